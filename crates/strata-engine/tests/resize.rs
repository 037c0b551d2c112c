//! Growing a disk: a `resize` version carries the larger size into the catalog with the head
//! CAS, writes past the old end are refused until then and kept after, every older version
//! keeps its own size (forks, exports), a rollback never shrinks the disk, and a crash after a
//! grow replays the writes past the old end.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

use common::*;
use strata_engine::{CheckpointKind, Error, Mode};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_grows_under_a_writer_and_every_version_keeps_its_size() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", MIB, Mode::Durable).await;
    let last = MIB / 4096 - 1;
    v.write(last * 4096, &tagged(1, last), false).await.unwrap();
    v.flush().await.unwrap();
    assert!(matches!(
        v.write(MIB, &tagged(1, 256), false).await,
        Err(Error::OutOfRange { .. })
    ));
    let before = a.checkpoint(TENANT, "w", None).await.unwrap().version;

    // A writer flushes tagged blocks inside the old end while the disk grows.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (v, stop) = (v.clone(), stop.clone());
        tokio::spawn(async move {
            let mut flushed = std::collections::HashMap::new();
            for i in 0u64.. {
                if stop.load(SeqCst) {
                    break;
                }
                let lba = (i * 37) % last;
                v.write(lba * 4096, &tagged(i + 10, lba), false)
                    .await
                    .unwrap();
                v.flush().await.unwrap();
                flushed.insert(lba, i + 10);
            }
            flushed
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let p = v.grow(2 * MIB + 1).await.unwrap().expect("a new version");
    assert_eq!(v.size(), 2 * MIB + 4096, "rounded up to whole blocks");
    stop.store(true, SeqCst);
    let flushed = writer.await.unwrap();
    assert!(!flushed.is_empty());
    let ws = a.workspace(TENANT, "w").await.unwrap();
    assert_eq!((ws.disk_size, ws.head_version), (2 * MIB + 4096, p.version));
    let log = a.log(TENANT, "w").await.unwrap();
    assert_eq!(log.last().unwrap().kind, CheckpointKind::Resize);

    // Past the old end now; the same size again is nothing to do; smaller is refused.
    v.write(300 * 4096, &tagged(7, 300), false).await.unwrap();
    v.flush().await.unwrap();
    assert!(v.grow(2 * MIB + 4096).await.unwrap().is_none());
    assert!(matches!(v.grow(MIB).await, Err(Error::Invalid(_))));
    assert!(matches!(v.grow(u64::MAX).await, Err(Error::Invalid(_))));
    let grown = a.checkpoint(TENANT, "w", None).await.unwrap().version;

    // Each version keeps its size: a fork or export of the old one is the old disk.
    let old = a
        .fork(TENANT, "w", Some(before), "old", None)
        .await
        .unwrap();
    assert_eq!(old.disk_size, MIB);
    let out = c.path("old.raw");
    assert_eq!(
        a.export(TENANT, "w", Some(before), &out).await.unwrap(),
        MIB
    );
    assert_eq!(std::fs::metadata(&out).unwrap().len(), MIB);
    let new = a.fork(TENANT, "w", None, "new", None).await.unwrap();
    assert_eq!(new.disk_size, 2 * MIB + 4096);

    // Rolled back to before the grow, the disk keeps its size; the new end reads as zeros.
    a.rollback(TENANT, "w", before).await.unwrap();
    assert_eq!(v.size(), 2 * MIB + 4096);
    assert_eq!(
        tag_of(&v.read(300 * 4096, 4096).await.unwrap(), 300),
        Some(0)
    );
    assert_eq!(
        tag_of(&v.read(last * 4096, 4096).await.unwrap(), last),
        Some(1)
    );
    assert_eq!(
        a.workspace(TENANT, "w").await.unwrap().disk_size,
        2 * MIB + 4096
    );
    a.rollback(TENANT, "w", grown).await.unwrap();
    assert_eq!(
        tag_of(&v.read(300 * 4096, 4096).await.unwrap(), 300),
        Some(7)
    );
    for (&lba, &tag) in &flushed {
        let got = tag_of(&v.read(lba * 4096, 4096).await.unwrap(), lba).unwrap();
        assert!(got >= tag, "block {lba}: flushed {tag}, read {got}");
    }

    // Another node sees the grown disk with its data.
    a.detach(TENANT, "w").await.unwrap();
    let b = c.node("b");
    let v = b.attach(TENANT, "w").await.unwrap();
    assert_eq!(v.size(), 2 * MIB + 4096);
    assert_eq!(
        tag_of(&v.read(300 * 4096, 4096).await.unwrap(), 300),
        Some(7)
    );
    // An unattached workspace grows through the engine (attached for the call).
    b.detach(TENANT, "w").await.unwrap();
    assert_eq!(b.grow(TENANT, "w", 4 * MIB).await.unwrap(), 4 * MIB);
    assert!(b.volume(TENANT, "w").is_none());
    assert_eq!(b.workspace(TENANT, "w").await.unwrap().disk_size, 4 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_grow_replays_the_writes_past_the_old_end() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", MIB, Mode::Durable).await;
    v.grow(3 * MIB).await.unwrap();
    for lba in [0u64, 256, 700] {
        v.write(lba * 4096, &tagged(lba + 1, lba), false)
            .await
            .unwrap();
    }
    v.flush().await.unwrap();
    drop(v);
    a.abandon().await;
    // The same node starts again: the journal's writes past the old end replay.
    let a = c.node("a");
    let v = a.attach(TENANT, "w").await.unwrap();
    assert_eq!(v.size(), 3 * MIB);
    for lba in [0u64, 256, 700] {
        assert_eq!(
            tag_of(&v.read(lba * 4096, 4096).await.unwrap(), lba),
            Some(lba + 1)
        );
    }
    // Grown again (a publish of the replayed writes with it); this node is lost too: another
    // node's export of the head has the size and the writes past the first end.
    v.grow(4 * MIB).await.unwrap().expect("a new version");
    drop(v);
    a.abandon().await;
    let b = c.node("b");
    let out = c.path("w.raw");
    assert_eq!(b.export(TENANT, "w", None, &out).await.unwrap(), 4 * MIB);
    let img = std::fs::read(&out).unwrap();
    for lba in [0u64, 256, 700] {
        let at = (lba * 4096) as usize;
        assert_eq!(tag_of(&img[at..at + 4096], lba), Some(lba + 1));
    }
}

/// A grow whose head CAS committed but whose reply was lost, with the catalog unreadable
/// meanwhile: the grow fails and the size stays (nothing past the old end is accepted); once
/// the catalog answers, the next publish adopts the committed version and its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grow_whose_reply_is_lost_is_adopted_later() {
    use common::faults::LossyCatalog;
    let c = Cluster::new().await;
    let lossy = LossyCatalog::new(c.catalog.clone());
    let a = strata_engine::Engine::open_with(
        c.config("a"),
        lossy.clone(),
        c.store.clone(),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    let catalog_size = async || {
        c.catalog
            .get_workspace(TENANT, "w")
            .await
            .unwrap()
            .disk_size
    };
    let v = empty_volume(&a, "w", MIB, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    lossy.lose_next_cas_reply.store(true, SeqCst);
    lossy.blind.store(true, SeqCst);
    assert!(v.grow(2 * MIB).await.is_err());
    assert_eq!(v.size(), MIB);
    assert!(matches!(
        v.write(300 * 4096, &tagged(2, 300), false).await,
        Err(Error::OutOfRange { .. })
    ));
    lossy.blind.store(false, SeqCst);
    assert_eq!(catalog_size().await, 2 * MIB);
    v.checkpoint(None).await.unwrap();
    assert_eq!(v.size(), 2 * MIB);
    v.write(300 * 4096, &tagged(2, 300), false).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(tag_of(&v.read(0, 4096).await.unwrap(), 0), Some(1));
    // A grow with nothing left pending: a later publish keeps the size it has.
    v.checkpoint(None).await.unwrap();
    assert_eq!(catalog_size().await, 2 * MIB);
}
