//! Letting go of a workspace on this node: detach (final publish, then the lease), abandon
//! (as a crash would), delete (on purpose: its data goes).

use super::*;

impl Engine {
    /// Detaches: refuses new writes after draining those in flight, publishes what is
    /// unpublished (durable and sync; an ephemeral workspace's unpublished writes are discarded
    /// on purpose), releases the lease, removes local state. Every write acknowledged before
    /// the call is in the published head; a write that arrives later gets an error, never an
    /// acknowledgement that is then thrown away. If the final publish fails, the volume stays
    /// attached and writable.
    pub async fn detach(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Option<Published>> {
        let (t, w) = (tenant.to_string(), ws.to_string());
        self.in_own_task(move |e| async move { e.detach_now(&t, &w).await })
            .await
    }

    async fn detach_now(&self, tenant: &str, ws: &str) -> Result<Option<Published>> {
        self.detach_if(tenant, ws, false).await
    }

    /// Detaches (see [`Engine::detach`]); with `only_unclaimed`, only a volume nobody asked for
    /// (a live fork that has published), and otherwise nothing.
    pub(super) async fn detach_if(
        &self,
        tenant: &str,
        ws: &str,
        only_unclaimed: bool,
    ) -> Result<Option<Published>> {
        let key = key(tenant, ws);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        if only_unclaimed && s.as_ref().is_none_or(|a| a.claimed || a.holds > 0) {
            drop(s);
            self.tidy_slot(&key, slot);
            return Ok(None);
        }
        let Some(a) = s.take() else {
            drop(s);
            self.tidy_slot(&key, slot);
            return Err(Error::Invalid(format!(
                "workspace {ws:?} is not attached on this node"
            )));
        };
        let vol = a.vol.clone();
        vol.seal().await;
        let published = if vol.mode() == Mode::Ephemeral {
            // Unpublished writes are discarded on purpose, but not the local checkpoints a
            // user was given receipts for.
            if let Err(e) = vol.publish_pending().await {
                vol.unseal();
                *s = Some(a);
                return Err(e);
            }
            None
        } else {
            match vol.publish_kind(CheckpointKind::Detach).await {
                Ok(p) => Some(p),
                Err(e) => {
                    // Keep it attached: nothing may be lost.
                    vol.unseal();
                    *s = Some(a);
                    return Err(e);
                }
            }
        };
        a.task.abort();
        let _ = a.task.await;
        vol.close();
        // A publish started before the close (a checkpoint's) ends before the directory goes.
        vol.quiesce().await;
        self.set_live(&key, None);
        let res = self.remove_volume_dir(vol.dir()).await;
        let released = self.catalog.release_lease(tenant, ws, &vol.lease()).await;
        // The workspace's lock goes before the slot's: an attach waiting on the slot takes it
        // next, and from this process a lock still open would refuse it.
        drop(a.vol);
        drop(a._owner);
        drop(s);
        self.tidy_slot(&key, slot);
        res?;
        released?;
        Ok(published)
    }

    /// Drops every attached volume without publishing or releasing leases, as a crash would
    /// (tests), or before a restart that resumes them.
    pub async fn abandon(&self) {
        let slots: Vec<(Key, Slot)> = {
            let m = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            m.iter().map(|(k, s)| (k.clone(), s.clone())).collect()
        };
        for (k, slot) in slots {
            if let Some(a) = slot.lock().await.take() {
                a.task.abort();
                a.vol.close();
                // A publish still running in its own task ends first (closed, it starts no
                // other): the next process must not find this one still writing. Bounded: a
                // store that hangs must not hang a shutdown.
                let quiet = tokio::time::timeout(Duration::from_secs(10), a.vol.quiesce()).await;
                if quiet.is_err() {
                    // Still writing: the workspace's lock stays held until this process ends,
                    // so no other process opens the journal under it.
                    std::mem::forget(a._owner);
                }
            }
            self.set_live(&k, None);
        }
    }

    /// Deletes a workspace (on purpose: its data goes). If attached here, new writes are
    /// refused and in-flight ones drained first, so nothing is acknowledged into a journal
    /// about to be removed.
    pub async fn delete_workspace(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<()> {
        let (t, w) = (tenant.to_string(), ws.to_string());
        self.in_own_task(move |e| async move { e.delete_now(&t, &w).await })
            .await
    }

    async fn delete_now(&self, tenant: &str, ws: &str) -> Result<()> {
        let key = key(tenant, ws);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        let res = async {
            // Not attached here: it may be attached by another process on this data
            // directory (its lease reads as this node's); its journal is not removed under it.
            let _owner = match s.as_ref() {
                None => Some(self.lock_workspace(tenant, ws)?),
                Some(_) => None,
            };
            if let Some(a) = s.take() {
                a.vol.seal().await;
                a.task.abort();
                let _ = a.task.await;
                a.vol.close();
                a.vol.quiesce().await;
                self.set_live(&key, None);
                self.catalog
                    .release_lease(tenant, ws, &a.vol.lease())
                    .await?;
            }
            self.catalog.delete_workspace(tenant, ws).await?;
            self.remove_volume_dir(&self.volume_dir(tenant, ws)).await
        }
        .await;
        drop(s);
        self.tidy_slot(&key, slot);
        res
    }

    /// Removes a detached volume's directory. Background work of the volume that was already
    /// running off the runtime when its task was aborted (a segment being cleaned forward, a
    /// retired one renamed) may still add a file for a moment: the removal is retried until
    /// the directory is gone (found in the nemesis: "Directory not empty" failed a detach).
    pub(super) async fn remove_volume_dir(&self, dir: &std::path::Path) -> Result<()> {
        let mut tries = 0;
        loop {
            match self.fs.remove_dir_all(dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty && tries < 250 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => return Err(Error::io("removing local volume state")(e)),
            }
        }
    }
}
