//! Local checkpoints: taken at the cut, durable on the node, published later in order.
//!
//! - The receipt is `local` with its version reserved; reads see every layer; publication
//!   commits exactly the reserved versions, each with exactly the data of its cut.
//! - Power loss at a random moment while cuts are being published (a process handle of the
//!   simulated disk dies with the power, so a publish still running stops at its next file
//!   operation: before, during or after its upload, before or after its head CAS): after
//!   recovery every local checkpoint is published with exactly its content, and the disk is a
//!   state at or after the last flush or local checkpoint.
//! - A head CAS whose reply was lost is adopted, not published twice.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_catalog::CheckpointKind;
use strata_engine::simfs::SimFs;
use strata_engine::{CheckpointState, Engine, Mode};

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
    let node = cluster.node_with(cfg.clone(), Arc::new(disk.process()));
    let vol = empty_volume(&node, &name, DISK, Mode::Durable).await;
    // states[k]: the disk after the first k writes and trims.
    let mut states: Vec<Vec<u64>> = vec![vec![0; BLOCKS as usize]];
    let mut durable = 0usize;
    let mut locals: Vec<(u64, usize)> = Vec::new();
    for i in 0..rng.random_range(1..40u64) {
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
        } else if r < 94 {
            let p = vol.checkpoint_with(None, None, false).await.unwrap();
            assert_eq!(p.state, CheckpointState::Local);
            locals.push((p.version, states.len() - 1));
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
    for &(version, k) in &locals {
        vol.published(version).await.unwrap();
        let img = version_image(&node2, &name, version, &format!("{name}v{version}")).await;
        assert!(
            img == states[k],
            "seed {seed}: local checkpoint v{version} does not hold the disk of its cut"
        );
    }
    let log = node2.log(TENANT, &name).await.unwrap();
    for (version, _) in &locals {
        let c = log.iter().find(|c| c.version == *version).unwrap();
        assert_eq!(
            c.kind,
            CheckpointKind::Checkpoint,
            "seed {seed}: v{version}"
        );
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
    eprintln!(
        "{} power-loss cases ({mid} with a publish cut short): {verified} local checkpoints verified after recovery",
        cases()
    );
    assert!(verified > 0 && mid > 0);
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
