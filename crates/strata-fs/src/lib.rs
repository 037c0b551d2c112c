//! The file layer under the journal and local state, injectable so tests can lose power.
//!
//! Only what the volume needs: positional reads and writes, `fdatasync`, directory listing,
//! atomic replace and directory `fsync`. [`RealFs`] is the operating system; `strata-simfs` (tests only)
//! is an in-memory model that keeps un-synced data apart and can drop it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[allow(clippy::len_without_is_empty)]
pub trait FsFile: Send + Sync {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Reads exactly `buf.len()` bytes or fails.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    fn sync_data(&self) -> io::Result<()>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    /// How many names the file has (a journal segment shared with a fork has two or more:
    /// it must never be recycled, only unlinked). A layer that cannot tell says "shared".
    fn links(&self) -> io::Result<u64> {
        Ok(u64::MAX)
    }
}

pub trait Fs: Send + Sync {
    /// Opens a file read-write, creating it (empty) if `create`.
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn FsFile>>;
    fn remove(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// File names in `dir` (not paths), unsorted.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    fn exists(&self, path: &Path) -> bool;
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Gives the file at `from` a second name `to` (durable once `to`'s directory is synced).
    fn hard_link(&self, _from: &Path, _to: &Path) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "hard links are not supported here",
        ))
    }
    /// Bytes an unprivileged writer may still allocate on the file system holding `dir`
    /// (None where the layer cannot tell: simulated file systems).
    fn available(&self, _dir: &Path) -> io::Result<Option<u64>> {
        Ok(None)
    }

    /// Whether overwriting written blocks of a file in `dir` reuses them (no allocation, so no
    /// ENOSPC): false on copy-on-write and log-structured file systems.
    fn overwrites_in_place(&self, _dir: &Path) -> bool {
        true
    }

    /// Holds the file at `path` (created, with its directory, if missing) for this process,
    /// exclusively among processes, until the returned guard is dropped: the kernel lets go
    /// when the process ends in any way. `Ok(Err(text))` when another process holds it, with
    /// what that process wrote into the file (its pid). A layer inside one process (a
    /// simulated file system) has no other process to exclude.
    fn lock_exclusive(&self, _path: &Path) -> io::Result<Result<FileLock, String>> {
        Ok(Ok(FileLock(None)))
    }

    /// Reads a whole file.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let f = self.open(path, false)?;
        let mut buf = vec![0; f.len()? as usize];
        f.read_at(&mut buf, 0)?;
        Ok(buf)
    }

    /// Durably replaces `path` with `data`: temp file, fdatasync, rename, directory fsync.
    fn write_atomic(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp: PathBuf = path.with_extension("tmp");
        let f = self.open(&tmp, true)?;
        f.set_len(0)?;
        f.write_at(data, 0)?;
        f.sync_data()?;
        drop(f);
        self.rename(&tmp, path)?;
        self.sync_dir(dir)
    }
}

/// A lock held by [`Fs::lock_exclusive`]; dropping it lets go.
pub struct FileLock(#[allow(dead_code)] Option<std::fs::File>);

/// The real file system.
pub struct RealFs;

struct RealFile(std::fs::File);

impl FsFile for RealFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, off)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn links(&self) -> io::Result<u64> {
        Ok(std::os::unix::fs::MetadataExt::nlink(&self.0.metadata()?))
    }
}

impl Fs for RealFs {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn FsFile>> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        Ok(Arc::new(RealFile(f)))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect()
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }
    fn exists(&self, path: &Path) -> bool {
        // Unreadable (EIO, EACCES) counts as present: callers then fail on reading it rather
        // than take local state for absent and discard a journal.
        path.try_exists().unwrap_or(true)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::hard_link(from, to)
    }
    fn lock_exclusive(&self, path: &Path) -> io::Result<Result<FileLock, String>> {
        use std::io::{Read, Write};
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        match f.try_lock() {
            Ok(()) => {
                // Who holds it, for the message another process gets (not needed for safety:
                // the lock is the kernel's).
                f.set_len(0)?;
                f.write_all(format!("pid {}", std::process::id()).as_bytes())?;
                Ok(Ok(FileLock(Some(f))))
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut who = String::new();
                let _ = f.take(64).read_to_string(&mut who);
                Ok(Err(who))
            }
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }
    fn available(&self, dir: &Path) -> io::Result<Option<u64>> {
        let st = rustix::fs::statvfs(dir)?;
        Ok(Some(st.f_bavail.saturating_mul(st.f_frsize)))
    }
    fn overwrites_in_place(&self, dir: &Path) -> bool {
        // Known to overwrite written blocks in place: ext2/3/4, XFS (files strata writes are
        // never reflinked), tmpfs. Anything else (btrfs, ZFS, bcachefs, F2FS, overlayfs over
        // any of them, network and FUSE file systems) may allocate on overwrite: the journal
        // then writes every record under its lock, where ENOSPC refuses one request.
        const IN_PLACE: [u32; 3] = [0xef53, 0x5846_5342, 0x0102_1994];
        match rustix::fs::statfs(dir) {
            // `f_type`'s integer type differs between targets (signed 32 bits on some).
            #[allow(clippy::unnecessary_cast)]
            Ok(st) => IN_PLACE.contains(&(st.f_type as u32)),
            Err(_) => false,
        }
    }
}
