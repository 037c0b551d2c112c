//! The free-space floor of a node.
//!
//! Guest writes are refused (ENOSPC, for that request only) while the file system holding the
//! data directory has less than `min_free` bytes available. The node's own small writes (the
//! catalog's commits and lease renewals on the embedded default, `state.json`, segment
//! cleaning, retiring published segments) therefore always find room, so a full disk costs a
//! sandbox its new writes, never its lease, its flushes or its workspace. The availability is
//! sampled (statvfs) at most every second, and every few milliseconds once it gets close.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fs::Fs;
use crate::{Error, Result};

/// Re-sample this close to the floor.
const NEAR: u64 = 32 << 20;

pub(crate) struct SpaceGuard {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    min_free: u64,
    /// When last sampled, and what is left since (sampled minus writes admitted).
    sample: Mutex<Option<(Instant, u64)>>,
}

impl SpaceGuard {
    pub fn new(fs: Arc<dyn Fs>, dir: PathBuf, min_free: u64) -> SpaceGuard {
        SpaceGuard {
            fs,
            dir,
            min_free,
            sample: Mutex::new(None),
        }
    }

    /// Admits a write of `bytes`, or refuses it with [`Error::NoSpace`].
    pub fn admit(&self, bytes: u64) -> Result<()> {
        if self.min_free == 0 {
            return Ok(());
        }
        let mut s = self.sample.lock().unwrap_or_else(|p| p.into_inner());
        let need = self.min_free.saturating_add(bytes);
        let resample = match *s {
            None => true,
            Some((at, left)) => {
                let age = at.elapsed();
                age > Duration::from_secs(1)
                    || (left < need.saturating_add(NEAR) && age > Duration::from_millis(5))
            }
        };
        if resample {
            match self.fs.available(&self.dir) {
                Ok(Some(n)) => *s = Some((Instant::now(), n)),
                // Unknown (a simulated file system) or unreadable: never refuse on a guess.
                Ok(None) | Err(_) => return Ok(()),
            }
        }
        let Some((at, left)) = *s else { return Ok(()) };
        if left < need {
            return Err(Error::NoSpace(format!(
                "new data: {left} bytes are free on the node's disk and {} are kept for its own metadata",
                self.min_free
            )));
        }
        *s = Some((at, left - bytes));
        Ok(())
    }
}

/// The longest one write waits for its tenant's write rate (see `TenantBudget::pace`).
pub const PACE_MAX: Duration = Duration::from_secs(5);

/// How long a guest write past its tenant's journal quota waits for uploads to free room
/// before it gets ENOSPC.
pub const QUOTA_WAIT: Duration = Duration::from_secs(1);

/// One tenant's journal bytes on this node against its `local_journal_bytes` quota: a guest
/// write that would take the tenant past it waits up to [`QUOTA_WAIT`] for uploads to retire
/// published segments, then gets ENOSPC (that request only; the tenant's other writes and
/// every other tenant go on). Writes racing
/// on several of the tenant's volumes may pass it by at most one request each.
pub struct TenantBudget {
    /// `u64::MAX`: no limit.
    limit: std::sync::atomic::AtomicU64,
    /// Each attached volume's journal size (`Journal::held`).
    held: Mutex<Vec<std::sync::Weak<std::sync::atomic::AtomicU64>>>,
    /// Bytes a second the tenant may write into this node (`u64::MAX`: no limit), and its
    /// token bucket: (tokens, when last filled). See [`TenantBudget::pace`].
    rate: std::sync::atomic::AtomicU64,
    bucket: Mutex<(f64, Instant)>,
}

impl Default for TenantBudget {
    fn default() -> Self {
        TenantBudget {
            limit: std::sync::atomic::AtomicU64::new(u64::MAX),
            held: Mutex::default(),
            rate: std::sync::atomic::AtomicU64::new(u64::MAX),
            bucket: Mutex::new((0.0, Instant::now())),
        }
    }
}

impl TenantBudget {
    /// Sets the tenant's write rate on this node (bytes a second; `None`: unlimited).
    pub fn set_rate(&self, rate: Option<u64>) {
        self.rate.store(
            rate.filter(|r| *r > 0).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Charges `bytes` the tenant is writing into this node (a guest write, a relay file, a
    /// template upload) to its rate, and says how long the writer should wait first: a token
    /// bucket refilled at the rate, holding a quarter second of it (at least 1 MiB) for bursts.
    /// A tenant that writes as fast as the node can take it otherwise takes the disk and CPU
    /// every other tenant's FLUSH waits on. The charge is kept if the writer goes away.
    pub fn pace(&self, bytes: u64) -> Option<Duration> {
        let rate = self.rate.load(std::sync::atomic::Ordering::Relaxed);
        if rate == u64::MAX {
            return None;
        }
        let rate = rate as f64;
        let burst = (rate / 4.0).max((1u64 << 20) as f64);
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        b.0 = (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(burst);
        b.1 = now;
        b.0 -= bytes as f64;
        // One request waits at most `PACE_MAX` (its debt stays, and the tenant's next ones
        // pay it): a tiny rate never holds a request (and a detach that drains it) for days.
        (b.0 < 0.0).then(|| Duration::from_secs_f64(-b.0 / rate).min(PACE_MAX))
    }

    pub fn set_limit(&self, limit: Option<u64>) {
        self.limit.store(
            limit.unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    pub fn limit(&self) -> Option<u64> {
        Some(self.limit.load(std::sync::atomic::Ordering::Relaxed)).filter(|l| *l != u64::MAX)
    }

    /// Counts a volume's journal from now on (until the volume is gone).
    pub fn register(&self, held: &Arc<std::sync::atomic::AtomicU64>) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        h.retain(|w| w.strong_count() > 0);
        h.push(Arc::downgrade(held));
    }

    /// Journal bytes the tenant's attached volumes hold on this node.
    pub fn used(&self) -> u64 {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// Whether the tenant holds half its quota or more: its volumes then publish without
    /// waiting for their upload interval, and each cut seals the journal's active segment so
    /// that the publish can retire it (a segment is otherwise retired only once full, which a
    /// quota smaller than a segment would never let it be).
    pub fn pressed(&self) -> bool {
        self.limit()
            .is_some_and(|l| self.used().saturating_mul(2) >= l)
    }

    /// Admits a guest write of `bytes`, or refuses it with [`Error::NoSpace`].
    pub fn admit(&self, bytes: u64) -> Result<()> {
        let Some(limit) = self.limit() else {
            return Ok(());
        };
        let used = self.used();
        if used.saturating_add(bytes) > limit {
            return Err(Error::NoSpace(format!(
                "the tenant's local journal quota: {used} of {limit} bytes are held on this node until uploads free them"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41, item 6: a tenant's write rate on the node. A bucket a quarter second deep
    /// (at least 1 MiB): within it writes go at once, past it each waits what the rate says.
    #[test]
    fn the_write_rate_paces_a_tenant_past_its_burst() {
        let b = TenantBudget::default();
        assert_eq!(b.pace(1 << 30), None, "unlimited by default");
        b.set_rate(Some(8 << 20)); // 8 MiB/s: a 2 MiB burst
        b.pace(0);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(b.pace(2 << 20), None, "the burst");
        let wait = b.pace(4 << 20).expect("past the burst");
        assert!(
            wait > Duration::from_millis(450) && wait < Duration::from_millis(560),
            "{wait:?}"
        );
        b.set_rate(None);
        assert_eq!(b.pace(1 << 30), None);
    }
}
