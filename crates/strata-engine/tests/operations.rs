//! Operations racing the data path, one regression test per way an acknowledged write was lost
//! (or a volume wedged) before: detach while a writer flushes, a checkpoint whose caller goes
//! away, a lost head-CAS reply, rollback inside a freeze, a full disk, a segment recycled under
//! a read, a failed directory fsync in cleaning, a template build slower than the GC grace.

#[path = "operations/ack_order.rs"]
mod ack_order;
mod common;
#[path = "operations/groups.rs"]
mod groups;

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use common::faults::{FaultFs, Switches};
use common::*;
use object_store::memory::InMemory;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::ObjectStore;
use strata_engine::{Engine, Error, Mode};
use strata_simfs::SimFs;
use strata_store::Store;

const DISK: u64 = 64 << 20;

/// Reads every block in `expect` and checks it holds at least the flushed tag (tags grow per
/// block, so anything older is a lost flushed write). Returns how many blocks were checked.
async fn check_flushed(v: &strata_engine::Volume, expect: &HashMap<u64, u64>) -> usize {
    let mut lost = vec![];
    for (&lba, &tag) in expect {
        let b = v.read(lba * 4096, 4096).await.unwrap();
        match tag_of(&b, lba) {
            Some(got) if got >= tag => {}
            got => lost.push((lba, tag, got)),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} flushed blocks read back older data, e.g. {:?}",
        lost.len(),
        expect.len(),
        &lost[..lost.len().min(5)]
    );
    expect.len()
}

/// A writer that writes tagged 4 KiB blocks over `span` blocks and flushes after every 32,
/// until a write or flush fails. Returns the tag each block held at its last successful flush.
async fn write_until_refused(v: Arc<strata_engine::Volume>, span: u64) -> HashMap<u64, u64> {
    let mut flushed = HashMap::new();
    let mut pending = vec![];
    for i in 0u64.. {
        let lba = (i * 7919) % span;
        let tag = i + 1;
        if v.write(lba * 4096, &tagged(tag, lba), false).await.is_err() {
            break;
        }
        pending.push((lba, tag));
        if pending.len() == 32 {
            if v.flush().await.is_err() {
                break;
            }
            flushed.extend(pending.drain(..));
        }
    }
    flushed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_while_a_writer_flushes_loses_no_flushed_write() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    let writer = tokio::spawn(write_until_refused(v.clone(), 4096));
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.detach(TENANT, "w").await.unwrap();
    let flushed = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("writes are refused after a detach")
        .unwrap();
    assert!(flushed.len() > 100, "the writer got going");
    let v = a.attach(TENANT, "w").await.unwrap();
    check_flushed(&v, &flushed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_while_a_writer_writes_acknowledges_nothing_after() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "d", DISK, Mode::Durable).await;
    let writer = tokio::spawn(write_until_refused(v.clone(), 1024));
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.delete_workspace(TENANT, "d").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("writes are refused after a delete")
        .unwrap();
    assert!(v.write(0, &tagged(1, 0), false).await.is_err());
}

/// An in-memory object store whose every put takes `ms` milliseconds (object_store's throttle
/// cannot wrap the local file store's reads).
fn slow_store(ms: u64) -> Store {
    let cfg = ThrottleConfig {
        wait_put_per_call: Duration::from_millis(ms),
        ..ThrottleConfig::default()
    };
    let inner: Arc<dyn ObjectStore> = Arc::new(ThrottledStore::new(InMemory::new(), cfg));
    Store::from_object_store(inner, "slow")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_caller_goes_away_loses_nothing() {
    let c = Cluster::new().await;
    let store = slow_store(100);
    let node = |n: &str| {
        let fs = Arc::new(strata_engine::fs::RealFs);
        Engine::open_with(c.config(n), c.catalog.clone(), store.clone(), fs).unwrap()
    };
    let a = node("a");
    let v = empty_volume(&a, "c", DISK, Mode::Durable).await;
    let mut expect = HashMap::new();
    for lba in 0..2048u64 {
        v.write(lba * 4096, &tagged(1, lba), false).await.unwrap();
        expect.insert(lba, 1);
    }
    v.flush().await.unwrap();
    // The caller gives up during the upload (an HTTP client with a short timeout).
    let r = tokio::time::timeout(Duration::from_millis(150), v.checkpoint(None)).await;
    assert!(r.is_err(), "the checkpoint was still uploading");
    for lba in 4000..4256u64 {
        v.write(lba * 4096, &tagged(2, lba), false).await.unwrap();
        expect.insert(lba, 2);
    }
    v.flush().await.unwrap();
    let p = v.checkpoint(None).await.unwrap();
    a.detach(TENANT, "c").await.unwrap();
    // Another node restores from the head alone.
    let b = node("b");
    let v = b.attach(TENANT, "c").await.unwrap();
    assert!(v.head_version() > p.version - 1);
    check_flushed(&v, &expect).await;
}

/// Node "a" on a catalog whose replies can be lost.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_cas_reply_does_not_wedge_the_volume() {
    let c = Cluster::new().await;
    let (a, lossy) = lossy_node(&c, "a");
    let v = empty_volume(&a, "cas", DISK, Mode::Durable).await;
    let mut expect = HashMap::new();
    for round in 1..=3u64 {
        for lba in 0..64u64 {
            let lba = lba + round * 100;
            v.write(lba * 4096, &tagged(round, lba), false)
                .await
                .unwrap();
            expect.insert(lba, round);
        }
        v.flush().await.unwrap();
        lossy.lose_next_cas_reply.store(true, SeqCst);
        // Round 2: the head cannot even be read back right away.
        lossy.blind.store(round == 2, SeqCst);
        let r = v.checkpoint(None).await;
        lossy.blind.store(false, SeqCst);
        if round == 2 {
            assert!(r.is_err(), "the outcome could not be known yet");
        } else {
            r.unwrap();
        }
    }
    // The volume is not stuck conflicting with its own committed versions.
    let p = v.checkpoint(Some("after".into())).await.unwrap();
    let head = a.workspace(TENANT, "cas").await.unwrap();
    assert_eq!(head.head_version, p.version);
    a.detach(TENANT, "cas").await.unwrap();
    let v = c.node("b").attach(TENANT, "cas").await.unwrap();
    check_flushed(&v, &expect).await;
}

/// A rollback whose CAS reply is lost settles before writes resume: it reports the version it
/// made, and later publishes do not silently switch the disk under the guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_whose_reply_is_lost_settles_before_writes_resume() {
    let c = Cluster::new().await;
    let (a, lossy) = lossy_node(&c, "a");
    let v = empty_volume(&a, "rb", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    let p1 = v.checkpoint(None).await.unwrap();
    v.write(0, &tagged(2, 0), false).await.unwrap();
    lossy.lose_next_cas_reply.store(true, SeqCst);
    let r = a.rollback(TENANT, "rb", p1.version).await.unwrap();
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(1));
    v.write(4096, &tagged(3, 1), false).await.unwrap();
    let p = v.checkpoint(None).await.unwrap();
    assert_eq!(p.version, r.version + 1);
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(1));
    assert_eq!(tag_of(&v.read(4096, 4096).await.unwrap(), 1), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_works_inside_a_freeze() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "r", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    let p1 = v.checkpoint(None).await.unwrap();
    v.write(0, &tagged(2, 0), false).await.unwrap();
    v.freeze().await;
    let r = tokio::time::timeout(Duration::from_secs(10), a.rollback(TENANT, "r", p1.version))
        .await
        .expect("rollback of a frozen workspace completes");
    r.unwrap();
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(1));
    v.thaw().await;
    v.write(4096, &tagged(3, 1), false).await.unwrap();
    // The write of tag 2 is kept in history: the version before the rollback.
    let log = a.log(TENANT, "r").await.unwrap();
    let before = &log[log.len() - 2];
    let out = c.path("before.raw");
    a.export(TENANT, "r", Some(before.version), &out)
        .await
        .unwrap();
    assert_eq!(tag_of(&std::fs::read(&out).unwrap()[..4096], 0), Some(2));
}

fn fault_node(c: &Cluster, name: &str) -> (Arc<Engine>, Arc<Switches>) {
    let sw = Arc::new(Switches::default());
    let node = c.node_with(c.config(name), Arc::new(FaultFs(sw.clone())));
    (node, sw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_and_recovers() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "full", DISK, Mode::Durable).await;
    for lba in 0..16u64 {
        v.write(lba * 4096, &tagged(1, lba), false).await.unwrap();
    }
    v.flush().await.unwrap();
    sw.full.store(true, SeqCst);
    for lba in 0..400u64 {
        match v.write(lba * 4096, &tagged(2, lba), false).await {
            Ok(()) => {}
            Err(Error::NoSpace(_)) => break,
            Err(e) => panic!("a full disk must say so, not {e}"),
        }
        assert!(lba < 399, "the full disk was never hit");
    }
    // What is already durable still reads and flushes.
    assert!(tag_of(&v.read(15 * 4096, 4096).await.unwrap(), 15).is_some());
    v.flush().await.unwrap();
    assert!(
        v.failure().is_none(),
        "a full disk does not kill the volume"
    );
    sw.full.store(false, SeqCst);
    v.write(0, &tagged(3, 0), false).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(3));
    a.detach(TENANT, "full").await.unwrap();
}

/// The disk fills exactly when a segment rotates: the new segment's header fits, its first
/// record does not. Later writes land in that segment and must still read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_at_a_segment_rotation_loses_no_segment() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "rot", DISK, Mode::Durable).await;
    for i in 0..160u64 {
        v.write(i * 4096, &tagged(1, i), false).await.unwrap();
        sw.full_after_header.store(true, SeqCst);
        assert!(v
            .write((1000 + i) * 4096, &tagged(9, 1000 + i), false)
            .await
            .is_err());
        sw.full_after_header.store(false, SeqCst);
    }
    v.flush().await.unwrap();
    for i in 0..160u64 {
        let b = v
            .read(i * 4096, 4096)
            .await
            .expect("every acknowledged write reads");
        assert_eq!(tag_of(&b, i), Some(1));
    }
    v.checkpoint(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_in_flight_never_sees_its_segment_recycled() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "pin", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.flush().await.unwrap();
    sw.stall_next_read.store(true, SeqCst);
    let reader = {
        let v = v.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(v.read(0, 4096))
        })
    };
    tokio::task::spawn_blocking({
        let sw = sw.clone();
        move || sw.wait_stalled()
    })
    .await
    .unwrap();
    // Publish (retiring the read's segment), then write enough to rotate into recycled files
    // and overwrite the same offsets with other data.
    v.checkpoint(None).await.unwrap();
    for round in 0..4u64 {
        for lba in 0..96u64 {
            let lba = 1000 + lba;
            v.write(lba * 4096, &tagged(10 + round, lba), false)
                .await
                .unwrap();
        }
        v.flush().await.unwrap();
        v.checkpoint(None).await.unwrap();
    }
    sw.release();
    let got = reader.join().unwrap().unwrap();
    assert_eq!(
        tag_of(&got, 0),
        Some(1),
        "the read saw another write's bytes"
    );
}

/// A zero-fill of a spare journal segment that fails halfway (a full disk) leaves no partial
/// file behind it until the next open of the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_zero_fill_leaves_no_partial_file() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "prep", DISK, Mode::Durable).await;
    sw.full_for_spares.store(true, SeqCst);
    let r = v.prepare_journal().await;
    sw.full_for_spares.store(false, SeqCst);
    assert!(r.is_err(), "the zero-fill was not attempted");
    let left: Vec<_> = std::fs::read_dir(v.dir().join("journal"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".prep"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    v.prepare_journal().await.unwrap();
}

/// An fsync that panics (an injected fault) fails the FLUSH and the volume, like one that
/// fails: the batch it took is not silently dropped for a later FLUSH to succeed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_journal_fsync_fails_the_volume() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "panics", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    sw.panic_next_sync.store(true, SeqCst);
    assert!(
        v.flush().await.is_err(),
        "the FLUSH whose fsync panicked succeeded"
    );
    assert!(
        v.flush().await.is_err(),
        "a FLUSH after a panicked fsync succeeded"
    );
}

/// A client that gives up on its FLUSH while the journal's fsync is under way, and that fsync
/// fails: the failure is not lost with the dropped request, so no later FLUSH succeeds over
/// data the page cache may have dropped. On a current-thread runtime (a multi-thread one runs
/// the fsync on the caller's worker, where it cannot be dropped either).
#[tokio::test]
async fn a_flush_dropped_during_a_failing_fsync_lets_no_later_flush_succeed() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "gone", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    sw.stall_then_fail_next_sync.store(true, SeqCst);
    let s = sw.clone();
    let helper = std::thread::spawn(move || {
        s.wait_stalled();
        std::thread::sleep(Duration::from_millis(50));
        s.release();
    });
    let first = tokio::time::timeout(Duration::from_millis(10), v.flush()).await;
    helper.join().unwrap();
    assert!(
        !matches!(first, Ok(Ok(()))),
        "the FLUSH whose fsync failed succeeded"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        v.flush().await.is_err(),
        "a FLUSH after a failed fsync succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_directory_fsync_in_cleaning_leaves_the_flush_to_sync_it() {
    let c = Cluster::new().await;
    let (a, sw) = fault_node(&c, "a");
    let v = empty_volume(&a, "clean2", DISK, Mode::Durable).await;
    for round in 0..12u64 {
        for lba in 0..16u64 {
            v.write(lba * 4096, &tagged(round + 1, lba), false)
                .await
                .unwrap();
        }
    }
    sw.fail_sync_dir.store(true, SeqCst);
    assert!(v.clean_journal(0).await.is_err());
    let before = sw.sync_dirs.load(SeqCst);
    v.flush().await.unwrap();
    assert!(
        sw.sync_dirs.load(SeqCst) > before,
        "the flush after a failed directory fsync syncs the directory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_build_slower_than_half_the_gc_grace_gives_up() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.gc_grace = Duration::from_millis(200);
    let a = Engine::open_with(
        cfg,
        c.catalog.clone(),
        slow_store(150),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    let img = c.path("img.raw");
    let data: Vec<u8> = (0..(24u32 << 20)).map(|i| (i % 251) as u8 + 1).collect();
    std::fs::write(&img, &data).unwrap();
    let r = a
        .build_template_from_image(TENANT, "slow", &img, &|_, _| {})
        .await;
    assert!(
        r.is_err(),
        "a template whose first chunks may already be condemned is not published"
    );
    assert!(c.catalog.get_template(TENANT, "slow").await.is_err());
}

/// Journal records are written outside the writer lock (reserved under it, written beside
/// other writers): eight writers on two threads, each flushing now and then, with checkpoints
/// and a cleaner racing them, and every record slow to land, so flushes and cuts meet records
/// reserved and not yet written. The power goes while they run. Every write a writer saw
/// flushed must survive (a record reserved before it and never written would end replay
/// first), and every block must hold a value its writer wrote at or after that: one it saw
/// acknowledged, or the one write it had in flight when the power went (never acknowledged,
/// so it may or may not survive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_landing_outside_the_lock_survive_a_power_cut_once_flushed() {
    power_cut_with_writers_in_flight(false).await
}

/// The same with writes that arrive together ([`strata_engine::Volume::write_many`]: an NBD
/// client's pipelined requests): each writer writes three of its blocks at a time, which land
/// in one journal write. A torn group keeps a prefix of its records, and no group write is
/// acknowledged before every record reserved ahead of it has landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_arrive_together_survive_a_power_cut_once_flushed() {
    power_cut_with_writers_in_flight(true).await
}

async fn power_cut_with_writers_in_flight(grouped: bool) {
    const WRITERS: u64 = 8;
    const PER: u64 = 8; // blocks per writer, disjoint
    let c = Cluster::new().await;
    let fs = SimFs::new();
    let mut cfg = c.config("n");
    cfg.segment_max_bytes = 256 << 10;
    let (mut unlocked, mut together) = (0, 0);
    for round in 0..8u64 {
        let node = c.node_with(cfg.clone(), Arc::new(fs.process()));
        let name = format!("par{round}");
        let v = empty_volume(&node, &name, DISK, Mode::Durable).await;
        fs.set_write_delay(Duration::from_micros(50));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let side = {
            let (v, done, node, name) = (v.clone(), done.clone(), node.clone(), name.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !done.load(SeqCst) {
                    let _ = v.clean_journal(0).await;
                    let _ = v.prepare_journal().await;
                    n += 1;
                    if n.is_multiple_of(20) {
                        let _ = node.checkpoint(TENANT, &name, None).await;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        };
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (v, done) = (v.clone(), done.clone());
                tokio::spawn(async move {
                    let mut last = vec![0u64; PER as usize];
                    let mut flushed = last.clone();
                    // The write in flight when the power went (never acknowledged: it may or
                    // may not survive).
                    let mut tried = last.clone();
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (w + 1) ^ (round << 8);
                    let mut i = 0u64;
                    while !done.load(SeqCst) {
                        i += 1;
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        // One block, or three distinct ones written together.
                        let ks: Vec<u64> = if grouped {
                            (0..3).map(|d| (rng + d) % PER).collect()
                        } else {
                            vec![rng % PER]
                        };
                        let blocks: Vec<(u64, Vec<u8>)> = ks
                            .iter()
                            .map(|k| (w * PER + k) * 4096)
                            .map(|at| (at, tagged(i, at / 4096)))
                            .collect();
                        for k in &ks {
                            tried[*k as usize] = i;
                        }
                        let ok = if grouped {
                            let writes: Vec<(u64, &[u8])> =
                                blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
                            v.write_many(&writes).await.iter().all(|r| r.is_ok())
                        } else {
                            v.write(blocks[0].0, &blocks[0].1, false).await.is_ok()
                        };
                        if !ok {
                            break;
                        }
                        for k in &ks {
                            last[*k as usize] = i;
                        }
                        if i.is_multiple_of(7) {
                            let before = last.clone();
                            if v.flush().await.is_err() {
                                break;
                            }
                            flushed = before;
                        }
                    }
                    (last, flushed, tried)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100 + 25 * round)).await;
        assert!(
            v.failure().is_none(),
            "failed before the power cut: {:?}",
            v.failure()
        );
        // The power goes with writes in flight: this process's handles die with it.
        fs.power_loss(11 + round, true);
        done.store(true, SeqCst);
        let (mut last, mut flushed, mut tried) = (vec![], vec![], vec![]);
        for w in writers {
            let (l, f, t) = w.await.unwrap();
            last.extend(l);
            flushed.extend(f);
            tried.extend(t);
        }
        side.await.unwrap();
        assert!(
            flushed.iter().filter(|&&f| f > 0).count() > (WRITERS * PER / 2) as usize,
            "round {round}: too few flushes completed before the cut to test anything"
        );
        unlocked += v.stats().appends_unlocked;
        together += v.stats().appends_grouped;
        node.abandon().await;
        drop(v);
        fs.set_write_delay(Duration::ZERO);
        let node2 = c.node_with(cfg.clone(), Arc::new(fs.process()));
        let v = node2.attach(TENANT, &name).await.unwrap();
        let img = image(&v).await;
        let mut kept = 0;
        for b in 0..WRITERS * PER {
            let got = img[b as usize];
            let b = b as usize;
            assert!(
                got >= flushed[b] && (got <= last[b] || got == tried[b]),
                "round {round}, block {b}: {got} after the power cut, flushed {}, last {}, in flight {}",
                flushed[b],
                last[b],
                tried[b]
            );
            kept += (got == last[b]) as u64;
        }
        eprintln!(
            "round {round}: {kept} of {} blocks kept their last write",
            WRITERS * PER
        );
        node2.abandon().await;
    }
    eprintln!("{unlocked} writes landed outside the lock, {together} of them in groups");
    assert!(unlocked > 1000, "the fast path was hardly taken");
    if grouped {
        assert!(together > 1000, "writes were hardly grouped");
    }
}

/// Whether `cond` holds within 5 s (polled every 10 ms).
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// A call on a detached workspace attaches it for itself (here a checkpoint, slowed by the
/// store). A user who attaches it meanwhile gets the same volume and keeps it when the call
/// ends (before, the call's detach closed it under the user's writes); a call whose caller
/// goes away still lets go of the workspace once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_attached_for_itself_leaves_a_users_attach_alone() {
    let c = Cluster::new().await;
    let store = slow_store(200);
    let fs = Arc::new(strata_engine::fs::RealFs);
    let a = Engine::open_with(c.config("a"), c.catalog.clone(), store, fs).unwrap();
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), true).await.unwrap();
    drop(v);
    a.detach(TENANT, "w").await.unwrap();
    assert!(a.volume(TENANT, "w").is_none());

    let call = {
        let a = a.clone();
        tokio::spawn(async move { a.checkpoint(TENANT, "w", Some("mid".into())).await })
    };
    tokio::time::sleep(Duration::from_millis(60)).await;
    let user = a.attach(TENANT, "w").await.unwrap();
    call.await.unwrap().unwrap();
    assert!(
        a.volume(TENANT, "w").is_some(),
        "the user's attach outlives the call"
    );
    user.write(4096, &tagged(2, 1), true).await.unwrap();
    user.flush().await.unwrap();
    drop(user);
    a.detach(TENANT, "w").await.unwrap();

    // A caller that gives up mid-call: the workspace is detached once the call ends.
    let r = tokio::time::timeout(
        Duration::from_millis(60),
        a.checkpoint(TENANT, "w", Some("gone".into())),
    )
    .await;
    assert!(r.is_err(), "the checkpoint was still running");
    // Its call goes on (attached for it), then lets go.
    assert!(
        eventually(|| a.volume(TENANT, "w").is_some()).await,
        "the abandoned call attached the workspace for itself"
    );
    assert!(
        eventually(|| a.volume(TENANT, "w").is_none()).await,
        "an abandoned call lets go of the workspace"
    );
    let v = a.attach(TENANT, "w").await.unwrap();
    assert_eq!(tag_of(&v.read(4096, 4096).await.unwrap(), 1), Some(2));
}

/// A node that stops in the middle of a call that attached a workspace for itself marks it:
/// after the restart it is settled (published, detached, lease let go), not resumed as if a
/// user had attached it; a user's attach during the call clears the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_a_call_settles_what_it_held() {
    let c = Cluster::new().await;
    let store = slow_store(300);
    let fs = Arc::new(strata_engine::fs::RealFs);
    let node = || Engine::open_with(c.config("a"), c.catalog.clone(), store.clone(), fs.clone());
    let a = node().unwrap();
    for ws in ["held", "claimed"] {
        let v = empty_volume(&a, ws, DISK, Mode::Durable).await;
        v.write(0, &tagged(1, 0), true).await.unwrap();
        drop(v);
        a.detach(TENANT, ws).await.unwrap();
    }
    let call = |ws: &'static str| {
        let a = a.clone();
        tokio::spawn(async move { a.checkpoint(TENANT, ws, Some("x".into())).await })
    };
    let wait_held = async |ws: &str| {
        assert!(
            eventually(|| a.was_held(TENANT, ws)).await,
            "{ws} was not marked held"
        );
    };
    // A user's attach during the call: no mark left, still attached after it.
    let t = call("claimed");
    wait_held("claimed").await;
    let user = a.attach(TENANT, "claimed").await.unwrap();
    assert!(
        !a.was_held(TENANT, "claimed"),
        "a user's attach clears the mark"
    );
    t.await.unwrap().unwrap();
    assert!(a.volume(TENANT, "claimed").is_some());
    drop(user);
    // The node stops mid-call.
    let t = call("held");
    wait_held("held").await;
    a.abandon().await;
    t.abort();
    drop(a);
    let a = node().unwrap();
    assert!(a.was_held(TENANT, "held"));
    a.settle_held(TENANT, "held").await.unwrap();
    assert!(a.volume(TENANT, "held").is_none(), "settled, not attached");
    let lease = c.catalog.get_lease(TENANT, "held").await.unwrap();
    assert_eq!(lease.holder, None, "its lease is let go");
    let b = Engine::open_with(c.config("b"), c.catalog.clone(), store.clone(), fs.clone());
    let v = b.unwrap().attach(TENANT, "held").await.unwrap();
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(1));
}

/// Two processes on one data directory share the node's id, so the lease takes them for one
/// writer: each attachment holds its workspace's lock file, and the second engine (a second
/// process: flock locks of two open files exclude each other) is refused attach, a held call
/// and delete while the first serves it, instead of opening (and then removing) the same
/// journal under a live export. Once the first detaches, the second attaches normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_the_data_directory_cannot_open_an_attached_journal() {
    let c = Cluster::new().await;
    let first = c.node("a");
    let second = c.node("a");
    let v = empty_volume(&first, "w", 1 << 20, Mode::Durable).await;
    write_tag(&v, 7, 0, 4).await;
    v.flush().await.unwrap();
    let refused = |r: strata_engine::Result<()>, what: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("attached by another process"), "{what}: {e}");
    };
    refused(second.attach(TENANT, "w").await.map(|_| ()), "attach");
    refused(
        second.checkpoint(TENANT, "w", None).await.map(|_| ()),
        "checkpoint",
    );
    refused(second.delete_workspace(TENANT, "w").await, "delete");
    // The first still serves the workspace, its journal whole.
    write_tag(&v, 8, 4, 4).await;
    v.flush().await.unwrap();
    let img = image(&v).await;
    first.detach(TENANT, "w").await.unwrap();
    let v2 = second.attach(TENANT, "w").await.unwrap();
    assert_eq!(image(&v2).await, img);
    second.detach(TENANT, "w").await.unwrap();
}
