//! Tenants as the admin manages them: the list with counts, quotas, usage on active data and
//! its metering, and deletion with everything a tenant owns, under the tenant's gate (which
//! every request of the tenant holds shared, `auth.rs` `Caller`).

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use strata_catalog::TenantInfo;

use crate::auth::{Admin, Path, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::routes::{D, R};
use crate::Daemon;

pub(crate) fn check_tenant_name(name: &str) -> Result<(), ApiError> {
    strata_format::name::validate("tenant name", name).map_err(|e| ApiError::invalid(e.to_string()))
}

/// A tenant with counts, for the admin's list.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantView {
    #[serde(flatten)]
    pub tenant: TenantInfo,
    pub workspaces: u64,
    pub tokens: u64,
}

/// What deleting a tenant removed.
#[derive(Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantDeleted {
    pub tenant: String,
    pub workspaces: u64,
    pub templates: u64,
    pub streams: u64,
    pub store_keys: u64,
    pub store_bytes: u64,
}

#[utoipa::path(
    get,
    path = "/v1/tenants",
    summary = "Every tenant, with its workspace and token counts (admin token)",
    responses((status = 200, description = "Tenants", body = Vec<TenantView>)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn list_tenants(_: Admin, State(d): D) -> R<Vec<TenantView>> {
    let cat = d.engine.catalog();
    let mut out = vec![];
    for t in cat.list_tenants().await? {
        let tenant = match cat.get_tenant(&t).await {
            Ok(i) => i,
            Err(strata_catalog::CatalogError::NotFound { .. }) => continue, // just purged
            Err(e) => return Err(e.into()),
        };
        out.push(TenantView {
            workspaces: cat.list_workspaces(&t).await?.len() as u64,
            tokens: cat.list_tokens(&t).await?.len() as u64,
            tenant,
        });
    }
    Ok(Json(out))
}

#[utoipa::path(
    delete,
    path = "/v1/tenants/{name}",
    summary = "Delete a tenant and everything it owns: workspaces, checkpoints, templates, relay files, tokens, its objects in the store and on this node (refused while a workspace is attached; admin token; a failed delete is finished by calling again)",
    params(("name" = String, Path, description = "Tenant name")),
    responses((status = 200, description = "What was removed", body = TenantDeleted)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn delete_tenant(
    _: Admin,
    State(d): D,
    Path(name): Path<String>,
) -> R<TenantDeleted> {
    check_tenant_name(&name)?;
    Ok(Json(d.delete_tenant(&name).await?))
}

/// A tenant's usage on what the catalog and this node know, with its quotas.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub tenant: String,
    pub workspaces: u64,
    /// The sum of its workspaces' disk sizes (what `disk_bytes` limits).
    pub disk_bytes: u64,
    /// Its workspaces attached on this node.
    pub attached_here: u64,
    /// Journal bytes its attached workspaces hold on this node's disk.
    pub local_journal_bytes: u64,
    /// Relay files on this node's disk not yet in the object store.
    pub relay_pending_bytes: u64,
    /// Its live data in the object store, from the catalog's reference graph.
    pub store: strata_catalog::StoreUsage,
    /// Live bytes over time (byte-seconds), metered at this reading and every
    /// [`crate::METER_EVERY`] by each node.
    pub meter: strata_catalog::Meter,
    pub quotas: strata_catalog::Quotas,
}

#[utoipa::path(
    put,
    path = "/v1/tenants/{name}/quotas",
    summary = "Set a tenant's quotas, replacing them (absent: no limit; admin token). This node applies a journal quota at once, other nodes at their next attach of the tenant's workspaces",
    params(("name" = String, Path, description = "Tenant name")),
    request_body = strata_catalog::Quotas,
    responses((status = 200, description = "The tenant with its quotas", body = TenantInfo)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn set_quotas(
    _: Admin,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<strata_catalog::Quotas>, JsonRejection>,
) -> R<TenantInfo> {
    check_tenant_name(&name)?;
    let q = crate::auth::body(b)?;
    let cat = d.engine.catalog();
    cat.set_quotas(&name, &q).await?;
    d.engine
        .set_local_journal_quota(&name, q.local_journal_bytes);
    Ok(Json(cat.get_tenant(&name).await?))
}

#[utoipa::path(
    get,
    path = "/v1/usage",
    summary = "This tenant's usage (workspaces, disk bytes, what it holds on this node) and quotas",
    responses((status = 200, description = "Usage", body = Usage)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn usage(Tenant(t, _caller): Tenant, State(d): D) -> R<Usage> {
    Ok(Json(d.usage(&t).await?))
}

impl Daemon {
    /// Meters every tenant's live bytes (see [`strata_catalog::Meter`]).
    pub(crate) async fn meter_all(&self) {
        let cat = self.engine.catalog();
        let Ok(tenants) = cat.list_tenants().await else {
            return;
        };
        for t in tenants {
            let metered = async {
                let live = cat.store_usage(&t).await?.live_bytes;
                cat.meter_usage(&t, live).await
            };
            match metered.await {
                Ok(_) | Err(strata_catalog::CatalogError::NotFound { .. }) => {}
                Err(strata_catalog::CatalogError::InUse(_)) => {} // being deleted
                Err(e) => tracing::warn!(tenant = %t, error = %e, "metering usage failed"),
            }
        }
    }

    /// Drops this node's relay files of tenants that no longer exist or are being deleted
    /// (a deletion on another node cannot reach this node's disk).
    /// With `all`, every tenant with files on this disk, uploaded ones too (a node may hold
    /// an uploaded file of a tenant deleted through another node, which a new tenant of the
    /// same name must never be served); else only those with files still to upload.
    pub(crate) async fn forget_deleted_relay_tenants(&self, all: bool) {
        let mut tenants: std::collections::BTreeSet<String> =
            self.relay.lag().into_keys().map(|(t, _)| t).collect();
        if all {
            tenants.extend(self.relay.local_tenants());
        }
        for t in tenants {
            let gone = match self.engine.catalog().get_tenant(&t).await {
                Ok(i) if i.deleting_ms.is_none() => {
                    // Files of an earlier tenant of the name are dropped here.
                    if let Err(e) = self.relay.bind_tenant(&t, i.created_ms).await {
                        tracing::warn!(tenant = %t, error = %e, "binding relay files to their tenant failed");
                    }
                    false
                }
                Ok(_) => true,
                Err(strata_catalog::CatalogError::NotFound { .. }) => true,
                Err(_) => false, // unknown now: asked again at the next pass
            };
            if gone {
                match self.relay.forget_tenant(&t).await {
                    Ok(()) => {
                        tracing::info!(tenant = %t, "relay files of a deleted tenant dropped")
                    }
                    Err(e) => {
                        tracing::warn!(tenant = %t, error = %e, "dropping a deleted tenant's relay files failed")
                    }
                }
            }
        }
    }

    pub(crate) async fn usage(&self, t: &str) -> Result<Usage, ApiError> {
        let cat = self.engine.catalog();
        let quotas = cat.get_tenant(t).await?.quotas;
        let ws = cat.list_workspaces(t).await?;
        let store = cat.store_usage(t).await?;
        let meter = cat.meter_usage(t, store.live_bytes).await?;
        Ok(Usage {
            tenant: t.into(),
            workspaces: ws.len() as u64,
            disk_bytes: ws.iter().map(|w| w.disk_size).sum(),
            attached_here: self.attached_here(t),
            local_journal_bytes: self.engine.local_journal_usage(t).0,
            relay_pending_bytes: self
                .relay
                .lag()
                .iter()
                .filter(|((tenant, _), _)| tenant == t)
                .map(|(_, l)| l.pending_bytes)
                .sum(),
            store,
            meter,
            quotas,
        })
    }

    fn attached_here(&self, t: &str) -> u64 {
        self.engine
            .attached()
            .iter()
            .filter(|v| v.tenant() == t)
            .count() as u64
    }

    /// Refuses a new attachment of `ws` past the tenant's `attached_per_node` quota. With a
    /// quota, the returned guard (the tenant's own op lock) is held through the attach, so
    /// attaches racing for the last place are counted one at a time.
    pub(crate) async fn attach_quota(
        &self,
        t: &str,
        ws: &str,
    ) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, ApiError> {
        if self.engine.volume(t, ws).is_some() {
            return Ok(None);
        }
        let q = match self.engine.catalog().get_tenant(t).await {
            Ok(i) => i.quotas,
            Err(strata_catalog::CatalogError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        // Without a quota of its own, the node's default share, checked without serialising
        // the tenant's attaches (concurrent ones may pass it by as many as race: a bound on a
        // tenant that floods, not an exact quota; set `attached_per_node` for one).
        let Some(max) = q.attached_per_node else {
            let (n, max) = (self.attached_here(t), self.shares.limits().attached);
            if n >= max {
                let mut e = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "busy",
                    format!("tenant {t:?} has {n} workspaces attached on this node, its share; detach some first"),
                );
                e.retryable = true;
                return Err(e);
            }
            return Ok(None);
        };
        // Workspace names are never empty: this key is the tenant's own.
        let guard = self
            .op_lock(&(t.to_string(), String::new()))
            .lock_owned()
            .await;
        let n = self.attached_here(t);
        if n >= max {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "quota",
                format!("quota exceeded: tenant {t:?} may have {max} workspaces attached on a node; {n} are attached here"),
            ));
        }
        Ok(Some(guard))
    }

    /// Reads the tenant's placement again where it starts writing on this node: a tenant
    /// deleted and created again (perhaps through another node) may be placed elsewhere or
    /// keyed otherwise, and this node must not go on with the old one's.
    pub(crate) async fn refresh_placement(&self, t: &str) -> Result<(), ApiError> {
        self.engine.reader().store().refresh(t).await.map_err(|e| {
            let mut a = ApiError::new(
                if e.is_retryable() {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                },
                "placement",
                e.to_string(),
            );
            a.retryable = e.is_retryable();
            a
        })
    }

    /// Forgets the placement (and data key) of every tenant this node holds that is deleted
    /// or being deleted: run every minute.
    pub(crate) async fn sweep_placements(&self) {
        let store = self.engine.reader().store();
        for t in store.bound_tenants() {
            let gone = match self.engine.catalog().get_tenant(&t).await {
                Ok(i) => i.deleting_ms.is_some(),
                Err(strata_catalog::CatalogError::NotFound { .. }) => true,
                Err(_) => false,
            };
            if gone {
                store.unbind(&t);
            }
        }
    }

    /// Refuses an operation that adds to the tenant's data in the store while its live bytes
    /// are past its `live_bytes` quota (counted from the catalog now, as usage does).
    pub(crate) async fn live_quota(&self, t: &str, what: &str) -> Result<(), ApiError> {
        let cat = self.engine.catalog();
        let Some(max) = cat.get_tenant(t).await?.quotas.live_bytes else {
            return Ok(());
        };
        let live = cat.store_usage(t).await?.live_bytes;
        if live >= max {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "quota",
                format!("quota exceeded: tenant {t:?} may keep {max} live bytes in the store and keeps {live}; {what} refused (expire checkpoints or delete workspaces or templates)"),
            ));
        }
        Ok(())
    }

    /// The tenant's relay bytes waiting for upload on this node.
    pub(crate) fn relay_waiting(&self, t: &str) -> u64 {
        self.relay.pending_bytes(t)
    }

    /// Refuses a relay file of `incoming` declared bytes past the tenant's `relay_bytes` quota
    /// on this node; else the quota and the room left under it (`None`: no quota), which the
    /// body's bytes as received are held to.
    pub(crate) async fn relay_quota(
        &self,
        t: &str,
        incoming: u64,
    ) -> Result<Option<(u64, u64)>, ApiError> {
        let Some(max) = self
            .engine
            .catalog()
            .get_tenant(t)
            .await?
            .quotas
            .relay_bytes
        else {
            return Ok(None);
        };
        let pending = self.relay_waiting(t);
        if pending.saturating_add(incoming) > max {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "quota",
                format!("quota exceeded: tenant {t:?} may have {max} relay bytes waiting for upload on a node; {pending} are waiting here and this file is {incoming}"),
            ));
        }
        Ok(Some((max, max - pending)))
    }

    /// Refuses growing `ws` to `size` past the tenant's `disk_bytes` quota.
    pub(crate) async fn resize_quota(&self, t: &str, ws: &str, size: u64) -> Result<(), ApiError> {
        let cat = self.engine.catalog();
        let Some(max) = cat.get_tenant(t).await?.quotas.disk_bytes else {
            return Ok(());
        };
        let total: u64 = cat
            .list_workspaces(t)
            .await?
            .iter()
            .map(|w| {
                if w.name == ws {
                    size.max(w.disk_size)
                } else {
                    w.disk_size
                }
            })
            .sum();
        if total > max {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "quota",
                format!("quota exceeded: tenant {t:?} may have {max} bytes of workspace disks in all; this would make {total}"),
            ));
        }
        Ok(())
    }
}

/// Store keys deleted per listing (the listing starts over after each batch).
const PURGE_BATCH: usize = 1000;

impl Daemon {
    /// Deletes a tenant (see [`delete_tenant`]). Runs in a task of its own: a client that
    /// leaves does not stop it half-way, and if it fails (or the node dies) the tenant stays
    /// marked, its tokens dead, and calling again finishes it.
    pub(crate) async fn delete_tenant(
        self: &Arc<Self>,
        tenant: &str,
    ) -> Result<TenantDeleted, ApiError> {
        let (d, t) = (self.clone(), tenant.to_string());
        own_task(async move {
            let cat = d.engine.catalog().clone();
            // Atomically: no workspace attached anywhere, and from now on none can be, and
            // the tenant's tokens speak for nobody.
            cat.begin_tenant_delete(&t).await?;
            // The tenant's requests admitted before the mark finish first; none runs beside
            // the deletion (their tokens no longer pass, the gate refuses the rest).
            let gate = d.tenant_gate(&t);
            *gate.write().await += 1;
            let out = d.delete_marked_tenant(&t).await;
            *gate.write().await -= 1;
            out
        })
        .await
    }

    async fn delete_marked_tenant(self: &Arc<Self>, t: &str) -> Result<TenantDeleted, ApiError> {
        let (d, t) = (self, t.to_string());
        {
            let cat = d.engine.catalog().clone();
            // No GC pass of this node works on the tenant meanwhile.
            let _gc = d.gc.lock.lock().await;
            let mut out = TenantDeleted {
                tenant: t.clone(),
                ..TenantDeleted::default()
            };
            // A create admitted just before the mark may still land: list until empty.
            for _ in 0..5 {
                let ws = cat.list_workspaces(&t).await?;
                if ws.is_empty() {
                    break;
                }
                for w in ws {
                    match d.delete_workspace(&t, &w.name).await {
                        // Another deletion of the tenant (or of the workspace) got it first.
                        Err(e) if e.status == StatusCode::NOT_FOUND => {}
                        r => r?,
                    }
                    out.workspaces += 1;
                }
            }
            for tpl in cat.list_templates(&t).await? {
                match cat.delete_template(&t, &tpl.name).await {
                    Err(strata_catalog::CatalogError::NotFound { .. }) => {}
                    r => r?,
                }
                out.templates += 1;
            }
            out.streams = cat.list_streams(&t).await?.len() as u64;
            let local = |what: &'static str| {
                move |e: std::io::Error| ApiError::internal(format!("{what}: {e}"))
            };
            d.relay
                .forget_tenant(&t)
                .await
                .map_err(local("removing the tenant's relay files"))?;
            d.shares.forget_tenant(&t);
            d.engine.forget_tenant_budget(&t);
            // Its frame tables, verified units and cached objects: nothing of it stays in
            // this node's memory or cache.
            d.engine
                .reader()
                .forget_tenant(&t)
                .map_err(local("removing the tenant's cached objects"))?;
            let store = d
                .engine
                .reader()
                .store()
                .inner_for(&t)
                .await
                .map_err(|e| ApiError::internal(format!("the tenant's store: {e}")))?;
            // Crypto-shredding: the data key goes before the objects, so an interrupted
            // deletion leaves only ciphertext nobody can open. (The store above was found
            // before: listing and deleting need no key.)
            cat.shred_data_key(&t).await?;
            d.engine.reader().store().unbind(&t);
            let prefix = strata_store::keys::tenant(&t);
            loop {
                let batch: Vec<_> = store
                    .list(Some(&prefix))
                    .take(PURGE_BATCH)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .collect::<Result<_, _>>()
                    .map_err(|e| {
                        ApiError::internal(format!("listing the tenant's objects: {e}"))
                    })?;
                if batch.is_empty() {
                    break;
                }
                for m in batch {
                    match store.delete(&m.location).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => {
                            return Err(ApiError::internal(format!("deleting {}: {e}", m.location)))
                        }
                    }
                    out.store_keys += 1;
                    out.store_bytes += m.size;
                }
            }
            cat.purge_tenant(&t).await?;
            // A new tenant of this name may be placed elsewhere.
            d.engine.reader().store().unbind(&t);
            tracing::info!(tenant = %t, workspaces = out.workspaces, store_keys = out.store_keys, "tenant deleted");
            Ok(out)
        }
    }
}
