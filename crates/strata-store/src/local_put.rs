//! Puts into a local object directory (the embedded default), paced so they do not starve the
//! guest's writer on the same disk and cores.
//!
//! An off-CPU trace of a publish of 1 GiB (`perf record -e sched:sched_switch -g`, see
//! docs/BENCHMARKS.md) showed the writer's 30–50 ms stalls were not locks or I/O waits: the
//! runtime workers sat *runnable* behind up to four blocking threads, each copying an 8 MiB
//! object into fresh page-cache pages in one `write(2)` (`generic_perform_write`), at the same
//! priority. So every put of a process goes through one background thread (and journal
//! zero-fills through another; `STRATA_BACKGROUND_NICE` can lower their CPU priority),
//! writing 1 MiB at a time and starting writeback of each piece as it goes
//! (`sync_file_range`), so the final `fsync` and the kernel's dirty-page throttling have little
//! left to wait for.
//!
//! Later, a CPU profile of 4 KiB random writes at QD32 (`bench/profile-writes.sh`) found that
//! copy into page-cache pages to be a quarter to a third of strata's CPU, on a machine the writer
//! and the guest keep CPU-bound. So a put writes with `O_DIRECT` where the file system takes it:
//! each piece is copied into one reused aligned buffer (a plain `memcpy`) and written from there
//! to the device, with no page cache pages to allocate, account, write back or reclaim. The last
//! piece is padded to the alignment and the file cut back to its length before the `fsync`. A
//! file system that refuses `O_DIRECT` (`EINVAL` when it is set on the staged file's handle, or at
//! a write) gets the buffered path
//! above, the whole object rewritten, and the process does not try `O_DIRECT` again.
//! `STRATA_DIRECT_PUTS=0` chooses the buffered path outright.
//!
//! Objects are read in place, so an `O_DIRECT` put alone left a block read soon after its
//! publish to the disk: random 4 KiB reads of just-published data at QD32 ran at a third of
//! qemu-nbd's (issue 45). So once an object written direct is durable and in place, its pages
//! are read back into the page cache (`posix_fadvise(WILLNEED)`): the kernel reads them
//! asynchronously by DMA, with no copy on the put thread and no dirty pages to write back, and
//! they are clean pages the kernel reclaims like any other. `STRATA_PUT_READBACK=0` turns it
//! off (a node whose guests rarely read back what they wrote saves the disk reads);
//! docs/BENCHMARKS.md measures the three modes.
//!
//! Durability is object_store's (`LocalFileSystem::with_fsync`): a staged file
//! (`{key}#{digits}`, which listings skip) written and fsync'd, renamed over the key, the
//! directory fsync'd; new directories are fsync'd in their parents. A put returns only after all
//! of it. A crash leaves at most a staged file, never a partial object under its key.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::OnceLock;

use bytes::Bytes;

/// How much one `write` copies before the writeback of that piece is started.
const PIECE: usize = 1 << 20;
/// The background threads' niceness unless `STRATA_BACKGROUND_NICE` says otherwise (0–19).
/// Not lowered by default: at nice +10 the worst write during a 1 GiB publish halves again
/// (about 10 ms against 20), but on a node whose CPUs are saturated the uploads starve, the
/// upload window stays full and publishes overrun the GC grace period (reproduced with
/// stress-ng under the daemon's GC test). A node that keeps CPU headroom can lower it.
const NICE: i32 = 0;

fn niceness() -> i32 {
    std::env::var("STRATA_BACKGROUND_NICE")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(NICE, |n| n.clamp(0, 19))
}

type Job = Box<dyn FnOnce() + Send>;

/// The background threads: object puts, and the rest (journal zero-fills, read-backs of direct
/// puts). Two lanes, so a 64 MiB zero-fill never queues a publish (which a sync-mode FLUSH may
/// be waiting for). Puts are queued per tenant and taken in turn ([`Turns`]); the other lane is
/// first come, first served (a read-back is one `posix_fadvise`, a zero-fill waits behind at
/// most the read-backs queued before it).
enum Lane {
    Puts(String),
    Other,
}

/// Jobs queued per tenant, taken one per tenant in turn (round robin): fair queueing of one
/// thread among the tenants of a node.
#[derive(Default)]
struct Turns {
    queues: std::collections::HashMap<String, std::collections::VecDeque<Job>>,
    /// Tenants with jobs waiting, in the order they get their next turn.
    order: std::collections::VecDeque<String>,
}

impl Turns {
    fn push(&mut self, tenant: String, job: Job) {
        let q = self.queues.entry(tenant.clone()).or_default();
        if q.is_empty() {
            self.order.push_back(tenant);
        }
        q.push_back(job);
    }

    fn pop(&mut self) -> Option<Job> {
        let tenant = self.order.pop_front()?;
        let q = self.queues.get_mut(&tenant)?;
        let job = q.pop_front();
        if q.is_empty() {
            self.queues.remove(&tenant);
        } else {
            self.order.push_back(tenant);
        }
        job
    }
}

/// The put thread's queue.
struct FairQueue {
    turns: std::sync::Mutex<Turns>,
    ready: std::sync::Condvar,
}

fn put_queue() -> &'static FairQueue {
    static Q: OnceLock<&'static FairQueue> = OnceLock::new();
    Q.get_or_init(|| {
        let q: &'static FairQueue = Box::leak(Box::new(FairQueue {
            turns: Default::default(),
            ready: std::sync::Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("strata-put".into())
            .spawn(move || {
                lower_priority();
                loop {
                    let job = {
                        let mut t = q.turns.lock().unwrap_or_else(|p| p.into_inner());
                        loop {
                            if let Some(j) = t.pop() {
                                break j;
                            }
                            t = q.ready.wait(t).unwrap_or_else(|p| p.into_inner());
                        }
                    };
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .expect("spawning the put thread");
        q
    })
}

/// The alignment `O_DIRECT` puts keep for their buffer, offsets and lengths: a page, which is at
/// least the logical block size of any device this runs on (a larger one refuses the writes
/// with `EINVAL`, and the put falls back to the buffered path).
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Set once a file system refused an `O_DIRECT` put: later puts of the process are buffered.
static DIRECT_REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether puts try `O_DIRECT`: unless `STRATA_DIRECT_PUTS=0`, or a file system refused it.
fn direct_wanted() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("STRATA_DIRECT_PUTS").is_ok_and(|v| v == "0"));
    !off && !DIRECT_REFUSED.load(Ordering::Relaxed)
}

/// Whether an object written with `O_DIRECT` is read back into the page cache once it is
/// durable (`posix_fadvise(WILLNEED)` from the other background thread, which the put does not
/// wait for:
/// the kernel reads it asynchronously, by DMA, with no copy): unless `STRATA_PUT_READBACK=0`.
fn readback_wanted() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("STRATA_PUT_READBACK").is_ok_and(|v| v == "0"))
}

/// Starts reading all of `f` into the page cache without waiting for it. Best effort: a kernel
/// that ignores the advice leaves reads to the disk, as before.
fn read_back(f: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor; no memory is passed.
        #[allow(unsafe_code)]
        unsafe {
            // A length of 0: to the end of the file (its last, partial page included).
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = f;
}

/// How a put wrote its object.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Wrote {
    Direct,
    Buffered,
    /// `O_DIRECT` was tried and refused (the error, said); the object was written buffered.
    Refused(String),
}

/// Writes `bytes` durably at `path` (a file under a local object directory) on the put thread,
/// in `tenant`'s turn: the thread takes one put of each tenant with puts waiting in turn, so a
/// tenant publishing gigabytes delays another's put (a sync-mode FLUSH waiting on it) by at
/// most one object, never by its whole backlog.
pub(crate) async fn put(tenant: &str, path: PathBuf, bytes: Bytes) -> std::io::Result<()> {
    run(Lane::Puts(tenant.to_string()), move || {
        let wrote = write_durably(&path, &bytes, direct_wanted().then_some(DIRECT_ALIGN))?;
        if wrote == Wrote::Direct && readback_wanted() {
            // On the other lane, not waited for: the put thread (other tenants' puts, a
            // sync-mode FLUSH waiting on one) never waits for the kernel to queue the reads.
            let path = path.clone();
            let _ = other_queue().send(Box::new(move || {
                if let Ok(f) = File::open(&path) {
                    read_back(&f);
                }
            }));
        }
        if let Wrote::Refused(why) = wrote {
            if !DIRECT_REFUSED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    path = %path.display(),
                    error = %why,
                    "the file system refused an O_DIRECT object put (rewritten buffered); \
                     this process's puts are buffered from now on"
                );
            }
        }
        Ok(())
    })
    .await
}

/// Runs bulk background disk work (a journal segment's zero-fill) on a low-priority
/// background thread of this process, one job at a time, and waits for it.
pub async fn background<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    run(Lane::Other, f).await
}

/// A job whose caller has gone away before it started is skipped (nobody can use its result;
/// a put's object is then never referenced). One that has started runs to its end: each
/// leaves its files consistent either way.
async fn run<T: Send + 'static>(
    lane: Lane,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        if !tx.is_closed() {
            let _ = tx.send(f());
        }
    });
    match lane {
        Lane::Puts(tenant) => {
            let q = put_queue();
            q.turns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(tenant, job);
            q.ready.notify_one();
        }
        Lane::Other => {
            if other_queue().send(job).is_err() {
                return Err(std::io::Error::other("the background I/O thread is gone"));
            }
        }
    }
    rx.await
        .map_err(|_| std::io::Error::other("the background I/O thread dropped a job"))?
}

fn other_queue() -> &'static mpsc::Sender<Job> {
    static OTHER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    let (cell, name) = (&OTHER, "strata-bg-io");
    cell.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                lower_priority();
                for job in rx {
                    // A panicking job fails its caller (its reply is dropped), not the thread.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .expect("spawning a background I/O thread");
        tx
    })
}

/// Lowers this thread's CPU priority (Linux: niceness is per thread) if configured. Best
/// effort.
fn lower_priority() {
    let nice = niceness();
    #[cfg(target_os = "linux")]
    if nice > 0 {
        // SAFETY: gettid and setpriority take no pointers; who = this thread's id.
        #[allow(unsafe_code)]
        let r = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice)
        };
        if r != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "cannot lower the background I/O thread's priority");
        }
    }
}

/// Starts writeback of `len` bytes at `off` without waiting for it.
fn start_writeback(f: &File, off: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor; no memory is passed.
        #[allow(unsafe_code)]
        unsafe {
            libc::sync_file_range(
                f.as_raw_fd(),
                off as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, off, len);
}

/// Writes `bytes` to a staged file, fsyncs it, renames it over `path` and fsyncs the directory.
/// `direct` is `Some(pad_to)` to try `O_DIRECT` first, padding the last piece to a multiple of
/// `pad_to` ([`DIRECT_ALIGN`] but in a test of the fallback, where the kernel's own `EINVAL` for
/// an unaligned length is wanted).
fn write_durably(path: &Path, bytes: &[u8], direct: Option<usize>) -> std::io::Result<Wrote> {
    let parent = path
        .parent()
        .ok_or_else(|| std::io::Error::other(format!("{} has no directory", path.display())))?;
    let (mut f, staged) = create_staged(path, parent)?;
    let res = (|| {
        let wrote = match direct {
            Some(pad_to) => match write_direct(&f, bytes, pad_to) {
                Ok(()) => Wrote::Direct,
                Err(e) if refused(&e) => {
                    // Whatever the refused writes left is rewritten whole, through the page
                    // cache (the handle may still carry `O_DIRECT`).
                    set_direct(&f, false)?;
                    f.set_len(0)?;
                    write_buffered(&mut f, bytes)?;
                    Wrote::Refused(e.to_string())
                }
                Err(e) => return Err(e),
            },
            None => {
                write_buffered(&mut f, bytes)?;
                Wrote::Buffered
            }
        };
        f.sync_all()?;
        drop(f);
        std::fs::rename(&staged, path)?;
        File::open(parent)?.sync_all()?;
        Ok(wrote)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&staged);
    }
    res
}

/// Whether an error is a file system's refusal of `O_DIRECT` (when it is set, or a write it
/// cannot align), not a failure of the disk.
fn refused(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
    )
}

/// The buffered path: 1 MiB at a time through the page cache, starting writeback of each piece.
fn write_buffered(f: &mut File, bytes: &[u8]) -> std::io::Result<()> {
    let mut off = 0usize;
    for piece in bytes.chunks(PIECE) {
        f.write_all(piece)?;
        start_writeback(f, off as u64, piece.len() as u64);
        off += piece.len();
    }
    Ok(())
}

#[cfg(target_os = "linux")]
thread_local! {
    /// The put thread's aligned buffer for `O_DIRECT` writes (one piece plus room to align).
    static DIRECT_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `len` bytes of `v` starting at an address aligned for `O_DIRECT` (grows `v` as needed).
#[cfg(target_os = "linux")]
fn aligned(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    v.resize(len + DIRECT_ALIGN, 0);
    let addr = v.as_ptr().addr();
    let start = addr.next_multiple_of(DIRECT_ALIGN) - addr;
    &mut v[start..start + len]
}

/// The `O_DIRECT` path, on the staged file's own handle (never opened again by name): bytes at
/// an aligned address written from where they are, others copied piece by piece into an
/// aligned buffer and written from there; the last piece padded with zeros to the alignment,
/// the file then cut back to `bytes.len()`. The writes bypass the page cache
/// but may sit in the device's cache, and the file's size and extents are not durable either:
/// the caller's fsync makes them so.
fn write_direct(f: &File, bytes: &[u8], pad_to: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::FileExt;
        set_direct(f, true)?;
        // Bytes already at an aligned address (an object built in an `ObjectBuf`) are
        // written from where they are, all but a last partial block: no copy.
        let mut off = 0u64;
        let mut bytes = bytes;
        if bytes.as_ptr().addr().is_multiple_of(DIRECT_ALIGN) {
            let whole = bytes.len() / pad_to * pad_to;
            for piece in bytes[..whole].chunks(PIECE) {
                f.write_all_at(piece, off)?;
                off += piece.len() as u64;
            }
            bytes = &bytes[whole..];
        }
        let done = off;
        DIRECT_BUF.with_borrow_mut(|v| {
            let buf = aligned(v, PIECE);
            for piece in bytes.chunks(PIECE) {
                let padded = piece.len().next_multiple_of(pad_to);
                buf[..piece.len()].copy_from_slice(piece);
                buf[piece.len()..padded].fill(0);
                f.write_all_at(&buf[..padded], off)?;
                off += padded as u64;
            }
            if off != done + bytes.len() as u64 {
                f.set_len(done + bytes.len() as u64)?;
            }
            Ok(())
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (f, bytes, pad_to);
        Err(std::io::Error::from_raw_os_error(libc::EINVAL))
    }
}

/// Turns `O_DIRECT` on or off for an open file (`fcntl(F_SETFL)`; a file system without direct
/// I/O refuses it with `EINVAL`).
#[allow(unsafe_code)]
fn set_direct(f: &File, on: bool) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let fd = f.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL on a descriptor this `File` owns; no memory is passed.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let want = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if want != flags && unsafe { libc::fcntl(fd, libc::F_SETFL, want) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = f;
        if on {
            Err(std::io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            Ok(())
        }
    }
}

/// Creates `{path}#{digits}` (skipped by listings), making and fsyncing missing directories.
fn create_staged(path: &Path, parent: &Path) -> std::io::Result<(File, PathBuf)> {
    let mut made_dirs = false;
    loop {
        let mut name = path.as_os_str().to_owned();
        name.push(format!("#{}", rand::random::<u32>()));
        let staged = PathBuf::from(name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staged)
        {
            Ok(f) => return Ok((f, staged)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) if e.kind() == ErrorKind::NotFound && !made_dirs => {
                made_dirs = true;
                make_dirs(parent)?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// `create_dir_all`, then an fsync of each new directory's parent (its entry is durable).
fn make_dirs(dir: &Path) -> std::io::Result<()> {
    let mut missing = vec![];
    let mut d = dir;
    while !d.exists() {
        missing.push(d.to_path_buf());
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    std::fs::create_dir_all(dir)?;
    for m in &missing {
        if let Some(p) = m.parent() {
            File::open(p)?.sync_all()?;
        }
    }
    Ok(())
}

/// Whether `name` is a staged file's: what follows its first `#` is all digits, the rule by which
/// object_store's listings skip a file (its own puts stage the same way).
fn is_staged(name: &std::ffi::OsStr) -> bool {
    name.to_str()
        .and_then(|n| n.split_once('#'))
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the staged files under `root`'s tenant directories (`t/`) that are older than
/// `older_than`: what a put interrupted by a crash or a panic leaves (listings skip them, so
/// nothing else ever would). A put in progress rewrites its staged file piece by piece and
/// renames it within seconds; should a stalled one lose it all the same, its rename fails and
/// the put reports an error, never a success. Symlinks are not followed. A directory or file
/// that cannot be read or removed is passed over (counted in the second number), not the rest.
/// Returns (removed, passed over, the first error).
pub(crate) fn sweep_staged(
    root: &Path,
    older_than: std::time::Duration,
) -> (u64, u64, Option<std::io::Error>) {
    let now = std::time::SystemTime::now();
    let (mut removed, mut failed, mut first) = (0, 0, None);
    let mut note = |e: std::io::Error| {
        if e.kind() != ErrorKind::NotFound {
            failed += 1;
            first.get_or_insert(e);
        }
    };
    let mut dirs = vec![root.join("t")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir).map_err(&mut note) else {
            continue;
        };
        for entry in entries {
            let Ok(entry) = entry.map_err(&mut note) else {
                continue;
            };
            let Ok(kind) = entry.file_type().map_err(&mut note) else {
                continue;
            };
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() && is_staged(&entry.file_name()) {
                let old = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age >= older_than));
                if old
                    && std::fs::remove_file(entry.path())
                        .map_err(&mut note)
                        .is_ok()
                {
                    removed += 1;
                }
            }
        }
    }
    (removed, failed, first)
}

#[cfg(test)]
mod tests;
