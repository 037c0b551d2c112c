//! Conformance: tenants, their tokens, placement, quotas, usage and deletion, and isolation.

use super::*;

/// A tenant's store is recorded at its creation and read back; the default is none.
pub(super) async fn tenant_placement(cat: &dyn Catalog) {
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

pub(super) fn tok(tenant: &str, hash: &str, scope: Option<&str>) -> NewToken {
    NewToken {
        tenant: tenant.into(),
        hash: hash.into(),
        scope: scope.map(Into::into),
        ..NewToken::default()
    }
}

pub(super) async fn token_lifecycle(cat: &dyn Catalog) {
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

pub(super) async fn quotas_limit_creates(cat: &dyn Catalog) {
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

pub(super) async fn store_usage_follows_references(cat: &dyn Catalog, time: &Time) {
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

pub(super) async fn tenant_deletion(cat: &dyn Catalog, time: &Time) {
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

pub(super) async fn scoped_tokens_and_streams(cat: &dyn Catalog) {
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

pub(super) async fn tenants_do_not_see_each_other(cat: &dyn Catalog) {
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
