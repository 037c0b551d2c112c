//! The node's mounts: checked paths, binds and unbinds, usage.

use std::path::Path;

use rustix::fs::{AtFlags, StatxFlags, CWD};
use rustix::mount::{MountFlags, UnmountFlags};
use tonic::Status;

use crate::pb;

/// A target path as the kubelet names it: absolute, no `..`, no NUL, at most 4096 bytes.
pub fn check_target(p: &str) -> Result<String, Status> {
    let path = Path::new(p);
    let bad =
        !path.is_absolute() || p.contains('\0') || p.split('/').any(|c| c == ".." || c == ".");
    if bad {
        return Err(crate::invalid(format!(
            "path {p:?} is not an absolute path without '..'"
        )));
    }
    Ok(p.trim_end_matches('/').to_string())
}

fn io<'a>(what: &str, p: &'a Path) -> impl Fn(std::io::Error) -> Status + 'a {
    let what = what.to_string();
    move |e| Status::internal(format!("{what} {}: {e}", p.display()))
}

/// Creates the directory (its parent must exist); one that exists is fine.
pub fn make_dir(p: &Path) -> Result<(), Status> {
    match std::fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && p.is_dir() => Ok(()),
        Err(e) => Err(io("cannot create", p)(e)),
    }
}

/// Whether `p` is the root of a mount (statx's `STATX_ATTR_MOUNT_ROOT`), not following a
/// symlink there.
pub fn is_mount_point(p: &Path) -> bool {
    use rustix::fs::StatxAttributes as A;
    match rustix::fs::statx(CWD, p, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::BASIC_STATS) {
        Ok(s) => {
            s.stx_attributes_mask.contains(A::MOUNT_ROOT)
                && s.stx_attributes.contains(A::MOUNT_ROOT)
        }
        Err(_) => false,
    }
}

/// Whether `a` and `b` show the same directory of the same mounted filesystem.
pub fn same_mount(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((std::fs::metadata(a), std::fs::metadata(b)),
        (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino())
}

/// Binds `src` onto `dst` (created if missing), read-only if asked, never with devices or
/// set-uid programs honoured.
pub fn bind(src: &Path, dst: &Path, read_only: bool) -> Result<(), Status> {
    make_dir(dst)?;
    rustix::mount::mount_bind(src, dst).map_err(|e| io("cannot bind onto", dst)(e.into()))?;
    let mut flags = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV;
    if read_only {
        flags |= MountFlags::RDONLY;
    }
    if let Err(e) = rustix::mount::mount_remount(dst, flags, "") {
        let _ = rustix::mount::unmount(dst, UnmountFlags::NOFOLLOW);
        return Err(io("cannot restrict the bind at", dst)(e.into()));
    }
    Ok(())
}

/// Removes every mount stacked at `target` (a busy one is an error: something still uses it).
/// A reference held for a moment is waited out for up to a second (a process forked on the
/// node while a file was open there holds it until its exec).
pub fn unbind(target: &Path) -> Result<(), Status> {
    let mut busy = 0;
    for _ in 0..64 {
        if !is_mount_point(target) {
            return Ok(());
        }
        match rustix::mount::unmount(target, UnmountFlags::NOFOLLOW) {
            Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
            Err(rustix::io::Errno::BUSY) if busy < 10 => {
                busy += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(rustix::io::Errno::BUSY) => {
                return Err(Status::failed_precondition(format!(
                    "{} is busy: something still uses it",
                    target.display()
                )))
            }
            Err(e) => return Err(io("cannot unmount", target)(e.into())),
        }
    }
    Err(Status::internal(format!(
        "{} still has mounts after 64 unmounts",
        target.display()
    )))
}

/// Bytes and inodes of the filesystem at `p`.
pub fn usage(p: &Path) -> Result<Vec<pb::VolumeUsage>, Status> {
    use pb::volume_usage::Unit;
    let s = rustix::fs::statvfs(p).map_err(|e| io("cannot stat", p)(e.into()))?;
    let f = s.f_frsize as i64;
    Ok(vec![
        pb::VolumeUsage {
            available: s.f_bavail as i64 * f,
            total: s.f_blocks as i64 * f,
            used: (s.f_blocks - s.f_bfree) as i64 * f,
            unit: Unit::Bytes as i32,
        },
        pb::VolumeUsage {
            available: s.f_favail as i64,
            total: s.f_files as i64,
            used: (s.f_files - s.f_ffree) as i64,
            unit: Unit::Inodes as i32,
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_absolute_without_dot_dot() {
        assert_eq!(
            check_target("/var/lib/kubelet/x/mount/").unwrap(),
            "/var/lib/kubelet/x/mount"
        );
        for bad in ["relative", "/a/../b", "/a/./b", "/a\0b"] {
            assert!(check_target(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_root_is_a_mount_point_and_a_directory_in_it_is_not() {
        assert!(is_mount_point(Path::new("/")));
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("x");
        std::fs::create_dir(&sub).unwrap();
        assert!(!is_mount_point(&sub));
    }
}
