//! Operations race a vhost-user writer: a frontend (a VMM's part, played by the test's own
//! virtqueue over the daemon's socket) writes tagged 4 KiB blocks with a FLUSH every few,
//! while the daemon is told to checkpoint, fork the live workspace, refuse a second front-end,
//! detach and re-attach, and is killed with -9 and restarted (the VMM reconnecting each time).
//! At the end every block holds what the last completed FLUSH covered, or a later write: a
//! flushed write is never lost, nothing is torn, and every operation answered as it should.
//!
//! CI runs a short campaign; `STRATA_VHOST_OPS=200` a long one (`STRATA_VHOST_SEED` to replay).

mod common;
#[path = "../../strata-vhost/tests/frontend/mod.rs"]
mod frontend;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{block, Found, Ledger};
use frontend::{try_connect, Guest, F_WRITE, OK, T_FLUSH, T_IN, T_OUT};
use rand::{Rng, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;
use vm_memory::{Bytes, GuestAddress};

const BLOCKS: u64 = 2048;
const BUF: u64 = 0x20000;

#[derive(Default)]
struct Counts {
    writes: AtomicU64,
    flushes: AtomicU64,
    reconnects: AtomicU64,
    unanswered: AtomicU64,
}

/// Connects, retrying while the socket is away (a detach, a restart); gives up after `within`.
fn reconnect(path: &Path, within: Duration) -> Guest {
    let end = Instant::now() + within;
    loop {
        if path.exists() {
            if let Ok(g) = try_connect(path) {
                return g;
            }
        }
        assert!(
            Instant::now() < end,
            "no vhost-user backend at {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes until `stop`: QD1, a FLUSH every 1..8 writes. The ledger learns each write before
/// it is sent and each FLUSH once it completed OK.
fn writer(
    path: PathBuf,
    seed: u64,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut g = reconnect(&path, Duration::from_secs(60));
    let mut tag = 1u64;
    let mut unflushed: Vec<(u64, u64)> = vec![];
    let answer = Duration::from_secs(2);
    while !stop.load(Ordering::Relaxed) {
        let lba = rng.random_range(0..BLOCKS);
        ledger.lock().unwrap().written(lba, tag);
        g.mem
            .write_slice(&block(tag, lba), GuestAddress(BUF))
            .unwrap();
        let r = g.try_request(T_OUT, lba * 8, &[(BUF, 4096, 0)], answer);
        let ok = match r {
            Some((OK, _)) => {
                counts.writes.fetch_add(1, Ordering::Relaxed);
                unflushed.push((lba, tag));
                true
            }
            // An error status (the volume closing under a detach): not acknowledged.
            Some(_) => false,
            None => false,
        };
        tag += 1;
        if ok && (unflushed.len() >= 8 || rng.random_bool(0.3)) {
            match g.try_request(T_FLUSH, 0, &[], answer) {
                Some((OK, _)) => {
                    counts.flushes.fetch_add(1, Ordering::Relaxed);
                    let mut l = ledger.lock().unwrap();
                    for (lba, t) in unflushed.drain(..) {
                        l.flushed(lba, t);
                    }
                }
                Some(_) => {}
                None => {
                    counts.unanswered.fetch_add(1, Ordering::Relaxed);
                    unflushed.clear();
                    g = reconnect(&path, Duration::from_secs(60));
                    counts.reconnects.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else if !ok {
            // No answer or an error: the backend went away or is going; start over on a new
            // connection (a new frontend session, as a VMM reconnecting).
            if r.is_none() {
                counts.unanswered.fetch_add(1, Ordering::Relaxed);
            }
            unflushed.clear();
            std::thread::sleep(Duration::from_millis(20));
            g = reconnect(&path, Duration::from_secs(60));
            counts.reconnects.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_race_a_vhost_user_writer_and_no_flushed_write_is_lost() {
    let ops: usize = std::env::var("STRATA_VHOST_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let seed: u64 = std::env::var("STRATA_VHOST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("vhost-user race: {ops} operations, STRATA_VHOST_SEED={seed}");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut d = common::serve(&data, &[]);
    let api = common::tenant(&d.url, "racer").await;
    let token = api.token.clone();
    let (s, v) = api
        .post(
            "/v1/workspaces",
            json!({"name": "vm", "size": BLOCKS * 4096}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // What a tenant may send is checked; another tenant's workspace is not there for it.
    for bad in [
        json!({"protocol": "vhost-user", "queues": 0}),
        json!({"protocol": "vhost-user", "queues": 9}),
        json!({"protocol": "nbd", "queues": 2}),
        json!({"protocol": "virtio-fs"}),
        json!({"protocol": "vhost-user", "socket": "/etc/passwd"}),
    ] {
        let (s, v) = api.post("/v1/workspaces/vm/attach", bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
    }
    let other = common::tenant(&d.url, "other").await;
    let (s, v) = other
        .post(
            "/v1/workspaces/vm/attach",
            json!({"protocol": "vhost-user"}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another tenant's workspace: {v}");
    let attach = json!({"protocol": "vhost-user"});
    let (s, a) = api.post("/v1/workspaces/vm/attach", attach.clone()).await;
    assert_eq!(s, StatusCode::OK, "{a}");
    let socket = PathBuf::from(a["socket"].as_str().unwrap());

    let ledger = Arc::new(Mutex::new(Ledger::new(BLOCKS)));
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let w = {
        let (p, l, s, c) = (socket.clone(), ledger.clone(), stop.clone(), counts.clone());
        std::thread::spawn(move || writer(p, seed, l, s, c))
    };
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x5eed);
    let mut api = api;
    let mut done = std::collections::BTreeMap::<&str, u32>::new();
    for i in 0..ops {
        tokio::time::sleep(Duration::from_millis(rng.random_range(150..600))).await;
        let op = match rng.random_range(0..10) {
            0..=2 => "checkpoint",
            3 => "fork",
            4 => "nbd-refused",
            5..=7 => "detach-reattach",
            _ => "kill-restart",
        };
        match op {
            "checkpoint" => {
                let (s, v) = api.post("/v1/workspaces/vm/checkpoint", json!({})).await;
                assert_eq!(s, StatusCode::OK, "checkpoint: {v}");
            }
            "fork" => {
                let name = format!("fork{i}");
                let (s, v) = api
                    .post("/v1/workspaces/vm/fork", json!({"name": name}))
                    .await;
                assert!(s.is_success(), "fork: {s} {v}");
            }
            "nbd-refused" => {
                let (s, v) = api.post("/v1/workspaces/vm/attach", json!({})).await;
                assert_eq!(s, StatusCode::CONFLICT, "a second front-end: {v}");
            }
            "detach-reattach" => {
                let (s, v) = api.post("/v1/workspaces/vm/detach", json!({})).await;
                assert_eq!(s, StatusCode::OK, "detach: {v}");
                assert!(!socket.exists(), "socket gone after detach");
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
                let (s, v) = api.post("/v1/workspaces/vm/attach", attach.clone()).await;
                assert_eq!(s, StatusCode::OK, "re-attach: {v}");
            }
            _ => {
                d.signal("KILL");
                drop(d);
                d = common::serve(&data, &[]);
                api = common::Api::new(&d.url, &token);
                let (s, w) = api.get("/v1/workspaces/vm").await;
                assert_eq!(s, StatusCode::OK, "{w}");
                assert_eq!(w["attached"], true, "a restart serves it again: {w}");
            }
        }
        *done.entry(op).or_default() += 1;
        assert!(!w.is_finished(), "writer died");
    }
    stop.store(true, Ordering::Relaxed);
    w.join().expect("writer");

    // Read every block back over vhost-user, on a fresh connection.
    let mut g = reconnect(&socket, Duration::from_secs(30));
    let mut l = std::mem::replace(&mut *ledger.lock().unwrap(), Ledger::new(0));
    let (mut lost, mut torn) = (vec![], 0);
    for lba in 0..BLOCKS {
        let (st, _) = g.request(T_IN, lba * 8, &[(BUF, 4096, F_WRITE)]);
        assert_eq!(st, OK, "read of block {lba}");
        let mut b = vec![0u8; 4096];
        g.mem.read_slice(&mut b, GuestAddress(BUF)).unwrap();
        match l.observe(lba, &b) {
            Found::Ok => {}
            Found::Torn => torn += 1,
            Found::Lost { has, flushed } => lost.push((lba, has, flushed)),
        }
    }
    eprintln!(
        "vhost-user race: {done:?}; {} writes and {} flushes acknowledged, {} reconnects, {} unanswered; {} blocks checked: {} lost, {torn} torn",
        counts.writes.load(Ordering::Relaxed),
        counts.flushes.load(Ordering::Relaxed),
        counts.reconnects.load(Ordering::Relaxed),
        counts.unanswered.load(Ordering::Relaxed),
        BLOCKS,
        lost.len(),
    );
    assert!(
        lost.is_empty() && torn == 0,
        "lost {lost:?}, torn {torn} (seed {seed})"
    );
    assert!(
        counts.flushes.load(Ordering::Relaxed) > 0,
        "the writer never flushed"
    );
    // The export's counters are on /metrics while it serves.
    let m = api
        .http
        .get(format!("{}/metrics", d.url))
        .bearer_auth(common::ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = m
        .lines()
        .find(|l| l.starts_with("strata_vhost_requests_total{tenant=\"racer\",workspace=\"vm\"}"))
        .unwrap_or_else(|| panic!("no vhost-user counter in /metrics"));
    assert!(
        line.ends_with(&format!(" {BLOCKS}")) || !line.ends_with(" 0"),
        "{line}"
    );
    let (s, v) = api.post("/v1/workspaces/vm/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

fn cli(data: &Path, env: &[(&str, &str)], args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_strata"));
    c.arg("--data")
        .arg(data)
        .args(args)
        .envs(env.iter().copied());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ws_attach_vhost_user_in_the_foreground_and_through_a_daemon() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("local");
    let ok = cli(&data, &[], &["ws", "create", "w", "--size", "8MiB"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ws create");
    // Without a daemon: serves until SIGTERM, then publishes.
    let mut child = cli(&data, &[], &["ws", "attach", "w", "--vhost-user"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let socket = PathBuf::from(line.trim());
    assert!(socket.ends_with("w.vhost.sock"), "{line}");
    let mut g = reconnect(&socket, Duration::from_secs(30));
    g.mem.write_slice(&block(7, 3), GuestAddress(BUF)).unwrap();
    assert_eq!(g.request(T_OUT, 3 * 8, &[(BUF, 4096, 0)]).0, OK);
    assert_eq!(g.request(T_FLUSH, 0, &[]).0, OK);
    drop(g);
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    assert!(
        child.wait().unwrap().success(),
        "attach exits cleanly on SIGTERM"
    );
    assert!(!socket.exists(), "socket removed");
    let out = tmp.path().join("w.raw");
    let ok = cli(&data, &[], &["ws", "export", "w", out.to_str().unwrap()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ws export");
    let img = std::fs::read(&out).unwrap();
    assert_eq!(&img[3 * 4096..4 * 4096], block(7, 3).as_slice());

    // Through a daemon: the CLI prints the socket; --queues outside 1..=8 is refused.
    let d = common::serve(&tmp.path().join("daemon"), &[]);
    let api = common::tenant(&d.url, "cli").await;
    let (s, v) = api
        .post("/v1/workspaces", json!({"name": "vm", "size": 8u64 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let env = [
        ("STRATA_URL", d.url.as_str()),
        ("STRATA_TOKEN", api.token.as_str()),
    ];
    let o = cli(
        &data,
        &env,
        &["ws", "attach", "vm", "--vhost-user", "--queues", "1"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let socket = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    assert!(
        socket.exists() && socket.to_string_lossy().ends_with(".vhost.sock"),
        "{socket:?}"
    );
    let o = cli(
        &data,
        &env,
        &["ws", "attach", "vm", "--vhost-user", "--queues", "9"],
    )
    .output()
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = cli(&data, &env, &["ws", "attach", "vm"]).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "NBD while vhost-user serves: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}
