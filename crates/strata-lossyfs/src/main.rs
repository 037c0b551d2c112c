//! `strata-lossyfs BACKING MOUNTPOINT`: a test-only FUSE passthrough that simulates power loss
//! for a real process (the strata daemon) whose data directory lives on it.
//!
//! File data written through the mount stays in this process's memory until the file is
//! fsync'd (`fsync`/`fdatasync`), then it is written to BACKING and synced there. On SIGUSR1
//! every un-synced write is dropped ("power loss"); on SIGUSR2 each un-synced write survives
//! with probability 1/2, cut at a random 512-byte boundary ("power loss with torn, reordered
//! writes"). A power-loss test kills the daemon with SIGKILL, signals this process, restarts the
//! daemon and checks what it promised. Files are opened in direct-I/O mode so the kernel page
//! cache never hides the loss.
//!
//! Limits, on purpose: namespace changes (create, rename, unlink, mkdir) reach BACKING at once,
//! as if every directory were always synced, so the model catches missing data syncs, not
//! missing directory syncs (the engine's simulated file system covers those). File sizes set by
//! truncate are un-synced data like writes.
//!
//! A file unlinked (or renamed over) while open stays readable and writable through its open
//! handles until the last is released, as on a local file system: its backing file moves to
//! `BACKING/.lossyfs-hidden/` (never listed or looked up), like libfuse's `.fuse_hidden` files.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};

const TTL: Duration = Duration::ZERO;
const FOPEN_DIRECT_IO: u32 = 1;
/// Where files unlinked while open live until their last release (relative to BACKING).
const HIDDEN: &str = ".lossyfs-hidden";

/// 0: nothing; 1: drop everything un-synced; 2: tear.
static PENDING: AtomicU8 = AtomicU8::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    PENDING.store(1, Ordering::SeqCst);
}
extern "C" fn on_usr2(_: libc::c_int) {
    PENDING.store(2, Ordering::SeqCst);
}

/// Un-synced state of one file.
struct Dirty {
    writes: Vec<(u64, Vec<u8>)>,
    /// Logical size.
    size: u64,
    /// Lowest size a truncation set since the last sync: backing bytes at or past it are gone.
    floor: u64,
}

struct LossyFs {
    backing: PathBuf,
    paths: HashMap<u64, PathBuf>,
    inos: HashMap<PathBuf, u64>,
    next_ino: u64,
    dirty: HashMap<u64, Dirty>,
    /// Open handles per inode (open/create minus release).
    opens: HashMap<u64, u64>,
    rng: u64,
    drops: u64,
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl LossyFs {
    fn new(backing: PathBuf) -> LossyFs {
        // Files hidden by an earlier mount had no open handle left once it ended.
        let _ = std::fs::remove_dir_all(backing.join(HIDDEN));
        let mut fs = LossyFs {
            backing,
            paths: HashMap::new(),
            inos: HashMap::new(),
            next_ino: 2,
            dirty: HashMap::new(),
            opens: HashMap::new(),
            rng: 0x9e3779b97f4a7c15 ^ std::process::id() as u64,
            drops: 0,
        };
        fs.paths.insert(1, PathBuf::new());
        fs.inos.insert(PathBuf::new(), 1);
        fs
    }

    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Applies a pending power loss before serving anything else.
    fn check(&mut self) {
        match PENDING.swap(0, Ordering::SeqCst) {
            1 => {
                self.dirty.clear();
                self.drops += 1;
                eprintln!(
                    "lossyfs: power loss #{}: un-synced writes dropped",
                    self.drops
                );
            }
            2 => {
                let inos: Vec<u64> = self.dirty.keys().copied().collect();
                let mut kept = 0;
                for ino in inos {
                    let d = self.dirty.remove(&ino).unwrap();
                    let Some(p) = self.paths.get(&ino).map(|p| self.backing.join(p)) else {
                        continue;
                    };
                    let Ok(f) = OpenOptions::new().write(true).open(&p) else {
                        continue;
                    };
                    for (off, data) in d.writes {
                        if self.rand().is_multiple_of(2) {
                            continue;
                        }
                        let sectors = data.len().div_ceil(512) as u64;
                        let keep = ((self.rand() % (sectors + 1)) * 512).min(data.len() as u64);
                        let _ = f.write_all_at(&data[..keep as usize], off);
                        kept += 1;
                    }
                    let _ = f.sync_all();
                }
                self.drops += 1;
                eprintln!(
                    "lossyfs: torn power loss #{}: {kept} un-synced writes partly kept",
                    self.drops
                );
            }
            _ => {}
        }
    }

    fn path(&self, ino: u64) -> Option<PathBuf> {
        self.paths.get(&ino).cloned()
    }

    fn ino_for(&mut self, rel: PathBuf) -> u64 {
        if let Some(i) = self.inos.get(&rel) {
            return *i;
        }
        let i = self.next_ino;
        self.next_ino += 1;
        self.paths.insert(i, rel.clone());
        self.inos.insert(rel, i);
        i
    }

    fn attr(&self, ino: u64, rel: &Path) -> std::io::Result<FileAttr> {
        let m = std::fs::symlink_metadata(self.backing.join(rel))?;
        let kind = file_type(&m.file_type());
        let size = self.dirty.get(&ino).map_or(m.len(), |d| d.size);
        let t = |s: i64| UNIX_EPOCH + Duration::from_secs(s.max(0) as u64);
        Ok(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: t(m.atime()),
            mtime: t(m.mtime()),
            ctime: t(m.ctime()),
            crtime: t(m.ctime()),
            kind,
            perm: (m.permissions().mode() & 0o7777) as u16,
            nlink: m.nlink() as u32,
            uid: m.uid(),
            gid: m.gid(),
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn dirty_of(&mut self, ino: u64) -> std::io::Result<&mut Dirty> {
        if !self.dirty.contains_key(&ino) {
            let rel = self
                .path(ino)
                .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?;
            let size = std::fs::metadata(self.backing.join(rel))?.len();
            self.dirty.insert(
                ino,
                Dirty {
                    writes: vec![],
                    size,
                    floor: size,
                },
            );
        }
        Ok(self.dirty.get_mut(&ino).unwrap())
    }

    /// Makes a file's un-synced state durable in BACKING.
    fn sync(&mut self, ino: u64) -> std::io::Result<()> {
        let Some(d) = self.dirty.remove(&ino) else {
            return Ok(());
        };
        let rel = self
            .path(ino)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?;
        let f = OpenOptions::new()
            .write(true)
            .open(self.backing.join(rel))?;
        if d.floor < f.metadata()?.len() {
            f.set_len(d.floor)?;
        }
        for (off, data) in &d.writes {
            f.write_all_at(data, *off)?;
        }
        f.set_len(d.size)?;
        f.sync_all()
    }

    /// `name` under directory `parent`, relative to BACKING (the hidden directory has none).
    fn child(&self, parent: u64, name: &OsStr) -> std::io::Result<PathBuf> {
        if parent == 1 && name == HIDDEN {
            return Err(std::io::Error::from_raw_os_error(libc::ENOENT));
        }
        self.path(parent)
            .map(|p| p.join(name))
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))
    }

    /// The name `rel` is going away (unlink, or a rename over it). An inode still open keeps
    /// its data: its backing file moves to the hidden directory until the last release.
    /// Returns whether it was hidden (then the name is already gone from BACKING).
    fn forget_name(&mut self, rel: &Path) -> std::io::Result<bool> {
        let Some(ino) = self.inos.get(rel).copied() else {
            return Ok(false);
        };
        if self.opens.get(&ino).copied().unwrap_or(0) == 0 {
            self.inos.remove(rel);
            self.paths.remove(&ino);
            self.dirty.remove(&ino);
            return Ok(false);
        }
        let hidden = Path::new(HIDDEN).join(ino.to_string());
        std::fs::create_dir_all(self.backing.join(HIDDEN))?;
        std::fs::rename(self.backing.join(rel), self.backing.join(&hidden))?;
        self.inos.remove(rel);
        self.paths.insert(ino, hidden);
        Ok(true)
    }

    fn entry(&mut self, parent: u64, name: &OsStr) -> std::io::Result<(u64, FileAttr)> {
        let rel = self.child(parent, name)?;
        std::fs::symlink_metadata(self.backing.join(&rel))?;
        let ino = self.ino_for(rel.clone());
        Ok((ino, self.attr(ino, &rel)?))
    }

    /// Answers a lookup-like request with `name`'s entry.
    fn reply_entry(&mut self, parent: u64, name: &OsStr, reply: ReplyEntry) {
        match self.entry(parent, name) {
            Ok((_, a)) => reply.entry(&TTL, &a, 0),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

impl Filesystem for LossyFs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        self.check();
        self.reply_entry(parent, name, reply)
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        self.check();
        let Some(rel) = self.path(ino) else {
            return reply.error(libc::ENOENT);
        };
        match self.attr(ino, &rel) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        self.check();
        let Some(rel) = self.path(ino) else {
            return reply.error(libc::ENOENT);
        };
        if let Some(m) = mode {
            if let Err(e) = std::fs::set_permissions(
                self.backing.join(&rel),
                std::fs::Permissions::from_mode(m & 0o7777),
            ) {
                return reply.error(errno(&e));
            }
        }
        if let Some(n) = size {
            match self.dirty_of(ino) {
                Ok(d) => {
                    // Truncation is un-synced data too: later reads past `n` see zeros.
                    for (off, data) in d.writes.iter_mut() {
                        if *off >= n {
                            data.clear();
                        } else if *off + data.len() as u64 > n {
                            data.truncate((n - *off) as usize);
                        }
                    }
                    d.writes.retain(|(_, w)| !w.is_empty());
                    d.floor = d.floor.min(n);
                    d.size = n;
                }
                Err(e) => return reply.error(errno(&e)),
            }
        }
        match self.attr(ino, &rel) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mkdir(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        self.check();
        let full = match self.child(parent, name) {
            Ok(rel) => self.backing.join(rel),
            Err(e) => return reply.error(errno(&e)),
        };
        if let Err(e) = std::fs::create_dir(&full) {
            return reply.error(errno(&e));
        }
        let _ = std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode & 0o7777));
        self.reply_entry(parent, name, reply)
    }

    /// Unix sockets (the daemon's NBD exports) are created in BACKING as sockets.
    fn mknod(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.check();
        let full = match self.child(parent, name) {
            Ok(rel) => self.backing.join(rel),
            Err(e) => return reply.error(errno(&e)),
        };
        if let Err(e) = mknod(&full, mode, rdev) {
            return reply.error(errno(&e));
        }
        self.reply_entry(parent, name, reply)
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        self.check();
        let rel = match self.child(parent, name) {
            Ok(rel) => rel,
            Err(e) => return reply.error(errno(&e)),
        };
        let meta = match std::fs::symlink_metadata(self.backing.join(&rel)) {
            Ok(m) => m,
            Err(e) => return reply.error(errno(&e)),
        };
        if meta.is_dir() {
            return reply.error(libc::EISDIR);
        }
        match self.forget_name(&rel) {
            Ok(true) => reply.ok(),
            Ok(false) => match std::fs::remove_file(self.backing.join(&rel)) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            },
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        self.check();
        let rel = match self.child(parent, name) {
            Ok(rel) => rel,
            Err(e) => return reply.error(errno(&e)),
        };
        match std::fs::remove_dir(self.backing.join(&rel)) {
            Ok(()) => {
                if let Some(ino) = self.inos.remove(&rel) {
                    self.paths.remove(&ino);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        _flags: u32,
        reply: ReplyEmpty,
    ) {
        self.check();
        let (Some(p), Some(np)) = (self.path(parent), self.path(newparent)) else {
            return reply.error(libc::ENOENT);
        };
        if (parent == 1 && name == HIDDEN) || (newparent == 1 && newname == HIDDEN) {
            return reply.error(libc::ENOENT);
        }
        let (from, to) = (p.join(name), np.join(newname));
        if let Err(e) = std::fs::symlink_metadata(self.backing.join(&from)) {
            return reply.error(errno(&e));
        }
        // The replaced target's name disappears (its inode lives on while open) …
        let replaced_file =
            std::fs::symlink_metadata(self.backing.join(&to)).is_ok_and(|m| !m.is_dir());
        let hidden = if replaced_file && from != to {
            let ino = self.inos.get(&to).copied();
            match self.forget_name(&to) {
                Ok(true) => ino,
                Ok(false) => None,
                Err(e) => return reply.error(errno(&e)),
            }
        } else {
            None
        };
        if let Err(e) = std::fs::rename(self.backing.join(&from), self.backing.join(&to)) {
            // The target keeps its name after all.
            if let Some(ino) = hidden {
                if let Some(h) = self.paths.get(&ino).cloned() {
                    if std::fs::rename(self.backing.join(&h), self.backing.join(&to)).is_ok() {
                        self.paths.insert(ino, to.clone());
                        self.inos.insert(to, ino);
                    }
                }
            }
            return reply.error(errno(&e));
        }
        if let Some(old) = self.inos.remove(&to) {
            self.paths.remove(&old);
            self.dirty.remove(&old);
        }
        // … and everything under `from` moves.
        let moved: Vec<(PathBuf, u64)> = self
            .inos
            .iter()
            .filter(|(k, _)| k.starts_with(&from))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (k, ino) in moved {
            let rest = k.strip_prefix(&from).unwrap();
            let nk = if rest.as_os_str().is_empty() {
                to.clone()
            } else {
                to.join(rest)
            };
            self.inos.remove(&k);
            self.inos.insert(nk.clone(), ino);
            self.paths.insert(ino, nk);
        }
        reply.ok()
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        self.check();
        if self.path(ino).is_none() {
            return reply.error(libc::ENOENT);
        }
        *self.opens.entry(ino).or_default() += 1;
        reply.opened(0, FOPEN_DIRECT_IO)
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let left = self.opens.get_mut(&ino).map(|n| {
            *n = n.saturating_sub(1);
            *n
        });
        if left == Some(0) {
            self.opens.remove(&ino);
            let hidden = self.path(ino).filter(|p| p.starts_with(HIDDEN));
            if let Some(rel) = hidden {
                let _ = std::fs::remove_file(self.backing.join(rel));
                self.paths.remove(&ino);
                self.dirty.remove(&ino);
            }
        }
        reply.ok()
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
        self.check();
        let Some(rel) = self.path(ino) else {
            return reply.error(libc::ENOENT);
        };
        let off = offset.max(0) as u64;
        let f = match File::open(self.backing.join(&rel)) {
            Ok(f) => f,
            Err(e) => return reply.error(errno(&e)),
        };
        let backing_len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let (len, floor) = self
            .dirty
            .get(&ino)
            .map_or((backing_len, backing_len), |d| (d.size, d.floor));
        if off >= len {
            return reply.data(&[]);
        }
        let n = (size as u64).min(len - off) as usize;
        let mut buf = vec![0u8; n];
        // Backing bytes (only below both the backing and the logical size) …
        let from_backing = backing_len
            .min(len)
            .min(floor)
            .saturating_sub(off)
            .min(n as u64) as usize;
        if from_backing > 0 {
            if let Err(e) = f.read_exact_at(&mut buf[..from_backing], off) {
                return reply.error(errno(&e));
            }
        }
        // … then the un-synced writes, in order.
        if let Some(d) = self.dirty.get(&ino) {
            let end = off + n as u64;
            for (woff, data) in &d.writes {
                let wend = woff + data.len() as u64;
                if wend <= off || *woff >= end {
                    continue;
                }
                let a = (*woff).max(off);
                let b = wend.min(end);
                buf[(a - off) as usize..(b - off) as usize]
                    .copy_from_slice(&data[(a - woff) as usize..(b - woff) as usize]);
            }
        }
        reply.data(&buf)
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
        self.check();
        let off = offset.max(0) as u64;
        match self.dirty_of(ino) {
            Ok(d) => {
                d.writes.push((off, data.to_vec()));
                d.size = d.size.max(off + data.len() as u64);
            }
            Err(e) => return reply.error(errno(&e)),
        }
        // O_SYNC / O_DSYNC writes are durable when they return.
        if flags & (libc::O_SYNC | libc::O_DSYNC) != 0 {
            if let Err(e) = self.sync(ino) {
                return reply.error(errno(&e));
            }
        }
        reply.written(data.len() as u32)
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lo: u64, reply: ReplyEmpty) {
        // close() is not a sync.
        reply.ok()
    }

    fn fsync(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.check();
        match self.sync(ino) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn opendir(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        self.check();
        if self.path(ino).is_none() {
            return reply.error(libc::ENOENT);
        }
        reply.opened(0, 0)
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        self.check();
        let Some(rel) = self.path(ino) else {
            return reply.error(libc::ENOENT);
        };
        let mut entries: Vec<(u64, FileType, Vec<u8>)> = vec![
            (ino, FileType::Directory, b".".to_vec()),
            (ino, FileType::Directory, b"..".to_vec()),
        ];
        let rd = match std::fs::read_dir(self.backing.join(&rel)) {
            Ok(r) => r,
            Err(e) => return reply.error(errno(&e)),
        };
        let mut names: Vec<_> = rd.flatten().collect();
        names.sort_by_key(|e| e.file_name());
        for e in names {
            if rel.as_os_str().is_empty() && e.file_name() == HIDDEN {
                continue;
            }
            let kind = e
                .file_type()
                .map_or(FileType::RegularFile, |t| file_type(&t));
            let child = self.ino_for(rel.join(e.file_name()));
            entries.push((child, kind, e.file_name().as_bytes().to_vec()));
        }
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as i64, kind, OsStr::from_bytes(&name)) {
                break;
            }
        }
        reply.ok()
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        self.check();
        reply.ok() // namespace changes are applied at once (see the module docs)
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        reply.statfs(1 << 24, 1 << 23, 1 << 23, 1 << 20, 1 << 19, 4096, 255, 4096);
    }

    fn access(&mut self, _req: &Request<'_>, _ino: u64, _mask: i32, reply: ReplyEmpty) {
        reply.ok()
    }

    fn create(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        self.check();
        let full = match self.child(parent, name) {
            Ok(rel) => self.backing.join(rel),
            Err(e) => return reply.error(errno(&e)),
        };
        let mut o = OpenOptions::new();
        o.write(true).create(true);
        if flags & libc::O_EXCL != 0 {
            o.create_new(true);
        }
        if let Err(e) = o.open(&full) {
            return reply.error(errno(&e));
        }
        let _ = std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode & 0o7777));
        match self.entry(parent, name) {
            Ok((ino, a)) => {
                if flags & libc::O_TRUNC != 0 {
                    if let Ok(d) = self.dirty_of(ino) {
                        d.writes.clear();
                        d.size = 0;
                        d.floor = 0;
                    }
                }
                *self.opens.entry(ino).or_default() += 1;
                reply.created(&TTL, &a, 0, 0, FOPEN_DIRECT_IO)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }
}

fn file_type(t: &std::fs::FileType) -> FileType {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else if t.is_socket() {
        FileType::Socket
    } else if t.is_fifo() {
        FileType::NamedPipe
    } else {
        FileType::RegularFile
    }
}

#[allow(unsafe_code)]
fn mknod(path: &Path, mode: u32, rdev: u32) -> std::io::Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    let r = unsafe { libc::mknod(c.as_ptr(), mode as libc::mode_t, rdev as libc::dev_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[allow(unsafe_code)]
fn install_signals() {
    // SAFETY: the handlers only store to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
        libc::signal(libc::SIGUSR2, on_usr2 as *const () as libc::sighandler_t);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: strata-lossyfs BACKING MOUNTPOINT (SIGUSR1: drop un-synced writes, SIGUSR2: tear them)");
        std::process::exit(2);
    }
    install_signals();
    let fs = LossyFs::new(PathBuf::from(&args[1]));
    let opts = [
        MountOption::FSName("strata-lossyfs".into()),
        MountOption::DefaultPermissions,
    ];
    if let Err(e) = fuser::mount2(fs, &args[2], &opts) {
        eprintln!("strata-lossyfs: mount failed: {e}");
        std::process::exit(1);
    }
}
