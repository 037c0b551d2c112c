//! Tokens and tenants as things an operator manages: what a token may do (its scope), when it
//! stops working (expiry, revocation), the admin tokens (rotated through a file without a
//! restart), and the tenant lifecycle (list, delete with everything it owns).
//!
//! Scopes, checked against the matched route before any handler runs:
//!
//! | scope          | may                                                               |
//! |----------------|-------------------------------------------------------------------|
//! | (none)         | everything of its tenant, including managing its tokens           |
//! | `read`         | `GET` of workspaces, templates, mounts, relay files and usage     |
//! | `attach`       | attach and detach a workspace, and read workspaces                |
//! | `relay`        | every relay route (streams, stream tokens, files)                 |
//! | `relay:STREAM` | add files to that one stream (`PUT`)                              |

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::Json;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use strata_catalog::{NewToken, TenantInfo, TokenInfo};

use crate::api::TenantToken;
use crate::auth::{optional_body, Admin, Path, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::routes::{D, R};
use crate::{new_token, token_hash, Daemon};

/// What a token may do; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    Full,
    Read,
    Attach,
    Relay,
    Stream(String),
    /// Written by a newer version: allows nothing here.
    Unknown(String),
}

impl Scope {
    pub(crate) fn of(s: Option<&str>) -> Scope {
        match s {
            None => Scope::Full,
            Some("read") => Scope::Read,
            Some("attach") => Scope::Attach,
            Some("relay") => Scope::Relay,
            Some(s) => match s.strip_prefix("relay:") {
                Some(stream) => Scope::Stream(stream.into()),
                None => Scope::Unknown(s.into()),
            },
        }
    }

    fn name(&self) -> &str {
        match self {
            Scope::Full => "full",
            Scope::Read => "read",
            Scope::Attach => "attach",
            Scope::Relay => "relay",
            Scope::Stream(_) => "stream",
            Scope::Unknown(s) => s,
        }
    }

    /// Whether a token of this scope may call `method` on the tenant route `route` (a route
    /// template such as `/v1/workspaces/{name}`).
    pub(crate) fn allows(&self, method: &Method, route: &str) -> bool {
        let get = method == Method::GET || method == Method::HEAD;
        match self {
            Scope::Full => true,
            Scope::Read => {
                get && [
                    "/v1/workspaces",
                    "/v1/templates",
                    "/v1/mounts",
                    "/v1/relay",
                    "/v1/usage",
                ]
                .iter()
                .any(|p| route.starts_with(p))
            }
            Scope::Attach => {
                (get && matches!(route, "/v1/workspaces" | "/v1/workspaces/{name}"))
                    || (method == Method::POST
                        && matches!(
                            route,
                            "/v1/workspaces/{name}/attach" | "/v1/workspaces/{name}/detach"
                        ))
            }
            Scope::Relay => route.starts_with("/v1/relay"),
            // The relay's own extractor lets a stream token PUT to its stream.
            Scope::Stream(_) | Scope::Unknown(_) => false,
        }
    }

    pub(crate) fn refusal(&self, method: &Method, route: &str) -> ApiError {
        ApiError::forbidden(format!(
            "a token of scope {:?} may not {method} {route}",
            self.name()
        ))
    }
}

/// A token that is known, not revoked and not expired; or the refusal that says which.
pub(crate) async fn live_token(d: &Daemon, token: &str) -> Result<TokenInfo, ApiError> {
    let h = token_hash(token);
    match d.engine.catalog().token_info(&h).await? {
        Some(i) if i.revoked_ms.is_some() => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            format!("token {} was revoked", i.id),
        )),
        Some(i) if i.expires_ms.is_some_and(|e| e <= strata_format::now_ms()) => {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                format!("token {} has expired", i.id),
            ))
        }
        Some(i) => Ok(i),
        None if d.admin.contains(&h) => Err(ApiError::forbidden(
            "the admin token manages tenants; use a tenant's token for its data",
        )),
        None => Err(ApiError::unauthorized()),
    }
}

/// The admin tokens: the configured one and those listed in the admin token file, which is
/// read again whenever it changes, so a new token can be added, clients moved over and the
/// old one removed without a restart. A line is a token or `blake3:HEX` (its hash); blank
/// lines and `#` comments are skipped.
pub(crate) struct AdminTokens {
    fixed: Option<String>,
    file: Option<PathBuf>,
    cached: Mutex<FileTokens>,
}

#[derive(Default)]
struct FileTokens {
    /// (modified, length, inode) of the file last read.
    stamp: Option<(std::time::SystemTime, u64, u64)>,
    hashes: Vec<String>,
}

impl AdminTokens {
    /// Fails if the file is given but cannot be read or holds a malformed hash.
    pub(crate) fn new(fixed: Option<&str>, file: Option<PathBuf>) -> std::io::Result<AdminTokens> {
        let a = AdminTokens {
            fixed: fixed.filter(|t| !t.is_empty()).map(token_hash),
            file,
            cached: Mutex::default(),
        };
        if let Some(f) = &a.file {
            let mut c = a.lock();
            c.stamp = Some(stamp(f)?);
            c.hashes = read_tokens(f)?;
        }
        Ok(a)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FileTokens> {
        self.cached.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn configured(&self) -> bool {
        self.fixed.is_some() || self.file.is_some()
    }

    /// Whether `hash` is an admin token's hash now.
    pub(crate) fn contains(&self, hash: &str) -> bool {
        if self.fixed.as_deref() == Some(hash) {
            return true;
        }
        let Some(f) = &self.file else { return false };
        let mut c = self.lock();
        match stamp(f) {
            Ok(s) if c.stamp != Some(s) => {
                c.stamp = Some(s);
                match read_tokens(f) {
                    Ok(h) => {
                        tracing::info!(tokens = h.len(), "admin token file reloaded");
                        c.hashes = h;
                    }
                    // A malformed file (say a bad blake3 line) keeps the set read before, so
                    // a typo does not lock the admin out; it is said once per change.
                    Err(e) => {
                        tracing::warn!(error = %e, "admin token file not reloaded; keeping the tokens read before")
                    }
                }
            }
            Ok(_) => {}
            // No file: no tokens from it (removing the file revokes them). Replace it by
            // rename, never by rewriting in place.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if c.stamp.take().is_some() {
                    tracing::warn!("admin token file removed: its tokens no longer work");
                }
                c.hashes.clear();
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin token file unreadable; keeping the tokens read before")
            }
        }
        c.hashes.iter().any(|h| h == hash)
    }
}

fn stamp(f: &std::path::Path) -> std::io::Result<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(f)?;
    Ok((m.modified()?, m.len(), m.ino()))
}

fn read_tokens(f: &std::path::Path) -> std::io::Result<Vec<String>> {
    let text = std::fs::read_to_string(f)?;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_prefix("blake3:") {
            Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
                out.push(hex.to_ascii_lowercase())
            }
            Some(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{}: line {}: blake3: needs 64 hex digits",
                        f.display(),
                        i + 1
                    ),
                ))
            }
            None => out.push(token_hash(line)),
        }
    }
    Ok(out)
}

/// `POST /v1/tokens`, `POST /v1/tenants/{name}/tokens`.
#[derive(Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    /// `read`, `attach`, `relay` or `relay:STREAM`; absent: the tenant's full rights.
    pub scope: Option<String>,
    /// The token stops working this many seconds from now (at most ten years).
    pub ttl_seconds: Option<u64>,
    /// A note for listings (up to 100 printable characters).
    pub label: Option<String>,
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

const MAX_TTL_SECONDS: u64 = 10 * 366 * 24 * 3600;

/// Checks a token request and records the token; the token itself is returned once. A
/// token minted by an expiring token expires no later (`cap`).
async fn issue(
    d: &Daemon,
    tenant: &str,
    b: CreateToken,
    cap: Option<u64>,
) -> Result<TenantToken, ApiError> {
    let scope = match b.scope.as_deref() {
        None | Some("full") => None,
        Some(s @ ("read" | "attach" | "relay")) => Some(s.to_string()),
        Some(s) => match s.strip_prefix("relay:") {
            Some(stream) => {
                strata_format::name::validate("stream name", stream)
                    .map_err(|e| ApiError::invalid(e.to_string()))?;
                d.engine.catalog().get_stream(tenant, stream).await?;
                Some(s.to_string())
            }
            None => {
                return Err(ApiError::invalid(
                    "scope is one of read, attach, relay, relay:STREAM (absent: full)",
                ))
            }
        },
    };
    let expires_ms = match b.ttl_seconds {
        None => None,
        Some(0) => return Err(ApiError::invalid("ttl_seconds must be at least 1")),
        Some(s) if s > MAX_TTL_SECONDS => {
            return Err(ApiError::invalid("ttl_seconds is at most ten years"))
        }
        Some(s) => Some(strata_format::now_ms() + s * 1000),
    };
    let expires_ms = match (expires_ms, cap) {
        (Some(e), Some(c)) => Some(e.min(c)),
        (e, c) => e.or(c),
    };
    if let Some(l) = &b.label {
        if l.chars().count() > 100 || l.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "label: up to 100 characters, no control characters",
            ));
        }
    }
    let token = new_token();
    let info = d
        .engine
        .catalog()
        .add_token(&NewToken {
            tenant: tenant.into(),
            hash: token_hash(&token),
            scope,
            expires_ms,
            label: b.label,
        })
        .await?;
    Ok(TenantToken::issued(info, token))
}

fn check_tenant_name(name: &str) -> Result<(), ApiError> {
    strata_format::name::validate("tenant name", name).map_err(|e| ApiError::invalid(e.to_string()))
}

fn check_token_id(id: &str) -> Result<(), ApiError> {
    if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(ApiError::invalid("a token id is 16 hex digits"))
    }
}

#[utoipa::path(
    get,
    path = "/v1/tokens",
    summary = "This tenant's tokens: ids and metadata, never the tokens (a full token)",
    responses((status = 200, description = "Tokens, oldest first", body = Vec<TokenInfo>)),
    tag = "tokens",
    security(("bearer" = [])),
)]
pub(crate) async fn list_own(Tenant(t, _caller): Tenant, State(d): D) -> R<Vec<TokenInfo>> {
    Ok(Json(d.engine.catalog().list_tokens(&t).await?))
}

#[utoipa::path(
    post,
    path = "/v1/tokens",
    summary = "Issue a token for this tenant, optionally scoped and expiring (a full token; shown once)",
    request_body = Option<CreateToken>,
    responses((status = 201, description = "The new token", body = TenantToken)),
    tag = "tokens",
    security(("bearer" = [])),
)]
pub(crate) async fn create_own(
    Tenant(t, caller): Tenant,
    State(d): D,
    b: Result<Json<CreateToken>, JsonRejection>,
) -> Result<(StatusCode, Json<TenantToken>), ApiError> {
    let b = optional_body(b)?;
    Ok((
        StatusCode::CREATED,
        Json(issue(&d, &t, b, caller.expires_ms).await?),
    ))
}

#[utoipa::path(
    delete,
    path = "/v1/tokens/{id}",
    summary = "Revoke one of this tenant's tokens (a full token; idempotent)",
    params(("id" = String, Path, description = "Token id (16 hex digits)")),
    responses((status = 200, description = "The revoked token", body = TokenInfo)),
    tag = "tokens",
    security(("bearer" = [])),
)]
pub(crate) async fn revoke_own(
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(id): Path<String>,
) -> R<TokenInfo> {
    check_token_id(&id)?;
    Ok(Json(d.engine.catalog().revoke_token(&t, &id).await?))
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

#[utoipa::path(
    get,
    path = "/v1/tenants/{name}/tokens",
    summary = "A tenant's tokens: ids and metadata, never the tokens (admin token)",
    params(("name" = String, Path, description = "Tenant name")),
    responses((status = 200, description = "Tokens, oldest first", body = Vec<TokenInfo>)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn list_tenant_tokens(
    _: Admin,
    State(d): D,
    Path(name): Path<String>,
) -> R<Vec<TokenInfo>> {
    check_tenant_name(&name)?;
    Ok(Json(d.engine.catalog().list_tokens(&name).await?))
}

#[utoipa::path(
    post,
    path = "/v1/tenants/{name}/tokens",
    summary = "Issue a token for a tenant, optionally scoped and expiring (admin token; shown once)",
    params(("name" = String, Path, description = "Tenant name")),
    request_body = Option<CreateToken>,
    responses((status = 201, description = "A new token", body = TenantToken)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn create_tenant_token(
    _: Admin,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<CreateToken>, JsonRejection>,
) -> Result<(StatusCode, Json<TenantToken>), ApiError> {
    check_tenant_name(&name)?;
    let b = optional_body(b)?;
    Ok((StatusCode::CREATED, Json(issue(&d, &name, b, None).await?)))
}

#[utoipa::path(
    delete,
    path = "/v1/tenants/{name}/tokens/{id}",
    summary = "Revoke a tenant's token (admin token; idempotent)",
    params(
        ("name" = String, Path, description = "Tenant name"),
        ("id" = String, Path, description = "Token id (16 hex digits)"),
    ),
    responses((status = 200, description = "The revoked token", body = TokenInfo)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn revoke_tenant_token(
    _: Admin,
    State(d): D,
    Path((name, id)): Path<(String, String)>,
) -> R<TokenInfo> {
    check_tenant_name(&name)?;
    check_token_id(&id)?;
    Ok(Json(d.engine.catalog().revoke_token(&name, &id).await?))
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
    pub(crate) async fn forget_deleted_relay_tenants(&self) {
        let tenants: std::collections::BTreeSet<String> =
            self.relay.lag().into_keys().map(|(t, _)| t).collect();
        for t in tenants {
            let gone = match self.engine.catalog().get_tenant(&t).await {
                Ok(i) => i.deleting_ms.is_some(),
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
        let Some(max) = q.attached_per_node else {
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
            d.engine
                .reader()
                .cache()
                .forget_tenant(&t)
                .map_err(local("removing the tenant's cached objects"))?;
            let store = d.engine.reader().store().inner().clone();
            let prefix = object_store::path::Path::from(format!("t/{t}"));
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
            tracing::info!(tenant = %t, workspaces = out.workspaces, store_keys = out.store_keys, "tenant deleted");
            Ok(out)
        }
    }
}
