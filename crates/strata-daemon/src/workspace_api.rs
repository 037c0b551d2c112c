//! Workspace routes: create, view, attach, detach, checkpoint, fork, rollback, resize,
//! retention, freeze and mounts. The caller's tenant comes from its token; names from paths
//! and bodies are validated by the engine; errors are JSON (`ErrorBody`).

use std::sync::Arc;
use std::time::Duration;

use crate::auth::Path;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::Json;
use strata_catalog::{Checkpoint, Mode, Workspace};
use strata_engine::{Published, Source};

use crate::api::*;
use crate::auth::{body, optional_body, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::routes::{D, R};
use crate::Daemon;
use axum::extract::State;
use strata_format::now_ms;

#[utoipa::path(
    get,
    path = "/v1/workspaces",
    summary = "List workspaces",
    responses((status = 200, description = "Workspaces", body = Vec<Workspace>)),
    tag = "workspaces",
    security(("bearer" = [])),
)]
pub(crate) async fn list_workspaces(Tenant(t, _caller): Tenant, State(d): D) -> R<Vec<Workspace>> {
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
    Tenant(t, _caller): Tenant,
    State(d): D,
    b: Result<Json<CreateWorkspace>, JsonRejection>,
) -> Result<(StatusCode, Json<Workspace>), ApiError> {
    let b = body(b)?;
    d.refresh_placement(&t).await?;
    d.live_quota(&t, "a new workspace").await?;
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<CheckpointRequest>, JsonRejection>,
) -> R<Published> {
    let b = optional_body(b)?;
    d.engine.workspace(&t, &name).await?;
    d.live_quota(&t, "a checkpoint").await?;
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
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<ForkRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<Workspace>), ApiError> {
    let b = body(b)?;
    d.refresh_placement(&t).await?;
    d.live_quota(&t, "a fork").await?;
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<crate::mount::resize::ResizeRequest>, JsonRejection>,
) -> R<crate::mount::resize::Resized> {
    let b = body(b)?;
    d.engine.workspace(&t, &name).await?;
    // The tenant's resizes on this node one at a time, the check and the grow under one lock
    // held by a task of its own (a client that leaves cannot release it while the grow goes
    // on): two checked against the same total could both pass and take the tenant past its
    // quota together. A key of their own (no workspace name holds a `/`): the attach quota's
    // tenant lock is taken under a workspace's lock, which a resize takes after this one.
    let resized = own_task(async move {
        let _caller = caller;
        let _one = d.op_lock(&(t.clone(), "/resize".into())).lock_owned().await;
        d.resize_quota(&t, &name, b.size).await?;
        d.resize_workspace(&t, &name, b.size).await
    })
    .await?;
    Ok(Json(resized))
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
    Tenant(t, _caller): Tenant,
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
pub(crate) async fn list_mounts(
    Tenant(t, _caller): Tenant,
    State(d): D,
) -> R<Vec<crate::mount::MountInfo>> {
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
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
    Tenant(t, _caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
) -> R<serde_json::Value> {
    let v = attached_volume(&d, &t, &name).await?;
    v.thaw().await;
    Ok(Json(
        serde_json::json!({"workspace": name, "frozen": false}),
    ))
}
