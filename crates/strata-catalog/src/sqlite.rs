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

mod gc;
mod sql;
mod tenants;
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
        tenants::create_tenant_placed(self, tenant, store, data_key).await
    }

    async fn tenant_placement(&self, tenant: &str) -> Result<TenantPlacement> {
        tenants::tenant_placement(self, tenant).await
    }

    async fn shred_data_key(&self, tenant: &str) -> Result<()> {
        tenants::shred_data_key(self, tenant).await
    }

    async fn add_token(&self, tok: &NewToken) -> Result<TokenInfo> {
        tenants::add_token(self, tok).await
    }

    async fn token_info(&self, hash: &str) -> Result<Option<TokenInfo>> {
        tenants::token_info(self, hash).await
    }

    async fn list_tokens(&self, tenant: &str) -> Result<Vec<TokenInfo>> {
        tenants::list_tokens(self, tenant).await
    }

    async fn revoke_token(&self, tenant: &str, id: &str) -> Result<TokenInfo> {
        tenants::revoke_token(self, tenant, id).await
    }

    async fn get_tenant(&self, tenant: &str) -> Result<TenantInfo> {
        tenants::get_tenant(self, tenant).await
    }

    async fn store_usage(&self, tenant: &str) -> Result<StoreUsage> {
        tenants::store_usage(self, tenant).await
    }

    async fn meter_usage(&self, tenant: &str, live_bytes: u64) -> Result<Meter> {
        tenants::meter_usage(self, tenant, live_bytes).await
    }

    async fn set_quotas(&self, tenant: &str, q: &Quotas) -> Result<()> {
        tenants::set_quotas(self, tenant, q).await
    }

    async fn begin_tenant_delete(&self, tenant: &str) -> Result<()> {
        tenants::begin_tenant_delete(self, tenant).await
    }

    async fn purge_tenant(&self, tenant: &str) -> Result<()> {
        tenants::purge_tenant(self, tenant).await
    }

    async fn tenant_exists(&self, tenant: &str) -> Result<bool> {
        tenants::tenant_exists(self, tenant).await
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
        tenants::list_tenants(self).await
    }

    async fn expire_checkpoints(
        &self,
        tenant: &str,
        workspace: &str,
        versions: &[u64],
    ) -> Result<u64> {
        gc::expire_checkpoints(self, tenant, workspace, versions).await
    }

    async fn gc_references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>> {
        gc::gc_references(self, tenant, grace_ms).await
    }

    async fn gc_mark(&self, tenant: &str, grace_ms: u64) -> Result<GcMark> {
        gc::gc_mark(self, tenant, grace_ms).await
    }

    async fn gc_changes(
        &self,
        tenant: &str,
        grace_ms: u64,
        after_seq: i64,
        limit: usize,
    ) -> Result<GcChanges> {
        gc::gc_changes(self, tenant, grace_ms, after_seq, limit).await
    }

    async fn gc_settle(&self, tenant: &str, seqs: &[i64]) -> Result<()> {
        gc::gc_settle(self, tenant, seqs).await
    }

    async fn gc_live(&self, tenant: &str, manifests: &[Hash], objects: &[Hash]) -> Result<GcLive> {
        gc::gc_live(self, tenant, manifests, objects).await
    }

    async fn retention_due(
        &self,
        tenant: &str,
        now_ms: u64,
        all: bool,
    ) -> Result<Vec<RetentionDue>> {
        gc::retention_due(self, tenant, now_ms, all).await
    }

    async fn retention_done(
        &self,
        tenant: &str,
        workspace: &str,
        seen: u64,
        next_ms: u64,
    ) -> Result<bool> {
        gc::retention_done(self, tenant, workspace, seen, next_ms).await
    }

    async fn compaction_candidates(
        &self,
        tenant: &str,
        idle_before_ms: u64,
        all: bool,
    ) -> Result<Vec<(String, Hash)>> {
        gc::compaction_candidates(self, tenant, idle_before_ms, all).await
    }

    async fn compaction_judged(&self, tenant: &str, workspace: &str, manifest: Hash) -> Result<()> {
        gc::compaction_judged(self, tenant, workspace, manifest).await
    }

    async fn purge_expired_checkpoints(&self, tenant: &str, grace_ms: u64) -> Result<u64> {
        gc::purge_expired_checkpoints(self, tenant, grace_ms).await
    }

    async fn gc_condemn(&self, tenant: &str, keys: &[String]) -> Result<()> {
        gc::gc_condemn(self, tenant, keys).await
    }

    async fn gc_condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>> {
        gc::gc_condemned(self, tenant).await
    }

    async fn prune_references(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64> {
        gc::prune_references(self, tenant, manifests, objects).await
    }

    async fn recorded_references(&self, tenant: &str) -> Result<(u64, u64)> {
        gc::recorded_references(self, tenant).await
    }

    async fn gc_forget(&self, tenant: &str, keys: &[String]) -> Result<()> {
        gc::gc_forget(self, tenant, keys).await
    }
}
