//! Workspaces mounted on the host: `POST /v1/workspaces/{ws}/mount`, `strata ws mount`.
//!
//! ```text
//! mount ─▶ op lock ─▶ engine.attach ─▶ FUSE export DATA/mounts/{h}/disk/disk ─▶ loop device
//!          ─▶ mkfs.ext4 (only a blank volume, only if asked) ─▶ mount ext4 at DATA/mounts/{h}/fs
//!          ─▶ bind onto the target (under --mount-root) ─▶ record DATA/mounts/{h}/mount.json
//!          (each step undone if a later one fails: all or nothing)
//! umount ─▶ op lock ─▶ unmount target, fs (syncs: FLUSH reaches the volume) ─▶ detach loop
//!          ─▶ unmount FUSE ─▶ forget the record ─▶ engine.detach (final publish)
//! checkpoint of a mounted workspace ─▶ FIFREEZE ─▶ cut ─▶ FITHAW ─▶ upload
//! restart (clean or kill -9) ─▶ each record: lazily unmount what is left (a dead FUSE
//!          connection, its loop device, the ext4 on it), thaw, then mount again
//! ```
//!
//! The internal directories never come from names (`{h}` hashes tenant and workspace). A
//! tenant may name only a bind target, which must be an empty directory under the operator's
//! `--mount-root` once symlinks are resolved; without a mount root, no target is accepted.
//! A mounted workspace is not exported over NBD and cannot be detached, deleted or rolled
//! back (any of those would change the disk under a mounted filesystem): umount first.

pub(crate) mod fuse;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use strata_engine::{Published, Volume};

use crate::error::ApiError;
use crate::exports::{own_task, Key};
use crate::Daemon;

/// How a mounted workspace reaches the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The native FUSE export under a loop device (no kernel module beyond fuse and loop).
    #[default]
    Fuse,
    /// The kernel NBD client over netlink.
    Nbd,
}

/// `POST /v1/workspaces/{name}/mount`.
#[derive(Debug, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MountRequest {
    #[serde(default)]
    pub backend: Backend,
    /// Make this filesystem if (and only if) the volume is blank: `ext4`.
    #[serde(default)]
    pub mkfs: Option<String>,
    /// Bind the filesystem onto this directory too (under the daemon's `--mount-root`).
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default)]
    pub read_only: bool,
}

/// A workspace mounted on this node (also its record on disk).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MountInfo {
    pub tenant: String,
    pub workspace: String,
    pub backend: Backend,
    /// The filesystem's own mount point (inside the daemon's data directory).
    pub dir: String,
    /// Where it is bound for the sandbox, if anywhere.
    pub target: Option<String>,
    /// The block device under the filesystem (`/dev/loopN`), while mounted.
    pub device: Option<String>,
    pub fstype: String,
    pub read_only: bool,
}

/// A live mount: its record and what holds it up.
pub(crate) struct Mounted {
    pub info: MountInfo,
    fuse: Option<fuse::FuseDisk>,
    vol: Arc<Volume>,
}

const FSTYPE: &str = "ext4";
/// A blank volume reads as zeros over its first MiB (where every filesystem puts its label).
const BLANK_PROBE: u64 = 1 << 20;

fn conflict(msg: String) -> ApiError {
    ApiError::new(StatusCode::CONFLICT, "conflict", msg)
}

fn io_err(what: &str) -> impl Fn(std::io::Error) -> ApiError + '_ {
    move |e| ApiError::internal(format!("{what}: {e}"))
}

/// Runs a host tool, returning its stdout; its stderr is the error.
async fn run(cmd: &str, args: &[&str]) -> Result<String, ApiError> {
    let out = tokio::process::Command::new(cmd)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ApiError::internal(format!("{cmd}: {e} (is it installed?)")))?;
    if !out.status.success() {
        return Err(ApiError::internal(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Freezes (`true`) or thaws the filesystem mounted at `dir`.
async fn fsfreeze(dir: &Path, freeze: bool) -> Result<(), ApiError> {
    let d = dir.to_string_lossy();
    run("fsfreeze", &[if freeze { "-f" } else { "-u" }, &d])
        .await
        .map(drop)
}

/// The loop device's backing file as the kernel reports it.
fn loop_backing(dev: &str) -> Option<PathBuf> {
    let name = Path::new(dev).file_name()?.to_str()?;
    let s = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(
        s.trim_end_matches('\n').trim_end_matches(" (deleted)"),
    ))
}

async fn loop_detach(dev: &str, file: &Path) {
    // Only a device still backed by our file: after a crash the number may be someone else's.
    if loop_backing(dev).as_deref() != Some(file) {
        return;
    }
    if let Err(e) = run("losetup", &["-d", dev]).await {
        tracing::warn!(device = dev, error = %e.message, "detaching loop device failed");
    }
    // The kernel releases the file asynchronously; wait for it (bounded).
    for _ in 0..250 {
        if loop_backing(dev).as_deref() != Some(file) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tracing::warn!(device = dev, "loop device still bound after detach");
}

async fn unmount(dir: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || fuse::unmount_retrying(&dir)).await;
}

fn unmount_now(dir: &Path) -> std::io::Result<()> {
    match rustix::mount::unmount(dir, rustix::mount::UnmountFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev() || a.ino() == b.ino(),
        _ => false,
    }
}

fn write_record(path: &Path, info: &MountInfo) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(info).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

impl Daemon {
    fn lock_mounts(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<Key, Mounted>> {
        self.mounts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the workspace is mounted on this node.
    pub(crate) fn is_mounted(&self, t: &str, ws: &str) -> bool {
        self.lock_mounts()
            .contains_key(&(t.to_string(), ws.to_string()))
    }

    /// Refuses an operation that would change the disk under a mounted filesystem.
    pub(crate) fn refuse_if_mounted(&self, t: &str, ws: &str, what: &str) -> Result<(), ApiError> {
        match self.lock_mounts().get(&(t.to_string(), ws.to_string())) {
            Some(m) => Err(conflict(format!(
                "workspace {ws:?} is mounted at {}: umount it before {what}",
                m.info.target.as_deref().unwrap_or(&m.info.dir)
            ))),
            None => Ok(()),
        }
    }

    /// This node's mounts of a tenant's workspaces.
    pub(crate) fn mounts_of(&self, t: &str) -> Vec<MountInfo> {
        let mut v: Vec<MountInfo> = self
            .lock_mounts()
            .values()
            .filter(|m| m.info.tenant == t)
            .map(|m| m.info.clone())
            .collect();
        v.sort_by(|a, b| a.workspace.cmp(&b.workspace));
        v
    }

    fn mount_home(&self, t: &str, ws: &str) -> PathBuf {
        let sock = self.socket_path(t, ws);
        let h = sock
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.engine.config().data_dir.join("mounts").join(h)
    }

    /// Resolves a tenant-named bind target: an existing, empty, unmounted directory under the
    /// mount root once symlinks are resolved.
    fn check_target(&self, target: &str) -> Result<PathBuf, ApiError> {
        let Some(root) = &self.mount_root else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "this node has no --mount-root: mount targets are not accepted",
            ));
        };
        let bad = |why: &str| ApiError::invalid(format!("mount target {target:?} {why}"));
        let p = Path::new(target);
        if !p.is_absolute() || target.len() > 4096 {
            return Err(bad("must be an absolute path"));
        }
        let root = std::fs::canonicalize(root).map_err(io_err("mount root"))?;
        let c = std::fs::canonicalize(p).map_err(|_| bad("does not exist"))?;
        if c == root || !c.starts_with(&root) {
            return Err(bad("is not under the node's mount root"));
        }
        let md = std::fs::metadata(&c).map_err(|_| bad("does not exist"))?;
        if !md.is_dir() {
            return Err(bad("is not a directory"));
        }
        if is_mount_point(&c) {
            return Err(bad("is already a mount point"));
        }
        if std::fs::read_dir(&c)
            .map_err(|_| bad("cannot be read"))?
            .next()
            .is_some()
        {
            return Err(bad("is not empty"));
        }
        Ok(c)
    }

    /// Mounts a workspace on this node (idempotent for the same request).
    pub(crate) async fn mount_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
        req: MountRequest,
    ) -> Result<MountInfo, ApiError> {
        if req.backend == Backend::Nbd {
            return Err(ApiError::new(
                StatusCode::NOT_IMPLEMENTED,
                "not_implemented",
                "the kernel NBD backend is not built yet: use backend fuse",
            ));
        }
        if let Some(f) = &req.mkfs {
            if f != FSTYPE {
                return Err(ApiError::invalid(format!(
                    "mkfs {f:?}: only {FSTYPE} is supported"
                )));
            }
        }
        let target = req.target.as_deref().map(|t| self.check_target(t));
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = (t.clone(), ws.clone());
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            if let Some(m) = d.lock_mounts().get(&k) {
                let same = match &target {
                    None => true,
                    Some(Ok(p)) => m.info.target.as_deref() == Some(&*p.to_string_lossy()),
                    Some(Err(_)) => m.info.target.as_deref() == req.target.as_deref(),
                };
                return if same && m.info.read_only == req.read_only {
                    Ok(m.info.clone())
                } else {
                    Err(conflict(format!(
                        "workspace {ws:?} is already mounted at {}",
                        m.info.target.as_deref().unwrap_or(&m.info.dir)
                    )))
                };
            }
            let target = target.transpose()?;
            if d.export_uri(&t, &ws).is_some() {
                return Err(conflict(format!(
                    "workspace {ws:?} is attached over NBD: detach it before mounting"
                )));
            }
            let info = MountInfo {
                tenant: t.clone(),
                workspace: ws.clone(),
                backend: req.backend,
                dir: d.mount_home(&t, &ws).join("fs").display().to_string(),
                target: target.map(|p| p.display().to_string()),
                device: None,
                fstype: FSTYPE.into(),
                read_only: req.read_only,
            };
            let was_attached = d.engine.volume(&t, &ws).is_some();
            let vol = d.engine.attach(&t, &ws).await?;
            match d.bring_up(info, vol, req.mkfs.is_some()).await {
                Ok(m) => {
                    let info = m.info.clone();
                    d.lock_mounts().insert(k, m);
                    Ok(info)
                }
                Err(e) => {
                    if !was_attached {
                        if let Err(de) = d.engine.detach(&t, &ws).await {
                            tracing::error!(tenant = t, workspace = ws, error = %de, "undoing an attach whose mount failed");
                        }
                    }
                    Err(e)
                }
            }
        })
        .await
    }

    /// FUSE export, loop device, (mkfs), mount, bind, record; undoes what it did on failure.
    async fn bring_up(
        &self,
        mut info: MountInfo,
        vol: Arc<Volume>,
        mkfs: bool,
    ) -> Result<Mounted, ApiError> {
        let home = self.mount_home(&info.tenant, &info.workspace);
        let (disk_dir, fs_dir) = (home.join("disk"), PathBuf::from(&info.dir));
        {
            use std::os::unix::fs::DirBuilderExt;
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true).mode(0o700);
            b.create(&disk_dir).map_err(io_err("mount directory"))?;
            b.create(&fs_dir).map_err(io_err("mount directory"))?;
        }
        // Whether the disk holds anything, and an ext4 superblock, before the kernel sees it.
        let probe = BLANK_PROBE.min(vol.size());
        let blank = vol
            .allocation(0, probe)
            .map_err(|e| ApiError::internal(format!("reading the volume: {e}")))?
            .iter()
            .all(|(_, zero)| *zero);
        let has_ext4 = !blank
            && vol.size() >= 2048
            && vol
                .read(1024 + 56, 2)
                .await
                .map_err(|e| ApiError::internal(format!("reading the volume: {e}")))?
                == [0x53, 0xEF];
        if blank && !mkfs {
            return Err(conflict(format!(
                "workspace {:?} is blank: mount it with mkfs ext4 to make its filesystem",
                info.workspace
            )));
        }
        if !blank && !has_ext4 {
            return Err(conflict(format!(
                "workspace {:?} holds data but no ext4 filesystem: not mounting (and not formatting) it",
                info.workspace
            )));
        }
        let fuse = {
            let (vol, dir) = (vol.clone(), disk_dir.clone());
            let rt = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || fuse::FuseDisk::mount(vol, &dir, rt))
                .await
                .map_err(|e| ApiError::internal(format!("fuse mount: {e}")))?
                .map_err(io_err("fuse mount"))?
        };
        let file = fuse.file.clone();
        let mut m = Mounted {
            info: info.clone(),
            fuse: Some(fuse),
            vol,
        };
        let up = async {
            let f = file.to_string_lossy();
            let dev = run("losetup", &["--find", "--show", &f]).await?;
            info.device = Some(dev.clone());
            m.info.device = Some(dev.clone());
            if blank && mkfs {
                run("mkfs.ext4", &["-q", "-F", &dev]).await?;
            }
            let flags = rustix::mount::MountFlags::NOSUID
                | rustix::mount::MountFlags::NODEV
                | if info.read_only {
                    rustix::mount::MountFlags::RDONLY
                } else {
                    rustix::mount::MountFlags::empty()
                };
            {
                let (d2, dir) = (dev.clone(), fs_dir.clone());
                tokio::task::spawn_blocking(move || {
                    rustix::mount::mount(d2.as_str(), &dir, FSTYPE, flags, None)
                })
                .await
                .map_err(|e| ApiError::internal(format!("mount: {e}")))?
                .map_err(|e| ApiError::internal(format!("mounting {FSTYPE} from {dev}: {e}")))?;
            }
            if let Some(t) = &info.target {
                let (src, dst) = (fs_dir.clone(), PathBuf::from(t));
                tokio::task::spawn_blocking(move || rustix::mount::mount_bind(&src, &dst))
                    .await
                    .map_err(|e| ApiError::internal(format!("bind: {e}")))?
                    .map_err(|e| ApiError::internal(format!("binding onto {t}: {e}")))?;
            }
            write_record(&home.join("mount.json"), &info).map_err(io_err("mount record"))?;
            Ok::<(), ApiError>(())
        };
        match up.await {
            Ok(()) => Ok(m),
            Err(e) => {
                self.tear_down(&mut m).await;
                let _ = std::fs::remove_file(home.join("mount.json"));
                Err(e)
            }
        }
    }

    /// Unmounts every layer of a mount (best effort, in order; lazily where busy). The record
    /// stays: the caller forgets it when that is what it means.
    async fn tear_down(&self, m: &mut Mounted) {
        if let Some(t) = &m.info.target {
            if is_mount_point(Path::new(t)) {
                unmount(PathBuf::from(t)).await;
            }
        }
        unmount(PathBuf::from(&m.info.dir)).await;
        if let (Some(dev), Some(f)) = (&m.info.device, &m.fuse) {
            loop_detach(dev, &f.file).await;
        }
        if let Some(f) = m.fuse.take() {
            let _ = tokio::task::spawn_blocking(move || f.unmount()).await;
        }
        if let Err(e) = m.vol.flush().await {
            tracing::warn!(workspace = m.info.workspace, error = %e, "flush after unmount failed");
        }
        m.info.device = None;
    }

    /// Unmounts a workspace and detaches it (its final publish): what a sandbox's end means.
    pub(crate) async fn umount_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
    ) -> Result<Option<Published>, ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = (t.clone(), ws.clone());
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            let Some(mut m) = d.lock_mounts().remove(&k) else {
                return Err(conflict(format!(
                    "workspace {ws:?} is not mounted on this node"
                )));
            };
            // A busy filesystem (a process still inside it) stays mounted: say so.
            let busy = |dir: &str| {
                unmount_now(Path::new(dir)).map_err(|e| {
                    conflict(format!(
                        "cannot unmount {dir}: {e} (is something using it?)"
                    ))
                })
            };
            let first = match &m.info.target {
                Some(t) => busy(t),
                None => Ok(()),
            }
            .and_then(|()| busy(&m.info.dir));
            if let Err(e) = first {
                if let Some(tg) = &m.info.target {
                    if !is_mount_point(Path::new(tg)) {
                        let _ = rustix::mount::mount_bind(Path::new(&m.info.dir), Path::new(tg));
                    }
                }
                d.lock_mounts().insert(k, m);
                return Err(e);
            }
            d.tear_down(&mut m).await;
            let home = d.mount_home(&t, &ws);
            let _ = std::fs::remove_file(home.join("mount.json"));
            let _ = std::fs::File::open(&home).and_then(|f| f.sync_all());
            let _ = std::fs::remove_dir(home.join("fs"));
            let _ = std::fs::remove_dir(home.join("disk"));
            let _ = std::fs::remove_dir(&home);
            drop(m);
            Ok(d.engine.detach(&t, &ws).await?)
        })
        .await
    }

    /// A checkpoint; of a mounted workspace, with its filesystem frozen from before the cut to
    /// just after it (application-consistent) unless `freeze` is false.
    pub(crate) async fn checkpoint_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
        label: Option<String>,
        keep_until: Option<u64>,
        freeze: bool,
    ) -> Result<Published, ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = (t.clone(), ws.clone());
            let mounted = if freeze {
                let lock = d.op_lock(&k);
                let op = lock.clone().lock_owned().await;
                let m = d
                    .lock_mounts()
                    .get(&k)
                    .map(|m| (PathBuf::from(&m.info.dir), m.vol.clone()));
                m.map(|m| (m, op))
            } else {
                None
            };
            let Some(((dir, vol), _op)) = mounted else {
                return Ok(d.engine.checkpoint_with(&t, &ws, label, keep_until).await?);
            };
            if let Some(l) = &label {
                strata_format::name::validate_label(l).map_err(strata_engine::Error::from)?;
            }
            fsfreeze(&dir, true).await?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let cp = tokio::spawn(async move { vol.checkpoint_reporting_cut(label, keep_until, tx).await });
            // Thawed at the cut, or when the checkpoint failed before it: never left frozen.
            let _ = rx.await;
            let mut thawed = fsfreeze(&dir, false).await;
            for _ in 0..10 {
                if thawed.is_ok() {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                thawed = fsfreeze(&dir, false).await;
            }
            if let Err(e) = thawed {
                tracing::error!(workspace = ws, error = %e.message, "thawing the filesystem failed");
            }
            cp.await
                .map_err(|e| ApiError::internal(format!("checkpoint task: {e}")))?
                .map_err(ApiError::from)
        })
        .await
    }

    /// After a restart (clean or kill -9): clears what a previous run left of each recorded
    /// mount and mounts it again. Returns the workspaces mounted.
    pub(crate) async fn resume_mounts(self: &Arc<Self>) -> Vec<Key> {
        let root = self.engine.config().data_dir.join("mounts");
        let mut done = vec![];
        let Ok(rd) = std::fs::read_dir(&root) else {
            return done;
        };
        for e in rd.flatten() {
            let rec = e.path().join("mount.json");
            let Some(info) = std::fs::read(&rec)
                .ok()
                .and_then(|b| serde_json::from_slice::<MountInfo>(&b).ok())
            else {
                continue;
            };
            // The record must be this node's own, at its own place.
            if self.mount_home(&info.tenant, &info.workspace) != e.path() {
                tracing::warn!(path = %rec.display(), "ignoring a mount record in the wrong place");
                continue;
            }
            self.clear_stale(&info, &e.path()).await;
            let req = MountRequest {
                backend: info.backend,
                mkfs: None,
                target: None,
                read_only: info.read_only,
            };
            let _ = std::fs::remove_file(&rec);
            let k = (info.tenant.clone(), info.workspace.clone());
            // The target was checked when it was first named; it is bound again as it was.
            match self.remount(&info, req).await {
                Ok(_) => done.push(k),
                Err(err) => {
                    tracing::error!(tenant = info.tenant, workspace = info.workspace, error = %err.message, "not remounting workspace");
                    // Keep the record: the operator (or the next restart) retries.
                    let _ = write_record(&rec, &info);
                }
            }
        }
        done
    }

    async fn remount(
        self: &Arc<Self>,
        info: &MountInfo,
        req: MountRequest,
    ) -> Result<MountInfo, ApiError> {
        let (d, info, _req) = (self.clone(), info.clone(), req);
        own_task(async move {
            let k = (info.tenant.clone(), info.workspace.clone());
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            let vol = d.engine.attach(&info.tenant, &info.workspace).await?;
            let mut fresh = info.clone();
            fresh.device = None;
            let m = d.bring_up(fresh, vol, false).await?;
            let out = m.info.clone();
            d.lock_mounts().insert(k, m);
            Ok(out)
        })
        .await
    }

    /// What a dead run leaves: a frozen or mounted ext4 on a loop device whose FUSE connection
    /// is gone. Everything is detached lazily; nothing a sandbox fsync'd is lost (it reached
    /// the volume before the fsync returned).
    async fn clear_stale(&self, info: &MountInfo, home: &Path) {
        if let Some(t) = &info.target {
            if is_mount_point(Path::new(t)) {
                let _ = rustix::mount::unmount(Path::new(t), rustix::mount::UnmountFlags::DETACH);
            }
        }
        let fs_dir = PathBuf::from(&info.dir);
        if is_mount_point(&fs_dir) {
            // Frozen if the crash came mid-checkpoint (thawing an unfrozen one just fails).
            let _ = tokio::process::Command::new("fsfreeze")
                .arg("-u")
                .arg(&fs_dir)
                .output()
                .await;
            let _ = rustix::mount::unmount(&fs_dir, rustix::mount::UnmountFlags::DETACH);
        }
        let disk_dir = home.join("disk");
        // Every loop device over a disk of ours (the record may predate its device, if the
        // crash came mid-mount).
        let mounts_root = self.engine.config().data_dir.join("mounts");
        if let Ok(rd) = std::fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !name.starts_with("loop") {
                    continue;
                }
                let dev = format!("/dev/{name}");
                if let Some(f) = loop_backing(&dev).filter(|f| f.starts_with(&mounts_root)) {
                    if f.starts_with(&disk_dir) {
                        loop_detach(&dev, &f).await;
                    }
                }
            }
        }
        // A FUSE mount whose daemon died answers ENOTCONN; it can only be detached.
        let _ = rustix::mount::unmount(&disk_dir, rustix::mount::UnmountFlags::DETACH);
    }

    /// Orderly stop: unmounts every mount cleanly (its filesystem synced to the volume), keeping
    /// the records so that the next start mounts them again.
    pub(crate) async fn stop_all_mounts(&self) {
        let all: Vec<(Key, Mounted)> = self.lock_mounts().drain().collect();
        for (_, mut m) in all {
            self.tear_down(&mut m).await;
        }
    }
}
