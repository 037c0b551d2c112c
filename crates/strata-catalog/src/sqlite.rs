//! The embedded catalog: one SQLite file (WAL, synchronous=FULL) under the data directory.

use async_trait::async_trait;
use rusqlite::{params, OptionalExtension, TransactionBehavior};
use strata_format::manifest::ObjectRef;
use strata_format::Hash;

use crate::*;

pub struct SqliteCatalog {
    worker: worker::Worker,
    /// Time for leases, retention and GC grace: the system's, or a test's.
    clock: std::sync::Arc<dyn Clock>,
}

mod sql;
mod worker;

use sql::*;

#[async_trait]
impl Catalog for SqliteCatalog {
    async fn create_tenant_placed(
        &self,
        tenant: &str,
        store: Option<&str>,
        data_key: Option<&str>,
    ) -> Result<()> {
        let t = tenant.to_string();
        let store = store.map(str::to_string);
        let key = data_key.map(str::to_string);
        let clock = self.clock.clone();
        self.run(move |c| {
            c.execute(
                "INSERT INTO tenants (id, created_ms, store, data_key) VALUES (?1, ?2, ?3, ?4)",
                params![t, clock.now_ms() as i64, store, key],
            )
            .map_err(exists_or_backend("tenant", &t))?;
            Ok(())
        })
        .await
    }

    async fn tenant_placement(&self, tenant: &str) -> Result<TenantPlacement> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn shred_data_key(&self, tenant: &str) -> Result<()> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn add_token(&self, tok: &NewToken) -> Result<TokenInfo> {
        let tok = tok.clone();
        let clock = self.clock.clone();
        self.run(move |c| {
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

    async fn token_info(&self, hash: &str) -> Result<Option<TokenInfo>> {
        let h = hash.to_string();
        self.run(move |c| {
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

    async fn list_tokens(&self, tenant: &str) -> Result<Vec<TokenInfo>> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn revoke_token(&self, tenant: &str, id: &str) -> Result<TokenInfo> {
        let (t, id) = (tenant.to_string(), id.to_string());
        let clock = self.clock.clone();
        self.run(move |c| {
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

    async fn get_tenant(&self, tenant: &str) -> Result<TenantInfo> {
        let t = tenant.to_string();
        self.run(move |c| tenant_row(c, &t)).await
    }

    async fn store_usage(&self, tenant: &str) -> Result<StoreUsage> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn meter_usage(&self, tenant: &str, live_bytes: u64) -> Result<Meter> {
        let t = tenant.to_string();
        let clock = self.clock.clone();
        self.run(move |c| {
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

    async fn set_quotas(&self, tenant: &str, q: &Quotas) -> Result<()> {
        let (t, col) = (tenant.to_string(), q.to_column());
        self.run(move |c| {
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

    async fn begin_tenant_delete(&self, tenant: &str) -> Result<()> {
        let t = tenant.to_string();
        let clock = self.clock.clone();
        self.run(move |c| {
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

    async fn purge_tenant(&self, tenant: &str) -> Result<()> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn tenant_exists(&self, tenant: &str) -> Result<bool> {
        let t = tenant.to_string();
        self.run(move |c| {
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

    async fn record_manifest(
        &self,
        tenant: &str,
        manifest: Hash,
        objects: &[ObjectRef],
    ) -> Result<()> {
        let t = tenant.to_string();
        let objects = objects.to_vec();
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(be)?;
            live_tenant(&tx, &t)?;
            let now = clock.now_ms() as i64;
            let m = manifest.to_hex();
            tx.execute(
                "INSERT OR IGNORE INTO manifests (tenant, id, created_ms) VALUES (?1, ?2, ?3)",
                params![t, m, now],
            )
            .map_err(be)?;
            {
                let mut obj = tx
                    .prepare_cached("INSERT OR IGNORE INTO objects (tenant, id, data_len, created_ms) VALUES (?1, ?2, ?3, ?4)")
                    .map_err(be)?;
                let mut link = tx
                    .prepare_cached("INSERT OR IGNORE INTO manifest_objects (tenant, manifest, object) VALUES (?1, ?2, ?3)")
                    .map_err(be)?;
                for o in &objects {
                    let id = o.id.to_hex();
                    obj.execute(params![t, id, o.data_len as i64, now]).map_err(be)?;
                    link.execute(params![t, m, id]).map_err(be)?;
                }
            }
            tx.commit().map_err(be)
        })
        .await
    }

    async fn create_template(&self, tpl: &Template) -> Result<()> {
        let tpl = tpl.clone();
        self.run(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(be)?;
            live_tenant(&tx, &tpl.tenant)?;
            tx.execute(
                "INSERT INTO templates (tenant, name, manifest, disk_size, stored_bytes, created_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![tpl.tenant, tpl.name, tpl.manifest.to_hex(), tpl.disk_size as i64, tpl.stored_bytes as i64, tpl.created_ms as i64],
            )
            .map_err(exists_or_backend("template", &tpl.name))?;
            tx.commit().map_err(be)
        })
        .await
    }

    async fn get_template(&self, tenant: &str, name: &str) -> Result<Template> {
        let (t, n) = (tenant.to_string(), name.to_string());
        self.run(move |c| {
            c.query_row(
                "SELECT tenant, name, manifest, disk_size, stored_bytes, created_ms FROM templates WHERE tenant = ?1 AND name = ?2",
                params![t, n],
                tpl_row,
            )
            .optional()
            .map_err(be)?
            .ok_or(CatalogError::NotFound { what: "template", name: n })
        })
        .await
    }

    async fn list_templates(&self, tenant: &str) -> Result<Vec<Template>> {
        let t = tenant.to_string();
        self.run(move |c| {
            let mut s = c
                .prepare("SELECT tenant, name, manifest, disk_size, stored_bytes, created_ms FROM templates WHERE tenant = ?1 ORDER BY name")
                .map_err(be)?;
            let rows = s.query_map(params![t], tpl_row).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn delete_template(&self, tenant: &str, name: &str) -> Result<()> {
        let (t, n) = (tenant.to_string(), name.to_string());
        self.run(move |c| {
            let users: Vec<String> = {
                let mut s = c
                    .prepare("SELECT name FROM workspaces WHERE tenant = ?1 AND source = ?2 ORDER BY name")
                    .map_err(be)?;
                let rows = s
                    .query_map(params![t, format!("template:{n}")], |r| r.get(0))
                    .map_err(be)?;
                rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)?
            };
            if !users.is_empty() {
                return Err(CatalogError::InUse(format!(
                    "template {n:?} is used by workspaces: {}",
                    users.join(", ")
                )));
            }
            let k = c
                .execute("DELETE FROM templates WHERE tenant = ?1 AND name = ?2", params![t, n])
                .map_err(be)?;
            if k == 0 {
                return Err(CatalogError::NotFound { what: "template", name: n });
            }
            Ok(())
        })
        .await
    }

    async fn create_workspace(&self, w: &NewWorkspace) -> Result<Workspace> {
        let w = w.clone();
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
            let now = clock.now_ms() as i64;
            let quotas = live_tenant(&tx, &w.tenant)?.quotas;
            tx.execute(
                &format!("INSERT INTO workspaces ({WS_COLS}) VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?8)"),
                params![w.tenant, w.name, w.mode.as_str(), w.disk_size as i64, w.manifest.to_hex(), w.source, now, w.ttl_ms.map(|v| v as i64)],
            )
            .map_err(exists_or_backend("workspace", &w.name))?;
            // A leftover checkpoint history of a deleted workspace of the same name is gone
            // (delete removes it); the lease row is kept so epochs never go backwards.
            tx.execute(
                &format!("INSERT INTO checkpoints (tenant, {CP_COLS}) VALUES (?1, ?2, 1, ?3, NULL, ?4, ?5, 0, 0, NULL, 0, NULL)"),
                params![w.tenant, w.name, w.manifest.to_hex(), w.kind.as_str(), now],
            )
            .map_err(be)?;
            if quotas.workspaces.is_some() || quotas.disk_bytes.is_some() {
                let (n, bytes): (i64, i64) = tx
                    .query_row(
                        "SELECT count(*), coalesce(sum(disk_size), 0) FROM workspaces WHERE tenant = ?1",
                        params![w.tenant],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .map_err(be)?;
                check_workspace_quotas(&w.tenant, &quotas, n as u64, bytes as u64)?;
            }
            let ws = get_ws(&tx, &w.tenant, &w.name)?;
            tx.commit().map_err(be)?;
            Ok(ws)
        })
        .await
    }

    async fn get_workspace(&self, tenant: &str, name: &str) -> Result<Workspace> {
        let (t, n) = (tenant.to_string(), name.to_string());
        self.run(move |c| get_ws(c, &t, &n)).await
    }

    async fn list_workspaces(&self, tenant: &str) -> Result<Vec<Workspace>> {
        let t = tenant.to_string();
        self.run(move |c| {
            let mut s = c
                .prepare(&format!(
                    "SELECT {WS_COLS} FROM workspaces WHERE tenant = ?1 ORDER BY name"
                ))
                .map_err(be)?;
            let rows = s.query_map(params![t], ws_row).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn list_expired(&self, now_ms: u64) -> Result<Vec<(String, String)>> {
        self.run(move |c| {
            let mut s = c
                .prepare("SELECT tenant, name FROM workspaces WHERE ttl_ms IS NOT NULL AND created_ms + ttl_ms <= ?1 ORDER BY tenant, name")
                .map_err(be)?;
            let rows = s.query_map(params![now_ms as i64], |r| Ok((r.get(0)?, r.get(1)?))).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn delete_workspace(&self, tenant: &str, name: &str) -> Result<()> {
        let (t, n) = (tenant.to_string(), name.to_string());
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
            get_ws(&tx, &t, &n)?;
            let l = lease_of(&tx, &t, &n).map_err(be)?;
            if let Some(h) = l.holder.filter(|_| l.expires_ms > clock.now_ms()) {
                return Err(CatalogError::LeaseHeld {
                    holder: h,
                    epoch: l.epoch,
                    expires_in_ms: l.expires_ms.saturating_sub(clock.now_ms()),
                });
            }
            tx.execute("DELETE FROM checkpoints WHERE tenant = ?1 AND workspace = ?2", params![t, n]).map_err(be)?;
            tx.execute("DELETE FROM workspaces WHERE tenant = ?1 AND name = ?2", params![t, n]).map_err(be)?;
            tx.execute("UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = ?1 AND workspace = ?2", params![t, n]).map_err(be)?;
            tx.commit().map_err(be)
        })
        .await
    }

    async fn advance_head(
        &self,
        tenant: &str,
        workspace: &str,
        expected: u64,
        lease: &LeaseGrant,
        cp: &NewCheckpoint,
    ) -> Result<u64> {
        let (t, n, lease, cp) = (
            tenant.to_string(),
            workspace.to_string(),
            lease.clone(),
            cp.clone(),
        );
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
            let ws = get_ws(&tx, &t, &n)?;
            let l = lease_of(&tx, &t, &n).map_err(be)?;
            if l.epoch != lease.epoch || l.holder.as_deref() != Some(lease.node.as_str()) {
                return Err(CatalogError::Fenced { held: lease.epoch, current: l.epoch, holder: l.holder });
            }
            if ws.head_version != expected {
                return Err(CatalogError::Conflict { expected, actual: ws.head_version });
            }
            if cp.disk_size < ws.disk_size {
                return Err(shrink(ws.disk_size, cp.disk_size));
            }
            let v = expected + 1;
            tx.execute(
                "UPDATE workspaces SET head_version = ?3, head_manifest = ?4, disk_size = ?6 WHERE tenant = ?1 AND name = ?2 AND head_version = ?5",
                params![t, n, v as i64, cp.manifest.to_hex(), expected as i64, cp.disk_size as i64],
            )
            .map_err(be)?;
            tx.execute(
                &format!("INSERT INTO checkpoints (tenant, {CP_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"),
                params![t, n, v as i64, cp.manifest.to_hex(), cp.label, cp.kind.as_str(), clock.now_ms() as i64,
                    cp.bytes as i64, cp.cut_seq as i64, cp.journal_id, lease.epoch as i64,
                    cp.keep_until_ms.map(|v| v as i64)],
            )
            .map_err(be)?;
            tx.commit().map_err(be)?;
            Ok(v)
        })
        .await
    }

    async fn list_checkpoints(&self, tenant: &str, workspace: &str) -> Result<Vec<Checkpoint>> {
        let (t, n) = (tenant.to_string(), workspace.to_string());
        self.run(move |c| {
            get_ws(c, &t, &n)?;
            let mut s = c
                .prepare(&format!("SELECT {CP_COLS} FROM checkpoints WHERE tenant = ?1 AND workspace = ?2 AND expired_ms IS NULL ORDER BY version"))
                .map_err(be)?;
            let rows = s.query_map(params![t, n], cp_row).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn get_checkpoint(
        &self,
        tenant: &str,
        workspace: &str,
        version: u64,
    ) -> Result<Checkpoint> {
        let (t, n) = (tenant.to_string(), workspace.to_string());
        self.run(move |c| {
            c.query_row(
                &format!("SELECT {CP_COLS} FROM checkpoints WHERE tenant = ?1 AND workspace = ?2 AND version = ?3 AND expired_ms IS NULL"),
                params![t, n, version as i64],
                cp_row,
            )
            .optional()
            .map_err(be)?
            .ok_or(CatalogError::NotFound { what: "checkpoint", name: format!("{n}@{version}") })
        })
        .await
    }

    async fn acquire_lease(
        &self,
        tenant: &str,
        workspace: &str,
        node: &str,
        ttl_ms: u64,
    ) -> Result<LeaseGrant> {
        let (t, n, node) = (tenant.to_string(), workspace.to_string(), node.to_string());
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
            get_ws(&tx, &t, &n)?;
            if tenant_row(&tx, &t)?.deleting_ms.is_some() {
                return Err(deleting(&t));
            }
            let now = clock.now_ms();
            let l = lease_of(&tx, &t, &n).map_err(be)?;
            if let Some(h) = l.holder.as_ref().filter(|h| **h != node && l.expires_ms > now) {
                return Err(CatalogError::LeaseHeld {
                    holder: h.clone(),
                    epoch: l.epoch,
                    expires_in_ms: l.expires_ms - now,
                });
            }
            let grant = LeaseGrant { node, epoch: l.epoch + 1, expires_ms: now + ttl_ms };
            tx.execute(
                "INSERT INTO leases (tenant, workspace, holder, epoch, expires_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (tenant, workspace) DO UPDATE SET holder = ?3, epoch = ?4, expires_ms = ?5",
                params![t, n, grant.node, grant.epoch as i64, grant.expires_ms as i64],
            )
            .map_err(be)?;
            tx.commit().map_err(be)?;
            Ok(grant)
        })
        .await
    }

    async fn renew_lease(
        &self,
        tenant: &str,
        workspace: &str,
        lease: &LeaseGrant,
        ttl_ms: u64,
    ) -> Result<()> {
        let (t, n, lease) = (tenant.to_string(), workspace.to_string(), lease.clone());
        let clock = self.clock.clone();
        self.run_urgent(move |c| renew_one(c, &t, &n, &lease, clock.now_ms() + ttl_ms)?)
            .await
    }

    async fn renew_leases(&self, leases: &[LeaseRenewal], ttl_ms: u64) -> Result<Vec<Result<()>>> {
        let leases = leases.to_vec();
        let clock = self.clock.clone();
        self.run_urgent(move |c| {
            // One transaction, one fsync, for every lease of the node.
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(be)?;
            let mut out = Vec::with_capacity(leases.len());
            for l in &leases {
                out.push(renew_one(
                    &tx,
                    &l.tenant,
                    &l.workspace,
                    &l.lease,
                    clock.now_ms() + ttl_ms,
                )?);
            }
            tx.commit().map_err(be)?;
            Ok(out)
        })
        .await
    }

    async fn release_lease(&self, tenant: &str, workspace: &str, lease: &LeaseGrant) -> Result<()> {
        let (t, n, lease) = (tenant.to_string(), workspace.to_string(), lease.clone());
        self.run(move |c| {
            c.execute(
                "UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = ?1 AND workspace = ?2 AND holder = ?3 AND epoch = ?4",
                params![t, n, lease.node, lease.epoch as i64],
            )
            .map_err(be)?;
            Ok(())
        })
        .await
    }

    async fn get_lease(&self, tenant: &str, workspace: &str) -> Result<Lease> {
        let (t, n) = (tenant.to_string(), workspace.to_string());
        self.run(move |c| lease_of(c, &t, &n).map_err(be)).await
    }

    async fn report_node(&self, status: &NodeStatus) -> Result<()> {
        let attached = serde_json::to_string(&status.attached)
            .map_err(|e| CatalogError::from_source("encoding a node row", false, e))?;
        let (node, url) = (status.node.clone(), status.url.clone());
        let clock = self.clock.clone();
        self.run(move |c| {
            c.execute(
                "INSERT INTO nodes (id, url, seen_ms, attached) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (id) DO UPDATE SET url = ?2, seen_ms = ?3, attached = ?4",
                params![node, url, clock.now_ms() as i64, attached],
            )
            .map_err(be)?;
            Ok(())
        })
        .await
    }

    async fn list_nodes(&self) -> Result<Vec<NodeStatus>> {
        let clock = self.clock.clone();
        self.run(move |c| {
            let now = clock.now_ms();
            let mut s = c
                .prepare("SELECT id, url, seen_ms, attached FROM nodes ORDER BY id")
                .map_err(be)?;
            let rows = s
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, Option<String>>(1)?,
                        r.get::<_, i64>(2)? as u64,
                        r.get::<_, String>(3)?,
                    ))
                })
                .map_err(be)?
                .collect::<rusqlite::Result<Vec<_>>>()
                .map_err(be)?;
            rows.into_iter()
                .map(|(node, url, seen, attached)| {
                    Ok(NodeStatus {
                        node,
                        url,
                        seen_ms: seen,
                        seen_ago_ms: now.saturating_sub(seen),
                        attached: serde_json::from_str(&attached)
                            .map_err(|e| CatalogError::from_source("corrupt node row", false, e))?,
                    })
                })
                .collect()
        })
        .await
    }

    async fn create_stream(&self, st: &RelayStream) -> Result<()> {
        let st = st.clone();
        self.run(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(be)?;
            live_tenant(&tx, &st.tenant)?;
            tx.execute(
                "INSERT INTO relay_streams (tenant, name, sync, created_ms) VALUES (?1, ?2, ?3, ?4)",
                params![st.tenant, st.name, st.sync as i64, st.created_ms as i64],
            )
            .map_err(exists_or_backend("relay stream", &st.name))?;
            tx.commit().map_err(be)
        })
        .await
    }

    async fn get_stream(&self, tenant: &str, name: &str) -> Result<RelayStream> {
        let (t, n) = (tenant.to_string(), name.to_string());
        self.run(move |c| {
            c.query_row(
                "SELECT tenant, name, sync, created_ms FROM relay_streams WHERE tenant = ?1 AND name = ?2",
                params![t, n],
                stream_row,
            )
            .optional()
            .map_err(be)?
            .ok_or(CatalogError::NotFound { what: "relay stream", name: n })
        })
        .await
    }

    async fn list_streams(&self, tenant: &str) -> Result<Vec<RelayStream>> {
        let t = tenant.to_string();
        self.run(move |c| {
            let mut s = c
                .prepare("SELECT tenant, name, sync, created_ms FROM relay_streams WHERE tenant = ?1 ORDER BY name")
                .map_err(be)?;
            let rows = s.query_map(params![t], stream_row).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn list_tenants(&self) -> Result<Vec<String>> {
        self.run(move |c| {
            let mut s = c
                .prepare("SELECT id FROM tenants ORDER BY id")
                .map_err(be)?;
            let rows = s.query_map([], |r| r.get(0)).map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn expire_checkpoints(
        &self,
        tenant: &str,
        workspace: &str,
        versions: &[u64],
    ) -> Result<u64> {
        let (t, n, versions) = (tenant.to_string(), workspace.to_string(), versions.to_vec());
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
            let ws = get_ws(&tx, &t, &n)?;
            let now = clock.now_ms() as i64;
            let mut k = 0;
            for v in versions.into_iter().filter(|&v| v != ws.head_version) {
                k += tx
                    .execute(
                        "UPDATE checkpoints SET expired_ms = ?4 WHERE tenant = ?1 AND workspace = ?2 AND version = ?3 AND expired_ms IS NULL",
                        params![t, n, v as i64, now],
                    )
                    .map_err(be)? as u64;
            }
            tx.commit().map_err(be)?;
            Ok(k)
        })
        .await
    }

    async fn gc_references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>> {
        let t = tenant.to_string();
        let clock = self.clock.clone();
        self.run(move |c| {
            let since = clock.now_ms() as i64 - grace_ms as i64;
            let mut s = c
                .prepare(
                    "SELECT head_manifest FROM workspaces WHERE tenant = ?1
                     UNION SELECT manifest FROM checkpoints WHERE tenant = ?1 AND (expired_ms IS NULL OR expired_ms >= ?2)
                     UNION SELECT manifest FROM templates WHERE tenant = ?1",
                )
                .map_err(be)?;
            let rows = s
                .query_map(params![t, since], |r| hash(r.get(0)?))
                .map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn purge_expired_checkpoints(&self, tenant: &str, grace_ms: u64) -> Result<u64> {
        let t = tenant.to_string();
        let clock = self.clock.clone();
        self.run(move |c| {
            let before = clock.now_ms() as i64 - grace_ms as i64;
            Ok(c.execute(
                "DELETE FROM checkpoints WHERE tenant = ?1 AND expired_ms IS NOT NULL AND expired_ms < ?2",
                params![t, before],
            )
            .map_err(be)? as u64)
        })
        .await
    }

    async fn gc_condemn(&self, tenant: &str, keys: &[String]) -> Result<()> {
        let (t, keys) = (tenant.to_string(), keys.to_vec());
        let clock = self.clock.clone();
        self.run(move |c| {
            let tx = c.transaction().map_err(be)?;
            let now = clock.now_ms() as i64;
            {
                let mut s = tx
                    .prepare_cached("INSERT OR IGNORE INTO gc_condemned (tenant, key, condemned_ms) VALUES (?1, ?2, ?3)")
                    .map_err(be)?;
                for k in &keys {
                    s.execute(params![t, k, now]).map_err(be)?;
                }
            }
            tx.commit().map_err(be)
        })
        .await
    }

    async fn gc_condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>> {
        let t = tenant.to_string();
        let clock = self.clock.clone();
        self.run(move |c| {
            let now = clock.now_ms() as i64;
            let mut s = c
                .prepare(
                    "SELECT key, condemned_ms FROM gc_condemned WHERE tenant = ?1 ORDER BY key",
                )
                .map_err(be)?;
            let rows = s
                .query_map(params![t], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        (now - r.get::<_, i64>(1)?).max(0) as u64,
                    ))
                })
                .map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
        })
        .await
    }

    async fn prune_references(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64> {
        let t = tenant.to_string();
        let (ms, os): (Vec<String>, Vec<String>) = (
            manifests.iter().map(|h| h.to_hex()).collect(),
            objects.iter().map(|h| h.to_hex()).collect(),
        );
        self.run(move |c| {
            let tx = c.transaction().map_err(be)?;
            let mut n = 0usize;
            {
                let mut links = tx
                    .prepare_cached(
                        "DELETE FROM manifest_objects WHERE tenant = ?1 AND manifest = ?2",
                    )
                    .map_err(be)?;
                let mut man = tx
                    .prepare_cached("DELETE FROM manifests WHERE tenant = ?1 AND id = ?2")
                    .map_err(be)?;
                let mut obj = tx
                    .prepare_cached("DELETE FROM objects WHERE tenant = ?1 AND id = ?2")
                    .map_err(be)?;
                for m in &ms {
                    n += links.execute(params![t, m]).map_err(be)?;
                    n += man.execute(params![t, m]).map_err(be)?;
                }
                for o in &os {
                    n += obj.execute(params![t, o]).map_err(be)?;
                }
            }
            tx.commit().map_err(be)?;
            Ok(n as u64)
        })
        .await
    }

    async fn recorded_references(&self, tenant: &str) -> Result<(u64, u64)> {
        let t = tenant.to_string();
        self.run(move |c| {
            let count = |table: &str| -> Result<u64> {
                c.query_row(
                    &format!("SELECT COUNT(*) FROM {table} WHERE tenant = ?1"),
                    params![t],
                    |r| r.get::<_, i64>(0),
                )
                .map(|n| n as u64)
                .map_err(be)
            };
            Ok((count("manifests")?, count("objects")?))
        })
        .await
    }

    async fn gc_forget(&self, tenant: &str, keys: &[String]) -> Result<()> {
        let (t, keys) = (tenant.to_string(), keys.to_vec());
        self.run(move |c| {
            let tx = c.transaction().map_err(be)?;
            {
                let mut s = tx
                    .prepare_cached("DELETE FROM gc_condemned WHERE tenant = ?1 AND key = ?2")
                    .map_err(be)?;
                for k in &keys {
                    s.execute(params![t, k]).map_err(be)?;
                }
            }
            tx.commit().map_err(be)
        })
        .await
    }
}
