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
use std::sync::Mutex;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_catalog::{NewToken, TokenInfo};

use crate::api::TenantToken;
use crate::auth::{optional_body, Admin, Path, Tenant};
use crate::error::ApiError;
use crate::routes::{D, R};
use crate::tenants::check_tenant_name;
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
    Ok(crate::api::issued(info, token))
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
