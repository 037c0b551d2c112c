//! The protocol, strictly, through the project's own client and raw bytes.

mod common;

use std::sync::Arc;

use common::*;
use strata_nbd::client::{Client, ClientError};
use strata_nbd::proto::*;
use strata_nbd::{Export, MemDevice, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

fn errno<T: std::fmt::Debug>(r: Result<T, ClientError>) -> u32 {
    match r {
        Err(ClientError::Nbd { errno, .. }) => errno,
        other => panic!("expected an NBD error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_on_a_volume() {
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("ws1", 8 << 20).await;
    assert_eq!(
        Client::list_unix(&rig.socket).await.unwrap(),
        vec!["ws1".to_string()]
    );
    let mut c = Client::connect_unix(&rig.socket, "ws1").await.unwrap();
    assert_eq!(c.size, 8 << 20);
    for f in [
        TF_HAS_FLAGS,
        TF_SEND_FLUSH,
        TF_SEND_FUA,
        TF_SEND_TRIM,
        TF_SEND_WRITE_ZEROES,
        TF_CAN_MULTI_CONN,
        TF_SEND_DF,
    ] {
        assert!(c.flags & f != 0, "flag {f:#x} not advertised");
    }
    assert!(c.flags & TF_READ_ONLY == 0);
    assert!(c.structured && c.meta);
    // Unaligned write, read back.
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    c.write(1000, &data, true).await.unwrap();
    assert_eq!(c.read(1000, 10_000).await.unwrap(), data);
    c.flush().await.unwrap();
    // Block status: the written blocks are data, the rest holes.
    let st = c.block_status(0, 1 << 20).await.unwrap();
    assert_eq!(st[0], (12288, 0));
    assert_eq!(st[1], ((1 << 20) - 12288, STATE_HOLE | STATE_ZERO));
    let one = c
        .request(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, 1 << 20, &[])
        .await
        .unwrap()
        .1;
    assert_eq!(one.len(), 1);
    // Trim and write-zeroes read back as zeros and show as holes.
    c.trim(4096, 4096).await.unwrap();
    c.write_zeroes(8192, 4096).await.unwrap();
    assert!(c.read(4096, 8192).await.unwrap().iter().all(|&b| b == 0));
    assert_eq!(&c.read(1000, 3096).await.unwrap()[..], &data[..3096]);
    // NO_HOLE zeroing reads back as zeros and, being metadata only, is fast too.
    c.request(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 0, 4096, &[])
        .await
        .unwrap();
    c.request(
        CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES,
        0,
        4096,
        &[],
    )
    .await
    .unwrap();
    assert!(c.read(0, 4096).await.unwrap().iter().all(|&b| b == 0));
    c.request(CMD_FLAG_FAST_ZERO, CMD_WRITE_ZEROES, 0, 4096, &[])
        .await
        .unwrap();
    // DF reads are single chunks anyway.
    c.request(CMD_FLAG_DF, CMD_READ, 0, 65536, &[])
        .await
        .unwrap();
    c.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_specified_errors_and_the_server_survives() {
    let rig = Rig::new(ServerConfig {
        max_request: 1 << 19,
        ..ServerConfig::default()
    })
    .await;
    rig.workspace("w", 1 << 20).await;
    let mut c = Client::connect_unix(&rig.socket, "w").await.unwrap();
    assert_eq!(errno(c.read((1 << 20) - 10, 20).await), EINVAL);
    assert_eq!(
        errno(c.write((1 << 20) - 10, &[1; 20], false).await),
        ENOSPC
    );
    assert_eq!(
        errno(c.request(0, CMD_READ, u64::MAX - 5, 10, &[]).await),
        EINVAL
    );
    assert_eq!(
        errno(c.request(1 << 9, CMD_WRITE, 0, 4, &[1, 2, 3, 4]).await),
        EINVAL
    );
    assert_eq!(
        errno(c.request(CMD_FLAG_FUA, CMD_READ, 0, 4, &[]).await),
        EINVAL
    );
    assert_eq!(errno(c.request(0, 99, 0, 0, &[]).await), EINVAL);
    assert_eq!(errno(c.request(0, CMD_CACHE, 0, 4096, &[]).await), EINVAL);
    assert_eq!(errno(c.request(0, CMD_FLUSH, 5, 0, &[]).await), EINVAL);
    assert_eq!(
        errno(c.request(0, CMD_BLOCK_STATUS, 0, 0, &[]).await),
        EINVAL
    );
    assert_eq!(errno(c.request(0, CMD_READ, 0, 1 << 20, &[]).await), EINVAL);
    // Block status lengths are hints: larger than the block size maximum is fine.
    c.request(0, CMD_BLOCK_STATUS, 0, 1 << 20, &[])
        .await
        .unwrap();
    // An oversized write's payload is consumed, refused, and the connection stays in sync.
    assert_eq!(
        errno(
            c.request(0, CMD_WRITE, 0, 2 << 20, &vec![0u8; 2 << 20])
                .await
        ),
        EINVAL
    );
    c.write(0, b"still here", false).await.unwrap();
    assert_eq!(c.read(0, 10).await.unwrap(), b"still here");
    // Garbage on another connection closes that connection only.
    let mut bad = UnixStream::connect(&rig.socket).await.unwrap();
    let mut hello = [0u8; 18];
    bad.read_exact(&mut hello).await.unwrap();
    bad.write_all(&3u32.to_be_bytes()).await.unwrap();
    bad.write_all(b"this is not an option header")
        .await
        .unwrap();
    let mut rest = vec![];
    // The server closes it (EOF or reset, depending on unread bytes).
    let _ = bad.read_to_end(&mut rest).await;
    // A client that vanishes mid-write payload.
    let mut torn = Client::connect_unix(&rig.socket, "w").await.unwrap();
    let head = encode_request(&Request {
        flags: 0,
        kind: CMD_WRITE,
        cookie: 1,
        offset: 4096,
        length: 8192,
    });
    torn.stream().write_all(&head).await.unwrap();
    torn.stream().write_all(&[9u8; 100]).await.unwrap();
    drop(torn);
    // Wrong magic mid-transmission: that connection closes.
    let mut wrong = Client::connect_unix(&rig.socket, "w").await.unwrap();
    wrong.stream().write_all(&[0xffu8; 28]).await.unwrap();
    let mut buf = vec![];
    let _ = wrong.stream().read_to_end(&mut buf).await;
    assert!(buf.is_empty(), "no reply to a request with a bad magic");
    // The first connection and the server are unaffected; the torn write never landed.
    assert!(c.read(4096, 8192).await.unwrap().iter().all(|&b| b == 0));
    let mut again = Client::connect_unix(&rig.socket, "w").await.unwrap();
    assert_eq!(again.read(0, 10).await.unwrap(), b"still here");
    // Unknown export: GO fails with an error reply.
    assert!(Client::connect_unix(&rig.socket, "nope").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiation_edge_cases() {
    let rig = Rig::new(ServerConfig::default()).await;
    rig.exports.insert(
        "ro",
        Export {
            device: MemDevice::read_only(vec![7u8; 65536]),
            description: String::new(),
            multi_conn: false,
        },
    );
    let mut s = UnixStream::connect(&rig.socket).await.unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).await.unwrap();
    assert_eq!(&hello[..8], &NBDMAGIC.to_be_bytes());
    assert_eq!(&hello[8..16], &IHAVEOPT.to_be_bytes());
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .await
        .unwrap();
    let opt = |o: u32, d: &[u8]| {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&o.to_be_bytes());
        v.extend_from_slice(&(d.len() as u32).to_be_bytes());
        v.extend_from_slice(d);
        v
    };
    async fn reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
        assert_eq!(s.read_u64().await.unwrap(), OPT_REPLY_MAGIC);
        let o = s.read_u32().await.unwrap();
        let k = s.read_u32().await.unwrap();
        let l = s.read_u32().await.unwrap();
        let mut p = vec![0; l as usize];
        s.read_exact(&mut p).await.unwrap();
        (o, k, p)
    }
    // Unknown option, STARTTLS, SET_META_CONTEXT before STRUCTURED_REPLY, malformed INFO.
    s.write_all(&opt(4242, b"x")).await.unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ERR_UNSUP);
    s.write_all(&opt(OPT_STARTTLS, &[])).await.unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ERR_POLICY);
    let mut meta = 2u32.to_be_bytes().to_vec();
    meta.extend_from_slice(b"ro");
    meta.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&opt(OPT_SET_META_CONTEXT, &meta))
        .await
        .unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ERR_INVALID);
    s.write_all(&opt(OPT_INFO, &[0, 0, 0, 9, b'a']))
        .await
        .unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ERR_INVALID);
    s.write_all(&opt(OPT_STRUCTURED_REPLY, &[])).await.unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ACK);
    // LIST_META_CONTEXT with no queries lists base:allocation.
    s.write_all(&opt(OPT_LIST_META_CONTEXT, &meta))
        .await
        .unwrap();
    let (_, k, p) = reply(&mut s).await;
    assert_eq!(k, REP_META_CONTEXT);
    assert_eq!(&p[4..], BASE_ALLOCATION.as_bytes());
    assert_eq!(reply(&mut s).await.1, REP_ACK);
    // INFO on the read-only export: READ_ONLY, no write flags, no multi-conn.
    let mut info = 2u32.to_be_bytes().to_vec();
    info.extend_from_slice(b"ro");
    info.extend_from_slice(&1u16.to_be_bytes());
    info.extend_from_slice(&INFO_NAME.to_be_bytes());
    s.write_all(&opt(OPT_INFO, &info)).await.unwrap();
    let mut flags = 0;
    loop {
        let (_, k, p) = reply(&mut s).await;
        if k == REP_ACK {
            break;
        }
        assert_eq!(k, REP_INFO);
        if p[..2] == INFO_EXPORT.to_be_bytes() {
            flags = u16::from_be_bytes([p[10], p[11]]);
        }
    }
    assert!(
        flags & TF_READ_ONLY != 0 && flags & TF_SEND_TRIM == 0 && flags & TF_CAN_MULTI_CONN == 0
    );
    // ABORT is acknowledged.
    s.write_all(&opt(OPT_ABORT, &[])).await.unwrap();
    assert_eq!(reply(&mut s).await.1, REP_ACK);
    // Writes to the read-only export are refused with EPERM.
    let mut c = Client::connect_unix(&rig.socket, "ro").await.unwrap();
    assert_eq!(errno(c.write(0, &[1], false).await), EPERM);
    assert_eq!(c.read(0, 4).await.unwrap(), vec![7; 4]);
    // Legacy NBD_OPT_EXPORT_NAME still works.
    let mut s = UnixStream::connect(&rig.socket).await.unwrap();
    s.read_exact(&mut hello).await.unwrap();
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .await
        .unwrap();
    s.write_all(&opt(OPT_EXPORT_NAME, b"ro")).await.unwrap();
    assert_eq!(s.read_u64().await.unwrap(), 65536);
    let _flags = s.read_u16().await.unwrap();
    let mut zeroes = [0u8; 124];
    s.read_exact(&mut zeroes).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_and_connections() {
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("m", 16 << 20).await;
    let mut tasks = vec![];
    for conn in 0..4u64 {
        let sock = rig.socket.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect_unix(&sock, "m").await.unwrap();
            for i in 0..64u64 {
                let off = (conn * 64 + i) * 4096;
                c.write(off, &vec![(conn * 64 + i) as u8; 4096], false)
                    .await
                    .unwrap();
            }
            c
        }));
    }
    let mut clients = vec![];
    for t in tasks {
        clients.push(t.await.unwrap());
    }
    // A flush on one connection covers the writes completed on all of them (multi-conn).
    clients[0].flush().await.unwrap();
    for i in 0..256u64 {
        assert!(clients[1]
            .read(i * 4096, 4096)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == i as u8));
    }
    // Many requests in flight on one raw connection; replies may come back in any order.
    let mut c = Client::connect_unix(&rig.socket, "m").await.unwrap();
    let s = c.stream();
    for i in 0..32u64 {
        s.write_all(&encode_request(&Request {
            flags: 0,
            kind: CMD_READ,
            cookie: 1000 + i,
            offset: i * 4096,
            length: 4096,
        }))
        .await
        .unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..32 {
        assert_eq!(s.read_u32().await.unwrap(), STRUCTURED_REPLY_MAGIC);
        let _flags = s.read_u16().await.unwrap();
        let _ty = s.read_u16().await.unwrap();
        let cookie = s.read_u64().await.unwrap();
        let len = s.read_u32().await.unwrap();
        let mut p = vec![0; len as usize];
        s.read_exact(&mut p).await.unwrap();
        let i = cookie - 1000;
        assert!(p[8..].iter().all(|&b| b == i as u8));
        seen.insert(cookie);
    }
    assert_eq!(seen.len(), 32);
    let _ = Arc::strong_count(&rig.exports);
}
