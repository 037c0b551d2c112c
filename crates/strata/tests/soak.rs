//! Load and soak: 64 workspaces attached at once on one daemon under a mixed fio load (random
//! and sequential reads and writes with periodic fsync, through fio's NBD engine), with
//! background uploads and a checkpoint sweep mid-run. Checks no I/O error, and no unbounded
//! growth: daemon memory, file descriptors and journal bytes at the end against the middle of
//! the run; records latency percentiles.
//!
//! `STRATA_SOAK_SECS` (default 20 in CI; hours on demand), `STRATA_SOAK_WORKSPACES` (64).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => n += m.len(),
                _ => {}
            }
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_workspaces_under_mixed_load_stay_bounded() {
    if !have("fio") {
        assert!(std::env::var("CI").is_err(), "CI installs fio");
        eprintln!("skipping: needs fio");
        return;
    }
    let secs: u64 = std::env::var("STRATA_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let n: usize = std::env::var("STRATA_SOAK_WORKSPACES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    let daemon = serve(
        &data,
        &[
            "--upload-interval",
            "2s",
            "--segment-size",
            "4MiB",
            "--cache-capacity",
            "256MiB",
        ],
    );
    let pid = daemon.child.id();
    let t = tenant(&daemon.url, "alpha").await;
    let mut jobs =
        String::from("[global]\nioengine=nbd\nsize=24m\nbs=4k\ndirect=1\ntime_based=1\n");
    jobs.push_str(&format!("runtime={secs}\ngroup_reporting=0\n"));
    for i in 0..n {
        let ws = format!("s{i}");
        let (s, v) = t
            .post("/v1/workspaces", json!({"name": ws, "size": 32 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, att) = t
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{att}");
        let uri = att["export"].as_str().unwrap();
        let (rw, extra) = match i % 4 {
            0 => ("randwrite", "fsync=16\n"),
            1 => ("randread", ""),
            2 => ("randrw", "rwmixread=70\nfsync=32\n"),
            _ => ("write", "bs=256k\nfsync=4\n"),
        };
        jobs.push_str(&format!("[{ws}]\nuri={uri}\nrw={rw}\n{extra}"));
    }
    let job_file = d.path().join("soak.fio");
    std::fs::write(&job_file, jobs).unwrap();
    let (rss0, fd0) = (rss_kib(pid), fds(pid));
    let fio = tokio::task::spawn_blocking({
        let job_file = job_file.clone();
        move || {
            Command::new("fio")
                .arg("--output-format=json")
                .arg(&job_file)
                .output()
                .unwrap()
        }
    });
    // Mid-run: sample, and checkpoint every workspace while the load runs.
    tokio::time::sleep(Duration::from_secs(secs / 2)).await;
    let (rss_mid, fd_mid, journal_mid) = (rss_kib(pid), fds(pid), dir_bytes(&data.join("volumes")));
    let t0 = Instant::now();
    for i in 0..n {
        let (s, v) = t
            .post(&format!("/v1/workspaces/s{i}/checkpoint"), json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    let sweep = t0.elapsed();
    let out = fio.await.unwrap();
    assert!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (rss_end, fd_end, journal_end) = (rss_kib(pid), fds(pid), dir_bytes(&data.join("volumes")));
    // fio may print notes before its JSON.
    let start = out.stdout.iter().position(|&b| b == b'{').unwrap_or(0);
    let report: Value = serde_json::from_slice(&out.stdout[start..]).unwrap_or_else(|e| {
        panic!(
            "{e}: {}",
            String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(2000)])
        )
    });
    let (mut errors, mut ios) = (0u64, 0u64);
    let mut p99_write = vec![];
    let mut p99_read = vec![];
    for j in report["jobs"].as_array().unwrap() {
        errors += j["error"].as_u64().unwrap_or(0);
        for (dir, p) in [("read", &mut p99_read), ("write", &mut p99_write)] {
            ios += j[dir]["total_ios"].as_u64().unwrap_or(0);
            if let Some(v) = j[dir]["clat_ns"]["percentile"]["99.000000"].as_u64() {
                p.push(v / 1000);
            }
        }
    }
    p99_read.sort();
    p99_write.sort();
    let med = |v: &Vec<u64>| v.get(v.len() / 2).copied().unwrap_or(0);
    eprintln!(
        "soak: {n} workspaces, {secs} s, {ios} I/Os, {errors} errors; checkpoint sweep of all {n} in {sweep:?}; \
         median job p99 latency read {} µs, write {} µs (worst {} / {} µs); \
         RSS {rss0} → {rss_mid} → {rss_end} KiB; fds {fd0} → {fd_mid} → {fd_end}; \
         journals {} → {} MiB",
        med(&p99_read),
        med(&p99_write),
        p99_read.last().unwrap_or(&0),
        p99_write.last().unwrap_or(&0),
        journal_mid >> 20,
        journal_end >> 20
    );
    assert_eq!(errors, 0);
    assert!(ios > 0);
    // Bounded: the second half of the run adds little on top of the first.
    assert!(
        rss_end < rss_mid * 2 + 64 * 1024,
        "memory keeps growing: {rss_mid} → {rss_end} KiB"
    );
    assert!(
        fd_end <= fd_mid + 16,
        "file descriptors leak: {fd_mid} → {fd_end}"
    );
    // Journals: live data plus spare segments, bounded per workspace (not by bytes written).
    let per_ws = journal_end / n as u64;
    assert!(per_ws < 64 << 20, "journal {per_ws} B per workspace");
}
