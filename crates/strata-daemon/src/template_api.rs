//! Template sources a tenant cannot abuse.
//!
//! - `PUT /v1/templates/{name}?format=tar|raw|qcow2[&size=BYTES]`: the content is the request
//!   body, spooled to a private temp file (size-limited, streamed, never held in memory), then
//!   built: a tar archive is unpacked as hostile input and made into ext4; an image is opened
//!   with the stated format only (a qcow2 naming a backing or data file is refused).
//! - `POST /v1/templates {"name", "import": "rel/path"}`: a directory or image the operator put
//!   under `IMPORT/{tenant}/`; the path is checked component by component and must resolve
//!   (symlinks included) inside that tenant's directory.
//!
//! Nothing a tenant sends names a host path outside those two places. A build runs in a task of
//! its own once the body is in, so a client that leaves cannot stop it halfway; a client that
//! leaves during the upload leaves no temp file behind.

use std::path::{Component, Path as FsPath, PathBuf};
use std::sync::Arc;

use crate::auth::{Path, Query};
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use futures::StreamExt;
use strata_catalog::Template;
use strata_engine::template::{ImageFormat, ImportLimits};
use tokio::io::AsyncWriteExt;

use crate::api::{BuildTemplate, UploadTemplate};
use crate::auth::{body, Tenant};
use crate::error::ApiError;
use crate::exports::own_task;
use crate::routes::D;
use crate::shares::Kind;
use crate::Daemon;

/// Largest disk a tenant's template may describe (ext4 size, an image's virtual size).
pub const TEMPLATE_MAX_DISK: u64 = 256 << 30;

fn limits(d: &Daemon) -> ImportLimits {
    ImportLimits {
        max_bytes: d.template_max_bytes,
        max_entries: 1 << 20,
        max_disk: TEMPLATE_MAX_DISK,
    }
}

/// A private temp directory removed when dropped (also when the request is cancelled).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        strata_engine::template::remove_tree(&self.0);
    }
}

fn check_size(size: Option<u64>) -> Result<(), ApiError> {
    match size {
        Some(s) if s == 0 || s > TEMPLATE_MAX_DISK => Err(ApiError::invalid(format!(
            "size must be between 1 byte and {TEMPLATE_MAX_DISK}"
        ))),
        _ => Ok(()),
    }
}

async fn check_new(d: &Daemon, t: &str, name: &str) -> Result<(), ApiError> {
    strata_format::name::validate("template name", name)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    match d.engine.catalog().get_template(t, name).await {
        Ok(_) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("template {name:?} already exists"),
        )),
        Err(strata_catalog::CatalogError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[utoipa::path(
    put,
    path = "/v1/templates/{name}",
    summary = "Build a template from content sent in the body: a tar archive of a directory tree (made into ext4) or a raw or qcow2 image (opened as that format only; a qcow2 naming a backing or data file is refused)",
    params(("name" = String, Path, description = "Template name", pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"), UploadTemplate),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "Built", body = Template), (status = 413, description = "Over the upload limit", body = crate::api::ErrorBody)),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn upload_template(
    Tenant(t, caller): Tenant,
    State(d): D,
    Path(name): Path<String>,
    Query(q): Query<UploadTemplate>,
    content: Body,
) -> Result<(StatusCode, Json<Template>), ApiError> {
    d.refresh_placement(&t).await?;
    d.live_quota(&t, "a template").await?;
    let kind = q.format.as_str();
    if !matches!(kind, "tar" | "raw" | "qcow2") {
        return Err(ApiError::invalid(
            "format must be tar (a directory tree), raw or qcow2",
        ));
    }
    check_size(q.size)?;
    if q.size.is_some() && kind != "tar" {
        return Err(ApiError::invalid(
            "size applies to tar uploads (an image has its own size)",
        ));
    }
    check_new(&d, &t, &name).await?;
    // The tenant's share of uploads first, then the body, and only then one of the node's
    // build slots: a client that sends nothing holds its own tenant's share until the body
    // idle timeout, never a slot another tenant's build waits for.
    let share = d.shares.take(&t, Kind::TemplateUploads, 1)?;
    let tmp = TempDir(strata_engine::tempdir_in(&d.engine.config().data_dir)?);
    let file = tmp.0.join("upload");
    spool(&d, &t, content, &file, d.template_max_bytes).await?;
    let permit = build_slot(&d, &t).await?;
    let (size, limits) = (q.size, limits(&d));
    let format = q.format.clone();
    let tpl = own_task(async move {
        let _tmp = tmp; // removed once the build is done, whatever happens to the request
        let _permit = permit;
        let _share = share; // the converted image is the upload's too
                            // The tenant's gate goes with the build: a deletion waits for it even if the client
                            // left or the request timed out.
        let _caller = caller;
        let e = &d.engine;
        let r = match format.as_str() {
            "tar" => {
                e.build_template_from_archive(&t, &name, &file, size, limits, &|_, _| {})
                    .await
            }
            f => {
                let f: ImageFormat = f.parse()?;
                e.build_template_from_image_as(&t, &name, &file, f, limits, &|_, _| {})
                    .await
            }
        };
        Ok(r?)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(tpl)))
}

/// A place among the node's concurrent template builds (waits for one), after the tenant's
/// builds before it: a tenant builds one template at a time on a node, so it can never hold
/// every slot (slow builds, up to their tools' wall time) while other tenants wait.
async fn build_slot(d: &Daemon, tenant: &str) -> Result<BuildSlot, ApiError> {
    let mine = d
        .op_lock(&(tenant.to_string(), "/build".into()))
        .lock_owned()
        .await;
    let slot = d
        .builds
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("template builds are closed"))?;
    Ok(BuildSlot(mine, slot))
}

/// A tenant's turn and one of the node's build slots, held while a build runs.
struct BuildSlot(
    #[allow(dead_code)] tokio::sync::OwnedMutexGuard<()>,
    #[allow(dead_code)] tokio::sync::OwnedSemaphorePermit,
);

/// Whether a request body failed because its client sent nothing for the idle timeout.
pub(crate) fn body_error_is_idle(e: &axum::Error) -> bool {
    use std::error::Error;
    let mut cause: Option<&(dyn Error + 'static)> = e.source();
    while let Some(c) = cause {
        if c.is::<crate::observe::BodyIdle>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A request body that failed: the client stopped sending (408) or sent something broken.
pub(crate) fn body_error(e: axum::Error) -> ApiError {
    if body_error_is_idle(&e) {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid",
            format!("reading the upload: {e}"),
        )
    } else {
        ApiError::invalid(format!("reading the upload: {e}"))
    }
}

/// Streams a request body into `file`, refusing it past `max` bytes, and refusing bytes the
/// node's free-space floor keeps for its own metadata.
async fn spool(
    d: &Daemon,
    tenant: &str,
    content: Body,
    file: &FsPath,
    max: u64,
) -> Result<(), ApiError> {
    let io = |e: std::io::Error| ApiError::internal(format!("spooling the upload: {e}"));
    let mut out = tokio::fs::File::create(file).await.map_err(io)?;
    let mut stream = content.into_data_stream();
    let mut n = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(body_error)?;
        n += chunk.len() as u64;
        if let Some(wait) = d.engine.pace(tenant, chunk.len() as u64) {
            tokio::time::sleep(wait).await;
        }
        d.engine.admit_local(chunk.len() as u64)?;
        if n > max {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("template upload over {max} bytes (the daemon's template_max_bytes)"),
            ));
        }
        out.write_all(&chunk).await.map_err(io)?;
    }
    out.flush().await.map_err(io)?;
    if n == 0 {
        return Err(ApiError::invalid("the upload is empty"));
    }
    Ok(())
}

#[utoipa::path(
    post,
    path = "/v1/templates",
    summary = "Build a template from a directory or image in the operator's import directory (IMPORT/{tenant}/); host paths are refused",
    request_body = BuildTemplate,
    responses((status = 201, description = "Built", body = Template)),
    tag = "templates",
    security(("bearer" = [])),
)]
pub(crate) async fn import_template(
    Tenant(t, caller): Tenant,
    State(d): D,
    b: Result<Json<BuildTemplate>, JsonRejection>,
) -> Result<(StatusCode, Json<Template>), ApiError> {
    let b = body(b)?;
    d.refresh_placement(&t).await?;
    d.live_quota(&t, "a template").await?;
    if b.from_dir.is_some() || b.from_image.is_some() {
        return Err(ApiError::invalid(
            "from_dir and from_image (host paths) are not accepted: send the content with PUT /v1/templates/NAME?format=tar|raw|qcow2 (what `strata template build` does), or name a file in the operator's import directory with \"import\"",
        ));
    }
    let Some(rel) = b.import.clone() else {
        return Err(ApiError::invalid(
            "give \"import\" (a path in the import directory), or PUT the content",
        ));
    };
    check_size(b.size)?;
    check_new(&d, &t, &b.name).await?;
    let src = import_path(&d, &t, &rel)?;
    let limits = limits(&d);
    let permit = build_slot(&d, &t).await?;
    let tpl = own_task(async move {
        let _permit = permit;
        let _caller = caller;
        let e = &d.engine;
        let r = if src.is_dir() {
            e.build_template_from_dir(&t, &b.name, &src, b.size, &|_, _| {})
                .await
        } else {
            let f = strata_engine::template::detect_format(&src)?;
            e.build_template_from_image_as(&t, &b.name, &src, f, limits, &|_, _| {})
                .await
        };
        Ok(r?)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(tpl)))
}

/// Resolves `rel` inside `IMPORT/{tenant}/`: every component a plain name (no `..`, no
/// absolute path), and the result, symlinks resolved, still inside. Anything else, like a
/// missing file, is "not found".
fn import_path(d: &Arc<Daemon>, tenant: &str, rel: &str) -> Result<PathBuf, ApiError> {
    let Some(root) = &d.import_dir else {
        return Err(ApiError::forbidden(
            "this node has no import directory (--import-dir); upload the content instead",
        ));
    };
    let missing = || ApiError::not_found(format!("{rel:?} is not in your import directory"));
    let relp = FsPath::new(rel);
    for c in relp.components() {
        match c {
            Component::Normal(n) => {
                let n = n.to_str().ok_or_else(missing)?;
                strata_format::name::validate_file_name(n)
                    .map_err(|e| ApiError::invalid(format!("import path: {e}")))?;
            }
            _ => {
                return Err(ApiError::invalid(
                    "import path: give a relative path of plain names",
                ))
            }
        }
    }
    let base = root.join(tenant).canonicalize().map_err(|_| missing())?;
    let p = base.join(relp).canonicalize().map_err(|_| missing())?;
    if !p.starts_with(&base) {
        return Err(missing());
    }
    Ok(p)
}
