//! The write gate: freeze and thaw (an orchestrator's pause window), exclusive sections
//! (rollback), sealing for detach, and closing.
//!
//! Writers hold the gate shared while they append. Freeze holds it exclusively until thaw;
//! `exclusive` runs a section with no write in flight, inside a freeze if there is one. Lock
//! order: the freeze mutex before the gate, always.

use super::*;

impl Volume {
    /// Stops acknowledging new writes after draining those in flight (reads continue). Pair
    /// with a checkpoint and a VM memory snapshot, then [`Volume::thaw`]. Idempotent.
    pub async fn freeze(&self) {
        let mut f = self.freeze.lock().await;
        if f.is_none() {
            *f = Some(self.gate.clone().write_owned().await);
            self.frozen_flag.store(true, SeqCst);
        }
    }

    pub async fn thaw(&self) {
        let mut f = self.freeze.lock().await;
        self.frozen_flag.store(false, SeqCst);
        f.take();
    }

    pub fn is_frozen(&self) -> bool {
        self.frozen_flag.load(SeqCst)
    }

    /// Runs `f` with no write in flight and none starting: under the freeze if the volume is
    /// frozen (its gate is already held), otherwise under the gate taken exclusively. Thaw and
    /// freeze wait until `f` returns.
    pub(crate) async fn exclusive<T>(&self, f: impl AsyncFnOnce() -> T) -> T {
        let frozen = self.freeze.lock().await;
        let _gate = match &*frozen {
            Some(_) => None,
            None => Some(self.gate.write().await),
        };
        f().await
    }

    /// Refuses every later write, after draining those in flight (detach: the final cut then
    /// covers every write ever acknowledged). Reads, flushes and publishes go on.
    pub(crate) async fn seal(&self) {
        self.exclusive(async || self.sealed.store(true, SeqCst))
            .await
    }

    /// Waits for a cut, publish, rollback or compaction running in its own task to finish (a volume
    /// being replaced must not retire segments in a directory its successor opened).
    pub(crate) async fn quiesce(&self) {
        drop(self.cut_lock.lock().await);
        drop(self.publish_lock.lock().await);
    }

    /// Undoes [`Volume::seal`] (a detach whose final publish failed keeps the volume).
    pub(crate) fn unseal(&self) {
        self.sealed.store(false, SeqCst);
    }

    /// Marks the volume closed: later I/O fails. Used by detach after the final publish.
    pub(crate) fn close(&self) {
        self.sealed.store(true, SeqCst);
        self.closed.store(true, SeqCst);
    }
}
