//! Bounds a client cannot push past, and an orderly stop: a client that never reads its replies
//! stops the server from reading more requests; WRITE_ZEROES with NO_HOLE stores no zero bytes;
//! [`Server::shutdown`] finishes what each connection accepted, then closes it.

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use strata_nbd::client::Client;
use strata_nbd::proto::*;
use strata_nbd::DevResult;
use strata_nbd::{BlockDevice, Export, Exports, MemDevice, Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A memory disk that counts reads and makes every write take `write_ms`.
struct Probe {
    mem: Arc<MemDevice>,
    reads: AtomicU64,
    write_ms: u64,
}

#[async_trait]
impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.reads.fetch_add(1, SeqCst);
        self.mem.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: &[u8], fua: bool) -> DevResult<()> {
        tokio::time::sleep(Duration::from_millis(self.write_ms)).await;
        self.mem.write(offset, data, fua).await
    }
    async fn flush(&self) -> DevResult<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32, fua: bool) -> DevResult<()> {
        self.mem.trim(offset, len, fua).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, fua: bool) -> DevResult<()> {
        self.mem.write_zeroes(offset, len, fua).await
    }
    async fn allocation(&self, offset: u64, len: u32) -> DevResult<Vec<(u64, bool)>> {
        self.mem.allocation(offset, len).await
    }
}

fn probe_server(write_ms: u64, cfg: ServerConfig) -> (Arc<Server>, Arc<Probe>) {
    let probe = Arc::new(Probe {
        mem: MemDevice::new(64 << 20),
        reads: AtomicU64::new(0),
        write_ms,
    });
    let exports = Exports::new();
    exports.insert(
        "x",
        Export {
            device: probe.clone(),
            description: String::new(),
            multi_conn: true,
        },
    );
    (Server::new(exports, cfg), probe)
}

fn request(kind: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    encode_request(&Request {
        flags: 0,
        kind,
        cookie,
        offset,
        length,
    })
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_replies_cannot_make_the_server_buffer_them() {
    let (srv, probe) = probe_server(
        0,
        ServerConfig {
            max_request: 1 << 20,
            max_inflight_bytes: 4 << 20,
            ..ServerConfig::default()
        },
    );
    let (client, conn) = tokio::io::duplex(64 << 10);
    srv.spawn_connection(conn);
    let mut c = Client::handshake(client, "x").await.unwrap();
    // 300 reads of 1 MiB pipelined, and not one reply read.
    let mut reqs = vec![];
    for i in 0..300u64 {
        reqs.extend(request(CMD_READ, i + 1, (i % 64) << 20, 1 << 20));
    }
    let s = c.stream();
    let _ = tokio::time::timeout(Duration::from_millis(500), s.write_all(&reqs)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = probe.reads.load(SeqCst);
    assert!(
        started <= 6,
        "{started} reads of 1 MiB were served into a 4 MiB budget while the client read nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hole_write_zeroes_stores_no_zero_bytes() {
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("z", 1 << 30).await;
    let mut c = Client::connect_unix(&rig.socket, "z").await.unwrap();
    c.write(0, &[7u8; 8192], false).await.unwrap();
    c.request(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 0, 512 << 20, &[])
        .await
        .unwrap();
    c.request(
        CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES,
        512 << 20,
        4096,
        &[],
    )
    .await
    .expect("zeroing is metadata only, so it is fast");
    c.flush().await.unwrap();
    assert!(c.read(0, 1 << 20).await.unwrap().iter().all(|&b| b == 0));
    let v = rig.engine.volume(TENANT, "z").unwrap();
    let j = v.stats().journal_bytes;
    assert!(
        j < 4 << 20,
        "512 MiB of zeroing put {j} bytes in the journal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_accepted_requests_then_closes() {
    let (srv, probe) = probe_server(300, ServerConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let accept = tokio::spawn(srv.clone().serve_unix(Server::bind_unix(&sock).unwrap()));
    let mut busy = Client::connect_unix(&sock, "x").await.unwrap();
    let mut idle = Client::connect_unix(&sock, "x").await.unwrap();
    // A slow write is in flight when the stop begins.
    let mut w = request(CMD_WRITE, 9, 0, 4096);
    w.extend_from_slice(&[0x5a; 4096]);
    busy.stream().write_all(&w).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stop = {
        let srv = srv.clone();
        tokio::spawn(async move { srv.shutdown().await })
    };
    // Its reply still arrives, then the connection closes.
    let s = busy.stream();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(&reply[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
    assert_eq!(&reply[4..8], &[0, 0, 0, 0], "the accepted write succeeded");
    let mut rest = vec![];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .expect("the server closes the connection")
        .unwrap();
    assert_eq!(n, 0);
    tokio::time::timeout(Duration::from_secs(5), stop)
        .await
        .expect("shutdown returns once every connection is gone")
        .unwrap();
    let mut rest = vec![];
    assert_eq!(
        idle.stream().read_to_end(&mut rest).await.unwrap(),
        0,
        "idle ones too"
    );
    accept.await.unwrap().unwrap();
    assert_eq!(
        &probe.mem.read(0, 4096).await.unwrap()[..],
        &[0x5a; 4096][..]
    );
    assert!(
        Client::connect_unix(&sock, "x").await.is_err(),
        "no connection is served after a shutdown"
    );
}

/// A client paused in the middle of a write's payload cannot hold a shutdown (and with it a
/// detach) forever: after the drain timeout its connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_cannot_hold_a_shutdown() {
    let (srv, probe) = probe_server(
        0,
        ServerConfig {
            drain_timeout: Duration::from_millis(300),
            ..ServerConfig::default()
        },
    );
    let (client, conn) = tokio::io::duplex(1 << 20);
    srv.spawn_connection(conn);
    let mut c = Client::handshake(client, "x").await.unwrap();
    let mut w = request(CMD_WRITE, 1, 0, 8192);
    w.extend_from_slice(&[0x77; 4096]); // half the payload, then nothing
    c.stream().write_all(&w).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(5), srv.shutdown())
        .await
        .expect("shutdown gives up on a stalled client");
    assert!(t.elapsed() >= Duration::from_millis(250));
    assert!(
        probe
            .mem
            .read(0, 4096)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "the torn write was never applied"
    );
}
