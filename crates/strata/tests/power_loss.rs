//! Power-loss campaign against the real daemon: its data directory (journals, local state, the
//! local object store, the node cache) lives on `strata-lossyfs`, a FUSE passthrough that keeps
//! un-fsync'd file data in memory. "Power loss" = SIGKILL the daemon, then tell the file system
//! to drop every un-synced write (or keep a random, torn subset of them). After the restart
//! every write acknowledged before a completed FLUSH must be there. A control run with
//! `STRATA_VOLUME_CACHE_UNSAFE=1` (flushes not honoured) must lose writes: the harness can fail.
//!
//! The SQLite catalog stays off the lossy mount: SQLite's WAL needs shared memory maps, which
//! FUSE direct I/O does not offer; its durability is SQLite's own (synchronous=FULL).
//!
//! `STRATA_POWER_CYCLES` (default 30 in CI).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

const BLOCKS: u64 = 2048; // 8 MiB

struct Lossy {
    child: Child,
    mnt: PathBuf,
}

impl Lossy {
    fn mount(dir: &Path) -> Lossy {
        let (backing, mnt) = (dir.join("backing"), dir.join("mnt"));
        std::fs::create_dir_all(&backing).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let mut child = Command::new(lossyfs_bin())
            .arg(&backing)
            .arg(&mnt)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        for _ in 0..100 {
            let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
            if mounts.contains(&format!(" {} fuse", mnt.display())) {
                return Lossy { child, mnt };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("strata-lossyfs did not mount");
    }
    fn power_loss(&self, torn: bool) {
        let sig = if torn { "-USR2" } else { "-USR1" };
        assert!(Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success());
    }
}

impl Drop for Lossy {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.mnt)
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cycles` power-loss cycles; returns (flushed writes, lost flushed writes, torn blocks).
async fn campaign(dir: &Path, cycles: u64, unsafe_cache: bool) -> (u64, u64, u64) {
    let fs = Lossy::mount(dir);
    let data = fs.mnt.join("data");
    let env: &[(&str, &str)] = if unsafe_cache {
        &[("STRATA_VOLUME_CACHE_UNSAFE", "1")]
    } else {
        &[]
    };
    let catalog = format!("sqlite:{}", dir.join("catalog.db").display());
    let flags = [
        "--upload-interval",
        "200ms",
        "--segment-size",
        "1MiB",
        "--catalog",
        &catalog,
    ];
    let daemon = serve_env(&data, &flags, env);
    let t = tenant(&daemon.url, "alpha").await;
    let (s, v) = t
        .post(
            "/v1/workspaces",
            json!({"name": "w", "size": BLOCKS * 4096}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, att) = t.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let sock = att["socket"].as_str().unwrap().to_string();
    // Make the setup itself durable, then start from a clean power cycle.
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    c.flush().await.unwrap();
    drop(daemon);
    let mut ledger = Ledger::new(BLOCKS);
    let (mut flushed, mut lost, mut torn) = (0u64, 0u64, 0u64);
    for cycle in 1..=cycles {
        let daemon = serve_env(&data, &flags, env);
        let mut rng = SmallRng::seed_from_u64(cycle);
        let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
        let buf = c.read(0, (BLOCKS * 4096) as u32).await.unwrap();
        for lba in 0..BLOCKS {
            let b = &buf[(lba * 4096) as usize..((lba + 1) * 4096) as usize];
            match ledger.observe(lba, b) {
                Found::Ok => {}
                Found::Torn => torn += 1,
                Found::Lost { .. } => lost += 1,
            }
        }
        let writes: Vec<(u64, u64)> = (0..60)
            .map(|k| (rng.random_range(0..BLOCKS), cycle * 1000 + k))
            .collect();
        for &(lba, tag) in &writes {
            c.write(lba * 4096, &block(tag, lba), false).await.unwrap();
        }
        c.flush().await.unwrap();
        for &(lba, tag) in &writes {
            ledger.flushed(lba, tag);
        }
        flushed += writes.len() as u64;
        // Unflushed writes, then the power goes.
        for k in 0..rng.random_range(0..40u64) {
            let lba = rng.random_range(0..BLOCKS);
            let tag = cycle * 1000 + 500 + k;
            ledger.written(lba, tag);
            if c.write(lba * 4096, &block(tag, lba), false).await.is_err() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        drop(daemon); // SIGKILL …
        fs.power_loss(cycle % 2 == 0); // … and everything not fsync'd is gone (or torn)
    }
    (flushed, lost, torn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_writes_survive_power_loss_of_the_daemon_host() {
    if !(is_root() && have("fusermount3")) {
        assert!(std::env::var("CI").is_err(), "CI runs as root with fuse3");
        eprintln!("skipping: needs root and fusermount3");
        return;
    }
    let cycles: u64 = std::env::var("STRATA_POWER_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let d = tempfile::tempdir().unwrap();
    let (flushed, lost, torn) = campaign(&d.path().join("real"), cycles, false).await;
    eprintln!("power loss: {cycles} cycles (half torn), {flushed} flushed writes, {lost} lost, {torn} torn blocks");
    assert_eq!((lost, torn), (0, 0));
    // Control: flushes not honoured. The same harness must see flushed writes disappear.
    let (cflushed, clost, ctorn) = campaign(&d.path().join("control"), 6, true).await;
    eprintln!("control (STRATA_VOLUME_CACHE_UNSAFE=1): {cflushed} flushed writes, {clost} lost, {ctorn} torn");
    assert!(
        clost + ctorn > 0,
        "the harness must catch unhonoured flushes"
    );
}
