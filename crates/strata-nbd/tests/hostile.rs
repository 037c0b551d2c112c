//! Hostile clients: random bytes at every stage of the protocol, slow handshakes, idle
//! connections, and TCP. The server must never panic, must keep serving other clients, and
//! must never change data it did not acknowledge writing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use strata_nbd::client::Client;
use strata_nbd::proto::*;
use strata_nbd::{BlockDevice, Export, Exports, MemDevice, Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn server(dev: Arc<MemDevice>, cfg: ServerConfig) -> Arc<Server> {
    let exports = Exports::new();
    exports.insert(
        "x",
        Export {
            device: dev,
            description: String::new(),
            multi_conn: true,
        },
    );
    Server::new(exports, cfg)
}

fn opt(o: u32, d: &[u8]) -> Vec<u8> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&o.to_be_bytes());
    v.extend_from_slice(&(d.len() as u32).to_be_bytes());
    v.extend_from_slice(d);
    v
}

/// Feeds `prefix` (a valid conversation up to some point) and then `noise` to a server over an
/// in-memory pipe; drains whatever comes back until the server closes or a timeout passes.
async fn feed(dev: Arc<MemDevice>, prefix: Vec<u8>, noise: Vec<u8>) {
    let srv = server(
        dev,
        ServerConfig {
            handshake_timeout: Duration::from_millis(200),
            idle_timeout: Some(Duration::from_millis(200)),
            max_request: 1 << 16,
            max_inflight_bytes: 1 << 17,
            metrics: Some(Arc::new(strata_nbd::NbdMetrics::default())),
            ..ServerConfig::default()
        },
    );
    let (mut client, conn) = tokio::io::duplex(1 << 20);
    let task = tokio::spawn(srv.handle(conn));
    let mut sink = vec![0u8; 1 << 16];
    let _ = client.write_all(&prefix).await;
    let _ = client.write_all(&noise).await;
    let drain = async {
        loop {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
    drop(client);
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("server task did not finish")
        .expect("server task panicked");
}

fn transmission_prefix() -> Vec<u8> {
    let mut v = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    v.extend(opt(OPT_STRUCTURED_REPLY, &[]));
    let mut go = 1u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"x");
    go.extend_from_slice(&0u16.to_be_bytes());
    v.extend(opt(OPT_GO, &go));
    v
}

fn arb_request() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u16>(),
        0u16..10,
        any::<u64>(),
        prop_oneof![0u64..70_000, any::<u64>()],
        prop_oneof![0u32..70_000, any::<u32>()],
        proptest::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(flags, kind, cookie, offset, length, tail)| {
            let mut v = encode_request(&Request {
                flags: flags & 0x3f,
                kind,
                cookie,
                offset,
                length,
            })
            .to_vec();
            v.extend(tail);
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_during_negotiation(noise in proptest::collection::vec(any::<u8>(), 0..300), prefix_ops in 0usize..3) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut prefix = (FLAG_C_FIXED_NEWSTYLE).to_be_bytes().to_vec();
        for _ in 0..prefix_ops {
            prefix.extend(opt(OPT_LIST, &[]));
        }
        let dev = MemDevice::new(65536);
        rt.block_on(feed(dev, prefix, noise));
    }

    #[test]
    fn random_requests_during_transmission(reqs in proptest::collection::vec(arb_request(), 1..8)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dev = MemDevice::new(65536);
        rt.block_on(async {
            dev.write(0, &[0x5a; 65536], false).await.unwrap();
            feed(dev.clone(), transmission_prefix(), reqs.concat()).await;
        });
    }
}

#[tokio::test]
async fn slow_handshake_and_idle_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let srv = server(
        MemDevice::new(65536),
        ServerConfig {
            handshake_timeout: Duration::from_millis(200),
            idle_timeout: Some(Duration::from_millis(300)),
            ..ServerConfig::default()
        },
    );
    tokio::spawn(srv.serve_unix(Server::bind_unix(&sock).unwrap()));
    // Says nothing after the greeting: dropped after the handshake timeout.
    let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).await.unwrap();
    let mut rest = vec![];
    let closed = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "handshake timeout not enforced");
    // Negotiates, then idles: closed after the idle timeout; an active one stays.
    let mut idle = Client::connect_unix(&sock, "x").await.unwrap();
    let mut busy = Client::connect_unix(&sock, "x").await.unwrap();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        busy.read(0, 512).await.unwrap();
    }
    assert!(
        idle.read(0, 512).await.is_err(),
        "idle connection still open"
    );
    // The socket is owner-only.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

#[tokio::test]
async fn tcp_on_loopback() {
    let srv = server(MemDevice::new(1 << 20), ServerConfig::default());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(srv.serve_tcp(l));
    let s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut c = Client::handshake(s, "x").await.unwrap();
    c.write(4096, b"over tcp", true).await.unwrap();
    assert_eq!(c.read(4096, 8).await.unwrap(), b"over tcp");
    if common::have("qemu-io") {
        let uri = format!("nbd://{addr}/x");
        let out = common::run(common::cmd(
            "qemu-io",
            &[
                "-f",
                "raw",
                &uri,
                "-c",
                "read -P 0 0 4096",
                "-c",
                "write -P 0x44 8192 4096",
                "-c",
                "read -P 0x44 8192 4096",
            ],
        ))
        .await;
        assert!(!out.contains("fail"), "{out}");
    }
}
