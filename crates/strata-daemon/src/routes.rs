//! HTTP routes. Every tenant route resolves the caller's tenant from its token first; names
//! from paths and bodies are validated by the engine; errors are JSON (`ErrorBody`).

use std::sync::Arc;

use crate::auth::Path;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use strata_catalog::Template;

use crate::api::*;
use crate::auth::{body, optional_body, Admin, Scraper, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::workspace_api::*;
use crate::{new_token, observe, relay_api, template_api, tenants, token_hash, tokens, Daemon};

pub(crate) type D = State<Arc<Daemon>>;
pub(crate) type R<T> = Result<Json<T>, ApiError>;

/// The relay's routes (and health): all that the relay address serves.
fn relay_routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/v1/health", get(health))
        .route(
            "/v1/relay",
            get(relay_api::list_streams).post(relay_api::create_stream),
        )
        .route(
            "/v1/relay/{stream}",
            get(relay_api::list_relay_files).post(relay_api::stream_token),
        )
        .route(
            "/v1/relay/{stream}/{name}",
            axum::routing::put(relay_api::put_relay_file).get(relay_api::get_relay_file),
        )
}

/// What `--relay-listen` serves: the relay routes only, for the address sandboxes reach. Every
/// other path is 404 there, admin routes included, whatever the token.
pub fn relay_router(d: Arc<Daemon>) -> Router {
    layered(
        relay_routes(),
        d,
        "the relay address serves /v1/relay/… only",
    )
}

pub fn router(d: Arc<Daemon>) -> Router {
    let r = relay_routes()
        .route("/v1/openapi.json", get(openapi_json))
        .route("/metrics", get(metrics))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/gc", post(run_gc))
        .route(
            "/v1/tenants",
            get(tenants::list_tenants).post(create_tenant),
        )
        .route(
            "/v1/tenants/{name}",
            axum::routing::delete(tenants::delete_tenant),
        )
        .route(
            "/v1/tenants/{name}/tokens",
            get(tokens::list_tenant_tokens).post(tokens::create_tenant_token),
        )
        .route(
            "/v1/tenants/{name}/tokens/{id}",
            axum::routing::delete(tokens::revoke_tenant_token),
        )
        .route("/v1/tokens", get(tokens::list_own).post(tokens::create_own))
        .route("/v1/tokens/{id}", axum::routing::delete(tokens::revoke_own))
        .route(
            "/v1/tenants/{name}/quotas",
            axum::routing::put(tenants::set_quotas),
        )
        .route("/v1/usage", get(tenants::usage))
        .route(
            "/v1/templates",
            get(list_templates).post(template_api::import_template),
        )
        .route(
            "/v1/templates/{name}",
            // The upload streams its body itself, with its own limit (not the 64 KiB one).
            get(show_template)
                .delete(delete_template)
                .put(template_api::upload_template),
        )
        .route(
            "/v1/workspaces",
            get(list_workspaces).post(create_workspace),
        )
        .route(
            "/v1/workspaces/{name}",
            get(show_workspace).delete(delete_workspace),
        )
        .route("/v1/workspaces/{name}/attach", post(attach))
        .route("/v1/workspaces/{name}/detach", post(detach))
        .route("/v1/workspaces/{name}/checkpoint", post(checkpoint))
        .route("/v1/workspaces/{name}/fork", post(fork))
        .route("/v1/workspaces/{name}/rollback", post(rollback))
        .route("/v1/workspaces/{name}/resize", post(resize))
        .route("/v1/workspaces/{name}/log", get(log))
        .route(
            "/v1/workspaces/{name}/checkpoints/{version}",
            axum::routing::delete(expire_checkpoint),
        )
        .route("/v1/workspaces/{name}/freeze", post(freeze))
        .route("/v1/workspaces/{name}/mount", post(mount).delete(umount))
        .route("/v1/mounts", get(list_mounts))
        .route("/v1/workspaces/{name}/thaw", post(thaw));
    layered(r, d, "no such endpoint (see /v1/openapi.json)")
}

/// The layers every listener's routes run under; `missing` answers unknown paths.
fn layered(r: Router<Arc<Daemon>>, d: Arc<Daemon>, missing: &'static str) -> Router {
    r.route_layer(axum::middleware::from_fn_with_state(
        d.clone(),
        observe::time_route,
    ))
    .fallback(move || async move { ApiError::not_found(missing) })
    .layer(axum::middleware::from_fn_with_state(
        d.clone(),
        observe::idle_body,
    ))
    .layer(DefaultBodyLimit::max(64 * 1024))
    // Outermost last: a client's over-long request id is dropped, one is made, the
    // request runs in its span, and the id goes back on the response.
    .layer(
        tower_http::trace::TraceLayer::new_for_http()
            .make_span_with(observe::span)
            // Server errors are logged once, where they are made (`ApiError`).
            .on_failure(()),
    )
    .layer(tower_http::request_id::PropagateRequestIdLayer::x_request_id())
    .layer(tower_http::request_id::SetRequestIdLayer::x_request_id(
        observe::Ids::default(),
    ))
    .layer(axum::middleware::from_fn(observe::bound_client_id))
    .with_state(d)
}

/// Every node sharing this catalog: what it serves, its remote windows, and whether it is alive
/// (heard from within three heartbeats). Admin only: it spans tenants.
#[utoipa::path(
    get,
    path = "/v1/nodes",
    summary = "Nodes sharing this catalog: attached workspaces, lease epochs, remote windows, liveness (admin token)",
    responses((status = 200, description = "The nodes view", body = Object)),
    tag = "node",
    security(("bearer" = [])),
)]
pub(crate) async fn list_nodes(_: Admin, State(d): D) -> R<serde_json::Value> {
    // This node's own row is reported fresh; the others are as of their last heartbeat.
    d.engine
        .catalog()
        .report_node(&d.node_status().await)
        .await?;
    let nodes = d.engine.catalog().list_nodes().await?;
    let alive_ms = 3 * crate::HEARTBEAT.as_millis() as u64;
    Ok(Json(serde_json::json!({
        "this": d.node_id(),
        "nodes": nodes.iter().map(|n| {
            let mut v = serde_json::to_value(n).unwrap_or_default();
            v["alive"] = (n.seen_ago_ms <= alive_ms).into();
            v
        }).collect::<Vec<_>>(),
    })))
}

#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    summary = "This document",
    responses((status = 200, description = "OpenAPI 3.1, generated from the types", body = Object)),
    tag = "node",
)]
pub(crate) async fn openapi_json() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document(),
    )
}

#[utoipa::path(
    get,
    path = "/v1/health",
    summary = "Liveness and node id",
    responses((status = 200, description = "Alive", body = Object)),
    tag = "node",
)]
pub(crate) async fn health(State(d): D) -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok", "node": d.engine.node_id()}))
}

#[utoipa::path(
    post,
    path = "/v1/tenants",
    summary = "Create a tenant; returns its first token (shown once; admin token)",
    request_body = CreateTenant,
    responses((status = 201, description = "Created", body = TenantToken)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn create_tenant(
    _: Admin,
    State(d): D,
    b: Result<Json<CreateTenant>, JsonRejection>,
) -> Result<(StatusCode, Json<TenantToken>), ApiError> {
    let b = body(b)?;
    strata_format::name::validate("tenant name", &b.name)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    // A store by name only: its URL and credentials are the node's configuration, never a
    // request's.
    let store = d.engine.reader().store().clone();
    if let Some(s) = &b.store {
        if !store.has_named(s) {
            return Err(ApiError::invalid(format!(
                "no store named {s:?} on this node (configured: {:?})",
                store.named()
            )));
        }
    }
    let placed = strata_store::Placed {
        // Set from the catalog's row at the first refresh; 0 matches no row.
        incarnation: 0,
        store: b.store,
        data_key: match b.encrypted {
            true => Some(
                store
                    .new_data_key(&b.name)
                    .map_err(|e| ApiError::invalid(e.to_string()))?,
            ),
            false => None,
        },
    };
    // Both steps in a task of their own: a client that leaves (or a request timeout) between
    // them would leave a tenant without a token, and a retry would get 409.
    let (cat, name) = (d.engine.catalog().clone(), b.name.clone());
    let issued = own_task(async move {
        cat.create_tenant_placed(&name, placed.store.as_deref(), placed.data_key.as_deref())
            .await?;
        store
            .bind(&name, &placed)
            .map_err(|e| strata_catalog::CatalogError::backend(e.to_string()))?;
        let token = new_token();
        let info = cat
            .add_token(&strata_catalog::NewToken {
                tenant: name,
                hash: token_hash(&token),
                label: Some("first token".into()),
                ..Default::default()
            })
            .await?;
        Ok(crate::api::issued(info, token))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(issued)))
}

#[utoipa::path(
    get,
    path = "/v1/templates",
    summary = "List templates",
    responses((status = 200, description = "Templates", body = Vec<Template>)),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn list_templates(Tenant(t, _caller): Tenant, State(d): D) -> R<Vec<Template>> {
    Ok(Json(d.engine.catalog().list_templates(&t).await?))
}

#[utoipa::path(
    get,
    path = "/v1/templates/{name}",
    summary = "Show a template",
    params(("name" = String, Path, description = "Template name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "The template", body = Template)),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn show_template(
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<Template> {
    Ok(Json(d.engine.catalog().get_template(&t, &name).await?))
}

#[utoipa::path(
    delete,
    path = "/v1/templates/{name}",
    summary = "Delete a template (refused while workspaces use it)",
    params(("name" = String, Path, description = "Template name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 204, description = "Deleted")),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn delete_template(
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    d.engine.catalog().delete_template(&t, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Prometheus text exposition (it spans tenants: admin or scrape token only).
#[utoipa::path(
    get,
    path = "/metrics",
    summary = "Prometheus metrics (text exposition); the admin token or the scrape token (metrics_token)",
    responses((status = 200, description = "Prometheus text format 0.0.4", body = String, content_type = "text/plain")),
    tag = "node",
    security(("bearer" = [])),
)]
pub(crate) async fn metrics(_: Scraper, State(d): D) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        d.metrics.render(),
    )
}

/// One GC pass now (admin: it spans tenants). A dry run reports and changes nothing.
#[utoipa::path(
    post,
    path = "/v1/gc",
    summary = "One garbage-collection pass now (admin token): retention expires checkpoints, unreferenced keys older than the grace period are condemned, keys condemned for at least the grace period are deleted",
    request_body = Option<GcRequest>,
    responses((status = 200, description = "The report", body = strata_engine::GcReport)),
    tag = "node",
    security(("bearer" = [])),
)]
pub(crate) async fn run_gc(
    _: Admin,
    State(d): D,
    b: Result<Json<GcRequest>, JsonRejection>,
) -> R<strata_engine::GcReport> {
    let b = optional_body(b)?;
    Ok(Json(
        own_task(async move { Ok(d.run_gc(b.dry_run, b.reconcile).await?) }).await?,
    ))
}
