//! SQLite: tenants (placement, data keys, quotas, usage, deletion) and tokens. The `Catalog`
//! impl in `sqlite.rs` delegates here.

use super::*;

pub(super) async fn create_tenant_placed(
    cat: &SqliteCatalog,
    tenant: &str,
    store: Option<&str>,
    data_key: Option<&str>,
) -> Result<()> {
    let t = tenant.to_string();
    let store = store.map(str::to_string);
    let key = data_key.map(str::to_string);
    let clock = cat.clock.clone();
    cat.run(move |c| {
        c.execute(
            "INSERT INTO tenants (id, created_ms, store, data_key) VALUES (?1, ?2, ?3, ?4)",
            params![t, clock.now_ms() as i64, store, key],
        )
        .map_err(exists_or_backend("tenant", &t))?;
        Ok(())
    })
    .await
}

pub(super) async fn tenant_placement(cat: &SqliteCatalog, tenant: &str) -> Result<TenantPlacement> {
    let t = tenant.to_string();
    cat.run(move |c| {
        c.query_row(
            "SELECT store, data_key, created_ms FROM tenants WHERE id = ?1",
            params![t],
            |r| {
                Ok(TenantPlacement {
                    store: r.get(0)?,
                    data_key: r.get(1)?,
                    created_ms: r.get::<_, i64>(2)? as u64,
                })
            },
        )
        .optional()
        .map_err(be)?
        .ok_or(CatalogError::NotFound {
            what: "tenant",
            name: t,
        })
    })
    .await
}

pub(super) async fn shred_data_key(cat: &SqliteCatalog, tenant: &str) -> Result<()> {
    let t = tenant.to_string();
    cat.run(move |c| {
        let n = c
            .execute(
                "UPDATE tenants SET data_key = 'shredded' WHERE id = ?1 AND data_key IS NOT NULL AND deleting_ms IS NOT NULL",
                params![t],
            )
            .map_err(be)?;
        if n == 0 && tenant_row(c, &t)?.deleting_ms.is_none() {
            return Err(CatalogError::backend(format!(
                "tenant {t:?}: its data key is destroyed only by its deletion"
            )));
        }
        Ok(())
    })
    .await
}

pub(super) async fn add_token(cat: &SqliteCatalog, tok: &NewToken) -> Result<TokenInfo> {
    let tok = tok.clone();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        let info = tenant_row(&tx, &tok.tenant)?;
        if info.deleting_ms.is_some() {
            return Err(deleting(&tok.tenant));
        }
        let created = clock.now_ms();
        tx.execute(
            "INSERT INTO tokens (hash, tenant, created_ms, scope, id, expires_ms, label)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                tok.hash,
                tok.tenant,
                created as i64,
                tok.scope,
                token_id(&tok.hash),
                tok.expires_ms.map(|e| e as i64),
                tok.label
            ],
        )
        .map_err(be)?;
        tx.commit().map_err(be)?;
        Ok(TokenInfo {
            id: token_id(&tok.hash),
            tenant: tok.tenant,
            scope: tok.scope,
            created_ms: created,
            expires_ms: tok.expires_ms,
            revoked_ms: None,
            label: tok.label,
        })
    })
    .await
}

pub(super) async fn token_info(cat: &SqliteCatalog, hash: &str) -> Result<Option<TokenInfo>> {
    let h = hash.to_string();
    cat.run(move |c| {
        c.query_row(
            &format!(
                "SELECT {TOKEN_COLS} FROM tokens k JOIN tenants t ON t.id = k.tenant
                 WHERE k.hash = ?1 AND t.deleting_ms IS NULL"
            ),
            params![h],
            token_row,
        )
        .optional()
        .map_err(be)
    })
    .await
}

pub(super) async fn list_tokens(cat: &SqliteCatalog, tenant: &str) -> Result<Vec<TokenInfo>> {
    let t = tenant.to_string();
    cat.run(move |c| {
        tenant_row(c, &t)?;
        let mut s = c
            .prepare(&format!(
                "SELECT {TOKEN_COLS} FROM tokens k WHERE k.tenant = ?1 ORDER BY k.created_ms, k.id"
            ))
            .map_err(be)?;
        let rows = s.query_map(params![t], token_row).map_err(be)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
    })
    .await
}

pub(super) async fn revoke_token(cat: &SqliteCatalog, tenant: &str, id: &str) -> Result<TokenInfo> {
    let (t, id) = (tenant.to_string(), id.to_string());
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        tx.execute(
            "UPDATE tokens SET revoked_ms = ?3
                 WHERE tenant = ?1 AND coalesce(id, substr(hash, 1, 16)) = ?2 AND revoked_ms IS NULL",
            params![t, id, clock.now_ms() as i64],
        )
        .map_err(be)?;
        let info = tx
            .query_row(
                &format!("SELECT {TOKEN_COLS} FROM tokens k WHERE k.tenant = ?1 AND coalesce(k.id, substr(k.hash, 1, 16)) = ?2"),
                params![t, id],
                token_row,
            )
            .optional()
            .map_err(be)?
            .ok_or(CatalogError::NotFound {
                what: "token",
                name: id.clone(),
            })?;
        tx.commit().map_err(be)?;
        Ok(info)
    })
    .await
}

pub(super) async fn get_tenant(cat: &SqliteCatalog, tenant: &str) -> Result<TenantInfo> {
    let t = tenant.to_string();
    cat.run(move |c| tenant_row(c, &t)).await
}

pub(super) async fn store_usage(cat: &SqliteCatalog, tenant: &str) -> Result<StoreUsage> {
    let t = tenant.to_string();
    cat.run(move |c| {
        // One read transaction: the total and the per-workspace figures agree.
        let tx = c.transaction().map_err(be)?;
        let (n, b): (i64, i64) = tx
            .query_row(TENANT_LIVE_SQL, params![t], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(be)?;
        let mut s = tx.prepare(WORKSPACE_LIVE_SQL).map_err(be)?;
        let rows = s
            .query_map(params![t], |r| {
                Ok(WorkspaceStoreUsage {
                    workspace: r.get(0)?,
                    live_objects: r.get::<_, i64>(1)? as u64,
                    live_bytes: r.get::<_, i64>(2)? as u64,
                })
            })
            .map_err(be)?;
        let workspaces = rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)?;
        drop(s);
        tx.commit().map_err(be)?;
        Ok(StoreUsage {
            live_objects: n as u64,
            live_bytes: b as u64,
            workspaces,
        })
    })
    .await
}

pub(super) async fn meter_usage(
    cat: &SqliteCatalog,
    tenant: &str,
    live_bytes: u64,
) -> Result<Meter> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        live_tenant(&tx, &t)?;
        let prev = tx
            .query_row(
                "SELECT live_bytes, byte_seconds, since_ms, last_ms FROM usage_meter WHERE tenant = ?1",
                params![t],
                |r| {
                    Ok(Meter {
                        live_bytes: r.get::<_, i64>(0)? as u64,
                        byte_seconds: r.get(1)?,
                        since_ms: r.get::<_, i64>(2)? as u64,
                        last_ms: r.get::<_, i64>(3)? as u64,
                    })
                },
            )
            .optional()
            .map_err(be)?;
        let m = advance_meter(prev, live_bytes, clock.now_ms());
        tx.execute(
            "INSERT INTO usage_meter (tenant, live_bytes, byte_seconds, since_ms, last_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (tenant) DO UPDATE SET live_bytes = ?2, byte_seconds = ?3, last_ms = ?5",
            params![t, m.live_bytes as i64, m.byte_seconds, m.since_ms as i64, m.last_ms as i64],
        )
        .map_err(be)?;
        tx.commit().map_err(be)?;
        Ok(m)
    })
    .await
}

pub(super) async fn set_quotas(cat: &SqliteCatalog, tenant: &str, q: &Quotas) -> Result<()> {
    let (t, col) = (tenant.to_string(), q.to_column());
    cat.run(move |c| {
        let n = c
            .execute(
                "UPDATE tenants SET quotas = ?2 WHERE id = ?1",
                params![t, col],
            )
            .map_err(be)?;
        if n == 0 {
            return Err(CatalogError::NotFound {
                what: "tenant",
                name: t,
            });
        }
        Ok(())
    })
    .await
}

pub(super) async fn begin_tenant_delete(cat: &SqliteCatalog, tenant: &str) -> Result<()> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        let info = tenant_row(&tx, &t)?;
        if info.deleting_ms.is_some() {
            return Ok(());
        }
        let now = clock.now_ms();
        let live: Option<(String, String)> = tx
            .query_row(
                "SELECT workspace, holder FROM leases
                 WHERE tenant = ?1 AND holder IS NOT NULL AND expires_ms > ?2
                 ORDER BY workspace LIMIT 1",
                params![t, now as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(be)?;
        if let Some((ws, node)) = live {
            return Err(attached_refusal(&t, &ws, &node));
        }
        tx.execute(
            "UPDATE tenants SET deleting_ms = ?2 WHERE id = ?1",
            params![t, now as i64],
        )
        .map_err(be)?;
        // Leases that ran out are taken away with the mark: a late renewal (it matches
        // holder and epoch only) can no longer bring one back under the deletion.
        tx.execute(
            "UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = ?1 AND holder IS NOT NULL",
            params![t],
        )
        .map_err(be)?;
        tx.commit().map_err(be)
    })
    .await
}

pub(super) async fn purge_tenant(cat: &SqliteCatalog, tenant: &str) -> Result<()> {
    let t = tenant.to_string();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        purge_check(&t, &tenant_row(&tx, &t)?, {
            tx.query_row(
                "SELECT count(*) FROM workspaces WHERE tenant = ?1",
                params![t],
                |r| r.get::<_, i64>(0),
            )
            .map_err(be)? as u64
        })?;
        for table in TENANT_TABLES {
            tx.execute(
                &format!("DELETE FROM {table} WHERE tenant = ?1"),
                params![t],
            )
            .map_err(be)?;
        }
        tx.execute("DELETE FROM tenants WHERE id = ?1", params![t])
            .map_err(be)?;
        tx.commit().map_err(be)
    })
    .await
}

pub(super) async fn tenant_exists(cat: &SqliteCatalog, tenant: &str) -> Result<bool> {
    let t = tenant.to_string();
    cat.run(move |c| {
        c.query_row(
            "SELECT 1 FROM tenants WHERE id = ?1",
            params![t],
            |_| Ok(()),
        )
        .optional()
        .map(|r| r.is_some())
        .map_err(be)
    })
    .await
}

pub(super) async fn list_tenants(cat: &SqliteCatalog) -> Result<Vec<String>> {
    cat.run(move |c| {
        let mut s = c
            .prepare("SELECT id FROM tenants ORDER BY id")
            .map_err(be)?;
        let rows = s.query_map([], |r| r.get(0)).map_err(be)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
    })
    .await
}
