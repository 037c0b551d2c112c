//! Mounts across a daemon's restarts: what a start does with the records a previous run left
//! (clear the dead stack, mount again), what a stop does (sync, cover the targets, leave the
//! rest to end with the process), and the umount of a mount that is down.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_engine::Published;

use super::{
    blocking, conflict, host, is_mount_point, kernel, loop_backing, loop_detach_within, Backend,
    MountInfo, Mounted,
};
use crate::error::ApiError;
use crate::exports::{own_task, Key};
use crate::Daemon;

/// Covers a record's target with the read-only placeholder (unless one is on top already),
/// through the checked target.
async fn cover_target(root: Option<&Path>, info: &MountInfo) {
    if let (Some(t), Some(root)) = (info.target.clone(), root.map(Path::to_path_buf)) {
        let tenant = info.tenant.clone();
        let _ = blocking(move || host::cover(&root, &tenant, &t)).await;
    }
}

/// Why a kernel NBD mount was not reattached.
enum Reattach {
    /// Not now (the catalog or the store did not answer): the device keeps holding requests.
    Later(String, u32),
    /// Never: the device, the filesystem or the disk under it is not what the record says.
    Afresh(String),
}

impl Daemon {
    /// Whether a mount record exists for the workspace (mounted, or to be mounted again).
    pub(crate) fn has_mount_record(&self, t: &str, ws: &str) -> bool {
        self.mount_home(t, ws).join("mount.json").exists()
    }

    /// After a restart (clean or kill -9): clears what a previous run left of each recorded
    /// mount and mounts it again. Returns the workspaces mounted.
    pub(crate) async fn resume_mounts(self: &Arc<Self>) -> Vec<Key> {
        let root = self.engine.config().data_dir.join("mounts");
        let mut done = vec![];
        let Ok(rd) = std::fs::read_dir(&root) else {
            return done;
        };
        let enabled = self.mount_root.is_some();
        // Kernel NBD devices whose reattach is retried in the background.
        let mut pending = std::collections::BTreeSet::new();
        for e in rd.flatten() {
            let rec = e.path().join("mount.json");
            let Some(info) = std::fs::read(&rec)
                .ok()
                .and_then(|b| serde_json::from_slice::<MountInfo>(&b).ok())
            else {
                continue;
            };
            // The record must be this node's own, at its own place.
            if self.mount_home(&info.tenant, &info.workspace) != e.path()
                || Path::new(&info.dir) != e.path().join("fs")
            {
                tracing::warn!(path = %rec.display(), "ignoring a mount record in the wrong place");
                continue;
            }
            // A kernel NBD device outlives the daemon: its filesystem is still mounted and
            // waits for its connections, which go back into the same device.
            if enabled && info.backend == Backend::Nbd {
                match self.reattach(&info).await {
                    Ok(()) => {
                        done.push((info.tenant.clone(), info.workspace.clone()));
                        continue;
                    }
                    Err(Reattach::Later(why, index)) => {
                        // The device holds the sandbox's requests meanwhile: no EIO for a
                        // catalog or store that is briefly unreachable.
                        tracing::warn!(
                            tenant = info.tenant,
                            workspace = info.workspace,
                            error = why,
                            "cannot reattach the kernel nbd device yet; retrying in the background"
                        );
                        pending.insert(index);
                        self.reattach_later(info, e.path());
                        continue;
                    }
                    Err(Reattach::Afresh(why)) => {
                        tracing::warn!(
                            tenant = info.tenant,
                            workspace = info.workspace,
                            error = why,
                            "the kernel nbd device cannot be reattached; mounting afresh"
                        );
                    }
                }
            }
            if self.mount_afresh(&info, &e.path()).await {
                done.push((info.tenant.clone(), info.workspace.clone()));
            }
        }
        // Devices this node connected that no live (or soon reattached) mount uses.
        let mut keep: std::collections::BTreeSet<u32> = self
            .lock_mounts()
            .values()
            .filter_map(|m| m.kernel.as_ref().map(|k| k.index))
            .collect();
        keep.extend(pending);
        kernel::sweep(&self.nbd_backend_prefix(), &keep).await;
        done
    }

    /// Clears what is left of a recorded mount and mounts it again; whether it is mounted.
    async fn mount_afresh(self: &Arc<Self>, info: &MountInfo, home: &Path) -> bool {
        // A dead mount at the target still takes writes into its page cache (they fail
        // only at fsync): cover it at once, before anything else.
        cover_target(self.mount_root.as_deref(), info).await;
        self.clear_stale(home).await;
        if self.mount_root.is_none() {
            tracing::error!(
                tenant = info.tenant,
                workspace = info.workspace,
                "not remounting: mounts are off on this node (no --mount-root); the record stays"
            );
            self.publish_local(&info.tenant, &info.workspace).await;
            return false;
        }
        match self.remount(info).await {
            Ok(_) => true,
            Err(err) => {
                tracing::error!(tenant = info.tenant, workspace = info.workspace, error = %err.message, "not remounting workspace; its record stays (the next start retries)");
                // Keep the target covered: nothing a sandbox writes there may land on the
                // host directory underneath.
                cover_target(self.mount_root.as_deref(), info).await;
                false
            }
        }
    }

    /// Retries a reattach every 5 s for half the dead-connection timeout (the kernel holds
    /// the requests that long at least), then mounts afresh.
    fn reattach_later(self: &Arc<Self>, info: MountInfo, home: PathBuf) {
        let d = self.clone();
        tokio::spawn(async move {
            let until = std::time::Instant::now() + d.nbd_timeouts.1 / 2;
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                if !d.has_mount_record(&info.tenant, &info.workspace)
                    || d.is_mounted(&info.tenant, &info.workspace)
                {
                    return; // unmounted (or mounted) meanwhile
                }
                match d.reattach(&info).await {
                    Ok(()) => {
                        tracing::info!(
                            tenant = info.tenant,
                            workspace = info.workspace,
                            "kernel nbd device reattached"
                        );
                        return;
                    }
                    Err(Reattach::Later(why, _)) if std::time::Instant::now() < until => {
                        tracing::warn!(
                            tenant = info.tenant,
                            workspace = info.workspace,
                            error = why,
                            "cannot reattach the kernel nbd device yet"
                        );
                    }
                    Err(Reattach::Later(why, _)) | Err(Reattach::Afresh(why)) => {
                        tracing::warn!(
                            tenant = info.tenant,
                            workspace = info.workspace,
                            error = why,
                            "giving up on reattaching the kernel nbd device; mounting afresh"
                        );
                        d.mount_afresh(&info, &home).await;
                        return;
                    }
                }
            }
        });
    }

    /// Serves a recorded kernel NBD mount again: its device (checked to be this mount's by
    /// its backend name, still connected) gets fresh connections; the filesystem on it stays
    /// mounted. Only onto the same disk: if the volume did not open on the journal it had
    /// (another node moved the head meanwhile and the local journal was discarded), the
    /// filesystem's cache describes another disk, and it is mounted afresh instead.
    async fn reattach(self: &Arc<Self>, info: &MountInfo) -> Result<(), Reattach> {
        let (d, info) = (self.clone(), info.clone());
        let afresh = |s: &str| Reattach::Afresh(s.to_string());
        // In a task of its own (like every operation): a caller that goes away does not cut
        // it between the attach and the record of the mount.
        let r = tokio::spawn(async move {
            let k = (info.tenant.clone(), info.workspace.clone());
            let (_running, _op) = d.mount_op_on(&k).await;
            if !d.has_mount_record(&k.0, &k.1) || d.is_mounted(&k.0, &k.1) {
                return Ok(());
            }
            if d.stopping() {
                // The node is stopping (a background retry ran late): the device keeps
                // holding requests for the next start.
                return Ok(());
            }
            let index = info
                .device
                .as_deref()
                .and_then(|p| p.strip_prefix("/dev/nbd"))
                .and_then(|i| i.parse::<u32>().ok())
                .ok_or_else(|| afresh("the record names no nbd device"))?;
            let backend = d.nbd_backend_name(&k.0, &k.1);
            if !is_mount_point(Path::new(&info.dir)) {
                return Err(afresh("the filesystem is no longer mounted"));
            }
            if kernel::backend_of(index).as_deref() != Some(backend.as_str()) {
                return Err(afresh("the device is not this mount's any more"));
            }
            let before = d.journal_of(&k.0, &k.1);
            let was_attached = d.engine.volume(&k.0, &k.1).is_some();
            let vol = d
                .engine
                .attach(&k.0, &k.1)
                .await
                .map_err(|e| Reattach::Later(e.to_string(), index))?;
            if before.is_none() || d.journal_of(&k.0, &k.1) != before {
                return Err(afresh(
                    "the volume did not open on the journal the filesystem wrote (the head moved elsewhere)",
                ));
            }
            let disk = match kernel::KernelDisk::resume(
                vol.clone(),
                index,
                &backend,
                info.read_only,
            )
            .await
            {
                Ok(disk) => disk,
                Err(e) => {
                    d.undo_attach(&k.0, &k.1, was_attached, "mount").await;
                    return Err(Reattach::Afresh(e.to_string()));
                }
            };
            // The bind may be missing (a crash between the mount and the bind): bind again, or
            // cover the target, never leave the host directory open to the sandbox.
            let mut bound = false;
            if let (Some(tg), Some(root)) = (info.target.clone(), d.mount_root.clone()) {
                let (tenant, dir) = (k.0.clone(), PathBuf::from(&info.dir));
                bound = blocking(move || {
                    // Everything through the checked target: one that no longer resolves
                    // safely is neither taken for bound nor bound nor covered (covering its
                    // path string would follow what the sandbox put there).
                    let Ok(ct) = host::CheckedTarget::open(&root, &tenant, &tg) else {
                        tracing::error!(tenant, target = tg, "a mount target no longer resolves safely (a symlink or a mount on its path): not bound again");
                        return false;
                    };
                    let dir_dev = std::fs::metadata(&dir)
                        .ok()
                        .map(|m| std::os::unix::fs::MetadataExt::dev(&m));
                    if dir_dev.is_some() && ct.top_dev() == dir_dev {
                        return true;
                    }
                    let _one = host::BIND_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                    let rebound = host::open_target(&root, &tenant, &tg, true)
                        .ok()
                        .is_some_and(|fd| host::bind_onto(&dir, &fd).is_ok());
                    if !rebound {
                        ct.cover();
                    }
                    rebound
                })
                .await
                .unwrap_or(false);
            }
            let m = Mounted {
                info,
                fuse: None,
                kernel: Some(disk),
                vol,
                bound,
                _share: Some(d.shares.take_over(&k.0, crate::shares::Kind::Mounts, 1)),
            };
            if let Some(m) = d.insert_unless_stopping(k, m) {
                d.stop_one(m).await;
            }
            Ok(())
        });
        r.await
            .unwrap_or_else(|e| Err(Reattach::Afresh(format!("reattach task: {e}"))))
    }

    /// The id of the workspace's local journal (`volumes/{t}/{ws}/state.json`), if any.
    fn journal_of(&self, t: &str, ws: &str) -> Option<String> {
        let p = self
            .engine
            .config()
            .data_dir
            .join("volumes")
            .join(t)
            .join(ws)
            .join("state.json");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).ok()?).ok()?;
        v.get("journal_id")?.as_str().map(str::to_string)
    }

    async fn remount(self: &Arc<Self>, info: &MountInfo) -> Result<MountInfo, ApiError> {
        let (d, info) = (self.clone(), info.clone());
        own_task(async move {
            let k = (info.tenant.clone(), info.workspace.clone());
            let (_running, _op) = d.mount_op_on(&k).await;
            if d.stopping() {
                return Err(super::stopping_error());
            }
            let mut fresh = info.clone();
            fresh.device = None;
            d.attach_and_mount(fresh, false, true).await
        })
        .await
    }

    /// What a dead run leaves under a mount's home: a (maybe frozen) ext4 on a loop device whose
    /// FUSE connection is gone. All of it is detached lazily; nothing a sandbox fsync'd is lost
    /// (it reached the volume before the fsync returned). The target is left as it is (a dead
    /// mount answers ENOTCONN or EIO, a placeholder EROFS): the new bind covers it.
    async fn clear_stale(&self, home: &Path) {
        let fs_dir = home.join("fs");
        let disk_dir = home.join("disk");
        {
            let fs_dir = fs_dir.clone();
            let _ = blocking(move || {
                if is_mount_point(&fs_dir) {
                    host::thaw_path(&fs_dir);
                    let _ = rustix::mount::unmount(
                        &fs_dir,
                        rustix::mount::UnmountFlags::DETACH | rustix::mount::UnmountFlags::NOFOLLOW,
                    );
                }
            })
            .await;
        }
        // Every loop device over this home's disk (the crash may have come before the record
        // named its device).
        if let Ok(rd) = std::fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !name.starts_with("loop") {
                    continue;
                }
                let dev = format!("/dev/{name}");
                if let Some(f) = loop_backing(&dev).filter(|f| f.starts_with(&disk_dir)) {
                    loop_detach_within(&dev, &f, 10).await;
                }
            }
        }
        // A FUSE mount whose daemon died answers ENOTCONN; it can only be detached.
        let _ = rustix::mount::unmount(&disk_dir, rustix::mount::UnmountFlags::DETACH);
        // A kernel NBD device of this mount, still connected.
        if let Some(h) = home.file_name() {
            let name = format!("{}{}", self.nbd_backend_prefix(), h.to_string_lossy());
            kernel::disconnect_named(&name).await;
        }
    }

    /// Orderly stop: unmounts every mount cleanly (its filesystem synced to the volume), each
    /// under its op lock (a checkpoint's freeze finishes first), covers each target with a
    /// read-only placeholder, and keeps the records so that the next start mounts them again.
    pub(crate) async fn stop_all_mounts(&self) {
        self.mounts_stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Mount operations already running finish first (a reattach retried late, a mount
        // whose client left): each either records its mount before the list below is taken,
        // or sees the flag and stops itself, and none serves a volume this stop has closed.
        // One that starts from now on sees the flag (it counts itself before it looks).
        let mut running = self.mount_ops.subscribe();
        let _ = running.wait_for(|n| *n == 0).await;
        let keys: Vec<Key> = self.lock_mounts().keys().cloned().collect();
        for k in keys {
            let lock = self.op_lock(&k);
            let _op = lock.lock().await;
            let Some(m) = self.lock_mounts().remove(&k) else {
                continue;
            };
            self.stop_one(m).await;
        }
    }

    /// Stops one mount: covers its target on top of the live bind (from this moment a
    /// sandbox's writes there fail with EROFS, never reaching the host directory), syncs the
    /// filesystem into the volume, and leaves what is under the placeholder to end with this
    /// process, as after a kill -9; the next start clears it (nothing unsynced was promised).
    /// A kernel NBD mount stays up instead: its filesystem is synced, its connections are
    /// drained and closed, and the device holds the sandbox's requests until the next start
    /// reconnects it (for the dead-connection timeout, 10 min by default).
    pub(super) async fn stop_one(&self, mut m: super::Mounted) {
        let (dir, target) = (PathBuf::from(&m.info.dir), m.info.target.clone());
        let cover = m.kernel.is_none();
        let (root, tenant) = (self.mount_root.clone(), m.info.tenant.clone());
        let _ = blocking(move || {
            if let (Some(t), Some(root)) = (target.filter(|_| cover), root) {
                host::cover(&root, &tenant, &t);
            }
            host::sync_fs(&dir);
        })
        .await;
        if let Some(k) = m.kernel.take() {
            k.park().await;
        }
        if let Err(e) = m.vol.flush().await {
            tracing::warn!(workspace = m.info.workspace, error = %e, "flush at stop failed");
        }
        // The FUSE session must outlive this function: it ends with the process.
        std::mem::forget(m.fuse);
    }

    /// Umount of a mount that is down (its remount failed, or mounts are off): clears what is
    /// left of it, forgets the record, and detaches the workspace if it is attached here.
    pub(super) async fn clear_down_mount(
        &self,
        t: &str,
        ws: &str,
    ) -> Result<Option<Published>, ApiError> {
        let home = self.mount_home(t, ws);
        let rec = home.join("mount.json");
        let Some(info) = std::fs::read(&rec)
            .ok()
            .and_then(|b| serde_json::from_slice::<MountInfo>(&b).ok())
        else {
            return Err(conflict(format!(
                "workspace {ws:?} is not mounted on this node"
            )));
        };
        if let (Some(tg), Some(root)) = (info.target.clone(), self.mount_root.clone()) {
            let tenant = info.tenant.clone();
            let _ = blocking(move || host::unmount_all(&root, &tenant, &tg)).await;
        }
        self.clear_stale(&home).await;
        let _ = std::fs::remove_file(&rec);
        let _ = std::fs::File::open(&home).and_then(|f| f.sync_all());
        if self.engine.volume(t, ws).is_none() && self.has_local_state(t, ws) {
            self.engine.attach(t, ws).await?;
        }
        if self.engine.volume(t, ws).is_some() {
            return Ok(self.engine.detach(t, ws).await?);
        }
        Ok(None)
    }

    fn has_local_state(&self, t: &str, ws: &str) -> bool {
        self.engine
            .config()
            .data_dir
            .join("volumes")
            .join(t)
            .join(ws)
            .join("state.json")
            .exists()
    }

    /// A workspace whose mount stays down still has its fsync'd writes in the local journal:
    /// attach and detach it so they are published (and its lease released) rather than left
    /// while the lease lapses.
    async fn publish_local(&self, t: &str, ws: &str) {
        if !self.has_local_state(t, ws) {
            return;
        }
        let r = async {
            self.engine.attach(t, ws).await?;
            self.engine.detach(t, ws).await
        }
        .await;
        if let Err(e) = r {
            tracing::error!(tenant = t, workspace = ws, error = %e, "publishing a workspace whose mount is down failed");
        }
    }
}
