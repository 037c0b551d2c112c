//! The volume's side of its lease: the local deadline past which it acknowledges nothing, and
//! the outcome of a renewal. The node renews every attached volume's lease in one catalog call
//! (`engine/background.rs`); a single volume can also renew its own.

use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use strata_catalog::{CatalogError, LeaseRenewal};

use super::{lock, Volume};
use crate::{Error, Result};

/// The local end of a lease of `ttl` requested at `asked`: 80% of the TTL, leaving a margin for
/// clock-rate drift and for a write already past the check when the deadline falls.
pub(crate) fn lease_deadline(asked: Instant, ttl: Duration) -> Instant {
    asked + ttl.mul_f64(0.8)
}

impl Volume {
    /// Refuses to acknowledge a write or flush once the local lease deadline has passed: by
    /// then another node may be allowed to take the workspace over.
    pub(super) fn lease_valid(&self) -> Result<()> {
        let d = *lock(&self.lease_deadline);
        let now = Instant::now();
        if now >= d {
            return Err(Error::Unavailable(
                self.name.clone(),
                format!(
                    "lease not renewed for {} ms past its safe end (catalog unreachable or node paused); writes are refused until renewal succeeds",
                    now.duration_since(d).as_millis()
                ),
            ));
        }
        Ok(())
    }

    /// Whether the lease is still locally valid (the `nodes` view and tests).
    pub fn lease_ok(&self) -> bool {
        self.lease_valid().is_ok()
    }

    /// The lease the node should renew now, or `None` once there is nothing to renew: failed
    /// or fenced for good, or renewal stopped.
    pub(crate) fn renewal(&self) -> Option<LeaseRenewal> {
        if self.renewal_stopped.load(SeqCst) || self.failure().is_some() || self.closed.load(SeqCst)
        {
            return None;
        }
        Some(LeaseRenewal {
            tenant: self.tenant.clone(),
            workspace: self.name.clone(),
            lease: self.lease(),
        })
    }

    /// Stops renewing (what a paused or partitioned node looks like; fault tests).
    pub(crate) fn stop_renewal(&self) {
        self.renewal_stopped.store(true, SeqCst);
    }

    /// Applies the catalog's answer to a renewal sent at `asked`: extends the local deadline
    /// from that moment (never from the reply's), or fails the volume for good if fenced.
    pub(crate) fn renewed(&self, asked: Instant, outcome: Result<(), CatalogError>) -> Result<()> {
        match outcome {
            Ok(()) => {
                let ttl = self.opts.lease_ttl;
                lock(&self.lease).expires_ms = crate::now_ms() + ttl.as_millis() as u64;
                let d = lease_deadline(asked, ttl);
                let mut cur = lock(&self.lease_deadline);
                *cur = (*cur).max(d);
                Ok(())
            }
            Err(e @ CatalogError::Fenced { .. }) => {
                self.fail(e.to_string());
                Err(e.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Renews this volume's lease alone; on failure the volume stops acknowledging writes.
    pub async fn renew_lease(&self) -> Result<()> {
        let g = self.lease();
        let asked = Instant::now();
        let ttl = self.opts.lease_ttl.as_millis() as u64;
        let r = self
            .catalog
            .renew_lease(&self.tenant, &self.name, &g, ttl)
            .await;
        self.renewed(asked, r)
    }
}
