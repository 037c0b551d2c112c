//! Conformance: workspaces, templates, heads and leases, checkpoints, retention and GC state,
//! nodes, TTLs.

use super::*;

pub(super) async fn retention_and_gc_state(cat: &dyn Catalog, time: &Time) {
    assert!(cat
        .list_tenants()
        .await
        .unwrap()
        .contains(&"acme".to_string()));
    cat.create_workspace(&new_ws("acme", "ret", h(60)))
        .await
        .unwrap();
    let g = cat
        .acquire_lease("acme", "ret", "node-a", 60_000)
        .await
        .unwrap();
    for i in 0..3u8 {
        let mut c = cp(h(61 + i), None);
        c.keep_until_ms = Some(42);
        cat.advance_head("acme", "ret", 1 + i as u64, &g, &c)
            .await
            .unwrap();
    }
    assert_eq!(
        cat.get_checkpoint("acme", "ret", 2)
            .await
            .unwrap()
            .keep_until_ms,
        Some(42)
    );
    // Versions 1..=4, head 4: expiring 1, 2 and the head expires only 1 and 2.
    assert_eq!(
        cat.expire_checkpoints("acme", "ret", &[1, 2, 4])
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        cat.expire_checkpoints("acme", "ret", &[1]).await.unwrap(),
        0,
        "already expired"
    );
    let left: Vec<u64> = cat
        .list_checkpoints("acme", "ret")
        .await
        .unwrap()
        .iter()
        .map(|c| c.version)
        .collect();
    assert_eq!(left, vec![3, 4]);
    assert!(matches!(
        cat.get_checkpoint("acme", "ret", 1).await,
        Err(CatalogError::NotFound { .. })
    ));
    // Within the grace period an expired checkpoint's manifest is still referenced.
    let refs = cat.gc_references("acme", 60_000).await.unwrap();
    for m in [h(60), h(61), h(62), h(63)] {
        assert!(refs.contains(&m), "{m} within grace");
    }
    // GC's mark from the catalog alone: the referenced manifests, which of them were never
    // recorded, and the distinct objects of the recorded ones (an unreferenced manifest's
    // objects are not among them).
    let o = |n: u8| ObjectRef {
        id: h(200 + n),
        data_len: 4096 * n as u64,
    };
    cat.record_manifest("acme", h(60), &[o(1), o(2)])
        .await
        .unwrap();
    cat.record_manifest("acme", h(61), &[o(2), o(3)])
        .await
        .unwrap();
    let unreferenced = Hash::of(b"a manifest nothing names");
    cat.record_manifest("acme", unreferenced, &[o(9)])
        .await
        .unwrap();
    let mark = cat.gc_mark("acme", 60_000).await.unwrap();
    for m in [h(60), h(61), h(62), h(63)] {
        assert!(mark.manifests.contains(&m), "{m} within grace");
    }
    assert!(!mark.manifests.contains(&unreferenced));
    assert!(mark.unrecorded.contains(&h(62)) && mark.unrecorded.contains(&h(63)));
    assert!(!mark.unrecorded.contains(&h(60)) && !mark.unrecorded.contains(&h(61)));
    for n in [1, 2, 3] {
        let times = mark.objects.iter().filter(|x| **x == o(n).id).count();
        assert_eq!(times, 1, "object {n} once");
    }
    assert!(
        !mark.objects.contains(&o(9).id),
        "an unreferenced manifest's object"
    );
    // Recorded just now: nothing of it is stale yet.
    assert!(!mark.stale_manifests.contains(&unreferenced));
    assert!(!mark.stale_objects.iter().any(|(id, _)| *id == o(9).id));
    assert!(cat.gc_mark("other", 60_000).await.unwrap() == GcMark::default());
    assert_eq!(
        cat.purge_expired_checkpoints("acme", 60_000).await.unwrap(),
        0
    );
    time.pass(std::time::Duration::from_millis(20)).await;
    let refs = cat.gc_references("acme", 5).await.unwrap();
    assert!(
        !refs.contains(&h(60)) && !refs.contains(&h(61)),
        "past grace"
    );
    assert!(refs.contains(&h(62)) && refs.contains(&h(63)));
    // Past grace, the expired checkpoints' objects are no longer marked.
    let mark = cat.gc_mark("acme", 5).await.unwrap();
    assert!(!mark.manifests.contains(&h(60)) && !mark.manifests.contains(&h(61)));
    for n in [1, 2, 3] {
        assert!(!mark.objects.contains(&o(n).id), "object {n} past grace");
    }
    // Their records, and the unreferenced manifest's, are stale now: what an incremental sweep
    // condemns, with each object's length; unrecorded manifests never are.
    for m in [h(60), h(61), unreferenced] {
        assert!(mark.stale_manifests.contains(&m), "{m} stale");
    }
    assert!(!mark.stale_manifests.contains(&h(62)) && !mark.stale_manifests.contains(&h(63)));
    for n in [1, 2, 3, 9] {
        assert!(
            mark.stale_objects.contains(&(o(n).id, o(n).data_len)),
            "object {n} stale"
        );
    }
    assert!(cat.gc_mark("other", 5).await.unwrap() == GcMark::default());
    assert_eq!(cat.purge_expired_checkpoints("acme", 5).await.unwrap(), 2);
    // Condemned keys keep their first time; forget removes them.
    let keys = vec!["t/acme/obj/aa/x".to_string(), "t/acme/man/y".to_string()];
    cat.gc_condemn("acme", &keys).await.unwrap();
    time.pass(std::time::Duration::from_millis(20)).await;
    cat.gc_condemn("acme", &keys[..1]).await.unwrap();
    let c = cat.gc_condemned("acme").await.unwrap();
    assert_eq!(c.len(), 2);
    assert!(c.iter().all(|(_, age)| *age >= 15), "{c:?}");
    assert!(cat.gc_condemned("other").await.unwrap().is_empty());
    cat.gc_forget("acme", &keys[..1]).await.unwrap();
    assert_eq!(cat.gc_condemned("acme").await.unwrap().len(), 1);
    cat.gc_forget("acme", &keys).await.unwrap();
    cat.release_lease("acme", "ret", &g).await.unwrap();
}

pub(super) async fn nodes_report_and_list(cat: &dyn Catalog) {
    let mut st = NodeStatus {
        node: "node-x".into(),
        url: Some("http://127.0.0.1:1".into()),
        seen_ms: 0,
        seen_ago_ms: 0,
        attached: vec![AttachedStatus {
            tenant: "acme".into(),
            workspace: "race".into(),
            mode: Mode::Durable,
            epoch: 3,
            head_version: 6,
            remote_window_bytes: 4096,
            remote_window_age_ms: 12,
        }],
    };
    cat.report_node(&st).await.unwrap();
    st.attached[0].remote_window_bytes = 0;
    cat.report_node(&st).await.unwrap();
    let nodes = cat.list_nodes().await.unwrap();
    let n = nodes.iter().find(|n| n.node == "node-x").expect("listed");
    assert_eq!(n.attached, st.attached, "the latest report wins");
    assert!(n.seen_ms > 0 && n.seen_ago_ms < 60_000);
}

pub(super) async fn tenants_and_templates(cat: &dyn Catalog) {
    cat.create_tenant("acme").await.unwrap();
    assert!(cat.tenant_exists("acme").await.unwrap());
    assert!(!cat.tenant_exists("nope").await.unwrap());
    let t = cat.add_token(&tok("acme", "h1", None)).await.unwrap();
    assert_eq!((t.id.as_str(), t.revoked_ms), ("h1", None));
    assert_eq!(
        cat.token_info("h1").await.unwrap().map(|i| i.tenant),
        Some("acme".to_string())
    );
    assert_eq!(cat.token_info("h2").await.unwrap(), None);
    assert!(matches!(
        cat.add_token(&tok("nope", "h3", None)).await,
        Err(CatalogError::NotFound { .. })
    ));
    assert!(matches!(
        cat.create_tenant("acme").await,
        Err(CatalogError::AlreadyExists { .. })
    ));
    cat.record_manifest(
        "acme",
        h(1),
        &[ObjectRef {
            id: h(2),
            data_len: 4096,
        }],
    )
    .await
    .unwrap();
    cat.record_manifest(
        "acme",
        h(1),
        &[ObjectRef {
            id: h(2),
            data_len: 4096,
        }],
    )
    .await
    .unwrap();
    // Recorded references: idempotent, per tenant, pruned with their keys.
    assert_eq!(cat.recorded_references("acme").await.unwrap(), (1, 1));
    let two = [
        ObjectRef {
            id: h(2),
            data_len: 4096,
        },
        ObjectRef {
            id: h(4),
            data_len: 8192,
        },
    ];
    cat.record_manifest("acme", h(3), &two).await.unwrap();
    assert_eq!(cat.recorded_references("acme").await.unwrap(), (2, 2));
    assert_eq!(cat.recorded_references("nope").await.unwrap(), (0, 0));
    // Manifest 3 and object 4 go: 2 links, 1 manifest, 1 object.
    assert_eq!(
        cat.prune_references("acme", &[h(3)], &[h(4)])
            .await
            .unwrap(),
        4
    );
    assert_eq!(cat.recorded_references("acme").await.unwrap(), (1, 1));
    assert_eq!(
        cat.prune_references("acme", &[h(3)], &[h(4)])
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        cat.prune_references("other", &[h(1)], &[h(2)])
            .await
            .unwrap(),
        0
    );
    assert_eq!(cat.recorded_references("acme").await.unwrap(), (1, 1));
    let t = Template {
        tenant: "acme".into(),
        name: "base".into(),
        manifest: h(1),
        disk_size: 1 << 30,
        stored_bytes: 4096,
        created_ms: 1,
    };
    cat.create_template(&t).await.unwrap();
    assert!(matches!(
        cat.create_template(&t).await,
        Err(CatalogError::AlreadyExists { .. })
    ));
    assert_eq!(cat.get_template("acme", "base").await.unwrap(), t);
    assert_eq!(cat.list_templates("acme").await.unwrap(), vec![t.clone()]);
    cat.create_workspace(&new_ws("acme", "user", h(1)))
        .await
        .unwrap();
    let e = cat.delete_template("acme", "base").await.unwrap_err();
    assert!(
        matches!(&e, CatalogError::InUse(m) if m.contains("user")),
        "{e}"
    );
    cat.delete_workspace("acme", "user").await.unwrap();
    cat.delete_template("acme", "base").await.unwrap();
    assert!(matches!(
        cat.get_template("acme", "base").await,
        Err(CatalogError::NotFound { .. })
    ));
}

pub(super) async fn heads_move_only_by_cas_with_the_current_lease(cat: &dyn Catalog) {
    let ws = cat
        .create_workspace(&new_ws("acme", "w1", h(1)))
        .await
        .unwrap();
    assert_eq!((ws.head_version, ws.head_manifest), (1, h(1)));
    assert!(matches!(
        cat.create_workspace(&new_ws("acme", "w1", h(1))).await,
        Err(CatalogError::AlreadyExists { .. })
    ));
    let g = cat
        .acquire_lease("acme", "w1", "node-a", 60_000)
        .await
        .unwrap();
    assert_eq!(g.epoch, 1);
    assert_eq!(
        cat.advance_head("acme", "w1", 1, &g, &cp(h(3), Some("first")))
            .await
            .unwrap(),
        2
    );
    // Stale version.
    assert_eq!(
        cat.advance_head("acme", "w1", 1, &g, &cp(h(4), None)).await,
        Err(CatalogError::Conflict {
            expected: 1,
            actual: 2
        })
    );
    // Wrong epoch (a forged or stale grant).
    let stale = LeaseGrant {
        epoch: 0,
        ..g.clone()
    };
    assert!(matches!(
        cat.advance_head("acme", "w1", 2, &stale, &cp(h(4), None))
            .await,
        Err(CatalogError::Fenced { .. })
    ));
    let w = cat.get_workspace("acme", "w1").await.unwrap();
    assert_eq!((w.head_version, w.head_manifest), (2, h(3)));
    let log = cat.list_checkpoints("acme", "w1").await.unwrap();
    assert_eq!(log.len(), 2);
    assert_eq!(log[1].label.as_deref(), Some("first"));
    assert_eq!(
        (log[1].epoch, log[1].cut_seq, log[1].journal_id.as_deref()),
        (1, 5, Some("j1"))
    );
    assert_eq!(
        cat.get_checkpoint("acme", "w1", 1).await.unwrap().kind,
        CheckpointKind::Create
    );
    assert!(matches!(
        cat.get_checkpoint("acme", "w1", 9).await,
        Err(CatalogError::NotFound { .. })
    ));
    // A version on a larger disk moves the workspace's size in the same CAS; a smaller one is
    // refused and moves nothing.
    let grown = NewCheckpoint {
        disk_size: 2 << 30,
        kind: CheckpointKind::Resize,
        ..cp(h(5), None)
    };
    assert_eq!(
        cat.advance_head("acme", "w1", 2, &g, &grown).await.unwrap(),
        3
    );
    let w = cat.get_workspace("acme", "w1").await.unwrap();
    assert_eq!((w.head_version, w.disk_size), (3, 2 << 30));
    assert_eq!(
        cat.get_checkpoint("acme", "w1", 3).await.unwrap().kind,
        CheckpointKind::Resize
    );
    assert!(matches!(
        cat.advance_head("acme", "w1", 3, &g, &cp(h(6), None)).await,
        Err(CatalogError::InUse(_))
    ));
    let w = cat.get_workspace("acme", "w1").await.unwrap();
    assert_eq!((w.head_version, w.disk_size), (3, 2 << 30));
    // Delete is refused while the lease is live, and allowed after release.
    assert!(matches!(
        cat.delete_workspace("acme", "w1").await,
        Err(CatalogError::LeaseHeld { .. })
    ));
    cat.release_lease("acme", "w1", &g).await.unwrap();
    cat.delete_workspace("acme", "w1").await.unwrap();
    assert!(matches!(
        cat.get_workspace("acme", "w1").await,
        Err(CatalogError::NotFound { .. })
    ));
    // Recreated under the same name: the epoch keeps counting up, so the old grant stays fenced.
    cat.create_workspace(&new_ws("acme", "w1", h(1)))
        .await
        .unwrap();
    let g2 = cat
        .acquire_lease("acme", "w1", "node-a", 60_000)
        .await
        .unwrap();
    assert!(g2.epoch > g.epoch);
    assert!(matches!(
        cat.advance_head("acme", "w1", 1, &g, &cp(h(4), None)).await,
        Err(CatalogError::Fenced { .. })
    ));
    cat.release_lease("acme", "w1", &g2).await.unwrap();
}

pub(super) async fn leases_expire_and_fence(cat: &dyn Catalog, time: &Time) {
    cat.create_workspace(&new_ws("acme", "w2", h(1)))
        .await
        .unwrap();
    let a = cat
        .acquire_lease("acme", "w2", "node-a", 300)
        .await
        .unwrap();
    let e = cat
        .acquire_lease("acme", "w2", "node-b", 300)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, CatalogError::LeaseHeld { holder, .. } if holder == "node-a"),
        "{e}"
    );
    assert!(e.to_string().contains("node-a"));
    cat.renew_lease("acme", "w2", &a, 300).await.unwrap();
    time.pass(std::time::Duration::from_millis(400)).await;
    let b = cat
        .acquire_lease("acme", "w2", "node-b", 60_000)
        .await
        .unwrap();
    assert_eq!(b.epoch, a.epoch + 1);
    assert!(matches!(
        cat.renew_lease("acme", "w2", &a, 300).await,
        Err(CatalogError::Fenced { .. })
    ));
    assert!(matches!(
        cat.advance_head("acme", "w2", 1, &a, &cp(h(5), None)).await,
        Err(CatalogError::Fenced { .. })
    ));
    assert_eq!(
        cat.advance_head("acme", "w2", 1, &b, &cp(h(5), None))
            .await
            .unwrap(),
        2
    );
    // Releasing a stale grant does nothing.
    cat.release_lease("acme", "w2", &a).await.unwrap();
    let l = cat.get_lease("acme", "w2").await.unwrap();
    assert_eq!((l.holder.as_deref(), l.epoch), (Some("node-b"), b.epoch));
    // The same node re-acquiring (a restart) bumps the epoch too.
    let b2 = cat
        .acquire_lease("acme", "w2", "node-b", 60_000)
        .await
        .unwrap();
    assert_eq!(b2.epoch, b.epoch + 1);
    cat.release_lease("acme", "w2", &b2).await.unwrap();
}

pub(super) async fn a_node_renews_its_leases_in_one_call(cat: &dyn Catalog, time: &Time) {
    assert!(cat.renew_leases(&[], 1000).await.unwrap().is_empty());
    let mut batch = vec![];
    for i in 0..3 {
        let n = format!("batch{i}");
        cat.create_workspace(&new_ws("acme", &n, h(70 + i)))
            .await
            .unwrap();
        let g = cat.acquire_lease("acme", &n, "node-a", 300).await.unwrap();
        batch.push(LeaseRenewal {
            tenant: "acme".into(),
            workspace: n,
            lease: g,
        });
    }
    // batch1 is taken over by node-b once it expires; the others are renewed far ahead.
    time.pass(std::time::Duration::from_millis(400)).await;
    let b = cat
        .acquire_lease("acme", "batch1", "node-b", 60_000)
        .await
        .unwrap();
    let out = cat.renew_leases(&batch, 60_000).await.unwrap();
    assert_eq!(out.len(), 3);
    assert!(out[0].is_ok() && out[2].is_ok(), "{out:?}");
    assert!(
        matches!(&out[1], Err(CatalogError::Fenced { held, current, holder })
            if *held == batch[1].lease.epoch && *current == b.epoch && holder.as_deref() == Some("node-b")),
        "{out:?}"
    );
    // Renewed: node-b cannot take batch0 or batch2 now, and node-a's hold on batch1 is gone.
    for i in [0, 2] {
        let n = format!("batch{i}");
        assert!(matches!(
            cat.acquire_lease("acme", &n, "node-b", 60_000).await,
            Err(CatalogError::LeaseHeld { .. })
        ));
        let l = cat.get_lease("acme", &n).await.unwrap();
        assert!(l.expires_ms > now_ms() + 30_000, "{l:?}");
        cat.release_lease("acme", &n, &batch[i].lease)
            .await
            .unwrap();
    }
    assert_eq!(
        cat.get_lease("acme", "batch1")
            .await
            .unwrap()
            .holder
            .as_deref(),
        Some("node-b")
    );
    cat.release_lease("acme", "batch1", &b).await.unwrap();
}

pub(super) async fn concurrent_checkpoints_one_winner_per_version(cat: Arc<dyn Catalog>) {
    cat.create_workspace(&new_ws("acme", "race", h(1)))
        .await
        .unwrap();
    let g = cat
        .acquire_lease("acme", "race", "node-a", 60_000)
        .await
        .unwrap();
    for round in 0..5u64 {
        let expected = round + 1;
        let tasks: Vec<_> = (0..8u8)
            .map(|i| {
                let (cat, g) = (cat.clone(), g.clone());
                tokio::spawn(async move {
                    cat.advance_head("acme", "race", expected, &g, &cp(h(100 + i), None))
                        .await
                })
            })
            .collect();
        let mut wins = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(v) => {
                    assert_eq!(v, expected + 1);
                    wins += 1;
                }
                Err(CatalogError::Conflict { .. }) => {}
                Err(e) => panic!("unexpected {e}"),
            }
        }
        assert_eq!(
            wins,
            1,
            "exactly one checkpoint wins version {}",
            expected + 1
        );
    }
    let log = cat.list_checkpoints("acme", "race").await.unwrap();
    let versions: Vec<u64> = log.iter().map(|c| c.version).collect();
    assert_eq!(
        versions,
        vec![1, 2, 3, 4, 5, 6],
        "history is linear with no gaps"
    );
    cat.release_lease("acme", "race", &g).await.unwrap();
}

pub(super) async fn ttls_expire(cat: &dyn Catalog) {
    let mut w = new_ws("acme", "short", h(1));
    w.mode = Mode::Ephemeral;
    w.ttl_ms = Some(1);
    let created = cat.create_workspace(&w).await.unwrap();
    let far = created.created_ms + 10;
    let expired = cat.list_expired(far).await.unwrap();
    assert!(expired.contains(&("acme".to_string(), "short".to_string())));
    assert!(
        !expired.iter().any(|(_, n)| n == "race"),
        "workspaces without a TTL never expire"
    );
    assert!(cat
        .list_expired(created.created_ms - 1)
        .await
        .unwrap()
        .iter()
        .all(|(_, n)| n != "short"));
    cat.delete_workspace("acme", "short").await.unwrap();
}
