//! What a request carries before its handler runs: who the caller is (a tenant's token, the
//! admin token, the scrape token; every token is compared by its BLAKE3 hash) and its JSON
//! body, with refusals in the API's error body.
//!
//! The `strata` CLI without a daemon runs the same router in its own process and names its
//! caller with a [`LocalCaller`] request extension instead of a token. Extensions exist only
//! in memory: nothing a network client sends can set one.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequestParts, MatchedPath};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::Json;

use crate::error::ApiError;
use crate::tokens::{live_token, Scope};
use crate::{observe, token_hash, Daemon};

/// The caller's tenant, from `Authorization: Bearer TOKEN`, and what else is known of the
/// caller.
pub struct Tenant(pub String, pub Caller);

/// A tenant's caller for the length of its request.
pub struct Caller {
    /// When the caller's token stops working: tokens it mints expire no later.
    pub(crate) expires_ms: Option<u64>,
    /// Held while the request runs: a deletion of the tenant waits for it (see
    /// [`Daemon::tenant_gate`]).
    _gate: tokio::sync::OwnedRwLockReadGuard<u32>,
    /// One of the tenant's requests in the daemon (`shares.rs`): a tenant flooding the node
    /// with requests is refused past its share, others are not.
    _share: crate::shares::Share,
}

impl Caller {
    /// Enters the tenant's gate, or refuses a tenant being deleted on this node.
    pub(crate) async fn enter(
        d: &Daemon,
        tenant: &str,
        expires_ms: Option<u64>,
        changes: bool,
    ) -> Result<Caller, ApiError> {
        let share = d.shares.take(tenant, crate::shares::Kind::Requests, 1)?;
        // A request that changes something waits its tenant's turn (`shares.rs`, ops_rate).
        if changes {
            if let Some(wait) = d.shares.pace_op(tenant)? {
                tokio::time::sleep(wait).await;
            }
        }
        let gate = d.tenant_gate(tenant).read_owned().await;
        if *gate > 0 {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                format!("tenant {tenant:?} is being deleted"),
            ));
        }
        Ok(Caller {
            expires_ms,
            _gate: gate,
            _share: share,
        })
    }
}
/// The caller holds the admin token.
pub struct Admin;

/// The caller of a request made in this process (the CLI on its own data directory): acts
/// as `tenant` on tenant routes and as the admin on admin routes, as the owner of the data
/// directory may. Only code linked into the process can attach it to a request.
#[derive(Clone, Debug)]
pub struct LocalCaller {
    tenant: String,
}

impl LocalCaller {
    pub fn new(tenant: impl Into<String>) -> LocalCaller {
        LocalCaller {
            tenant: tenant.into(),
        }
    }
}

fn local(parts: &Parts) -> Option<&LocalCaller> {
    parts.extensions.get::<LocalCaller>()
}

pub(crate) fn bearer(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

impl FromRequestParts<Arc<Daemon>> for Tenant {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, d: &Arc<Daemon>) -> Result<Self, ApiError> {
        if let Some(l) = local(parts) {
            observe::record_tenant(&l.tenant);
            let caller = Caller::enter(d, &l.tenant, None, false).await?;
            return Ok(Tenant(l.tenant.clone(), caller));
        }
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let info = live_token(d, token).await?;
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map(|p| p.as_str())
            .unwrap_or("");
        let scope = Scope::of(info.scope.as_deref());
        if !scope.allows(&parts.method, route) {
            return Err(scope.refusal(&parts.method, route));
        }
        observe::record_tenant(&info.tenant);
        let changes = !matches!(
            parts.method,
            axum::http::Method::GET | axum::http::Method::HEAD
        );
        let caller = Caller::enter(d, &info.tenant, info.expires_ms, changes).await?;
        Ok(Tenant(info.tenant, caller))
    }
}

impl FromRequestParts<Arc<Daemon>> for Admin {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, d: &Arc<Daemon>) -> Result<Self, ApiError> {
        if local(parts).is_some() {
            return Ok(Admin);
        }
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let h = token_hash(token);
        if d.admin.contains(&h) {
            Ok(Admin)
        } else if let Err(e) = live_token(d, token).await {
            Err(e) // unknown, expired or revoked
        } else if d.admin.configured() {
            Err(ApiError::forbidden("this needs the admin token"))
        } else {
            Err(ApiError::forbidden(
                "no admin token is configured (STRATA_ADMIN_TOKEN or admin_token_file)",
            ))
        }
    }
}

/// A body that may be left out (no JSON content type): the request's defaults then.
pub(crate) fn optional_body<T: Default>(b: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    match b {
        Err(JsonRejection::MissingJsonContentType(_)) => Ok(T::default()),
        b => body(b),
    }
}

pub(crate) fn body<T>(b: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    match b {
        Ok(Json(v)) => Ok(v),
        Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::invalid(
            "send a JSON body with Content-Type: application/json",
        )),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "request body over 64 KiB",
        )),
        Err(e) => Err(ApiError::invalid(format!(
            "bad request body: {}",
            e.body_text()
        ))),
    }
}

/// The caller may read `/metrics`: the admin token or the configured scrape token.
pub struct Scraper;

impl FromRequestParts<Arc<Daemon>> for Scraper {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, d: &Arc<Daemon>) -> Result<Self, ApiError> {
        if local(parts).is_some() {
            return Ok(Scraper);
        }
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let h = token_hash(token);
        if d.admin.contains(&h) || d.metrics_hash.as_deref() == Some(&h) {
            Ok(Scraper)
        } else if let Err(e) = live_token(d, token).await {
            Err(e)
        } else {
            Err(ApiError::forbidden(
                "/metrics needs the admin token or the scrape token (metrics_token)",
            ))
        }
    }
}

/// `axum::extract::Path` whose refusals are the API's error body (axum's own are plain text).
pub struct Path<T>(pub T);

impl<S, T> FromRequestParts<S> for Path<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, s: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, s).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(e) => Err(refusal(e.status(), format!("bad path: {}", e.body_text()))),
        }
    }
}

/// `axum::extract::Query` whose refusals are the API's error body.
pub struct Query<T>(pub T);

impl<S, T> FromRequestParts<S> for Query<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, s: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, s).await {
            Ok(axum::extract::Query(v)) => Ok(Query(v)),
            Err(e) => Err(refusal(e.status(), format!("bad query: {}", e.body_text()))),
        }
    }
}

fn refusal(status: StatusCode, message: String) -> ApiError {
    if status.is_client_error() {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
    } else {
        ApiError::internal(message)
    }
}
