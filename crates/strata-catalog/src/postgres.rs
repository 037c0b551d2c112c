//! The scale-out catalog: PostgreSQL (any compatible server) through `tokio-postgres` with a
//! `deadpool` connection pool. Several nodes share one database.
//!
//! Every head move and lease change is one transaction that first locks the workspace row
//! (`SELECT … FOR UPDATE`), so concurrent nodes serialize on the workspace and the checks read
//! committed state. Lease expiry is judged by the *database server's* clock
//! (`clock_timestamp()`), never a node's, so nodes with skewed clocks still agree on who holds a
//! lease. A node enforces its own lease locally with a monotonic deadline measured from before
//! it asked (see the volume), which is always earlier than the server's expiry.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use deadpool_postgres::Pool;
use strata_format::manifest::ObjectRef;
use strata_format::Hash;

use crate::*;

pub struct PostgresCatalog {
    pool: Pool,
}

mod sql;
mod sweep;
mod tenants;
mod tls;

use sql::*;
pub use sql::{create_database, pg_retryable};

#[async_trait]
impl Catalog for PostgresCatalog {
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

    async fn tenant_exists(&self, tenant: &str) -> Result<bool> {
        tenants::tenant_exists(self, tenant).await
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

    async fn record_manifest(
        &self,
        tenant: &str,
        manifest: Hash,
        objects: &[ObjectRef],
    ) -> Result<()> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        live_tenant(&tx, tenant, " FOR SHARE").await?;
        let now = now_ms() as i64;
        let m = manifest.to_hex();
        tx.execute(
            "INSERT INTO manifests (tenant, id, created_ms) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            &[&tenant, &m, &now],
        )
        .await
        .map_err(be)?;
        if !objects.is_empty() {
            // One statement per table for the whole manifest (arrays unnested server-side).
            let ids: Vec<String> = objects.iter().map(|o| o.id.to_hex()).collect();
            let lens: Vec<i64> = objects.iter().map(|o| o.data_len as i64).collect();
            tx.execute(
                "INSERT INTO objects (tenant, id, data_len, created_ms)
                 SELECT $1, id, len, $4 FROM unnest($2::TEXT[], $3::BIGINT[]) AS u(id, len)
                 ON CONFLICT DO NOTHING",
                &[&tenant, &ids, &lens, &now],
            )
            .await
            .map_err(be)?;
            tx.execute(
                "INSERT INTO manifest_objects (tenant, manifest, object)
                 SELECT DISTINCT $1, $2, id FROM unnest($3::TEXT[]) AS u(id)
                 ON CONFLICT DO NOTHING",
                &[&tenant, &m, &ids],
            )
            .await
            .map_err(be)?;
        }
        tx.commit().await.map_err(be)
    }

    async fn create_template(&self, t: &Template) -> Result<()> {
        let mut c = self.conn().await?;
        let c = c.transaction().await.map_err(be)?;
        live_tenant(&c, &t.tenant, " FOR SHARE").await?;
        c.execute(
            &format!("INSERT INTO templates ({TPL_COLS}) VALUES ($1, $2, $3, $4, $5, $6)"),
            &[
                &t.tenant,
                &t.name,
                &t.manifest.to_hex(),
                &(t.disk_size as i64),
                &(t.stored_bytes as i64),
                &(t.created_ms as i64),
            ],
        )
        .await
        .map_err(exists_or_backend("template", &t.name))?;
        c.commit().await.map_err(be)
    }

    async fn get_template(&self, tenant: &str, name: &str) -> Result<Template> {
        let c = self.conn().await?;
        match c
            .query_opt(
                &format!("SELECT {TPL_COLS} FROM templates WHERE tenant = $1 AND name = $2"),
                &[&tenant, &name],
            )
            .await
            .map_err(be)?
        {
            Some(r) => tpl_row(&r),
            None => Err(CatalogError::NotFound {
                what: "template",
                name: name.into(),
            }),
        }
    }

    async fn list_templates(&self, tenant: &str) -> Result<Vec<Template>> {
        let c = self.conn().await?;
        c.query(
            &format!("SELECT {TPL_COLS} FROM templates WHERE tenant = $1 ORDER BY name"),
            &[&tenant],
        )
        .await
        .map_err(be)?
        .iter()
        .map(tpl_row)
        .collect()
    }

    async fn delete_template(&self, tenant: &str, name: &str) -> Result<()> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        // Lock the template row so a concurrent create-from-template cannot slip in unseen.
        if tx
            .query_opt(
                "SELECT 1 FROM templates WHERE tenant = $1 AND name = $2 FOR UPDATE",
                &[&tenant, &name],
            )
            .await
            .map_err(be)?
            .is_none()
        {
            return Err(CatalogError::NotFound {
                what: "template",
                name: name.into(),
            });
        }
        let users: Vec<String> = tx
            .query(
                "SELECT name FROM workspaces WHERE tenant = $1 AND source = $2 ORDER BY name",
                &[&tenant, &format!("template:{name}")],
            )
            .await
            .map_err(be)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if !users.is_empty() {
            return Err(CatalogError::InUse(format!(
                "template {name:?} is used by workspaces: {}",
                users.join(", ")
            )));
        }
        tx.execute(
            "DELETE FROM templates WHERE tenant = $1 AND name = $2",
            &[&tenant, &name],
        )
        .await
        .map_err(be)?;
        tx.commit().await.map_err(be)
    }

    async fn create_workspace(&self, w: &NewWorkspace) -> Result<Workspace> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        let now = now_ms() as i64;
        let m = w.manifest.to_hex();
        // The tenant row's lock orders creates against each other (quotas) and against a
        // deletion's mark.
        let quotas = live_tenant(&tx, &w.tenant, " FOR UPDATE").await?.quotas;
        tx.execute(
            &format!(
                "INSERT INTO workspaces ({WS_COLS}) VALUES ($1, $2, $3, $4, 1, $5, $6, $7, $8)"
            ),
            &[
                &w.tenant,
                &w.name,
                &w.mode.as_str(),
                &(w.disk_size as i64),
                &m,
                &w.source,
                &now,
                &w.ttl_ms.map(|v| v as i64),
            ],
        )
        .await
        .map_err(exists_or_backend("workspace", &w.name))?;
        tx.execute(
            &format!("INSERT INTO checkpoints (tenant, {CP_COLS}) VALUES ($1, $2, 1, $3, NULL, $4, $5, 0, 0, NULL, 0, NULL)"),
            &[&w.tenant, &w.name, &m, &w.kind.as_str(), &now],
        )
        .await
        .map_err(be)?;
        if quotas.workspaces.is_some() || quotas.disk_bytes.is_some() {
            let r = tx
                .query_one(
                    "SELECT count(*), coalesce(sum(disk_size), 0)::BIGINT FROM workspaces WHERE tenant = $1",
                    &[&w.tenant],
                )
                .await
                .map_err(be)?;
            let (n, bytes): (i64, i64) = (r.get(0), r.get(1));
            check_workspace_quotas(&w.tenant, &quotas, n as u64, bytes as u64)?;
        }
        let ws = get_ws(&tx, &w.tenant, &w.name, false).await?;
        tx.commit().await.map_err(be)?;
        Ok(ws)
    }

    async fn get_workspace(&self, tenant: &str, name: &str) -> Result<Workspace> {
        let c = self.conn().await?;
        get_ws(&c, tenant, name, false).await
    }

    async fn list_workspaces(&self, tenant: &str) -> Result<Vec<Workspace>> {
        let c = self.conn().await?;
        c.query(
            &format!("SELECT {WS_COLS} FROM workspaces WHERE tenant = $1 ORDER BY name"),
            &[&tenant],
        )
        .await
        .map_err(be)?
        .iter()
        .map(ws_row)
        .collect()
    }

    async fn list_expired(&self, now_ms: u64) -> Result<Vec<(String, String)>> {
        let c = self.conn().await?;
        Ok(c
            .query(
                "SELECT tenant, name FROM workspaces WHERE ttl_ms IS NOT NULL AND created_ms + ttl_ms <= $1 ORDER BY tenant, name",
                &[&(now_ms as i64)],
            )
            .await
            .map_err(be)?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
    }

    async fn delete_workspace(&self, tenant: &str, name: &str) -> Result<()> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        get_ws(&tx, tenant, name, true).await?;
        let now = server_now(&tx).await?;
        let l = lease_of(&tx, tenant, name).await?;
        if let Some(h) = l.holder.filter(|_| l.expires_ms > now) {
            return Err(CatalogError::LeaseHeld {
                holder: h,
                epoch: l.epoch,
                expires_in_ms: l.expires_ms.saturating_sub(now),
            });
        }
        for q in [
            "DELETE FROM checkpoints WHERE tenant = $1 AND workspace = $2",
            "DELETE FROM workspaces WHERE tenant = $1 AND name = $2",
            // The lease row stays so epochs never go backwards if the name is reused.
            "UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = $1 AND workspace = $2",
        ] {
            tx.execute(q, &[&tenant, &name]).await.map_err(be)?;
        }
        tx.commit().await.map_err(be)
    }

    async fn advance_head(
        &self,
        tenant: &str,
        workspace: &str,
        expected: u64,
        lease: &LeaseGrant,
        cp: &NewCheckpoint,
    ) -> Result<u64> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        let ws = get_ws(&tx, tenant, workspace, true).await?;
        let l = lease_of(&tx, tenant, workspace).await?;
        if l.epoch != lease.epoch || l.holder.as_deref() != Some(lease.node.as_str()) {
            return Err(CatalogError::Fenced {
                held: lease.epoch,
                current: l.epoch,
                holder: l.holder,
            });
        }
        if ws.head_version != expected {
            return Err(CatalogError::Conflict {
                expected,
                actual: ws.head_version,
            });
        }
        if cp.disk_size < ws.disk_size {
            return Err(crate::shrink(ws.disk_size, cp.disk_size));
        }
        let v = (expected + 1) as i64;
        let m = cp.manifest.to_hex();
        let k = tx
            .execute(
                "UPDATE workspaces SET head_version = $3, head_manifest = $4, disk_size = $6 WHERE tenant = $1 AND name = $2 AND head_version = $5",
                &[&tenant, &workspace, &v, &m, &(expected as i64), &(cp.disk_size as i64)],
            )
            .await
            .map_err(be)?;
        if k != 1 {
            return Err(CatalogError::unavailable("head changed under a row lock"));
        }
        tx.execute(
            &format!("INSERT INTO checkpoints (tenant, {CP_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"),
            &[
                &tenant,
                &workspace,
                &v,
                &m,
                &cp.label,
                &cp.kind.as_str(),
                &(now_ms() as i64),
                &(cp.bytes as i64),
                &(cp.cut_seq as i64),
                &cp.journal_id,
                &(lease.epoch as i64),
                &cp.keep_until_ms.map(|v| v as i64),
            ],
        )
        .await
        .map_err(be)?;
        tx.commit().await.map_err(be)?;
        Ok(v as u64)
    }

    async fn list_checkpoints(&self, tenant: &str, workspace: &str) -> Result<Vec<Checkpoint>> {
        let c = self.conn().await?;
        get_ws(&c, tenant, workspace, false).await?;
        c.query(
            &format!("SELECT {CP_COLS} FROM checkpoints WHERE tenant = $1 AND workspace = $2 AND expired_ms IS NULL ORDER BY version"),
            &[&tenant, &workspace],
        )
        .await
        .map_err(be)?
        .iter()
        .map(cp_row)
        .collect()
    }

    async fn get_checkpoint(
        &self,
        tenant: &str,
        workspace: &str,
        version: u64,
    ) -> Result<Checkpoint> {
        let c = self.conn().await?;
        match c
            .query_opt(
                &format!("SELECT {CP_COLS} FROM checkpoints WHERE tenant = $1 AND workspace = $2 AND version = $3 AND expired_ms IS NULL"),
                &[&tenant, &workspace, &(version as i64)],
            )
            .await
            .map_err(be)?
        {
            Some(r) => cp_row(&r),
            None => Err(CatalogError::NotFound {
                what: "checkpoint",
                name: format!("{workspace}@{version}"),
            }),
        }
    }

    async fn acquire_lease(
        &self,
        tenant: &str,
        workspace: &str,
        node: &str,
        ttl_ms: u64,
    ) -> Result<LeaseGrant> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        get_ws(&tx, tenant, workspace, true).await?;
        // Ordered against a tenant deletion's mark by the tenant row's lock.
        if tenant_row(&tx, tenant, " FOR SHARE")
            .await?
            .deleting_ms
            .is_some()
        {
            return Err(deleting(tenant));
        }
        let now = server_now(&tx).await?;
        let l = lease_of(&tx, tenant, workspace).await?;
        if let Some(h) = l
            .holder
            .as_ref()
            .filter(|h| *h != node && l.expires_ms > now)
        {
            return Err(CatalogError::LeaseHeld {
                holder: h.clone(),
                epoch: l.epoch,
                expires_in_ms: l.expires_ms - now,
            });
        }
        let grant = LeaseGrant {
            node: node.into(),
            epoch: l.epoch + 1,
            expires_ms: now + ttl_ms,
        };
        tx.execute(
            "INSERT INTO leases (tenant, workspace, holder, epoch, expires_ms) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (tenant, workspace) DO UPDATE SET holder = $3, epoch = $4, expires_ms = $5",
            &[&tenant, &workspace, &grant.node, &(grant.epoch as i64), &(grant.expires_ms as i64)],
        )
        .await
        .map_err(be)?;
        tx.commit().await.map_err(be)?;
        Ok(grant)
    }

    async fn renew_lease(
        &self,
        tenant: &str,
        workspace: &str,
        lease: &LeaseGrant,
        ttl_ms: u64,
    ) -> Result<()> {
        let c = self.conn().await?;
        let k = c
            .execute(
                &format!(
                    "UPDATE leases SET expires_ms = ({SERVER_NOW}) + $5 WHERE tenant = $1 AND workspace = $2 AND holder = $3 AND epoch = $4"
                ),
                &[&tenant, &workspace, &lease.node, &(lease.epoch as i64), &(ttl_ms as i64)],
            )
            .await
            .map_err(be)?;
        if k == 0 {
            let l = lease_of(&c, tenant, workspace).await?;
            return Err(CatalogError::Fenced {
                held: lease.epoch,
                current: l.epoch,
                holder: l.holder,
            });
        }
        Ok(())
    }

    async fn renew_leases(&self, leases: &[LeaseRenewal], ttl_ms: u64) -> Result<Vec<Result<()>>> {
        if leases.is_empty() {
            return Ok(vec![]);
        }
        let c = self.conn().await?;
        // One statement for every lease of the node; the ones it did not extend were taken over.
        let col = |f: fn(&LeaseRenewal) -> &str| leases.iter().map(f).collect::<Vec<&str>>();
        let (tenants, names, holders) = (
            col(|l| &l.tenant),
            col(|l| &l.workspace),
            col(|l| &l.lease.node),
        );
        let epochs: Vec<i64> = leases.iter().map(|l| l.lease.epoch as i64).collect();
        let rows = c
            .query(
                &format!(
                    "UPDATE leases l SET expires_ms = ({SERVER_NOW}) + $5 \
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS r(tenant, workspace, holder, epoch) \
                     WHERE l.tenant = r.tenant AND l.workspace = r.workspace AND l.holder = r.holder AND l.epoch = r.epoch \
                     RETURNING l.tenant, l.workspace, l.epoch"
                ),
                &[&tenants, &names, &holders, &epochs, &(ttl_ms as i64)],
            )
            .await
            .map_err(be)?;
        let renewed: std::collections::HashSet<(String, String, u64)> =
            rows.iter().map(|r| (r.get(0), r.get(1), u(r, 2))).collect();
        let mut out = Vec::with_capacity(leases.len());
        for l in leases {
            if renewed.contains(&(l.tenant.clone(), l.workspace.clone(), l.lease.epoch)) {
                out.push(Ok(()));
            } else {
                let cur = lease_of(&c, &l.tenant, &l.workspace).await?;
                out.push(Err(CatalogError::Fenced {
                    held: l.lease.epoch,
                    current: cur.epoch,
                    holder: cur.holder,
                }));
            }
        }
        Ok(out)
    }

    async fn release_lease(&self, tenant: &str, workspace: &str, lease: &LeaseGrant) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            "UPDATE leases SET holder = NULL, expires_ms = 0 WHERE tenant = $1 AND workspace = $2 AND holder = $3 AND epoch = $4",
            &[&tenant, &workspace, &lease.node, &(lease.epoch as i64)],
        )
        .await
        .map_err(be)?;
        Ok(())
    }

    async fn get_lease(&self, tenant: &str, workspace: &str) -> Result<Lease> {
        let c = self.conn().await?;
        lease_of(&c, tenant, workspace).await
    }

    async fn report_node(&self, status: &NodeStatus) -> Result<()> {
        let c = self.conn().await?;
        let attached = serde_json::to_string(&status.attached)
            .map_err(|e| CatalogError::from_source("encoding a node row", false, e))?;
        c.execute(
            &format!(
                "INSERT INTO nodes (id, url, seen_ms, attached) VALUES ($1, $2, ({SERVER_NOW}), $3)
                 ON CONFLICT (id) DO UPDATE SET url = $2, seen_ms = ({SERVER_NOW}), attached = $3"
            ),
            &[&status.node, &status.url, &attached],
        )
        .await
        .map_err(be)?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeStatus>> {
        let c = self.conn().await?;
        let now = server_now(&c).await?;
        c.query(
            "SELECT id, url, seen_ms, attached FROM nodes ORDER BY id",
            &[],
        )
        .await
        .map_err(be)?
        .iter()
        .map(|r| {
            let seen = u(r, 2);
            Ok(NodeStatus {
                node: r.get(0),
                url: r.get(1),
                seen_ms: seen,
                seen_ago_ms: now.saturating_sub(seen),
                attached: serde_json::from_str(r.get(3))
                    .map_err(|e| CatalogError::from_source("corrupt node row", false, e))?,
            })
        })
        .collect()
    }

    async fn create_stream(&self, st: &RelayStream) -> Result<()> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        live_tenant(&tx, &st.tenant, " FOR SHARE").await?;
        tx.execute(
            "INSERT INTO relay_streams (tenant, name, sync, created_ms) VALUES ($1, $2, $3, $4)",
            &[&st.tenant, &st.name, &st.sync, &(st.created_ms as i64)],
        )
        .await
        .map_err(exists_or_backend("relay stream", &st.name))?;
        tx.commit().await.map_err(be)
    }

    async fn get_stream(&self, tenant: &str, name: &str) -> Result<RelayStream> {
        let c = self.conn().await?;
        c.query_opt(
            "SELECT tenant, name, sync, created_ms FROM relay_streams WHERE tenant = $1 AND name = $2",
            &[&tenant, &name],
        )
        .await
        .map_err(be)?
        .map(|r| stream_row(&r))
        .ok_or(CatalogError::NotFound {
            what: "relay stream",
            name: name.into(),
        })
    }

    async fn list_streams(&self, tenant: &str) -> Result<Vec<RelayStream>> {
        let c = self.conn().await?;
        Ok(c
            .query(
                "SELECT tenant, name, sync, created_ms FROM relay_streams WHERE tenant = $1 ORDER BY name",
                &[&tenant],
            )
            .await
            .map_err(be)?
            .iter()
            .map(stream_row)
            .collect())
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
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        let ws = get_ws(&tx, tenant, workspace, true).await?;
        let vs: Vec<i64> = versions
            .iter()
            .filter(|&&v| v != ws.head_version)
            .map(|&v| v as i64)
            .collect();
        let k = tx
            .execute(
                &format!(
                    "UPDATE checkpoints SET expired_ms = ({SERVER_NOW}) WHERE tenant = $1 AND workspace = $2 AND version = ANY($3) AND expired_ms IS NULL"
                ),
                &[&tenant, &workspace, &vs],
            )
            .await
            .map_err(be)?;
        tx.commit().await.map_err(be)?;
        Ok(k)
    }

    async fn gc_references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>> {
        self.references(tenant, grace_ms).await
    }

    async fn gc_mark(&self, tenant: &str, grace_ms: u64) -> Result<GcMark> {
        self.full_mark(tenant, grace_ms).await
    }

    async fn gc_changes(
        &self,
        tenant: &str,
        grace_ms: u64,
        after_seq: i64,
        limit: usize,
    ) -> Result<GcChanges> {
        self.changes(tenant, grace_ms, after_seq, limit).await
    }

    async fn gc_settle(&self, tenant: &str, seqs: &[i64]) -> Result<()> {
        self.settle(tenant, seqs).await
    }

    async fn gc_live(&self, tenant: &str, manifests: &[Hash], objects: &[Hash]) -> Result<GcLive> {
        self.live(tenant, manifests, objects).await
    }

    async fn retention_due(
        &self,
        tenant: &str,
        now_ms: u64,
        all: bool,
    ) -> Result<Vec<RetentionDue>> {
        self.due_for_retention(tenant, now_ms, all).await
    }

    async fn retention_done(
        &self,
        tenant: &str,
        workspace: &str,
        seen: u64,
        next_ms: u64,
    ) -> Result<bool> {
        self.retention_seen(tenant, workspace, seen, next_ms).await
    }

    async fn compaction_candidates(
        &self,
        tenant: &str,
        idle_before_ms: u64,
        all: bool,
    ) -> Result<Vec<(String, Hash)>> {
        self.candidates(tenant, idle_before_ms, all).await
    }

    async fn compaction_judged(&self, tenant: &str, workspace: &str, manifest: Hash) -> Result<()> {
        self.judged(tenant, workspace, manifest).await
    }

    async fn purge_expired_checkpoints(&self, tenant: &str, grace_ms: u64) -> Result<u64> {
        let c = self.conn().await?;
        c.execute(
            &format!(
                "DELETE FROM checkpoints WHERE tenant = $1 AND expired_ms IS NOT NULL AND expired_ms < ({SERVER_NOW}) - $2"
            ),
            &[&tenant, &(grace_ms as i64)],
        )
        .await
        .map_err(be)
    }

    async fn gc_condemn(&self, tenant: &str, keys: &[String]) -> Result<()> {
        self.condemn(tenant, keys).await
    }

    async fn gc_condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>> {
        self.condemned(tenant).await
    }

    async fn prune_references(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64> {
        self.prune(tenant, manifests, objects).await
    }

    async fn recorded_references(&self, tenant: &str) -> Result<(u64, u64)> {
        self.recorded(tenant).await
    }

    async fn gc_forget(&self, tenant: &str, keys: &[String]) -> Result<()> {
        self.forget(tenant, keys).await
    }
}
