//! vhost-user-blk: a VMM (QEMU `vhost-user-blk-pci`, Cloud Hypervisor `--disk vhost_user=on`,
//! Firecracker's vhost-user drives) hands its virtio-blk queues to strata, which serves them
//! from a [`BlockDevice`] (an attached volume) without the host kernel's block layer between.
//!
//! ```text
//! VMM ──unix socket (vhost-user messages, guest memory fds)──▶ Served: accept loop thread
//!        │                                                      └─ VhostUserDaemon per connection
//!        └─ virtqueue kicks (eventfd) ──▶ worker thread per queue ─▶ blk::Request ─▶ tokio ─▶ volume
//! ```
//!
//! - One frontend at a time; when it goes (the VMM stopped, or died) the socket accepts the
//!   next, so a VMM that reconnects (QEMU `reconnect-ms`, Cloud Hypervisor) finds it again, and
//!   a daemon restarted on the same socket path serves it again.
//! - [`Served::stop`] ends it: the socket stops accepting, the connection is shut down, and it
//!   returns only when every worker thread has finished the requests it took: after it,
//!   nothing reaches the device.
//! - The frontend is hostile input: requests are parsed in `blk.rs`, memory only through
//!   `vm-memory`'s checked accessors; the vhost-user messages are decoded by the `vhost` crate.

mod backend;
pub mod blk;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use strata_block::BlockDevice;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

pub use backend::{BlkBackend, Stats, BATCH_BYTES};
pub use blk::Features;

/// Defaults: queues and their size (QEMU's `num-queues` / `queue-size` must not exceed them).
pub const DEFAULT_QUEUES: u16 = 2;
/// Most queues a caller should let a tenant ask for (each is a thread on the node).
pub const MAX_QUEUES: u16 = 8;
pub const DEFAULT_QUEUE_SIZE: u16 = 256;

/// A device served on a vhost-user socket.
pub struct Served {
    path: PathBuf,
    /// (device, inode) of the socket file bound: only that file is removed at the end (a late
    /// stop must not remove a newer export's socket at the same path).
    file: (u64, u64),
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    conn: Arc<Mutex<Option<ShutdownHandle>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    backend: Arc<BlkBackend>,
}

/// Binds `path` (replacing a stale socket file) and serves `dev` there until [`Served::stop`].
/// `rt` runs the device's futures; the vhost-user threads are plain threads.
pub fn serve(
    path: &Path,
    dev: Arc<dyn BlockDevice>,
    features: Features,
    rt: tokio::runtime::Handle,
) -> std::io::Result<Served> {
    if features.num_queues == 0 || features.num_queues > 64 || features.queue_size == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "queues must be 1..=64 and queue size non-zero",
        ));
    }
    if !features.queue_size.is_power_of_two() || features.queue_size > 32768 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "queue size must be a power of two up to 32768",
        ));
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    let file = {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let m = std::fs::metadata(path)?;
        (m.dev(), m.ino())
    };
    let backend = Arc::new(BlkBackend::new(dev, features, rt));
    let stop = Arc::new(AtomicBool::new(false));
    let conn = Arc::new(Mutex::new(None));
    let thread = {
        let (backend, stop, conn) = (backend.clone(), stop.clone(), conn.clone());
        let listener = listener.try_clone()?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        std::thread::Builder::new()
            .name("vhost-user-accept".into())
            .spawn(move || accept_loop(listener, &name, backend, &stop, &conn))?
    };
    Ok(Served {
        path: path.to_path_buf(),
        file,
        listener,
        stop,
        conn,
        thread: Some(thread),
        backend,
    })
}

fn accept_loop(
    listener: UnixListener,
    name: &str,
    backend: Arc<BlkBackend>,
    stop: &AtomicBool,
    conn: &Mutex<Option<ShutdownHandle>>,
) {
    while !stop.load(Ordering::SeqCst) {
        let l = match listener.try_clone() {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(socket = name, error = %e, "vhost-user listener");
                return;
            }
        };
        let mut listener = Listener::from(l);
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = match VhostUserDaemon::new(name.to_string(), backend.clone(), mem) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(socket = name, error = %e, "vhost-user daemon");
                return;
            }
        };
        if let Err(e) = daemon.start(&mut listener) {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            tracing::warn!(socket = name, error = %e, "vhost-user accept");
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        *conn.lock().unwrap_or_else(|p| p.into_inner()) = daemon.shutdown_handle();
        // A stop that came while accepting: it may have found no connection to shut down.
        if stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
        }
        tracing::info!(socket = name, "vhost-user frontend connected");
        match daemon.wait() {
            Ok(()) => tracing::info!(socket = name, "vhost-user frontend disconnected"),
            Err(e) => tracing::info!(socket = name, error = %e, "vhost-user connection ended"),
        }
        conn.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Dropping the daemon stops its worker threads and joins them: every request they took
        // is answered (or abandoned with the connection) before the next frontend is accepted.
        drop(daemon);
        backend.reset_connection();
    }
}

impl Served {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stats(&self) -> &Stats {
        &self.backend.stats
    }

    /// Stops serving (blocking: run it off the async runtime). Returns when no thread of this
    /// backend touches the device any more; the socket file is removed. Dropping a `Served`
    /// does the same.
    pub fn stop(self) {
        drop(self)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.backend.stopping.store(true, Ordering::SeqCst);
        if let Some(h) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            h.shutdown();
        }
        // Wakes an accept that is waiting (shutting a listening socket down makes accept fail;
        // a connection does the same where the path still exists): it sees the stop and ends.
        let _ = socket2::SockRef::from(&self.listener).shutdown(std::net::Shutdown::Both);
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        use std::os::unix::fs::MetadataExt;
        if std::fs::metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
