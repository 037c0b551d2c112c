//! Each attached volume's background work: lease renewal in a loop of its own, and the work
//! loop (a prepared journal segment, segment cleaning, window-bounded uploads and the
//! publication of pending cuts, with backoff).

use std::sync::Weak;
use std::time::Duration;

use crate::volume::Volume;

pub(super) async fn background(
    vol: Weak<Volume>,
    interval: Duration,
    ttl: Duration,
    segment_max: u64,
) {
    tokio::join!(renew(vol.clone(), ttl), work(vol, interval, segment_max));
}

async fn renew(vol: Weak<Volume>, ttl: Duration) {
    // Three tries before the local deadline (80% of the TTL).
    let every = (ttl / 4).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(every).await;
        let Some(v) = vol.upgrade() else { return };
        if v.failure().is_some() {
            return; // Fenced or failed for good: nothing left to renew.
        }
        match tokio::time::timeout(every, v.renew_lease()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(workspace = v.name(), error = %e, "lease renewal failed"),
            Err(_) => tracing::warn!(workspace = v.name(), "lease renewal timed out"),
        }
    }
}

async fn work(vol: Weak<Volume>, interval: Duration, segment_max: u64) {
    let tick = (interval / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut backoff = Duration::ZERO;
    loop {
        tokio::time::sleep(tick + backoff).await;
        let Some(v) = vol.upgrade() else { return };
        if let Some(why) = v.failure() {
            tracing::warn!(workspace = v.name(), %why, "background uploads stop: the volume refuses writes; detach it");
            return;
        }
        if let Err(e) = v.prepare_journal().await {
            tracing::warn!(workspace = v.name(), error = %e, "preparing a journal segment failed");
        }
        if let Err(e) = v.clean_journal(4 * segment_max).await {
            tracing::warn!(workspace = v.name(), error = %e, "journal cleaning failed");
        }
        match v.maybe_upload().await {
            Ok(_) => backoff = Duration::ZERO,
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
                tracing::warn!(workspace = v.name(), error = %e, retry_in = ?backoff, "background upload failed");
            }
        }
    }
}
