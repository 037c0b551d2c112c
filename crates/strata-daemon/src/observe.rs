//! Request observability: every HTTP request gets a request id (`x-request-id`, the client's
//! if it sent a short plain one, else `req-N`), runs in an `http` span carrying its method, path,
//! request id and, once resolved, the caller's `tenant` and the `workspace` it names (so every
//! event logged while serving it says whose it was), and is counted in
//! `strata_http_request_seconds{method,route,status}` by its route template (`/v1/workspaces/{name}`,
//! never the name itself: a tenant cannot grow the metric's label set).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tower_http::request_id::{MakeRequestId, RequestId};

use crate::Daemon;

/// The request-id header.
pub const REQUEST_ID: &str = "x-request-id";

/// Longest request id taken from a client; a longer one is replaced.
const MAX_CLIENT_ID: usize = 64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HttpLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

pub(crate) type HttpSeconds = Family<HttpLabels, Histogram, fn() -> Histogram>;

pub(crate) fn http_seconds() -> HttpSeconds {
    Family::new_with_constructor(|| Histogram::new(strata_nbd::metrics::BUCKETS_SECONDS))
}

/// Request ids `req-1`, `req-2`, … per daemon; a client's own id is kept when it is short
/// and printable.
#[derive(Clone, Default)]
pub(crate) struct Ids(Arc<AtomicU64>);

impl MakeRequestId for Ids {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        let n = self.0.fetch_add(1, Relaxed) + 1;
        HeaderValue::from_str(&format!("req-{n}"))
            .ok()
            .map(RequestId::new)
    }
}

/// Whether a client's request id is kept: at most 64 characters of `[A-Za-z0-9._:-]` (nothing
/// that could pose as another log field or line).
fn acceptable_id(v: &HeaderValue) -> bool {
    !v.is_empty()
        && v.len() <= MAX_CLIENT_ID
        && v.as_bytes()
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Drops a client's request id that is not [`acceptable_id`] (the layer then makes one).
pub(crate) async fn bound_client_id(mut req: Request, next: Next) -> Response {
    if req
        .headers()
        .get(REQUEST_ID)
        .is_some_and(|v| !acceptable_id(v))
    {
        req.headers_mut().remove(REQUEST_ID);
    }
    next.run(req).await
}

/// The span a request runs in.
pub(crate) fn span(req: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let path = req.uri().path();
    // `/v1/workspaces/{name}…`: the workspace, for the logs (validated names only reach the
    // engine; this is only what the request said).
    let workspace = path
        .strip_prefix("/v1/workspaces/")
        .and_then(|r| r.split('/').next())
        .filter(|w| !w.is_empty() && w.len() <= 128)
        .unwrap_or("");
    // Warn level: enabled under the default filter, so a warning or error logged while
    // serving the request names it.
    tracing::warn_span!(
        "http",
        method = %req.method(),
        // A tenant chooses the path (percent-encoded ASCII): logged up to 256 bytes.
        path = %path.get(..path.len().min(256)).unwrap_or(path),
        request_id = %id,
        tenant = tracing::field::Empty,
        workspace = %workspace,
    )
}

/// Records the caller's tenant on the request's span.
pub(crate) fn record_tenant(tenant: &str) {
    tracing::Span::current().record("tenant", tenant);
}

/// Whether a request may run for minutes by design (the data moves: attach replays a journal,
/// detach, checkpoint, rollback and some forks publish, templates and relay files stream, a
/// relay listing reads one meta per file from the store, GC sweeps, mounts make filesystems). Every other route only reads or writes the catalog and is held
/// to the daemon's request timeout.
pub(crate) fn unbounded(method: &Method, route: &str) -> bool {
    // HEAD runs the GET handler (a relay file's HEAD may fetch and verify it first).
    let method = if method == Method::HEAD {
        "GET"
    } else {
        method.as_str()
    };
    matches!(
        (method, route),
        ("POST", "/v1/workspaces/{name}/attach")
            | ("POST", "/v1/workspaces/{name}/detach")
            | ("POST", "/v1/workspaces/{name}/checkpoint")
            | ("POST", "/v1/workspaces/{name}/rollback")
            | ("POST", "/v1/workspaces/{name}/fork")
            | ("POST", "/v1/workspaces/{name}/resize")
            | ("POST", "/v1/workspaces/{name}/mount")
            | ("DELETE", "/v1/workspaces/{name}/mount")
            | ("POST", "/v1/workspaces/{name}/freeze")
            | ("DELETE", "/v1/workspaces/{name}")
            | ("PUT", "/v1/templates/{name}")
            | ("POST", "/v1/templates")
            | ("PUT", "/v1/relay/{stream}/{name}")
            | ("GET", "/v1/relay/{stream}/{name}")
            | ("GET", "/v1/relay/{stream}")
            | ("POST", "/v1/gc")
            | ("DELETE", "/v1/tenants/{name}")
    )
}

/// Times a matched route (a route layer: the route template is known), and holds the routes
/// that are not [`unbounded`] to the request timeout: past it the client gets a retryable
/// 503 in the error body. The handler's future is dropped; work it handed to a task of its
/// own finishes there, so the outcome is unknown to the client, never half-done.
pub(crate) async fn time_route(State(d): State<Arc<Daemon>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = match *req.method() {
        Method::GET | Method::POST | Method::PUT | Method::DELETE | Method::HEAD => {
            req.method().to_string()
        }
        _ => "other".to_string(),
    };
    let started = std::time::Instant::now();
    let bounded = !unbounded(req.method(), &route);
    let resp = match d.request_timeout {
        Some(limit) if bounded => match tokio::time::timeout(limit, next.run(req)).await {
            Ok(r) => r,
            Err(_) => {
                let mut e = crate::error::ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    format!(
                        "no answer within the request timeout ({} ms); the request may still complete",
                        limit.as_millis()
                    ),
                );
                e.retryable = true;
                axum::response::IntoResponse::into_response(e)
            }
        },
        _ => next.run(req).await,
    };
    let labels = HttpLabels {
        method,
        route,
        status: resp.status().as_u16(),
    };
    d.metrics
        .http
        .get_or_create(&labels)
        .observe(started.elapsed().as_secs_f64());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every route the router serves is either bounded or listed as unbounded on purpose, and
    /// the routes that move data are the unbounded ones.
    #[test]
    fn routes_that_move_data_are_not_timed_out() {
        let post = Method::POST;
        assert!(unbounded(&post, "/v1/workspaces/{name}/checkpoint"));
        assert!(unbounded(&Method::PUT, "/v1/relay/{stream}/{name}"));
        assert!(!unbounded(&Method::GET, "/v1/workspaces"));
        assert!(unbounded(&post, "/v1/workspaces/{name}/fork"));
        assert!(unbounded(&Method::HEAD, "/v1/relay/{stream}/{name}"));
        assert!(!unbounded(&post, "/v1/workspaces"));
        assert!(!unbounded(&Method::GET, "/v1/workspaces/{name}"));
    }

    #[test]
    fn client_ids_that_could_pose_as_log_fields_are_replaced() {
        let ok = |s: &str| acceptable_id(&HeaderValue::from_str(s).unwrap());
        assert!(ok("job-42") && ok("a.b_c:d-1"));
        assert!(!ok("x tenant=other") && !ok("a=b") && !ok("{}") && !ok(""));
        assert!(!ok(&"x".repeat(65)));
    }
}

/// The error a request body yields when its client sent nothing for the daemon's body idle
/// timeout; a handler reading the body reports it (the upload is dropped, its spool removed).
#[derive(Debug)]
pub(crate) struct BodyIdle(pub std::time::Duration);

impl std::fmt::Display for BodyIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the client sent nothing for {} s (the daemon's body idle timeout)",
            self.0.as_secs()
        )
    }
}

impl std::error::Error for BodyIdle {}

/// Bounds the wait for each piece of a request body: a client that opens an upload and then
/// sends nothing (or stops halfway) has its request fail after the idle timeout instead of
/// holding what the request took (a share, a spool file, its tenant's gate, which a deletion
/// of the tenant waits for) for ever. Routes that move data are not held to the request
/// timeout ([`unbounded`]); this holds them to keep moving.
pub(crate) async fn idle_body(State(d): State<Arc<Daemon>>, req: Request, next: Next) -> Response {
    let Some(idle) = d.body_idle_timeout else {
        return next.run(req).await;
    };
    let (parts, body) = req.into_parts();
    let stream = futures::stream::unfold(Some(body.into_data_stream()), move |s| async move {
        let mut s = s?;
        match tokio::time::timeout(idle, futures::StreamExt::next(&mut s)).await {
            Ok(Some(Ok(chunk))) => Some((Ok(chunk), Some(s))),
            Ok(Some(Err(e))) => Some((Err(axum::BoxError::from(e)), None)),
            Ok(None) => None,
            Err(_) => Some((Err(axum::BoxError::from(BodyIdle(idle))), None)),
        }
    });
    next.run(Request::from_parts(
        parts,
        axum::body::Body::from_stream(stream),
    ))
    .await
}
