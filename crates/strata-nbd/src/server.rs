//! The NBD server: fixed newstyle negotiation, then concurrent transmission with out-of-order
//! replies.
//!
//! ```text
//! accept ─▶ handshake (timeout) ─▶ options: LIST, INFO, GO, EXPORT_NAME, STRUCTURED_REPLY,
//!           LIST/SET_META_CONTEXT (base:allocation), ABORT; anything else ERR_UNSUP
//!        ─▶ transmission: reader loop parses a request, reserves its bytes from the
//!           connection's in-flight budget, reads any payload, spawns the operation; each
//!           operation sends its complete reply through one writer task, so replies never
//!           interleave on the wire but may complete out of order.
//! ```
//! A FLUSH covers every write whose reply was sent before the FLUSH arrived, on any connection
//! to the same export (the device is shared), which is what CAN_MULTI_CONN promises.
//!
//! Memory per connection is bounded whatever the client sends: every request is charged to the
//! connection's in-flight budget (its payload or read length, at least [`MIN_CHARGE`]) from
//! when its header is read until its reply has been written to the socket, so a client that
//! stops reading replies stops the server from reading requests.
//!
//! [`Server::shutdown`] stops accepting, lets every connection finish the requests it already
//! accepted (their replies are sent), then closes them; it returns when none is left. Stopping
//! an export this way is what detach does before its final cut, so no write is acknowledged
//! after the cut.
//! Protocol violations that desynchronise the stream (bad magic, absurd payloads) close the
//! connection; everything else gets the error reply the spec names, and the server and other
//! connections keep running. Nothing acknowledged is undone by a disconnect.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;

use strata_block::{BlockDevice, DevError};

mod conn;
mod negotiate;
mod transmit;

use crate::proto::*;
pub use conn::Conn;
use conn::{send_replies, Charge, Reply, READ_BUFFER};

/// One export: a device and how it is offered.
#[derive(Clone)]
pub struct Export {
    pub device: Arc<dyn BlockDevice>,
    pub description: String,
    /// Advertise CAN_MULTI_CONN (true when every connection shares the device's flush).
    pub multi_conn: bool,
}

/// The set of exports, by name. Can change while the server runs.
#[derive(Default)]
pub struct Exports {
    map: RwLock<HashMap<String, Export>>,
}

impl Exports {
    pub fn new() -> Arc<Exports> {
        Arc::new(Exports::default())
    }
    pub fn insert(&self, name: &str, e: Export) {
        if let Ok(mut m) = self.map.write() {
            m.insert(name.to_string(), e);
        }
    }
    pub fn remove(&self, name: &str) -> Option<Export> {
        self.map.write().ok()?.remove(name)
    }
    pub fn get(&self, name: &str) -> Option<Export> {
        let m = self.map.read().ok()?;
        match m.get(name) {
            Some(e) => Some(e.clone()),
            // The empty name means "the default export": the only one, if there is one.
            None if name.is_empty() && m.len() == 1 => m.values().next().cloned(),
            None => None,
        }
    }
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .map
            .read()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest READ/WRITE/BLOCK_STATUS length accepted (advertised as the maximum block size).
    pub max_request: u32,
    /// Bytes of request payloads and read buffers one connection may hold at once.
    pub max_inflight_bytes: u32,
    pub handshake_timeout: Duration,
    /// Close a connection idle this long in transmission (None: never; kernel clients idle).
    pub idle_timeout: Option<Duration>,
    /// Where request latencies are recorded (shared across servers if wanted).
    pub metrics: Option<Arc<crate::NbdMetrics>>,
    /// How long [`Server::shutdown`] lets connections finish what they accepted before it
    /// closes them anyway (a client paused mid-payload, one that reads no replies, a request
    /// waiting on a frozen device). Requests cut off so were never answered.
    pub drain_timeout: Duration,
    /// Bytes of requests in flight shared with other servers (every export of one tenant):
    /// each request is charged to it beside its connection's budget. Its owner makes it at
    /// least `max_request` permits: a request larger than it would wait for ever.
    pub shared_budget: Option<Arc<tokio::sync::Semaphore>>,
    /// Connections served at once; one accepted past it is closed at once (None: no limit).
    pub max_connections: Option<usize>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_request: 32 << 20,
            max_inflight_bytes: 64 << 20,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: None,
            metrics: None,
            drain_timeout: Duration::from_secs(10),
            shared_budget: None,
            max_connections: None,
        }
    }
}

pub struct Server {
    exports: Arc<Exports>,
    cfg: ServerConfig,
    stop: watch::Sender<bool>,
    /// Cloned by every live connection; [`Server::shutdown`] waits for all clones to drop.
    alive: std::sync::Mutex<Option<mpsc::Sender<()>>>,
    drained: tokio::sync::Mutex<mpsc::Receiver<()>>,
    /// Live connection tasks, to close those that outlast the drain.
    conns: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// Accepted connections being served ([`ServerConfig::max_connections`]).
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

/// Aborts a task when dropped (a connection's reply writer goes with its connection).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The least a request is charged against the in-flight budget, so that a client cannot hold
/// millions of tiny requests (FLUSH, TRIM) in flight on one connection.
pub const MIN_CHARGE: u32 = 16 << 10;

/// At most this many BLOCK_STATUS descriptors in one reply (the spec lets a server describe a
/// prefix of the range; the client asks again for the rest).
const MAX_EXTENTS: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("protocol: {0}")]
    Proto(#[from] ProtoError),
    #[error("handshake timed out")]
    Timeout,
    #[error("client ended negotiation")]
    Aborted,
}

struct Negotiated {
    /// The export's name as the client asked for it (logged with every error of the
    /// connection).
    name: String,
    export: Export,
    structured: bool,
    meta: bool,
    alive: Option<Alive>,
}

/// Whether the client is still there to be answered (see [`Server::spawn_negotiated`]).
pub type Alive = Arc<dyn Fn() -> bool + Send + Sync>;

impl Server {
    pub fn new(exports: Arc<Exports>, mut cfg: ServerConfig) -> Arc<Server> {
        cfg.max_request = cfg.max_request.clamp(4096, 1 << 30);
        cfg.max_inflight_bytes = cfg.max_inflight_bytes.max(cfg.max_request);
        let (alive, drained) = mpsc::channel(1);
        Arc::new(Server {
            exports,
            cfg,
            stop: watch::Sender::new(false),
            alive: std::sync::Mutex::new(Some(alive)),
            drained: tokio::sync::Mutex::new(drained),
            conns: Default::default(),
            accepted: Default::default(),
        })
    }

    /// Stops accepting connections, lets every open connection finish what it accepted (their
    /// replies are written), closes them, and returns once none is left. Connections still
    /// busy after the drain timeout are closed anyway. Idempotent.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        self.alive.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut rx = self.drained.lock().await;
        let all = async { while rx.recv().await.is_some() {} };
        if tokio::time::timeout(self.cfg.drain_timeout, all)
            .await
            .is_err()
        {
            tracing::warn!(
                timeout = ?self.cfg.drain_timeout,
                "nbd connections still busy at shutdown; closing them (what they had not answered was never acknowledged)"
            );
            for h in self
                .conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .drain(..)
            {
                h.abort();
            }
            while rx.recv().await.is_some() {}
        }
    }

    fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// A token held by one connection for its life; None once the server is shutting down.
    fn join(&self) -> Option<mpsc::Sender<()>> {
        self.alive.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Binds a unix socket at `path` (replacing a stale one), owner-only (0600).
    pub fn bind_unix(path: &Path) -> io::Result<UnixListener> {
        let _ = std::fs::remove_file(path);
        let l = UnixListener::bind(path)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(l)
    }

    /// Accepts connections until [`Server::shutdown`].
    pub async fn serve_unix(self: Arc<Self>, listener: UnixListener) -> io::Result<()> {
        let mut stop = self.stopped();
        loop {
            let (s, _) = tokio::select! {
                r = listener.accept() => r?,
                _ = stop.wait_for(|s| *s) => return Ok(()),
            };
            self.spawn_connection(s);
        }
    }

    /// Accepts connections until [`Server::shutdown`].
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        let mut stop = self.stopped();
        loop {
            let (s, peer) = tokio::select! {
                r = listener.accept() => r?,
                _ = stop.wait_for(|s| *s) => return Ok(()),
            };
            let _ = s.set_nodelay(true);
            tracing::debug!(%peer, "nbd connection");
            self.spawn_connection(s);
        }
    }

    /// Serves one accepted connection in its own task, unless the server is shutting down (then
    /// the connection is closed at once).
    /// Past [`ServerConfig::max_connections`] the connection is closed at once: a client
    /// opening connection after connection holds no more than the limit's worth.
    pub fn spawn_connection<S: Conn>(self: &Arc<Self>, s: S) {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.accepted.fetch_add(1, SeqCst);
        if self.cfg.max_connections.is_some_and(|max| n >= max) {
            self.accepted.fetch_sub(1, SeqCst);
            tracing::debug!(
                max = self.cfg.max_connections,
                "nbd connection refused: the export serves its most connections"
            );
            return;
        }
        struct Live(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Live {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let (me, live) = (self.clone(), Live(self.accepted.clone()));
        self.spawn_tracked(async move {
            let _live = live;
            me.handle(s).await
        });
    }

    /// Serves a connection whose negotiation happened elsewhere, in its own task: the kernel's
    /// NBD client, handed one end of a socketpair over netlink, starts in the transmission
    /// phase with the flags [`Server::transmission_flags`] gave it (simple replies, no meta
    /// contexts). The task ends when the connection does (or at once if the server is
    /// shutting down); [`Server::shutdown`] drains it like any other.
    ///
    /// `alive` says whether the client still listens. The kernel gives up on a connection
    /// whose request timed out (it shuts its end and resends the request elsewhere), but
    /// requests it had already sent may still sit unread here: executed late, such a write
    /// would land after the newer data its resent copy let through. So once `alive` is false
    /// no request is read, and no write, trim or zeroing is executed (checked just before it
    /// would reach the device).
    pub fn spawn_negotiated<S>(
        self: &Arc<Self>,
        s: S,
        export: Export,
        alive: Option<Alive>,
    ) -> tokio::task::JoinHandle<()>
    where
        S: Conn,
    {
        let me = self.clone();
        self.spawn_tracked(async move {
            let (rd, wr) = s.into_halves();
            let neg = Negotiated {
                name: export.description.clone(),
                export,
                structured: false,
                meta: false,
                alive,
            };
            let name = neg.name.clone();
            if let Err(e) = me.transmit(rd, wr, neg).await {
                tracing::debug!(export = %name, error = %e, "nbd connection closed");
            }
        })
    }

    /// Runs one connection's task holding a join token (none once shutting down: the task
    /// ends at once, dropping the connection), where [`Server::shutdown`] can abort it.
    fn spawn_tracked(
        self: &Arc<Self>,
        conn: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let token = self.join();
        let task = tokio::spawn(async move {
            // Dropped with the task, also when it is aborted.
            let Some(_token) = token else { return };
            conn.await
        });
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.retain(|h| !h.is_finished());
        conns.push(task.abort_handle());
        task
    }

    /// The transmission flags a client of `e` is given (without structured replies).
    pub fn transmission_flags(&self, e: &Export) -> u16 {
        self.tflags(e, false)
    }

    /// Serves one connection to completion. Errors are logged here, where they are handled.
    pub async fn handle<S: Conn>(self: Arc<Self>, stream: S) {
        let (mut rd, mut wr) = stream.into_halves();
        let mut stop = self.stopped();
        let negotiated = tokio::select! {
            r = tokio::time::timeout(self.cfg.handshake_timeout, self.negotiate(&mut rd, &mut wr)) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let neg = match negotiated {
            Ok(Ok(Some(n))) => n,
            Ok(Ok(None)) | Ok(Err(ConnError::Aborted)) => return,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "nbd negotiation failed");
                return;
            }
            Err(_) => {
                tracing::debug!(error = %ConnError::Timeout, "nbd negotiation failed");
                return;
            }
        };
        let name = neg.name.clone();
        if let Err(e) = self.transmit(rd, wr, neg).await {
            tracing::debug!(export = %name, error = %e, "nbd connection closed");
        }
    }
}
