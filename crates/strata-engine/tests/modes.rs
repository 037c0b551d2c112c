//! The durability modes, fencing, concurrent checkpoints and corruption handling.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use std::sync::atomic::Ordering::SeqCst;
use strata_catalog::CatalogError;
use strata_engine::fs::RealFs;
use strata_engine::{Engine, Error, Mode, Source};
use strata_simfs::SimFs;

const DISK: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_flush_does_not_fsync_durable_does() {
    let c = Cluster::new().await;
    for (mode, unsafe_, want_sync) in [
        (Mode::Ephemeral, false, false),
        (Mode::Durable, false, true),
        (Mode::Durable, true, false),
    ] {
        let fs = Arc::new(SimFs::new());
        let mut cfg = c.config("n");
        cfg.cache_unsafe = unsafe_;
        let node = c.node_with(cfg, fs.clone());
        let name = format!("m-{mode}-{unsafe_}");
        let v = empty_volume(&node, &name, DISK, mode).await;
        let before = fs.counter("sync_data");
        v.write(0, &[1; 4096], false).await.unwrap();
        v.flush().await.unwrap();
        assert_eq!(
            fs.counter("sync_data") > before,
            want_sync,
            "{mode} unsafe={unsafe_}"
        );
        assert_eq!(v.flush_honoured(), want_sync);
        node.abandon().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_one_fsync_for_many_writers() {
    let c = Cluster::new().await;
    let fs = Arc::new(SimFs::new());
    let node = c.node_with(c.config("n"), fs.clone());
    let v = empty_volume(&node, "g", DISK, Mode::Durable).await;
    for i in 0..64u64 {
        v.write(i * 4096, &tagged(i + 1, i), false).await.unwrap();
    }
    let before = fs.counter("sync_data");
    let flushes: Vec<_> = (0..16)
        .map(|_| {
            let v = v.clone();
            tokio::spawn(async move { v.flush().await })
        })
        .collect();
    for f in flushes {
        f.await.unwrap().unwrap();
    }
    // One segment was dirty: all 16 flushes are covered by one fdatasync.
    assert_eq!(fs.counter("sync_data") - before, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_mode_flush_reaches_the_object_store() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "s", DISK, Mode::Sync).await;
    v.write(8192, &tagged(9, 2), false).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(v.stats().window_bytes, 0);
    // The host is lost: another node restores from the head alone.
    a.abandon().await;
    let out = c.path("s.raw");
    c.node("b").export(TENANT, "s", None, &out).await.unwrap();
    let img = std::fs::read(&out).unwrap();
    assert_eq!(tag_of(&img[8192..12288], 2), Some(9));
}

/// A writer past the window's byte bound wakes the uploader at once: with an upload tick of a
/// second, the publish starts well before the tick (a fast writer would otherwise run a whole
/// tick of bytes ahead of its uploads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_the_byte_bound_starts_an_upload_before_the_next_tick() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.upload_interval = Duration::from_secs(3600); // The tick: a second (its upper clamp).
    cfg.upload_max_bytes = 256 << 10;
    let a = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let v = empty_volume(&a, "d", DISK, Mode::Durable).await;
    // Right after a tick began, so the next one is about a second away.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let start = std::time::Instant::now();
    write_tag(&v, 3, 0, 64).await; // 256 KiB: the bound.
    while v.stats().head_version < 2 {
        assert!(
            start.elapsed() < Duration::from_millis(700),
            "no upload {:?} after the window crossed its byte bound",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(v.stats().window_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_window_is_bounded_by_the_upload_interval() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.upload_interval = Duration::from_millis(200);
    let a = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let v = empty_volume(&a, "d", DISK, Mode::Durable).await;
    v.write(0, &tagged(5, 0), false).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(v.stats().window_bytes, 4096);
    let start = std::time::Instant::now();
    while v.stats().window_bytes > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "window never drained"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(v.stats().head_version >= 2);
    let log = a.log(TENANT, "d").await.unwrap();
    assert_eq!(
        log.last().unwrap().kind,
        strata_engine::CheckpointKind::Auto
    );
    a.abandon().await;
    let out = c.path("d.raw");
    c.node("b").export(TENANT, "d", None, &out).await.unwrap();
    assert_eq!(tag_of(&std::fs::read(&out).unwrap()[..4096], 0), Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checkpoints_get_distinct_versions_and_lose_nothing() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "r", DISK, Mode::Durable).await;
    let mut tasks = vec![];
    for i in 0..8u64 {
        let (v, a) = (v.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            v.write(i * 4096, &tagged(i + 1, i), false).await.unwrap();
            a.checkpoint(TENANT, "r", Some(format!("cp{i}")))
                .await
                .unwrap()
                .version
        }));
    }
    let mut versions = vec![];
    for t in tasks {
        versions.push(t.await.unwrap());
    }
    versions.sort();
    versions.dedup();
    assert_eq!(versions.len(), 8, "every checkpoint got its own version");
    let log = a.log(TENANT, "r").await.unwrap();
    let vs: Vec<u64> = log.iter().map(|c| c.version).collect();
    assert_eq!(vs, (1..=9).collect::<Vec<_>>(), "linear history");
    a.abandon().await;
    let out = c.path("r.raw");
    c.node("b").export(TENANT, "r", None, &out).await.unwrap();
    let img = std::fs::read(&out).unwrap();
    for i in 0..8u64 {
        assert_eq!(
            tag_of(&img[(i * 4096) as usize..((i + 1) * 4096) as usize], i),
            Some(i + 1)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_writer_cannot_move_the_head() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.lease_ttl = Duration::from_millis(300);
    cfg.upload_interval = Duration::from_secs(3600);
    let a = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let va = empty_volume(&a, "f", DISK, Mode::Durable).await;
    va.write(0, &tagged(1, 0), false).await.unwrap();
    a.checkpoint(TENANT, "f", None).await.unwrap();
    // Node b cannot attach while a's lease is live, and the error names the holder.
    let b = c.node("b");
    let e = b.attach(TENANT, "f").await.err().unwrap();
    assert!(e.to_string().contains("\"a\""), "{e}");
    // a stops renewing (paused); b takes over after expiry.
    a.stop_background().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let vb = b.attach(TENANT, "f").await.unwrap();
    assert_eq!(tag_of(&vb.read(0, 4096).await.unwrap(), 0), Some(1));
    vb.write(4096, &tagged(2, 1), false).await.unwrap();
    b.checkpoint(TENANT, "f", None).await.unwrap();
    // a wakes up: its lease ran out locally, so it no longer acknowledges writes or flushes;
    // its checkpoint is fenced and its volume refuses writes from then on.
    let e = va.write(8192, &tagged(3, 2), false).await.unwrap_err();
    assert!(e.to_string().contains("lease"), "{e}");
    assert!(
        va.flush().await.is_err(),
        "no flush succeeds without a lease"
    );
    let head_before = c.catalog.get_workspace(TENANT, "f").await.unwrap();
    // Refused: at once, since its lease ran out locally (no local receipt either), or by the
    // catalog's fence.
    let e = va.checkpoint(None).await.unwrap_err();
    assert!(
        matches!(e, Error::Catalog(CatalogError::Fenced { .. }))
            || matches!(&e, Error::Unavailable(_, why) if why.contains("lease")),
        "{e}"
    );
    let e = va.checkpoint_with(None, None, false).await.unwrap_err();
    assert!(
        e.to_string().contains("lease"),
        "a local receipt without a lease: {e}"
    );
    let head_after = c.catalog.get_workspace(TENANT, "f").await.unwrap();
    assert_eq!(head_before.head_version, head_after.head_version);
    assert!(matches!(
        va.write(8192, &tagged(3, 2), false).await,
        Err(Error::Unavailable(..))
    ));
    assert_eq!(
        tag_of(&vb.read(8192, 4096).await.unwrap(), 2),
        Some(0),
        "a's write never reached b"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_renew_stops_acknowledging_before_its_lease_can_be_taken() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.lease_ttl = Duration::from_millis(500);
    let a = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let va = empty_volume(&a, "r", DISK, Mode::Durable).await;
    va.write(0, &tagged(1, 0), false).await.unwrap();
    va.flush().await.unwrap();
    // Renewals stop (the catalog is unreachable from here, or the node is paused).
    a.stop_background().await;
    let granted = c.catalog.get_lease(TENANT, "r").await.unwrap();
    let t0 = std::time::Instant::now();
    loop {
        match va.write(4096, &tagged(2, 1), false).await {
            Ok(()) => {
                assert!(
                    t0.elapsed() < Duration::from_millis(500),
                    "acknowledged past the TTL"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => {
                assert!(e.to_string().contains("lease"), "{e}");
                break;
            }
        }
    }
    // The refusal came while the catalog still counted the lease as live: nobody could have
    // taken the workspace yet.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        now < granted.expires_ms,
        "refused only after the catalog expiry"
    );
    assert!(!va.lease_ok());
    assert!(va.flush().await.is_err());
    // Reads still work; a successful renewal (nobody took over) restores writes.
    assert_eq!(tag_of(&va.read(0, 4096).await.unwrap(), 0), Some(1));
    va.renew_lease().await.unwrap();
    va.write(8192, &tagged(3, 2), false).await.unwrap();
    va.flush().await.unwrap();
}

/// A node renews every lease it holds in one catalog call per period, not one call per
/// workspace: with 64 workspaces and a 2 s TTL, per-workspace renewals were 128 fsync'd catalog
/// transactions a second, and under a heavy write load they fell behind until leases ran out
/// (the soak test saw writes refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_renews_all_its_leases_in_one_call_per_period() {
    let c = Cluster::new().await;
    let mut cfg = c.config("a");
    cfg.lease_ttl = Duration::from_millis(400);
    let lossy = common::faults::LossyCatalog::new(c.catalog.clone());
    let a = Engine::open_with(cfg, lossy.clone(), c.store.clone(), Arc::new(RealFs)).unwrap();
    let n = 24;
    let mut vols = vec![];
    for i in 0..n {
        vols.push(empty_volume(&a, &format!("l{i}"), DISK, Mode::Durable).await);
    }
    let (calls0, leases0) = (
        lossy.batch_renewals.load(SeqCst),
        lossy.batched_leases.load(SeqCst),
    );
    // Three TTLs: without renewals every lease would have run out locally by now.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for (i, v) in vols.iter().enumerate() {
        assert!(v.lease_ok(), "l{i} lost its lease");
        v.write(0, &tagged(1, 0), false).await.unwrap();
        v.flush().await.unwrap();
    }
    let calls = lossy.batch_renewals.load(SeqCst) - calls0;
    let leases = lossy.batched_leases.load(SeqCst) - leases0;
    eprintln!("{calls} renewal calls carried {leases} leases in 1.2 s");
    // One call per 100 ms period (a quarter TTL), each carrying every workspace.
    assert!((6..=14).contains(&calls), "{calls} calls");
    assert_eq!(leases, calls * n);
    assert_eq!(lossy.single_renewals.load(SeqCst), 0);
    // A paused node stops renewing all of them.
    a.stop_background().await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(vols.iter().all(|v| !v.lease_ok()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_objects_and_manifests_are_errors_not_data() {
    use object_store::{ObjectStoreExt, PutPayload};
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "x", DISK, Mode::Durable).await;
    v.write(0, &vec![0xab; 65536], false).await.unwrap();
    let p = a.checkpoint(TENANT, "x", None).await.unwrap();
    a.detach(TENANT, "x").await.unwrap();
    let m = c
        .store
        .get_manifest(TENANT, &p.manifest.unwrap())
        .await
        .unwrap();
    let obj = m.objects[0];
    let key = strata_store::Store::object_key(TENANT, &obj.id);
    let mut raw = c
        .store
        .default_inner()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    raw[100] ^= 1;
    c.store
        .default_inner()
        .put(&key, PutPayload::from(raw))
        .await
        .unwrap();
    // A node with a cold cache must refuse to serve the corrupted range.
    let b = c.node("b");
    let vb = b.attach(TENANT, "x").await.unwrap();
    let e = vb.read(0, 4096).await.unwrap_err();
    assert!(
        matches!(e, Error::Store(strata_store::StoreError::Corrupt(_))),
        "{e}"
    );
    b.detach(TENANT, "x").await.unwrap();
    // A corrupt manifest is refused at attach.
    let head = c.catalog.get_workspace(TENANT, "x").await.unwrap();
    let mkey = strata_store::Store::manifest_key(TENANT, &head.head_manifest);
    let mut mraw = c
        .store
        .default_inner()
        .get(&mkey)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let n = mraw.len();
    mraw[n - 40] ^= 1;
    c.store
        .default_inner()
        .put(&mkey, PutPayload::from(mraw))
        .await
        .unwrap();
    let e = c.node("c").attach(TENANT, "x").await.err().unwrap();
    assert!(e.to_string().contains("manifest"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors() {
    let c = Cluster::new().await;
    let a = c.node("a");
    for bad in ["../x", "a/b", "a\0b", &"x".repeat(300), ""] {
        let e = a
            .create_workspace(
                TENANT,
                bad,
                Source::Empty { size: DISK },
                Mode::Durable,
                None,
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("workspace name"), "{e}");
    }
    let v = empty_volume(&a, "ok", DISK, Mode::Durable).await;
    assert!(matches!(
        v.write(DISK - 10, &[1; 20], false).await,
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        v.read(u64::MAX - 5, 10).await,
        Err(Error::OutOfRange { .. })
    ));
    assert!(a.workspace("other", "ok").await.unwrap_err().is_not_found());
    assert!(a
        .fork(TENANT, "nope", None, "n2", None)
        .await
        .unwrap_err()
        .is_not_found());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_journal_recovers_a_clean_prefix() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "t", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.flush().await.unwrap();
    v.write(4096, &tagged(2, 1), false).await.unwrap();
    a.abandon().await;
    drop(v);
    // Chop the last record in half, as a torn write would.
    let jdir = c.path("a/volumes/acme/t/journal");
    let mut segs: Vec<_> = std::fs::read_dir(&jdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segs.sort();
    let seg = segs
        .iter()
        .rev()
        .find(|p| std::fs::metadata(p).unwrap().len() > 0)
        .unwrap();
    let len = std::fs::metadata(seg).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(seg).unwrap();
    f.set_len(len - 2000).unwrap();
    let a2 = c.node("a");
    let v = a2.attach(TENANT, "t").await.unwrap();
    let img = v.read(0, 8192).await.unwrap();
    assert_eq!(tag_of(&img[..4096], 0), Some(1));
    assert_eq!(
        tag_of(&img[4096..], 1),
        Some(0),
        "the torn record is dropped, not half-applied"
    );
    v.write(4096, &tagged(3, 1), true).await.unwrap();
    assert_eq!(tag_of(&v.read(4096, 4096).await.unwrap(), 1), Some(3));
}

#[test]
fn unsafe_env_only_exact_one() {
    for v in ["true", "yes", "", " 1", "1 "] {
        assert!(!strata_engine::cache_unsafe(Some(v)));
    }
    assert!(strata_engine::cache_unsafe(Some("1")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_overwrites_do_not_grow_local_space() {
    let c = Cluster::new().await;
    let fs = Arc::new(SimFs::new());
    let mut cfg = c.config("n");
    cfg.segment_max_bytes = 128 << 10;
    let node = c.node_with(cfg, fs.clone());
    let v = empty_volume(&node, "e", DISK, Mode::Ephemeral).await;
    // 64 passes over the same 256 KiB: 16 MiB written, 256 KiB live.
    for pass in 0..64u64 {
        for b in 0..64u64 {
            v.write(b * 4096, &tagged(pass + 1, b), false)
                .await
                .unwrap();
        }
        v.clean_journal(512 << 10).await.unwrap();
    }
    let s = v.stats();
    assert_eq!(s.journal_live_bytes, 256 << 10);
    assert!(
        s.journal_bytes <= 2 * (256 << 10) + (512 << 10) + (128 << 10),
        "journal grew to {}",
        s.journal_bytes
    );
    assert!(
        fs.total_bytes() < 2 << 20,
        "local files hold {} bytes",
        fs.total_bytes()
    );
    let img = v.read(0, 64 * 4096).await.unwrap();
    for b in 0..64u64 {
        assert_eq!(
            tag_of(&img[(b * 4096) as usize..((b + 1) * 4096) as usize], b),
            Some(64)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeze_holds_writes_until_thaw_and_checkpoint_works_while_frozen() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "z", DISK, Mode::Durable).await;
    v.write(0, &tagged(1, 0), false).await.unwrap();
    v.freeze().await;
    assert!(v.is_frozen());
    let v2 = v.clone();
    let pending = tokio::spawn(async move { v2.write(4096, &tagged(2, 1), false).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !pending.is_finished(),
        "a write was acknowledged while frozen"
    );
    // The checkpoint taken inside the pause window holds exactly the pre-freeze writes.
    let p = v
        .checkpoint(Some("paired with memory snapshot".into()))
        .await
        .unwrap();
    assert_eq!(
        tag_of(&v.read(0, 4096).await.unwrap(), 0),
        Some(1),
        "reads continue while frozen"
    );
    v.thaw().await;
    pending.await.unwrap().unwrap();
    let out = c.path("z.raw");
    a.export(TENANT, "z", Some(p.version), &out).await.unwrap();
    let img = std::fs::read(&out).unwrap();
    assert_eq!(tag_of(&img[..4096], 0), Some(1));
    assert_eq!(
        tag_of(&img[4096..8192], 1),
        Some(0),
        "the held write is not in the checkpoint"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_on_an_s3_protocol_server() {
    let Some(c) = Cluster::new_s3().await else {
        return;
    };
    let a = c.node("a");
    let v = empty_volume(&a, "s3ws", DISK, Mode::Sync).await;
    v.write(0, &vec![3u8; 300_000], false).await.unwrap();
    v.flush().await.unwrap();
    let p = a
        .checkpoint(TENANT, "s3ws", Some("on s3".into()))
        .await
        .unwrap();
    a.fork(TENANT, "s3ws", Some(p.version), "s3fork", None)
        .await
        .unwrap();
    a.abandon().await;
    // Another node, nothing local, restores both from the S3 store.
    let b = c.node("b");
    let vb = b.attach(TENANT, "s3fork").await.unwrap();
    let got = vb.read(0, 300_000).await.unwrap();
    assert!(got.iter().all(|&x| x == 3));
    assert!(
        b.reader().stats().gets > 0,
        "the read came from the object store"
    );
}

/// Regression (found by the 10,000-case power-loss campaign, seed 4586): cleaning must carry
/// forward live trims, not only live data, or a trimmed block reverts to its published bytes
/// once the segment holding the trim record is reclaimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleaning_keeps_trims_across_power_loss() {
    let c = Cluster::new().await;
    let fs = Arc::new(SimFs::new());
    let mut cfg = c.config("n");
    cfg.segment_max_bytes = 64 << 10;
    let node = c.node_with(cfg.clone(), fs.clone());
    let v = empty_volume(&node, "t", DISK, Mode::Durable).await;
    v.write(5 * 4096, &tagged(1, 5), false).await.unwrap();
    node.checkpoint(TENANT, "t", None).await.unwrap();
    v.trim(5 * 4096, 4096).await.unwrap();
    for i in 0..40u64 {
        v.write((10 + i % 4) * 4096, &tagged(i + 2, 10 + i % 4), false)
            .await
            .unwrap();
    }
    v.flush().await.unwrap();
    v.clean_journal(0).await.unwrap();
    assert_eq!(tag_of(&v.read(5 * 4096, 4096).await.unwrap(), 5), Some(0));
    node.abandon().await;
    drop(v);
    fs.power_loss(1, true);
    let v = c.node_with(cfg, fs).attach(TENANT, "t").await.unwrap();
    assert_eq!(
        tag_of(&v.read(5 * 4096, 4096).await.unwrap(), 5),
        Some(0),
        "the trim was lost"
    );
}

/// Cleaning copies live records forward in pieces, taking the writer lock per piece, while the
/// guest goes on writing, trimming, flushing and checkpointing: a copy must never put back a
/// block's older bytes over a newer write (or trim) that landed between the piece's read and
/// its copy, a cut taken meanwhile keeps the victim, and after a power cut (no final flush) the
/// disk is a state at or after the last flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleaning_beside_writers_never_copies_an_overwritten_block_back() {
    const BLOCKS: u64 = 32;
    let c = Cluster::new().await;
    let fs = Arc::new(SimFs::new());
    let mut cfg = c.config("n");
    cfg.segment_max_bytes = 64 << 10;
    let node = c.node_with(cfg.clone(), fs.clone());
    let v = empty_volume(&node, "race", DISK, Mode::Durable).await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cleaner = {
        let (v, done) = (v.clone(), done.clone());
        tokio::spawn(async move {
            let (mut passes, mut reclaimed) = (0u64, 0u64);
            while !done.load(SeqCst) {
                reclaimed += v.clean_journal(0).await.unwrap();
                passes += 1;
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
            (passes, reclaimed)
        })
    };
    let mut model = vec![0u64; BLOCKS as usize];
    let mut states = vec![model.clone()];
    let mut flushed = 0usize;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 1..=4000u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let b = rng % BLOCKS;
        if (rng >> 40).is_multiple_of(10) {
            v.trim(b * 4096, 4096).await.unwrap();
            model[b as usize] = 0;
        } else {
            v.write(b * 4096, &tagged(i, b), false).await.unwrap();
            model[b as usize] = i;
        }
        states.push(model.clone());
        if i.is_multiple_of(250) {
            v.flush().await.unwrap();
            flushed = states.len() - 1;
        }
        if i.is_multiple_of(700) {
            // A cut (and its publish) racing the cleaner: the victim must stay for it.
            node.checkpoint(TENANT, "race", None).await.unwrap();
        }
        if i.is_multiple_of(4) {
            // Often, so that a stale copy is seen before a later write hides it.
            assert_eq!(
                image(&v).await[..BLOCKS as usize],
                model[..],
                "read after op {i}"
            );
        }
    }
    // Unflushed overwrites after the last flush, cleaned too (its copies must be synced
    // before a victim goes, or flushed blocks die with it), then the power cut.
    for k in 0..96u64 {
        let b = k % BLOCKS;
        v.write(b * 4096, &tagged(5000 + k, b), false)
            .await
            .unwrap();
        model[b as usize] = 5000 + k;
        states.push(model.clone());
        if k.is_multiple_of(8) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    done.store(true, SeqCst);
    let (passes, reclaimed) = cleaner.await.unwrap();
    eprintln!("cleaning: {passes} passes beside the writer, {reclaimed} bytes reclaimed");
    assert!(reclaimed > 0, "cleaning never reclaimed a segment");
    assert_eq!(
        image(&v).await[..BLOCKS as usize],
        model[..],
        "read before the power cut"
    );
    node.abandon().await;
    drop(v);
    fs.power_loss(7, true);
    let node2 = c.node_with(cfg, fs.clone());
    let v = node2.attach(TENANT, "race").await.unwrap();
    let got = image(&v).await[..BLOCKS as usize].to_vec();
    assert!(
        states[flushed..].contains(&got),
        "recovered disk is no state at or after the last flush (op {flushed}): {got:?}"
    );
}
