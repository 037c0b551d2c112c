//! Writes that arrive together: pipelined WRITE requests already whole in the server's read
//! buffer go to a device that batches ([`BlockDevice::write_many`]) in one call, each still
//! answered on its own with its own result. Requests that cannot join a batch (FUA, out of
//! range, another command) are served as before, and every request gets exactly one reply.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use strata_nbd::client::Client;
use strata_nbd::proto::*;
use strata_nbd::{BlockDevice, DevError, DevResult};
use strata_nbd::{Export, Exports, MemDevice, Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The offset whose writes fail (EIO), to see one failure answered apart from its batch.
const POISON: u64 = 1000 << 12;
const SIZE: u64 = 64 << 20;

/// A memory disk that batches writes and records how many each batch held.
struct Batcher {
    mem: Arc<MemDevice>,
    batches: Mutex<Vec<usize>>,
}

#[async_trait]
impl BlockDevice for Batcher {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.mem.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: &[u8], fua: bool) -> DevResult<()> {
        if offset == POISON {
            return Err(DevError::new(5, "poisoned"));
        }
        self.mem.write(offset, data, fua).await
    }
    fn batches_writes(&self) -> bool {
        true
    }
    async fn write_many(&self, writes: &[(u64, &[u8])]) -> Vec<DevResult<()>> {
        self.batches.lock().unwrap().push(writes.len());
        let mut out = vec![];
        for (offset, data) in writes {
            out.push(self.write(*offset, data, false).await);
        }
        out
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

fn request(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    encode_request(&Request {
        flags,
        kind,
        cookie,
        offset,
        length,
    })
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_writes_are_batched_and_each_is_answered_on_its_own() {
    let dev = Arc::new(Batcher {
        mem: MemDevice::new(SIZE),
        batches: Mutex::new(vec![]),
    });
    let exports = Exports::new();
    exports.insert(
        "x",
        Export {
            device: dev.clone(),
            description: String::new(),
            multi_conn: true,
        },
    );
    let srv = Server::new(exports, ServerConfig::default());
    let (client, conn) = tokio::io::duplex(4 << 20);
    srv.spawn_connection(conn);
    let mut c = Client::handshake(client, "x").await.unwrap();
    // 200 writes of 4 KiB sent in one go, each block tagged with its cookie; among them a FUA
    // write, one past the end, one to the poisoned block, and a FLUSH.
    let mut wire = vec![];
    let mut expect: HashMap<u64, u32> = HashMap::new();
    for cookie in 1..=200u64 {
        let (flags, kind, offset, errno) = match cookie {
            50 => (CMD_FLAG_FUA, CMD_WRITE, cookie << 12, 0),
            90 => (0, CMD_WRITE, SIZE, 28), // ENOSPC: beyond the end
            120 => (0, CMD_WRITE, POISON, 5),
            150 => (0, CMD_FLUSH, 0, 0),
            _ => (0, CMD_WRITE, cookie << 12, 0),
        };
        let len = if kind == CMD_WRITE { 4096 } else { 0 };
        wire.extend(request(flags, kind, cookie, offset, len));
        if kind == CMD_WRITE {
            wire.extend(std::iter::repeat_n(cookie as u8, 4096));
        }
        expect.insert(cookie, errno);
    }
    let s = c.stream();
    s.write_all(&wire).await.unwrap();
    let mut got: HashMap<u64, u32> = HashMap::new();
    for _ in 0..200 {
        let mut r = [0u8; 16];
        s.read_exact(&mut r).await.unwrap();
        assert_eq!(
            u32::from_be_bytes(r[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let errno = u32::from_be_bytes(r[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(r[8..16].try_into().unwrap());
        assert!(
            got.insert(cookie, errno).is_none(),
            "cookie {cookie} answered twice"
        );
    }
    assert_eq!(
        got, expect,
        "each request answered once, with its own result"
    );
    for cookie in (1..=200u64).filter(|c| ![90, 120, 150].contains(c)) {
        let b = c.read(cookie << 12, 4096).await.unwrap();
        assert!(
            b.iter().all(|&x| x == cookie as u8),
            "block of write {cookie}"
        );
    }
    let batches = dev.batches.lock().unwrap().clone();
    assert_eq!(
        batches.iter().sum::<usize>(),
        197,
        "every plain write in range (all but the FUA one and the one past the end) went through write_many: {batches:?}"
    );
    assert!(
        batches.iter().any(|&n| n > 1),
        "no batch held more than one write: {batches:?}"
    );
}
