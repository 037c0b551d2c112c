//! Calls on a workspace that may not be attached here (a checkpoint, compaction, grow or
//! rollback of a detached workspace, and GC's compaction of detached workspaces) attach it for
//! their duration: a *hold*. A workspace attached by a user meanwhile (its attach returns the
//! same volume and claims it) stays attached when the call ends; one held by several calls is
//! detached when the last ends. A caller that goes away (an HTTP client that disconnects) lets
//! go of its hold all the same, so nothing stays attached by accident.

use super::*;

/// In a volume's directory: attached only for calls (holds), never claimed by a user.
pub(crate) const HELD: &str = "held";

/// A user claimed the attachment: the mark goes, durably (a mark that came back after a
/// power cut would detach the user's workspace at the restart).
pub(crate) fn unmark(fs: &dyn crate::fs::Fs, dir: &std::path::Path) {
    let p = dir.join(HELD);
    if !fs.exists(&p) {
        return;
    }
    if let Err(e) = fs.remove(&p).and_then(|()| fs.sync_dir(dir)) {
        tracing::warn!(dir = %dir.display(), error = %e, "clearing a held mark");
    }
}

/// How long a detach after the last hold waits before trying again when it failed.
const RETRY_DETACH: std::time::Duration = std::time::Duration::from_secs(10);

/// A hold on one attachment (its volume); released by [`Hold::release`], or in the
/// background if dropped (wherever that happens: the caller's future, or the channel that
/// carried it to a caller who had gone).
struct Hold {
    engine: Option<Arc<Engine>>,
    vol: Arc<Volume>,
    tenant: String,
    ws: String,
}

impl Hold {
    async fn release(mut self) -> Result<()> {
        let e = self.engine.take().expect("a hold is released once");
        let (t, w, v) = (self.tenant.clone(), self.ws.clone(), self.vol.clone());
        e.in_own_task(move |e| async move { e.release_hold(&t, &w, &v).await })
            .await
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let Some(e) = self.engine.take() else {
            return;
        };
        let (t, w) = (
            std::mem::take(&mut self.tenant),
            std::mem::take(&mut self.ws),
        );
        let v = self.vol.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(err) = e.release_hold(&t, &w, &v).await {
                    tracing::warn!(tenant = %t, workspace = %w, error = %err, "detaching after an abandoned call failed");
                }
            });
        }
    }
}

impl Engine {
    /// Runs `f` on the workspace's volume, attaching it for the call if it is not attached
    /// (see the module docs). An error of the detach after the call is returned (its final
    /// publish failed: the volume stays attached, nothing is lost).
    pub(super) async fn with_volume<T>(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        f: impl AsyncFnOnce(&Volume) -> Result<T>,
    ) -> Result<T> {
        let hold = self.hold(tenant, ws).await?;
        let r = f(&hold.vol).await;
        hold.release().await?;
        r
    }

    /// Takes a hold in a task of its own; the hold travels back to the caller, so if the
    /// caller is gone it is dropped (and released) wherever it is.
    async fn hold(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Hold> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (e, t, w) = (self.clone(), tenant.to_string(), ws.to_string());
        tokio::spawn(async move {
            let r = e.take_hold(&t, &w).await.map(|vol| Hold {
                engine: Some(e.clone()),
                vol,
                tenant: t,
                ws: w,
            });
            let _ = tx.send(r);
        });
        rx.await
            .map_err(|e| Error::Invalid(format!("engine task failed: {e}")))?
    }

    async fn take_hold(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Arc<Volume>> {
        name::validate("workspace name", ws)?;
        let key = key(tenant, ws);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        let fresh = s.is_none();
        match self.attach_locked(tenant, ws, &mut s, false, None).await {
            Ok(v) => {
                if fresh {
                    // Attached only for calls: a restart must not resume it as a user's
                    // attachment (see `settle_held`).
                    if let Err(e) = self.fs.write_atomic(&v.dir().join(HELD), b"") {
                        tracing::warn!(tenant, workspace = ws, error = %e, "marking a held workspace");
                    }
                }
                if let Some(a) = s.as_mut() {
                    a.holds += 1;
                }
                Ok(v)
            }
            Err(e) => {
                drop(s);
                self.tidy_slot(&key, slot);
                Err(e)
            }
        }
    }

    /// Lets go of a hold on `vol`. One on an attachment since replaced (detached and attached
    /// again, or a failed volume replaced) has nothing left to let go of.
    async fn release_hold(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        vol: &Arc<Volume>,
    ) -> Result<()> {
        let k = key(tenant, ws);
        let slot = self.slot(&k);
        let mut s = slot.lock().await;
        match s.as_mut() {
            Some(a) if Arc::ptr_eq(&a.vol, vol) => a.holds = a.holds.saturating_sub(1),
            _ => {
                drop(s);
                self.tidy_slot(&k, slot);
                return Ok(());
            }
        }
        drop(s);
        let r = self.detach_if(tenant, ws, true).await.map(|_| ());
        if r.is_err() {
            self.retry_detach(tenant, ws, vol);
        }
        r
    }

    /// A detach after the last hold failed (its final publish: a store outage, say): nothing
    /// is lost, the volume stays attached, and it is tried again in the background until it
    /// is detached, claimed by a user, held again or replaced (otherwise it would keep its
    /// lease here for good, refusing attaches elsewhere).
    fn retry_detach(self: &Arc<Self>, tenant: &str, ws: &str, vol: &Arc<Volume>) {
        let e = self.clone();
        let (t, w, weak) = (tenant.to_string(), ws.to_string(), Arc::downgrade(vol));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RETRY_DETACH).await;
                let Some(v) = weak.upgrade() else { return };
                let current = e.volume(&t, &w).is_some_and(|c| Arc::ptr_eq(&c, &v));
                drop(v);
                if !current {
                    return;
                }
                match e.detach_if(&t, &w, true).await {
                    Ok(_) => return,
                    Err(err) => {
                        tracing::warn!(tenant = %t, workspace = %w, error = %err, "detaching after a call failed again; retrying")
                    }
                }
            }
        });
    }

    /// Whether this node's local state for the workspace is from an attachment only calls
    /// held (a restart came in the middle of one).
    pub fn was_held(&self, tenant: &str, ws: &str) -> bool {
        self.fs.exists(&self.volume_dir(tenant, ws).join(HELD))
    }

    /// After a restart, a workspace that was attached here only for calls: attached for a
    /// moment and detached, so anything its journal holds is published and the lease let go
    /// (instead of resuming it as if a user had attached it).
    pub async fn settle_held(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<()> {
        self.with_volume(tenant, ws, async |_| Ok(())).await
    }
}
