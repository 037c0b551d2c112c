//! TLS for the HTTP API: rustls on the TCP listener, with the certificate and key read from
//! files and re-read when they change, so a renewed certificate is served without a restart.
//!
//! - The files are checked at most once a second, on a handshake: (mtime, length, inode) of
//!   each. A pair that does not load or whose key does not match the certificate (a renewal
//!   half done: the certificate renamed into place, the key not yet) is logged and the pair
//!   served before is kept; it is tried again when either file changes again.
//! - Handshakes run in their own tasks, each bounded in time, so a client that connects and
//!   says nothing holds neither the accept loop nor other clients.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;

/// Longest a client may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in flight at once; more connections wait in the kernel's backlog.
const MAX_HANDSHAKES: usize = 256;
/// How often the files are looked at (on a handshake).
const RECHECK: Duration = Duration::from_secs(1);

type Stamp = Option<(std::time::SystemTime, u64, u64)>;

fn stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Loads a PEM certificate chain and its private key, checking that they belong together.
pub fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("reading {}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("parsing {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{} holds no certificate", cert.display()));
    }
    let der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("reading the private key in {}: {e}", key.display()))?;
    let mismatch = |e| {
        format!(
            "the key in {} does not match the certificate in {}: {e}",
            key.display(),
            cert.display()
        )
    };
    let ck = CertifiedKey::from_der(chain, der, &provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => mismatch(e),
        e => format!("{} and {}: {e}", cert.display(), key.display()),
    })?;
    ck.keys_match().map_err(mismatch)?;
    Ok(Arc::new(ck))
}

struct Current {
    stamps: (Stamp, Stamp),
    checked: Instant,
    pair: Arc<CertifiedKey>,
}

/// The certificate the server presents, re-read when its files change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<Current>,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current")
            .field("stamps", &self.stamps)
            .finish()
    }
}

impl ReloadingCert {
    /// Reads the pair once; a daemon does not start with a certificate it cannot serve.
    pub fn open(cert: &Path, key: &Path) -> Result<Arc<ReloadingCert>, String> {
        let stamps = (stamp(cert), stamp(key));
        let pair = load_pair(cert, key)?;
        Ok(Arc::new(ReloadingCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Mutex::new(Current {
                stamps,
                checked: Instant::now(),
                pair,
            }),
        }))
    }

    fn get(&self) -> Arc<CertifiedKey> {
        let mut c = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if c.checked.elapsed() >= RECHECK {
            c.checked = Instant::now();
            let now = (stamp(&self.cert), stamp(&self.key));
            if now != c.stamps {
                // Recorded either way: a bad pair is reported once, not on every handshake.
                c.stamps = now;
                match load_pair(&self.cert, &self.key) {
                    Ok(p) => {
                        c.pair = p;
                        tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    }
                    Err(e) => tracing::warn!(
                        "TLS certificate not reloaded, the one loaded before is still served: {e}"
                    ),
                }
            }
        }
        c.pair.clone()
    }

    /// A rustls server configuration presenting this certificate (HTTP/1.1).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// A TCP listener whose connections come out of a TLS handshake (for `axum::serve`).
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
}

impl TlsListener {
    /// Starts accepting on `tcp`; ends when the listener is dropped.
    pub fn new(tcp: TcpListener, cfg: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let addr = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (sock, peer) = tokio::select! {
                    _ = tx.closed() => return,
                    r = tcp.accept() => match r {
                        Ok(c) => c,
                        Err(e) => {
                            // Out of descriptors and the like: wait instead of spinning.
                            tracing::warn!("accepting a connection: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                };
                let _ = sock.set_nodelay(true);
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(sock)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, addr })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task only ends once this listener is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.addr)
    }
}
