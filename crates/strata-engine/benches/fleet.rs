//! A fleet on one catalog (issue 46): simulated nodes in one process, each doing what a strata
//! node does to the catalog at the rates the daemon uses, against one real PostgreSQL
//! (`STRATA_TEST_PG`, an admin URL; SQLite when unset, for a smoke run):
//! - a heartbeat every second (`report_node`, with one entry per attached workspace);
//! - every attached workspace's lease renewed in one call every `lease_ttl / 4` (7.5 s);
//! - each *active* workspace publishing every `upload_interval` (10 s): the manifest recorded
//!   (8 objects, 1 new) and the head CAS;
//! - user operations at `BENCH_FLEET_OPS` per node per second (default 0.2): checkpoints (a
//!   publish), live forks (a workspace created from the head's manifest, its lease taken, the
//!   fork deleted a while later) and reads (`get_workspace` + `list_checkpoints`);
//! - one GC pass every 10 s over the fleet's tenant (an engine on the same catalog, the store
//!   in memory, counted).
//!
//! Each step of `BENCH_FLEET_NODES` (default "10 40 160"; "4" under `cargo test`) runs
//! `BENCH_FLEET_SECS` (default 30; 5 under `cargo test`) with `BENCH_FLEET_WS` workspaces per
//! node (default 25), `BENCH_FLEET_ACTIVE` of them active (default 0.2). Reported per step: each
//! transaction kind's rate and p50 / p99 / max latency, all transactions per second, the GC
//! passes' time, and whether the nodes kept up (the share of renewals and publishes that ran
//! late). The simulator and the database share this machine's cores: the figures are a floor.
//!
//! `cargo bench -p strata-engine --bench fleet`; `BENCH_JSON=FILE` also writes the rows.

#[path = "common/counting.rs"]
mod counting;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::memory::InMemory;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use strata_catalog::{
    AttachedStatus, Catalog, CheckpointKind, LeaseGrant, LeaseRenewal, Mode, NewCheckpoint,
    NewWorkspace, NodeStatus, SqliteCatalog,
};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, GcOptions};
use strata_format::manifest::ObjectRef;
use strata_format::Hash;
use strata_store::Store;

const T: &str = "fleet";
const HEARTBEAT: Duration = Duration::from_secs(1);
const RENEW: Duration = Duration::from_millis(7500);
const LEASE_TTL_MS: u64 = 30_000;
const PUBLISH: Duration = Duration::from_secs(10);
const GC_EVERY: Duration = Duration::from_secs(10);

/// Latencies per transaction kind, and how many ran late (after their next was due).
#[derive(Default)]
struct Stats {
    lat: Mutex<HashMap<&'static str, Vec<Duration>>>,
    late: AtomicU64,
    due: AtomicU64,
}

impl Stats {
    /// A periodic task ran at `now`, due at `next`: counted late if over half a period after.
    fn ran(&self, next: Instant, period: Duration, now: Instant) {
        self.due.fetch_add(1, Relaxed);
        if now > next + period / 2 {
            self.late.fetch_add(1, Relaxed);
        }
    }
    fn add(&self, kind: &'static str, d: Duration) {
        self.lat.lock().unwrap().entry(kind).or_default().push(d);
    }
    async fn time<F: std::future::Future<Output = R>, R>(&self, kind: &'static str, f: F) -> R {
        let t = Instant::now();
        let r = f.await;
        self.add(kind, t.elapsed());
        r
    }
}

struct Ws {
    name: String,
    lease: LeaseGrant,
    version: u64,
}

/// A node's heartbeat: one entry per attached workspace.
fn status<'a>(node: &str, url: Option<String>, ws: impl Iterator<Item = &'a Ws>) -> NodeStatus {
    NodeStatus {
        node: node.into(),
        url,
        seen_ms: 0,
        seen_ago_ms: 0,
        attached: ws
            .map(|w| AttachedStatus {
                tenant: T.into(),
                workspace: w.name.clone(),
                mode: Mode::Durable,
                epoch: w.lease.epoch,
                head_version: w.version,
                remote_window_bytes: 0,
                remote_window_age_ms: 0,
            })
            .collect(),
    }
}

/// One renewal call's batch: every lease the node holds.
fn renewals<'a>(ws: impl Iterator<Item = &'a Ws>) -> Vec<LeaseRenewal> {
    ws.map(|w| LeaseRenewal {
        tenant: T.into(),
        workspace: w.name.clone(),
        lease: w.lease.clone(),
    })
    .collect()
}

fn hash(s: String) -> Hash {
    Hash::of(s.as_bytes())
}

fn objects(ws: &str, v: u64) -> Vec<ObjectRef> {
    (v.saturating_sub(7)..=v)
        .map(|n| ObjectRef {
            id: hash(format!("o/{ws}/{n}")),
            data_len: 4 << 20,
        })
        .collect()
}

fn cp(m: Hash, kind: CheckpointKind, v: u64) -> NewCheckpoint {
    NewCheckpoint {
        manifest: m,
        disk_size: 1 << 30,
        label: None,
        kind,
        bytes: 4 << 20,
        cut_seq: v,
        journal_id: Some("j".into()),
        keep_until_ms: None,
    }
}

async fn publish(cat: &dyn Catalog, st: &Stats, w: &mut Ws, kind: CheckpointKind) {
    let v = w.version + 1;
    let m = hash(format!("m/{}/{v}", w.name));
    st.time(
        "record_manifest",
        cat.record_manifest(T, m, &objects(&w.name, v)),
    )
    .await
    .unwrap();
    let kind_name = if kind == CheckpointKind::Auto {
        "head CAS (publish)"
    } else {
        "head CAS (checkpoint)"
    };
    w.version = st
        .time(
            kind_name,
            cat.advance_head(T, &w.name, w.version, &w.lease, &cp(m, kind, v)),
        )
        .await
        .unwrap();
}

async fn create(cat: &dyn Catalog, st: &Stats, name: String, m: Hash, node: &str) -> Ws {
    st.time(
        "create workspace",
        cat.create_workspace(&NewWorkspace {
            tenant: T.into(),
            name: name.clone(),
            mode: Mode::Durable,
            disk_size: 1 << 30,
            manifest: m,
            source: "empty".into(),
            kind: CheckpointKind::Create,
            ttl_ms: None,
        }),
    )
    .await
    .unwrap();
    let lease = st
        .time(
            "acquire lease",
            cat.acquire_lease(T, &name, node, LEASE_TTL_MS),
        )
        .await
        .unwrap();
    Ws {
        name,
        lease,
        version: 1,
    }
}

/// What every simulated node does: its workspaces, the share active, user operations per second.
#[derive(Clone, Copy)]
struct Load {
    n_ws: usize,
    active: f64,
    ops: f64,
}

async fn node(
    cat: Arc<dyn Catalog>,
    st: Arc<Stats>,
    id: usize,
    Load { n_ws, active, ops }: Load,
    ready: Arc<tokio::sync::Barrier>,
    mut start_rx: tokio::sync::watch::Receiver<Option<Instant>>,
) {
    let name = format!("node-{id}");
    let mut rng = SmallRng::seed_from_u64(id as u64);
    let mut ws = vec![];
    // The node's workspaces, created and attached before the measured period (not counted).
    let setup = Stats::default();
    for i in 0..n_ws {
        let w = format!("n{id}-w{i}");
        let m = hash(format!("m/{w}/1"));
        cat.record_manifest(T, m, &objects(&w, 1)).await.unwrap();
        ws.push(create(&*cat, &setup, w, m, &name).await);
    }
    ready.wait().await;
    let until = *start_rx.wait_for(|u| u.is_some()).await.unwrap();
    let until = until.unwrap();
    let n_active = ((n_ws as f64) * active).round() as usize;
    let start = Instant::now();
    // Spread each node's timers over the period (nodes do not start together).
    let mut next_beat = start + HEARTBEAT.mul_f64(rng.random());
    let mut next_renew = start + RENEW.mul_f64(rng.random());
    let mut next_publish: Vec<Instant> = (0..n_active)
        .map(|_| start + PUBLISH.mul_f64(rng.random()))
        .collect();
    let op_gap = Duration::from_secs_f64(1.0 / ops.max(1e-6));
    let mut next_op = start + op_gap.mul_f64(rng.random());
    let mut forks: Vec<Ws> = vec![];
    let mut fork_n = 0;
    loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        let mut due: Vec<Instant> = vec![next_beat, next_renew, next_op];
        due.extend(next_publish.iter().copied());
        let wake = due.into_iter().min().unwrap();
        if wake > now {
            tokio::time::sleep(wake - now).await;
            continue;
        }
        if now >= next_beat {
            st.ran(next_beat, HEARTBEAT, now);
            let url = Some(format!("http://10.0.{}.{}:7000", id / 250, id % 250));
            let status = status(&name, url, ws.iter().chain(forks.iter()));
            st.time("heartbeat", cat.report_node(&status))
                .await
                .unwrap();
            next_beat += HEARTBEAT;
        } else if now >= next_renew {
            st.ran(next_renew, RENEW, now);
            let batch = renewals(ws.iter().chain(forks.iter()));
            st.time(
                "renew leases (batch)",
                cat.renew_leases(&batch, LEASE_TTL_MS),
            )
            .await
            .unwrap();
            next_renew += RENEW;
        } else if now >= next_op {
            match rng.random_range(0..3) {
                0 => {
                    let i = rng.random_range(0..ws.len());
                    publish(&*cat, &st, &mut ws[i], CheckpointKind::Checkpoint).await;
                }
                1 => {
                    // A live fork: a workspace from the source's head manifest, attached here.
                    let i = rng.random_range(0..ws.len());
                    let head = hash(format!("m/{}/{}", ws[i].name, ws[i].version));
                    fork_n += 1;
                    let f = format!("n{id}-f{fork_n}");
                    let w = create(&*cat, &st, f, head, &name).await;
                    forks.push(w);
                    if forks.len() > 4 {
                        let old = forks.remove(0);
                        cat.release_lease(T, &old.name, &old.lease).await.unwrap();
                        st.time("delete workspace", cat.delete_workspace(T, &old.name))
                            .await
                            .unwrap();
                    }
                }
                _ => {
                    let i = rng.random_range(0..ws.len());
                    st.time("read workspace", cat.get_workspace(T, &ws[i].name))
                        .await
                        .unwrap();
                    st.time("list checkpoints", cat.list_checkpoints(T, &ws[i].name))
                        .await
                        .unwrap();
                }
            }
            next_op += op_gap;
        } else if let Some(i) = (0..next_publish.len()).find(|&i| now >= next_publish[i]) {
            st.ran(next_publish[i], PUBLISH, now);
            publish(&*cat, &st, &mut ws[i], CheckpointKind::Auto).await;
            next_publish[i] += PUBLISH;
        }
    }
    for w in forks.iter().chain(ws.iter()) {
        let _ = cat.release_lease(T, &w.name, &w.lease).await;
    }
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1000.0
}

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(d)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let steps: Vec<usize> = std::env::var("BENCH_FLEET_NODES")
        .ok()
        .map(|s| s.split_whitespace().map(|c| c.parse().unwrap()).collect())
        .unwrap_or(if full { vec![10, 40, 160] } else { vec![4] });
    let secs: u64 = env("BENCH_FLEET_SECS", if full { 30 } else { 5 });
    let n_ws: usize = env("BENCH_FLEET_WS", 25);
    let active: f64 = env("BENCH_FLEET_ACTIVE", 0.2);
    let ops: f64 = env("BENCH_FLEET_OPS", 0.2);
    let pg = std::env::var("STRATA_TEST_PG").ok();
    if pg.is_none() {
        println!(
            "NOT MEASURED: PostgreSQL (set STRATA_TEST_PG to a server's admin URL); SQLite instead"
        );
    }
    println!(
        "{secs} s per step, {n_ws} workspaces per node ({active} active), {ops} user operations per node per second\n"
    );
    let mut rows = vec![];
    for &nodes in &steps {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let cat: Arc<dyn Catalog> = match &pg {
            Some(admin) => {
                let db = format!("strata_fleet_{}_{nodes}", std::process::id());
                let url = strata_catalog::create_database(admin, &db).await.unwrap();
                strata_catalog::open_url(&url, 32).await.unwrap()
            }
            None => Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap()),
        };
        cat.create_tenant(T).await.unwrap();
        let st = Arc::new(Stats::default());
        // Every node attaches its workspaces, then the measured period starts for all.
        let ready = Arc::new(tokio::sync::Barrier::new(nodes + 1));
        let load = Load { n_ws, active, ops };
        let (start_tx, start_rx) = tokio::sync::watch::channel(None);
        let tasks: Vec<_> = (0..nodes)
            .map(|i| {
                let (cat, st, ready, rx) =
                    (cat.clone(), st.clone(), ready.clone(), start_rx.clone());
                tokio::spawn(node(cat, st, i, load, ready, rx))
            })
            .collect();
        ready.wait().await;
        let until = Instant::now() + Duration::from_secs(secs);
        start_tx.send(Some(until)).unwrap();
        // GC: an engine on the same catalog, its store in memory and counted.
        let (store, requests) = counting::Counting::new(InMemory::new());
        let store = Store::from_object_store(Arc::new(store), "memory://fleet");
        let mut cfg = EngineConfig::new(dir.path().join("gc"));
        cfg.node_id = Some("gc".into());
        let e = Engine::open_with(cfg.clone(), cat.clone(), store, Arc::new(RealFs)).unwrap();
        let opts = GcOptions::from_config(&cfg, false, false);
        let mut gc_ms = vec![];
        let t0 = Instant::now();
        while Instant::now() + GC_EVERY < until {
            let t = Instant::now();
            e.gc(&opts).await.unwrap();
            gc_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            tokio::time::sleep(GC_EVERY.saturating_sub(t.elapsed())).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let mut lat = std::mem::take(&mut *st.lat.lock().unwrap());
        let total: usize = lat.values().map(|v| v.len()).sum();
        println!("### {nodes} nodes, {} workspaces\n", nodes * n_ws);
        println!("| transaction | per second | p50 ms | p99 ms | max ms |");
        println!("|---|---|---|---|---|");
        let mut kinds: Vec<_> = lat.keys().copied().collect();
        kinds.sort();
        let mut by_kind = serde_json::Map::new();
        for k in kinds {
            let v = lat.get_mut(k).unwrap();
            let (rate, p50, p99, max) = (
                v.len() as f64 / elapsed,
                pct(v, 0.5),
                pct(v, 0.99),
                pct(v, 1.0),
            );
            println!("| {k} | {rate:.1} | {p50:.2} | {p99:.2} | {max:.1} |");
            by_kind.insert(
                k.into(),
                json!({"per_s": rate, "p50_ms": p50, "p99_ms": p99, "max_ms": max}),
            );
        }
        let late = st.late.load(Relaxed) as f64 / st.due.load(Relaxed).max(1) as f64;
        gc_ms.sort_by(f64::total_cmp);
        let gc_p50 = gc_ms.get(gc_ms.len() / 2).copied().unwrap_or(0.0);
        println!(
            "\nall: {:.0} transactions/s; late heartbeats, renewals and publishes: {:.1}%; GC passes: {} (p50 {gc_p50:.1} ms, store requests {})\n",
            total as f64 / elapsed,
            late * 100.0,
            gc_ms.len(),
            requests.load(Relaxed)
        );
        rows.push(
            json!({"nodes": nodes, "workspaces": nodes * n_ws, "secs": elapsed,
            "catalog": if pg.is_some() { "postgres" } else { "sqlite" },
            "tx_per_s": total as f64 / elapsed, "late_share": late, "gc_passes": gc_ms.len(),
            "gc_p50_ms": gc_p50, "gc_store_requests": requests.load(Relaxed), "kinds": by_kind}),
        );
    }
    // Saturation: each transaction kind alone, from `BENCH_FLEET_CLIENTS` (default 32)
    // concurrent clients as fast as they can for `secs / 3` seconds: what one catalog sustains.
    let clients: usize = env("BENCH_FLEET_CLIENTS", 32);
    let sat_secs = (secs / 3).max(2);
    println!("### Saturation: {clients} clients, {sat_secs} s per kind\n");
    println!("| transaction | per second | p50 ms | p99 ms |");
    println!("|---|---|---|---|");
    let mut sat = serde_json::Map::new();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cat: Arc<dyn Catalog> = match &pg {
        Some(admin) => {
            let db = format!("strata_fleet_{}_sat", std::process::id());
            let url = strata_catalog::create_database(admin, &db).await.unwrap();
            strata_catalog::open_url(&url, clients.max(4))
                .await
                .unwrap()
        }
        None => Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap()),
    };
    cat.create_tenant(T).await.unwrap();
    for (k, kind) in [
        "publish (record + head CAS)",
        "renew leases (batch of 25)",
        "heartbeat (25 attached)",
        "read workspace",
    ]
    .into_iter()
    .enumerate()
    {
        let st = Arc::new(Stats::default());
        let ready = Arc::new(tokio::sync::Barrier::new(clients));
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let (cat, st, ready) = (cat.clone(), st.clone(), ready.clone());
                tokio::spawn(async move {
                    let node = format!("sat-{c}");
                    let setup = Stats::default();
                    let mut ws = vec![];
                    for i in 0..25 {
                        let w = format!("{k}-{c}-{i}");
                        let m = hash(format!("m/{w}/1"));
                        cat.record_manifest(T, m, &objects(&w, 1)).await.unwrap();
                        ws.push(create(&*cat, &setup, w, m, &node).await);
                    }
                    // Every client set up, then all measure the same window.
                    ready.wait().await;
                    let until = Instant::now() + Duration::from_secs(sat_secs);
                    let mut i = 0;
                    while Instant::now() < until {
                        let t = Instant::now();
                        match k {
                            0 => {
                                publish(&*cat, &setup, &mut ws[i % 25], CheckpointKind::Auto).await
                            }
                            1 => {
                                let batch = renewals(ws.iter());
                                cat.renew_leases(&batch, LEASE_TTL_MS).await.unwrap();
                            }
                            2 => {
                                let status = status(&node, None, ws.iter());
                                cat.report_node(&status).await.unwrap();
                            }
                            _ => {
                                cat.get_workspace(T, &ws[i % 25].name).await.unwrap();
                            }
                        }
                        st.add("x", t.elapsed());
                        i += 1;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let mut lat = std::mem::take(&mut *st.lat.lock().unwrap());
        let v = lat.get_mut("x").unwrap();
        let rate = v.len() as f64 / sat_secs as f64;
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        println!("| {kind} | {rate:.0} | {p50:.2} | {p99:.2} |");
        sat.insert(
            kind.into(),
            json!({"per_s": rate, "p50_ms": p50, "p99_ms": p99}),
        );
    }
    println!();
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let doc = json!({"bench": "fleet", "workspaces_per_node": n_ws, "active": active,
            "ops_per_node_s": ops, "rows": rows, "saturation": {"clients": clients, "secs": sat_secs, "kinds": sat}});
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
