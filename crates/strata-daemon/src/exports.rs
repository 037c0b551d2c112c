//! Exports of attached workspaces (NBD, or vhost-user-blk for a VMM), and the per-workspace
//! operations that change them.
//!
//! ```text
//! attach ─▶ workspace op lock ─▶ engine.attach (lease, replay) ─▶ bind RUN/{h}.sock (NBD) or
//!           RUN/{h}.vhost.sock (vhost-user) ─▶ serve
//!           (an export that cannot be made undoes the attach it made: all or nothing)
//! detach ─▶ workspace op lock ─▶ stop the export: no new connections, every connection
//!           finishes what it accepted, then closes ─▶ engine.detach (seal, final cut, publish)
//!           (a failed publish re-exports: the workspace stays as it was)
//! delete ─▶ workspace op lock ─▶ stop the export ─▶ engine.delete_workspace
//! ```
//! Each operation runs in a task of its own: an HTTP client that disconnects cannot stop one
//! halfway. Only operations on the same workspace wait for each other.
//!
//! Socket names never come from user names: `RUN/{h}.sock` with `h` a hash of (tenant,
//! workspace), so every legal name fits a unix socket path (108 bytes) and nothing a tenant
//! names becomes a host path. The run directory is 0700, each socket 0600.
//!
//! One front-end per workspace: an attach over another protocol (or with another read-only
//! setting) than the live export is refused (409), so there is never a second writer. A
//! vhost-user export leaves a record, `DATA/vhost/{h}.json`, that detach and delete remove and
//! a stop keeps: a restart serves it again on the same socket, where the VMM reconnects.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_engine::{Published, Volume};
use strata_nbd::{BlockDevice, Export, Exports, Server, ServerConfig};
use tokio::task::JoinHandle;

use crate::error::ApiError;
use crate::{AttachRequest, Attached, Daemon, Protocol};

pub(crate) type Key = (String, String);

/// A running export of one workspace.
pub(crate) struct ExportHandle {
    pub uri: String,
    pub socket: PathBuf,
    pub req: AttachRequest,
    front: Front,
    /// The volume it serves: an export of a volume the engine has since replaced (a failed
    /// one, by a call's attach) is stale.
    vol: std::sync::Weak<Volume>,
}

enum Front {
    Nbd {
        server: Arc<Server>,
        task: JoinHandle<()>,
    },
    Vhost(strata_vhost::Served),
}

/// Longest unix socket path (`sun_path` holds 108 bytes with its terminating NUL).
const SUN_PATH_MAX: usize = 107;
const SOCKET_NAME_LEN: usize = 32 + ".sock".len();

/// How long a stop waits for a vhost-user backend's queue threads (as an NBD drain does).
const VHOST_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a restart needs to serve a vhost-user export again.
#[derive(serde::Serialize, serde::Deserialize)]
struct VhostRecord {
    tenant: String,
    workspace: String,
    req: AttachRequest,
}

/// Checks that NBD sockets under `run_dir` fit a unix socket path (at start).
pub(crate) fn check_run_dir(run_dir: &Path) -> std::io::Result<()> {
    fits(run_dir, run_dir.as_os_str().len() + 1 + SOCKET_NAME_LEN)
}

/// A socket path of `len` bytes under `run_dir` fits `sun_path`.
fn fits(run_dir: &Path, len: usize) -> std::io::Result<()> {
    if len > SUN_PATH_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "run directory {} is too long for unix socket paths ({len} > {SUN_PATH_MAX} bytes); choose a shorter --run-dir",
                run_dir.display()
            ),
        ));
    }
    Ok(())
}

fn key(t: &str, w: &str) -> Key {
    (t.to_string(), w.to_string())
}

impl Daemon {
    /// The socket of a workspace's NBD export: a hash of the names, never the names.
    pub(crate) fn socket_path(&self, tenant: &str, ws: &str) -> PathBuf {
        self.run_dir.join(format!("{}.sock", name_hash(tenant, ws)))
    }

    fn vhost_socket_path(&self, tenant: &str, ws: &str) -> PathBuf {
        self.run_dir
            .join(format!("{}.vhost.sock", name_hash(tenant, ws)))
    }

    fn vhost_record_path(&self, tenant: &str, ws: &str) -> PathBuf {
        self.engine
            .config()
            .data_dir
            .join("vhost")
            .join(format!("{}.json", name_hash(tenant, ws)))
    }

    /// How a restart serves this workspace again: vhost-user if a record says so, else NBD.
    pub(crate) fn resume_request(&self, tenant: &str, ws: &str) -> AttachRequest {
        let p = self.vhost_record_path(tenant, ws);
        let b = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return AttachRequest::default(),
            Err(e) => {
                tracing::warn!(tenant, workspace = ws, error = %e, "vhost-user record unreadable: resuming over NBD");
                return AttachRequest::default();
            }
        };
        match serde_json::from_slice::<VhostRecord>(&b) {
            Ok(r) if r.tenant == tenant && r.workspace == ws => r.req,
            _ => {
                tracing::warn!(tenant, workspace = ws, record = %p.display(), "vhost-user record invalid: resuming over NBD");
                AttachRequest::default()
            }
        }
    }

    fn write_vhost_record(&self, t: &str, ws: &str, req: AttachRequest) -> std::io::Result<()> {
        let p = self.vhost_record_path(t, ws);
        let dir = p.parent().expect("record has a parent");
        std::fs::create_dir_all(dir)?;
        let rec = VhostRecord {
            tenant: t.into(),
            workspace: ws.into(),
            req,
        };
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(&rec).expect("record serializes"))?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, &p)?;
        std::fs::File::open(dir)?.sync_all()
    }

    fn remove_vhost_record(&self, t: &str, ws: &str) {
        match std::fs::remove_file(self.vhost_record_path(t, ws)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(tenant = t, workspace = ws, error = %e, "removing vhost-user record")
            }
            _ => {}
        }
    }

    fn lock_exports(&self) -> std::sync::MutexGuard<'_, HashMap<Key, ExportHandle>> {
        self.exports.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The export address of a workspace, if it is exported here.
    pub(crate) fn export_uri(&self, tenant: &str, ws: &str) -> Option<String> {
        self.lock_exports()
            .get(&key(tenant, ws))
            .map(|h| h.uri.clone())
    }

    /// The protocol a workspace is exported over here, if it is.
    pub(crate) fn export_protocol(&self, tenant: &str, ws: &str) -> Option<Protocol> {
        self.lock_exports()
            .get(&key(tenant, ws))
            .map(|h| h.req.protocol)
    }

    pub(crate) fn op_lock(&self, k: &Key) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        // Forget idle entries now and then so the map follows the attached set, not history.
        if m.len() > 1024 {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        m.entry(k.clone()).or_default().clone()
    }

    /// Attaches (idempotently) and serves the workspace on its unix socket, over the protocol
    /// the request names (NBD by default).
    pub(crate) async fn attach_and_export(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
        req: AttachRequest,
    ) -> Result<Attached, ApiError> {
        if let Some(q) = req.queues {
            if req.protocol != Protocol::VhostUser {
                return Err(ApiError::invalid("queues applies to vhost-user attaches"));
            }
            if q == 0 || q > strata_vhost::MAX_QUEUES {
                return Err(ApiError::invalid(format!(
                    "queues must be 1..={}",
                    strata_vhost::MAX_QUEUES
                )));
            }
        }
        // The default spelled out, so an attach naming it matches one that did not.
        let mut req = req;
        if req.protocol == Protocol::VhostUser {
            req.queues = Some(req.queues.unwrap_or(strata_vhost::DEFAULT_QUEUES));
        }
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = key(&t, &ws);
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            d.refuse_if_mounted(&t, &ws, &format!("attaching it over {}", req.protocol))?;
            if d.engine.volume(&t, &ws).is_none() {
                d.refresh_placement(&t).await?;
            }
            // A stop drains every export once: nothing new is exported after it began.
            if d.mounts_stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "stopping",
                    "this node is stopping",
                ));
            }
            let current = d.engine.volume(&t, &ws).filter(|v| v.failure().is_none());
            let stale = current.as_ref().is_some_and(|cur| {
                d.lock_exports().get(&k).is_some_and(|h| {
                    h.vol.upgrade().is_none_or(|v| !Arc::ptr_eq(&v, cur))
                })
            });
            if stale {
                // It serves a volume the engine replaced: the current one is exported instead.
                d.stop_export(&t, &ws).await;
            }
            if current.is_some() {
                if let Some(h) = d.lock_exports().get(&k) {
                    if h.req != req {
                        return Err(ApiError::new(
                            axum::http::StatusCode::CONFLICT,
                            "conflict",
                            format!(
                                "workspace {ws:?} is attached over {}{}: detach it first (one front-end at a time)",
                                h.req.protocol,
                                if h.req.read_only { ", read-only" } else { "" }
                            ),
                        ));
                    }
                    return Ok(attached(&ws, h));
                }
            } else {
                // An export of a fenced or failed volume serves nothing: replace it.
                d.stop_export(&t, &ws).await;
            }
            let _quota = d.attach_quota(&t, &ws).await?;
            let was_attached = d.engine.volume(&t, &ws).is_some();
            let vol = d.engine.attach(&t, &ws).await?;
            match d.export(&t, &ws, vol, req) {
                Ok(a) => Ok(a),
                Err(e) => {
                    d.undo_attach(&t, &ws, was_attached, "export").await;
                    Err(e)
                }
            }
        })
        .await
    }

    /// Undoes an attach made for an export or mount that then failed (all or nothing);
    /// `was_attached`: it was attached before, and stays.
    pub(crate) async fn undo_attach(&self, t: &str, ws: &str, was_attached: bool, what: &str) {
        if was_attached {
            return;
        }
        if let Err(e) = self.engine.detach(t, ws).await {
            tracing::error!(tenant = t, workspace = ws, error = %e, "undoing an attach whose {what} failed");
        }
    }

    fn export(
        &self,
        t: &str,
        ws: &str,
        vol: Arc<Volume>,
        req: AttachRequest,
    ) -> Result<Attached, ApiError> {
        let io = |e: std::io::Error| ApiError::internal(format!("export socket: {e}"));
        {
            use std::os::unix::fs::DirBuilderExt;
            use std::os::unix::fs::PermissionsExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.run_dir)
                .map_err(io)?;
            std::fs::set_permissions(&self.run_dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io)?;
        }
        let mode = vol.mode();
        let served = Arc::downgrade(&vol);
        let device: Arc<dyn BlockDevice> = if req.read_only {
            Arc::new(strata_nbd::ReadOnly(vol))
        } else {
            vol
        };
        if req.protocol == Protocol::VhostUser {
            return self.export_vhost(t, ws, device, mode, req, served);
        }
        // A record left by an earlier vhost-user export (its resume failed) must not make the
        // next restart serve this NBD export as vhost-user.
        self.remove_vhost_record(t, ws);
        let socket = self.socket_path(t, ws);
        let exports = Exports::new();
        exports.insert(
            ws,
            Export {
                description: format!("strata workspace {ws} ({mode})"),
                device,
                multi_conn: true,
            },
        );
        let listener = Server::bind_unix(&socket).map_err(io)?;
        let server = Server::new(
            exports,
            ServerConfig {
                metrics: Some(self.nbd_metrics.clone()),
                // One tenant's exports between them hold at most its share of bytes in
                // flight, each at most its share of connections (`shares.rs`).
                shared_budget: Some(self.shares.nbd_budget(t)),
                max_connections: Some(self.shares.limits().nbd_connections as usize),
                ..ServerConfig::default()
            },
        );
        let task = {
            let (server, t, ws) = (server.clone(), t.to_string(), ws.to_string());
            tokio::spawn(async move {
                if let Err(e) = server.serve_unix(listener).await {
                    tracing::error!(tenant = t, workspace = ws, error = %e, "nbd listener failed");
                }
            })
        };
        let h = ExportHandle {
            uri: format!("nbd+unix:///{ws}?socket={}", socket.display()),
            socket,
            req,
            front: Front::Nbd { server, task },
            vol: served,
        };
        let a = attached(ws, &h);
        self.lock_exports().insert(key(t, ws), h);
        Ok(a)
    }

    fn export_vhost(
        &self,
        t: &str,
        ws: &str,
        device: Arc<dyn BlockDevice>,
        mode: strata_catalog::Mode,
        req: AttachRequest,
        vol: std::sync::Weak<Volume>,
    ) -> Result<Attached, ApiError> {
        let io = |e: std::io::Error| ApiError::internal(format!("vhost-user socket: {e}"));
        let socket = self.vhost_socket_path(t, ws);
        // The run directory was checked for NBD socket names at start; these are 6 bytes longer.
        fits(&self.run_dir, socket.as_os_str().len()).map_err(io)?;
        // Ephemeral promises nothing at FLUSH: offer none; durable and sync honour every FLUSH.
        let features = strata_vhost::Features {
            unsealed_memory: self.vhost_unsealed_memory,
            ..strata_vhost::Features::new(
                req.read_only,
                mode != strata_catalog::Mode::Ephemeral,
                req.queues,
                format!("strata-{}", &name_hash(t, ws)[..13]),
            )
        };
        // The record first: without it a restart would serve NBD where the VMM expects
        // vhost-user.
        self.write_vhost_record(t, ws, req).map_err(io)?;
        let served =
            match strata_vhost::serve(&socket, device, features, tokio::runtime::Handle::current())
            {
                Ok(s) => s,
                Err(e) => {
                    self.remove_vhost_record(t, ws);
                    return Err(io(e));
                }
            };
        let h = ExportHandle {
            uri: socket.display().to_string(),
            socket,
            req,
            front: Front::Vhost(served),
            vol,
        };
        let a = attached(ws, &h);
        self.lock_exports().insert(key(t, ws), h);
        Ok(a)
    }

    /// Stops a workspace's export for good (detach, delete, a replaced failed volume): no new
    /// connections; every open one finishes the requests it accepted (replies sent) and is
    /// closed; then the socket goes. Returns once it is done.
    pub(crate) async fn stop_export(&self, t: &str, ws: &str) {
        let h = self.lock_exports().remove(&key(t, ws));
        if let Some(h) = h {
            drain(h).await;
        }
        self.remove_vhost_record(t, ws);
    }

    /// Detaches: the export is drained and closed first, so the final cut covers every write a
    /// client was ever acknowledged. If the final publish fails, the export comes back.
    pub(crate) async fn detach_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
    ) -> Result<Option<Published>, ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let k = key(&t, &ws);
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            d.refuse_if_mounted(&t, &ws, "detaching it")?;
            let exported = d.lock_exports().get(&k).map(|h| h.req);
            d.stop_export(&t, &ws).await;
            if d.engine.volume(&t, &ws).is_none() && d.engine.has_local_state(&t, &ws) {
                // Not attached, but a process that stopped without detaching left its journal
                // here (a killed `strata ws attach`, a resume refused): attaching replays it
                // under the lease checks of any attach, and the detach below publishes it.
                d.engine.attach(&t, &ws).await?;
            }
            match d.engine.detach(&t, &ws).await {
                Ok(p) => Ok(p),
                Err(e) => {
                    if let (Some(req), Some(v)) = (exported, d.engine.volume(&t, &ws)) {
                        if let Err(xe) = d.export(&t, &ws, v, req) {
                            tracing::error!(tenant = t, workspace = ws, error = %xe.message, "re-exporting after a failed detach");
                        }
                    }
                    Err(e.into())
                }
            }
        })
        .await
    }

    /// Deletes a workspace; if it is attached here its export is drained and closed first.
    pub(crate) async fn delete_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
    ) -> Result<(), ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            let lock = d.op_lock(&key(&t, &ws));
            let _op = lock.lock().await;
            d.refuse_if_mounted(&t, &ws, "deleting it")?;
            d.stop_export(&t, &ws).await;
            Ok(d.engine.delete_workspace(&t, &ws).await?)
        })
        .await
    }

    /// Per vhost-user export: (tenant, workspace), requests taken, requests malformed.
    pub(crate) fn vhost_stats(&self) -> Vec<(Key, u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        self.lock_exports()
            .iter()
            .filter_map(|(k, h)| match &h.front {
                Front::Vhost(s) => Some((
                    k.clone(),
                    s.stats().requests.load(Relaxed),
                    s.stats().malformed.load(Relaxed),
                )),
                Front::Nbd { .. } => None,
            })
            .collect()
    }

    /// Drains and closes every export (orderly shutdown), returning the workspaces.
    pub(crate) async fn stop_all_exports(&self) -> Vec<Key> {
        let all: Vec<(Key, ExportHandle)> = self.lock_exports().drain().collect();
        let mut keys = vec![];
        for (k, h) in all {
            drain(h).await;
            keys.push(k);
        }
        keys
    }
}

async fn drain(h: ExportHandle) {
    match h.front {
        Front::Nbd { server, task } => {
            server.shutdown().await;
            let _ = task.await;
        }
        // Blocking (it joins the queue threads): off the runtime's workers. Bounded like an
        // NBD drain: a queue thread stuck in a device operation (a frozen volume, a hung
        // store) is left to end on its own. Nothing it had not answered was acknowledged, and
        // once the volume is sealed its operations are refused, never acknowledged.
        Front::Vhost(served) => {
            let stop = tokio::task::spawn_blocking(move || served.stop());
            if tokio::time::timeout(VHOST_DRAIN_TIMEOUT, stop)
                .await
                .is_err()
            {
                tracing::warn!(
                    socket = %h.socket.display(),
                    timeout = ?VHOST_DRAIN_TIMEOUT,
                    "vhost-user queue threads still busy at stop; going on without them"
                );
            }
            // The backend removes its own socket file (and only its own).
            return;
        }
    }
    let _ = std::fs::remove_file(&h.socket);
}

fn attached(ws: &str, h: &ExportHandle) -> Attached {
    Attached {
        workspace: ws.into(),
        export: h.uri.clone(),
        socket: h.socket.display().to_string(),
        protocol: h.req.protocol,
        read_only: h.req.read_only,
    }
}

/// A hash of (tenant, workspace): socket and record names, never the names themselves.
fn name_hash(tenant: &str, ws: &str) -> String {
    let mut h = blake3::Hasher::new();
    h.update(tenant.as_bytes());
    h.update(&[0]);
    h.update(ws.as_bytes());
    h.finalize().to_hex()[..32].to_string()
}

/// Runs `f` in a task of its own and waits for it: the operation completes (or fails) as a
/// whole even when the HTTP client that asked for it goes away.
pub(crate) async fn own_task<T: Send + 'static>(
    f: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    // The request's span goes with the work: what it logs names the request and its tenant.
    tokio::spawn(tracing::Instrument::in_current_span(f))
        .await
        .map_err(|e| ApiError::internal(format!("operation task failed: {e}")))?
}
