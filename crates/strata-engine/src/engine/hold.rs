//! Calls on a workspace that may not be attached here (a checkpoint, compaction, grow or
//! rollback of a detached workspace, and GC's compaction of detached workspaces) attach it for
//! their duration: a *hold*. A workspace attached by a user meanwhile (its attach returns the
//! same volume and claims it) stays attached when the call ends; one held by several calls is
//! detached when the last ends. A caller that goes away (an HTTP client that disconnects) lets
//! go of its hold all the same, so nothing stays attached by accident.

use super::*;

/// A hold taken; released by [`Hold::release`], or in the background if dropped.
struct Hold {
    engine: Option<Arc<Engine>>,
    tenant: String,
    ws: String,
}

impl Hold {
    async fn release(mut self) -> Result<()> {
        let e = self.engine.take().expect("a hold is released once");
        let (t, w) = (self.tenant.clone(), self.ws.clone());
        e.in_own_task(move |e| async move { e.release_hold(&t, &w).await })
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
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(err) = e.release_hold(&t, &w).await {
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
        let (v, hold) = self.hold(tenant, ws).await?;
        let r = f(&v).await;
        drop(v);
        hold.release().await?;
        r
    }

    /// Takes a hold in a task of its own: if the caller is gone by the time it is taken,
    /// the task lets go of it again.
    async fn hold(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<(Arc<Volume>, Hold)> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (e, t, w) = (self.clone(), tenant.to_string(), ws.to_string());
        tokio::spawn(async move {
            let r = e.take_hold(&t, &w).await;
            if let Err(Ok(_)) = tx.send(r) {
                if let Err(err) = e.release_hold(&t, &w).await {
                    tracing::warn!(tenant = %t, workspace = %w, error = %err, "detaching after an abandoned call failed");
                }
            }
        });
        let v = rx
            .await
            .map_err(|e| Error::Invalid(format!("engine task failed: {e}")))??;
        let hold = Hold {
            engine: Some(self.clone()),
            tenant: tenant.into(),
            ws: ws.into(),
        };
        Ok((v, hold))
    }

    async fn take_hold(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Arc<Volume>> {
        name::validate("workspace name", ws)?;
        let key = key(tenant, ws);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        match self.attach_locked(tenant, ws, &mut s, false, None).await {
            Ok(v) => {
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

    async fn release_hold(&self, tenant: &str, ws: &str) -> Result<()> {
        {
            let slot = self.slot(&key(tenant, ws));
            let mut s = slot.lock().await;
            if let Some(a) = s.as_mut() {
                a.holds = a.holds.saturating_sub(1);
            }
        }
        self.detach_if(tenant, ws, true).await.map(|_| ())
    }
}
