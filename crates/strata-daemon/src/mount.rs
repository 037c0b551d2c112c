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
//! Mounts are off unless the operator gives a `--mount-root` (the host kernel then parses
//! filesystems whose bytes a tenant wrote). The internal directories never come from names
//! (`{h}` hashes tenant and workspace). A tenant names only a bind target: an empty directory
//! under its own `ROOT/{tenant}/`, resolved with no symlink, no `..` and no mount crossed, and
//! bound through the descriptor that was checked (`mount/host.rs`). While a recorded mount is
//! down (daemon stopped, remount failed) its target is covered by a read-only placeholder, so
//! a sandbox's writes there fail instead of landing in the host directory underneath.
//! A mounted workspace is not exported over NBD and cannot be detached, deleted or rolled
//! back (any of those would change the disk under a mounted filesystem): umount first.

pub(crate) mod fuse;
pub(crate) mod host;
pub(crate) mod kernel;
mod loopdev;
mod netlink;
mod recover;

use crate::shares::Kind;
pub(crate) mod resize;

use loopdev::{loop_backing, loop_detach, loop_detach_within};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use strata_engine::{Published, Volume};

use crate::error::ApiError;
use crate::exports::{own_task, Key};
use crate::Daemon;

/// How a mounted workspace reaches the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The native FUSE export under a loop device (no kernel module beyond fuse and loop).
    #[default]
    Fuse,
    /// The kernel NBD client over netlink.
    Nbd,
}

/// `POST /v1/workspaces/{name}/mount`.
#[derive(Debug, Serialize, Deserialize, Default, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
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
    /// Kernel NBD: the connections being served now (of [`kernel::CONNECTIONS`]); not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<usize>,
}

/// What a mount asked of a node that has begun to stop gets.
pub(crate) fn stopping_error() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "this node is stopping",
    )
}

/// A mount operation in progress (see [`Daemon::mount_op`]).
pub(crate) struct MountOp<'a>(&'a Daemon);

impl Drop for MountOp<'_> {
    fn drop(&mut self) {
        self.0.mount_ops.send_modify(|n| *n -= 1);
    }
}

/// A live mount: its record and what holds it up.
pub(crate) struct Mounted {
    pub info: MountInfo,
    fuse: Option<fuse::FuseDisk>,
    kernel: Option<kernel::KernelDisk>,
    vol: Arc<Volume>,
    /// This mount's bind is on top of the target (only then is the top layer ours to remove).
    bound: bool,
    /// The mount in its tenant's share of the node's mounts (`shares.rs`).
    _share: Option<crate::shares::Share>,
}

const FSTYPE: &str = "ext4";
/// Mounts a node holds at once (each is a loop device, a FUSE session and a kernel filesystem).
pub const MAX_MOUNTS: usize = 128;

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
        .await;
    stdout_of(cmd, args, out)
}

/// [`run`] for a tool that writes or parses a tenant's filesystem: confined
/// (`strata_engine::confine`), with no capabilities, killed past its limits.
async fn run_confined(cmd: &str, args: &[&str]) -> Result<String, ApiError> {
    use strata_engine::confine;
    let out = confine::run_async(
        tokio::process::Command::new(cmd).args(args),
        confine::Keep::default(),
        confine::Limits::default(),
    )
    .await;
    stdout_of(cmd, args, out)
}

/// A tool's stdout if it ran and succeeded; else its error or stderr.
fn stdout_of(
    cmd: &str,
    args: &[&str],
    out: std::io::Result<std::process::Output>,
) -> Result<String, ApiError> {
    let out = out.map_err(|e| ApiError::internal(format!("{cmd}: {e} (is it installed?)")))?;
    if !out.status.success() {
        return Err(ApiError::internal(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("blocking task: {e}")))
}

fn unmount_now(dir: &Path) -> std::io::Result<()> {
    match rustix::mount::unmount(dir, rustix::mount::UnmountFlags::NOFOLLOW) {
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

use host::is_mount_point;

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

    /// Counts a mount operation as running until the guard is dropped (see `stop_all_mounts`).
    /// Taken before the operation checks `mounts_stopping`.
    pub(crate) fn mount_op(&self) -> MountOp<'_> {
        self.mount_ops.send_modify(|n| *n += 1);
        MountOp(self)
    }

    /// A mount operation on `k`: counted (a stop waits for it), then under the workspace's op
    /// lock.
    pub(crate) async fn mount_op_on(
        &self,
        k: &Key,
    ) -> (MountOp<'_>, tokio::sync::OwnedMutexGuard<()>) {
        let running = self.mount_op();
        (running, self.op_lock(k).lock_owned().await)
    }

    /// Whether the node has begun to stop (no new mounts).
    pub(crate) fn stopping(&self) -> bool {
        self.mounts_stopping
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Records a live mount, unless the node has begun to stop: then the mount is handed
    /// back, for the caller to stop (the stop, waiting for this operation, does not list it).
    fn insert_unless_stopping(&self, k: Key, m: Mounted) -> Option<Mounted> {
        if self.stopping() {
            return Some(m);
        }
        self.lock_mounts().insert(k, m);
        None
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
            // A mount that is down (its remount failed) is mounted again at the next start.
            None if self.has_mount_record(t, ws) => Err(conflict(format!(
                "workspace {ws:?} has a mount that is down (the next start remounts it): umount it before {what}"
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
            .map(|m| MountInfo {
                connections: m.kernel.as_ref().map(|k| k.live()),
                ..m.info.clone()
            })
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

    /// The backend name a kernel NBD device of this mount carries (`/sys/block/nbdN/backend`):
    /// this node and the mount's home, never the names themselves.
    fn nbd_backend_name(&self, t: &str, ws: &str) -> String {
        let home = self.mount_home(t, ws);
        let h = home
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        format!("{}{h}", self.nbd_backend_prefix())
    }

    /// What every kernel NBD device this node connects is named with: a hash of its node id
    /// (random, persisted in its data directory), so that two daemons on one host (say, in
    /// two containers with the same data path) never take each other's devices for theirs.
    fn nbd_backend_prefix(&self) -> String {
        let node = blake3::hash(self.engine.node_id().as_bytes());
        format!("strata-{}-", &node.to_hex()[..12])
    }

    fn mount_root(&self) -> Result<&PathBuf, ApiError> {
        self.mount_root.as_ref().ok_or_else(|| {
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "mounts are off on this node: the operator enables them with --mount-root",
            )
        })
    }

    /// Checks a tenant-named bind target (again at bind time, under the bind lock).
    async fn check_target(&self, t: &str, target: &str) -> Result<String, ApiError> {
        let root = self.mount_root()?.clone();
        let (t, target) = (t.to_string(), target.to_string());
        let troot = host::tenant_root(&root, &t);
        blocking(move || {
            host::open_target(&root, &t, &target, false)
                .map(|_| target.clone())
                .map_err(|_| {
                    ApiError::invalid(format!(
                        "mount target {target:?} is not an empty directory under your mount root {} (no symlinks, no mount points on the way)",
                        troot.display()
                    ))
                })
        })
        .await?
    }

    /// Mounts a workspace on this node (idempotent for the same request).
    pub(crate) async fn mount_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
        req: MountRequest,
    ) -> Result<MountInfo, ApiError> {
        if let Some(f) = &req.mkfs {
            if f != FSTYPE {
                return Err(ApiError::invalid(format!(
                    "mkfs {f:?}: only {FSTYPE} is supported"
                )));
            }
        }
        self.mount_root()?;
        let target = match req.target.as_deref() {
            Some(tg) => Some(self.check_target(t, tg).await),
            None => None,
        };
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = (t.clone(), ws.clone());
            let (_running, _op) = d.mount_op_on(&k).await;
            if let Some(m) = d.lock_mounts().get(&k) {
                // The same request again (its target is a mount point now, so it no longer
                // passes the check: compare what was asked).
                let same =
                    req.target.is_none() || m.info.target.as_deref() == req.target.as_deref();
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
            if d.stopping() {
                return Err(stopping_error());
            }
            if d.has_mount_record(&t, &ws) {
                return Err(conflict(format!(
                    "workspace {ws:?} has a mount that is down: umount it first"
                )));
            }
            if d.lock_mounts().len() >= MAX_MOUNTS {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "busy",
                    format!("this node holds {MAX_MOUNTS} mounts already"),
                ));
            }
            if let Some(p) = d.export_protocol(&t, &ws) {
                return Err(conflict(format!(
                    "workspace {ws:?} is attached over {p}: detach it before mounting"
                )));
            }
            let info = MountInfo {
                tenant: t.clone(),
                workspace: ws.clone(),
                backend: req.backend,
                dir: d.mount_home(&t, &ws).join("fs").display().to_string(),
                target,
                device: None,
                fstype: FSTYPE.into(),
                read_only: req.read_only,
                connections: None,
            };
            d.attach_and_mount(info, req.mkfs.is_some(), false).await
        })
        .await
    }

    /// Under the workspace's op lock: attaches, brings the mount up and records it live; an
    /// attach made here is undone if the mount fails.
    async fn attach_and_mount(
        &self,
        info: MountInfo,
        mkfs: bool,
        again: bool,
    ) -> Result<MountInfo, ApiError> {
        let (t, ws) = (info.tenant.clone(), info.workspace.clone());
        let (_quota, share) = match again {
            // A remount after a restart brings back what was already counted.
            true => (None, self.shares.take_over(&t, Kind::Mounts, 1)),
            false => {
                let share = self.shares.take(&t, Kind::Mounts, 1)?;
                (self.attach_quota(&t, &ws).await?, share)
            }
        };
        let was_attached = self.engine.volume(&t, &ws).is_some();
        let vol = self.engine.attach(&t, &ws).await?;
        match self.bring_up(info, vol, mkfs, again).await {
            Ok(mut m) => {
                m._share = Some(share);
                let out = m.info.clone();
                if let Some(m) = self.insert_unless_stopping((t, ws), m) {
                    // The stop took its list before this mount finished: treat it as stop does.
                    self.stop_one(m).await;
                    return Err(stopping_error());
                }
                Ok(out)
            }
            Err(e) => {
                self.undo_attach(&t, &ws, was_attached, "mount").await;
                Err(e)
            }
        }
    }

    /// FUSE export, loop device, (mkfs), mount, bind, record; undoes what it did on failure.
    /// `again`: a remount after a restart (the target may still be covered by a placeholder or
    /// a dead mount, which the new bind covers in turn).
    async fn bring_up(
        &self,
        mut info: MountInfo,
        vol: Arc<Volume>,
        mkfs: bool,
        again: bool,
    ) -> Result<Mounted, ApiError> {
        let root = self.mount_root()?.clone();
        let home = self.mount_home(&info.tenant, &info.workspace);
        let record = home.join("mount.json");
        let (disk_dir, fs_dir) = (home.join("disk"), PathBuf::from(&info.dir));
        {
            use std::os::unix::fs::DirBuilderExt;
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true).mode(0o700);
            b.create(&disk_dir).map_err(io_err("mount directory"))?;
            b.create(&fs_dir).map_err(io_err("mount directory"))?;
        }
        // Whether the disk holds anything (metadata only: no data is read), and an ext4
        // superblock, before the kernel sees it.
        let blank = vol
            .allocation(0, vol.size())
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
        // The intent first: a crash from here on leaves a record, and the next start clears
        // whatever this attempt left (its loop device is found by its backing file).
        write_record(&record, &info).map_err(io_err("mount record"))?;
        let disk = match info.backend {
            Backend::Fuse => {
                let (vol, dir) = (vol.clone(), disk_dir.clone());
                let rt = tokio::runtime::Handle::current();
                blocking(move || fuse::FuseDisk::mount(vol, &dir, rt))
                    .await?
                    .map(|f| (Some(f), None))
                    .map_err(io_err("fuse mount"))
            }
            Backend::Nbd => {
                let backend = self.nbd_backend_name(&info.tenant, &info.workspace);
                kernel::KernelDisk::connect(vol.clone(), backend, info.read_only, self.nbd_timeouts)
                    .await
                    .map(|k| (None, Some(k)))
                    .map_err(|e| match e.kind() {
                        std::io::ErrorKind::Unsupported => ApiError::new(
                            StatusCode::NOT_IMPLEMENTED,
                            "unsupported",
                            format!("{e}: use backend fuse on this host"),
                        ),
                        _ => ApiError::internal(format!("kernel nbd: {e}")),
                    })
            }
        };
        let (fuse, kernel) = match disk {
            Ok(d) => d,
            Err(e) => {
                if !again {
                    let _ = std::fs::remove_file(&record);
                }
                return Err(e);
            }
        };
        let file = fuse.as_ref().map(|f| f.file.clone());
        let nbd_dev = kernel.as_ref().map(|k| kernel::device_path(k.index));
        let mut m = Mounted {
            info: info.clone(),
            fuse,
            kernel,
            vol,
            bound: false,
            _share: None,
        };
        let up = async {
            let dev = match (&file, nbd_dev) {
                (_, Some(dev)) => dev,
                (Some(file), None) => {
                    let f = file.to_string_lossy();
                    let mut args = vec!["--find", "--show"];
                    if info.read_only {
                        args.push("--read-only");
                    }
                    args.push(&f);
                    run("losetup", &args).await?
                }
                (None, None) => return Err(ApiError::internal("mount without a disk")),
            };
            info.device = Some(dev.clone());
            m.info.device = Some(dev.clone());
            write_record(&record, &info).map_err(io_err("mount record"))?;
            if blank && mkfs {
                run_confined("mkfs.ext4", &["-q", "-F", &dev]).await?;
            }
            // A disk grown while it was not mounted: its filesystem follows it, offline here
            // only where the kernel would refuse online growth (not at a restart's remount,
            // which must not wait on it).
            let made_now = blank && mkfs;
            let grow = !(info.read_only || made_now || again);
            // An offline grow interrupted by a crash is finished (checked first) even at a
            // restart's remount: a half-grown filesystem is never mounted unchecked.
            let interrupted = resize::grow_marker(&home).exists();
            if (grow || interrupted) && !info.read_only && !resize::can_grow_online() {
                // A filesystem e2fsck or resize2fs failed on (or was killed in) is not mounted.
                resize::grow_unmounted(&dev, &home).await?;
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
                blocking(move || rustix::mount::mount(d2.as_str(), &dir, FSTYPE, flags, None))
                    .await?
                    .map_err(|e| {
                        ApiError::internal(format!("mounting {FSTYPE} from {dev}: {e}"))
                    })?;
            }

            if grow && resize::can_grow_online() {
                if let Err(e) = resize::grow_filesystem(&dev).await {
                    tracing::warn!(workspace = %info.workspace, error = %e.message, "not growing the filesystem onto its disk");
                }
            }
            if let Some(t) = &info.target {
                let (tenant, t, src) = (info.tenant.clone(), t.clone(), fs_dir.clone());
                blocking(move || {
                    let _one = host::BIND_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                    let fd = host::open_target(&root, &tenant, &t, again).map_err(|_| {
                        ApiError::invalid(format!(
                            "mount target {t:?} is no longer an empty directory under your mount root"
                        ))
                    })?;
                    host::bind_onto(&src, &fd)
                        .map_err(|e| ApiError::internal(format!("binding onto {t}: {e}")))
                })
                .await??;
                m.bound = true;
            }
            Ok::<(), ApiError>(())
        };
        match up.await {
            Ok(()) => Ok(m),
            Err(e) => {
                self.tear_down(&mut m).await;
                if !again {
                    let _ = std::fs::remove_file(&record);
                }
                Err(e)
            }
        }
    }

    /// Unmounts this mount's own layers (its bind, the filesystem, the loop device, the FUSE
    /// export), best effort, in order, lazily where busy; leaves whatever was at the target
    /// before the bind. The record stays: the caller forgets it when that is what it means.
    async fn tear_down(&self, m: &mut Mounted) {
        let target = m.info.target.clone().filter(|_| m.bound);
        m.bound = false;
        let dir = PathBuf::from(&m.info.dir);
        let (root, tenant) = (self.mount_root.clone(), m.info.tenant.clone());
        let _ = blocking(move || {
            // Everything the filesystem holds reaches the volume first, even if a copy of the
            // mount elsewhere (another mount namespace) keeps the filesystem alive.
            host::sync_fs(&dir);
            // The bind, through the checked target (never its path string).
            if let (Some(t), Some(root)) = (target, root) {
                match host::CheckedTarget::open(&root, &tenant, &t) {
                    Ok(ct) => {
                        if ct.unmount_top(false).is_err() {
                            let _ = ct.unmount_top(true);
                        }
                    }
                    Err(_) => tracing::error!(
                        tenant,
                        target = t,
                        "a mount target no longer resolves safely (a symlink or a mount on its path): its bind is left"
                    ),
                }
            }
            fuse::unmount_retrying(&dir);
        })
        .await;
        if let (Some(dev), Some(f)) = (&m.info.device, &m.fuse) {
            loop_detach(dev, &f.file).await;
        }
        if let Some(k) = m.kernel.take() {
            k.disconnect().await;
        }
        if let Some(f) = m.fuse.take() {
            // The session ends when the kernel lets go of the file; a filesystem kept alive
            // elsewhere holds it: do not wait forever (the session thread ends with it).
            let h = tokio::task::spawn_blocking(move || f.unmount());
            if tokio::time::timeout(std::time::Duration::from_secs(15), h)
                .await
                .is_err()
            {
                tracing::warn!(workspace = m.info.workspace, "the FUSE export is still in use after its unmount (a mount in another namespace?); left to end with it");
            }
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
            // Counted: a stop waits for it, so a umount that fails and puts the mount back
            // does so before the stop takes its list.
            let k = (t.clone(), ws.clone());
            let (_running, _op) = d.mount_op_on(&k).await;
            let Some(mut m) = d.lock_mounts().remove(&k) else {
                return d.clear_down_mount(&t, &ws).await;
            };
            // A busy filesystem (a process still inside it) stays mounted: say so. The unmount
            // syncs the filesystem through FUSE tasks, so it runs off the runtime's workers.
            let (target, dir) = (m.info.target.clone(), m.info.dir.clone());
            let (root, tenant) = (d.mount_root.clone(), t.clone());
            let (dev, ro) = (m.info.device.clone(), m.info.read_only);
            let first = blocking(move || {
                // Bound again through a checked descriptor (over a placeholder left by a
                // restart, if that is what is under it), or covered.
                let rebind = |tg: &str| {
                    let Some(root) = &root else { return };
                    let _one = host::BIND_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                    let Ok(ct) = host::CheckedTarget::open(root, &tenant, tg) else {
                        return;
                    };
                    let over = ct.top_is_placeholder();
                    let rebound = host::open_target(root, &tenant, tg, over)
                        .ok()
                        .is_some_and(|fd| host::bind_onto(Path::new(&dir), &fd).is_ok());
                    if !rebound {
                        ct.cover();
                    }
                };
                let busy = |p: &str| {
                    unmount_now(Path::new(p)).map_err(|e| {
                        conflict(format!("cannot unmount {p}: {e} (is something using it?)"))
                    })
                };
                // The bind at the target, through the checked target: a target that no longer
                // resolves safely (its sandbox put a symlink or a mount on its path) is
                // refused, and nothing of anyone else's is unmounted in its place.
                if let Some(tg) = &target {
                    let refused = || {
                        conflict(format!(
                            "the mount target {tg} no longer resolves beneath the tenant's mount root without a symlink or a mount on its path: restore it, then umount"
                        ))
                    };
                    let root = root.as_ref().ok_or_else(refused)?;
                    let ct = host::CheckedTarget::open(root, &tenant, tg).map_err(|_| refused())?;
                    ct.unmount_top(false).map_err(|e| {
                        conflict(format!("cannot unmount {tg}: {e} (is something using it?)"))
                    })?;
                }
                if let Err(e) = busy(&dir) {
                    if let Some(tg) = &target {
                        rebind(tg);
                    }
                    return Err(e);
                }
                // Still mounted elsewhere (a container's mount namespace holds a copy): the
                // filesystem lives on and would keep writing to the volume. Mount it back and
                // say so, rather than detach under it.
                if let Some(dev) = dev.as_deref().filter(|d| host::in_use(d)) {
                    let flags = rustix::mount::MountFlags::NOSUID
                        | rustix::mount::MountFlags::NODEV
                        | if ro {
                            rustix::mount::MountFlags::RDONLY
                        } else {
                            rustix::mount::MountFlags::empty()
                        };
                    let _ = rustix::mount::mount(dev, Path::new(&dir), FSTYPE, flags, None);
                    if let Some(tg) = &target {
                        rebind(tg);
                    }
                    return Err(conflict(
                        "the filesystem is still mounted in another mount namespace (a running container?): stop what uses it, then umount".into(),
                    ));
                }
                Ok(())
            })
            .await?;
            if let Err(e) = first {
                d.lock_mounts().insert(k, m);
                return Err(e);
            }
            m.bound = false; // its bind is gone already
            d.tear_down(&mut m).await;
            let t2 = t.clone();
            // Layers left under the bind by an earlier crash (a placeholder, a dead mount).
            if let (Some(tg), Some(root)) = (m.info.target.clone(), d.mount_root.clone()) {
                let _ = blocking(move || host::unmount_all(&root, &t2, &tg)).await;
            }
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
        wait: bool,
    ) -> Result<Published, ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = (t.clone(), ws.clone());
            // Only a mounted workspace waits for its op lock (a mount or umount in progress).
            let mounted = if freeze && d.is_mounted(&t, &ws) {
                let op = d.op_lock(&k).lock_owned().await;
                d.lock_mounts()
                    .get(&k)
                    .and_then(|m| {
                        let dev = m.info.device.clone()?;
                        Some((PathBuf::from(&m.info.dir), dev, m.vol.clone()))
                    })
                    .map(|m| (m, op))
            } else {
                None
            };
            let Some(((dir, dev, vol), _op)) = mounted else {
                return Ok(d
                    .engine
                    .checkpoint_with(&t, &ws, label, keep_until, wait)
                    .await?);
            };
            if let Some(l) = &label {
                strata_format::name::validate_label(l).map_err(strata_engine::Error::from)?;
            }
            // FIFREEZE syncs the filesystem through this daemon's FUSE tasks: off the workers.
            let frozen = blocking(move || host::Frozen::freeze(&dir, &dev))
                .await?
                .map_err(|e| ApiError::internal(format!("freezing the filesystem: {e}")))?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let cp = tokio::spawn(async move {
                vol.checkpoint_reporting_cut(label, keep_until, wait, tx)
                    .await
            });
            // Thawed at the cut, or when the checkpoint failed before it: never left frozen.
            let _ = rx.await;
            let _ = blocking(move || frozen.thaw()).await;
            cp.await
                .map_err(|e| ApiError::internal(format!("checkpoint task: {e}")))?
                .map_err(ApiError::from)
        })
        .await
    }
}
