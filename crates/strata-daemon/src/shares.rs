//! Per-tenant shares of what one node has: no tenant holds more than its share of a resource
//! every tenant on the node draws from, so one that misbehaves (idle uploads, slow readers, a
//! flood of mounts or connections) runs out of its own share and nobody else's.
//!
//! A [`Share`] is held for as long as the resource is (a spool file, a mount, a connection)
//! and returned when dropped, also when the request holding it is cancelled. A request past
//! its tenant's share is refused at once with `429 busy` (retryable), never queued behind the
//! tenant's other requests: a waiting request would hold what it already took.
//!
//! Node-wide limits stay where they were (the mount table, the template build slots); shares
//! bound one tenant's part of them. Defaults fit a node of a few dozen tenants; an operator
//! changes them with `serve` flags (docs/ARCHITECTURE.md, "Tenants on one node").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use crate::error::ApiError;

/// What a share counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// Template uploads being received or converted (each spools up to `template_max_bytes`).
    TemplateUploads,
    /// Bytes of relay files spooled on this node to answer GETs still being sent.
    RelaySpoolBytes,
    /// Workspaces mounted on this host (`ws mount`), kernel NBD devices among them.
    Mounts,
    /// Requests of the tenant in the daemon at once (each may hold memory, a task, a
    /// connection).
    Requests,
    /// Bytes of relay files being received (counted against the tenant's relay quota, which
    /// the daemon checks; no share of its own).
    RelayReceiving,
}

impl Kind {
    fn what(self) -> &'static str {
        match self {
            Kind::TemplateUploads => "template uploads",
            Kind::RelaySpoolBytes => "bytes of relay files being sent",
            Kind::Mounts => "mounts",
            Kind::Requests => "requests in flight",
            Kind::RelayReceiving => "relay bytes being received",
        }
    }
}

/// The most one tenant may hold on one node, per [`Kind`].
#[derive(Clone, Copy, Debug)]
pub struct ShareLimits {
    pub template_uploads: u64,
    pub relay_spool_bytes: u64,
    pub mounts: u64,
    pub requests: u64,
    /// NBD connections one export serves at once (each may hold up to 64 MiB of requests).
    pub nbd_connections: u64,
    /// Workspaces attached (or mounted) on the node, unless the tenant's
    /// `attached_per_node` quota says otherwise.
    pub attached: u64,
    /// Bytes of NBD requests in flight over all of a tenant's exports on the node (at least
    /// the largest request, 32 MiB).
    pub inflight_bytes: u64,
    /// Bytes a second a tenant may write into the node: guest writes on every front-end,
    /// relay files, template uploads (0: unlimited, the default; `Engine::pace`).
    pub write_rate: u64,
    /// Requests that change something (POST, PUT, DELETE: attaches, detaches, checkpoints,
    /// forks, relay files…) a second, with a second's worth as a burst (0: unlimited, the
    /// default). Each costs the node catalog commits and fsyncs every tenant's FLUSH shares.
    pub ops_rate: u64,
}

impl Default for ShareLimits {
    fn default() -> Self {
        ShareLimits {
            template_uploads: 2,
            relay_spool_bytes: 256 << 20,
            mounts: 32,
            requests: 256,
            nbd_connections: 16,
            attached: 64,
            inflight_bytes: 256 << 20,
            write_rate: 0,
            ops_rate: 0,
        }
    }
}

impl ShareLimits {
    /// The NBD servers of `tenant`'s exports on a node share this budget of bytes in flight.
    pub(crate) fn inflight_budget(&self) -> usize {
        self.inflight_bytes.max(32 << 20) as usize
    }

    fn of(&self, k: Kind) -> u64 {
        match k {
            Kind::TemplateUploads => self.template_uploads,
            Kind::RelaySpoolBytes => self.relay_spool_bytes,
            Kind::Mounts => self.mounts,
            Kind::Requests => self.requests,
            Kind::RelayReceiving => u64::MAX,
        }
    }
}

/// Every tenant's use of every [`Kind`] on this node.
pub(crate) struct Shares {
    limits: ShareLimits,
    used: Mutex<HashMap<(String, Kind), u64>>,
    /// Each tenant's NBD budget of bytes in flight, shared by its exports' servers (dropped
    /// with the tenant).
    nbd_budgets: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// Each tenant's bucket of requests that change something ([`ShareLimits::ops_rate`]).
    ops: Mutex<HashMap<String, Arc<Mutex<Bucket>>>>,
}

/// A token bucket: (tokens, when last filled).
type Bucket = (f64, std::time::Instant);

/// The longest a request waits for its tenant's [`ShareLimits::ops_rate`]; past it, `429`.
const OPS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Shares {
    pub fn new(limits: ShareLimits) -> Arc<Shares> {
        Arc::new(Shares {
            limits,
            used: Mutex::default(),
            nbd_budgets: Mutex::default(),
            ops: Mutex::default(),
        })
    }

    pub fn limits(&self) -> &ShareLimits {
        &self.limits
    }

    /// Takes `n` of `kind` for `tenant`, or refuses with `429 busy` if that would take the
    /// tenant past its share. A request for more than the whole share is admitted only while
    /// the tenant holds none of the kind (so it is bounded by one such request).
    pub fn take(self: &Arc<Self>, tenant: &str, kind: Kind, n: u64) -> Result<Share, ApiError> {
        let limit = self.limits.of(kind);
        let key = (tenant.to_string(), kind);
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let u = used.get(&key).copied().unwrap_or(0);
        // One piece larger than the whole share (a relay file over the spool share) is still
        // admitted while the tenant holds nothing else of the kind: it would never fit, and
        // its tenant's file would be unreadable for ever. Nothing (n = 0) always fits.
        let over = if u == 0 {
            limit == 0
        } else {
            u.saturating_add(n) > limit
        };
        if n > 0 && over {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "busy",
                format!(
                    "the tenant holds {u} of its {limit} {} on this node; retry when some are done",
                    kind.what()
                ),
            );
            e.retryable = true;
            return Err(e);
        }
        *used.entry(key.clone()).or_default() += n;
        Ok(Share {
            shares: self.clone(),
            key,
            n,
        })
    }

    /// Counts `n` of `kind` for `tenant` whatever its share: for what the node holds already
    /// (a mount brought back after a restart), which is never refused.
    pub fn take_over(self: &Arc<Self>, tenant: &str, kind: Kind, n: u64) -> Share {
        let key = (tenant.to_string(), kind);
        *self
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_default() += n;
        Share {
            shares: self.clone(),
            key,
            n,
        }
    }

    /// The budget of bytes in flight every NBD export of `tenant` on this node shares.
    pub fn nbd_budget(&self, tenant: &str) -> Arc<tokio::sync::Semaphore> {
        self.nbd_budgets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.limits.inflight_budget())))
            .clone()
    }

    /// Forgets a deleted tenant's budgets.
    pub fn forget_tenant(&self, tenant: &str) {
        self.nbd_budgets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(tenant);
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(tenant);
    }

    /// Paces a request of `tenant` that changes something to [`ShareLimits::ops_rate`] (a
    /// token bucket a second deep): how long it waits first, or `429 busy` if that would be
    /// longer than [`OPS_WAIT`] (its charge then given back).
    pub fn pace_op(&self, tenant: &str) -> Result<Option<std::time::Duration>, ApiError> {
        if self.limits.ops_rate == 0 {
            return Ok(None);
        }
        let rate = self.limits.ops_rate as f64;
        let bucket = self
            .ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(Mutex::new((rate, std::time::Instant::now()))))
            .clone();
        let mut b = bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        b.0 = (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(rate.max(1.0));
        b.1 = now;
        b.0 -= 1.0;
        if b.0 >= 0.0 {
            return Ok(None);
        }
        let wait = std::time::Duration::from_secs_f64(-b.0 / rate);
        if wait > OPS_WAIT {
            b.0 += 1.0;
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "busy",
                format!(
                    "the tenant makes more than its {} changes a second on this node; retry later",
                    self.limits.ops_rate
                ),
            );
            e.retryable = true;
            return Err(e);
        }
        Ok(Some(wait))
    }

    /// What `tenant` holds of `kind` now.
    pub fn used(&self, tenant: &str, kind: Kind) -> u64 {
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(tenant.to_string(), kind))
            .copied()
            .unwrap_or(0)
    }
}

/// A part of a tenant's share, given back when dropped.
pub(crate) struct Share {
    shares: Arc<Shares>,
    key: (String, Kind),
    n: u64,
}

impl Share {
    /// Counts `n` more in this share whatever the limit (see [`Shares::take_over`]).
    pub fn add(&mut self, n: u64) {
        *self
            .shares
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(self.key.clone())
            .or_default() += n;
        self.n += n;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut used = self.shares.used.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = used.get_mut(&self.key) {
            *u = u.saturating_sub(self.n);
            if *u == 0 {
                used.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_is_refused_past_its_share_and_others_are_not() {
        let s = Shares::new(ShareLimits {
            template_uploads: 2,
            ..ShareLimits::default()
        });
        let a1 = s.take("a", Kind::TemplateUploads, 1).unwrap();
        let _a2 = s.take("a", Kind::TemplateUploads, 1).unwrap();
        let e = s.take("a", Kind::TemplateUploads, 1).err().unwrap();
        assert_eq!(
            (e.status, e.kind, e.retryable),
            (StatusCode::TOO_MANY_REQUESTS, "busy", true)
        );
        let _b = s.take("b", Kind::TemplateUploads, 1).unwrap();
        drop(a1);
        let _a3 = s.take("a", Kind::TemplateUploads, 1).unwrap();
        assert_eq!(s.used("a", Kind::TemplateUploads), 2);
    }

    #[test]
    fn shares_count_bytes_and_return_everything_when_dropped() {
        let s = Shares::new(ShareLimits {
            relay_spool_bytes: 100,
            ..ShareLimits::default()
        });
        let a = s.take("a", Kind::RelaySpoolBytes, 40).unwrap();
        let b = s.take("a", Kind::RelaySpoolBytes, 50).unwrap();
        assert!(s.take("a", Kind::RelaySpoolBytes, 11).is_err());
        // More than the whole share: only while the tenant holds none.
        assert!(s.take("a", Kind::RelaySpoolBytes, 500).is_err());
        let big = s.take("b", Kind::RelaySpoolBytes, 500).unwrap();
        assert!(s.take("b", Kind::RelaySpoolBytes, 1).is_err());
        drop(big);
        let mut over = s.take_over("a", Kind::RelaySpoolBytes, 0);
        over.add(30);
        assert_eq!(s.used("a", Kind::RelaySpoolBytes), 120);
        drop((a, b, over));
        assert_eq!(s.used("a", Kind::RelaySpoolBytes), 0);
        assert!(
            s.used.lock().unwrap().is_empty(),
            "no entry left for a tenant holding none"
        );
    }
}
