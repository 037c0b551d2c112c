//! HTTP routes. Every tenant route resolves the caller's tenant from its token first; names
//! from paths and bodies are validated by the engine; errors are JSON (`ErrorBody`).

use std::sync::Arc;
use std::time::Duration;

use crate::auth::Path;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use strata_catalog::{Checkpoint, Mode, Template, Workspace};
use strata_engine::{Published, Source};

use crate::api::*;
use crate::auth::{body, optional_body, Admin, Scraper, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::{new_token, observe, relay_api, template_api, token_hash, Daemon};

pub(crate) type D = State<Arc<Daemon>>;
pub(crate) type R<T> = Result<Json<T>, ApiError>;

pub fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi_json))
        .route("/metrics", get(metrics))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/gc", post(run_gc))
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
        .route("/v1/tenants", post(create_tenant))
        .route("/v1/tenants/{name}/tokens", post(create_token))
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
        .route("/v1/workspaces/{name}/thaw", post(thaw))
        .route_layer(axum::middleware::from_fn_with_state(
            d.clone(),
            observe::time_route,
        ))
        .fallback(|| async { ApiError::not_found("no such endpoint (see /v1/openapi.json)") })
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
    d.engine.catalog().create_tenant(&b.name).await?;
    let token = new_token();
    d.engine
        .catalog()
        .add_token(&b.name, &token_hash(&token))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(TenantToken {
            tenant: b.name,
            token,
        }),
    ))
}

#[utoipa::path(
    post,
    path = "/v1/tenants/{name}/tokens",
    summary = "Issue another token for a tenant (admin token)",
    params(("name" = String, Path, description = "Tenant name")),
    responses((status = 201, description = "A new token", body = TenantToken)),
    tag = "tenants",
    security(("bearer" = [])),
)]
pub(crate) async fn create_token(
    _: Admin,
    State(d): D,
    Path(name): Path<String>,
) -> Result<(StatusCode, Json<TenantToken>), ApiError> {
    let token = new_token();
    d.engine
        .catalog()
        .add_token(&name, &token_hash(&token))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(TenantToken {
            tenant: name,
            token,
        }),
    ))
}

#[utoipa::path(
    get,
    path = "/v1/templates",
    summary = "List templates",
    responses((status = 200, description = "Templates", body = Vec<Template>)),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn list_templates(Tenant(t): Tenant, State(d): D) -> R<Vec<Template>> {
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
    Tenant(t): Tenant,
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
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    d.engine.catalog().delete_template(&t, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    get,
    path = "/v1/workspaces",
    summary = "List workspaces",
    responses((status = 200, description = "Workspaces", body = Vec<Workspace>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn list_workspaces(Tenant(t): Tenant, State(d): D) -> R<Vec<Workspace>> {
    Ok(Json(d.engine.list_workspaces(&t).await?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces",
    summary = "Create a workspace from a template, a checkpoint (from: WS@VERSION) or an empty disk",
    request_body = CreateWorkspace,
    responses((status = 201, description = "Created", body = Workspace)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn create_workspace(
    Tenant(t): Tenant,
    State(d): D,
    b: Result<Json<CreateWorkspace>, JsonRejection>,
) -> Result<(StatusCode, Json<Workspace>), ApiError> {
    let b = body(b)?;
    let source = match (b.template, b.from, b.size) {
        (Some(tpl), None, None) => Source::Template(tpl),
        (None, Some(from), None) => {
            let (w, v) = match from.split_once('@') {
                Some((w, v)) => (
                    w.to_string(),
                    Some(
                        v.parse::<u64>()
                            .map_err(|_| ApiError::invalid(format!("bad version in {from:?}")))?,
                    ),
                ),
                None => (from, None),
            };
            Source::Checkpoint {
                workspace: w,
                version: v,
            }
        }
        (None, None, Some(size)) => {
            if size == 0 || size > strata_format::manifest::MAX_DISK_SIZE {
                return Err(ApiError::invalid("size must be between 1 byte and 1 PiB"));
            }
            Source::Empty { size }
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of template, from or size",
            ))
        }
    };
    let mode = b.mode.unwrap_or(Mode::Durable);
    let w = d
        .engine
        .create_workspace(
            &t,
            &b.name,
            source,
            mode,
            b.ttl_secs.map(Duration::from_secs),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(w)))
}

#[utoipa::path(
    get,
    path = "/v1/workspaces/{name}",
    summary = "Show a workspace: head, lease, export, remote window",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "The workspace", body = WorkspaceView)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn show_workspace(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<WorkspaceView> {
    let workspace = d.engine.workspace(&t, &name).await?;
    let lease = d.engine.catalog().get_lease(&t, &name).await?;
    let export = d.export_uri(&t, &name);
    let vol = d.engine.volume(&t, &name);
    Ok(Json(WorkspaceView {
        workspace,
        lease,
        attached: vol.is_some(),
        export,
        stats: vol.map(|v| v.stats()),
    }))
}

#[utoipa::path(
    delete,
    path = "/v1/workspaces/{name}",
    summary = "Delete a workspace and its history",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 204, description = "Deleted")),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn delete_workspace(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    d.engine.workspace(&t, &name).await?;
    d.delete_workspace(&t, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/attach",
    summary = "Attach on this node and serve over NBD (default) or vhost-user-blk (idempotent; another protocol or read-only setting than the live export is 409)",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = Option<AttachRequest>,
    responses((status = 200, description = "Attached", body = Attached)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn attach(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<crate::AttachRequest>, JsonRejection>,
) -> R<Attached> {
    let b = optional_body(b)?;
    d.engine.workspace(&t, &name).await?;
    Ok(Json(d.attach_and_export(&t, &name, b).await?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/detach",
    summary = "Publish what is unpublished, stop the export, release the lease",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "Detached: the final publish, if there was one", body = Option<Published>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn detach(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<Option<Published>> {
    d.engine.workspace(&t, &name).await?;
    Ok(Json(d.detach_workspace(&t, &name).await?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/checkpoint",
    summary = "Checkpoint everything acknowledged so far",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = Option<CheckpointRequest>,
    responses((status = 200, description = "The checkpoint (local, or published with wait)", body = Published)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn checkpoint(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<CheckpointRequest>, JsonRejection>,
) -> R<Published> {
    let b = optional_body(b)?;
    d.engine.workspace(&t, &name).await?;
    let keep_until = match b.keep_secs {
        Some(s) if s > 100 * 365 * 86400 => {
            return Err(ApiError::invalid("keep_secs is over 100 years"))
        }
        Some(s) => Some(now_ms() + s * 1000),
        None => None,
    };
    let started = std::time::Instant::now();
    let r = d
        .checkpoint_workspace(&t, &name, b.label, keep_until, !b.no_freeze, b.wait)
        .await;
    d.metrics
        .checkpoint
        .observe(started.elapsed().as_secs_f64());
    Ok(Json(r?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/fork",
    summary = "Fork into a new workspace without copying data",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = ForkRequest,
    responses((status = 201, description = "The fork", body = Workspace)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn fork(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<ForkRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<Workspace>), ApiError> {
    let b = body(b)?;
    let started = std::time::Instant::now();
    let r = own_task({
        let d = d.clone();
        async move {
            // A fork of a mounted workspace's current state is cut with its filesystem frozen,
            // as a checkpoint is: the fork mounts clean.
            let version = match b.version {
                None if d.is_mounted(&t, &name) => Some(
                    d.checkpoint_workspace(&t, &name, None, None, true, true)
                        .await?
                        .version,
                ),
                v => v,
            };
            Ok(d.engine.fork(&t, &name, version, &b.name, b.mode).await?)
        }
    })
    .await;
    d.metrics.fork.observe(started.elapsed().as_secs_f64());
    let w = r?;
    Ok((StatusCode::CREATED, Json(w)))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/rollback",
    summary = "Make an older version the head, as a new version",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = RollbackRequest,
    responses((status = 200, description = "The new head version", body = Published)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn rollback(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<RollbackRequest>, JsonRejection>,
) -> R<Published> {
    let b = body(b)?;
    d.engine.workspace(&t, &name).await?;
    let r = own_task(async move {
        // Under the workspace's op lock: a mount cannot start while the disk is replaced.
        let lock = d.op_lock(&(t.clone(), name.clone()));
        let _op = lock.lock().await;
        d.refuse_if_mounted(&t, &name, "rolling it back")?;
        Ok(d.engine.rollback_with(&t, &name, b.version, b.wait).await?)
    })
    .await;
    Ok(Json(r?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/mount",
    summary = "Mount the workspace's filesystem on this host (attach, mkfs on a blank volume if asked, mount, bind onto the target); remounted after a daemon restart. Needs the node's --mount-root (403 without)",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = Option<crate::mount::MountRequest>,
    responses((status = 200, description = "Mounted", body = crate::mount::MountInfo), (status = 501, description = "Not supported on this host", body = ErrorBody), (status = 503, description = "Busy or stopping", body = ErrorBody)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn mount(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<crate::mount::MountRequest>, JsonRejection>,
) -> R<crate::mount::MountInfo> {
    let b = optional_body(b)?;
    d.engine.workspace(&t, &name).await?;
    Ok(Json(d.mount_workspace(&t, &name, b).await?))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/resize",
    summary = "Grow the disk (never shrinks); mounted here, its device and ext4 filesystem too",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = crate::mount::resize::ResizeRequest,
    responses((status = 200, description = "Sizes now", body = crate::mount::resize::Resized), (status = 503, description = "Busy", body = ErrorBody)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn resize(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<crate::mount::resize::ResizeRequest>, JsonRejection>,
) -> R<crate::mount::resize::Resized> {
    let b = body(b)?;
    d.engine.workspace(&t, &name).await?;
    Ok(Json(d.resize_workspace(&t, &name, b.size).await?))
}

#[utoipa::path(
    delete,
    path = "/v1/workspaces/{name}/mount",
    summary = "Unmount (target, filesystem, loop device, FUSE export) and detach: the final publish",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "Unmounted and detached", body = Option<Published>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn umount(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<Option<Published>> {
    d.engine.workspace(&t, &name).await?;
    Ok(Json(d.umount_workspace(&t, &name).await?))
}

#[utoipa::path(
    get,
    path = "/v1/mounts",
    summary = "The caller's workspaces mounted on this node",
    responses((status = 200, description = "Mounts", body = Vec<crate::mount::MountInfo>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn list_mounts(Tenant(t): Tenant, State(d): D) -> R<Vec<crate::mount::MountInfo>> {
    Ok(Json(d.mounts_of(&t)))
}

#[utoipa::path(
    get,
    path = "/v1/workspaces/{name}/log",
    summary = "Checkpoint history",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "Checkpoints, oldest first", body = Vec<Checkpoint>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn log(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<Vec<Checkpoint>> {
    Ok(Json(d.engine.log(&t, &name).await?))
}

/// Ends a checkpoint's retention now (a deleted snapshot): it leaves the log at once; its
/// data is collected by the GC passes after the grace period (an operation that read it just
/// before still completes). The head is refused: it is the workspace's current state.
#[utoipa::path(
    delete,
    path = "/v1/workspaces/{name}/checkpoints/{version}",
    summary = "Expire a checkpoint now (a deleted snapshot); the head is refused (409)",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"), ("version" = u64, Path, description = "Checkpoint version")),
    responses((status = 204, description = "Expired")),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn expire_checkpoint(
    Tenant(t): Tenant,
    State(d): D,
    Path((name, version)): Path<(String, u64)>,
) -> Result<StatusCode, ApiError> {
    let w = d.engine.workspace(&t, &name).await?;
    let cat = d.engine.catalog();
    cat.get_checkpoint(&t, &name, version)
        .await
        .map_err(strata_engine::Error::from)?;
    if version == w.head_version {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("version {version} is the head of {name:?} (its current state): checkpoint it again first"),
        ));
    }
    let n = cat
        .expire_checkpoints(&t, &name, &[version])
        .await
        .map_err(strata_engine::Error::from)?;
    if n == 0 {
        // Expired meanwhile, or the head now (a rollback to it raced this): say which.
        cat.get_checkpoint(&t, &name, version)
            .await
            .map_err(strata_engine::Error::from)?;
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("version {version} of {name:?} became its head: checkpoint it again first"),
        ));
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn attached_volume(
    d: &Daemon,
    t: &str,
    name: &str,
) -> Result<Arc<strata_engine::Volume>, ApiError> {
    d.engine.workspace(t, name).await?;
    d.engine.volume(t, name).ok_or_else(|| {
        ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("workspace {name:?} is not attached on this node: attach it first"),
        )
    })
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/freeze",
    summary = "Stop acknowledging writes after draining in-flight ones (pair with a VM memory snapshot)",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "Frozen", body = Object)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn freeze(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<serde_json::Value> {
    let v = attached_volume(&d, &t, &name).await?;
    // A mounted filesystem is frozen by its checkpoint (FIFREEZE); a block-level freeze left
    // on would stall its writeback, and with it the node's stop.
    d.refuse_if_mounted(&t, &name, "freezing its block device")?;
    v.freeze().await;
    Ok(Json(serde_json::json!({"workspace": name, "frozen": true})))
}

#[utoipa::path(
    post,
    path = "/v1/workspaces/{name}/thaw",
    summary = "Resume acknowledging writes",
    params(("name" = String, Path, description = "Workspace name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, description = "Thawed", body = Object)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn thaw(
    Tenant(t): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<serde_json::Value> {
    let v = attached_volume(&d, &t, &name).await?;
    v.thaw().await;
    Ok(Json(
        serde_json::json!({"workspace": name, "frozen": false}),
    ))
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

use strata_format::now_ms;

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
        own_task(async move { Ok(d.run_gc(b.dry_run).await?) }).await?,
    ))
}
