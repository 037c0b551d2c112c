//! Local checkpoints: taken at the cut, durable on the node, published later in order.
//!
//! - The receipt is `local` with its version reserved; reads see every layer; publication
//!   commits exactly the reserved versions, each with exactly the data of its cut.
//! - Power loss at a random moment while cuts are being published (a process handle of the
//!   simulated disk dies with the power, so a publish still running stops at its next file
//!   operation: before, during or after its upload, before or after its head CAS): after
//!   recovery every local checkpoint is published with exactly its content, and the disk is a
//!   state at or after the last flush or local checkpoint.
//! - A rollback to a version still local is taken at once (a `local` receipt) and reads as
//!   that version; it survives power loss like a checkpoint and publishes as a `rollback`
//!   version with exactly the target's data.
//! - A head CAS whose reply was lost is adopted, not published twice.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_catalog::CheckpointKind;
use strata_engine::{CheckpointState, Engine, Mode};
use strata_simfs::SimFs;

const BLOCKS: u64 = 64;
const DISK: u64 = BLOCKS * 4096;

/// The image of `version` of `ws`, read through a fork attached on `node`.
async fn version_image(node: &Arc<Engine>, ws: &str, version: u64, fork: &str) -> Vec<u64> {
    node.fork(TENANT, ws, Some(version), fork, None)
        .await
        .unwrap();
    let f = node.attach(TENANT, fork).await.unwrap();
    let img = image(&f).await;
    node.detach(TENANT, fork).await.unwrap();
    node.delete_workspace(TENANT, fork).await.unwrap();
    img
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_checkpoint_is_taken_at_the_cut_and_published_in_order() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 16).await;
    let p2 = a
        .checkpoint_with(TENANT, "w", Some("first".into()), None, false)
        .await
        .unwrap();
    assert_eq!((p2.version, p2.state), (2, CheckpointState::Local));
    assert!(p2.manifest.is_none(), "a local receipt names no manifest");
    let img2 = image(&v).await;
    write_tag(&v, 2, 8, 16).await;
    let p3 = a
        .checkpoint_with(TENANT, "w", None, None, false)
        .await
        .unwrap();
    assert_eq!((p3.version, p3.state), (3, CheckpointState::Local));
    let img3 = image(&v).await;
    write_tag(&v, 3, 0, 4).await;
    let now = image(&v).await;
    assert_eq!(&now[..4], &[3; 4]);
    assert_eq!(&now[4..8], &[1; 4]);
    assert_eq!(&now[8..24], &[2; 16]);
    // Waiting for a version publishes everything before it, in order.
    let p = v.published(3).await.unwrap();
    assert_eq!(p.state, CheckpointState::Published);
    assert!(p.manifest.is_some());
    let log = a.log(TENANT, "w").await.unwrap();
    let kinds: Vec<(u64, CheckpointKind, Option<String>)> = log
        .iter()
        .map(|c| (c.version, c.kind, c.label.clone()))
        .collect();
    assert_eq!(
        kinds[1..],
        [
            (2, CheckpointKind::Checkpoint, Some("first".into())),
            (3, CheckpointKind::Checkpoint, None)
        ]
    );
    assert_eq!(v.stats().pending_versions, 0);
    assert_eq!(version_image(&a, "w", 2, "f2").await, img2);
    assert_eq!(version_image(&a, "w", 3, "f3").await, img3);
    // Two cuts with no write between them: two versions with the same data.
    let q4 = v.checkpoint_with(None, None, false).await.unwrap();
    let q5 = v.checkpoint_with(None, None, false).await.unwrap();
    assert_eq!((q4.version, q5.version), (4, 5));
    assert_eq!(q4.cut_seq, q5.cut_seq);
    // A fork (and a rollback) of a local version waits for its publication.
    assert_eq!(version_image(&a, "w", 5, "f5").await, now);
    let r = a.rollback(TENANT, "w", 2).await.unwrap();
    assert_eq!(image(&v).await, img2);
    assert_eq!(
        r.version, 6,
        "nothing was written after v5: no version before the rollback"
    );
    a.detach(TENANT, "w").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_to_a_local_checkpoint_is_immediate_and_publishes_in_order() {
    let c = Cluster::new().await;
    let lossy = common::faults::LossyCatalog::new(c.catalog.clone());
    let a = Engine::open_with(
        c.config("a"),
        lossy.clone(),
        c.store.clone(),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    // Nothing publishes (every publish fails before its head CAS): every version below stays
    // local until the catalog answers again.
    lossy.refuse_manifests.store(true, SeqCst);
    write_tag(&v, 1, 0, 16).await;
    let p2 = v.checkpoint_with(None, None, false).await.unwrap();
    let img2 = image(&v).await;
    write_tag(&v, 2, 8, 16).await;
    let p3 = v.checkpoint_with(None, None, false).await.unwrap();
    let img3 = image(&v).await;
    write_tag(&v, 3, 0, 4).await;
    let before = image(&v).await;
    let r = a.rollback(TENANT, "w", p2.version).await.unwrap();
    assert_eq!((r.version, r.state), (5, CheckpointState::Local));
    assert_eq!(image(&v).await, img2, "reads are v2's at once");
    // Writes go on top of the rolled-back disk; a rollback to a rollback nests.
    write_tag(&v, 4, 30, 2).await;
    let mut after = img2.clone();
    after[30..32].fill(4);
    assert_eq!(image(&v).await, after);
    let r2 = a.rollback(TENANT, "w", p3.version).await.unwrap();
    assert_eq!((r2.version, r2.state), (7, CheckpointState::Local));
    assert_eq!(image(&v).await, img3);
    let r3 = a.rollback(TENANT, "w", r.version).await.unwrap();
    assert_eq!(r3.version, 8);
    assert_eq!(image(&v).await, img2);
    assert_eq!(v.stats().pending_versions, 7);
    // The catalog answers: everything publishes in order, each version with its data.
    lossy.refuse_manifests.store(false, SeqCst);
    let p = v.published(r3.version).await.unwrap();
    assert_eq!(p.state, CheckpointState::Published);
    assert_eq!(
        image(&v).await,
        img2,
        "publication changes nothing a guest reads"
    );
    let log = a.log(TENANT, "w").await.unwrap();
    let kinds: Vec<(u64, CheckpointKind)> = log.iter().map(|c| (c.version, c.kind)).collect();
    assert_eq!(
        kinds[1..],
        [
            (2, CheckpointKind::Checkpoint),
            (3, CheckpointKind::Checkpoint),
            (4, CheckpointKind::Auto),
            (5, CheckpointKind::Rollback),
            (6, CheckpointKind::Auto),
            (7, CheckpointKind::Rollback),
            (8, CheckpointKind::Rollback),
        ]
    );
    assert_eq!(log[4].label.as_deref(), Some("rollback to v2"));
    let m = |n: u64| log.iter().find(|c| c.version == n).unwrap().manifest;
    assert_eq!(m(5), m(2), "a rollback publishes its target's manifest");
    assert_eq!(m(7), m(3));
    assert_eq!(m(8), m(2));
    for (n, want) in [
        (4, &before),
        (5, &img2),
        (6, &after),
        (7, &img3),
        (8, &img2),
    ] {
        assert_eq!(
            &version_image(&a, "w", n, &format!("v{n}")).await,
            want,
            "v{n}"
        );
    }
    a.detach(TENANT, "w").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_returns_a_published_receipt_and_a_detached_workspace_publishes() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 8).await;
    let p = a
        .checkpoint_with(TENANT, "w", None, None, true)
        .await
        .unwrap();
    assert_eq!((p.version, p.state), (2, CheckpointState::Published));
    // The receipt carries the call's own times (the catalog's row has none: they read 0).
    assert!(p.stall > Duration::ZERO && p.total >= p.stall, "{p:?}");
    // Local cuts still pending at detach are published by it.
    write_tag(&v, 2, 0, 8).await;
    let l = v.checkpoint_with(None, None, false).await.unwrap();
    write_tag(&v, 3, 8, 8).await;
    drop(v);
    a.detach(TENANT, "w").await.unwrap();
    let ws = a.workspace(TENANT, "w").await.unwrap();
    assert!(ws.head_version > l.version);
    let img = version_image(&a, "w", l.version, "fl").await;
    assert_eq!(&img[..8], &[2; 8]);
    assert_eq!(&img[8..16], &[0; 8]);
    // A workspace not attached here is attached for the call, so its checkpoint is published.
    let p = a
        .checkpoint_with(TENANT, "w", None, None, false)
        .await
        .unwrap();
    assert_eq!(p.state, CheckpointState::Published);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_cas_reply_of_a_local_checkpoint_is_adopted_not_repeated() {
    let c = Cluster::new().await;
    let (a, lossy) = lossy_node(&c, "a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 8).await;
    lossy.lose_next_cas_reply.store(true, SeqCst);
    let l = v.checkpoint_with(None, None, false).await.unwrap();
    write_tag(&v, 2, 8, 8).await;
    let m = v.checkpoint_with(None, None, false).await.unwrap();
    assert_eq!((l.version, m.version), (2, 3));
    let p = v.published(3).await.unwrap();
    assert_eq!(p.version, 3);
    let log = a.log(TENANT, "w").await.unwrap();
    assert_eq!(log.len(), 3, "one row per version: {log:?}");
    assert_eq!(&version_image(&a, "w", 2, "f2").await[..16], {
        let mut e = vec![1; 8];
        e.extend([0; 8]);
        &e.clone()[..]
    });
    assert_eq!(
        &version_image(&a, "w", 3, "f3").await[..16],
        &[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    );
}

/// Rollbacks that were taken locally (their target still pending), across the cases.
static LOCAL_ROLLBACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Rollbacks that failed (the published way, while the catalog refused) and changed nothing.
static ROLLBACKS_REFUSED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn cases() -> u64 {
    std::env::var("STRATA_LOCAL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

/// One power-loss case; returns the local checkpoints it verified and whether work of the dead
/// process was cut short by the power loss.
async fn power_case(cluster: &Cluster, seed: u64) -> (usize, bool) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let disk = SimFs::new();
    let name = format!("p{seed}");
    let mut cfg = cluster.config("crash");
    cfg.segment_max_bytes = rng.random_range(8..64) * 4096;
    // Half the cases keep the catalog refusing head CASes for a while: cuts stay local
    // (publishes fail and retry), so rollbacks find their targets still pending.
    let lossy = common::faults::LossyCatalog::new(cluster.catalog.clone());
    let node = Engine::open_with(
        cfg.clone(),
        lossy.clone(),
        cluster.store.clone(),
        Arc::new(disk.process()),
    )
    .unwrap();
    let vol = empty_volume(&node, &name, DISK, Mode::Durable).await;
    // (Refused manifests fail a publish before its CAS; a refused CAS leaves it ambiguous, and
    // then a rollback takes the published way until that is settled.)
    let refusing = |on: bool, cas: bool| {
        let flag = if cas {
            &lossy.refuse_cas
        } else {
            &lossy.refuse_manifests
        };
        flag.store(on, SeqCst);
    };
    let cas = rng.random_bool(0.3);
    let refuse_until = if rng.random_bool(0.5) {
        refusing(true, cas);
        rng.random_range(0..40u64)
    } else {
        0
    };
    // states[k]: the disk after the first k writes and trims.
    let mut states: Vec<Vec<u64>> = vec![vec![0; BLOCKS as usize]];
    let mut durable = 0usize;
    let mut locals: Vec<(u64, usize, CheckpointKind)> = Vec::new();
    for i in 0..rng.random_range(1..40u64) {
        if i == refuse_until {
            refusing(false, cas);
        }
        let r = rng.random_range(0..100);
        let mut next = states.last().unwrap().clone();
        if r < 60 {
            let lba = rng.random_range(0..BLOCKS);
            let n = rng.random_range(1..=(BLOCKS - lba).min(6));
            let tag = (seed << 16) | (i + 1);
            write_tag(&vol, tag, lba, n).await;
            next[lba as usize..(lba + n) as usize].fill(tag);
            states.push(next);
        } else if r < 68 {
            let lba = rng.random_range(0..BLOCKS);
            let n = rng.random_range(1..=(BLOCKS - lba).min(8));
            vol.trim(lba * 4096, n * 4096).await.unwrap();
            next[lba as usize..(lba + n) as usize].fill(0);
            states.push(next);
        } else if r < 76 {
            vol.flush().await.unwrap();
            durable = states.len() - 1;
        } else if r < 91 {
            let p = vol.checkpoint_with(None, None, false).await.unwrap();
            assert_eq!(p.state, CheckpointState::Local);
            locals.push((p.version, states.len() - 1, CheckpointKind::Checkpoint));
            durable = states.len() - 1;
        } else if r < 96 && !locals.is_empty() {
            // A rollback to one of them: at once while it is still local.
            let (to, k, _) = if rng.random_bool(0.5) {
                *locals.last().unwrap()
            } else {
                locals[rng.random_range(0..locals.len())]
            };
            let p = match node.rollback(TENANT, &name, to).await {
                Ok(p) => p,
                Err(e) => {
                    // Only the published way fails, while the catalog refuses: nothing changed.
                    assert!(i < refuse_until, "seed {seed}: rollback to v{to}: {e}");
                    let now = states.last().unwrap();
                    assert_eq!(
                        &image(&vol).await,
                        now,
                        "seed {seed}: a failed rollback changed the disk"
                    );
                    ROLLBACKS_REFUSED.fetch_add(1, SeqCst);
                    continue;
                }
            };
            if p.state == CheckpointState::Local {
                LOCAL_ROLLBACKS.fetch_add(1, SeqCst);
            }
            states.push(states[k].clone());
            assert_eq!(
                image(&vol).await,
                states[k],
                "seed {seed}: rolled back to v{to}"
            );
            locals.push((p.version, states.len() - 1, CheckpointKind::Rollback));
            durable = states.len() - 1;
        } else {
            // Let background publication get somewhere (or not) before the next step.
            tokio::time::sleep(std::time::Duration::from_micros(rng.random_range(0..3000))).await;
        }
    }
    if rng.random_bool(0.5) {
        tokio::time::sleep(std::time::Duration::from_micros(rng.random_range(0..5000))).await;
    }
    // The lights go out: this process's disk handle dies with them.
    disk.power_loss(seed, true);
    node.abandon().await;
    drop(vol);
    let cut_short = disk.counter("dead") > 0;
    let node2 = cluster.node_with(cfg, Arc::new(disk.process()));
    let vol = node2.attach(TENANT, &name).await.unwrap();
    let got = image(&vol).await;
    if std::env::var("STRATA_LOCAL_TRACE").is_ok() {
        let ws = node2.workspace(TENANT, &name).await.unwrap();
        eprintln!(
            "seed {seed}: locals {locals:?}, head {} after recovery, {} pending",
            ws.head_version,
            vol.stats().pending_versions
        );
    }
    assert!(
        (durable..states.len()).any(|k| states[k] == got),
        "seed {seed}: the recovered disk is not a state at or after the last flush or local checkpoint (state {durable} of {})",
        states.len() - 1
    );
    for &(version, k, _) in &locals {
        vol.published(version).await.unwrap();
        let img = version_image(&node2, &name, version, &format!("{name}v{version}")).await;
        assert!(
            img == states[k],
            "seed {seed}: local checkpoint v{version} does not hold the disk of its cut"
        );
    }
    let log = node2.log(TENANT, &name).await.unwrap();
    for (version, _, kind) in &locals {
        let c = log.iter().find(|c| c.version == *version).unwrap();
        assert_eq!(c.kind, *kind, "seed {seed}: v{version}");
    }
    node2.detach(TENANT, &name).await.unwrap();
    node2.delete_workspace(TENANT, &name).await.unwrap();
    (locals.len(), cut_short)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_checkpoints_survive_power_loss_mid_publication() {
    let c = Cluster::new().await;
    let from: u64 = std::env::var("STRATA_LOCAL_FROM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let (mut verified, mut mid) = (0, 0);
    for seed in from..from + cases() {
        let (n, cut_short) = power_case(&c, seed).await;
        verified += n;
        mid += cut_short as u64;
    }
    let rollbacks = LOCAL_ROLLBACKS.load(SeqCst);
    eprintln!(
        "{} power-loss cases ({mid} with a publish cut short): {verified} local checkpoints and rollbacks verified after recovery, {rollbacks} rollbacks taken locally, {} refused without effect",
        cases(),
        ROLLBACKS_REFUSED.load(SeqCst)
    );
    assert!(verified > 0 && mid > 0 && rollbacks > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_whose_reply_is_lost_settles_before_the_next_cut() {
    let c = Cluster::new().await;
    let (a, lossy) = lossy_node(&c, "a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 64).await;
    v.checkpoint(None).await.unwrap();
    write_tag(&v, 2, 0, 60).await;
    v.checkpoint(None).await.unwrap();
    // The compaction's head CAS commits, its reply is lost and the head is unreadable for a
    // while: it must learn its outcome before any cut can reserve the next number.
    lossy.lose_next_cas_reply.store(true, SeqCst);
    lossy.blind.store(true, SeqCst);
    let unblind = {
        let lossy = lossy.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(600)).await;
            lossy.blind.store(false, SeqCst);
        })
    };
    let p = v
        .compact(0.5)
        .await
        .unwrap()
        .expect("a sparse object to compact");
    unblind.await.unwrap();
    write_tag(&v, 9, 0, 1).await;
    let l = v.checkpoint_with(None, None, false).await.unwrap();
    assert_eq!(l.version, p.version + 1);
    v.published(l.version).await.unwrap();
    let img = version_image(&a, "w", l.version, "f").await;
    assert_eq!(
        img[0], 9,
        "the local checkpoint after the compaction holds its write"
    );
    assert_eq!(&img[1..60], &[2; 59]);
    assert_eq!(&img[60..64], &[1; 4]);
}

/// A node that died holding a workspace keeps its journal; the workspace is deleted elsewhere
/// once the lease is free, and made again under the same name from the same source (the same
/// version-1 manifest). When the first node comes back, its journal belongs to the deleted
/// workspace and must not replay onto the new one: local state names the incarnation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_left_by_a_deleted_workspace_never_replays_onto_its_namesake() {
    let c = Cluster::new().await;
    let a = c.node("a");
    empty_volume(&a, "base", DISK, Mode::Durable).await;
    a.detach(TENANT, "base").await.unwrap();
    let from_base = || strata_engine::Source::Checkpoint {
        workspace: "base".into(),
        version: None,
    };
    a.create_workspace(TENANT, "w", from_base(), Mode::Durable, None)
        .await
        .unwrap();
    let v = a.attach(TENANT, "w").await.unwrap();
    write_tag(&v, 7, 0, 16).await;
    v.flush().await.unwrap();
    let lease = v.lease();
    a.abandon().await; // the node dies: its journal stays, unpublished
    drop(v);
    c.catalog.release_lease(TENANT, "w", &lease).await.unwrap(); // (expired)
    let b = c.node("b");
    b.delete_workspace(TENANT, "w").await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await; // a later creation time
    b.create_workspace(TENANT, "w", from_base(), Mode::Durable, None)
        .await
        .unwrap();
    let w = b.attach(TENANT, "w").await.unwrap();
    assert!(image(&w).await.iter().all(|&t| t == 0));
    b.detach(TENANT, "w").await.unwrap();
    let a = c.node("a");
    let w = a.attach(TENANT, "w").await.unwrap();
    assert!(
        image(&w).await.iter().all(|&t| t == 0),
        "the deleted workspace's writes replayed onto its namesake"
    );
}
