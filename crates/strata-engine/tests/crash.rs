//! Power-loss crash tests through the simulated file system.
//!
//! Each seeded case attaches a durable workspace, runs random writes (some arriving together,
//! in groups), trims, flushes and the
//! occasional checkpoint or grow of the disk (writes then reach the new end), then "loses
//! power" at a random point: everything not fsync'd is
//! dropped, except a random subset of un-synced writes, some torn. A new process (engine)
//! recovers. The recovered disk must equal the disk after some prefix of the operations that is
//! at least as long as the last completed flush: every write acknowledged before a completed
//! FLUSH is present, nothing older reappears, and the journal recovered to a clean prefix.

mod common;

use std::sync::Arc;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_engine::{Mode, Source};
use strata_simfs::SimFs;

const BLOCKS: u64 = 64;
const DISK: u64 = BLOCKS * 4096;
/// A case's disk may grow once, to this many blocks.
const GROWN: u64 = 2 * BLOCKS;

fn cases() -> u64 {
    std::env::var("STRATA_CRASH_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// One case; returns (writes checked, flushes) for reporting.
async fn case(cluster: &Cluster, seed: u64) -> (u64, u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let fs = Arc::new(SimFs::new());
    let name = format!("c{seed}");
    let mut cfg = cluster.config("crash");
    cfg.segment_max_bytes = rng.random_range(8..64) * 4096;
    let node = cluster.node_with(cfg.clone(), fs.clone());
    node.create_workspace(
        TENANT,
        &name,
        Source::Empty { size: DISK },
        Mode::Durable,
        None,
    )
    .await
    .unwrap();
    let vol = node.attach(TENANT, &name).await.unwrap();

    // states[k] = disk (as tags) after the first k operations, over the largest disk.
    let mut states: Vec<Vec<u64>> = vec![vec![0; GROWN as usize]];
    let mut blocks = BLOCKS;
    let mut flushed = 0usize;
    let mut flushes = 0;
    let n_ops = rng.random_range(1..40);
    for i in 0..n_ops {
        let mut next = states.last().unwrap().clone();
        let r = rng.random_range(0..100);
        if std::env::var("STRATA_CRASH_TRACE").is_ok() {
            eprintln!("op {i}: r={r}");
        }
        if r < 20 {
            // Writes that arrive together (`write_many`: one journal write for the group);
            // their records are in order, so a torn group keeps a prefix of them, and each
            // is a state of its own.
            let k = rng.random_range(2..=5);
            let mut group: Vec<(u64, Vec<u8>)> = vec![];
            for w in 0..k {
                let lba = rng.random_range(0..blocks);
                let n = rng.random_range(1..=(blocks - lba).min(4));
                let tag = (seed << 16) | 0x8000 | ((i as u64 + 1) << 3) | w;
                let mut data = Vec::new();
                for b in lba..lba + n {
                    data.extend(tagged(tag, b));
                    next[b as usize] = tag;
                }
                group.push((lba * 4096, data));
                states.push(next.clone());
            }
            if std::env::var("STRATA_CRASH_TRACE").is_ok() {
                eprintln!("write group of {k}");
            }
            let writes: Vec<(u64, &[u8])> = group.iter().map(|(at, d)| (*at, &d[..])).collect();
            for r in vol.write_many(&writes).await {
                r.unwrap();
            }
        } else if r < 65 {
            let lba = rng.random_range(0..blocks);
            let n = rng.random_range(1..=(blocks - lba).min(6));
            let tag = (seed << 16) | (i as u64 + 1);
            let mut data = Vec::new();
            for b in lba..lba + n {
                data.extend(tagged(tag, b));
                next[b as usize] = tag;
            }
            let fua = rng.random_bool(0.1);
            if std::env::var("STRATA_CRASH_TRACE").is_ok() {
                eprintln!("write lba {lba} n {n} tag {tag} fua {fua}");
            }
            vol.write(lba * 4096, &data, fua).await.unwrap();
            states.push(next);
            if fua {
                // FUA makes this write (and, with our group commit, all before it) durable.
                flushed = states.len() - 1;
            }
        } else if r < 75 {
            let lba = rng.random_range(0..blocks);
            let n = rng.random_range(1..=(blocks - lba).min(8));
            vol.trim(lba * 4096, n * 4096).await.unwrap();
            for b in lba..lba + n {
                next[b as usize] = 0;
            }
            states.push(next);
        } else if r < 88 {
            vol.flush().await.unwrap();
            flushed = states.len() - 1;
            flushes += 1;
        } else if r < 91 {
            // Segment cleaning copies live data forward and deletes the oldest segments; it
            // syncs what it copies, but must not make un-flushed writes look flushed.
            vol.clean_journal(0).await.unwrap();
        } else if r < 94 {
            // A prepared (zero-filled) segment file, and a rotation onto it.
            vol.prepare_journal().await.unwrap();
        } else if blocks == BLOCKS && rng.random_bool(0.4) {
            // A grow: a publish whose version carries the larger size (committed when it
            // returns, so the recovered disk has it).
            vol.grow(GROWN * 4096).await.unwrap();
            blocks = GROWN;
        } else {
            // A checkpoint exercises publish, local state and segment deletion.
            node.checkpoint(TENANT, &name, None).await.unwrap();
        }
    }
    if std::env::var("STRATA_CRASH_TRACE").is_ok() {
        eprintln!("POWER LOSS");
    }
    // Power cut (the process dies with it).
    node.abandon().await;
    drop(vol);
    fs.power_loss(seed, true);
    let node2 = cluster.node_with(cfg, fs.clone());
    let vol = node2.attach(TENANT, &name).await.unwrap();
    assert_eq!(vol.size(), blocks * 4096, "seed {seed}: the disk's size");
    let img = vol.read(0, vol.size()).await.unwrap();
    let got: Vec<u64> = (0..GROWN)
        .map(|b| {
            if b >= blocks {
                return 0;
            }
            tag_of(&img[(b * 4096) as usize..((b + 1) * 4096) as usize], b)
                .unwrap_or_else(|| panic!("seed {seed}: block {b} is torn or foreign"))
        })
        .collect();
    let ok = (flushed..states.len()).any(|k| states[k] == got);
    if !ok {
        let lost: Vec<u64> = (0..GROWN)
            .filter(|&b| got[b as usize] != states[flushed][b as usize])
            .collect();
        panic!(
            "seed {seed}: recovered disk is not a prefix state at or after the last flush (op {flushed} of {}); blocks differing from the flushed state: {lost:?}",
            states.len() - 1
        );
    }
    // The recovered volume keeps working, and a second recovery sees the same thing.
    vol.write(0, &tagged(1, 0), true).await.unwrap();
    node2.abandon().await;
    drop(vol);
    fs.power_loss(seed ^ 0xdead, true);
    let node3 = cluster.node_with(cluster.config("crash"), fs.clone());
    let vol = node3.attach(TENANT, &name).await.unwrap();
    let img2 = vol.read(0, vol.size()).await.unwrap();
    assert_eq!(
        tag_of(&img2[..4096], 0),
        Some(1),
        "seed {seed}: FUA write lost"
    );
    assert!(
        img2[4096..] == img[4096..],
        "seed {seed}: second recovery changed other blocks"
    );
    node3.detach(TENANT, &name).await.unwrap();
    node3
        .catalog()
        .delete_workspace(TENANT, &name)
        .await
        .unwrap();
    (
        states[flushed].iter().filter(|&&t| t != 0).count() as u64,
        flushes,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_loss_keeps_every_flushed_write() {
    let cluster = Cluster::new().await;
    let n = cases();
    let (mut checked, mut flushes) = (0, 0);
    let only: Option<u64> = std::env::var("STRATA_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok());
    // STRATA_CRASH_FROM: start past a known failing seed (the long mode's open case).
    let from: u64 = std::env::var("STRATA_CRASH_FROM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for seed in from..n {
        if only.is_some_and(|o| o != seed) {
            continue;
        }
        let (c, f) = case(&cluster, seed).await;
        checked += c;
        flushes += f;
    }
    eprintln!(
        "power-loss cases: {n}, flushed blocks checked: {checked}, flushes: {flushes}, lost: 0"
    );
}

/// The control run: with flushes not honoured (the unsafe opt-out), the same harness must see
/// lost writes, or it could not catch a real bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_catches_unhonoured_flushes() {
    let cluster = Cluster::new().await;
    let mut caught = 0;
    for seed in 0..50u64 {
        let fs = Arc::new(SimFs::new());
        let mut cfg = cluster.config("ctl");
        cfg.cache_unsafe = true;
        let name = format!("ctl{seed}");
        let node = cluster.node_with(cfg.clone(), fs.clone());
        node.create_workspace(
            TENANT,
            &name,
            Source::Empty { size: DISK },
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        let vol = node.attach(TENANT, &name).await.unwrap();
        vol.write(seed % BLOCKS * 4096, &tagged(7, seed % BLOCKS), false)
            .await
            .unwrap();
        vol.flush().await.unwrap();
        node.abandon().await;
        drop(vol);
        fs.power_loss(seed, true);
        let vol = cluster
            .node_with(cfg, fs)
            .attach(TENANT, &name)
            .await
            .unwrap();
        let b = vol.read(seed % BLOCKS * 4096, 4096).await.unwrap();
        if tag_of(&b, seed % BLOCKS) != Some(7) {
            caught += 1;
        }
    }
    assert!(caught > 0, "the harness never noticed unhonoured flushes");
}
