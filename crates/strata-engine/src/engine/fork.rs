//! Forks of a live workspace in constant time, whatever is dirty.
//!
//! The source takes a local checkpoint whose cut seals its journal; the fork's journal gets
//! hard links to the sealed segments holding everything after the source's published base
//! (shared read-only: a segment with two names is never recycled, only unlinked, so neither
//! side ever overwrites what the other reads). The fork's version 1 is that published base
//! (kind `livefork`), its local state says its journal replays on top of it, and it is attached
//! on this node at once (its writes go to its own new segments). It then publishes its data as
//! version 2 in the background and, unless someone attached it meanwhile, lets go of it.
//! That version 2 is the source's checkpoint itself once the source has published it (the
//! fork rebases onto it, `volume/rebase.rs`), so the shared data is uploaded once.
//!
//! Until that publish, only this node has the fork's data: `Volume::open` refuses a `livefork`
//! head without the matching local state, so another node never serves the stale base (if
//! this node is lost first, the fork is lost with it: delete it).
//!
//! Crash safety: the links come first, then `forking.json` (naming the fork's source,
//! `ws:SRC@VERSION`, unique since only the source's lease holder forks it live) with the
//! first layer's record in `cuts.log`, then `state.json`, each durable before the next is in
//! place (`write_fork_files`: three rounds of syncs), then the catalog row; the marker goes
//! once a local state naming the row's incarnation (`created_ms`) is durable (the fork's first
//! publish; not synced: one that comes back is settled like one a crash left). An attach that
//! finds the marker keeps the directory if the catalog has that very fork (version 1 a
//! `livefork` of that source, or pruned since and the head published from this journal) and
//! removes it otherwise; a directory with
//! links but no `state.json` is swept at the next start (`sweep_unfinished_forks`). Once the
//! row may exist (also when its reply was lost), the directory is never removed by the fork.

use super::*;
use crate::local::LocalState;

use crate::local::FORK_MARKER as MARKER;

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
        name::validate("workspace name", new)?;
        let (tenant, src, new) = (tenant.to_string(), src.to_string(), new.to_string());
        self.in_own_task(move |e| async move {
            let key = key(&tenant, &new);
            let slot = e.slot(&key);
            let mut s = slot.lock().await;
            let r = e
                .fork_live_locked(&tenant, &vol, &src, &new, mode, &mut s)
                .await;
            let attached = s.is_some();
            drop(s);
            if !attached {
                e.tidy_slot(&key, slot);
            }
            r
        })
        .await
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
        let made = self.make_fork(tenant, vol, src, new, mode, &dir).await;
        let (w, source, inherit) = match made {
            Ok(Ok(made)) => made,
            Ok(Err(local)) => {
                self.remove_volume_dir(&dir).await?;
                return Ok(Err(local));
            }
            Err((e, source)) => {
                // A row that committed with its reply lost is this fork: kept.
                let ours = match &source {
                    Some(src) => match self.is_our_fork(tenant, new, src).await {
                        Ok(o) => o,
                        // Unknown: the row may exist, so the directory stays (marked: the next
                        // attach decides).
                        Err(_) => return Err(e),
                    },
                    None => false,
                };
                if !ours {
                    if let Err(e) = self.remove_volume_dir(&dir).await {
                        tracing::warn!(tenant, workspace = new, error = %e, "removing an unfinished fork's directory failed");
                    }
                    return Err(e);
                }
                // Its inheritance went with the error: the attach replays the links instead.
                let w = self.catalog.get_workspace(tenant, new).await?;
                (w, source.unwrap_or_default(), None)
            }
        };
        // The fork exists from here on: its directory is never removed (an attach completes it).
        // The marker stays until a local state naming the row's incarnation replaces the
        // fork's first one (written before the row existed): the first publish's, or an
        // attach's after a restart, which settles it against the catalog first. Until then
        // it is what keeps this journal off a namesake made elsewhere.
        if let Err(e) = self.attach_locked(tenant, new, s, false, inherit).await {
            return Err(Error::Unavailable(
                new.to_string(),
                format!("the fork ({source}) exists, but attaching it here failed: {e}; attach it on this node to finish it"),
            ));
        }
        Ok(Ok(w))
    }

    /// The links, marker, local state and catalog row of a fork. Err carries the fork's source
    /// (`ws:SRC@VERSION`) once the catalog row may exist.
    #[allow(clippy::type_complexity)]
    async fn make_fork(
        self: &Arc<Self>,
        tenant: &str,
        vol: &Arc<Volume>,
        src: &str,
        new: &str,
        mode: Mode,
        dir: &Path,
    ) -> std::result::Result<
        std::result::Result<(Workspace, String, Option<crate::volume::Inheritance>), u64>,
        (Error, Option<String>),
    > {
        let (version, base) = vol
            .fork_into(dir.join("journal"))
            .await
            .map_err(|e| (e, None))?;
        let Some(b) = base else {
            return Ok(Err(version));
        };
        // Unique: only the source's lease holder forks it live, and its versions are reserved.
        let source = format!("ws:{src}@{version}");
        let state = LocalState {
            format: crate::local::LOCAL_FORMAT,
            tenant: tenant.to_string(),
            workspace: new.to_string(),
            journal_id: crate::local::new_journal_id(),
            base_version: 1,
            base_manifest: b.base_manifest,
            base_seq: b.base_seq,
            created_ms: None, // the row does not exist yet: the marker guards the directory
        };
        let (fs, d, marker, adopt) = (self.fs.clone(), dir.to_path_buf(), source.clone(), b.adopt);
        blocking(move || write_fork_files(&*fs, &d, &marker, &state, &adopt))
            .await
            .map_err(|e| (e, None))?;
        let w = self
            .catalog
            .create_workspace(&NewWorkspace {
                tenant: tenant.to_string(),
                name: new.to_string(),
                mode,
                disk_size: b.disk_size,
                manifest: b.base_manifest,
                source: source.clone(),
                kind: CheckpointKind::LiveFork,
                ttl_ms: None,
            })
            .await
            .map_err(|e| (e.into(), Some(source.clone())))?;
        tracing::info!(
            tenant,
            workspace = new,
            source = src,
            version,
            base = b.base_version,
            "forked a live workspace"
        );
        Ok(Ok((w, source, Some(b.inherit))))
    }

    /// Whether the catalog's `ws` is the live fork made from `source` (its version 1 a
    /// `livefork` of exactly that source).
    async fn is_our_fork(&self, tenant: &str, ws: &str, source: &str) -> Result<bool> {
        let w = match self.catalog.get_workspace(tenant, ws).await {
            Ok(w) => w,
            Err(CatalogError::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        if w.source != source {
            return Ok(false);
        }
        match self.catalog.get_checkpoint(tenant, ws, 1).await {
            Ok(first) => Ok(first.kind == CheckpointKind::LiveFork),
            // Pruned (a marker whose removal was not synced came back after a power cut, on a
            // fork that has published since): ours only if its head was published from this
            // directory's journal. A checkpoint fork of the same version has the same source.
            Err(CatalogError::NotFound { .. }) => {
                let head = self
                    .catalog
                    .get_checkpoint(tenant, ws, w.head_version)
                    .await?;
                let local =
                    crate::local::LocalState::load(&*self.fs, &self.volume_dir(tenant, ws))?;
                Ok(
                    local
                        .is_some_and(|l| head.journal_id.as_deref() == Some(l.journal_id.as_str())),
                )
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Publishes a live fork's data in the background, then detaches it unless a user attached
    /// it meanwhile (it can then be attached on any node).
    pub(super) fn release_when_published(self: &Arc<Self>, tenant: &str, ws: &str) {
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
    /// catalog has that very fork (the marker names its source); otherwise it is removed.
    pub(super) async fn settle_fork_marker(&self, tenant: &str, ws: &str) -> Result<()> {
        let dir = self.volume_dir(tenant, ws);
        if !self.fs.exists(&dir.join(MARKER)) {
            return Ok(());
        }
        let source = String::from_utf8_lossy(
            &self
                .fs
                .read(&dir.join(MARKER))
                .map_err(Error::io("reading a fork's marker"))?,
        )
        .into_owned();
        if self.is_our_fork(tenant, ws, &source).await? {
            // The marker goes once a local state naming the row is durable: now if the state
            // already names it, else with the state the open stores (`LocalState::store`). An
            // open that fails before then leaves it, to be settled again.
            let (fs, d) = (self.fs.clone(), dir.clone());
            blocking(move || {
                let named = LocalState::load(&*fs, &d)?.is_some_and(|l| l.created_ms.is_some());
                if !named {
                    return Ok(());
                }
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

    /// Removes what a fork interrupted before its local state was written left behind
    /// (directories with journal links but no `state.json`: they pin the source's old
    /// segments). For a restart, before workspaces resume.
    pub fn sweep_unfinished_forks(&self) {
        let root = self.cfg.data_dir.join("volumes");
        let Ok(tenants) = std::fs::read_dir(&root) else {
            return;
        };
        for t in tenants.flatten() {
            let Ok(wss) = std::fs::read_dir(t.path()) else {
                continue;
            };
            for w in wss.flatten() {
                let p = w.path();
                // An unreadable entry counts as present: only a sure absence is swept.
                let has = |n: &str| p.join(n).try_exists().unwrap_or(true);
                if has("state.json") || !has("journal") {
                    continue;
                }
                let key = key(
                    &t.file_name().to_string_lossy(),
                    &w.file_name().to_string_lossy(),
                );
                let slot = self.slot(&key);
                let Ok(s) = slot.try_lock() else { continue };
                if s.is_none() && !has("state.json") {
                    tracing::info!(dir = %p.display(), "removing an unfinished fork");
                    if let Err(e) = std::fs::remove_dir_all(&p) {
                        tracing::warn!(dir = %p.display(), error = %e, "removing an unfinished fork failed");
                    }
                }
                drop(s);
                self.tidy_slot(&key, slot.clone());
            }
        }
    }
}

/// `bytes` as the whole of the file `path`, synced (for a rename into place afterwards).
fn write_synced(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let f = fs.open(path, true)?;
    f.set_len(0)?;
    f.write_at(bytes, 0)?;
    f.sync_data()
}

/// A fork's marker (naming its source), first layer's record (`cuts.log`: the source's
/// checkpoint, published by rebasing onto it) and local state, in the order an interrupted
/// fork is told by: `state.json` is never there without the other two and the journal's links.
/// In three rounds of syncs where one after another took eight: the three contents written
/// and synced side by side with the journal directory (its links) and the directory's own name
/// in its parent, the marker and the record renamed into place and the directory synced once,
/// then the local state renamed and the directory synced.
fn write_fork_files(
    fs: &dyn Fs,
    d: &Path,
    marker: &str,
    state: &LocalState,
    adopt: &crate::volume::Adopt,
) -> Result<()> {
    let state_bytes = state.encode()?;
    let (marker_tmp, state_tmp) = (d.join("forking.json.tmp"), d.join("state.json.tmp"));
    let parent = d.parent().unwrap_or(d);
    let first = crate::volume::fork_layer(adopt);
    let (m, c, st, p) = std::thread::scope(|s| {
        let m = s.spawn(|| {
            write_synced(fs, &marker_tmp, marker.as_bytes())
                .map_err(Error::io("marking the fork's directory"))
        });
        let c = s.spawn(|| {
            crate::volume::stage_cut_log(fs, d, &state.journal_id, std::slice::from_ref(&first))
        });
        let st = s.spawn(|| {
            write_synced(fs, &state_tmp, &state_bytes)
                .map_err(Error::io("writing the fork's local state"))
        });
        // The links to the source's segments (made by `Volume::fork_into`, not yet synced).
        let j = s.spawn(|| {
            fs.sync_dir(&d.join("journal"))
                .map_err(Error::io("syncing the fork's journal"))
        });
        // The directory is new: its name in its parent made durable too.
        let p = fs
            .sync_dir(parent)
            .map_err(Error::io("syncing the fork's directory's parent"));
        fn join<T>(h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
            h.join()
                .unwrap_or_else(|_| Err(Error::Invalid("a fork's file writer panicked".into())))
        }
        (join(m), join(c), join(st), join(j).and(p))
    });
    m?;
    let (cut_tmp, cut_log) = c?;
    st?;
    p?;
    let io = |what: &'static str| Error::io(what);
    fs.rename(&marker_tmp, &d.join(MARKER))
        .map_err(io("marking the fork's directory"))?;
    fs.rename(&cut_tmp, &cut_log)
        .map_err(io("recording the fork's first layer"))?;
    fs.sync_dir(d).map_err(io("syncing the fork's directory"))?;
    fs.rename(&state_tmp, &d.join("state.json"))
        .map_err(io("writing the fork's local state"))?;
    fs.sync_dir(d).map_err(io("syncing the fork's directory"))
}
