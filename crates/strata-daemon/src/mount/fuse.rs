//! The native FUSE export: a workspace as one regular file, `DIR/disk`, for loop devices on
//! hosts without the nbd module.
//!
//! Every request goes straight to the volume: the file is opened in direct-I/O mode (the kernel
//! keeps no page cache for it, so nothing acknowledged sits where FLUSH cannot reach), a write
//! is answered only when the volume acknowledged it, and `fsync`/`fdatasync` of the file is
//! `Volume::flush`: what the workspace's mode promises for FLUSH. A loop device over the file
//! turns a filesystem's REQ_PREFLUSH into that fsync, and its discards into
//! `fallocate(PUNCH_HOLE)`, which trims.
//!
//! Requests run as tokio tasks (the session thread only decodes and dispatches), at most
//! [`IN_FLIGHT`] at once; each is bounded by the kernel's `max_write` (1 MiB here). Only the
//! mounting user (root) may open the file: no `allow_other`, mode 0600.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
};
use strata_engine::{Error, Volume};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;

/// Name of the one file in the FUSE mount.
pub const DISK: &str = "disk";
/// Requests served at once; the session thread waits for a slot (back-pressure to the kernel).
pub const IN_FLIGHT: usize = 64;
/// Largest read or write the kernel sends.
pub const MAX_IO: u32 = 1 << 20;

const ROOT: u64 = 1;
const FILE: u64 = 2;
const TTL: Duration = Duration::from_secs(1);
const FOPEN_DIRECT_IO: u32 = 1 << 0;
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

struct DiskFs {
    vol: Arc<Volume>,
    rt: Handle,
    slots: Arc<Semaphore>,
    created: SystemTime,
}

/// A mounted FUSE export; dropping it unmounts. The caller first releases every user of the
/// file (detaches the loop device): an unmount that stays busy ends in a lazy unmount.
pub struct FuseDisk {
    session: Option<fuser::BackgroundSession>,
    dir: PathBuf,
    pub file: PathBuf,
}

impl FuseDisk {
    /// Mounts `vol` at `dir` (an existing empty directory); the disk is `dir/disk`.
    pub fn mount(vol: Arc<Volume>, dir: &Path, rt: Handle) -> std::io::Result<FuseDisk> {
        let fs = DiskFs {
            vol,
            rt,
            slots: Arc::new(Semaphore::new(IN_FLIGHT)),
            created: SystemTime::now(),
        };
        let opts = [
            MountOption::FSName("strata".into()),
            MountOption::Subtype("disk".into()),
            MountOption::DefaultPermissions,
            MountOption::NoExec,
            MountOption::NoSuid,
            MountOption::NoDev,
        ];
        let session = fuser::spawn_mount2(fs, dir, &opts)?;
        Ok(FuseDisk {
            session: Some(session),
            dir: dir.to_path_buf(),
            file: dir.join(DISK),
        })
    }

    /// What makes the kernel read the file's size again, for use without this handle.
    pub fn size_refresh(&self) -> SizeRefresh {
        SizeRefresh {
            notifier: self.session.as_ref().map(|s| s.notifier()),
            file: self.file.clone(),
        }
    }

    /// Unmounts and waits for the session thread (blocking: call from a blocking thread).
    pub fn unmount(mut self) {
        self.stop()
    }

    fn stop(&mut self) {
        let Some(s) = self.session.take() else { return };
        // Unmount here rather than in fuser: its unmount logs a busy mount and then waits
        // forever for a session thread that never ends.
        unmount_retrying(&self.dir);
        let guard = {
            let s = s;
            s.guard
        };
        if let Ok(Err(e)) = guard.join() {
            tracing::warn!(dir = %self.dir.display(), error = %e, "fuse session ended with an error");
        }
    }
}

impl Drop for FuseDisk {
    fn drop(&mut self) {
        self.stop()
    }
}

/// Makes the kernel read the disk file's size again (after the volume grew): its cached
/// attributes are dropped and fetched anew, so a loop device then asked to re-read its backing
/// file's size (`LOOP_SET_CAPACITY`) finds the new one.
#[derive(Clone)]
pub struct SizeRefresh {
    notifier: Option<fuser::Notifier>,
    file: PathBuf,
}

impl SizeRefresh {
    /// Blocking (the kernel asks this daemon's session thread): call from a blocking thread.
    /// Returns the size the kernel now sees.
    pub fn refresh(&self) -> std::io::Result<u64> {
        if let Some(n) = &self.notifier {
            n.inval_inode(FILE, -1, 0)?;
        }
        Ok(std::fs::metadata(&self.file)?.len())
    }
}

/// Unmounts `dir`, retrying while it is busy for up to 5 s, then detaching it lazily.
pub fn unmount_retrying(dir: &Path) {
    use rustix::mount::{unmount, UnmountFlags};
    for _ in 0..250 {
        match unmount(dir, UnmountFlags::empty()) {
            Ok(()) => return,
            Err(rustix::io::Errno::BUSY) => std::thread::sleep(Duration::from_millis(20)),
            // Not a mount point (any more).
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => return,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "unmount failed");
                break;
            }
        }
    }
    tracing::warn!(dir = %dir.display(), "mount still busy: detaching it lazily");
    let _ = unmount(dir, UnmountFlags::DETACH);
}

fn errno(e: &Error) -> i32 {
    match e {
        Error::NoSpace(_) => libc::ENOSPC,
        Error::Io { source, .. } if strata_engine::is_no_space(source) => libc::ENOSPC,
        Error::OutOfRange { .. } | Error::Invalid(_) => libc::EINVAL,
        _ => libc::EIO,
    }
}

impl DiskFs {
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, perm, size, nlink) = if ino == ROOT {
            (FileType::Directory, 0o700, 0, 2)
        } else {
            (FileType::RegularFile, 0o600, self.vol.size(), 1)
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
            crtime: self.created,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Runs `f` as a task once a slot is free; the reply is sent from the task.
    fn spawn<F>(&self, f: impl FnOnce(Arc<Volume>) -> F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let permit = match self.rt.block_on(self.slots.clone().acquire_owned()) {
            Ok(p) => p,
            Err(_) => return,
        };
        let fut = f(self.vol.clone());
        self.rt.spawn(async move {
            fut.await;
            drop(permit);
        });
    }

    /// The byte range of a request, if it lies within the disk.
    fn range(&self, offset: i64, len: u64) -> Option<u64> {
        let off = u64::try_from(offset).ok()?;
        (off.checked_add(len)? <= self.vol.size()).then_some(off)
    }
}

impl Filesystem for DiskFs {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        let _ = config.set_max_write(MAX_IO);
        let _ = config.set_max_readahead(MAX_IO);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name == DISK {
            reply.entry(&TTL, &self.attr(FILE), 0)
        } else {
            reply.error(libc::ENOENT)
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match ino {
            ROOT | FILE => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(libc::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        // The disk's size, owner and mode are the workspace's, not the file's to change.
        if ino != FILE
            || mode.is_some()
            || uid.is_some()
            || gid.is_some()
            || size.is_some_and(|s| s != self.vol.size())
        {
            return reply.error(libc::EPERM);
        }
        reply.attr(&TTL, &self.attr(FILE))
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        if self.vol.failure().is_some() {
            return reply.error(libc::EIO);
        }
        reply.opened(0, FOPEN_DIRECT_IO)
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        let Ok(off) = u64::try_from(offset) else {
            return reply.error(libc::EINVAL);
        };
        // Reads at or past the end are short, as for any file.
        let len = (size.min(MAX_IO) as u64).min(self.vol.size().saturating_sub(off));
        if len == 0 {
            return reply.data(&[]);
        }
        self.spawn(move |vol| async move {
            match vol.read(off, len).await {
                Ok(d) => reply.data(&d),
                Err(e) => {
                    tracing::warn!(workspace = vol.name(), error = %e, "fuse read failed");
                    reply.error(errno(&e))
                }
            }
        })
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        let Some(off) = self.range(offset, data.len() as u64) else {
            return reply.error(libc::EFBIG);
        };
        let fua = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        let data = data.to_vec();
        self.spawn(move |vol| async move {
            match vol.write(off, &data, fua).await {
                Ok(()) => reply.written(data.len() as u32),
                Err(e) => {
                    tracing::warn!(workspace = vol.name(), error = %e, "fuse write failed");
                    reply.error(errno(&e))
                }
            }
        })
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lo: u64, reply: ReplyEmpty) {
        // close() is not a sync: only fsync promises durability.
        reply.ok()
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        if ino != FILE {
            return reply.ok();
        }
        self.spawn(move |vol| async move {
            match vol.flush().await {
                Ok(()) => reply.ok(),
                Err(e) => {
                    tracing::warn!(workspace = vol.name(), error = %e, "fuse fsync failed");
                    reply.error(errno(&e))
                }
            }
        })
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        let Some(len) = u64::try_from(length).ok().filter(|l| *l > 0) else {
            return reply.error(libc::EINVAL);
        };
        let Some(off) = self.range(offset, len) else {
            return reply.error(libc::EINVAL);
        };
        let punch = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
        let zero = mode & !FALLOC_FL_KEEP_SIZE == FALLOC_FL_ZERO_RANGE;
        if mode != punch && !zero {
            // Plain preallocation: the volume cannot reserve space, so it does not pretend to.
            return reply.error(libc::EOPNOTSUPP);
        }
        self.spawn(move |vol| async move {
            let r = if zero {
                vol.write_zeroes(off, len, false).await
            } else {
                vol.trim(off, len).await
            };
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        })
    }

    fn opendir(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        if ino == ROOT {
            reply.opened(0, 0)
        } else {
            reply.error(libc::ENOTDIR)
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(libc::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, DISK),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(*ino, (i + 1) as i64, *kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let blocks = self.vol.size() / 4096;
        reply.statfs(blocks, 0, 0, 2, 0, 4096, 255, 4096)
    }
}
