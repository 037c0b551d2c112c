//! Checkpoints of a live workspace against its dirty (unpublished) data (issue 16).
//!
//! For each dirty size (0, 64 MiB, 1 GiB, 4 GiB; written at random offsets, then flushed) a
//! writer keeps writing 4 KiB blocks while 200 checkpoints are taken 25 ms apart, without
//! `wait`: each returns once its cut is durable on the node (a `local` receipt), while the
//! first one's upload of everything dirty runs in the background; then as much dirty data is
//! written again and, a writer writing, 200 forks of the live workspace are taken one after
//! another (each deleted before the next, untimed): the first fork's cut makes the dirty data
//! a pending layer, uploaded in the background while the next forks inherit it.
//! Reported: checkpoint and fork latency (p50, p99, max: the whole call; a checkpoint is cut +
//! fdatasync + pending record, a fork also links the segments, records the fork and opens it),
//! the writer's worst and p99 write latency over the same time, then the time a rollback to
//! the newest checkpoint takes (immediate while it is local) and the time until everything is
//! published. (The issue-16 version forked once per size; issue 43 asks for 200 samples.)
//!
//! `cargo bench -p strata-engine --bench live` (full), a smoke version under `cargo test`.
//! With `BENCH_JSON=FILE` the results are also written as JSON (bench/run.sh collects them).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::RealFs;
use strata_engine::{CheckpointState, Engine, EngineConfig, Mode, Source};
use strata_store::Store;

const T: &str = "bench";
const DISK: u64 = 16 << 30;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Writes `dirty` bytes at random offsets in pieces of `chunk`, then flushes; the time taken.
async fn make_dirty(v: &strata_engine::Volume, dirty: u64, chunk: u64, seed: u64) -> Duration {
    let buf = vec![0x5au8; chunk as usize];
    let mut rng = SmallRng::seed_from_u64(seed);
    let t = Instant::now();
    for _ in 0..dirty / chunk {
        let off = rng.random_range(1024..DISK / chunk) * chunk;
        v.write(off, &buf, false).await.unwrap();
    }
    v.flush().await.unwrap();
    t.elapsed()
}

/// A writer of 4 KiB blocks (`byte`), one every 200 µs until `stop`; its write latencies.
fn spawn_writer(
    v: &Arc<strata_engine::Volume>,
    stop: &Arc<AtomicBool>,
    byte: u8,
) -> tokio::task::JoinHandle<Vec<Duration>> {
    let (v, stop) = (v.clone(), stop.clone());
    tokio::spawn(async move {
        let mut lat = vec![];
        let block = vec![byte; 4096];
        let mut i = 0u64;
        while !stop.load(Relaxed) {
            let t = Instant::now();
            v.write((i % 256) * 4096, &block, false).await.unwrap();
            lat.push(t.elapsed());
            i += 1;
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        lat
    })
}

fn pct(v: &[Duration], p: usize) -> Duration {
    v[(v.len() * p / 100).min(v.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let catalog: Arc<dyn Catalog> =
        Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
    catalog.create_tenant(T).await.unwrap();
    let store = Store::open(&format!("file:{}", dir.path().join("objects").display())).unwrap();
    let mut cfg = EngineConfig::new(dir.path().join("node"));
    cfg.node_id = Some("live".into());
    cfg.upload_interval = Duration::from_secs(3600);
    cfg.upload_max_bytes = u64::MAX;
    cfg.cache_unsafe = false;
    let e = Engine::open_with(cfg, catalog, store, Arc::new(RealFs)).unwrap();
    let sizes: &[u64] = if full {
        &[0, 64 << 20, 1 << 30, 4 << 30]
    } else {
        &[0, 4 << 20]
    };
    let n_cp = if full { 200 } else { 5 };
    let n_fork = if full { 200 } else { 3 };
    let mut rows = vec![];
    for &dirty in sizes {
        let name = format!("live-{}", dirty >> 20);
        e.create_workspace(T, &name, Source::Empty { size: DISK }, Mode::Durable, None)
            .await
            .unwrap();
        let v = e.attach(T, &name).await.unwrap();
        // 4 KiB random writes up to 1 GiB; 64 KiB ones beyond (to bound the bench's time).
        let chunk: u64 = if dirty > 1 << 30 { 64 << 10 } else { 4 << 10 };
        let wrote = make_dirty(&v, dirty, chunk, dirty).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = spawn_writer(&v, &stop, 7u8);
        tokio::time::sleep(Duration::from_millis(25)).await;
        let mut cps = vec![];
        for _ in 0..n_cp {
            let t = Instant::now();
            let p = v.checkpoint_with(None, None, false).await.unwrap();
            cps.push(t.elapsed());
            assert_eq!(p.state, CheckpointState::Local);
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        stop.store(true, Relaxed);
        let mut lat = writer.await.unwrap();
        // The forks against as much unpublished data again: written anew (the checkpoints'
        // upload has published the first), one fork after another, a writer writing.
        make_dirty(&v, dirty, chunk, dirty + 1).await;
        stop.store(false, Relaxed);
        let writer = spawn_writer(&v, &stop, 8u8);
        let mut forks = vec![];
        for i in 0..n_fork {
            let fork = format!("{name}-fork-{i}");
            let t = Instant::now();
            e.fork(T, &name, None, &fork, None).await.unwrap();
            forks.push(t.elapsed());
            e.delete_workspace(T, &fork).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.store(true, Relaxed);
        let mut fork_lat = writer.await.unwrap();
        fork_lat.sort();
        lat.sort();
        cps.sort();
        forks.sort();
        // A rollback to the newest checkpoint: local (immediate) if it is still unpublished.
        // (After the fork: a live fork across a pending rollback waits for its publication.)
        let newest = v.checkpoint_with(None, None, false).await.unwrap();
        let t = Instant::now();
        let rb = e.rollback(T, &name, newest.version).await.unwrap();
        let rollback = t.elapsed();
        let t = Instant::now();
        e.detach(T, &name).await.unwrap();
        let rest = t.elapsed();
        let row = json!({
            "dirty_bytes": dirty, "write_chunk": chunk, "checkpoints": n_cp,
            "checkpoint_p50_ms": ms(pct(&cps, 50)), "checkpoint_p99_ms": ms(pct(&cps, 99)),
            "checkpoint_max_ms": ms(*cps.last().unwrap()),
            "writer_worst_ms": ms(*lat.last().unwrap()), "writer_p99_ms": ms(pct(&lat, 99)),
            "writes_during": lat.len(), "forks": n_fork,
            "fork_of_live_ms": ms(pct(&forks, 50)), "fork_p50_ms": ms(pct(&forks, 50)),
            "fork_p99_ms": ms(pct(&forks, 99)), "fork_max_ms": ms(*forks.last().unwrap()),
            "fork_writer_worst_ms": ms(*fork_lat.last().unwrap()),
            "fork_writer_p99_ms": ms(pct(&fork_lat, 99)),
            "rollback_ms": ms(rollback), "rollback_state": rb.state.as_str(),
            "publish_rest_ms": ms(rest), "dirty_write_s": wrote.as_secs_f64(),
        });
        println!(
            "{} MiB dirty: local checkpoint p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; fork of the live workspace p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (writer worst {:.2} ms meanwhile); writer worst {:.2} ms, p99 {:.3} ms over {} writes; rollback to the newest {:.1} ms ({}); detach after {:.0} ms",
            dirty >> 20,
            ms(pct(&cps, 50)),
            ms(pct(&cps, 99)),
            ms(*cps.last().unwrap()),
            ms(pct(&forks, 50)),
            ms(pct(&forks, 99)),
            ms(*forks.last().unwrap()),
            ms(*fork_lat.last().unwrap()),
            ms(*lat.last().unwrap()),
            ms(pct(&lat, 99)),
            lat.len(),
            ms(rollback),
            rb.state.as_str(),
            ms(rest)
        );
        rows.push(row);
        e.delete_workspace(T, &name).await.unwrap();
    }
    let p0 = rows[0]["checkpoint_p99_ms"].as_f64().unwrap();
    let plast = rows.last().unwrap()["checkpoint_p99_ms"].as_f64().unwrap();
    println!(
        "ratio of checkpoint p99, largest dirty ÷ none: {:.2}",
        plast / p0
    );
    let f0 = rows[0]["fork_p99_ms"].as_f64().unwrap();
    let flast = rows.last().unwrap()["fork_p99_ms"].as_f64().unwrap();
    println!("ratio of fork p99, largest dirty ÷ none: {:.2}", flast / f0);
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let out = json!({ "live_checkpoint": Value::Array(rows) });
        std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap()).unwrap();
        println!("results: {path}");
    }
}
