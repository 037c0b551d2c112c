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
