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
    // Exactly the normal form (no `//`, `/./`, trailing `/`), and nothing mountinfo escapes:
    // the string is what mount points are later compared with.
    let normal: PathBuf = troot.join(comps.iter().collect::<PathBuf>());
    if comps.is_empty()
        || target.len() > 4096
        || normal.as_os_str() != p.as_os_str()
        || target.contains([' ', '\t', '\n', '\\'])
    {
        return Err(BadTarget);
    }
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

/// Whether `dir` is a mount point (in this mount namespace).
pub fn is_mount_point(dir: &Path) -> bool {
    let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let d = mountinfo_name(dir);
    mi.lines().any(|l| l.split(' ').nth(4) == Some(&*d))
}

/// Whether the topmost mount at `dir` is a placeholder (mountinfo lists mounts in the order
/// they were made, so the last entry at a mount point is the one on top).
pub fn top_is_placeholder(dir: &Path) -> bool {
    let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let d = mountinfo_name(dir);
    mi.lines()
        .rfind(|l| l.split(' ').nth(4) == Some(&*d))
        .and_then(|l| l.split(" - ").nth(1))
        .is_some_and(|rest| {
            let mut f = rest.split(' ');
            f.next() == Some("tmpfs") && f.next() == Some(PLACEHOLDER)
        })
}

/// Covers `target` with a placeholder unless one is on top already.
pub fn cover(target: &Path) {
    if !top_is_placeholder(target) {
        if let Err(e) = placeholder(target) {
            tracing::warn!(target = %target.display(), error = %e, "covering a target failed");
        }
    }
}

const PLACEHOLDER: &str = "strata-unmounted";

/// Unmounts every layer at `target` (a bind, a placeholder, a dead mount under them), without
/// following a symlink there; lazily if busy.
pub fn unmount_all(target: &Path) {
    for _ in 0..64 {
        if !is_mount_point(target) {
            return;
        }
        if rustix::mount::unmount(target, UnmountFlags::NOFOLLOW).is_err() {
            let _ = rustix::mount::unmount(target, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH);
        }
    }
}

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
