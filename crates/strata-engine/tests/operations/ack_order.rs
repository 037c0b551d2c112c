//! The acknowledgement order of the write fast path: a write is acknowledged only once every
//! record reserved before it has landed (replay stops at the first missing record).

use super::*;

/// Releases the stalled file operation on drop, so a failing assertion fails the test
/// instead of hanging it.
struct Release(Arc<Switches>);
impl Drop for Release {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Runs `v.write(at, data)` on a thread of its own and returns once its record's `pwrite` has
/// stalled (a switch of `sw` set by the caller), with the guard that releases it.
async fn stalled_write(
    v: &Arc<strata_engine::Volume>,
    sw: &Arc<Switches>,
    at: u64,
    data: Vec<u8>,
) -> (std::thread::JoinHandle<strata_engine::Result<()>>, Release) {
    let v = v.clone();
    let write = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(v.write(at, &data, false))
    });
    tokio::task::spawn_blocking({
        let sw = sw.clone();
        move || sw.wait_stalled()
    })
    .await
    .unwrap();
    (write, Release(sw.clone()))
}

/// Writes reserved after a record whose `pwrite` has not happened yet land beside it, but
/// are not acknowledged until it lands: replay stops at the first record missing from the
/// journal, so a write acknowledged past one would not survive a kill -9 that came first.
/// Once the older record lands, the younger ones are acknowledged and flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_acknowledged_only_once_every_older_record_has_landed() {
    let c = Cluster::new().await;
    let sw = Arc::new(Switches::default());
    sw.in_place.store(true, SeqCst);
    let a = c.node_with(c.config("a"), Arc::new(FaultFs(sw.clone())));
    let v = empty_volume(&a, "order", DISK, Mode::Durable).await;
    v.prepare_journal().await.unwrap(); // rotates onto a prepared segment
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.flush().await.unwrap();
    sw.stall_next_write.store(true, SeqCst);
    let (first, release) = stalled_write(&v, &sw, 4096, tagged(2, 1)).await;
    let later: Vec<_> = (2..6u64)
        .map(|b| {
            let v = v.clone();
            tokio::spawn(async move { v.write(b * 4096, &tagged(b + 1, b), false).await })
        })
        .collect();
    assert!(
        eventually(|| v.stats().appends_unlocked >= 5).await,
        "the later writes did not land beside the stalled one"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        later.iter().all(|w| !w.is_finished()),
        "a write was acknowledged past an older record still in flight"
    );
    assert!(v.stats().acks_held >= 4, "{:?}", v.stats());
    drop(release);
    first.join().unwrap().unwrap();
    for w in later {
        w.await.unwrap().unwrap();
    }
    v.flush().await.unwrap();
    let img = image(&v).await;
    assert_eq!(&img[..6], &[1, 2, 3, 4, 5, 6]);
}

/// The rule above for writes that arrive together ([`strata_engine::Volume::write_many`]):
/// a group reserved after a stalled record lands in one journal write beside it, and none of
/// its writes is acknowledged until the stalled record lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_arrive_together_wait_for_every_older_record() {
    let c = Cluster::new().await;
    let sw = Arc::new(Switches::default());
    sw.in_place.store(true, SeqCst);
    let a = c.node_with(c.config("a"), Arc::new(FaultFs(sw.clone())));
    let v = empty_volume(&a, "group", DISK, Mode::Durable).await;
    v.prepare_journal().await.unwrap(); // rotates onto a prepared segment
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.flush().await.unwrap();
    sw.stall_next_write.store(true, SeqCst);
    let (first, release) = stalled_write(&v, &sw, 4096, tagged(2, 1)).await;
    let group = {
        let v = v.clone();
        tokio::spawn(async move {
            let blocks: Vec<(u64, Vec<u8>)> =
                (2..6u64).map(|b| (b * 4096, tagged(b + 1, b))).collect();
            let writes: Vec<(u64, &[u8])> = blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
            v.write_many(&writes).await
        })
    };
    assert!(
        eventually(|| v.stats().appends_grouped >= 4).await,
        "the group did not land in one write beside the stalled record: {:?}",
        v.stats()
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !group.is_finished(),
        "a group was acknowledged past an older record still in flight"
    );
    drop(release);
    first.join().unwrap().unwrap();
    let results = group.await.unwrap();
    assert_eq!(results.len(), 4);
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    v.flush().await.unwrap();
    let img = image(&v).await;
    assert_eq!(&img[..6], &[1, 2, 3, 4, 5, 6]);
}

/// The kill -9 of the rule above: a record that never lands (its writer died, or its
/// `pwrite` failed) leaves a hole replay stops at. Writes reserved after it are not
/// acknowledged, a flush waiting for it fails rather than sync past the hole, and after the
/// process is gone every write that was acknowledged reads back on the next attach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_never_lands_leaves_no_acknowledged_write_behind_it() {
    let c = Cluster::new().await;
    let sw = Arc::new(Switches::default());
    sw.in_place.store(true, SeqCst);
    let cfg = c.config("a");
    let a = c.node_with(cfg.clone(), Arc::new(FaultFs(sw.clone())));
    let v = empty_volume(&a, "hole", DISK, Mode::Durable).await;
    v.prepare_journal().await.unwrap(); // rotates onto a prepared segment
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.flush().await.unwrap();
    assert!(
        v.stats().appends_unlocked >= 1,
        "the write path took the lock"
    );
    sw.stall_then_fail_next_write.store(true, SeqCst);
    let (first, release) = stalled_write(&v, &sw, 4096, tagged(2, 1)).await;
    // Reserved after the stalled one and landed first: written, not acknowledged.
    let later = {
        let v = v.clone();
        tokio::spawn(async move { v.write(2 * 4096, &tagged(3, 2), false).await })
    };
    assert!(eventually(|| v.stats().appends_unlocked >= 2).await);
    // A flush sent once the later write has landed (not acknowledged: a flush sent before
    // that owes it nothing and may return at once) must wait for the record in flight.
    let flush = tokio::spawn({
        let v = v.clone();
        async move { v.flush().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !later.is_finished(),
        "a write was acknowledged past a record still in flight"
    );
    assert!(
        !flush.is_finished(),
        "the flush did not wait for the record in flight"
    );
    // The process dies here: the stalled record is never written.
    drop(release);
    assert!(
        first.join().unwrap().is_err(),
        "the failed record was acknowledged"
    );
    assert!(
        later.await.unwrap().is_err(),
        "a write behind the hole was acknowledged"
    );
    assert!(
        flush.await.unwrap().is_err(),
        "a flush synced past a hole and reported success"
    );
    assert!(v.failure().is_some());
    a.abandon().await;
    drop(v);
    let b = c.node_with(cfg, Arc::new(FaultFs(Arc::new(Switches::default()))));
    let v = b.attach(TENANT, "hole").await.unwrap();
    let img = image(&v).await;
    assert_eq!(img[0], 1, "the flushed write was lost");
    b.abandon().await;
}

/// A group stalled in its journal write is still in flight for a freeze: the freeze waits for
/// it to land and be acknowledged (it holds the write gate as a single write does), so a
/// frozen volume acknowledges nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freeze_waits_for_a_group_in_flight() {
    let c = Cluster::new().await;
    let sw = Arc::new(Switches::default());
    sw.in_place.store(true, SeqCst);
    let a = c.node_with(c.config("a"), Arc::new(FaultFs(sw.clone())));
    let v = empty_volume(&a, "gfreeze", DISK, Mode::Durable).await;
    v.prepare_journal().await.unwrap(); // rotates onto a prepared segment
    v.write(0, &tagged(1, 0), false).await.unwrap();
    sw.stall_next_write.store(true, SeqCst);
    let group = {
        let v = v.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let blocks: Vec<(u64, Vec<u8>)> =
                        (1..4u64).map(|b| (b * 4096, tagged(b + 1, b))).collect();
                    let writes: Vec<(u64, &[u8])> =
                        blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
                    v.write_many(&writes).await
                })
        })
    };
    tokio::task::spawn_blocking({
        let sw = sw.clone();
        move || sw.wait_stalled()
    })
    .await
    .unwrap();
    let release = Release(sw.clone());
    let freeze = tokio::spawn({
        let v = v.clone();
        async move { v.freeze().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !freeze.is_finished(),
        "the freeze returned with a group of writes still in flight"
    );
    drop(release);
    let results = group.join().unwrap();
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    freeze.await.unwrap();
    v.thaw().await;
    assert_eq!(&image(&v).await[..4], &[1, 2, 3, 4]);
}

/// A group refused by a full disk after a short write (some of its records whole on disk past
/// the segment's end) leaves nothing that replays: the next write takes the group's first
/// sequence number, and a stale second record after it would otherwise replay as the next one,
/// putting back a write that was refused over one acknowledged and flushed before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_cut_short_by_a_full_disk_leaves_nothing_to_replay() {
    let c = Cluster::new().await;
    let sw = Arc::new(Switches::default());
    let cfg = c.config("a");
    let a = c.node_with(cfg.clone(), Arc::new(FaultFs(sw.clone())));
    let v = empty_volume(&a, "short", DISK, Mode::Durable).await;
    v.write(11 * 4096, &tagged(5, 11), false).await.unwrap();
    v.flush().await.unwrap();
    // Two of the three records land whole, then the disk is full.
    sw.short_next_write.store(2 * (40 + 4096), SeqCst);
    let blocks: Vec<(u64, Vec<u8>)> = (10..13u64).map(|b| (b * 4096, tagged(1, b))).collect();
    let writes: Vec<(u64, &[u8])> = blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
    let results = v.write_many(&writes).await;
    assert!(
        results.iter().all(|r| matches!(r, Err(Error::NoSpace(_)))),
        "{results:?}"
    );
    assert!(v.failure().is_none(), "a full disk failed the volume");
    // The same size as the group's first record: written exactly over it.
    v.write(20 * 4096, &tagged(2, 20), false).await.unwrap();
    v.flush().await.unwrap();
    a.abandon().await;
    drop(v);
    let b = c.node_with(cfg, Arc::new(FaultFs(Arc::new(Switches::default()))));
    let v = b.attach(TENANT, "short").await.unwrap();
    let img = image(&v).await;
    assert_eq!(img[20], 2, "the flushed write was lost");
    assert_eq!(img[11], 5, "a refused write replayed over a flushed one");
    assert_eq!((img[10], img[12]), (0, 0), "a refused write replayed");
    b.abandon().await;
}
