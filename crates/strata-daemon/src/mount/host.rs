//! Host-side primitives of mounts, each safe against what a tenant controls: bind targets
//! resolved beneath the tenant's own mount root with no symlink, no `..` and no mount crossed
//! (so never inside another mounted workspace, whose contents a sandbox controls), binds made
//! through the file descriptor that was checked, freezes by ioctl on a descriptor whose device
//! was checked, and a read-only placeholder that keeps a target from falling through to the
//! host directory underneath while its workspace is not mounted.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::mount::{MountFlags, UnmountFlags};

/// Serialises target checks and binds node-wide: two mounts never race onto one directory.
pub static BIND_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Why a target was refused; every reason reads the same to the tenant (no oracle of which
/// host paths exist).
#[derive(Debug)]
pub struct BadTarget;

/// The tenant's mount root, `ROOT/{tenant}` (made on first use).
pub fn tenant_root(root: &Path, tenant: &str) -> PathBuf {
    root.join(tenant)
}

/// Opens `target` (absolute, lexically under `ROOT/{tenant}/`) beneath the tenant root: no
/// symlinks, no `..`, no mount point crossed. With `mounted_ok`, the last component may be a
/// mount point (a placeholder or a dead mount left by a crash, which the new bind covers) and
/// need not be empty; otherwise it must be an empty directory that is not a mount point.
pub fn open_target(
    root: &Path,
    tenant: &str,
    target: &str,
    mounted_ok: bool,
) -> Result<OwnedFd, BadTarget> {
    let comps = target_components(root, tenant, target)?;
    let strict = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
    let dir = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let root_fd = rustix::fs::open(root, dir, Mode::empty()).map_err(|_| BadTarget)?;
    let tenant_fd = match rustix::fs::openat2(&root_fd, tenant, dir, Mode::empty(), strict) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => {
            rustix::fs::mkdirat(&root_fd, tenant, Mode::from_raw_mode(0o755))
                .map_err(|_| BadTarget)?;
            rustix::fs::openat2(&root_fd, tenant, dir, Mode::empty(), strict)
                .map_err(|_| BadTarget)?
        }
        Err(_) => return Err(BadTarget),
    };
    let (last, parents) = comps.split_last().ok_or(BadTarget)?;
    let parent_fd = if parents.is_empty() {
        tenant_fd
    } else {
        let parent: PathBuf = parents.iter().collect();
        rustix::fs::openat2(&tenant_fd, &parent, dir, Mode::empty(), strict)
            .map_err(|_| BadTarget)?
    };
    let flags = if mounted_ok {
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS
    } else {
        strict
    };
    let fd = rustix::fs::openat2(
        &parent_fd,
        *last,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        flags,
    )
    .map_err(|_| BadTarget)?;
    if !mounted_ok {
        let empty = std::fs::read_dir(fd_path(&fd))
            .map_err(|_| BadTarget)?
            .next()
            .is_none();
        if !empty {
            return Err(BadTarget);
        }
    }
    Ok(fd)
}

/// The components of `target` below `ROOT/{tenant}`, checked lexically: absolute, under the
/// tenant root, plain names only, in normal form, nothing mountinfo escapes.
fn target_components<'a>(
    root: &Path,
    tenant: &str,
    target: &'a str,
) -> Result<Vec<&'a std::ffi::OsStr>, BadTarget> {
    let troot = tenant_root(root, tenant);
    let p = Path::new(target);
    let rel = p.strip_prefix(&troot).map_err(|_| BadTarget)?;
    let comps: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(s) => Ok(s),
            _ => Err(BadTarget),
        })
        .collect::<Result<_, _>>()?;
    // Exactly the normal form (no `//`, `/./`, trailing `/`), and nothing mountinfo escapes.
    let normal: PathBuf = troot.join(comps.iter().collect::<PathBuf>());
    if comps.is_empty()
        || target.len() > 4096
        || normal.as_os_str() != p.as_os_str()
        || target.contains([' ', '\t', '\n', '\\'])
    {
        return Err(BadTarget);
    }
    Ok(comps)
}

/// The magic link naming exactly the file an open descriptor is.
pub fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Binds `src` onto the checked target `fd`.
pub fn bind_onto(src: &Path, fd: &OwnedFd) -> std::io::Result<()> {
    rustix::mount::mount_bind(src, fd_path(fd)).map_err(Into::into)
}

/// A mount point as mountinfo spells it: absolute, symlinks resolved where the path still
/// resolves (a dead FUSE mount does not), octal escapes for space, tab, newline, backslash.
fn mountinfo_name(dir: &Path) -> String {
    let p = std::fs::canonicalize(dir)
        .or_else(|_| std::path::absolute(dir))
        .unwrap_or_else(|_| dir.to_path_buf());
    p.to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012")
}

/// Whether a block device is still in use (mounted anywhere, in any mount namespace): an
/// exclusive open of a block device fails with EBUSY while a filesystem holds it.
pub fn in_use(dev: &str) -> bool {
    matches!(
        rustix::fs::open(
            dev,
            OFlags::RDONLY | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::empty()
        ),
        Err(rustix::io::Errno::BUSY)
    )
}

/// Whether `dir` is a mount point (in this mount namespace). For the daemon's own directories
/// (under its data directory, which no tenant controls): a tenant's target is checked through
/// a descriptor ([`target_is_mounted`]).
pub fn is_mount_point(dir: &Path) -> bool {
    let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let d = mountinfo_name(dir);
    mi.lines().any(|l| l.split(' ').nth(4) == Some(&*d))
}

/// The id of the mount an open descriptor is on (`/proc/self/fdinfo`'s `mnt_id`).
fn mount_id(fd: &OwnedFd) -> Option<u64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A tenant's target resolved for a later step (an unmount, a cover): the directory holding
/// it, opened beneath the tenant root with no symlink, no `..` and no mount crossed (as at
/// mount time), and the target's last component. Every step after mount time goes through
/// this, never through the target's path string: a sandbox that swapped a parent directory
/// for a symlink since has its own target refused, and can never point a step at another
/// tenant's mount or at a host directory.
pub struct CheckedTarget {
    parent: OwnedFd,
    last: std::ffi::OsString,
}

impl CheckedTarget {
    pub fn open(root: &Path, tenant: &str, target: &str) -> Result<CheckedTarget, BadTarget> {
        let comps = target_components(root, tenant, target)?;
        let strict = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
        let dir = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let root_fd = rustix::fs::open(root, dir, Mode::empty()).map_err(|_| BadTarget)?;
        let tenant_fd = rustix::fs::openat2(&root_fd, tenant, dir, Mode::empty(), strict)
            .map_err(|_| BadTarget)?;
        let (last, parents) = comps.split_last().ok_or(BadTarget)?;
        let parent = if parents.is_empty() {
            tenant_fd
        } else {
            let p: PathBuf = parents.iter().collect();
            rustix::fs::openat2(&tenant_fd, &p, dir, Mode::empty(), strict)
                .map_err(|_| BadTarget)?
        };
        Ok(CheckedTarget {
            parent,
            last: (*last).to_os_string(),
        })
    }

    /// The top of whatever is at the target now (the mount on top, or the directory itself),
    /// opened through the checked parent with no symlink followed. `O_PATH`, so a dead FUSE
    /// mount there opens too.
    fn top(&self) -> Result<OwnedFd, BadTarget> {
        rustix::fs::openat2(
            &self.parent,
            &self.last,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
        )
        .map_err(|_| BadTarget)
    }

    /// Whether something is mounted at the target: its top is on another mount than the
    /// directory holding it.
    pub fn is_mounted(&self) -> bool {
        match (self.top(), mount_id(&self.parent)) {
            (Ok(top), Some(parent)) => mount_id(&top).is_some_and(|m| m != parent),
            _ => false,
        }
    }

    /// The target's path through the checked parent (`/proc/self/fd/N/LAST`): what a syscall
    /// taking a path is given, with its last component never followed if a symlink.
    fn via_parent(&self) -> PathBuf {
        fd_path(&self.parent).join(&self.last)
    }

    /// Unmounts the top layer at the target (lazily if `lazy`); false if nothing is mounted
    /// there. The target's last component cannot change while it is a mount point (a rename
    /// or removal of a mount point fails), and the unmount does not follow a symlink there.
    pub fn unmount_top(&self, lazy: bool) -> std::io::Result<bool> {
        if !self.is_mounted() {
            return Ok(false);
        }
        let flags = if lazy {
            UnmountFlags::NOFOLLOW | UnmountFlags::DETACH
        } else {
            UnmountFlags::NOFOLLOW
        };
        rustix::mount::unmount(self.via_parent(), flags)?;
        Ok(true)
    }

    /// Unmounts every layer at the target (a bind, a placeholder, a dead mount under them),
    /// lazily if busy.
    pub fn unmount_all(&self) {
        for _ in 0..64 {
            match self.unmount_top(false) {
                Ok(false) => return,
                Ok(true) => {}
                Err(_) => {
                    if !matches!(self.unmount_top(true), Ok(true)) {
                        return;
                    }
                }
            }
        }
    }

    /// Whether the topmost mount at the target is a placeholder: the mountinfo line of the
    /// top's mount id (never a comparison of path strings).
    pub fn top_is_placeholder(&self) -> bool {
        let Some(id) = self.top().ok().as_ref().and_then(mount_id) else {
            return false;
        };
        let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return false;
        };
        mi.lines()
            .find(|l| l.split(' ').next().and_then(|v| v.parse::<u64>().ok()) == Some(id))
            .and_then(|l| l.split(" - ").nth(1))
            .is_some_and(|rest| {
                let mut f = rest.split(' ');
                f.next() == Some("tmpfs") && f.next() == Some(PLACEHOLDER)
            })
    }

    /// Covers the target with a placeholder unless one is on top already: mounted onto the
    /// descriptor of its top, so it lands exactly there.
    pub fn cover(&self) {
        if self.top_is_placeholder() {
            return;
        }
        let r = self
            .top()
            .map_err(|_| std::io::Error::other("the target is not a directory any more"))
            .and_then(|fd| placeholder(&fd_path(&fd)));
        if let Err(e) = r {
            tracing::warn!(target = ?self.last, error = %e, "covering a target failed");
        }
    }

    /// The device of the filesystem on top of the target.
    pub fn top_dev(&self) -> Option<u64> {
        let fd = self.top().ok()?;
        rustix::fs::fstat(&fd).ok().map(|st| st.st_dev)
    }
}

/// Covers a tenant's target through a [`CheckedTarget`]; a target that no longer resolves
/// safely (a symlink or a mount on the way) is left alone and said loudly: covering its path
/// string would follow whatever a sandbox put there.
pub fn cover(root: &Path, tenant: &str, target: &str) {
    match CheckedTarget::open(root, tenant, target) {
        Ok(t) => t.cover(),
        Err(BadTarget) => tracing::error!(
            tenant,
            target,
            "a mount target no longer resolves safely (a symlink or a mount on its path): not covered"
        ),
    }
}

/// Unmounts every layer at a tenant's target through a [`CheckedTarget`] (nothing if it no
/// longer resolves safely).
pub fn unmount_all(root: &Path, tenant: &str, target: &str) {
    match CheckedTarget::open(root, tenant, target) {
        Ok(t) => t.unmount_all(),
        Err(BadTarget) => tracing::error!(
            tenant,
            target,
            "a mount target no longer resolves safely (a symlink or a mount on its path): not unmounted"
        ),
    }
}

const PLACEHOLDER: &str = "strata-unmounted";

/// Covers `target` with an empty read-only tmpfs: while its workspace is not mounted (the
/// daemon stopped, a remount failed), a sandbox writing there gets EROFS instead of writing
/// to the host directory underneath, where an acknowledged write would be hidden later.
pub fn placeholder(target: &Path) -> std::io::Result<()> {
    let flags = MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    let data = c"size=4k,mode=0555";
    rustix::mount::mount(PLACEHOLDER, target, "tmpfs", flags, data).map_err(Into::into)
}

const FIFREEZE: libc::c_ulong = 0xC004_5877; // _IOWR('X', 119, int)
const FITHAW: libc::c_ulong = 0xC004_5878; // _IOWR('X', 120, int)

#[allow(unsafe_code)]
fn freeze_ioctl(fd: &OwnedFd, op: libc::c_ulong) -> std::io::Result<()> {
    let mut arg: libc::c_int = 0;
    // SAFETY: FIFREEZE and FITHAW take a pointer to an int they do not keep; `fd` is an open
    // descriptor owned by the caller for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_fd().as_raw_fd(), op, &mut arg) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A filesystem frozen through a descriptor of its root, checked to be on `device`: the
/// freeze can never land on another filesystem (say, the data directory's, if the mount went
/// away in between). Thawed by [`Frozen::thaw`].
pub struct Frozen {
    fd: OwnedFd,
}

impl Frozen {
    pub fn freeze(dir: &Path, device: &str) -> std::io::Result<Frozen> {
        let fd = rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )?;
        let dev = rustix::fs::stat(device)?.st_rdev;
        if rustix::fs::fstat(&fd)?.st_dev != dev {
            return Err(std::io::Error::other(format!(
                "{} is not the filesystem on {device}",
                dir.display()
            )));
        }
        freeze_ioctl(&fd, FIFREEZE)?;
        Ok(Frozen { fd })
    }

    /// Thaws, retrying while the kernel refuses (EINVAL: it is not frozen any more).
    pub fn thaw(self) {
        for i in 0..600 {
            match freeze_ioctl(&self.fd, FITHAW) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return,
                Err(e) => {
                    if i % 50 == 0 {
                        tracing::error!(error = %e, "thawing a filesystem failed; retrying");
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        }
        tracing::error!("a filesystem stays frozen: thaw it with fsfreeze -u");
    }
}

/// syncfs of the filesystem mounted at `dir` (best effort).
pub fn sync_fs(dir: &Path) {
    if let Ok(fd) = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        let _ = rustix::fs::syncfs(&fd);
    }
}

/// Thaws whatever is mounted at `dir` if it is frozen (after a crash mid-checkpoint).
pub fn thaw_path(dir: &Path) {
    if let Ok(fd) = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    ) {
        let _ = freeze_ioctl(&fd, FITHAW);
    }
}
