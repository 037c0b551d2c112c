//! Issue 7, scenarios 4–6 at the engine level:
//! - 4: fork time against logical disk size (1 GiB, 64 GiB, 1 TiB); checkpoint stall (the
//!   writer-lock hold, and the worst latency a concurrent writer saw) and publish time against
//!   dirty size (0 to 1 GiB); restore-ready time (attach on a fresh node with an empty cache plus
//!   the first read) with 0 and 20 ms of latency on every object-store request;
//! - 5: the shared node cache: 8 forks of one base cold-reading the same data on one node,
//!   store GETs relative to one reader (goal ≤ 1.1x);
//! - 6: memory per extent, counted by a global allocator wrapper (bytes held, not RSS): overlay
//!   runs (writes since the last checkpoint) and base-manifest extents (goal ≤ 32 B).
//!
//! `cargo bench -p strata-engine --bench scale` (full), a smoke version under `cargo test`.
//! With `BENCH_JSON=FILE` the results are also written as JSON (bench/run.sh collects them).

// The only unsafe code: a counting wrapper around the system allocator, bench-only.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::ObjectStore;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, Mode, Source, Volume};
use strata_store::Store;

const T: &str = "bench";

/// Counts the bytes the process holds on the heap (live) and the high-water mark since a reset.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let live = LIVE.fetch_add(n, Relaxed) + n;
    PEAK.fetch_max(live, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new >= l.size() {
            grew(new - l.size());
        } else {
            LIVE.fetch_sub(l.size() - new, Relaxed);
        }
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> usize {
    LIVE.load(Relaxed)
}
fn reset_peak() -> usize {
    let l = live();
    PEAK.store(l, Relaxed);
    l
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn engine(
    dir: &std::path::Path,
    node: &str,
    catalog: Arc<dyn Catalog>,
    store: Store,
) -> Arc<Engine> {
    let mut cfg = EngineConfig::new(dir.join(node));
    cfg.node_id = Some(node.into());
    cfg.upload_interval = Duration::from_secs(3600);
    cfg.upload_max_bytes = u64::MAX;
    cfg.cache_unsafe = false;
    Engine::open_with(cfg, catalog, store, Arc::new(RealFs)).unwrap()
}

/// The same store with `lat` added to every request, as a remote object store would.
fn slow(store: &Store, lat: Duration) -> Store {
    let cfg = ThrottleConfig {
        wait_get_per_call: lat,
        wait_put_per_call: lat,
        wait_delete_per_call: lat,
        wait_list_per_call: lat,
        wait_list_with_delimiter_per_call: lat,
        ..Default::default()
    };
    let inner: Arc<dyn ObjectStore> =
        Arc::new(ThrottledStore::new(store.default_inner().clone(), cfg));
    Store::from_object_store(inner, store.url())
}

/// Creates an empty durable workspace of `size` bytes and attaches it.
async fn empty_volume(e: &Arc<Engine>, name: &str, size: u64) -> Arc<Volume> {
    e.create_workspace(T, name, Source::Empty { size }, Mode::Durable, None)
        .await
        .unwrap();
    e.attach(T, name).await.unwrap()
}

/// A 4 KiB block stamped with its number (cheap distinct data).
fn stamped(i: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&i.to_le_bytes());
    }
    b
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let catalog: Arc<dyn Catalog> =
        Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
    catalog.create_tenant(T).await.unwrap();
    let store = Store::open(&format!("file:{}", dir.path().join("objects").display())).unwrap();
    let mut out = serde_json::Map::new();
    if std::env::var("BENCH_ONLY").is_ok_and(|o| o == "checkpoint") {
        let cps = checkpoints(dir.path(), &catalog, &store, full).await;
        println!("{}", serde_json::to_string(&cps).unwrap());
        return;
    }

    out.insert(
        "scaling".into(),
        scaling(dir.path(), &catalog, &store, full).await,
    );
    out.insert(
        "shared_cache".into(),
        shared_cache(dir.path(), &catalog, &store, full).await,
    );
    out.insert(
        "memory".into(),
        memory(dir.path(), &catalog, &store, full).await,
    );
    if let Ok(path) = std::env::var("BENCH_JSON") {
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&Value::Object(out)).unwrap(),
        )
        .unwrap();
        println!("results: {path}");
    }
}

/// Scenario 4.
async fn scaling(
    dir: &std::path::Path,
    catalog: &Arc<dyn Catalog>,
    store: &Store,
    full: bool,
) -> Value {
    // Forks and restores on an in-memory store (object_store's latency wrapper cannot wrap
    // local files); checkpoints on the local object directory, fsync'd like the default.
    let mem = Store::open("memory:").unwrap();
    let e = engine(dir, "scale", catalog.clone(), mem.clone());
    let sizes: &[(&str, u64)] = &[("1GiB", 1 << 30), ("64GiB", 64 << 30), ("1TiB", 1 << 40)];
    let spread = if full { 4096 } else { 256 }; // 4 KiB writes spread over the disk
    let mut forks = vec![];
    let mut restores = vec![];
    for &(label, size) in sizes {
        let src = format!("disk-{label}");
        let v = empty_volume(&e, &src, size).await;
        let mut rng = SmallRng::seed_from_u64(size);
        let blocks = size / 4096;
        for i in 0..spread {
            v.write(rng.random_range(0..blocks) * 4096, &stamped(i), false)
                .await
                .unwrap();
        }
        v.write(0, &stamped(u64::MAX), false).await.unwrap();
        let version = v.checkpoint(None).await.unwrap().version;
        let mut ts = vec![];
        for i in 0..20 {
            let t = Instant::now();
            e.fork(T, &src, Some(version), &format!("{src}-f{i}"), None)
                .await
                .unwrap();
            ts.push(t.elapsed());
        }
        let fork_ms = ms(p50(ts));
        println!("fork, {label} disk: p50 of 20 = {fork_ms:.2} ms");
        forks.push(json!({"disk": label, "bytes": size, "fork_p50_ms": fork_ms}));
        e.detach(T, &src).await.unwrap();

        // Restore-ready: a fresh node (empty cache) attaches the head and reads one block.
        for lat_ms in [0u64, 20] {
            let node = format!("restore-{label}-{lat_ms}");
            let r = engine(
                dir,
                &node,
                catalog.clone(),
                slow(&mem, Duration::from_millis(lat_ms)),
            );
            let t = Instant::now();
            let v = r.attach(T, &src).await.unwrap();
            let attach = t.elapsed();
            let b = v.read(0, 4096).await.unwrap();
            let ready = t.elapsed();
            assert_eq!(b, stamped(u64::MAX));
            let gets = r.reader().stats().gets;
            println!(
                "restore, {label} disk, {lat_ms} ms per request: attach {:.1} ms, first read at {:.1} ms ({gets} object GET)",
                ms(attach),
                ms(ready)
            );
            restores.push(
                json!({"disk": label, "latency_ms": lat_ms, "attach_ms": ms(attach),
                "first_read_ms": ms(ready), "object_gets": gets}),
            );
            r.detach(T, &src).await.unwrap();
        }
    }

    let cps = checkpoints(dir, catalog, store, full).await;
    json!({"fork": forks, "restore": restores, "checkpoint": cps})
}

/// Scenario 4, second half: checkpoint stall and publish time against dirty size, on a 64 GiB
/// disk. `BENCH_DIRTY_MB=256,1024` picks the sizes (for an off-CPU trace of one row).
async fn checkpoints(
    dir: &std::path::Path,
    catalog: &Arc<dyn Catalog>,
    store: &Store,
    full: bool,
) -> Vec<Value> {
    let dirty: Vec<u64> = match std::env::var("BENCH_DIRTY_MB") {
        Ok(l) => l
            .split(',')
            .map(|m| m.trim().parse::<u64>().unwrap() << 20)
            .collect(),
        Err(_) if full => vec![0, 16 << 20, 256 << 20, 1 << 30],
        Err(_) => vec![0, 1 << 20, 8 << 20],
    };
    let mut cps = vec![];
    let e = engine(dir, "checkpoints", catalog.clone(), store.clone());
    for &d in &dirty {
        let name = format!("cp-{}", d >> 20);
        let v = empty_volume(&e, &name, 64 << 30).await;
        let mut rng = SmallRng::seed_from_u64(d);
        let blocks = (64u64 << 30) / 4096;
        for i in 0..d / 4096 {
            v.write(rng.random_range(0..blocks) * 4096, &stamped(i), false)
                .await
                .unwrap();
        }
        v.flush().await.unwrap();
        // A writer keeps going during the checkpoint (over the same 1 MiB, so it adds at most
        // 1 MiB of dirty data); its worst latency is the stall it sees.
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (v, stop) = (v.clone(), stop.clone());
            tokio::spawn(async move {
                let mut lat = vec![];
                let mut i = 0u64;
                while !stop.load(Relaxed) {
                    let t = Instant::now();
                    v.write((i % 256) * 4096, &stamped(i), false).await.unwrap();
                    lat.push(t.elapsed());
                    i += 1;
                    tokio::task::yield_now().await;
                }
                lat
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let p = v.checkpoint(None).await.unwrap();
        stop.store(true, Relaxed);
        let mut lat = writer.await.unwrap();
        lat.sort();
        let worst = lat.last().copied().unwrap_or_default();
        let p99 = lat[lat.len() * 99 / 100];
        println!(
            "checkpoint, {} MiB dirty: cut {:.3} ms, concurrent writer worst {:.2} ms / p99 {:.3} ms over {} writes, publish {:.0} ms",
            d >> 20,
            ms(p.stall),
            ms(worst),
            ms(p99),
            lat.len(),
            ms(p.total)
        );
        cps.push(
            json!({"dirty_bytes": d, "cut_ms": ms(p.stall), "writer_worst_ms": ms(worst),
            "writer_p99_ms": ms(p99), "writes_during": lat.len(), "publish_ms": ms(p.total)}),
        );
        e.detach(T, &name).await.unwrap();
    }
    cps
}

/// Scenario 5.
async fn shared_cache(
    dir: &std::path::Path,
    catalog: &Arc<dyn Catalog>,
    store: &Store,
    full: bool,
) -> Value {
    let data_mib: u64 = if full { 64 } else { 8 };
    let w = engine(dir, "writer", catalog.clone(), store.clone());
    let v = empty_volume(&w, "base", data_mib << 20).await;
    for off in (0..data_mib << 20).step_by(1 << 20) {
        // Distinct blocks (identical ones would be stored once).
        let chunk: Vec<u8> = (0..256).flat_map(|b| stamped((off >> 12) + b)).collect();
        v.write(off, &chunk, false).await.unwrap();
    }
    w.detach(T, "base").await.unwrap();
    let read_all = |e: Arc<Engine>, ws: String| async move {
        let v = e.attach(T, &ws).await.unwrap();
        for off in (0..data_mib << 20).step_by(64 << 10) {
            v.read(off, 64 << 10).await.unwrap();
        }
    };
    let one = engine(dir, "one", catalog.clone(), store.clone());
    one.fork(T, "base", None, "solo", None).await.unwrap();
    read_all(one.clone(), "solo".into()).await;
    let solo = one.reader().stats();
    let shared = engine(dir, "shared", catalog.clone(), store.clone());
    let mut tasks = vec![];
    for i in 0..8 {
        let name = format!("f{i}");
        shared.fork(T, "base", None, &name, None).await.unwrap();
        tasks.push(tokio::spawn(read_all(shared.clone(), name)));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let eight = shared.reader().stats();
    let ratio = eight.gets as f64 / solo.gets.max(1) as f64;
    println!(
        "shared cache: one reader {} GETs ({} MiB) for {data_mib} MiB; 8 forks on one node {} GETs ({} MiB): {ratio:.2}x one reader",
        solo.gets,
        solo.bytes_fetched >> 20,
        eight.gets,
        eight.bytes_fetched >> 20
    );
    json!({"data_bytes": data_mib << 20, "one_reader_gets": solo.gets,
        "one_reader_bytes": solo.bytes_fetched, "eight_forks_gets": eight.gets,
        "eight_forks_bytes": eight.bytes_fetched, "ratio": ratio})
}

/// Scenario 6.
async fn memory(
    dir: &std::path::Path,
    catalog: &Arc<dyn Catalog>,
    store: &Store,
    full: bool,
) -> Value {
    let runs: u64 = if full { 500_000 } else { 20_000 };
    let m = engine(dir, "mem", catalog.clone(), store.clone());
    let v = empty_volume(&m, "frag", runs * 2 * 4096).await;
    let block = vec![1u8; 4096];
    // Every other block written: no runs merge, one overlay run (then one extent) per write.
    let l0 = live();
    for i in 0..runs {
        v.write(i * 2 * 4096, &block, false).await.unwrap();
    }
    let l1 = live();
    let overlay_runs = v.stats().overlay_runs;
    let per_run = (l1 - l0) as f64 / overlay_runs.max(1) as f64;
    reset_peak();
    let p = v.checkpoint(None).await.unwrap();
    let peak = PEAK.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let l2 = live();
    let per_extent = (l2 as f64 - l0 as f64) / runs as f64;
    // The same runs written in random order (runs land in the middle of the map).
    let shuffled = empty_volume(&m, "frag-random", runs * 2 * 4096).await;
    let mut order: Vec<u64> = (0..runs).collect();
    let mut rng = SmallRng::seed_from_u64(6);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let r0 = live();
    for &i in &order {
        shuffled.write(i * 2 * 4096, &block, false).await.unwrap();
    }
    let per_run_random = (live() - r0) as f64 / shuffled.stats().overlay_runs.max(1) as f64;
    drop(shuffled);
    let peak_above = (peak - l0) as u64;
    println!(
        "memory: overlay {overlay_runs} runs hold {:.1} B/run ({per_run_random:.1} written in random order); after the publish (v{}) the base manifest holds {:.1} B/extent; heap peak during the publish {} MiB above the start ({} MiB of data)",
        per_run,
        p.version,
        per_extent,
        peak_above >> 20,
        (runs * 4096) >> 20
    );
    json!({"runs": overlay_runs, "overlay_bytes_per_run": per_run,
        "overlay_bytes_per_run_random": per_run_random,
        "manifest_bytes_per_extent": per_extent, "publish_peak_bytes": peak_above,
        "data_bytes": runs * 4096})
}
