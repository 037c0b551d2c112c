//! Retention and garbage collection against a model: random interleavings of writes,
//! checkpoints (labelled or not), forks, rollbacks, deletes, retention and GC passes over
//! several workspaces. After every step, every head and every retained checkpoint reads back
//! exactly as the model says, through a fresh node with an empty cache (so only the object
//! store counts); after quiescence no unreferenced key remains. A second test interrupts a GC
//! pass at every one of its steps.
//!
//! `STRATA_GC_CASES` (default 12) and `STRATA_GC_SEED` pick the cases.

/// Issue 46: the mark and the sweep from the catalog's record; reconciliation passes.
#[path = "gc/catalog.rs"]
mod catalog;
mod common;
/// Compaction of workspaces detached everywhere.
#[path = "gc/compaction.rs"]
mod compaction;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use strata_engine::{Engine, GcOptions, Mode, Source};

const DISK: u64 = 1 << 20;
const LBAS: u64 = 24;

type Disk = BTreeMap<u64, u64>;

#[derive(Default)]
struct Model {
    heads: BTreeMap<String, Disk>,
    cps: BTreeMap<(String, u64), Disk>,
}

/// Retention keeps `keep` versions of each class (made by users, automatic).
fn gc_opts(keep: usize) -> GcOptions {
    GcOptions {
        grace: Duration::ZERO,
        keep_last: keep,
        keep_auto: keep,
        max_age: Duration::from_secs(3600),
        dry_run: false,
        // Listing the store finds what the catalog does not know; the campaigns also run
        // passes without it (the incremental sweep).
        reconcile: true,
        stop_after: None,
        compact_below: Some(0.5),
        // Detached workspaces too, at once: the campaigns detach and re-attach them.
        compact_detached_after: Some(Duration::ZERO),
    }
}

/// Reads `ws` (head or `version`) through a brand-new node: nothing cached, only the store.
async fn read_fresh(c: &Cluster, ws: &str, version: Option<u64>, n: u32) -> Disk {
    let verifier = c.node(&format!("verifier-{n}"));
    let out = c.path(&format!("export-{n}.raw"));
    verifier
        .export(TENANT, ws, version, &out)
        .await
        .unwrap_or_else(|e| panic!("{ws}@{version:?} unreadable: {e}"));
    let img = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    let _ = std::fs::remove_dir_all(c.path(&format!("verifier-{n}")));
    let mut d = Disk::new();
    for lba in 0..LBAS {
        let b = &img[(lba * 4096) as usize..((lba + 1) * 4096) as usize];
        match tag_of(b, lba) {
            Some(0) => {}
            Some(t) => {
                d.insert(lba, t);
            }
            None => panic!("{ws}@{version:?}: block {lba} is torn or foreign"),
        }
    }
    d
}

/// Syncs retained checkpoints with the catalog (retention may have expired some) and checks
/// every head and checkpoint against the model.
async fn check(
    c: &Cluster,
    node: &Arc<Engine>,
    m: &mut Model,
    labelled: &BTreeSet<(String, u64)>,
    n: &mut u32,
) {
    for ws in m.heads.keys().cloned().collect::<Vec<_>>() {
        // A live fork's version 1 is only its source's base (never read as a disk).
        let listed: BTreeSet<u64> = node
            .log(TENANT, &ws)
            .await
            .unwrap()
            .iter()
            .filter(|c| c.kind != strata_catalog::CheckpointKind::LiveFork)
            .map(|c| c.version)
            .collect();
        let head = node.workspace(TENANT, &ws).await.unwrap().head_version;
        assert!(listed.contains(&head), "{ws}: the head is never expired");
        let mine: Vec<u64> = m
            .cps
            .keys()
            .filter(|(w, _)| *w == ws)
            .map(|(_, v)| *v)
            .collect();
        for v in mine {
            if !listed.contains(&v) {
                assert!(
                    !labelled.contains(&(ws.clone(), v)),
                    "{ws}@{v}: a labelled checkpoint without expiry was expired"
                );
                m.cps.remove(&(ws.clone(), v));
            }
        }
        for v in &listed {
            assert!(
                m.cps.contains_key(&(ws.clone(), *v)),
                "{ws}@{v} unknown to the model"
            );
        }
        // The attached volume (journal over the head) reads as the model's head …
        if let Some(vol) = node.volume(TENANT, &ws) {
            for lba in 0..LBAS {
                let b = vol.read(lba * 4096, 4096).await.unwrap();
                let want = m.heads[&ws].get(&lba).copied().unwrap_or(0);
                assert_eq!(tag_of(&b, lba), Some(want), "{ws} block {lba}");
            }
        }
    }
    // … and every retained version (the published head among them) from the store alone.
    for ((ws, v), disk) in m.cps.clone() {
        *n += 1;
        assert_eq!(read_fresh(c, &ws, Some(v), *n).await, disk, "{ws}@{v}");
    }
}

/// Every store key of the tenant is referenced (after quiescence with grace 0).
async fn no_garbage(c: &Cluster) {
    let refs = c.catalog.gc_references(TENANT, 0).await.unwrap();
    let mut live: HashSet<String> = HashSet::new();
    for m in refs {
        live.insert(format!("t/{TENANT}/man/{}", m.to_hex()));
        for o in c.store.get_manifest(TENANT, &m).await.unwrap().objects {
            let h = o.id.to_hex();
            live.insert(format!("t/{TENANT}/obj/{}/{h}", &h[..2]));
        }
    }
    let prefix = object_store::path::Path::from(format!("t/{TENANT}"));
    let keys: Vec<String> = c
        .store
        .default_inner()
        .list(Some(&prefix))
        .map(|m| m.unwrap().location.to_string())
        .collect()
        .await;
    let garbage: Vec<&String> = keys.iter().filter(|k| !live.contains(*k)).collect();
    assert!(garbage.is_empty(), "unreferenced keys remain: {garbage:?}");
    for k in &live {
        assert!(keys.contains(k), "referenced key {k} is missing");
    }
    // The catalog's record of manifests and objects shrinks with the store: rows of deleted
    // keys are pruned, so it names exactly what is live.
    let (mans, objs) = c.catalog.recorded_references(TENANT).await.unwrap();
    let live_mans = live.iter().filter(|k| k.contains("/man/")).count() as u64;
    assert_eq!(
        (mans, objs),
        (live_mans, live.len() as u64 - live_mans),
        "catalog rows (manifests, objects) against live keys"
    );
}

/// Versions a GC pass's own compactions published (the attached volumes' heads, rewritten):
/// each holds what the version before it held.
async fn adopt_compactions(node: &Arc<Engine>, m: &mut Model) {
    for ws in m.heads.keys() {
        for cp in node.log(TENANT, ws).await.unwrap() {
            let key = (ws.clone(), cp.version);
            if cp.kind != strata_catalog::CheckpointKind::Compact || m.cps.contains_key(&key) {
                continue;
            }
            let before = m
                .cps
                .get(&(ws.clone(), cp.version - 1))
                .unwrap_or_else(|| {
                    panic!("{ws}@{}: a compaction of an unknown version", cp.version)
                })
                .clone();
            m.cps.insert(key, before);
        }
    }
}

async fn run_case(seed: u64) {
    let c = Cluster::new().await;
    let node = c.node("a");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut m = Model::default();
    let mut labelled = BTreeSet::new();
    let mut n = 0u32;
    let mut next_ws = 0;
    let mut new_ws = |m: &mut Model| {
        next_ws += 1;
        let name = format!("w{next_ws}");
        m.heads.insert(name.clone(), Disk::new());
        name
    };
    for _ in 0..2 {
        let w = new_ws(&mut m);
        node.create_workspace(
            TENANT,
            &w,
            Source::Empty { size: DISK },
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        node.attach(TENANT, &w).await.unwrap();
        m.cps.insert((w, 1), Disk::new());
    }
    let steps = rng.random_range(12..28);
    for step in 0..steps {
        let names: Vec<String> = m.heads.keys().cloned().collect();
        let ws = names[rng.random_range(0..names.len())].clone();
        let op = rng.random_range(0..100);
        let what;
        if op < 35 {
            let vol = node.volume(TENANT, &ws).unwrap();
            for _ in 0..rng.random_range(1..6) {
                let lba = rng.random_range(0..LBAS);
                let tag = rng.random_range(1..1_000_000u64);
                vol.write(lba * 4096, &tagged(tag, lba), false)
                    .await
                    .unwrap();
                m.heads.get_mut(&ws).unwrap().insert(lba, tag);
            }
            what = "write";
        } else if op < 50 {
            let label = rng.random_bool(0.3).then(|| "keep".to_string());
            let p = node.checkpoint(TENANT, &ws, label.clone()).await.unwrap();
            m.cps.insert((ws.clone(), p.version), m.heads[&ws].clone());
            if label.is_some() {
                labelled.insert((ws.clone(), p.version));
            }
            what = "checkpoint";
        } else if op < 58 {
            let head = node.workspace(TENANT, &ws).await.unwrap().head_version;
            let t = [0.3, 0.7, 1.0][rng.random_range(0..3)];
            if let Some(p) = node.compact(TENANT, &ws, t).await.unwrap() {
                let disk = m.cps[&(ws.clone(), head)].clone();
                m.cps.insert((ws.clone(), p.version), disk);
            }
            what = "compact";
        } else if op < 66 && m.heads.len() < 5 {
            let before = m.heads[&ws].clone();
            let f = new_ws(&mut m);
            let w = node.fork(TENANT, &ws, None, &f, None).await.unwrap();
            node.attach(TENANT, &f).await.unwrap();
            // The fork is of a local checkpoint of the source (named by its source), published in
            // the background; a live fork's own data becomes its version 2.
            let from: u64 = w.source.rsplit('@').next().unwrap().parse().unwrap();
            let src = node.volume(TENANT, &ws).unwrap();
            src.published(from).await.unwrap();
            m.cps
                .entry((ws.clone(), from))
                .or_insert_with(|| before.clone());
            let first = node.log(TENANT, &f).await.unwrap()[0].kind;
            let own = if first == strata_catalog::CheckpointKind::LiveFork {
                let t = std::time::Instant::now();
                while node.workspace(TENANT, &f).await.unwrap().head_version < 2 {
                    assert!(t.elapsed() < Duration::from_secs(30), "{f} never published");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                2
            } else {
                1
            };
            m.heads.insert(f.clone(), before.clone());
            m.cps.insert((f.clone(), own), before);
            what = "fork";
        } else if op < 76 {
            let mine: Vec<u64> = m
                .cps
                .keys()
                .filter(|(w, _)| *w == ws)
                .map(|(_, v)| *v)
                .collect();
            let target = mine[rng.random_range(0..mine.len())];
            let before = m.heads[&ws].clone();
            let old_head = node.workspace(TENANT, &ws).await.unwrap().head_version;
            let p = node.rollback(TENANT, &ws, target).await.unwrap();
            // Local when its target was (published in order right after): checked from the
            // store once published.
            let p = node
                .volume(TENANT, &ws)
                .unwrap()
                .published(p.version)
                .await
                .unwrap();
            for v in old_head + 1..p.version {
                m.cps.insert((ws.clone(), v), before.clone()); // the publish before the rollback
            }
            let disk = m.cps[&(ws.clone(), target)].clone();
            m.cps.insert((ws.clone(), p.version), disk.clone());
            m.heads.insert(ws.clone(), disk);
            what = "rollback";
        } else if op < 81 && m.heads.len() > 1 {
            node.delete_workspace(TENANT, &ws).await.unwrap();
            m.heads.remove(&ws);
            m.cps.retain(|(w, _), _| *w != ws);
            what = "delete";
        } else {
            let opts = GcOptions {
                keep_auto: rng.random_range(0..3),
                reconcile: rng.random_bool(0.5),
                ..gc_opts(rng.random_range(0..3))
            };
            let r = node.gc(&opts).await.unwrap();
            assert!(!r.stopped);
            adopt_compactions(&node, &mut m).await;
            what = "gc";
        }
        if std::env::var("STRATA_GC_TRACE").is_ok() {
            eprintln!("seed {seed} step {step}: {what} {ws}");
        }
        check(&c, &node, &mut m, &labelled, &mut n).await;
    }
    // Quiescence: nothing left to publish, then passes until one finds nothing to do (a pass
    // applies retention and compacts, the next two condemn and delete what it released; a
    // compaction that gave way to a cut being published runs in a later pass).
    for w in m.heads.keys() {
        if let Some(v) = node.volume(TENANT, w) {
            v.published(v.stats().head_version + v.stats().pending_versions)
                .await
                .unwrap();
        }
    }
    let mut idle = 0;
    for _ in 0..12 {
        let r = node.gc(&gc_opts(1)).await.unwrap();
        adopt_compactions(&node, &mut m).await;
        let busy = r.compactions + r.condemned + r.deleted_keys + r.checkpoints_expired;
        idle = if busy == 0 { idle + 1 } else { 0 };
        if idle == 2 {
            break;
        }
    }
    check(&c, &node, &mut m, &labelled, &mut n).await;
    no_garbage(&c).await;
    let dry = node
        .gc(&GcOptions {
            dry_run: true,
            ..gc_opts(1)
        })
        .await
        .unwrap();
    assert_eq!(dry.unreferenced_keys, 0, "{dry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_and_retention_never_lose_a_retained_byte() {
    let cases: u64 = std::env::var("STRATA_GC_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let first: u64 = std::env::var("STRATA_GC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for seed in first..first + cases {
        run_case(seed).await;
    }
}

/// A workspace with history, a fork, a deleted workspace and expired checkpoints: plenty for
/// GC to do.
async fn scenario(c: &Cluster, node: &Arc<Engine>) -> Model {
    let mut m = Model::default();
    for w in ["keep", "gone"] {
        node.create_workspace(TENANT, w, Source::Empty { size: DISK }, Mode::Durable, None)
            .await
            .unwrap();
        let v = node.attach(TENANT, w).await.unwrap();
        let mut disk = Disk::new();
        for round in 1..=4u64 {
            for lba in 0..8 {
                v.write(lba * 4096, &tagged(round * 100 + lba, lba), false)
                    .await
                    .unwrap();
                disk.insert(lba, round * 100 + lba);
            }
            let label = (round == 2).then(|| "milestone".to_string());
            let p = node.checkpoint(TENANT, w, label).await.unwrap();
            m.cps.insert((w.to_string(), p.version), disk.clone());
        }
        m.cps.insert((w.to_string(), 1), Disk::new());
        m.heads.insert(w.to_string(), disk);
    }
    node.fork(TENANT, "keep", Some(3), "child", None)
        .await
        .unwrap();
    m.heads
        .insert("child".into(), m.cps[&("keep".to_string(), 3)].clone());
    m.cps
        .insert(("child".into(), 1), m.cps[&("keep".to_string(), 3)].clone());
    node.delete_workspace(TENANT, "gone").await.unwrap();
    m.heads.remove("gone");
    m.cps.retain(|(w, _), _| w != "gone");
    let _ = c;
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gc_pass_interrupted_at_any_step_leaves_everything_readable() {
    let mut k = 0;
    loop {
        let c = Cluster::new().await;
        let node = c.node("a");
        let mut m = scenario(&c, &node).await;
        let labelled: BTreeSet<(String, u64)> = [("keep".to_string(), 3)].into();
        // A first full pass condemns; the interrupted pass is the one that deletes.
        node.gc(&gc_opts(0)).await.unwrap();
        let r = node
            .gc(&GcOptions {
                stop_after: Some(k),
                ..gc_opts(0)
            })
            .await
            .unwrap();
        let mut n = 0;
        check(&c, &node, &mut m, &labelled, &mut n).await;
        // The next passes finish the job.
        for _ in 0..3 {
            node.gc(&gc_opts(0)).await.unwrap();
        }
        check(&c, &node, &mut m, &labelled, &mut n).await;
        no_garbage(&c).await;
        if !r.stopped {
            eprintln!("interrupted GC: {k} stop points checked");
            assert!(k > 5, "the pass has several steps");
            break;
        }
        k += 1;
    }
}

/// Under random overwrites, compaction keeps stored bytes proportional to live data once
/// retention and GC release the old objects, and manifests stay bounded by the disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_keeps_storage_proportional_to_live_data() {
    let c = Cluster::new().await;
    let node = c.node("a");
    node.create_workspace(
        TENANT,
        "hot",
        Source::Empty { size: 4 << 20 },
        Mode::Durable,
        None,
    )
    .await
    .unwrap();
    let v = node.attach(TENANT, "hot").await.unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let blocks = (4u64 << 20) / 4096;
    let mut disk = Disk::new();
    for round in 0..12u64 {
        for _ in 0..256 {
            let lba = rng.random_range(0..blocks);
            let tag = round * 10_000 + lba + 1;
            v.write(lba * 4096, &tagged(tag, lba), false).await.unwrap();
            disk.insert(lba, tag);
        }
        node.checkpoint(TENANT, "hot", None).await.unwrap();
        node.gc(&gc_opts(1)).await.unwrap();
    }
    for _ in 0..3 {
        node.gc(&gc_opts(0)).await.unwrap();
    }
    let r = node
        .gc(&GcOptions {
            dry_run: true,
            ..gc_opts(0)
        })
        .await
        .unwrap();
    let head = c
        .store
        .get_manifest(
            TENANT,
            &node.workspace(TENANT, "hot").await.unwrap().head_manifest,
        )
        .await
        .unwrap();
    let live: u64 = head.extents.iter().map(|e| e.len as u64 * 4096).sum();
    let ratio = r.stored_bytes as f64 / live as f64;
    eprintln!(
        "after compaction: stored {} B for {} live B ({ratio:.2}x), {} objects, {} extents",
        r.stored_bytes,
        live,
        head.objects.len(),
        head.extents.len()
    );
    assert!(ratio < 2.0, "stored/live {ratio:.2}");
    // The data is intact, read from the store alone.
    let v = node.workspace(TENANT, "hot").await.unwrap().head_version;
    let verifier = c.node("verifier");
    let out = c.path("hot.raw");
    verifier.export(TENANT, "hot", Some(v), &out).await.unwrap();
    let img = std::fs::read(&out).unwrap();
    for (lba, tag) in &disk {
        let b = &img[(*lba * 4096) as usize..(*lba as usize + 1) * 4096];
        assert_eq!(tag_of(b, *lba), Some(*tag));
    }
}

/// GC passes on two nodes run continuously while a third writes, checkpoints and forks: with a
/// short grace period nothing retained is ever lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_two_nodes_overlapping_checkpoints_and_forks_loses_nothing() {
    let c = Cluster::new().await;
    let grace = Duration::from_millis(300);
    let mut cfg = c.config("w");
    cfg.gc_grace = grace; // publishes give up past 150 ms
    let writer = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut gcs = vec![];
    for n in ["g1", "g2"] {
        let (node, stop) = (c.node(n), stop.clone());
        gcs.push(tokio::spawn(async move {
            let mut passes = 0u64;
            let mut deleted = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = node
                    .gc(&GcOptions {
                        grace,
                        keep_last: 1,
                        compact_below: None,
                        reconcile: passes.is_multiple_of(2),
                        ..gc_opts(1)
                    })
                    .await
                    .unwrap();
                passes += 1;
                deleted += r.deleted_keys;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (passes, deleted)
        }));
    }
    let mut m = Model::default();
    let mut labelled = BTreeSet::new();
    writer
        .create_workspace(
            TENANT,
            "w",
            Source::Empty { size: DISK },
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
    let v = writer.attach(TENANT, "w").await.unwrap();
    m.heads.insert("w".into(), Disk::new());
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    let t0 = std::time::Instant::now();
    let mut i = 0u64;
    while t0.elapsed() < Duration::from_secs(3) {
        i += 1;
        for _ in 0..4 {
            let lba = rng.random_range(0..LBAS);
            v.write(lba * 4096, &tagged(i * 100 + lba, lba), false)
                .await
                .unwrap();
            m.heads.get_mut("w").unwrap().insert(lba, i * 100 + lba);
        }
        let label = i.is_multiple_of(5).then(|| format!("l{i}"));
        let p = writer.checkpoint(TENANT, "w", label.clone()).await.unwrap();
        m.cps.insert(("w".into(), p.version), m.heads["w"].clone());
        if label.is_some() {
            labelled.insert(("w".to_string(), p.version));
        }
        if i.is_multiple_of(7) {
            // Fork an older retained version while GC may be expiring it.
            let f = format!("f{i}");
            let listed = writer.log(TENANT, "w").await.unwrap();
            let from = listed[rng.random_range(0..listed.len())].version;
            if writer.fork(TENANT, "w", Some(from), &f, None).await.is_ok() {
                let disk = m.cps[&("w".to_string(), from)].clone();
                m.heads.insert(f.clone(), disk.clone());
                m.cps.insert((f.clone(), 1), disk);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = (0, 0);
    for g in gcs {
        let (p, d) = g.await.unwrap();
        total = (total.0 + p, total.1 + d);
    }
    eprintln!(
        "{i} checkpoints while two nodes ran {} GC passes deleting {} keys",
        total.0, total.1
    );
    assert!(total.1 > 0, "GC did delete while checkpoints ran");
    let mut n = 0;
    check(&c, &writer, &mut m, &labelled, &mut n).await;
}

/// The staged file of a put that a crash interrupted (`{key}#{digits}`, which listings skip) is
/// swept by a pass once older than the grace period; a fresh one (a put in progress) stays, and
/// so does every object.
#[tokio::test]
async fn a_pass_sweeps_the_staged_files_a_crash_left() {
    let c = Cluster::new().await;
    let node = c.node("a");
    let v = empty_volume(&node, "ws", 1 << 20, Mode::Durable).await;
    write_tag(&v, 1, 0, 8).await;
    v.checkpoint(None).await.unwrap();
    let dir = c.path(&format!("objects/t/{TENANT}/obj"));
    std::fs::create_dir_all(dir.join("zz")).unwrap();
    let (old, fresh) = (dir.join("zz/abc#123"), dir.join("zz/abd#456"));
    std::fs::write(&old, b"half a put").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(7200))
        .unwrap();
    std::fs::write(&fresh, b"a put in progress").unwrap();
    let objects = || {
        let mut n = 0;
        let mut dirs = vec![c.path("objects")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    dirs.push(e.path());
                } else if !e.file_name().to_string_lossy().contains('#') {
                    n += 1;
                }
            }
        }
        n
    };
    let before = objects();
    let mut opts = gc_opts(1);
    opts.grace = Duration::from_secs(3600);
    let r = node.gc(&opts).await.unwrap();
    assert_eq!(r.staged_removed, 1);
    assert!(!old.exists() && fresh.exists());
    assert_eq!(objects(), before, "an object went with the staged files");
    assert_eq!(image(&v).await[..8], [1; 8]);
    // A dry run removes nothing.
    opts.dry_run = true;
    opts.grace = Duration::ZERO;
    assert_eq!(node.gc(&opts).await.unwrap().staged_removed, 0);
    assert!(fresh.exists());
}
