//! GC compacts workspaces detached everywhere, never one a crashed node may still replay onto.

use super::*;

/// A workspace detached everywhere is compacted too (it used to keep its sparse objects for
/// good): attached here for the rewrite and detached again, its data intact. One whose node
/// crashed with flushed, unpublished writes is left alone, even after that node's first attach
/// attempt failed (which used to release the lease, so it looked cleanly detached): the
/// node's journal must still apply to the head when it comes back. One detached too recently
/// is left alone as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_workspaces_are_compacted_and_crashed_ones_left_alone() {
    let c = Cluster::new().await;
    // Ordinary passes: detached workspaces are looked at because their lease was released.
    let incremental = GcOptions {
        reconcile: false,
        ..gc_opts(16)
    };
    let mut cfg = c.config("a");
    cfg.lease_ttl = Duration::from_secs(1);
    let fs = Arc::new(strata_engine::fs::RealFs);
    let node = c.node_with(cfg.clone(), fs.clone());
    let mut disks = HashMap::new();
    for ws in ["idle", "crashed"] {
        node.create_workspace(
            TENANT,
            ws,
            Source::Empty { size: 4 << 20 },
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        let v = node.attach(TENANT, ws).await.unwrap();
        let mut disk = Disk::new();
        // 256 blocks, then three in four of them again: the first objects end up 25% live.
        for round in [1u64, 2] {
            for lba in (0..256u64).filter(|l| round == 1 || l % 4 != 0) {
                v.write(lba * 4096, &tagged(round * 1000 + lba, lba), false)
                    .await
                    .unwrap();
                disk.insert(lba, round * 1000 + lba);
            }
            v.checkpoint(None).await.unwrap();
        }
        disks.insert(ws, disk);
    }
    node.detach(TENANT, "idle").await.unwrap();
    // "crashed": flushed writes only in node a's journal, then the node dies with the lease.
    let v = node.volume(TENANT, "crashed").unwrap();
    for lba in 300..340u64 {
        v.write(lba * 4096, &tagged(3000 + lba, lba), false)
            .await
            .unwrap();
        disks.get_mut("crashed").unwrap().insert(lba, 3000 + lba);
    }
    v.flush().await.unwrap();
    drop(v);
    let crashed = node.workspace(TENANT, "crashed").await.unwrap();
    node.abandon().await;
    drop(node);
    // Node a comes back; its first attach fails (the head manifest unreadable for a moment).
    let man = c.path(&format!(
        "objects/t/{TENANT}/man/{}",
        crashed.head_manifest.to_hex()
    ));
    let aside = c.path("manifest.aside");
    std::fs::rename(&man, &aside).unwrap();
    let node = c.node_with(cfg, fs);
    assert!(node.attach(TENANT, "crashed").await.is_err());
    std::fs::rename(&aside, &man).unwrap();
    let lease = c.catalog.get_lease(TENANT, "crashed").await.unwrap();
    assert_eq!(
        lease.holder.as_deref(),
        Some("a"),
        "a failed attach over a journal keeps the lease"
    );

    let gc = c.node("gc");
    let later = GcOptions {
        compact_detached_after: Some(Duration::from_secs(3600)),
        ..incremental.clone()
    };
    assert_eq!(
        gc.gc(&later).await.unwrap().compactions,
        0,
        "detached too recently"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await; // node a's lease TTL runs out
    let idle_head = gc.workspace(TENANT, "idle").await.unwrap().head_version;
    let r = gc.gc(&incremental).await.unwrap();
    assert_eq!(r.compactions, 1, "{r:?}");
    assert!(gc.volume(TENANT, "idle").is_none(), "detached again");
    let lease = c.catalog.get_lease(TENANT, "idle").await.unwrap();
    assert_eq!(lease.holder, None, "its lease is released");
    let log = gc.log(TENANT, "idle").await.unwrap();
    let after: Vec<_> = log.iter().filter(|cp| cp.version > idle_head).collect();
    assert!(
        after
            .iter()
            .any(|cp| cp.kind == strata_catalog::CheckpointKind::Compact),
        "{after:?}"
    );
    assert_eq!(
        gc.workspace(TENANT, "crashed").await.unwrap().head_version,
        crashed.head_version,
        "a crashed node's workspace keeps its head"
    );
    assert_eq!(
        gc.gc(&incremental).await.unwrap().compactions,
        0,
        "nothing sparse left"
    );
    // Heads judged dense are not read again while they do not move.
    let gets = gc.reader().store().manifest_gets();
    gc.gc(&incremental).await.unwrap();
    assert_eq!(
        gc.reader().store().manifest_gets(),
        gets,
        "a pass read the manifest of a detached head it had judged"
    );
    // Node a attaches again: its journal replays onto the unmoved head.
    let v = node.attach(TENANT, "crashed").await.unwrap();
    for (lba, tag) in &disks["crashed"] {
        let b = v.read(lba * 4096, 4096).await.unwrap();
        assert_eq!(tag_of(&b, *lba), Some(*tag), "crashed block {lba}");
    }
    let reader = c.node("reader");
    let v = reader.attach(TENANT, "idle").await.unwrap();
    for (lba, tag) in &disks["idle"] {
        let b = v.read(lba * 4096, 4096).await.unwrap();
        assert_eq!(tag_of(&b, *lba), Some(*tag), "idle block {lba}");
    }
    // Judged dense, then attached, made sparse again and detached: the release marks it, and
    // an ordinary pass compacts it again.
    let disk = disks.get_mut("idle").unwrap();
    for lba in (0..256u64).filter(|l| l % 4 != 1) {
        v.write(lba * 4096, &tagged(3000 + lba, lba), false)
            .await
            .unwrap();
        disk.insert(lba, 3000 + lba);
    }
    v.checkpoint(None).await.unwrap();
    drop(v);
    reader.detach(TENANT, "idle").await.unwrap();
    let r = gc.gc(&incremental).await.unwrap();
    assert_eq!(r.compactions, 1, "re-judged after its detach: {r:?}");
    let v = c.node("reader2").attach(TENANT, "idle").await.unwrap();
    for (lba, tag) in &disks["idle"] {
        let b = v.read(lba * 4096, 4096).await.unwrap();
        assert_eq!(
            tag_of(&b, *lba),
            Some(*tag),
            "idle block {lba} after the second compaction"
        );
    }
}
