//! The relay's HTTP handlers (`/v1/relay`): stream creation and stream tokens, PUT/GET/HEAD of
//! files, listings with the upload backlog. The durable PUT path is in `relay.rs`.

use std::sync::Arc;

use crate::auth::Path;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use futures::StreamExt;
use strata_catalog::RelayStream;

use crate::api::*;
use crate::auth::{bearer, body, Tenant};
use crate::error::ApiError;
use crate::routes::{D, R};
use crate::tokens::{live_token, Scope};
use crate::{new_token, token_hash, Daemon};

/// A relay caller: a tenant token of full, `relay` or (to read) `read` scope, or a stream
/// token (only PUT to that stream).
pub struct RelayCaller {
    tenant: String,
    scope: Scope,
    _caller: crate::auth::Caller,
}

impl FromRequestParts<Arc<Daemon>> for RelayCaller {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, d: &Arc<Daemon>) -> Result<Self, ApiError> {
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let i = live_token(d, token).await?;
        let changes = !matches!(
            parts.method,
            axum::http::Method::GET | axum::http::Method::HEAD
        );
        Ok(RelayCaller {
            scope: Scope::of(i.scope.as_deref()),
            _caller: crate::auth::Caller::enter(d, &i.tenant, i.expires_ms, changes).await?,
            tenant: i.tenant,
        })
    }
}

impl RelayCaller {
    /// The tenant, if this caller may write to `stream`.
    fn may_put(&self, stream: &str) -> Result<&str, ApiError> {
        match &self.scope {
            Scope::Full | Scope::Relay => Ok(&self.tenant),
            Scope::Stream(s) if s == stream => Ok(&self.tenant),
            Scope::Stream(_) => Err(ApiError::forbidden(
                "this stream token may only add files to its own stream",
            )),
            s => Err(s.refusal(&axum::http::Method::PUT, "/v1/relay/{stream}/{name}")),
        }
    }
    /// The tenant, if this caller may read.
    fn may_read(&self) -> Result<&str, ApiError> {
        match &self.scope {
            Scope::Full | Scope::Relay | Scope::Read => Ok(&self.tenant),
            Scope::Stream(_) => Err(ApiError::forbidden(
                "a stream token can only add files; read with the tenant's token",
            )),
            s => Err(s.refusal(&axum::http::Method::GET, "/v1/relay/{stream}")),
        }
    }
}

/// A stream token, expiring no later than the token that asked for it.
fn stream_token_of(
    tenant: &str,
    stream: &str,
    token: &str,
    expires_ms: Option<u64>,
) -> strata_catalog::NewToken {
    strata_catalog::NewToken {
        tenant: tenant.into(),
        hash: token_hash(token),
        scope: Some(format!("relay:{stream}")),
        expires_ms,
        ..Default::default()
    }
}

/// The stream `t` names, with this node's relay files bound to the tenant of that name now
/// (`Relay::bind_tenant`): what every request touching a stream's files starts with.
async fn stream_files(d: &Daemon, t: &str, stream: &str) -> Result<RelayStream, ApiError> {
    let st = d.engine.catalog().get_stream(t, stream).await?;
    let created_ms = d.engine.catalog().get_tenant(t).await?.created_ms;
    d.relay
        .bind_tenant(t, created_ms)
        .await
        .map_err(|source| crate::relay::RelayError::Io {
            what: "binding relay files to their tenant",
            source,
        })?;
    Ok(st)
}

fn check_stream_name(stream: &str) -> Result<(), ApiError> {
    strata_format::name::validate("stream name", stream)
        .map_err(|e| ApiError::invalid(e.to_string()))
}

#[utoipa::path(
    post,
    path = "/v1/relay",
    summary = "Create a relay stream; returns a stream token that can only add files to it (shown once)",
    request_body = CreateStream,
    responses((status = 201, description = "Created", body = StreamToken)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn create_stream(
    Tenant(t, caller): Tenant,
    State(d): D,
    b: Result<Json<CreateStream>, JsonRejection>,
) -> Result<(StatusCode, Json<StreamToken>), ApiError> {
    let b = body(b)?;
    check_stream_name(&b.name)?;
    let now = strata_format::now_ms();
    // Both steps in a task of their own: a client that leaves (or a request timeout) between
    // them would leave a stream without a token.
    let (cat, name, sync) = (d.engine.catalog().clone(), b.name.clone(), b.sync);
    let expires = caller.expires_ms;
    let token = crate::exports::own_task(async move {
        cat.create_stream(&RelayStream {
            tenant: t.clone(),
            name: name.clone(),
            sync,
            created_ms: now,
        })
        .await?;
        let token = new_token();
        cat.add_token(&stream_token_of(&t, &name, &token, expires))
            .await?;
        Ok(token)
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(StreamToken {
            stream: b.name,
            sync: b.sync,
            token,
        }),
    ))
}

/// Another token for an existing stream.
#[utoipa::path(
    post,
    path = "/v1/relay/{stream}",
    summary = "Another stream token for an existing stream",
    params(("stream" = String, Path, description = "Stream name")),
    responses((status = 201, description = "A new stream token", body = StreamToken)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn stream_token(
    Tenant(t, caller): Tenant,
    State(d): D,
    Path(stream): Path<String>,
) -> Result<(StatusCode, Json<StreamToken>), ApiError> {
    check_stream_name(&stream)?;
    let st = d.engine.catalog().get_stream(&t, &stream).await?;
    let token = new_token();
    d.engine
        .catalog()
        .add_token(&stream_token_of(&t, &stream, &token, caller.expires_ms))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(StreamToken {
            stream,
            sync: st.sync,
            token,
        }),
    ))
}

#[utoipa::path(
    get,
    path = "/v1/relay",
    summary = "Relay streams of the caller's tenant with their upload backlog (pending_files, pending_bytes, lag_ms)",
    responses((status = 200, description = "Streams", body = Object)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn list_streams(Tenant(t, _caller): Tenant, State(d): D) -> R<serde_json::Value> {
    let lag = d.relay.lag();
    let streams = d.engine.catalog().list_streams(&t).await?;
    Ok(Json(serde_json::Value::Array(
        streams
            .into_iter()
            .map(|s| {
                let l = lag
                    .get(&(t.clone(), s.name.clone()))
                    .cloned()
                    .unwrap_or_default();
                serde_json::json!({
                    "name": s.name, "sync": s.sync, "created_ms": s.created_ms,
                    "pending_files": l.pending_files, "pending_bytes": l.pending_bytes,
                    "lag_ms": l.lag_ms,
                })
            })
            .collect(),
    )))
}

#[utoipa::path(
    get,
    path = "/v1/relay/{stream}",
    summary = "Files of a stream (this node's and the object store's); tenant token only",
    params(("stream" = String, Path, description = "Stream name")),
    responses((status = 200, description = "Files", body = Vec<crate::relay::RelayFile>)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn list_relay_files(
    c: RelayCaller,
    State(d): D,
    Path(stream): Path<String>,
) -> R<Vec<crate::relay::RelayFile>> {
    let t = c.may_read()?;
    check_stream_name(&stream)?;
    stream_files(&d, t, &stream).await?;
    Ok(Json(d.relay.list(t, &stream).await?))
}

#[utoipa::path(
    put,
    path = "/v1/relay/{stream}/{name}",
    summary = "Store a file durably: 201 once it is fsync'd (and, for a sync stream, in the object store); 200 for the same bytes again; 409 for other bytes (the original is kept); 413 over the size limit. Tenant or stream token",
    params(("stream" = String, Path, description = "Stream name"), ("name" = String, Path, description = "File name")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "Stored", body = crate::relay::RelayFile), (status = 200, description = "The same bytes were already stored", body = crate::relay::RelayFile), (status = 413, description = "Over the size limit", body = crate::api::ErrorBody)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn put_relay_file(
    c: RelayCaller,
    State(d): D,
    Path((stream, name)): Path<(String, String)>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<crate::relay::RelayFile>), ApiError> {
    check_stream_name(&stream)?;
    let t = c.may_put(&stream)?.to_string();
    strata_format::name::validate_file_name(&name).map_err(|e| ApiError::invalid(e.to_string()))?;
    let st = stream_files(&d, &t, &stream).await?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    d.refresh_placement(&t).await?;
    // The quota's room now; the body is held to it as it arrives (a chunked body says no
    // length), and to the node's free-space floor.
    let room = d.relay_quota(&t, declared.unwrap_or(0)).await?;
    d.live_quota(&t, "a relay file").await?;
    // Bytes being received count against the quota as they arrive, reserved before they are
    // checked: two PUTs racing each see the other's, so together they never pass it.
    let receiving = std::sync::Mutex::new(room.map(|_| {
        d.shares
            .take_over(&t, crate::shares::Kind::RelayReceiving, 0)
    }));
    let admit = |n: u64| {
        if let Some((max, _)) = room {
            let mut r = receiving.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(share) = r.as_mut() {
                share.add(n);
            }
            let waiting = d.relay_waiting(&t);
            let received = d.shares.used(&t, crate::shares::Kind::RelayReceiving);
            if waiting.saturating_add(received) > max {
                return Err(crate::relay::RelayError::Quota(format!(
                    "quota exceeded: tenant {t:?} may have {max} relay bytes waiting for upload on a node; {waiting} are waiting and {received} are being received here; nothing was stored"
                )));
            }
        }
        d.engine
            .admit_local(n)
            .map_err(|e| crate::relay::RelayError::NoSpace(e.to_string()))
    };
    // A body that stopped arriving is told apart (408) from a broken one (400).
    let idle = std::sync::atomic::AtomicBool::new(false);
    let body = body
        .into_data_stream()
        .map(|r| {
            r.inspect_err(|e| {
                if crate::template_api::body_error_is_idle(e) {
                    idle.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            })
        })
        // The tenant's write rate on this node (relay bytes are written to its disk too).
        .then(|r| {
            let wait = r
                .as_ref()
                .ok()
                .and_then(|c| d.engine.pace(&t, c.len() as u64));
            async move {
                if let Some(w) = wait {
                    tokio::time::sleep(w).await;
                }
                r
            }
        });
    let put = d
        .relay
        .put(
            &t,
            &stream,
            st.sync,
            &name,
            crate::relay::Incoming {
                declared_len: declared,
                body,
                admit: &admit,
            },
        )
        .await;
    let (f, created) = match put {
        Err(crate::relay::RelayError::Invalid(m))
            if idle.load(std::sync::atomic::Ordering::Relaxed) =>
        {
            return Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid", m));
        }
        r => r?,
    };
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(f)))
}

#[utoipa::path(
    get,
    path = "/v1/relay/{stream}/{name}",
    summary = "The file's bytes (from this node or the object store, hash-verified); headers x-strata-blake3 and ETag; HEAD for headers only. Tenant token only",
    params(("stream" = String, Path, description = "Stream name"), ("name" = String, Path, description = "File name")),
    responses((status = 200, description = "The bytes", body = Vec<u8>, content_type = "application/octet-stream"), (status = 502, description = "The object store's copy failed verification", body = crate::api::ErrorBody)),
    tag = "relay",
    security(("bearer" = [])),
)]
pub(crate) async fn get_relay_file(
    c: RelayCaller,
    State(d): D,
    Path((stream, name)): Path<(String, String)>,
) -> Result<axum::response::Response, ApiError> {
    let t = c.may_read()?;
    check_stream_name(&stream)?;
    strata_format::name::validate_file_name(&name).map_err(|e| ApiError::invalid(e.to_string()))?;
    stream_files(&d, t, &stream).await?;
    // A file fetched from the store is spooled on this node's disk for as long as the client
    // takes to read it: the tenant's share of spool bytes and the node's floor admit it first,
    // and the share is held until the response body is dropped.
    let spool = |n: u64| {
        let share = d
            .shares
            .take(t, crate::shares::Kind::RelaySpoolBytes, n)
            .map_err(|e| crate::relay::RelayError::Busy(e.message))?;
        d.engine
            .admit_local(n)
            .map_err(|e| crate::relay::RelayError::NoSpace(e.to_string()))?;
        Ok(share)
    };
    let (f, file, share) = d.relay.get(t, &stream, &name, spool).await?;
    let body = axum::body::Body::from_stream(crate::relay::file_stream(file).map(move |c| {
        let _held = &share;
        c
    }));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::ETAG, format!("\"{}\"", f.blake3)),
            (
                header::HeaderName::from_static("x-strata-blake3"),
                f.blake3.clone(),
            ),
            (header::CONTENT_LENGTH, f.size.to_string()),
        ],
        body,
    )
        .into_response())
}

/// What a client is told of a relay failure: the status, kind and message it always had.
impl From<crate::relay::RelayError> for ApiError {
    fn from(e: crate::relay::RelayError) -> ApiError {
        use crate::relay::RelayError as E;
        let (status, kind) = match &e {
            E::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "io"),
            E::Store(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            E::Conflict { .. } => (StatusCode::CONFLICT, "conflict"),
            E::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid"),
            E::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            E::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            E::CorruptLocal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "corrupt"),
            E::CorruptRemote(_) => (StatusCode::BAD_GATEWAY, "corrupt"),
            E::Closed => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            E::NoSpace(_) => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            E::Quota(_) => (StatusCode::FORBIDDEN, "quota"),
            E::Busy(_) => (StatusCode::TOO_MANY_REQUESTS, "busy"),
        };
        let mut a = ApiError::new(status, kind, e.to_string());
        a.retryable = e.is_retryable();
        a
    }
}
