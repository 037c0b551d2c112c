//! The nemesis campaign: operations and faults race the data path of the real daemon, and a
//! checker judges the history after every step.
//!
//! Two workspaces on node A, each written by three NBD connections (write, FUA write, trim,
//! write-zeroes, flush, on disjoint block ranges): `d` in durable mode and `s` in sync mode.
//! Node B shares A's catalog and object store. While the clients run, the nemesis does one of:
//! checkpoint; checkpoint whose client gives up at a random moment; fork of the live workspace;
//! rollback to an earlier checkpoint; a grow of the disk; detach and attach; freeze and thaw; a GC pass with a short
//! grace (which also compacts); kill -9 and restart of A (half the time just after a local
//! checkpoint, whose publication must resume); object-store faults for the round (on
//! an S3 store through the fault proxy); SIGSTOP of A past its lease while B takes `s` over,
//! then SIGCONT (and later `s` moves back).
//!
//! The checker, after every step: every write acknowledged before a successful FLUSH (or with
//! FUA) reads back, on a fresh connection, unless a rollback replaced it on purpose; nothing
//! reads as bytes no one wrote; every checkpoint and every fork reads exactly what was flushed
//! before it was requested (or something written after that, before it completed); a node whose
//! lease was taken acknowledges nothing after.
//!
//! `STRATA_NEMESIS_OPS` (default 40; the long run is 2000), `STRATA_NEMESIS_SEED`,
//! `STRATA_NEMESIS_BIN` (another `strata` binary: the mutation check).

// Blocks index several parallel per-block arrays: index loops read clearest.
#![allow(clippy::needless_range_loop)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

#[path = "nemesis/checks.rs"]
mod checks;
#[path = "nemesis/grow.rs"]
mod grow;
#[path = "nemesis/model.rs"]
mod model;
#[path = "nemesis/node.rs"]
mod node;
#[path = "nemesis/ops.rs"]
mod ops;
use model::*;
use node::*;

/// A checkpoint waiting to be verified: its version (or label, if its reply was lost) and what
/// each block may hold.
struct Pending {
    ws: &'static str,
    version: Option<u64>,
    label: String,
    allowed: Vec<Vec<u64>>,
    /// A checkpoint whose client gave up may complete any time before the step ends: its
    /// window is taken then, from these starts.
    open_window: Option<Vec<usize>>,
    /// A fork made of it, to read instead of forking again.
    fork: Option<String>,
}

struct Campaign {
    rng: SmallRng,
    a: Node,
    b: Node,
    token: String,
    tally: Arc<Tally>,
    ws: HashMap<&'static str, Arc<Ws>>,
    /// Which node serves `s` now.
    s_on_b: bool,
    /// Verified checkpoints per workspace: (version, exact content as codes).
    verified: HashMap<&'static str, Vec<(u64, Vec<u64>)>>,
    pending: Vec<Pending>,
    proxy: Option<faultproxy::Proxy>,
    n: u64,
    step: u64,
    takeover: bool,
    /// The largest disk size a grow of each workspace reported: sizes never go down.
    grown: HashMap<&'static str, u64>,
}

impl Campaign {
    fn api_for(&self, ws: &str) -> Api {
        if ws == "s" && self.s_on_b {
            self.b.api(&self.token)
        } else {
            self.a.api(&self.token)
        }
    }

    fn fail(&mut self, msg: String) {
        eprintln!("NEMESIS FAILURE: {msg}");
        lock(&self.tally.failures).push(msg);
    }

    fn count(&mut self, op: &'static str) {
        *lock(&self.tally.ops).entry(op).or_default() += 1;
        eprintln!("nemesis: step {}: {op}", self.step);
    }

    /// One nemesis operation on `name`, while its clients write.
    async fn nemesis(&mut self, step: u64) {
        let name: &'static str = if self.rng.random_bool(0.5) { "d" } else { "s" };
        self.step = step;
        eprintln!("nemesis: step {step} on {name}");
        let w = self.ws[name].clone();
        let api = self.api_for(name);
        let roll = self.rng.random_range(0..100);
        let can_fault = self.proxy.is_some();
        if roll < 16 {
            self.count("checkpoint");
            let starts = lock(&w.model).starts();
            let label = format!("n{step}");
            // Local (returned at the cut, published in the background) or waited for.
            let wait = self.rng.random_bool(0.3);
            let body = if self.rng.random_bool(0.5) {
                json!({"label": label, "wait": wait})
            } else {
                json!({ "wait": wait })
            };
            let (s, v) = api
                .post(&format!("/v1/workspaces/{name}/checkpoint"), body)
                .await;
            let allowed = lock(&w.model).window(&starts);
            if s == StatusCode::OK {
                self.pending.push(Pending {
                    ws: name,
                    version: v["version"].as_u64(),
                    label,
                    allowed,
                    open_window: None,
                    fork: None,
                });
            }
        } else if roll < 21 {
            self.grow(name, &api).await;
        } else if roll < 26 {
            self.count("checkpoint (client cut off)");
            let starts = lock(&w.model).starts();
            let label = format!("n{step}");
            self.post_cut_off(
                &api,
                &format!("/v1/workspaces/{name}/checkpoint"),
                json!({ "label": label, "wait": true }),
            )
            .await;
            // It may still complete: judged at the end of the step, by its label.
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..300))).await;
            self.pending.push(Pending {
                ws: name,
                version: None,
                label,
                allowed: vec![],
                open_window: Some(starts),
                fork: None,
            });
        } else if roll < 36 {
            self.count("fork of the live workspace");
            self.n += 1;
            let fork = format!("f{}", self.n);
            let starts = lock(&w.model).starts();
            let (s, v) = api
                .post(
                    &format!("/v1/workspaces/{name}/fork"),
                    json!({"name": fork}),
                )
                .await;
            let allowed = lock(&w.model).window(&starts);
            if s == StatusCode::CREATED {
                // The fork names the checkpoint it was taken at.
                let version = v["source"]
                    .as_str()
                    .and_then(|s| s.rsplit('@').next())
                    .and_then(|v| v.parse().ok());
                self.pending.push(Pending {
                    ws: name,
                    version,
                    label: String::new(),
                    allowed,
                    open_window: None,
                    fork: Some(fork),
                });
            } else {
                self.fail(format!("fork of {name}: {s} {v}"));
            }
        } else if roll < 44 {
            let Some((version, content)) = self.verified.get(name).and_then(|v| {
                (!v.is_empty()).then(|| v[self.rng.random_range(0..v.len())].clone())
            }) else {
                return;
            };
            self.count("rollback");
            let before = lock(&w.model).before_rollback();
            let (s, v) = api
                .post(
                    &format!("/v1/workspaces/{name}/rollback"),
                    json!({"version": version}),
                )
                .await;
            if s == StatusCode::OK {
                lock(&w.model).rebase(&content, &before);
            } else if s != StatusCode::NOT_FOUND {
                // (A checkpoint retention expired is not found: nothing rolled back.)
                self.fail(format!("rollback of {name} to v{version}: {s} {v}"));
            }
        } else if roll < 54 {
            self.count("detach and attach");
            let (s, v) = api
                .post(&format!("/v1/workspaces/{name}/detach"), json!({}))
                .await;
            if s != StatusCode::OK {
                self.fail(format!("detach of {name}: {s} {v}"));
            }
            w.epoch.fetch_add(1, SeqCst);
            *lock(&w.socket) = attach(&api, name, Duration::from_secs(20)).await;
            w.epoch.fetch_add(1, SeqCst);
        } else if roll < 62 {
            let target = self
                .verified
                .get(name)
                .filter(|v| !v.is_empty() && self.rng.random_bool(0.4))
                .map(|v| v[self.rng.random_range(0..v.len())].clone());
            self.count(if target.is_some() {
                "freeze, rollback, thaw"
            } else {
                "freeze and thaw"
            });
            let (s, _) = api
                .post(&format!("/v1/workspaces/{name}/freeze"), json!({}))
                .await;
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(20..300))).await;
            if let Some((version, content)) = target {
                // Restoring a paired memory snapshot: the disk rolls back inside the pause.
                let before = lock(&w.model).before_rollback();
                let rb = tokio::time::timeout(
                    Duration::from_secs(30),
                    api.post(
                        &format!("/v1/workspaces/{name}/rollback"),
                        json!({"version": version}),
                    ),
                )
                .await;
                match rb {
                    Ok((StatusCode::OK, _)) => lock(&w.model).rebase(&content, &before),
                    Ok((StatusCode::NOT_FOUND, _)) => {}
                    Ok((s, v)) => self.fail(format!("rollback of frozen {name}: {s} {v}")),
                    Err(_) => self.fail(format!("rollback of frozen {name} hung")),
                }
            }
            let (t, _) = api
                .post(&format!("/v1/workspaces/{name}/thaw"), json!({}))
                .await;
            if s != StatusCode::OK || t != StatusCode::OK {
                self.fail(format!("freeze/thaw of {name}: {s} {t}"));
            }
        } else if roll < 68 {
            // Half the passes reconcile (list the store); the others sweep from the catalog.
            let reconcile = self.rng.random_bool(0.5);
            self.count(if reconcile {
                "gc pass (grace 2s, compaction), listing the store"
            } else {
                "gc pass (grace 2s, compaction), from the catalog"
            });
            // A pass lists and deletes through the store: give it longer than other calls.
            let t0 = Instant::now();
            let admin = Api::with_timeout(&self.a.url, ADMIN, Duration::from_secs(300));
            let (s, v) = admin
                .post("/v1/gc", json!({ "reconcile": reconcile }))
                .await;
            if s != StatusCode::OK {
                self.fail(format!("gc: {s} {v} after {:?}", t0.elapsed()));
            } else if t0.elapsed() > Duration::from_secs(10) {
                eprintln!("nemesis: a gc pass took {:?}: {v}", t0.elapsed());
            }
        } else if roll < 72 {
            self.count("delete a busy tenant");
            self.delete_busy_tenant().await;
        } else if roll < 80 {
            self.count("kill -9 and restart");
            if self.rng.random_bool(0.5) {
                // A local checkpoint just before the kill: its publication is cut short at a
                // random point and must resume after the restart, with exactly its content.
                self.count("local checkpoint, then kill -9");
                let on_a = if name == "s" && self.s_on_b {
                    "d"
                } else {
                    name
                };
                let w = self.ws[on_a].clone();
                let starts = lock(&w.model).starts();
                let (s, v) = self
                    .a
                    .api(&self.token)
                    .post(&format!("/v1/workspaces/{on_a}/checkpoint"), json!({}))
                    .await;
                let allowed = lock(&w.model).window(&starts);
                if s == StatusCode::OK {
                    self.pending.push(Pending {
                        ws: on_a,
                        version: v["version"].as_u64(),
                        label: format!("n{step}"),
                        allowed,
                        open_window: None,
                        fork: None,
                    });
                }
            }
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..200))).await;
            drop(self.a.daemon.take()); // SIGKILL
            for w in self.ws.values() {
                if w.name == "d" || !self.s_on_b {
                    w.epoch.fetch_add(1, SeqCst);
                }
            }
            self.a.restart();
            let a = self.a.api(&self.token);
            for (ws, on_a) in [("d", true), ("s", !self.s_on_b)] {
                if on_a {
                    let w = self.ws[ws].clone();
                    *lock(&w.socket) = attach(&a, ws, Duration::from_secs(20)).await;
                    w.epoch.fetch_add(1, SeqCst);
                }
            }
        } else if roll < 86 && can_fault {
            self.count("object-store faults");
            if let Some(p) = &self.proxy {
                p.set(&faultproxy::ALL, 0.2);
            }
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(200..800))).await;
            let _ = api
                .post(&format!("/v1/workspaces/{name}/checkpoint"), json!({}))
                .await;
            if let Some(p) = &self.proxy {
                p.set(&[], 0.0);
            }
        } else if !self.takeover {
            self.count("checkpoint");
            let _ = api
                .post(&format!("/v1/workspaces/{name}/checkpoint"), json!({}))
                .await;
        } else if !self.s_on_b {
            self.count("SIGSTOP past the lease, takeover by B");
            self.takeover().await;
        } else {
            self.count("move back from B");
            let w = self.ws["s"].clone();
            let b = self.b.api(&self.token);
            let (s, v) = b.post("/v1/workspaces/s/detach", json!({})).await;
            if s != StatusCode::OK {
                self.fail(format!("detach of s on B: {s} {v}"));
            }
            w.epoch.fetch_add(1, SeqCst);
            self.s_on_b = false;
            *lock(&w.socket) = attach(&self.a.api(&self.token), "s", Duration::from_secs(20)).await;
            w.epoch.fetch_add(1, SeqCst);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis() {
    let ops: u64 = std::env::var("STRATA_NEMESIS_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let seed: u64 = std::env::var("STRATA_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("nemesis: seed {seed} (STRATA_NEMESIS_SEED={seed} reproduces), {ops} operations");
    let d = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (d.path().join("a"), d.path().join("b"));
    std::fs::create_dir_all(&data_a).unwrap();
    // The store: S3 through the fault proxy when there is an S3 server, else A's directory.
    let s3 = std::env::var("STRATA_TEST_S3_ENDPOINT")
        .ok()
        .filter(|s| !s.is_empty());
    if s3.is_none() {
        assert!(
            std::env::var("STRATA_REQUIRE_S3").as_deref() != Ok("1"),
            "STRATA_REQUIRE_S3=1 but no endpoint"
        );
        eprintln!("NEMESIS: no S3 server (STRATA_TEST_S3_ENDPOINT): object-store faults are NOT exercised");
    }
    let (store, proxy, env) = match &s3 {
        Some(ep) => {
            let bucket = format!("nemesis-{}-{seed}", std::process::id());
            create_bucket(ep, &bucket);
            let proxy = faultproxy::start(ep, seed).await;
            let url = format!(
                "s3://{bucket}/strata?endpoint={}&region=us-east-1&allow_http=true&timeout_ms=5000&retries=3",
                proxy.url
            );
            let env: Vec<(String, String)> = S3_ENV
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (url, Some(proxy), env)
        }
        None => (
            format!("file:{}", data_a.join("objects").display()),
            None,
            vec![],
        ),
    };
    // The catalog: PostgreSQL when there is a server (two nodes share it as in production);
    // else A's SQLite file, where a paused node can hold the file's lock, so the takeover is
    // left out.
    let pg = std::env::var("STRATA_TEST_PG")
        .ok()
        .filter(|s| !s.is_empty());
    let catalog = match &pg {
        Some(pg) => {
            strata_catalog::create_database(pg, &format!("strata_nem{}x{seed}", std::process::id()))
                .await
                .unwrap()
        }
        None => {
            assert!(
                std::env::var("STRATA_REQUIRE_PG").as_deref() != Ok("1"),
                "STRATA_REQUIRE_PG=1 but STRATA_TEST_PG is unset"
            );
            eprintln!(
                "NEMESIS: no PostgreSQL (STRATA_TEST_PG): the SIGSTOP takeover is NOT exercised"
            );
            format!("sqlite:{}", data_a.join("catalog.db").display())
        }
    };
    let common: Vec<String> = [
        "--catalog",
        &catalog,
        "--store",
        &store,
        "--gc-grace",
        "2s",
        "--gc-interval",
        "off",
        "--keep-checkpoints",
        "6",
        "--compact-below",
        "0.9",
        "--upload-interval",
        "500ms",
        "--segment-size",
        "1MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut a_args = common.clone();
    a_args.extend(["--node-id".into(), "node-a".into()]);
    let mut b_args = common;
    b_args.extend(["--node-id".into(), "node-b".into()]);
    let a = Node::start(&data_a, a_args, env.clone());
    let b = Node::start(&data_b, b_args, env);
    let t = tenant(&a.url, "nem").await;
    let mut ws = HashMap::new();
    for (name, mode) in [("d", "durable"), ("s", "sync")] {
        let (s, v) = t
            .post(
                "/v1/workspaces",
                json!({"name": name, "size": DISK, "mode": mode}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let sock = attach(&t, name, Duration::from_secs(10)).await;
        assert!(sock.is_some());
        ws.insert(
            name,
            Arc::new(Ws {
                name,
                model: Mutex::new(Model::new()),
                socket: Mutex::new(sock),
                epoch: AtomicU64::new(1),
            }),
        );
    }
    let mut c = Campaign {
        rng: SmallRng::seed_from_u64(seed),
        a,
        b,
        token: t.token.clone(),
        tally: Arc::new(Tally::default()),
        ws,
        s_on_b: false,
        verified: HashMap::new(),
        pending: vec![],
        proxy,
        n: 0,
        step: 0,
        takeover: pg.is_some(),
        grown: HashMap::new(),
    };
    let started = Instant::now();
    for step in 0..ops {
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = vec![];
        for w in c.ws.values() {
            for id in 0..CLIENTS {
                clients.push(tokio::spawn(client(
                    w.clone(),
                    id,
                    seed ^ (step << 8) ^ (id << 4) ^ (w.name == "s") as u64,
                    stop.clone(),
                    c.tally.clone(),
                )));
            }
        }
        tokio::time::sleep(Duration::from_millis(c.rng.random_range(20..200))).await;
        c.nemesis(step).await;
        tokio::time::sleep(Duration::from_millis(c.rng.random_range(20..200))).await;
        stop.store(true, SeqCst);
        for h in clients {
            if tokio::time::timeout(Duration::from_secs(60), h)
                .await
                .is_err()
            {
                c.fail("a client hung for 60 s".into());
            }
        }
        c.check().await;
        if !lock(&c.tally.failures).is_empty() {
            break;
        }
        // Running figures, so that a long run cut short still reports what it checked.
        if (step + 1) % 100 == 0 {
            let t = &c.tally;
            eprintln!(
                "nemesis: after {} steps ({:.0} s): {} operations, {} writes covered by a FLUSH or FUA checked, {} block reads verified, {} lost, {} wrong",
                step + 1,
                started.elapsed().as_secs_f64(),
                lock(&t.ops).values().sum::<u64>(),
                t.flushed_writes.load(SeqCst),
                t.verified.load(SeqCst),
                t.lost.load(SeqCst),
                t.wrong.load(SeqCst)
            );
        }
    }
    let t = &c.tally;
    let ops = lock(&t.ops).clone();
    let mut kinds: Vec<_> = ops.iter().collect();
    kinds.sort();
    eprintln!(
        "nemesis: {} operations in {:.0} s (seed {seed}): {kinds:?}; {} writes and {} flushes acknowledged, {} writes covered by a FLUSH or FUA and checked; {} block reads verified; {} flushed writes lost, {} wrong reads",
        ops.values().sum::<u64>(),
        started.elapsed().as_secs_f64(),
        t.writes_acked.load(SeqCst),
        t.flushes.load(SeqCst),
        t.flushed_writes.load(SeqCst),
        t.verified.load(SeqCst),
        t.lost.load(SeqCst),
        t.wrong.load(SeqCst)
    );
    if let Some(p) = &c.proxy {
        eprintln!("nemesis: fault proxy: {}", p.counts.summary());
    }
    let failures = lock(&t.failures);
    assert!(failures.is_empty(), "seed {seed}: {}", failures.join("\n"));
}

use common::faultproxy;
