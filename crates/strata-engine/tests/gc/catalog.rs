//! GC from the catalog's record of the reference graph (issue 46): a pass reads no manifest
//! and lists nothing unless it reconciles; what it deletes is decided by its own mark and the
//! store's clock.

use super::*;

/// The mark reads the catalog's record of the reference graph, not the manifests (issue 46): a
/// pass needs no manifest from the store, even with every manifest key out of its reach, and
/// loses nothing; a manifest the catalog has no record of is read from the store, and what it
/// references is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_reads_the_catalogs_record_not_the_manifests() {
    let c = Cluster::new().await;
    let node = c.node("a");
    let v = empty_volume(&node, "ws", DISK, Mode::Durable).await;
    let mut m = Model::default();
    let mut disk = Disk::new();
    for tag in 1..=4u64 {
        write_tag(&v, tag, tag * 3, 4).await;
        for lba in tag * 3..tag * 3 + 4 {
            disk.insert(lba, tag);
        }
        let version = v.checkpoint(None).await.unwrap().version;
        m.cps.insert(("ws".to_string(), version), disk.clone());
    }
    let mut opts = gc_opts(16);
    opts.compact_below = None;
    let verify = |n: u32| {
        let (c, m) = (&c, &m);
        async move {
            for ((ws, v), want) in &m.cps {
                assert_eq!(
                    &read_fresh(c, ws, Some(*v), n + *v as u32).await,
                    want,
                    "{ws}@{v}"
                );
            }
        }
    };
    let gets = node.reader().store().manifest_gets();
    let r = node.gc(&opts).await.unwrap();
    assert_eq!(
        r.manifests_read, 0,
        "every manifest was recorded when it was written"
    );
    assert!(r.live_manifests >= 4, "{r:?}");
    assert_eq!(
        node.reader().store().manifest_gets(),
        gets,
        "a manifest GET"
    );

    // Every manifest key out of the pass's reach: a pass that fetched one would stop.
    let man = c.path(&format!("objects/t/{TENANT}/man"));
    let hidden = c.path("man-hidden");
    std::fs::rename(&man, &hidden).unwrap();
    let r = node.gc(&opts).await;
    std::fs::rename(&hidden, &man).unwrap();
    let r = r.expect("a pass that needs no manifest from the store");
    assert_eq!(r.manifests_read, 0);
    verify(100).await;

    // Manifests the catalog has no record of: read from the store by every pass (a dry run
    // too), and nothing they reference is lost.
    let refs = c.catalog.gc_references(TENANT, 0).await.unwrap();
    c.catalog
        .prune_references(TENANT, &refs, &[])
        .await
        .unwrap();
    let mut dry = opts.clone();
    dry.dry_run = true;
    let r = node.gc(&dry).await.unwrap();
    assert_eq!(r.manifests_read, refs.len() as u64);
    for n in [200, 300] {
        let r = node.gc(&opts).await.unwrap();
        assert_eq!(r.manifests_read, refs.len() as u64);
        verify(n).await;
    }
}

/// A pass without reconciliation lists nothing (issue 46): a deleted workspace's data goes by
/// the catalog's stale records alone; a key the catalog never knew (an upload whose publish was
/// cut off before recording it) waits for a reconciliation pass, which lists the store once per
/// tenant and deletes it two passes later. What is retained reads back throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_pass_lists_nothing_and_a_reconciliation_finds_the_unknown() {
    let c = Cluster::new().await;
    let node = c.node("a");
    let mut m = Model::default();
    for (tag, ws) in [(1u64, "gone"), (2, "stay")] {
        let v = empty_volume(&node, ws, DISK, Mode::Durable).await;
        write_tag(&v, tag, 0, 8).await;
        let version = v.checkpoint(None).await.unwrap().version;
        if ws == "stay" {
            m.cps.insert(
                (ws.to_string(), version),
                (0..8).map(|l| (l, tag)).collect(),
            );
        }
    }
    // An upload the catalog never recorded, older than any grace.
    let orphan = c.path(&format!("objects/t/{TENANT}/obj/ee/{}", "ee".repeat(32)));
    std::fs::create_dir_all(orphan.parent().unwrap()).unwrap();
    std::fs::write(&orphan, b"an upload whose publish was cut off").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&orphan)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(7200))
        .unwrap();
    node.delete_workspace(TENANT, "gone").await.unwrap();

    let store = node.reader().store().clone();
    let listed = store.tenant_listings();
    let incremental = GcOptions {
        reconcile: false,
        compact_below: None,
        ..gc_opts(16)
    };
    let (mut deleted, mut bytes) = (0, 0);
    for _ in 0..3 {
        let r = node.gc(&incremental).await.unwrap();
        assert!(!r.reconciled && r.stored_keys == 0, "{r:?}");
        deleted += r.deleted_keys;
        bytes += r.deleted_bytes;
    }
    assert_eq!(
        store.tenant_listings(),
        listed,
        "an incremental pass listed the store"
    );
    assert!(
        deleted >= 3,
        "the deleted workspace's object and manifests: {deleted}"
    );
    assert!(
        bytes >= 8 * 4096,
        "the deleted workspace's 8 blocks: {bytes}"
    );
    assert!(
        orphan.exists(),
        "unknown to the catalog: only a listing finds it"
    );
    for ((ws, v), want) in &m.cps {
        assert_eq!(&read_fresh(&c, ws, Some(*v), 1).await, want);
    }
    let reconcile = GcOptions {
        reconcile: true,
        ..incremental.clone()
    };
    for pass in 1..=2u64 {
        let r = node.gc(&reconcile).await.unwrap();
        assert!(r.reconciled && r.stored_keys > 0, "{r:?}");
        assert_eq!(
            store.tenant_listings(),
            listed + pass,
            "one listing per tenant"
        );
    }
    assert!(
        !orphan.exists(),
        "condemned by one reconciliation, deleted by the next"
    );
    for ((ws, v), want) in &m.cps {
        assert_eq!(&read_fresh(&c, ws, Some(*v), 2).await, want);
    }
    no_garbage(&c).await;
}

/// A workspace "gone" with 8 blocks of tag 7 checkpointed, deleted: its head manifest.
async fn deleted_workspace(node: &Arc<Engine>) -> strata_format::Hash {
    let v = empty_volume(node, "gone", DISK, Mode::Durable).await;
    write_tag(&v, 7, 0, 8).await;
    v.checkpoint(None).await.unwrap();
    let head = node.workspace(TENANT, "gone").await.unwrap().head_manifest;
    node.delete_workspace(TENANT, "gone").await.unwrap();
    head
}

/// A condemned key that is referenced again before its deletion is kept and forgotten, in a
/// pass that lists nothing as in one that does: a deletion is decided by that pass's mark.
/// (Nothing strata does references unreferenced data again; a template row naming a deleted
/// workspace's manifest stands in for any way it might.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_condemned_key_referenced_again_is_kept() {
    for reconcile in [false, true] {
        let c = Cluster::new().await;
        let node = c.node("a");
        let head = deleted_workspace(&node).await;
        let opts = GcOptions {
            reconcile,
            compact_below: None,
            ..gc_opts(16)
        };
        let r = node.gc(&opts).await.unwrap();
        assert!(r.condemned >= 2, "{r:?}");
        c.catalog
            .create_template(&strata_catalog::Template {
                tenant: TENANT.into(),
                name: "revived".into(),
                manifest: head,
                disk_size: DISK,
                stored_bytes: 0,
                created_ms: strata_format::now_ms(),
            })
            .await
            .unwrap();
        // (The deleted workspace's first, empty manifest stays unreferenced and goes.)
        for _ in 0..2 {
            let r = node.gc(&opts).await.unwrap();
            assert!(r.deleted_keys <= 1, "reconcile {reconcile}: {r:?}");
        }
        assert!(
            c.catalog.gc_condemned(TENANT).await.unwrap().is_empty(),
            "reconcile {reconcile}: referenced again, so forgotten"
        );
        node.create_workspace(
            TENANT,
            "back",
            Source::Template("revived".into()),
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        let mut want = Disk::new();
        want.extend((0..8).map(|l| (l, 7)));
        assert_eq!(
            read_fresh(&c, "back", None, 1).await,
            want,
            "reconcile {reconcile}"
        );
    }
}

/// A condemned key written again before its deletion (a salt drawn twice for the same content:
/// two builds of one image) is not deleted: the store's clock says it is new, as a listing said
/// before the sweep came from the catalog. With and without a listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_condemned_key_written_again_is_not_deleted() {
    for reconcile in [false, true] {
        let c = Cluster::new().await;
        let node = c.node("a");
        let head = deleted_workspace(&node).await;
        let m = c.store.get_manifest(TENANT, &head).await.unwrap();
        let obj = m.objects[0].id;
        let path = c.path(&format!(
            "objects/{}",
            strata_store::Store::object_key(TENANT, &obj)
        ));
        let grace = Duration::from_millis(1500);
        let opts = GcOptions {
            reconcile,
            grace,
            compact_below: None,
            ..gc_opts(16)
        };
        tokio::time::sleep(grace + Duration::from_millis(200)).await;
        let r = node.gc(&opts).await.unwrap();
        assert!(r.condemned >= 1, "reconcile {reconcile}: {r:?}");
        tokio::time::sleep(grace + Duration::from_millis(200)).await;
        // The same bytes put again under the same key.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        node.gc(&opts).await.unwrap();
        assert!(
            path.exists(),
            "reconcile {reconcile}: a key written again was deleted"
        );
    }
}

/// Every file under `dir` (the keys of one tenant in the local store).
fn files_under(dir: &std::path::Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            if e.file_type().unwrap().is_dir() {
                files_under(&e.path())
            } else {
                1
            }
        })
        .sum()
}

/// One tenant's store failing does not stop GC for the others (issue 46; tenants have buckets
/// of their own): the pass names the tenant in `failed_tenants` and collects every other
/// tenant's garbage; once the store is back, later passes collect the failed tenant's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_store_fails_does_not_stop_gc_for_the_others() {
    let c = Cluster::new().await;
    // Sorts before TENANT: a pass meets it first.
    const FIRST: &str = "aaa";
    c.catalog.create_tenant(FIRST).await.unwrap();
    let node = c.node("a");
    for t in [FIRST, TENANT] {
        let src = Source::Empty { size: DISK };
        node.create_workspace(t, "gone", src, Mode::Durable, None)
            .await
            .unwrap();
        let v = node.attach(t, "gone").await.unwrap();
        write_tag(&v, 1, 0, 8).await;
        v.checkpoint(None).await.unwrap();
        drop(v);
        node.delete_workspace(t, "gone").await.unwrap();
    }
    let keys = |t: &str| files_under(&c.path(&format!("objects/t/{t}")));
    let (first_keys, acme_keys) = (keys(FIRST), keys(TENANT));
    assert!(
        first_keys >= 2 && acme_keys >= 2,
        "{first_keys} {acme_keys}"
    );
    let opts = GcOptions {
        reconcile: false,
        compact_below: None,
        ..gc_opts(16)
    };

    // FIRST's store breaks: its prefix is a file, so every key under it fails (ENOTDIR), the
    // way a bucket that refuses its credentials fails every request.
    let dir = c.path(&format!("objects/t/{FIRST}"));
    let moved = c.path("first-moved");
    std::fs::rename(&dir, &moved).unwrap();
    std::fs::write(&dir, b"not a directory").unwrap();
    let mut deleted = 0;
    for pass in 0..3 {
        let r = node
            .gc(&opts)
            .await
            .expect("the pass goes on past a tenant");
        assert_eq!(r.tenants, 2, "{r:?}");
        if pass > 0 {
            // The first pass condemns; FIRST's keys are touched from the second on.
            assert_eq!(
                r.failed_tenants
                    .iter()
                    .map(|f| f.tenant.as_str())
                    .collect::<Vec<_>>(),
                [FIRST],
                "{r:?}"
            );
            assert!(!r.failed_tenants[0].error.is_empty());
        }
        deleted += r.deleted_keys;
    }
    assert_eq!(keys(TENANT), 0, "the other tenant's garbage is collected");
    assert!(deleted >= acme_keys as u64, "{deleted} of {acme_keys}");

    // Back: the next passes collect FIRST's garbage, which the failures left in place.
    std::fs::remove_file(&dir).unwrap();
    std::fs::rename(&moved, &dir).unwrap();
    assert_eq!(keys(FIRST), first_keys);
    for _ in 0..3 {
        let r = node.gc(&opts).await.unwrap();
        assert!(r.failed_tenants.is_empty(), "{r:?}");
    }
    assert_eq!(
        keys(FIRST),
        0,
        "the failed tenant's garbage, once its store is back"
    );
}

/// A pass costs what changed since the pass before it (issue 46): after no change it looks at
/// no catalog change and no workspace's retention, and makes no store request; after K new
/// versions of one workspace it looks at about K changes and that workspace alone. What is
/// retained reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_after_no_change_looks_at_nothing_and_one_after_k_versions_at_k() {
    let c = Cluster::new().await;
    let node = c.node("a");
    let mut m = Model::default();
    let mut vols = vec![];
    for i in 0..4u64 {
        let name = format!("w{i}");
        let v = empty_volume(&node, &name, DISK, Mode::Durable).await;
        let mut disk = Disk::new();
        for tag in 1..=4u64 {
            write_tag(&v, 10 * i + tag, tag, 2).await;
            disk.insert(tag, 10 * i + tag);
            disk.insert(tag + 1, 10 * i + tag);
            let version = v.checkpoint(None).await.unwrap().version;
            m.cps.insert((name.clone(), version), disk.clone());
        }
        vols.push(v);
    }
    let opts = GcOptions {
        reconcile: false,
        compact_below: None,
        ..gc_opts(16)
    };
    let first = node.gc(&opts).await.unwrap();
    assert!(
        first.changes >= 16 && first.retention_looked == 4,
        "{first:?}"
    );
    let store = node.reader().store().clone();
    let (gets, listed) = (store.manifest_gets(), store.tenant_listings());
    for _ in 0..2 {
        let r = node.gc(&opts).await.unwrap();
        assert_eq!((r.changes, r.retention_looked), (0, 0), "no change: {r:?}");
        assert_eq!((r.condemned, r.deleted_keys, r.manifests_read), (0, 0, 0));
    }
    assert_eq!(
        (store.manifest_gets(), store.tenant_listings()),
        (gets, listed)
    );
    // K new versions of one workspace: about K changes (each version's manifest, recorded and
    // referenced), one workspace's retention.
    const K: u64 = 5;
    for tag in 0..K {
        write_tag(&vols[0], 100 + tag, 0, 1).await;
        vols[0].checkpoint(None).await.unwrap();
    }
    let r = node.gc(&opts).await.unwrap();
    assert!(
        (K..=2 * K).contains(&r.changes) && r.retention_looked == 1,
        "{K} versions: {r:?}"
    );
    let r = node.gc(&opts).await.unwrap();
    assert_eq!((r.changes, r.retention_looked), (0, 0), "{r:?}");
    for ((ws, v), want) in &m.cps {
        assert_eq!(&read_fresh(&c, ws, Some(*v), 3).await, want, "{ws}@{v}");
    }
}

/// Retention still expires by age when nothing changes (issue 46): a pass that looked at a
/// workspace records when its oldest kept version ages out, and a later pass with no change in
/// between expires it then, and only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_age_out_with_no_change_in_between() {
    let c = Cluster::new().await;
    let node = c.node("a");
    let v = empty_volume(&node, "w", DISK, Mode::Durable).await;
    for tag in 1..=3u64 {
        write_tag(&v, tag, 0, 1).await;
        v.checkpoint(None).await.unwrap();
    }
    let opts = GcOptions {
        reconcile: false,
        compact_below: None,
        max_age: Duration::from_millis(1500),
        ..gc_opts(16)
    };
    let r = node.gc(&opts).await.unwrap();
    assert_eq!((r.retention_looked, r.checkpoints_expired), (1, 0), "{r:?}");
    let r = node.gc(&opts).await.unwrap();
    assert_eq!(r.retention_looked, 0, "not due yet: {r:?}");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let r = node.gc(&opts).await.unwrap();
    assert_eq!(r.retention_looked, 1, "{r:?}");
    // Versions 1 to 3 are older than max_age; version 4 is the head.
    assert_eq!(r.checkpoints_expired, 3, "{r:?}");
    let listed = c.catalog.list_checkpoints(TENANT, "w").await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
}
