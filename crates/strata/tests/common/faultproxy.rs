//! A fault-injecting HTTP proxy for the S3-protocol server: the real server does the storing,
//! the proxy produces what a real network and a real cloud do to requests now and then.
//! Each request gets at most one fault, chosen with the configured probability:
//! `503` without forwarding, a slow forward, a connection reset before forwarding, a response
//! whose body is cut short, or a request that lands but whose reply is lost.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Unavailable,
    Slow,
    Reset,
    Truncate,
    LostReply,
}

pub const ALL: [Fault; 5] = [
    Fault::Unavailable,
    Fault::Slow,
    Fault::Reset,
    Fault::Truncate,
    Fault::LostReply,
];

#[derive(Default)]
pub struct Counts {
    pub requests: AtomicU64,
    pub unavailable: AtomicU64,
    pub slow: AtomicU64,
    pub reset: AtomicU64,
    pub truncate: AtomicU64,
    pub lost_reply: AtomicU64,
}

impl Counts {
    pub fn injected(&self) -> u64 {
        self.unavailable.load(Relaxed)
            + self.slow.load(Relaxed)
            + self.reset.load(Relaxed)
            + self.truncate.load(Relaxed)
            + self.lost_reply.load(Relaxed)
    }
    pub fn summary(&self) -> String {
        format!(
            "{} requests: 503 {}, slow {}, reset {}, truncated {}, lost reply {}",
            self.requests.load(Relaxed),
            self.unavailable.load(Relaxed),
            self.slow.load(Relaxed),
            self.reset.load(Relaxed),
            self.truncate.load(Relaxed),
            self.lost_reply.load(Relaxed)
        )
    }
}

/// Decides from a request's head (request line and headers) whether it is let through; a
/// refused one gets `403 AccessDenied`, as a bucket policy's refusal would.
pub type Gate = Arc<dyn Fn(&str) -> bool + Send + Sync>;

pub struct Proxy {
    pub url: String,
    /// (faults to pick from, probability per request)
    pub policy: Arc<Mutex<(Vec<Fault>, f64)>>,
    pub counts: Arc<Counts>,
    pub gate: Arc<Mutex<Option<Gate>>>,
}

impl Proxy {
    pub fn set(&self, faults: &[Fault], p: f64) {
        *self.policy.lock().unwrap() = (faults.to_vec(), p);
    }
    pub fn set_gate(&self, g: Gate) {
        *self.gate.lock().unwrap() = Some(g);
    }
}

/// Starts a proxy on loopback in front of `upstream` (`http://host:port`).
pub async fn start(upstream: &str, seed: u64) -> Proxy {
    let up = upstream
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let policy = Arc::new(Mutex::new((vec![], 0.0)));
    let counts = Arc::new(Counts::default());
    let rng = Arc::new(Mutex::new(rand::rngs::SmallRng::seed_from_u64(seed)));
    let gate: Arc<Mutex<Option<Gate>>> = Arc::default();
    let (p2, c2, g2) = (policy.clone(), counts.clone(), gate.clone());
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (up, policy, counts, rng) = (up.clone(), p2.clone(), c2.clone(), rng.clone());
            let gate = g2.lock().unwrap().clone();
            tokio::spawn(async move {
                let _ = serve(s, &up, &policy, &counts, &rng, gate).await;
            });
        }
    });
    Proxy {
        url,
        policy,
        counts,
        gate,
    }
}

/// Reads one HTTP/1.1 request (head + Content-Length body) from `s`; None at EOF.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Option<Vec<u8>>> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                let mut chunk = vec![0u8; 64 << 10];
                let n = s.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(None);
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let req: Vec<u8> = buf.drain(..total).collect();
            return Ok(Some(req));
        }
        let mut chunk = vec![0u8; 64 << 10];
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Rewrites the request to close the upstream connection after the response (the header is
/// not signed by SigV4), so the response is simply everything upstream sends.
fn with_close(req: &[u8]) -> Vec<u8> {
    let end = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&req[..end]);
    let mut out = String::new();
    for l in head.split("\r\n") {
        if !l.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(l);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    let mut v = out.into_bytes();
    v.extend_from_slice(&req[end + 4..]);
    v
}

async fn forward(up: &str, req: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut u = TcpStream::connect(up).await?;
    u.write_all(&with_close(req)).await?;
    let mut resp = vec![];
    u.read_to_end(&mut resp).await?;
    Ok(resp)
}

/// Answers with an S3 error document and closes.
async fn s3_error(s: &mut TcpStream, status: &str, code: &str, msg: &str) -> std::io::Result<()> {
    let body = format!("<Error><Code>{code}</Code><Message>{msg}</Message></Error>");
    s.write_all(
        format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
}

async fn serve(
    mut s: TcpStream,
    up: &str,
    policy: &Mutex<(Vec<Fault>, f64)>,
    counts: &Counts,
    rng: &Mutex<rand::rngs::SmallRng>,
    gate: Option<Gate>,
) -> std::io::Result<()> {
    let mut buf = vec![];
    // One request per connection: upstream closes after its response, so do we (the client
    // reconnects; every response it got was complete and framed, or was the injected fault).
    if let Some(req) = read_request(&mut s, &mut buf).await? {
        counts.requests.fetch_add(1, Relaxed);
        if let Some(g) = gate {
            let end = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0);
            if !g(&String::from_utf8_lossy(&req[..end])) {
                return s3_error(&mut s, "403 Forbidden", "AccessDenied", "gate").await;
            }
        }
        let fault = {
            let (faults, p) = policy.lock().unwrap().clone();
            let mut r = rng.lock().unwrap();
            (!faults.is_empty() && r.random_bool(p))
                .then(|| faults[r.random_range(0..faults.len())])
        };
        match fault {
            Some(Fault::Unavailable) => {
                counts.unavailable.fetch_add(1, Relaxed);
                return s3_error(&mut s, "503 Service Unavailable", "SlowDown", "injected").await;
            }
            Some(Fault::Reset) => {
                counts.reset.fetch_add(1, Relaxed);
                return Ok(()); // drop the connection without an answer
            }
            Some(Fault::LostReply) => {
                counts.lost_reply.fetch_add(1, Relaxed);
                let _ = forward(up, &req).await?; // it lands …
                return Ok(()); // … the client never hears
            }
            Some(Fault::Slow) => {
                counts.slow.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let resp = forward(up, &req).await?;
                s.write_all(&resp).await?;
            }
            Some(Fault::Truncate) => {
                let resp = forward(up, &req).await?;
                let end = resp
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map_or(resp.len(), |e| e + 4);
                let body = resp.len() - end;
                if body >= 2 {
                    counts.truncate.fetch_add(1, Relaxed);
                    s.write_all(&resp[..end + body / 2]).await?;
                    return Ok(());
                }
                s.write_all(&resp).await?;
            }
            None => {
                let resp = forward(up, &req).await?;
                s.write_all(&resp).await?;
            }
        }
    }
    Ok(())
}
