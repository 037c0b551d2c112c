//! What one GC pass costs against what a tenant retains (issue 46), on a simulated store:
//! the catalog is real (SQLite, and PostgreSQL when `STRATA_TEST_PG` names a server), the
//! object store is in memory behind `object_store`'s throttle (`BENCH_STORE_LATENCY_MS` per
//! request, default 20) and a wrapper that counts requests. For each count of retained versions
//! (`BENCH_GC_RETAINED`, default 100 10000 100000; 100 1000 under `cargo test`) the catalog is
//! filled through its API: one workspace per 10 versions, each version a manifest of 4 objects
//! (3 of the version before, 1 new), every workspace attached elsewhere (its lease held). Then
//! GC passes with the daemon's settings (grace 1 h, compaction of sparse heads, detached ones
//! after 10 min) and retention keeping everything:
//! - the first passes after the fill (they judge every change the fill made), summed;
//! - passes after no change (median of 3; on PostgreSQL after a `VACUUM ANALYZE`, what
//!   autovacuum does within a minute of the fill): the goal is the same time and no store
//!   request whatever the count;
//! - a pass after K = 100 new versions (one in each of 100 workspaces): O(K);
//! - a reconciliation pass (marks everything and lists the store), for contrast.
//!
//! `cargo bench -p strata-engine --bench gcpass`; `BENCH_JSON=FILE` also writes the rows.

#[path = "common/counting.rs"]
mod counting;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::memory::InMemory;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use serde_json::{json, Value};
use strata_catalog::{
    Catalog, CheckpointKind, LeaseGrant, Mode, NewCheckpoint, NewWorkspace, SqliteCatalog,
};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, GcOptions, GcReport};
use strata_format::manifest::ObjectRef;
use strata_format::Hash;
use strata_store::Store;

const T: &str = "bench";
const PER_WS: u64 = 10;
const K: u64 = 100;

fn id(kind: &str, ws: u64, n: u64) -> Hash {
    Hash::of(format!("{kind}/{ws}/{n}").as_bytes())
}

/// Version `v` of workspace `ws`: 3 objects of the version before and 1 new.
fn objects(ws: u64, v: u64) -> Vec<ObjectRef> {
    (v.saturating_sub(3)..=v)
        .map(|n| ObjectRef {
            id: id("obj", ws, n),
            data_len: 4 << 20,
        })
        .collect()
}

async fn publish(cat: &dyn Catalog, ws: u64, v: u64, lease: &LeaseGrant) {
    let m = id("man", ws, v);
    cat.record_manifest(T, m, &objects(ws, v)).await.unwrap();
    let cp = NewCheckpoint {
        manifest: m,
        disk_size: 1 << 30,
        label: None,
        kind: CheckpointKind::Auto,
        bytes: 4 << 20,
        cut_seq: v,
        journal_id: Some("j".into()),
        keep_until_ms: None,
    };
    cat.advance_head(T, &format!("w{ws}"), v - 1, lease, &cp)
        .await
        .unwrap();
}

/// One workspace with `PER_WS` versions, its lease held by another node.
async fn fill_one(cat: &dyn Catalog, ws: u64) -> LeaseGrant {
    let m = id("man", ws, 1);
    cat.record_manifest(T, m, &objects(ws, 1)).await.unwrap();
    let name = format!("w{ws}");
    cat.create_workspace(&NewWorkspace {
        tenant: T.into(),
        name: name.clone(),
        mode: Mode::Durable,
        disk_size: 1 << 30,
        manifest: m,
        source: "empty".into(),
        kind: CheckpointKind::Create,
        ttl_ms: None,
    })
    .await
    .unwrap();
    let lease = cat
        .acquire_lease(T, &name, "elsewhere", 86_400_000)
        .await
        .unwrap();
    for v in 2..=PER_WS {
        publish(cat, ws, v, &lease).await;
    }
    lease
}

struct Pass {
    ms: f64,
    requests: u64,
    report: GcReport,
}

async fn pass(e: &Arc<Engine>, opts: &GcOptions, requests: &std::sync::atomic::AtomicU64) -> Pass {
    let before = requests.load(Relaxed);
    let t = Instant::now();
    let report = e.gc(opts).await.unwrap();
    Pass {
        ms: t.elapsed().as_secs_f64() * 1000.0,
        requests: requests.load(Relaxed) - before,
        report,
    }
}

fn cell(p: &Pass) -> String {
    format!(
        "{:.1} ms, {} req, {} changes, {} ws",
        p.ms, p.requests, p.report.changes, p.report.retention_looked
    )
}

fn row(p: &Pass) -> Value {
    json!({"ms": p.ms, "store_requests": p.requests, "changes": p.report.changes,
           "retention_looked": p.report.retention_looked, "condemned": p.report.condemned,
           "live_manifests": p.report.live_manifests})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let counts: Vec<u64> = match std::env::var("BENCH_GC_RETAINED") {
        Ok(s) => s.split_whitespace().map(|c| c.parse().unwrap()).collect(),
        Err(_) if full => vec![100, 10_000, 100_000],
        Err(_) => vec![100, 1_000],
    };
    let latency = Duration::from_millis(
        std::env::var("BENCH_STORE_LATENCY_MS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20),
    );
    let mut backends = vec!["sqlite".to_string()];
    if let Ok(pg) = std::env::var("STRATA_TEST_PG") {
        backends.push(pg);
    } else {
        println!("NOT MEASURED: PostgreSQL (set STRATA_TEST_PG to a server's admin URL)");
    }
    // The catalog file on tmpfs where there is one: filling 100,000 versions is 200,000
    // transactions, and their fsyncs are not what is measured.
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
    };
    println!("store latency {} ms per request\n", latency.as_millis());
    println!("| catalog | retained versions | workspaces | fill | first passes after the fill | pass after no change (median of 3) | pass after {K} new versions | reconciliation pass |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = vec![];
    for backend in &backends {
        for &n in &counts {
            let dir = tempfile::tempdir_in(&base).unwrap();
            let mut pg_url = None;
            let (cat, label): (Arc<dyn Catalog>, &str) = if backend == "sqlite" {
                let c = SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap();
                (Arc::new(c), "SQLite (tmpfs)")
            } else {
                let db = format!("strata_gcbench_{}_{n}", std::process::id());
                let url = strata_catalog::create_database(backend, &db).await.unwrap();
                pg_url = Some(url.clone());
                (
                    strata_catalog::open_url(&url, 16).await.unwrap(),
                    "PostgreSQL",
                )
            };
            cat.create_tenant(T).await.unwrap();
            let throttle = ThrottleConfig {
                wait_get_per_call: latency,
                wait_put_per_call: latency,
                wait_delete_per_call: latency,
                wait_list_per_call: latency,
                wait_list_with_delimiter_per_call: latency,
                ..Default::default()
            };
            let (counting, requests) =
                counting::Counting::new(ThrottledStore::new(InMemory::new(), throttle));
            let store = Store::from_object_store(Arc::new(counting), "memory://bench");
            let mut cfg = EngineConfig::new(dir.path().join("node"));
            cfg.node_id = Some("gc".into());
            let e = Engine::open_with(cfg.clone(), cat.clone(), store, Arc::new(RealFs)).unwrap();
            let workspaces = (n / PER_WS).max(1);
            let t = Instant::now();
            let leases: Vec<LeaseGrant> = futures::stream::iter(0..workspaces)
                .map(|ws| {
                    let cat = cat.clone();
                    async move { fill_one(&*cat, ws).await }
                })
                .buffered(16)
                .collect()
                .await;
            let fill_s = t.elapsed().as_secs_f64();
            let mut opts = GcOptions::from_config(&cfg, false, false);
            opts.keep_last = usize::MAX;
            opts.keep_auto = usize::MAX;
            opts.max_age = Duration::from_secs(365 * 86_400);
            // The passes that judge what the fill made (a pass looks at most at
            // `CHANGES_PER_PASS` log rows), summed.
            let mut first = pass(&e, &opts, &requests).await;
            while first.report.changes > 0 {
                let p = pass(&e, &opts, &requests).await;
                if p.report.changes == 0 {
                    break;
                }
                first.ms += p.ms;
                first.requests += p.requests;
                first.report.changes += p.report.changes;
                first.report.retention_looked += p.report.retention_looked;
            }
            if let Some(url) = &pg_url {
                // The fill and the first passes changed every row; autovacuum would analyze
                // and vacuum within a minute and compete with the passes measured meanwhile.
                // Steady state is what is measured.
                let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(conn);
                client.batch_execute("VACUUM ANALYZE").await.unwrap();
            }
            let mut quiet: Vec<Pass> = vec![];
            for _ in 0..3 {
                quiet.push(pass(&e, &opts, &requests).await);
            }
            quiet.sort_by(|a, b| a.ms.total_cmp(&b.ms));
            let quiet = quiet.remove(1);
            for ws in 0..K.min(workspaces) {
                publish(&*cat, ws, PER_WS + 1, &leases[ws as usize]).await;
            }
            let after_k = pass(&e, &opts, &requests).await;
            let mut rec = opts.clone();
            rec.reconcile = true;
            let reconcile = pass(&e, &rec, &requests).await;
            println!(
                "| {label} | {n} | {workspaces} | {fill_s:.1} s | {} | {} | {} | {} |",
                cell(&first),
                cell(&quiet),
                cell(&after_k),
                cell(&reconcile)
            );
            rows.push(
                json!({"catalog": label, "retained_versions": n, "workspaces": workspaces,
                "fill_s": fill_s, "first": row(&first), "no_change": row(&quiet),
                "after_k": row(&after_k), "k": K.min(workspaces), "reconcile": row(&reconcile)}),
            );
        }
    }
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let doc = json!({"bench": "gcpass", "store_latency_ms": latency.as_millis() as u64, "rows": rows});
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
