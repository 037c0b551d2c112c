//! Forks of a live workspace: constant time on the node that holds it (the fork shares the
//! source's journal through hard links), usable at once, independent afterwards, published in
//! the background and then attachable anywhere; never served stale by another node before that.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata_catalog::CheckpointKind;
use strata_engine::{Engine, Error, Mode};
use strata_simfs::SimFs;

const BLOCKS: u64 = 256;
const DISK: u64 = BLOCKS * 4096;

/// The fork `ws` starts exactly at its source's checkpoint: a live fork's version 2 is that
/// checkpoint itself (it rebased onto it: the same manifest, nothing uploaded again); a fork
/// taken from the published checkpoint (the source had published past the fork's cut) starts
/// on its manifest. Returns how many rebased.
async fn rebased(c: &Cluster, ws: &str) -> usize {
    let w = c.catalog.get_workspace(TENANT, ws).await.unwrap();
    let (src, v) = w
        .source
        .strip_prefix("ws:")
        .and_then(|s| s.split_once('@'))
        .unwrap();
    let at = c
        .catalog
        .get_checkpoint(TENANT, src, v.parse().unwrap())
        .await
        .unwrap();
    let first = c.catalog.get_checkpoint(TENANT, ws, 1).await.unwrap();
    if first.kind != CheckpointKind::LiveFork {
        assert_eq!(first.manifest, at.manifest, "{ws} forked from {}", w.source);
        return 0;
    }
    let second = c.catalog.get_checkpoint(TENANT, ws, 2).await.unwrap();
    assert_eq!(
        second.manifest, at.manifest,
        "{ws} rebased onto {}",
        w.source
    );
    assert_eq!(second.bytes, 0, "{ws} uploaded nothing for its start");
    1
}

/// Waits until the live fork `ws` has published and been let go of on `node`.
async fn released(node: &Arc<Engine>, ws: &str) {
    let t = Instant::now();
    // Let go of: detached here and its lease released (that comes just after the detach).
    while node.volume(TENANT, ws).is_some()
        || node.workspace(TENANT, ws).await.unwrap().head_version < 2
        || node
            .catalog()
            .get_lease(TENANT, ws)
            .await
            .unwrap()
            .holder
            .is_some()
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{ws} was not published and released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_is_usable_at_once_independent_and_published() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 64).await;
    v.checkpoint(None).await.unwrap();
    // Dirty data: flushed, and acknowledged but not flushed.
    write_tag(&v, 2, 32, 64).await;
    v.flush().await.unwrap();
    write_tag(&v, 3, 90, 10).await;
    let at_fork = image(&v).await;
    let w = a.fork(TENANT, "w", None, "f", None).await.unwrap();
    assert_eq!(w.head_version, 1);
    let log = a.log(TENANT, "f").await.unwrap();
    assert_eq!(log[0].kind, CheckpointKind::LiveFork);
    // Usable at once on this node, with everything acknowledged before the fork.
    let f = a.attach(TENANT, "f").await.unwrap();
    assert_eq!(image(&f).await, at_fork);
    // Independent from here on, while the source's segments are published, retired and
    // (unshared ones) recycled by later writes.
    write_tag(&f, 4, 0, 8).await;
    for round in 0..6u64 {
        write_tag(&v, 10 + round, 100, 100).await;
        v.checkpoint(None).await.unwrap();
    }
    let mut expect = at_fork.clone();
    expect[..8].fill(4);
    assert_eq!(image(&f).await, expect, "the fork reads its own data");
    let src = image(&v).await;
    assert_eq!(
        &src[..8],
        &[1; 8],
        "the source does not see the fork's writes"
    );
    assert_eq!(&src[100..200], &[15; 100]);
    // Attached here, the fork is refused elsewhere; once published and detached, another node
    // restores it from the object store alone.
    let b = c.node("b");
    assert!(b.attach(TENANT, "f").await.is_err());
    f.flush().await.unwrap();
    a.detach(TENANT, "f").await.unwrap();
    let fb = b.attach(TENANT, "f").await.unwrap();
    assert_eq!(image(&fb).await, expect);
    b.detach(TENANT, "f").await.unwrap();
    a.detach(TENANT, "w").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclaimed_live_fork_publishes_and_is_let_go() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 128).await;
    let at_fork = image(&v).await;
    a.fork(TENANT, "w", None, "f", None).await.unwrap();
    released(&a, "f").await;
    assert_eq!(rebased(&c, "f").await, 1);
    let b = c.node("b");
    let fb = b.attach(TENANT, "f").await.unwrap();
    assert_eq!(image(&fb).await, at_fork);
    b.detach(TENANT, "f").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_parallel_forks_of_one_live_workspace_restore_on_another_node() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, BLOCKS).await;
    v.checkpoint(None).await.unwrap();
    write_tag(&v, 2, 0, 128).await;
    let at_fork = image(&v).await;
    // A writer keeps going on the source while the forks are taken (its blocks lie above 200).
    let writer = {
        let v = v.clone();
        tokio::spawn(async move {
            for i in 0..200u64 {
                write_tag(&v, 1000 + i, 200 + i % 56, 1).await;
            }
        })
    };
    let names: Vec<String> = (0..8).map(|i| format!("f{i}")).collect();
    let forks =
        futures::future::join_all(names.iter().map(|n| a.fork(TENANT, "w", None, n, None))).await;
    writer.await.unwrap();
    let mut expect = Vec::new();
    for (i, (n, r)) in names.iter().zip(forks).enumerate() {
        r.unwrap_or_else(|e| panic!("fork {n}: {e}"));
        let f = a.attach(TENANT, n).await.unwrap();
        let img = image(&f).await;
        // Below block 200 every fork holds exactly the data from before the forks began; above,
        // whatever of the concurrent writer's blocks came before its own cut.
        assert_eq!(&img[..200], &at_fork[..200], "{n}");
        let tag = 100 + i as u64;
        write_tag(&f, tag, 8 * i as u64, 8).await;
        let mut e = img.clone();
        e[8 * i..8 * i + 8].fill(tag);
        assert_eq!(image(&f).await, e, "{n} reads its own writes only");
        let p = a.checkpoint(TENANT, n, None).await.unwrap();
        expect.push((n.clone(), p.version, e));
    }
    let mut live = 0;
    for (n, _, _) in &expect {
        a.detach(TENANT, n).await.unwrap();
        live += rebased(&c, n).await;
    }
    eprintln!("{live} of 8 forks were live forks and rebased");
    assert!(live > 0);
    let b = c.node("b");
    for (n, version, e) in &expect {
        let f = b.attach(TENANT, n).await.unwrap();
        assert_eq!(f.head_version(), *version);
        assert_eq!(&image(&f).await, e, "{n} restored on another node");
        b.detach(TENANT, n).await.unwrap();
    }
    a.detach(TENANT, "w").await.unwrap();
}

/// A fork rebases only onto its very cut: when the source's checkpoint never published (its
/// node crashed) and another node committed other data under that version number, the fork
/// uploads its own data, and reads exactly as at the fork everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_never_rebases_onto_another_node_s_version() {
    let c = Cluster::new().await;
    let lossy = common::faults::LossyCatalog::new(c.catalog.clone());
    let cfg = c.config("a");
    let a = Engine::open_with(
        cfg.clone(),
        lossy.clone(),
        c.store.clone(),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, BLOCKS).await;
    v.checkpoint(None).await.unwrap();
    // From here the catalog refuses every head CAS of this node: the fork's cut (version 3 of
    // the source) stays local, and so does the fork.
    lossy
        .refuse_cas
        .store(true, std::sync::atomic::Ordering::SeqCst);
    write_tag(&v, 2, 0, 128).await;
    let at_fork = image(&v).await;
    a.fork(TENANT, "w", None, "f", None).await.unwrap();
    assert_eq!(
        c.catalog
            .get_workspace(TENANT, "w")
            .await
            .unwrap()
            .head_version,
        2
    );
    let lease = v.lease();
    a.abandon().await;
    drop(v);
    // Node b takes the source over from its head and commits other data as version 3.
    c.catalog.release_lease(TENANT, "w", &lease).await.unwrap();
    let b = c.node("b");
    let vb = b.attach(TENANT, "w").await.unwrap();
    write_tag(&vb, 9, 0, 16).await;
    assert_eq!(b.checkpoint(TENANT, "w", None).await.unwrap().version, 3);
    b.detach(TENANT, "w").await.unwrap();
    // Node a restarts: the fork publishes its own data instead of rebasing onto b's version 3.
    let a2 = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let f = a2.attach(TENANT, "f").await.unwrap();
    assert_eq!(image(&f).await, at_fork);
    a2.checkpoint(TENANT, "f", None).await.unwrap();
    let second = c.catalog.get_checkpoint(TENANT, "f", 2).await.unwrap();
    assert!(second.bytes > 0, "the fork uploaded its data");
    let w3 = c.catalog.get_checkpoint(TENANT, "w", 3).await.unwrap();
    assert_ne!(second.manifest, w3.manifest);
    a2.detach(TENANT, "f").await.unwrap();
    let fb = b.attach(TENANT, "f").await.unwrap();
    assert_eq!(
        image(&fb).await,
        at_fork,
        "the fork restored on another node"
    );
    b.detach(TENANT, "f").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_survives_power_loss_and_is_never_served_stale_elsewhere() {
    let c = Cluster::new().await;
    let disk = SimFs::new();
    let cfg = c.config("p");
    let a = c.node_with(cfg.clone(), Arc::new(disk.process()));
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 64).await;
    v.checkpoint(None).await.unwrap();
    write_tag(&v, 2, 16, 64).await;
    let at_fork = image(&v).await;
    a.fork(TENANT, "f", None, "g", None).await.unwrap_err();
    a.fork(TENANT, "w", None, "f", None).await.unwrap();
    write_tag(&a.attach(TENANT, "f").await.unwrap(), 3, 0, 4).await;
    // Power cut right away (the fork's publish may or may not have started; nothing after the
    // fork was flushed, so the fork reads as at the fork or with its unflushed write).
    disk.power_loss(7, true);
    a.abandon().await;
    drop(v);
    let a2 = c.node_with(cfg, Arc::new(disk.process()));
    let f = a2.attach(TENANT, "f").await.unwrap();
    let got = image(&f).await;
    let mut with_write = at_fork.clone();
    with_write[..4].fill(3);
    assert!(
        got == at_fork || got == with_write,
        "the fork after power loss"
    );
    let src = a2.attach(TENANT, "w").await.unwrap();
    assert_eq!(image(&src).await, at_fork, "the source after power loss");
    // The fork's head is still its `livefork` base if it has not published: another node must
    // refuse it rather than serve that base, once the lease is free.
    let fork_head = a2.workspace(TENANT, "f").await.unwrap().head_version;
    eprintln!("fork head after the power loss: v{fork_head}");
    if fork_head == 1 {
        let lease = f.lease();
        a2.abandon().await;
        c.catalog.release_lease(TENANT, "f", &lease).await.unwrap();
        let b = c.node("b");
        match b.attach(TENANT, "f").await {
            Err(Error::Unavailable(_, why)) => assert!(why.contains("live workspace"), "{why}"),
            other => panic!(
                "a stale live fork was attached elsewhere: {:?}",
                other.map(|_| ())
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_of_a_clean_workspace_leaves_the_node_and_its_start_is_never_a_disk() {
    let c = Cluster::new().await;
    let a = c.node("a");
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 16).await;
    v.checkpoint(None).await.unwrap();
    // Nothing dirty: the fork still publishes a version of its own and is let go.
    a.fork(TENANT, "w", None, "f", None).await.unwrap();
    // Its version 1 is the start of a live fork: no fork, export or rollback reads it as a disk.
    assert!(a.fork(TENANT, "f", Some(1), "g", None).await.is_err());
    assert!(a
        .export(TENANT, "f", Some(1), &c.path("f1.raw"))
        .await
        .is_err());
    released(&a, "f").await;
    let b = c.node("b");
    let fb = b.attach(TENANT, "f").await.unwrap();
    assert_eq!(&image(&fb).await[..16], &[1; 16]);
    assert!(b.rollback(TENANT, "f", 1).await.is_err());
    b.detach(TENANT, "f").await.unwrap();
    // Later versions are disks like any other.
    b.fork(TENANT, "f", None, "g", None).await.unwrap();
    let g = b.attach(TENANT, "g").await.unwrap();
    assert_eq!(&image(&g).await[..16], &[1; 16]);
}

/// One power cut at every file-system step of a live fork (and of whatever else ran then: the
/// source's background publish, the fork's own): after the restart the source reads what it
/// flushed, and the fork either does not exist or exists whole, reading the source at its cut
/// (its catalog row is never ahead of its local files); an absent fork's name can be made
/// again, and what the fork left on the node never replays onto that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_at_any_step_of_a_live_fork_leaves_it_whole_or_absent() {
    let mut steps = None;
    let mut k = 1;
    let (mut whole, mut absent) = (0, 0);
    while steps.is_none_or(|n| k <= n + 2) {
        let c = Cluster::new().await;
        let disk = SimFs::new();
        let cfg = c.config("p");
        let a = c.node_with(cfg.clone(), Arc::new(disk.process()));
        let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
        write_tag(&v, 1, 0, 64).await;
        let cp = v.checkpoint(None).await.unwrap().version;
        let at_checkpoint = image(&v).await;
        write_tag(&v, 2, 16, 64).await;
        v.flush().await.unwrap(); // flushed, unpublished: what the fork inherits
        let at_fork = image(&v).await;
        let before = disk.counter("op");
        if steps.is_some() {
            disk.power_loss_after(k, k);
        }
        let forked = a.fork(TENANT, "w", None, "f", None).await;
        if steps.is_none() {
            // The dry run: how many steps a fork takes (its background publish may add some).
            forked.unwrap();
            steps = Some(disk.counter("op") - before);
            eprintln!("a live fork took {} file-system steps", steps.unwrap());
            continue;
        }
        // Let whatever is still running meet the cut (or finish, past the last step).
        tokio::time::sleep(Duration::from_millis(20)).await;
        disk.power_loss_after(0, 0); // disarmed, if nothing met it
        disk.power_loss(k, true);
        a.abandon().await;
        drop(v);
        let a2 = c.node_with(cfg, Arc::new(disk.process()));
        let src = a2.attach(TENANT, "w").await.unwrap();
        assert_eq!(image(&src).await, at_fork, "step {k}: the source");
        match c.catalog.get_workspace(TENANT, "f").await {
            Ok(_) => {
                let f = a2
                    .attach(TENANT, "f")
                    .await
                    .unwrap_or_else(|e| panic!("step {k}: the fork's row is there: {e}"));
                assert_eq!(image(&f).await, at_fork, "step {k}: the fork");
                whole += 1;
            }
            Err(_) => {
                assert!(forked.is_err(), "step {k}: an acknowledged fork is gone");
                assert!(
                    a2.attach(TENANT, "f").await.is_err(),
                    "step {k}: a fork without a row was attached"
                );
                // The name made again elsewhere, from the checkpoint the interrupted fork's
                // base was (the same manifest, as version 1): attached here, what the fork left
                // in this node's directory must not replay onto it.
                c.node("b")
                    .fork(TENANT, "w", Some(cp), "f", None)
                    .await
                    .unwrap();
                let f = a2.attach(TENANT, "f").await.unwrap();
                assert_eq!(
                    image(&f).await,
                    at_checkpoint,
                    "step {k}: the name made again from the checkpoint"
                );
                absent += 1;
            }
        }
        a2.abandon().await;
        k += 1;
    }
    eprintln!("{whole} cuts left the fork whole, {absent} left none");
    assert!(whole > 0 && absent > 0);
}

/// A fork's marker whose removal was not synced can come back after a power cut, on a fork
/// that has published and taken writes since, its version 1 pruned: it is settled by the head
/// having been published from the directory's journal, and the flushed writes stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_marker_back_after_its_first_version_is_pruned_keeps_the_fork() {
    let c = Cluster::new().await;
    let cfg = c.config("a");
    let a = c.node_with(cfg.clone(), Arc::new(strata_engine::fs::RealFs));
    let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
    write_tag(&v, 1, 0, 32).await;
    v.flush().await.unwrap();
    a.fork(TENANT, "w", None, "f", None).await.unwrap();
    released(&a, "f").await;
    let f = a.attach(TENANT, "f").await.unwrap();
    f.checkpoint(None).await.unwrap(); // published from this node's journal
    write_tag(&f, 3, 8, 8).await;
    f.flush().await.unwrap(); // flushed, not published
    let want = image(&f).await;
    a.abandon().await;
    drop((f, v));
    let w = c.catalog.get_workspace(TENANT, "f").await.unwrap();
    let dir = cfg.data_dir.join("volumes").join(TENANT).join("f");
    std::fs::write(dir.join("forking.json"), &w.source).unwrap();
    c.catalog
        .expire_checkpoints(TENANT, "f", &[1])
        .await
        .unwrap();
    c.catalog
        .purge_expired_checkpoints(TENANT, 0)
        .await
        .unwrap();
    assert!(c.catalog.get_checkpoint(TENANT, "f", 1).await.is_err());
    let a2 = c.node_with(cfg, Arc::new(strata_engine::fs::RealFs));
    let f = a2.attach(TENANT, "f").await.unwrap();
    assert_eq!(image(&f).await, want, "the fork's flushed writes");
    assert!(!dir.join("forking.json").exists(), "the marker is settled");
}

/// Two live forks in a row with no write between them: the second links the segment the
/// first one's cut rotated into, which never got a record. A power cut after each fork
/// flushed a write of its own loses neither write (the second fork's replay must not end at
/// that segment's header).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_in_a_row_keep_their_flushed_writes_through_a_power_cut() {
    // Uploads slow enough that no fork has published (and let go of its links) by the cut.
    let store = slow_store(300);
    for seed in 0..4 {
        let c = Cluster::new().await;
        let disk = SimFs::new();
        let cfg = c.config("p");
        let node = |cfg: strata_engine::EngineConfig, fs: SimFs| {
            Engine::open_with(cfg, c.catalog.clone(), store.clone(), Arc::new(fs)).unwrap()
        };
        let a = node(cfg.clone(), disk.process());
        let v = empty_volume(&a, "w", DISK, Mode::Durable).await;
        write_tag(&v, 1, 0, 64).await;
        v.flush().await.unwrap();
        a.fork(TENANT, "w", None, "f1", None).await.unwrap();
        a.fork(TENANT, "w", None, "f2", None).await.unwrap();
        a.fork(TENANT, "w", None, "f3", None).await.unwrap();
        let mut want = vec![];
        for (i, f) in ["f1", "f2", "f3"].into_iter().enumerate() {
            let fv = a.attach(TENANT, f).await.unwrap();
            write_tag(&fv, 10 + i as u64, 4 * i as u64, 4).await;
            fv.flush().await.unwrap();
            want.push(image(&fv).await);
        }
        disk.power_loss(seed, true);
        a.abandon().await;
        drop(v);
        let a2 = node(cfg, disk.process());
        for (i, f) in ["f1", "f2", "f3"].into_iter().enumerate() {
            let fv = a2.attach(TENANT, f).await.unwrap();
            assert_eq!(
                image(&fv).await,
                want[i],
                "seed {seed}: {f}'s flushed write"
            );
        }
        a2.abandon().await;
    }
}

/// An in-memory object store whose every put takes `ms` milliseconds.
fn slow_store(ms: u64) -> strata_store::Store {
    use object_store::throttle::{ThrottleConfig, ThrottledStore};
    let cfg = ThrottleConfig {
        wait_put_per_call: Duration::from_millis(ms),
        ..ThrottleConfig::default()
    };
    let inner = ThrottledStore::new(object_store::memory::InMemory::new(), cfg);
    strata_store::Store::from_object_store(Arc::new(inner), "slow")
}

/// A node dies holding a live fork that has not published yet; the fork (unavailable
/// everywhere else, as its error says) is deleted on another node and forked again there from
/// the checkpoint the dead fork's base was: the same version-1 manifest. When the first node
/// comes back, the dead fork's journal must not replay onto the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_s_unpublished_fork_never_replays_onto_a_namesake() {
    let c = Cluster::new().await;
    let store = slow_store(2000); // the fork does not publish before the node dies
    let node = |n: &str| {
        Engine::open_with(
            c.config(n),
            c.catalog.clone(),
            store.clone(),
            Arc::new(strata_engine::fs::RealFs),
        )
        .unwrap()
    };
    let a = node("a");
    let v = empty_volume(&a, "s", DISK, Mode::Durable).await;
    let base = v.checkpoint(None).await.unwrap().version; // the source's published base
    write_tag(&v, 5, 0, 16).await;
    v.flush().await.unwrap(); // unpublished: inherited by the fork only
    a.fork(TENANT, "s", None, "f", None).await.unwrap();
    let fv = a.attach(TENANT, "f").await.unwrap();
    write_tag(&fv, 9, 32, 8).await;
    fv.flush().await.unwrap(); // the fork's own write, only in its journal
    let (f_lease, s_lease) = (fv.lease(), v.lease());
    drop(fv);
    a.abandon().await; // node a dies
    drop(v);
    c.catalog
        .release_lease(TENANT, "f", &f_lease)
        .await
        .unwrap(); // (expired)
    c.catalog
        .release_lease(TENANT, "s", &s_lease)
        .await
        .unwrap();
    assert_eq!(
        c.catalog
            .get_workspace(TENANT, "f")
            .await
            .unwrap()
            .head_version,
        1
    );
    // Node a comes back with its object store out of reach: the fork's attach gets past the
    // marker's check (the catalog has this fork) and fails in the open. The marker must stay.
    let cut_off = Engine::open_with(
        c.config("a"),
        c.catalog.clone(),
        strata_store::Store::from_object_store(
            Arc::new(object_store::memory::InMemory::new()),
            "empty",
        ),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    assert!(cut_off.attach(TENANT, "f").await.is_err());
    cut_off.abandon().await;
    let held = c.catalog.get_lease(TENANT, "f").await.unwrap();
    if let Some(node) = held.holder {
        let grant = strata_catalog::LeaseGrant {
            node,
            epoch: held.epoch,
            expires_ms: held.expires_ms,
        };
        c.catalog.release_lease(TENANT, "f", &grant).await.unwrap(); // (expired)
    }
    let b = node("b");
    b.delete_workspace(TENANT, "f").await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // From the checkpoint the dead fork's base was (the source's head, unless the dead node's
    // publish of the fork's cut got through first).
    b.fork(TENANT, "s", Some(base), "f", None).await.unwrap();
    let want = image(&b.attach(TENANT, "f").await.unwrap()).await;
    assert!(
        want[32..40].iter().all(|&t| t == 0),
        "the dead fork's own write is not in the new one"
    );
    b.detach(TENANT, "f").await.unwrap();
    let a = node("a");
    let f = a.attach(TENANT, "f").await.unwrap();
    assert_eq!(
        image(&f).await,
        want,
        "the dead fork's journal replayed onto its namesake"
    );
}
