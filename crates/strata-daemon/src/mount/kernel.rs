//! The kernel NBD backend of a mount: `/dev/nbdN` connected over netlink to socketpairs this
//! daemon serves itself (no socket file, no TCP).
//!
//! ```text
//! connect ─▶ pick a free device (pool) ─▶ CONNECTIONS socketpairs ─▶ netlink CONNECT
//!            (size, 4 KiB blocks, our transmission flags, timeout, dead_conn_timeout,
//!            backend "strata-{node}-{h}") ─▶ one supervisor per connection serving our end
//! a connection ends while mounted (the kernel timed a request out and shut the socket, or our
//!            side failed) ─▶ its supervisor swaps a fresh socketpair into the dead slot
//!            (RECONFIGURE; ENOSPC until the kernel has marked it dead: retried)
//! daemon restart or kill -9 ─▶ the kernel marks every slot dead and holds requests for
//!            dead_conn_timeout ─▶ the next start finds the device by its backend name and
//!            RECONFIGUREs it: the mounted filesystem never sees an error
//! disconnect ─▶ netlink DISCONNECT ─▶ drain the server ─▶ wait for the device to be free
//! ```
//!
//! The pool never hands out a device that is in use: a device is free only when the kernel
//! holds no configuration for it (netlink STATUS), sysfs shows no connection's leftovers
//! (`pid` absent, size 0, nothing in flight) and nothing holds it (`holders` empty); a
//! CONNECT refused with EBUSY (a race with another user) moves to the next. Not the kernel's
//! own choice (CONNECT without an index): this way a device is picked by what it shows.
//! Devices this node connected are named by their backend identifier, so a restart reattaches
//! only its own and disconnects those no record names (left by a crash between steps).

use std::collections::BTreeSet;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_engine::Volume;
use strata_nbd::{Export, Exports, Server, ServerConfig};
use tokio::task::JoinHandle;

use super::netlink::{Connect, Netlink};

/// Connections per device (the kernel spreads requests over them; CAN_MULTI_CONN holds).
pub const CONNECTIONS: usize = 4;
/// A request unanswered this long is requeued by the kernel (on another connection, or after
/// a reconnect), not failed; the connection it was on is shut. Requests in flight when the
/// daemon died are resent only when this fires, so it is also how long they wait after a
/// restart. Above a cold read's usual object-store fetch; a slower one costs a reconnect.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the kernel holds requests while every connection is dead (a daemon restart)
/// before failing them with EIO.
pub const DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(600);
const BLOCK: u64 = 4096;

/// Devices this process has picked and not yet released.
static HELD: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

fn held() -> std::sync::MutexGuard<'static, BTreeSet<u32>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

fn sys(index: u32, attr: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/nbd{index}/{attr}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether the device is connected (its `pid` file exists from CONNECT until the kernel
/// frees the configuration).
fn connected(index: u32) -> bool {
    sys(index, "pid").is_some()
}

/// Whether the kernel holds a connection (or its leftovers) for the device: a pid, a size,
/// requests in flight, or a holder (a partition, a device-mapper table).
fn busy(index: u32) -> bool {
    connected(index)
        || sys(index, "size").is_some_and(|s| s != "0")
        || sys(index, "inflight").is_some_and(|s| s.split_whitespace().any(|n| n != "0"))
        || std::fs::read_dir(format!("/sys/block/nbd{index}/holders"))
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
}

/// The backend identifier of a connected device.
pub fn backend_of(index: u32) -> Option<String> {
    sys(index, "backend").filter(|b| !b.is_empty())
}

/// The indexes of the nbd devices that exist.
pub fn devices() -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir("/sys/block")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_prefix("nbd")?
                        .parse::<u32>()
                        .ok()
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Picks a free device and marks it held; none free: the next index (the kernel creates it).
/// Free: no configuration in the kernel (STATUS), no connection's leftovers in sysfs, no
/// holder. (Not an open of the device: an open itself creates a configuration for a while.)
fn pick(nl: &Netlink, skip: &BTreeSet<u32>) -> u32 {
    let mut h = held();
    let all = devices();
    let free = all.iter().copied().find(|&i| {
        !h.contains(&i)
            && !skip.contains(&i)
            && !busy(i)
            && matches!(nl.connected(i), Ok(Some(false)))
    });
    let i = free.unwrap_or_else(|| {
        let top = all.iter().chain(h.iter()).chain(skip.iter()).max();
        top.map_or(0, |t| t + 1)
    });
    h.insert(i);
    i
}

/// A workspace's volume on `/dev/nbd{index}`.
pub struct KernelDisk {
    pub index: u32,
    backend: String,
    server: Arc<Server>,
    stopping: Arc<AtomicBool>,
    slots: Vec<JoinHandle<()>>,
    live: Arc<std::sync::atomic::AtomicUsize>,
}

/// Whether the kernel still listens on a connection: it shuts its end when it gives up on
/// the connection (POLLRDHUP on ours, even with requests still unread in the buffer).
fn alive_of(conn: &tokio::net::UnixStream) -> Option<strata_nbd::Alive> {
    use std::os::fd::AsFd;
    let fd = conn.as_fd().try_clone_to_owned().ok()?;
    Some(Arc::new(move || {
        let mut p = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::RDHUP,
        )];
        let now = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut p, Some(&now)) {
            Ok(_) => !p[0].revents().intersects(
                rustix::event::PollFlags::RDHUP
                    | rustix::event::PollFlags::HUP
                    | rustix::event::PollFlags::ERR,
            ),
            Err(_) => true,
        }
    }))
}

/// One socketpair: our end for the server, the kernel's end to hand over.
fn pair() -> io::Result<(tokio::net::UnixStream, std::os::unix::net::UnixStream)> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    Ok((tokio::net::UnixStream::from_std(ours)?, theirs))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| io::Error::other(format!("blocking task: {e}")))?
}

/// Gives connected device `index` (of `backend`) a disk of `size` bytes (after the volume
/// grew); the kernel applies it at once.
pub async fn resize(index: u32, backend: String, size: u64) -> io::Result<()> {
    blocking(move || Netlink::open()?.resize(index, &backend, size, BLOCK)).await
}

/// Hands the kernel one fresh connection for a dead slot of `index`. Whether a slot took it
/// shows only on our end: a socket the kernel dropped (no slot was dead yet) closes at once.
async fn swap_in(index: u32, backend: &str) -> io::Result<tokio::net::UnixStream> {
    let (ours, theirs) = pair()?;
    let backend = backend.to_string();
    blocking(move || Netlink::open()?.reconfigure(index, &backend, &[theirs.as_raw_fd()])).await?;
    Ok(ours)
}

impl KernelDisk {
    /// The per-mount server and its export; a read-only mount's device refuses changes in
    /// the server too (the kernel, told READ_ONLY, sends none).
    fn server(vol: &Arc<Volume>, read_only: bool) -> (Arc<Server>, Export, u64) {
        let device: Arc<dyn strata_nbd::BlockDevice> = if read_only {
            Arc::new(strata_nbd::ReadOnly(vol.clone()))
        } else {
            vol.clone()
        };
        let export = Export {
            description: "strata kernel nbd".into(),
            device,
            multi_conn: true,
        };
        let server = Server::new(Exports::new(), ServerConfig::default());
        let flags = server.transmission_flags(&export) as u64;
        (server, export, flags)
    }

    /// One task per connection: serves it, and when it ends while the mount is up, hands the
    /// kernel a fresh one for the slot (backing off while the kernel drops them because the
    /// slot is not dead yet). Only into this mount's device: before each RECONFIGURE the
    /// device must still be connected under this mount's backend name; a device gone, or
    /// taken over, or a kernel refusing for a minute ends the supervisor (the mount is then
    /// down: its requests fail once the dead-connection timeout passes).
    fn supervise(&mut self, export: &Export, conns: Vec<tokio::net::UnixStream>) {
        for c in conns {
            let (server, export, stopping, index, backend, live) = (
                self.server.clone(),
                export.clone(),
                self.stopping.clone(),
                self.index,
                self.backend.clone(),
                self.live.clone(),
            );
            self.slots.push(tokio::spawn(async move {
                let mut conn = c;
                let mut backoff = Duration::from_millis(20);
                loop {
                    let served = std::time::Instant::now();
                    live.fetch_add(1, Ordering::SeqCst);
                    let alive = alive_of(&conn);
                    let _ = server.spawn_negotiated(conn, export.clone(), alive).await;
                    live.fetch_sub(1, Ordering::SeqCst);
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    if served.elapsed() > Duration::from_secs(1) {
                        tracing::warn!(device = index, "an nbd connection of a mounted workspace ended; reconnecting it");
                        backoff = Duration::from_millis(20);
                    } else {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    let mut failures = 0;
                    conn = loop {
                        if stopping.load(Ordering::SeqCst) {
                            return;
                        }
                        if backend_of(index).as_deref() != Some(backend.as_str())
                            || !connected(index)
                        {
                            tracing::error!(device = index, "the nbd device of a mounted workspace is no longer this mount's (disconnected or taken over); not reconnecting");
                            return;
                        }
                        match swap_in(index, &backend).await {
                            Ok(c) => break c,
                            Err(e) => {
                                failures += 1;
                                if failures >= 60 {
                                    tracing::error!(device = index, error = %e, "reconnecting an nbd connection keeps failing; giving up on it");
                                    return;
                                }
                                tracing::warn!(device = index, error = %e, "reconnecting an nbd connection failed; retrying");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                        }
                    };
                }
            }));
        }
    }

    /// Connects a free device to the volume. The connections are served from when the kernel
    /// has taken them (what it sends before waits in the socket buffers).
    pub async fn connect(
        vol: Arc<Volume>,
        backend: String,
        read_only: bool,
        (timeout, dead_conn_timeout): (Duration, Duration),
    ) -> io::Result<KernelDisk> {
        let (server, export, flags) = Self::server(&vol, read_only);
        let size = vol.size();
        if size == 0 || !size.is_multiple_of(BLOCK) {
            return Err(io::Error::other(format!(
                "volume size {size} is not a multiple of {BLOCK}"
            )));
        }
        let nl = blocking(Netlink::open).await?;
        let nl = Arc::new(Mutex::new(nl));
        let mut skip = BTreeSet::new();
        for _ in 0..8 {
            let mut ours = vec![];
            let mut theirs = vec![];
            for _ in 0..CONNECTIONS {
                let (o, t) = pair()?;
                ours.push(o);
                theirs.push(t);
            }
            let index = {
                let nl = nl.clone();
                let skip = skip.clone();
                blocking(move || Ok(pick(&nl.lock().unwrap_or_else(|p| p.into_inner()), &skip)))
                    .await?
            };
            let c = Connect {
                index,
                size,
                block_size: BLOCK,
                server_flags: flags,
                timeout,
                dead_conn_timeout,
                backend: backend.clone(),
            };
            let nl2 = nl.clone();
            let r = blocking(move || {
                let fds: Vec<_> = theirs.iter().map(|t| t.as_raw_fd()).collect();
                nl2.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .connect(&c, &fds)
                // `theirs` closes here: the kernel holds its own references.
            })
            .await;
            match r {
                Ok(got) if got == index => {
                    let mut disk = KernelDisk {
                        index,
                        backend: backend.clone(),
                        server: server.clone(),
                        stopping: Arc::new(AtomicBool::new(false)),
                        slots: vec![],
                        live: Default::default(),
                    };
                    disk.supervise(&export, ours);
                    return Ok(disk);
                }
                Ok(got) => {
                    tracing::error!(
                        asked = index,
                        got,
                        "the kernel connected another nbd device than asked"
                    );
                    let _ = blocking(move || Netlink::open()?.disconnect(got)).await;
                    held().remove(&index);
                    return Err(io::Error::other(
                        "the kernel connected another nbd device than asked",
                    ));
                }
                Err(e) => {
                    held().remove(&index);
                    if e.raw_os_error() == Some(libc::EBUSY) {
                        skip.insert(index);
                        continue;
                    }
                    return Err(io::Error::new(
                        e.kind(),
                        format!("nbd connect of /dev/nbd{index}: {e}"),
                    ));
                }
            }
        }
        Err(io::Error::other("no free nbd device after 8 tries"))
    }

    /// After a restart: serves `/dev/nbd{index}` again, if it is this mount's device (its
    /// backend name) and still connected, by swapping fresh connections into its dead slots.
    pub async fn resume(
        vol: Arc<Volume>,
        index: u32,
        backend: &str,
        read_only: bool,
    ) -> io::Result<KernelDisk> {
        if backend_of(index).as_deref() != Some(backend) || !connected(index) {
            return Err(io::Error::other(format!(
                "/dev/nbd{index} is not this mount's connected device"
            )));
        }
        held().insert(index);
        let (server, export, _) = Self::server(&vol, read_only);
        let mut disk = KernelDisk {
            index,
            backend: backend.to_string(),
            server,
            stopping: Arc::new(AtomicBool::new(false)),
            slots: vec![],
            live: Default::default(),
        };
        // The old daemon's sockets closed when it died and the kernel marked their slots dead
        // (it has, by the time a new daemon runs; a socket handed over early is dropped and
        // its supervisor hands another).
        let mut conns = vec![];
        for _ in 0..CONNECTIONS {
            match swap_in(index, backend).await {
                Ok(c) => conns.push(c),
                Err(e) => {
                    disk.supervise(&export, conns);
                    disk.stop_serving().await;
                    held().remove(&index);
                    return Err(io::Error::new(
                        e.kind(),
                        format!("nbd reconfigure of /dev/nbd{index}: {e}"),
                    ));
                }
            }
        }
        disk.supervise(&export, conns);
        Ok(disk)
    }

    /// Connections being served now (a socket the kernel dropped counts until it closes).
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    async fn stop_serving(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.server.shutdown().await;
        for s in self.slots.drain(..) {
            s.abort();
        }
    }

    /// Disconnects the device (the kernel sends DISC and shuts its sockets), drains the
    /// server, and waits (bounded) for the kernel to free the device before releasing it.
    pub async fn disconnect(mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        let index = self.index;
        if let Err(e) = blocking(move || Netlink::open()?.disconnect(index)).await {
            tracing::warn!(device = index, error = %e, "nbd disconnect failed");
        }
        self.stop_serving().await;
        for _ in 0..250 {
            if !connected(index) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        held().remove(&index);
    }

    /// Leaves the device connected but stops serving it (a daemon stop): the connections
    /// finish what they accepted, then close; the kernel marks them dead and holds the
    /// sandbox's requests until the next start swaps fresh ones in. Nothing is served after
    /// the stop's final flush (the volumes are closed after it).
    pub async fn park(mut self) {
        self.stop_serving().await;
        held().remove(&self.index);
    }
}

/// Disconnects every device connected under a backend name that starts with `prefix` and is
/// not in `keep` (what a crash left between a connect and its record, or a record's removal).
pub async fn sweep(prefix: &str, keep: &BTreeSet<u32>) {
    for i in devices() {
        if keep.contains(&i) || held().contains(&i) {
            continue;
        }
        if backend_of(i).is_some_and(|b| b.starts_with(prefix)) && connected(i) {
            tracing::warn!(
                device = i,
                "disconnecting an nbd device this node left connected"
            );
            let _ = blocking(move || Netlink::open()?.disconnect(i)).await;
        }
    }
}

/// Disconnects this mount's device if it is still connected (a clear of a mount that is down).
pub async fn disconnect_named(backend: &str) {
    for i in devices() {
        if backend_of(i).as_deref() == Some(backend) && connected(i) && !held().contains(&i) {
            let _ = blocking(move || Netlink::open()?.disconnect(i)).await;
        }
    }
}

/// `/dev/nbd{index}`.
pub fn device_path(index: u32) -> String {
    Path::new("/dev")
        .join(format!("nbd{index}"))
        .display()
        .to_string()
}
