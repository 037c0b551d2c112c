//! Routine operations against the real daemon, as a user would run them, each a regression test
//! of a way the promise was broken: detach while clients write, a checkpoint whose client goes
//! away, template sources that reached the host, long names that broke attach, a full disk.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::{Client, ClientError};

mod common;
use common::*;

/// Writes tagged blocks over `span` blocks from `start` and flushes after every 32 until a
/// request fails; returns (lba, tag) for every write a successful FLUSH covered.
async fn write_until_refused(
    mut c: Client<tokio::net::UnixStream>,
    start: u64,
    span: u64,
    tag0: u64,
) -> Vec<(u64, u64)> {
    let (mut flushed, mut pending) = (vec![], vec![]);
    for i in 0u64.. {
        let lba = start + (i * 7919) % span;
        let tag = tag0 + i;
        if c.write(lba * 4096, &block(tag, lba), false).await.is_err() {
            break;
        }
        pending.push((lba, tag));
        if pending.len() == 32 {
            if c.flush().await.is_err() {
                break;
            }
            flushed.append(&mut pending);
        }
    }
    flushed
}

/// Checks that every block reads back at least its flushed tag (tags only grow per block).
async fn check(sock: &str, ws: &str, flushed: &[(u64, u64)]) -> usize {
    let mut want = std::collections::HashMap::new();
    for &(lba, tag) in flushed {
        let e = want.entry(lba).or_insert(tag);
        *e = (*e).max(tag);
    }
    let mut c = Client::connect_unix(Path::new(sock), ws).await.unwrap();
    let mut lost = vec![];
    for (&lba, &tag) in &want {
        let b = c.read(lba * 4096, 4096).await.unwrap();
        match tag_of(&b, lba) {
            Some(got) if got >= tag => {}
            got => lost.push((lba, tag, got)),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} flushed blocks read back older data, e.g. {:?}",
        lost.len(),
        want.len(),
        &lost[..lost.len().min(4)]
    );
    want.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_while_clients_write_loses_no_flushed_write() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(&d.path().join("a"), &[]);
    let a = tenant(&daemon.url, "t").await;
    let (s, v) = a
        .post("/v1/workspaces", json!({"name": "w", "size": 64 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    let sock = att["socket"].as_str().unwrap().to_string();
    let mut writers = vec![];
    for i in 0..2u64 {
        let c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
        writers.push(tokio::spawn(write_until_refused(
            c,
            i * 4096,
            4096,
            1 + i * (1 << 40),
        )));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (s, v) = a.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let mut flushed = vec![];
    for w in writers {
        flushed.extend(
            tokio::time::timeout(Duration::from_secs(20), w)
                .await
                .expect("clients are disconnected by the detach")
                .unwrap(),
        );
    }
    assert!(flushed.len() > 200, "the clients got going");
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    let n = check(att["socket"].as_str().unwrap(), "w", &flushed).await;
    eprintln!(
        "detach under load: {} flushed writes over {n} blocks, 0 lost",
        flushed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_client_goes_away_loses_nothing() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(&d.path().join("a"), &["--upload-interval", "1h"]);
    let a = tenant(&daemon.url, "t").await;
    a.post("/v1/workspaces", json!({"name": "w", "size": 256 << 20}))
        .await;
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    let sock = att["socket"].as_str().unwrap().to_string();
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    // 64 MiB in 1 MiB writes of tagged blocks, flushed.
    let mut flushed = vec![];
    for mib in 0..64u64 {
        let mut buf = Vec::with_capacity(1 << 20);
        for lba in mib * 256..(mib + 1) * 256 {
            buf.extend(block(1, lba));
            flushed.push((lba, 1));
        }
        c.write(mib << 20, &buf, false).await.unwrap();
    }
    c.flush().await.unwrap();
    // The client gives up while it waits for the upload (curl -m 0.05).
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let r = quick
        .post(format!("{}/v1/workspaces/w/checkpoint", daemon.url))
        .bearer_auth(&a.token)
        .json(&json!({"wait": true}))
        .send()
        .await;
    assert!(r.is_err(), "the checkpoint was still uploading at 50 ms");
    for lba in 60000..60256u64 {
        c.write(lba * 4096, &block(2, lba), false).await.unwrap();
        flushed.push((lba, 2));
    }
    c.flush().await.unwrap();
    let (s, v) = a.post("/v1/workspaces/w/checkpoint", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    drop(c);
    let (s, v) = a.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    check(att["socket"].as_str().unwrap(), "w", &flushed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_sources_never_reach_the_host() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let import = d.path().join("import");
    std::fs::create_dir_all(import.join("t/tree")).unwrap();
    std::fs::write(import.join("t/tree/hello.txt"), "staged by the operator\n").unwrap();
    std::fs::create_dir_all(import.join("other")).unwrap();
    std::fs::write(import.join("other/theirs.raw"), vec![1u8; 8192]).unwrap();
    // A symlink the tenant's directory might hold, pointing at another tenant's files.
    std::os::unix::fs::symlink(import.join("other"), import.join("t/peek")).unwrap();
    let daemon = serve(&data, &["--import-dir", import.to_str().unwrap()]);
    let a = tenant(&daemon.url, "t").await;
    let catalog = data.join("catalog.db");
    for (body, why) in [
        (json!({"name": "x", "from_dir": "/etc"}), "a host directory"),
        (
            json!({"name": "x", "from_image": "/etc/shadow"}),
            "a host file",
        ),
        (
            json!({"name": "x", "from_image": catalog.to_str().unwrap()}),
            "the daemon's own catalog",
        ),
        (
            json!({"name": "x", "import": "../other/theirs.raw"}),
            "dot-dot",
        ),
        (json!({"name": "x", "import": "/etc"}), "absolute"),
        (
            json!({"name": "x", "import": "peek/theirs.raw"}),
            "a symlink out",
        ),
        (json!({"name": "x", "import": "nope"}), "missing"),
    ] {
        let (s, v) = a.post("/v1/templates", body).await;
        assert!(s.is_client_error(), "{why}: {s} {v}");
    }
    assert_eq!(
        a.get("/v1/templates").await.1,
        json!([]),
        "nothing was built"
    );
    // The operator's import directory works, scoped to the tenant.
    let (s, v) = a
        .post(
            "/v1/templates",
            json!({"name": "staged", "import": "tree", "size": 16 << 20}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Uploads: a qcow2 whose backing file is the daemon's catalog is refused.
    let q = d.path().join("sneaky.qcow2");
    let ok = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&catalog)
        .arg(&q)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let (s, v) = a
        .put_bytes("/v1/templates/q?format=qcow2", std::fs::read(&q).unwrap())
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("backing"), "{v}");
    // A tar that climbs out of its tree.
    let mut h = tar::Header::new_old();
    h.as_old_mut().name[..10].copy_from_slice(b"../escaped");
    h.set_size(1);
    h.set_mode(0o644);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"x"[..]).unwrap();
    let (s, v) = a
        .put_bytes("/v1/templates/evil?format=tar", b.into_inner().unwrap())
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(!data.join("tmp/escaped").exists() && !d.path().join("escaped").exists());
    // An honest upload of a directory tree, the way the CLI sends one.
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a").unwrap();
    let (s, v) = a.template_from_dir("mine", &src, 16 << 20).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Nothing is left in the daemon's temp directory.
    let left: Vec<_> = std::fs::read_dir(data.join("tmp"))
        .map(|r| r.flatten().collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "temp files left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_names_attach_and_a_failed_export_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    // A data directory deep enough that DATA/run/{tenant}/{ws}.sock would not fit SUN_LEN.
    let data = d.path().join("x".repeat(40)).join("data");
    let daemon = serve(&data, &[]);
    let tname = format!("t{}", "n".repeat(62));
    let a = tenant(&daemon.url, &tname).await;
    let wname = format!("w{}", "s".repeat(62));
    let (s, v) = a
        .post("/v1/workspaces", json!({"name": wname, "size": 8 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, att) = a
        .post(&format!("/v1/workspaces/{wname}/attach"), json!({}))
        .await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let sock = att["socket"].as_str().unwrap();
    assert!(sock.len() < 108);
    let mut c = Client::connect_unix(Path::new(sock), &wname).await.unwrap();
    c.write(0, &block(5, 0), true).await.unwrap();
    // An export that cannot be made (something sits at its socket path) undoes the attach.
    a.post(
        "/v1/workspaces",
        json!({"name": "blocked", "size": 8 << 20}),
    )
    .await;
    let mut h = blake3::Hasher::new();
    h.update(tname.as_bytes());
    h.update(&[0]);
    h.update(b"blocked");
    let path = data
        .join("run")
        .join(format!("{}.sock", &h.finalize().to_hex()[..32]));
    std::fs::create_dir_all(path.join("squatter")).unwrap();
    let (s, v) = a.post("/v1/workspaces/blocked/attach", json!({})).await;
    assert!(s.is_server_error(), "{s} {v}");
    let (_, view) = a.get("/v1/workspaces/blocked").await;
    assert_eq!(view["attached"], false, "{view}");
    assert_eq!(view["lease"]["holder"], serde_json::Value::Null, "{view}");
    std::fs::remove_dir_all(&path).unwrap();
    let (s, v) = a.post("/v1/workspaces/blocked/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // vhost-user socket names are longer: this run directory cannot hold them. The attach says
    // so and leaves nothing attached; NBD above was unaffected.
    a.post("/v1/workspaces", json!({"name": "vm", "size": 8 << 20}))
        .await;
    let (s, v) = a
        .post(
            "/v1/workspaces/vm/attach",
            json!({"protocol": "vhost-user"}),
        )
        .await;
    assert!(s.is_server_error(), "{s} {v}");
    assert!(v.to_string().contains("--run-dir"), "{v}");
    let (_, view) = a.get("/v1/workspaces/vm").await;
    assert_eq!(view["attached"], false, "{view}");
}

/// The daemon's data directory on a small tmpfs, filled up by a client's writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_returns_enospc_and_recovers() {
    if !is_root() {
        assert!(std::env::var("CI").is_err(), "CI runs as root");
        eprintln!("SKIPPED a_full_disk_returns_enospc_and_recovers: needs root (tmpfs mount)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let mnt = d.path().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=160m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mount tmpfs");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _u = Unmount(mnt.clone());
    let data = mnt.join("data");
    let daemon = serve(
        &data,
        &[
            "--segment-size",
            "4MiB",
            "--upload-interval",
            "1h",
            "--upload-max-bytes",
            "1TiB",
        ],
    );
    let a = tenant(&daemon.url, "t").await;
    a.post("/v1/workspaces", json!({"name": "w", "size": 1 << 30}))
        .await;
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    let sock = att["socket"].as_str().unwrap().to_string();
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    // A filler the operator can delete to free space.
    let filler = mnt.join("filler");
    std::fs::write(&filler, vec![0xaau8; 40 << 20]).unwrap();
    let mut flushed = vec![];
    let mut full = None;
    for lba in 0..40_000u64 {
        match c.write(lba * 4096, &block(1, lba), false).await {
            Ok(()) => {}
            Err(ClientError::Nbd { errno, .. }) => {
                full = Some((lba, errno));
                break;
            }
            Err(e) => panic!("{e}"),
        }
        if lba % 64 == 63 {
            c.flush().await.unwrap();
            flushed.extend((lba - 63..=lba).map(|l| (l, 1)));
        }
    }
    let (at, errno) = full.expect("the disk filled up");
    assert_eq!(
        errno, 28,
        "a full disk is ENOSPC to the client, at block {at}"
    );
    // What is durable still reads, and a flush still succeeds.
    c.flush().await.unwrap();
    drop(c);
    check(&sock, "w", &flushed).await;
    // Space comes back: writes succeed again, on the same connection-level volume.
    std::fs::remove_file(&filler).unwrap();
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    c.write(at * 4096, &block(2, at), false).await.unwrap();
    c.flush().await.unwrap();
    assert_eq!(tag_of(&c.read(at * 4096, 4096).await.unwrap(), at), Some(2));
    let (_, view) = a.get("/v1/workspaces/w").await;
    assert_eq!(view["attached"], true);
}
