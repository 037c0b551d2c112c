//! PostgreSQL: tenants (placement, data keys, quotas, usage, deletion) and tokens. The
//! `Catalog` impl in `postgres.rs` delegates here.

use super::*;

pub(super) async fn create_tenant_placed(
    cat: &PostgresCatalog,
    tenant: &str,
    store: Option<&str>,
    data_key: Option<&str>,
) -> Result<()> {
    let c = cat.conn().await?;
    c.execute(
        "INSERT INTO tenants (id, created_ms, store, data_key) VALUES ($1, $2, $3, $4)",
        &[&tenant, &(now_ms() as i64), &store, &data_key],
    )
    .await
    .map_err(exists_or_backend("tenant", tenant))?;
    Ok(())
}

pub(super) async fn tenant_placement(
    cat: &PostgresCatalog,
    tenant: &str,
) -> Result<TenantPlacement> {
    let c = cat.conn().await?;
    c.query_opt(
        "SELECT store, data_key, created_ms FROM tenants WHERE id = $1",
        &[&tenant],
    )
    .await
    .map_err(be)?
    .map(|r| TenantPlacement {
        store: r.get(0),
        data_key: r.get(1),
        created_ms: r.get::<_, i64>(2) as u64,
    })
    .ok_or(CatalogError::NotFound {
        what: "tenant",
        name: tenant.into(),
    })
}

pub(super) async fn shred_data_key(cat: &PostgresCatalog, tenant: &str) -> Result<()> {
    let c = cat.conn().await?;
    let n = c
        .execute(
            "UPDATE tenants SET data_key = 'shredded' WHERE id = $1 AND data_key IS NOT NULL AND deleting_ms IS NOT NULL",
            &[&tenant],
        )
        .await
        .map_err(be)?;
    if n == 0 && tenant_row(&c, tenant, "").await?.deleting_ms.is_none() {
        return Err(CatalogError::backend(format!(
            "tenant {tenant:?}: its data key is destroyed only by its deletion"
        )));
    }
    Ok(())
}

pub(super) async fn tenant_exists(cat: &PostgresCatalog, tenant: &str) -> Result<bool> {
    let c = cat.conn().await?;
    Ok(
        c.query_opt("SELECT 1 FROM tenants WHERE id = $1", &[&tenant])
            .await
            .map_err(be)?
            .is_some(),
    )
}

pub(super) async fn add_token(cat: &PostgresCatalog, tok: &NewToken) -> Result<TokenInfo> {
    let mut c = cat.conn().await?;
    let tx = c.transaction().await.map_err(be)?;
    // Shares the tenant row's lock with a deletion's mark.
    if tenant_row(&tx, &tok.tenant, " FOR SHARE")
        .await?
        .deleting_ms
        .is_some()
    {
        return Err(deleting(&tok.tenant));
    }
    let created = now_ms();
    tx.execute(
        "INSERT INTO tokens (hash, tenant, created_ms, scope, id, expires_ms, label)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &tok.hash,
            &tok.tenant,
            &(created as i64),
            &tok.scope,
            &token_id(&tok.hash),
            &tok.expires_ms.map(|e| e as i64),
            &tok.label,
        ],
    )
    .await
    .map_err(be)?;
    tx.commit().await.map_err(be)?;
    Ok(TokenInfo {
        id: token_id(&tok.hash),
        tenant: tok.tenant.clone(),
        scope: tok.scope.clone(),
        created_ms: created,
        expires_ms: tok.expires_ms,
        revoked_ms: None,
        label: tok.label.clone(),
    })
}

pub(super) async fn token_info(cat: &PostgresCatalog, hash: &str) -> Result<Option<TokenInfo>> {
    let c = cat.conn().await?;
    Ok(c.query_opt(
        &format!(
            "SELECT {TOKEN_COLS} FROM tokens k JOIN tenants t ON t.id = k.tenant
                 WHERE k.hash = $1 AND t.deleting_ms IS NULL"
        ),
        &[&hash],
    )
    .await
    .map_err(be)?
    .map(|r| token_row(&r)))
}

pub(super) async fn list_tokens(cat: &PostgresCatalog, tenant: &str) -> Result<Vec<TokenInfo>> {
    let c = cat.conn().await?;
    tenant_row(&c, tenant, "").await?;
    Ok(c.query(
        &format!(
            "SELECT {TOKEN_COLS} FROM tokens k WHERE k.tenant = $1 ORDER BY k.created_ms, k.id"
        ),
        &[&tenant],
    )
    .await
    .map_err(be)?
    .iter()
    .map(token_row)
    .collect())
}

pub(super) async fn revoke_token(
    cat: &PostgresCatalog,
    tenant: &str,
    id: &str,
) -> Result<TokenInfo> {
    let c = cat.conn().await?;
    c.execute(
        "UPDATE tokens SET revoked_ms = $3
         WHERE tenant = $1 AND coalesce(id, substr(hash, 1, 16)) = $2 AND revoked_ms IS NULL",
        &[&tenant, &id, &(now_ms() as i64)],
    )
    .await
    .map_err(be)?;
    c.query_opt(
        &format!("SELECT {TOKEN_COLS} FROM tokens k WHERE k.tenant = $1 AND coalesce(k.id, substr(k.hash, 1, 16)) = $2"),
        &[&tenant, &id],
    )
    .await
    .map_err(be)?
    .map(|r| token_row(&r))
    .ok_or(CatalogError::NotFound {
        what: "token",
        name: id.into(),
    })
}

pub(super) async fn get_tenant(cat: &PostgresCatalog, tenant: &str) -> Result<TenantInfo> {
    let c = cat.conn().await?;
    tenant_row(&c, tenant, "").await
}

pub(super) async fn store_usage(cat: &PostgresCatalog, tenant: &str) -> Result<StoreUsage> {
    let mut c = cat.conn().await?;
    // One snapshot: the total and the per-workspace figures agree.
    let tx = c
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(be)?;
    let pg = |sql: &str| {
        sql.replace("?1", "$1")
            .replace("sum(o.data_len), 0)", "sum(o.data_len), 0)::BIGINT")
    };
    let r = tx
        .query_one(&pg(TENANT_LIVE_SQL), &[&tenant])
        .await
        .map_err(be)?;
    let (n, b): (i64, i64) = (r.get(0), r.get(1));
    let workspaces = tx
        .query(&pg(WORKSPACE_LIVE_SQL), &[&tenant])
        .await
        .map_err(be)?
        .iter()
        .map(|r| WorkspaceStoreUsage {
            workspace: r.get(0),
            live_objects: r.get::<_, i64>(1) as u64,
            live_bytes: r.get::<_, i64>(2) as u64,
        })
        .collect();
    tx.commit().await.map_err(be)?;
    Ok(StoreUsage {
        live_objects: n as u64,
        live_bytes: b as u64,
        workspaces,
    })
}

pub(super) async fn meter_usage(
    cat: &PostgresCatalog,
    tenant: &str,
    live_bytes: u64,
) -> Result<Meter> {
    let mut c = cat.conn().await?;
    let tx = c.transaction().await.map_err(be)?;
    // The tenant row's lock orders readings from several nodes.
    live_tenant(&tx, tenant, " FOR UPDATE").await?;
    let now = server_now(&tx).await?;
    let prev = tx
        .query_opt(
            "SELECT live_bytes, byte_seconds, since_ms, last_ms FROM usage_meter WHERE tenant = $1",
            &[&tenant],
        )
        .await
        .map_err(be)?
        .map(|r| Meter {
            live_bytes: r.get::<_, i64>(0) as u64,
            byte_seconds: r.get(1),
            since_ms: r.get::<_, i64>(2) as u64,
            last_ms: r.get::<_, i64>(3) as u64,
        });
    let m = advance_meter(prev, live_bytes, now);
    tx.execute(
        "INSERT INTO usage_meter (tenant, live_bytes, byte_seconds, since_ms, last_ms)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (tenant) DO UPDATE SET live_bytes = $2, byte_seconds = $3, last_ms = $5",
        &[
            &tenant,
            &(m.live_bytes as i64),
            &m.byte_seconds,
            &(m.since_ms as i64),
            &(m.last_ms as i64),
        ],
    )
    .await
    .map_err(be)?;
    tx.commit().await.map_err(be)?;
    Ok(m)
}

pub(super) async fn set_quotas(cat: &PostgresCatalog, tenant: &str, q: &Quotas) -> Result<()> {
    let c = cat.conn().await?;
    let n = c
        .execute(
            "UPDATE tenants SET quotas = $2 WHERE id = $1",
            &[&tenant, &q.to_column()],
        )
        .await
        .map_err(be)?;
    if n == 0 {
        return Err(CatalogError::NotFound {
            what: "tenant",
            name: tenant.into(),
        });
    }
    Ok(())
}

pub(super) async fn begin_tenant_delete(cat: &PostgresCatalog, tenant: &str) -> Result<()> {
    let mut c = cat.conn().await?;
    let tx = c.transaction().await.map_err(be)?;
    // The row lock orders this against every lease grant (which takes it FOR SHARE): a
    // grant either committed before (and is seen below) or sees the mark.
    if tenant_row(&tx, tenant, " FOR UPDATE")
        .await?
        .deleting_ms
        .is_some()
    {
        return Ok(());
    }
    let now = server_now(&tx).await?;
    if let Some(r) = tx
        .query_opt(
            "SELECT workspace, holder FROM leases
             WHERE tenant = $1 AND holder IS NOT NULL AND expires_ms > $2
             ORDER BY workspace LIMIT 1",
            &[&tenant, &(now as i64)],
        )
        .await
        .map_err(be)?
    {
        return Err(attached_refusal(tenant, r.get(0), r.get(1)));
    }
    tx.execute(
        "UPDATE tenants SET deleting_ms = $2 WHERE id = $1",
        &[&tenant, &(now as i64)],
    )
    .await
    .map_err(be)?;
    // Leases that ran out are taken away with the mark: a late renewal (it matches holder
    // and epoch only) can no longer bring one back under the deletion.
    tx.execute(
        "UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = $1 AND holder IS NOT NULL",
        &[&tenant],
    )
    .await
    .map_err(be)?;
    tx.commit().await.map_err(be)
}

pub(super) async fn purge_tenant(cat: &PostgresCatalog, tenant: &str) -> Result<()> {
    let mut c = cat.conn().await?;
    let tx = c.transaction().await.map_err(be)?;
    let info = tenant_row(&tx, tenant, " FOR UPDATE").await?;
    let n: i64 = tx
        .query_one(
            "SELECT count(*) FROM workspaces WHERE tenant = $1",
            &[&tenant],
        )
        .await
        .map_err(be)?
        .get(0);
    purge_check(tenant, &info, n as u64)?;
    for table in TENANT_TABLES {
        tx.execute(
            &format!("DELETE FROM {table} WHERE tenant = $1"),
            &[&tenant],
        )
        .await
        .map_err(be)?;
    }
    tx.execute("DELETE FROM tenants WHERE id = $1", &[&tenant])
        .await
        .map_err(be)?;
    tx.commit().await.map_err(be)
}

pub(super) async fn list_tenants(cat: &PostgresCatalog) -> Result<Vec<String>> {
    let c = cat.conn().await?;
    Ok(c.query("SELECT id FROM tenants ORDER BY id", &[])
        .await
        .map_err(be)?
        .iter()
        .map(|r| r.get(0))
        .collect())
}
