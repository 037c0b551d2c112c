//! The conformance suite every catalog backend must pass. Backends call [`run_all`] from their
//! own tests with a fresh, empty catalog.

use std::sync::Arc;

use strata_format::manifest::ObjectRef;
use strata_format::Hash;

use crate::*;

fn h(n: u8) -> Hash {
    Hash::of(&[n])
}

fn new_ws(tenant: &str, name: &str, m: Hash) -> NewWorkspace {
    NewWorkspace {
        tenant: tenant.into(),
        name: name.into(),
        mode: Mode::Durable,
        disk_size: 1 << 30,
        manifest: m,
        source: "template:base".into(),
        kind: CheckpointKind::Create,
        ttl_ms: None,
    }
}

fn cp(m: Hash, label: Option<&str>) -> NewCheckpoint {
    NewCheckpoint {
        manifest: m,
        disk_size: 1 << 30,
        label: label.map(Into::into),
        kind: CheckpointKind::Checkpoint,
        bytes: 10,
        cut_seq: 5,
        journal_id: Some("j1".into()),
        keep_until_ms: None,
    }
}

/// How the suite lets time pass for lease expiry and GC grace: a catalog on its own
/// [`ManualClock`] is moved forward; one that reads a server's clock (PostgreSQL: the point of
/// its design) is waited for.
pub enum Time {
    Real,
    Manual(Arc<ManualClock>),
}

impl Time {
    pub async fn pass(&self, d: std::time::Duration) {
        match self {
            Time::Real => tokio::time::sleep(d).await,
            Time::Manual(c) => c.advance(d),
        }
    }
}

/// Runs every check; panics with a message naming the failed property.
pub async fn run_all(cat: Arc<dyn Catalog>, time: &Time) {
    tenants_and_templates(&*cat).await;
    heads_move_only_by_cas_with_the_current_lease(&*cat).await;
    leases_expire_and_fence(&*cat, time).await;
    a_node_renews_its_leases_in_one_call(&*cat, time).await;
    concurrent_checkpoints_one_winner_per_version(cat.clone()).await;
    ttls_expire(&*cat).await;
    tenants_do_not_see_each_other(&*cat).await;
    nodes_report_and_list(&*cat).await;
    scoped_tokens_and_streams(&*cat).await;
    retention_and_gc_state(&*cat, time).await;
    token_lifecycle(&*cat).await;
    quotas_limit_creates(&*cat).await;
    store_usage_follows_references(&*cat, time).await;
    tenant_deletion(&*cat, time).await;
    tenant_placement(&*cat).await;
}

/// A tenant's store is recorded at its creation and read back; the default is none.
async fn tenant_placement(cat: &dyn Catalog) {
    cat.create_tenant_placed("placed", Some("own-bucket"), Some("v1:k:wrapped"))
        .await
        .unwrap();
    let p = cat.tenant_placement("placed").await.unwrap();
    assert_eq!(
        (p.store, p.data_key),
        (Some("own-bucket".into()), Some("v1:k:wrapped".into()))
    );
    assert_eq!(
        p.created_ms,
        cat.get_tenant("placed").await.unwrap().created_ms
    );
    assert!(cat.get_tenant("placed").await.unwrap().encrypted);
    assert!(cat.tenant_placement("nobody").await.is_err());
    // The key is destroyed only by a deletion.
    assert!(cat.shred_data_key("placed").await.is_err());
    assert_eq!(
        cat.tenant_placement("placed")
            .await
            .unwrap()
            .data_key
            .as_deref(),
        Some("v1:k:wrapped")
    );
    cat.create_tenant("unplaced").await.unwrap();
    assert_eq!(
        cat.get_tenant("placed").await.unwrap().store.as_deref(),
        Some("own-bucket")
    );
    assert_eq!(cat.get_tenant("unplaced").await.unwrap().store, None);
    assert!(!cat.get_tenant("unplaced").await.unwrap().encrypted);
    // A second create of the name is refused whatever its placement.
    assert!(cat
        .create_tenant_placed("placed", None, None)
        .await
        .is_err());
    assert_eq!(
        cat.get_tenant("placed").await.unwrap().store.as_deref(),
        Some("own-bucket")
    );
    // Its deletion destroys it (twice is fine); an unencrypted tenant has none to destroy.
    cat.begin_tenant_delete("placed").await.unwrap();
    cat.shred_data_key("placed").await.unwrap();
    cat.shred_data_key("placed").await.unwrap();
    assert_eq!(
        cat.tenant_placement("placed")
            .await
            .unwrap()
            .data_key
            .as_deref(),
        Some("shredded")
    );
    cat.begin_tenant_delete("unplaced").await.unwrap();
    cat.shred_data_key("unplaced").await.unwrap();
    assert_eq!(
        cat.tenant_placement("unplaced").await.unwrap().data_key,
        None
    );
    cat.purge_tenant("placed").await.unwrap();
    cat.purge_tenant("unplaced").await.unwrap();
}

fn tok(tenant: &str, hash: &str, scope: Option<&str>) -> NewToken {
    NewToken {
        tenant: tenant.into(),
        hash: hash.into(),
        scope: scope.map(Into::into),
        ..NewToken::default()
    }
}

async fn token_lifecycle(cat: &dyn Catalog) {
    cat.create_tenant("tok").await.unwrap();
    let hash = "0123456789abcdef0123456789abcdef";
    let made = cat
        .add_token(&NewToken {
            tenant: "tok".into(),
            hash: hash.into(),
            scope: Some("read".into()),
            expires_ms: Some(1234),
            label: Some("ci".into()),
        })
        .await
        .unwrap();
    assert_eq!(
        made.id, "0123456789abcdef",
        "the id is the hash's first 16 digits"
    );
    assert_eq!(cat.token_info(hash).await.unwrap(), Some(made.clone()));
    cat.add_token(&tok("tok", "fedcba9876543210ffff", None))
        .await
        .unwrap();
    let listed = cat.list_tokens("tok").await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&made));
    assert!(matches!(
        cat.list_tokens("nope").await,
        Err(CatalogError::NotFound { .. })
    ));
    // Revocation names the id, only within the tenant, and is idempotent.
    assert!(matches!(
        cat.revoke_token("acme", &made.id).await,
        Err(CatalogError::NotFound { .. })
    ));
    let r = cat.revoke_token("tok", &made.id).await.unwrap();
    assert!(r.revoked_ms.is_some());
    let again = cat.revoke_token("tok", &made.id).await.unwrap();
    assert_eq!(again.revoked_ms, r.revoked_ms);
    assert_eq!(
        cat.token_info(hash).await.unwrap().unwrap().revoked_ms,
        r.revoked_ms,
        "a revoked token is still known, so its refusal can say why"
    );
    assert!(cat
        .token_info("fedcba9876543210ffff")
        .await
        .unwrap()
        .unwrap()
        .revoked_ms
        .is_none());
}

async fn quotas_limit_creates(cat: &dyn Catalog) {
    cat.create_tenant("quota").await.unwrap();
    assert_eq!(
        cat.get_tenant("quota").await.unwrap().quotas,
        Quotas::default()
    );
    let q = Quotas {
        workspaces: Some(2),
        disk_bytes: Some(3 << 20),
        local_journal_bytes: Some(1 << 20),
        ..Quotas::default()
    };
    cat.set_quotas("quota", &q).await.unwrap();
    assert_eq!(cat.get_tenant("quota").await.unwrap().quotas, q);
    assert!(matches!(
        cat.set_quotas("nope", &q).await,
        Err(CatalogError::NotFound { .. })
    ));
    let m = h(70);
    cat.record_manifest("quota", m, &[]).await.unwrap();
    let sized = |name: &str, size: u64| NewWorkspace {
        disk_size: size,
        ..new_ws("quota", name, m)
    };
    cat.create_workspace(&sized("a", 2 << 20)).await.unwrap();
    assert!(
        matches!(
            cat.create_workspace(&sized("b", 2 << 20)).await,
            Err(CatalogError::Quota(_))
        ),
        "4 MiB of disks in all is over 3 MiB"
    );
    assert!(
        matches!(
            cat.get_workspace("quota", "b").await,
            Err(CatalogError::NotFound { .. })
        ),
        "a refused create leaves nothing"
    );
    cat.create_workspace(&sized("b", 1 << 20)).await.unwrap();
    assert!(
        matches!(
            cat.create_workspace(&sized("c", 4096)).await,
            Err(CatalogError::Quota(_))
        ),
        "a third workspace"
    );
    cat.set_quotas("quota", &Quotas::default()).await.unwrap();
    cat.create_workspace(&sized("c", 4096)).await.unwrap();
    assert_eq!(cat.list_workspaces("quota").await.unwrap().len(), 3);
}

async fn store_usage_follows_references(cat: &dyn Catalog, time: &Time) {
    cat.create_tenant("use").await.unwrap();
    assert_eq!(cat.store_usage("use").await.unwrap(), StoreUsage::default());
    let o = |n: u8, len: u64| ObjectRef {
        id: h(100 + n),
        data_len: len,
    };
    let (m1, m2, m3) = (h(90), h(91), h(92));
    cat.record_manifest("use", m1, &[o(1, 100), o(2, 200)])
        .await
        .unwrap();
    cat.record_manifest("use", m2, &[o(2, 200), o(3, 300)])
        .await
        .unwrap();
    cat.record_manifest("use", m3, &[o(4, 50)]).await.unwrap();
    // Another tenant's identical object ids are its own.
    cat.create_tenant("use2").await.unwrap();
    cat.record_manifest("use2", m1, &[o(1, 100), o(2, 200)])
        .await
        .unwrap();
    cat.create_workspace(&new_ws("use2", "z", m1))
        .await
        .unwrap();
    cat.create_workspace(&new_ws("use", "a", m1)).await.unwrap();
    cat.create_workspace(&new_ws("use", "b", m2)).await.unwrap();
    cat.create_template(&Template {
        tenant: "use".into(),
        name: "t".into(),
        manifest: m3,
        disk_size: 4096,
        stored_bytes: 50,
        created_ms: 1,
    })
    .await
    .unwrap();
    let u = cat.store_usage("use").await.unwrap();
    assert_eq!(
        (u.live_objects, u.live_bytes),
        (4, 650),
        "the object a and b share counts once: {u:?}"
    );
    let per: Vec<(&str, u64, u64)> = u
        .workspaces
        .iter()
        .map(|w| (w.workspace.as_str(), w.live_objects, w.live_bytes))
        .collect();
    assert_eq!(per, vec![("a", 2, 300), ("b", 2, 500)]);
    cat.delete_workspace("use", "b").await.unwrap();
    let u = cat.store_usage("use").await.unwrap();
    assert_eq!((u.live_objects, u.live_bytes), (3, 350), "{u:?}");
    // Metering: each reading adds the previous one's bytes times the time since it.
    let m0 = cat.meter_usage("use", 1000).await.unwrap();
    assert_eq!((m0.byte_seconds, m0.since_ms), (0.0, m0.last_ms));
    time.pass(std::time::Duration::from_millis(400)).await;
    let m1 = cat.meter_usage("use", 10).await.unwrap();
    let secs = (m1.last_ms - m0.last_ms) as f64 / 1000.0;
    assert!(secs >= 0.4, "{m0:?} {m1:?}");
    assert!((m1.byte_seconds - 1000.0 * secs).abs() < 1e-6, "{m1:?}");
    time.pass(std::time::Duration::from_millis(200)).await;
    let m2 = cat.meter_usage("use", 10).await.unwrap();
    let more = 10.0 * (m2.last_ms - m1.last_ms) as f64 / 1000.0;
    assert!(
        (m2.byte_seconds - m1.byte_seconds - more).abs() < 1e-6,
        "{m2:?}"
    );
    assert_eq!(m2.since_ms, m0.since_ms);
    assert_eq!(cat.store_usage("use2").await.unwrap().live_bytes, 300);
}

async fn tenant_deletion(cat: &dyn Catalog, time: &Time) {
    cat.create_tenant("doomed").await.unwrap();
    cat.add_token(&tok("doomed", "doomedtoken", None))
        .await
        .unwrap();
    let m = h(60);
    cat.record_manifest("doomed", m, &[]).await.unwrap();
    cat.create_workspace(&new_ws("doomed", "w", m))
        .await
        .unwrap();
    assert!(
        matches!(
            cat.purge_tenant("doomed").await,
            Err(CatalogError::InUse(_))
        ),
        "a tenant not marked is not purged"
    );
    let g = cat
        .acquire_lease("doomed", "w", "n1", 60_000)
        .await
        .unwrap();
    let e = cat.begin_tenant_delete("doomed").await.unwrap_err();
    assert!(
        matches!(&e, CatalogError::InUse(m) if m.contains("\"w\"")),
        "an attached workspace refuses the deletion: {e:?}"
    );
    assert!(cat
        .get_tenant("doomed")
        .await
        .unwrap()
        .deleting_ms
        .is_none());
    assert!(cat.token_info("doomedtoken").await.unwrap().is_some());
    cat.release_lease("doomed", "w", &g).await.unwrap();
    // A lease that ran out does not hold the deletion up.
    let g = cat.acquire_lease("doomed", "w", "n1", 100).await.unwrap();
    time.pass(std::time::Duration::from_millis(300)).await;
    cat.begin_tenant_delete("doomed").await.unwrap();
    assert!(
        cat.renew_lease("doomed", "w", &g, 60_000).await.is_err(),
        "a lease that ran out is not renewed back under the deletion"
    );
    cat.begin_tenant_delete("doomed").await.unwrap();
    assert!(cat
        .get_tenant("doomed")
        .await
        .unwrap()
        .deleting_ms
        .is_some());
    assert_eq!(
        cat.token_info("doomedtoken").await.unwrap(),
        None,
        "a deleted tenant's tokens speak for nobody"
    );
    assert!(matches!(
        cat.acquire_lease("doomed", "w", "n2", 60_000).await,
        Err(CatalogError::InUse(_))
    ));
    assert!(matches!(
        cat.add_token(&tok("doomed", "late", None)).await,
        Err(CatalogError::InUse(_))
    ));
    assert!(
        matches!(
            cat.create_workspace(&new_ws("doomed", "late", m)).await,
            Err(CatalogError::InUse(_))
        ),
        "no workspace is created in a tenant being deleted"
    );
    assert!(
        matches!(
            cat.purge_tenant("doomed").await,
            Err(CatalogError::InUse(_))
        ),
        "its workspaces go first"
    );
    let _ = g;
    cat.delete_workspace("doomed", "w").await.unwrap();
    cat.purge_tenant("doomed").await.unwrap();
    assert!(!cat.tenant_exists("doomed").await.unwrap());
    assert!(!cat
        .list_tenants()
        .await
        .unwrap()
        .contains(&"doomed".to_string()));
    assert!(cat.gc_references("doomed", 0).await.unwrap().is_empty());
    // The name is free again, with nothing of the old tenant.
    cat.create_tenant("doomed").await.unwrap();
    assert!(cat.list_workspaces("doomed").await.unwrap().is_empty());
    assert!(cat.list_tokens("doomed").await.unwrap().is_empty());
}

async fn retention_and_gc_state(cat: &dyn Catalog, time: &Time) {
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

async fn scoped_tokens_and_streams(cat: &dyn Catalog) {
    cat.add_token(&tok("acme", "scoped1", Some("relay:wal")))
        .await
        .unwrap();
    let i = cat.token_info("scoped1").await.unwrap().unwrap();
    assert_eq!(
        (i.tenant.as_str(), i.scope.as_deref()),
        ("acme", Some("relay:wal"))
    );
    let i = cat.token_info("h1").await.unwrap().unwrap();
    assert_eq!((i.tenant.as_str(), i.scope), ("acme", None));
    assert!(matches!(
        cat.add_token(&tok("nope", "scoped2", Some("relay:x")))
            .await,
        Err(CatalogError::NotFound { .. })
    ));
    let st = RelayStream {
        tenant: "acme".into(),
        name: "wal".into(),
        sync: true,
        created_ms: 7,
    };
    cat.create_stream(&st).await.unwrap();
    assert!(matches!(
        cat.create_stream(&st).await,
        Err(CatalogError::AlreadyExists { .. })
    ));
    assert_eq!(cat.get_stream("acme", "wal").await.unwrap(), st);
    assert!(matches!(
        cat.get_stream("other", "wal").await,
        Err(CatalogError::NotFound { .. })
    ));
    assert_eq!(cat.list_streams("acme").await.unwrap(), vec![st]);
    assert!(cat.list_streams("other").await.unwrap().is_empty());
}

/// Checks for two handles on the same catalog (two nodes): `a` and `b` must be separate
/// connections/pools to one database. Run after [`run_all`] or on a fresh catalog.
pub async fn run_shared(a: Arc<dyn Catalog>, b: Arc<dyn Catalog>) {
    match a.create_tenant("shared").await {
        Ok(()) | Err(CatalogError::AlreadyExists { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    assert!(
        b.tenant_exists("shared").await.unwrap(),
        "b sees a's writes"
    );
    for round in 0..5u8 {
        let name = format!("contended{round}");
        a.create_workspace(&new_ws("shared", &name, h(1)))
            .await
            .unwrap();
        // Both nodes race for the lease: exactly one wins, the loser is told who holds it.
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let (cat, name) = (if i % 2 == 0 { a.clone() } else { b.clone() }, name.clone());
                tokio::spawn(async move {
                    let node = format!("node-{i}");
                    (
                        node.clone(),
                        cat.acquire_lease("shared", &name, &node, 60_000).await,
                    )
                })
            })
            .collect();
        let mut winner = None;
        for t in tasks {
            match t.await.unwrap() {
                (node, Ok(g)) => {
                    assert!(winner.is_none(), "two nodes acquired {name}");
                    assert_eq!(g.epoch, 1);
                    winner = Some((node, g));
                }
                (_, Err(CatalogError::LeaseHeld { .. })) => {}
                (_, Err(e)) => panic!("unexpected {e}"),
            }
        }
        let (node, g) = winner.expect("one node acquires");
        let l = b.get_lease("shared", &name).await.unwrap();
        assert_eq!((l.holder.as_deref(), l.epoch), (Some(node.as_str()), 1));
        // Checkpoints through both handles with the one valid grant: one winner per version.
        let mut versions = vec![];
        for step in 0..4u64 {
            let tasks: Vec<_> = [a.clone(), b.clone()]
                .into_iter()
                .enumerate()
                .map(|(i, cat)| {
                    let (g, name) = (g.clone(), name.clone());
                    tokio::spawn(async move {
                        cat.advance_head("shared", &name, step + 1, &g, &cp(h(50 + i as u8), None))
                            .await
                    })
                })
                .collect();
            let mut wins = 0;
            for t in tasks {
                match t.await.unwrap() {
                    Ok(v) => {
                        wins += 1;
                        versions.push(v);
                    }
                    Err(CatalogError::Conflict { .. }) => {}
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            assert_eq!(wins, 1);
        }
        assert_eq!(versions, vec![2, 3, 4, 5]);
        a.release_lease("shared", &name, &g).await.unwrap();
    }
}

async fn nodes_report_and_list(cat: &dyn Catalog) {
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

async fn tenants_and_templates(cat: &dyn Catalog) {
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

async fn heads_move_only_by_cas_with_the_current_lease(cat: &dyn Catalog) {
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

async fn leases_expire_and_fence(cat: &dyn Catalog, time: &Time) {
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

async fn a_node_renews_its_leases_in_one_call(cat: &dyn Catalog, time: &Time) {
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

async fn concurrent_checkpoints_one_winner_per_version(cat: Arc<dyn Catalog>) {
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

async fn ttls_expire(cat: &dyn Catalog) {
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

async fn tenants_do_not_see_each_other(cat: &dyn Catalog) {
    cat.create_tenant("other").await.unwrap();
    assert!(matches!(
        cat.get_workspace("other", "race").await,
        Err(CatalogError::NotFound { .. })
    ));
    assert!(matches!(
        cat.acquire_lease("other", "race", "n", 1000).await,
        Err(CatalogError::NotFound { .. })
    ));
    assert!(matches!(
        cat.list_checkpoints("other", "race").await,
        Err(CatalogError::NotFound { .. })
    ));
    assert!(cat.list_workspaces("other").await.unwrap().is_empty());
    assert!(!cat.list_workspaces("acme").await.unwrap().is_empty());
}
