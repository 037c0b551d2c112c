//! Attaching a workspace on this node: its slot, the workspace's lock file (one process per
//! journal), the lease, replay of the local journal, and the background task.

use super::*;

impl Engine {
    /// Attaches a workspace on this node (idempotent): takes the lease, replays any local
    /// journal, and starts background uploads and lease renewal. Only this workspace's other
    /// operations wait for it.
    pub async fn attach(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Arc<Volume>> {
        let (t, w) = (tenant.to_string(), ws.to_string());
        self.in_own_task(move |e| async move { e.attach_now(&t, &w).await })
            .await
    }

    pub(super) async fn attach_now(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
    ) -> Result<Arc<Volume>> {
        name::validate("workspace name", ws)?;
        let key = key(tenant, ws);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        let r = self.attach_locked(tenant, ws, &mut s, true, None).await;
        if r.is_err() {
            drop(s);
            self.tidy_slot(&key, slot);
        }
        r
    }

    /// Attach under the workspace's slot lock. `claim`: asked for by a user (a live fork is
    /// attached unclaimed, and let go once it has published unless someone claims it).
    pub(super) async fn attach_locked(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        s: &mut Option<Attached>,
        mut claim: bool,
        inherit: Option<crate::volume::Inheritance>,
    ) -> Result<Arc<Volume>> {
        let key = key(tenant, ws);
        if let Some(a) = s.as_mut() {
            if a.vol.failure().is_none() {
                if claim && !a.claimed {
                    a.claimed = true;
                    hold::unmark(&*self.fs, a.vol.dir());
                }
                return Ok(a.vol.clone());
            }
            // Fenced (another node took the lease) or failed for good: attaching again starts
            // over from the head rather than handing out a volume that refuses everything.
            if let Some(old) = s.take() {
                // A user's claim survives the replacement (a call's hold does not carry over:
                // it belongs to the failed volume, see `engine/hold.rs`).
                claim |= old.claimed;
                tracing::info!(tenant, workspace = ws, why = ?old.vol.failure(), "replacing a failed volume");
                // Its writes in flight (one parked in a read-modify-write, one landing outside
                // the lock) end first, as for a detach or delete: one appended after the
                // successor replayed the same journal would sit where the successor's records
                // go, and the next replay would stop there.
                old.vol.seal().await;
                old.task.abort();
                old.vol.close();
                old.vol.quiesce().await;
            }
            self.set_live(&key, None);
        }
        let owner = self.lock_workspace(tenant, ws)?;
        if inherit.is_none() {
            // (A live fork attached by the fork itself keeps its marker: `engine/fork.rs`.)
            self.settle_fork_marker(tenant, ws).await?;
        }
        let ttl = self.cfg.lease_ttl.as_millis() as u64;
        // Whether a failed open may let go of the lease (below): not over a journal of ours,
        // nor when taking over another node's expired lease (its journal may still apply).
        let had_state = self.has_local_state(tenant, ws);
        let before = self.catalog.get_lease(tenant, ws).await?;
        let takeover = before.holder.as_ref().is_some_and(|h| *h != self.node);
        let lease_asked = Instant::now();
        let lease = self
            .catalog
            .acquire_lease(tenant, ws, &self.node, ttl)
            .await?;
        let budget = self.budget(tenant);
        // The quota as the catalog has it now (a row this version cannot read: as before).
        if let Ok(t) = self.catalog.get_tenant(tenant).await {
            budget.set_limit(t.quotas.local_journal_bytes);
        }
        let opened = Volume::open(VolumeParts {
            lease_asked,
            tenant: tenant.into(),
            name: ws.into(),
            dir: self.volume_dir(tenant, ws),
            fs: self.fs.clone(),
            reader: self.reader.clone(),
            catalog: self.catalog.clone(),
            lease: lease.clone(),
            opts: self.opts(),
            space: self.space.clone(),
            budget,
            inherit,
        })
        .await;
        let vol = match opened {
            Ok(v) => v,
            Err(e) => {
                // A journal here (its writes may be flushed and unpublished), or another
                // node's behind the expired lease this took over, keeps the lease until it
                // expires: released, it would read as a clean detach, and GC may compact the
                // head under that journal (which its next attach would have to discard).
                if !had_state && !takeover {
                    let _ = self.catalog.release_lease(tenant, ws, &lease).await;
                }
                return Err(e);
            }
        };
        if claim {
            hold::unmark(&*self.fs, vol.dir());
        }
        let task = self.spawn_background(&vol);
        *s = Some(Attached {
            vol: vol.clone(),
            task,
            claimed: claim,
            holds: 0,
            _owner: owner,
        });
        self.set_live(&key, Some(vol.clone()));
        if let Some(src) = vol.adopt_source().and_then(|s| self.volume(tenant, &s)) {
            vol.set_adopt_source(&src);
        }
        tracing::info!(tenant, workspace = ws, epoch = lease.epoch, "attached");
        if vol.is_live_fork() {
            // Its data is only here: published at once (and let go of unless claimed).
            self.release_when_published(tenant, ws);
        }
        Ok(vol)
    }

    /// Every volume attached on this node.
    pub fn attached(&self) -> Vec<Arc<Volume>> {
        let m = self.live.read().unwrap_or_else(|p| p.into_inner());
        m.values().cloned().collect()
    }

    pub fn volume(&self, tenant: &str, ws: &str) -> Option<Arc<Volume>> {
        let m = self.live.read().unwrap_or_else(|p| p.into_inner());
        m.get(&key(tenant, ws)).cloned()
    }

    /// Takes the workspace's lock file for this process (see [`Attached`]), or says which
    /// process on this data directory has it attached.
    pub(crate) fn lock_workspace(&self, tenant: &str, ws: &str) -> Result<crate::fs::FileLock> {
        name::validate("tenant name", tenant)?;
        name::validate("workspace name", ws)?;
        let path = self.cfg.data_dir.join("locks").join(tenant).join(ws);
        match self.fs.lock_exclusive(&path) {
            Ok(Ok(l)) => Ok(l),
            Ok(Err(who)) => Err(Error::Catalog(CatalogError::InUse(format!(
                "workspace {ws:?} is attached by another process on this data directory ({}): \
                 stop it, or run one daemon (`strata serve`) and send it every request",
                if who.is_empty() {
                    "pid unknown"
                } else {
                    who.as_str()
                }
            )))),
            Err(e) => Err(Error::io("locking the workspace")(e)),
        }
    }

    /// Whether this node keeps local state (a journal, perhaps unpublished writes) for a
    /// workspace, attached or not: left by a process that stopped without detaching it.
    pub fn has_local_state(&self, tenant: &str, ws: &str) -> bool {
        name::validate("workspace name", ws).is_ok()
            && name::validate("tenant name", tenant).is_ok()
            && self
                .fs
                .exists(&self.volume_dir(tenant, ws).join("state.json"))
    }
}
