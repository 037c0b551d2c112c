//! Background work. The node renews the leases of all its attached volumes in one catalog call
//! per period (so the catalog's load stays flat however many workspaces a node holds: one
//! renewal per workspace per period was 128 fsync'd transactions a second for 64 workspaces
//! with a 2 s TTL, and under a heavy write load the renewals fell behind until leases ran out).
//! Each attached volume has its work loop: a prepared journal segment, segment cleaning,
//! window-bounded uploads and the publication of pending cuts, with backoff.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use strata_catalog::Catalog;

use super::{Engine, Slot};
use crate::volume::Volume;

/// Every quarter TTL, one renewal for every attached volume that still renews: three tries
/// before the local deadline (80% of the TTL). Ends when the engine is dropped.
pub(super) async fn renew_leases(engine: Weak<Engine>, ttl: Duration) {
    let every = (ttl / 4).max(Duration::from_millis(10));
    let ttl_ms = ttl.as_millis() as u64;
    loop {
        tokio::time::sleep(every).await;
        // Nothing of the engine is held between rounds: dropping it ends the loop.
        let (vols, catalog): (Vec<Arc<Volume>>, Arc<dyn Catalog>) = match engine.upgrade() {
            Some(e) => (e.attached_volumes(), e.catalog.clone()),
            None => return,
        };
        let (vols, batch): (Vec<_>, Vec<_>) = vols
            .into_iter()
            .filter_map(|v| v.renewal().map(|r| (v, r)))
            .unzip();
        if batch.is_empty() {
            continue;
        }
        let asked = Instant::now();
        match tokio::time::timeout(every, catalog.renew_leases(&batch, ttl_ms)).await {
            Ok(Ok(outcomes)) if outcomes.len() == vols.len() => {
                for (v, o) in vols.iter().zip(outcomes) {
                    if o.is_ok() && v.renewal().is_none() {
                        continue; // Stopped or closed meanwhile: the answer extends nothing.
                    }
                    if let Err(e) = v.renewed(asked, o) {
                        tracing::warn!(tenant = v.tenant(), workspace = v.name(), error = %e, "lease lost");
                    }
                }
            }
            Ok(Ok(outcomes)) => tracing::error!(
                asked = vols.len(),
                answered = outcomes.len(),
                "lease renewal: the catalog answered for a different number of leases"
            ),
            Ok(Err(e)) => {
                tracing::warn!(leases = vols.len(), error = %e, "lease renewal failed")
            }
            Err(_) => tracing::warn!(leases = vols.len(), "lease renewal timed out"),
        }
    }
}

pub(super) async fn work(vol: Weak<Volume>, interval: Duration, segment_max: u64) {
    let tick = (interval / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut backoff = Duration::ZERO;
    let Some(due) = vol.upgrade().map(|v| v.upload_due()) else {
        return;
    };
    loop {
        if backoff.is_zero() {
            // A writer past the window's byte bound wakes the uploader at once: a fast writer
            // must not run a whole tick ahead of its uploads (the journal would grow by as
            // much, and the next cut's fdatasync with it).
            tokio::select! {
                _ = tokio::time::sleep(tick) => {}
                _ = due.notified() => {}
            }
        } else {
            tokio::time::sleep(backoff).await;
        }
        let Some(v) = vol.upgrade() else { return };
        if let Some(why) = v.failure() {
            tracing::warn!(%why, "background uploads stop: the volume refuses writes; detach it");
            return;
        }
        if let Err(e) = v.prepare_journal().await {
            tracing::warn!(error = %e, "preparing a journal segment failed");
        }
        let r = v.maybe_upload().await;
        match r {
            Ok(_) => backoff = Duration::ZERO,
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
                tracing::warn!(error = %e, retry_in = ?backoff, "background upload failed");
            }
        }
        // A volume that publishes reclaims its journal by publishing (every segment a cut
        // covers retires), which moves each byte once; cleaning copies live bytes forward
        // locally and only pays where publishing will not: an ephemeral volume, uploads that
        // are failing, or a window below its byte bound (a large bound, or a long interval,
        // would otherwise let overwrites grow the journal until the next upload).
        if !v.publishes() || !backoff.is_zero() || !v.window_full() {
            if let Err(e) = v.clean_journal(4 * segment_max).await {
                tracing::warn!(error = %e, "journal cleaning failed");
            }
        }
    }
}

impl Engine {
    pub(super) fn attached_volumes(&self) -> Vec<Arc<Volume>> {
        let m = self.live.read().unwrap_or_else(|p| p.into_inner());
        m.values().cloned().collect()
    }

    /// Stops every volume's background work (lease renewal, uploads) while leaving it attached:
    /// what a paused or partitioned node looks like from outside. For fault tests.
    pub async fn stop_background(&self) {
        let slots: Vec<Slot> = {
            let m = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            m.values().cloned().collect()
        };
        for slot in slots {
            if let Some(a) = &*slot.lock().await {
                a.task.abort();
                a.vol.stop_renewal();
            }
        }
    }
}
