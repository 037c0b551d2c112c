//! Forks of a live workspace in constant time, whatever is dirty.
//!
//! The source takes a local checkpoint whose cut seals its journal; the fork's journal gets
//! hard links to the sealed segments holding everything after the source's published base
//! (shared read-only: a segment with two names is never recycled, only unlinked, so neither
//! side ever overwrites what the other reads). The fork's version 1 is that published base
//! (kind `livefork`), its local state says its journal replays on top of it, and it is attached
//! on this node at once (its writes go to its own new segments). It then publishes its data as
//! version 2 in the background and, unless someone attached it meanwhile, lets go of it.
//!
//! Until that publish, only this node has the fork's data: `Volume::open` refuses a `livefork`
//! head without the matching local state, so another node never serves the stale base (if
//! this node is lost first, the fork is lost with it: delete it).
//!
//! Crash safety: `forking.json` marks a fork directory until the fork's catalog row exists.
//! An attach that finds the marker keeps the directory if the catalog has the fork (at its
//! `livefork` version 1) and removes it otherwise (a fork that never completed).

use super::*;
use crate::local::LocalState;

const MARKER: &str = "forking.json";

impl Engine {
    /// Forks the live workspace `src` (its volume `vol`, attached here) into `new`. Err(local
    /// version) when the fork cannot share the journal here: the caller forks that local
    /// checkpoint once it is published.
    pub(super) async fn fork_live(
        self: &Arc<Self>,
        tenant: &str,
        vol: Arc<Volume>,
        src: &str,
        new: &str,
        mode: Mode,
    ) -> Result<std::result::Result<Workspace, u64>> {
        let (t, s, n) = (tenant.to_string(), src.to_string(), new.to_string());
        self.in_own_task(move |e| async move { e.fork_live_now(&t, vol, &s, &n, mode).await })
            .await
    }

    async fn fork_live_now(
        self: &Arc<Self>,
        tenant: &str,
        vol: Arc<Volume>,
        src: &str,
        new: &str,
        mode: Mode,
    ) -> Result<std::result::Result<Workspace, u64>> {
        name::validate("workspace name", new)?;
        let key = key(tenant, new);
        let slot = self.slot(&key);
        let mut s = slot.lock().await;
        let r = self
            .fork_live_locked(tenant, &vol, src, new, mode, &mut s)
            .await;
        let keep = matches!(r, Ok(Ok(_)));
        drop(s);
        if !keep {
            self.tidy_slot(&key, slot);
        }
        if let Ok(Ok(_)) = &r {
            self.release_when_published(tenant, new);
        }
        r
    }

    async fn fork_live_locked(
        self: &Arc<Self>,
        tenant: &str,
        vol: &Arc<Volume>,
        src: &str,
        new: &str,
        mode: Mode,
        s: &mut Option<Attached>,
    ) -> Result<std::result::Result<Workspace, u64>> {
        let exists = || {
            Error::Catalog(CatalogError::AlreadyExists {
                what: "workspace",
                name: new.to_string(),
            })
        };
        if s.is_some() {
            return Err(exists());
        }
        match self.catalog.get_workspace(tenant, new).await {
            Ok(_) => return Err(exists()),
            Err(CatalogError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        // A directory left for this name by a workspace that no longer exists.
        let dir = self.volume_dir(tenant, new);
        self.remove_volume_dir(&dir).await?;
        let journal_id = crate::local::new_journal_id();
        let (fs, d, j) = (self.fs.clone(), dir.clone(), journal_id.clone());
        blocking(move || {
            fs.create_dir_all(&d)
                .map_err(Error::io("making the fork's directory"))?;
            if let Some(parent) = d.parent() {
                fs.sync_dir(parent)
                    .map_err(Error::io("syncing the fork's parent"))?;
            }
            fs.write_atomic(&d.join(MARKER), j.as_bytes())
                .map_err(Error::io("marking the fork's directory"))
        })
        .await?;
        let made = self
            .make_fork(tenant, vol, src, new, mode, &dir, &journal_id)
            .await;
        match made {
            Ok(Ok(w)) => {
                let (fs, d) = (self.fs.clone(), dir.clone());
                blocking(move || {
                    fs.remove(&d.join(MARKER))
                        .and_then(|_| fs.sync_dir(&d))
                        .map_err(Error::io("completing the fork's directory"))
                })
                .await?;
                self.attach_locked(tenant, new, s, false).await?;
                Ok(Ok(w))
            }
            other => {
                if let Err(e) = self.remove_volume_dir(&dir).await {
                    tracing::warn!(tenant, workspace = new, error = %e, "removing an unfinished fork's directory failed");
                }
                other
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn make_fork(
        self: &Arc<Self>,
        tenant: &str,
        vol: &Arc<Volume>,
        src: &str,
        new: &str,
        mode: Mode,
        dir: &Path,
        journal_id: &str,
    ) -> Result<std::result::Result<Workspace, u64>> {
        let (version, base) = vol.fork_into(dir.join("journal")).await?;
        let Some(b) = base else {
            return Ok(Err(version));
        };
        LocalState {
            format: crate::local::LOCAL_FORMAT,
            tenant: tenant.to_string(),
            workspace: new.to_string(),
            journal_id: journal_id.to_string(),
            base_version: 1,
            base_manifest: b.base_manifest,
            base_seq: b.base_seq,
        }
        .store(&*self.fs, dir)?;
        let w = self
            .catalog
            .create_workspace(&NewWorkspace {
                tenant: tenant.to_string(),
                name: new.to_string(),
                mode,
                disk_size: b.disk_size,
                manifest: b.base_manifest,
                source: format!("ws:{src}@{version}"),
                kind: CheckpointKind::LiveFork,
                ttl_ms: None,
            })
            .await?;
        tracing::info!(
            tenant,
            workspace = new,
            source = src,
            version,
            base = b.base_version,
            "forked a live workspace"
        );
        Ok(Ok(w))
    }

    /// Publishes a live fork's data in the background, then detaches it unless a user attached
    /// it meanwhile (it can then be attached on any node).
    fn release_when_published(self: &Arc<Self>, tenant: &str, ws: &str) {
        let (e, t, w) = (self.clone(), tenant.to_string(), ws.to_string());
        tokio::spawn(async move {
            let Some(v) = e.volume(&t, &w) else { return };
            match v.publish_kind(CheckpointKind::Auto).await {
                Ok(_) => {
                    drop(v);
                    if let Err(err) = e.detach_if(&t, &w, true).await {
                        tracing::warn!(tenant = %t, workspace = %w, error = %err, "letting go of a published live fork failed");
                    }
                }
                Err(err) => {
                    tracing::warn!(tenant = %t, workspace = %w, error = %err, "publishing a live fork failed; its background uploads retry")
                }
            }
        });
    }

    /// Before an attach: a directory still marked as an unfinished fork is kept only if the
    /// catalog has that fork (its `livefork` version 1); otherwise it is removed.
    pub(super) async fn settle_fork_marker(&self, tenant: &str, ws: &str) -> Result<()> {
        let dir = self.volume_dir(tenant, ws);
        if !self.fs.exists(&dir.join(MARKER)) {
            return Ok(());
        }
        let complete = match self.catalog.get_workspace(tenant, ws).await {
            Ok(w) if w.head_version == 1 => {
                self.catalog.get_checkpoint(tenant, ws, 1).await?.kind == CheckpointKind::LiveFork
            }
            Ok(_) | Err(CatalogError::NotFound { .. }) => false,
            Err(e) => return Err(e.into()),
        };
        if complete {
            let (fs, d) = (self.fs.clone(), dir.clone());
            blocking(move || {
                fs.remove(&d.join(MARKER))
                    .and_then(|_| fs.sync_dir(&d))
                    .map_err(Error::io("completing a fork's directory"))
            })
            .await
        } else {
            tracing::info!(
                tenant,
                workspace = ws,
                "removing the directory of a fork that never completed"
            );
            self.remove_volume_dir(&dir).await
        }
    }
}
