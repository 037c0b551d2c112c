//! `strata serve`: one node of strata as a long-running daemon.
//!
//! - HTTP API under `/v1` (JSON; OpenAPI at `/v1/openapi.json`, committed as `openapi.json`),
//!   Prometheus text at `/metrics`;
//! - tenancy: every request carries a bearer token, stored only as a BLAKE3 hash; another
//!   tenant's workspace is indistinguishable from a missing one (404);
//! - NBD exports: an attached workspace is served on a unix socket under
//!   `DATA/run/{tenant}/{ws}.sock` (directories 0700, sockets 0600);
//! - restart: workspaces with local state on this node are re-attached at the same socket
//!   paths, unless their lease was lost (then they are not served).

mod api;
mod error;
pub mod relay;
mod relay_api;
mod routes;

pub use api::*;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use strata_engine::Engine;
use tokio::task::JoinHandle;

/// A running export of one workspace.
pub(crate) struct ExportHandle {
    pub uri: String,
    pub socket: PathBuf,
    pub task: JoinHandle<()>,
}

pub struct Daemon {
    pub(crate) engine: Arc<Engine>,
    pub(crate) nbd_metrics: Arc<strata_nbd::NbdMetrics>,
    pub(crate) checkpoint_seconds: strata_nbd::metrics::Histogram,
    pub(crate) fork_seconds: strata_nbd::metrics::Histogram,
    pub(crate) expired_deleted: std::sync::atomic::AtomicU64,
    pub(crate) admin_hash: Option<String>,
    pub(crate) run_dir: PathBuf,
    pub(crate) exports: tokio::sync::Mutex<HashMap<(String, String), ExportHandle>>,
    /// This node's API address, as reported to the `nodes` view.
    pub(crate) url: std::sync::Mutex<Option<String>>,
    /// The durable relay (`/v1/relay`).
    pub(crate) relay: Arc<relay::Relay>,
    pub(crate) gc: GcState,
}

/// Garbage collection: schedule and counters (exported on `/metrics`).
#[derive(Default)]
pub(crate) struct GcState {
    pub interval: std::sync::Mutex<Option<std::time::Duration>>,
    pub runs: std::sync::atomic::AtomicU64,
    pub failures: std::sync::atomic::AtomicU64,
    pub deleted_keys: std::sync::atomic::AtomicU64,
    pub deleted_bytes: std::sync::atomic::AtomicU64,
    pub checkpoints_expired: std::sync::atomic::AtomicU64,
    pub last: std::sync::Mutex<Option<strata_engine::GcReport>>,
    /// One pass at a time on this node.
    pub lock: tokio::sync::Mutex<()>,
}

/// Default size limit of one relayed file.
pub const RELAY_MAX_BYTES: u64 = 256 << 20;

/// How often a node reports itself to the catalog (the `nodes` view).
pub const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// Hash under which a token is stored.
pub fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

/// A new random API token.
pub fn new_token() -> String {
    use rand::Rng;
    let mut b = [0u8; 24];
    rand::rng().fill(&mut b);
    format!("st_{}", blake3::hash(&b).to_hex().as_str()[..40].to_owned())
}

impl Daemon {
    /// A daemon over `engine`; fails only if the relay directory cannot be opened.
    pub fn new(engine: Arc<Engine>, admin_token: Option<&str>) -> std::io::Result<Arc<Daemon>> {
        let run_dir = engine.config().data_dir.join("run");
        let relay = Arc::new(relay::Relay::open(
            engine.config().data_dir.join("relay"),
            engine.reader().store().clone(),
            RELAY_MAX_BYTES,
        )?);
        Ok(Arc::new(Daemon {
            engine,
            nbd_metrics: Arc::default(),
            checkpoint_seconds: Default::default(),
            fork_seconds: Default::default(),
            expired_deleted: Default::default(),
            admin_hash: admin_token.filter(|t| !t.is_empty()).map(token_hash),
            run_dir,
            exports: tokio::sync::Mutex::new(HashMap::new()),
            url: std::sync::Mutex::new(None),
            relay,
            gc: GcState::default(),
        }))
    }

    /// Runs garbage collection every `every` (None: never) from `spawn_background` on.
    pub fn set_gc_interval(&self, every: Option<std::time::Duration>) {
        *self.gc.interval.lock().unwrap_or_else(|p| p.into_inner()) = every;
    }

    /// One GC pass with the engine's retention and grace settings.
    pub async fn run_gc(&self, dry_run: bool) -> strata_engine::Result<strata_engine::GcReport> {
        use std::sync::atomic::Ordering::Relaxed;
        let _one = self.gc.lock.lock().await;
        let cfg = self.engine.config();
        let r = self
            .engine
            .gc(&strata_engine::GcOptions::from_config(cfg, dry_run))
            .await;
        match &r {
            Ok(rep) => {
                if !dry_run {
                    self.gc.runs.fetch_add(1, Relaxed);
                    self.gc.deleted_keys.fetch_add(rep.deleted_keys, Relaxed);
                    self.gc.deleted_bytes.fetch_add(rep.deleted_bytes, Relaxed);
                    self.gc
                        .checkpoints_expired
                        .fetch_add(rep.checkpoints_expired, Relaxed);
                    *self.gc.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(rep.clone());
                }
                tracing::info!(
                    dry_run,
                    deleted = rep.deleted_keys,
                    bytes = rep.deleted_bytes,
                    condemned = rep.condemned,
                    live_bytes = rep.live_bytes,
                    ms = rep.duration_ms,
                    "gc pass"
                );
            }
            Err(e) => {
                self.gc.failures.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "gc pass failed; nothing more was deleted");
            }
        }
        r
    }

    /// Sets the size limit of one relayed file.
    pub fn set_relay_max_bytes(&self, n: u64) {
        self.relay
            .max_bytes
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records the address this node's API listens on (reported in the `nodes` view).
    pub fn set_url(&self, url: &str) {
        *self.url.lock().unwrap_or_else(|p| p.into_inner()) = Some(url.to_string());
    }

    /// This node's report: what it serves, with each workspace's remote window.
    pub async fn node_status(&self) -> strata_catalog::NodeStatus {
        let mut attached: Vec<_> = self
            .engine
            .attached()
            .iter()
            .map(|v| {
                let s = v.stats();
                strata_catalog::AttachedStatus {
                    tenant: v.tenant().to_string(),
                    workspace: v.name().to_string(),
                    mode: v.mode(),
                    epoch: s.lease_epoch,
                    head_version: s.head_version,
                    remote_window_bytes: s.window_bytes,
                    remote_window_age_ms: s.window_age_ms,
                }
            })
            .collect();
        attached.sort_by(|a, b| (&a.tenant, &a.workspace).cmp(&(&b.tenant, &b.workspace)));
        strata_catalog::NodeStatus {
            node: self.node_id().to_string(),
            url: self.url.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            seen_ms: 0,
            seen_ago_ms: 0,
            attached,
        }
    }

    pub fn node_id(&self) -> &str {
        self.engine.node_id()
    }

    pub fn router(self: &Arc<Self>) -> axum::Router {
        routes::router(self.clone())
    }

    /// Attaches a workspace and serves it over NBD (what `POST …/attach` does); returns the
    /// export address and socket.
    pub async fn attach(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Attached, String> {
        routes::attach_and_export(self, tenant, ws)
            .await
            .map_err(|e| e.message)
    }

    /// Re-attaches and re-exports every workspace this node has local state for (after a clean
    /// restart or a kill -9), unless its lease is now held by another node.
    pub async fn resume(self: &Arc<Self>) -> Vec<(String, String)> {
        let mut resumed = vec![];
        let root = self.engine.config().data_dir.join("volumes");
        let Ok(tenants) = std::fs::read_dir(&root) else {
            return resumed;
        };
        for t in tenants.flatten() {
            let tenant = t.file_name().to_string_lossy().into_owned();
            let Ok(wss) = std::fs::read_dir(t.path()) else {
                continue;
            };
            for w in wss.flatten() {
                let ws = w.file_name().to_string_lossy().into_owned();
                if !w.path().join("state.json").exists() {
                    continue;
                }
                match routes::attach_and_export(self, &tenant, &ws).await {
                    Ok(_) => resumed.push((tenant.clone(), ws)),
                    Err(e) => {
                        tracing::warn!(tenant, workspace = ws, error = %e.message, "not resuming workspace")
                    }
                }
            }
        }
        resumed
    }

    /// Background work: deletes ephemeral workspaces whose TTL ran out (on purpose: that is
    /// what a TTL means), when this node holds them or nobody does.
    pub fn spawn_background(self: &Arc<Self>) -> JoinHandle<()> {
        let d = Arc::downgrade(self);
        let beat = Arc::downgrade(self);
        let gc = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let every = {
                    let Some(d) = gc.upgrade() else { return };
                    let e = *d.gc.interval.lock().unwrap_or_else(|p| p.into_inner());
                    e
                };
                let Some(every) = every else {
                    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                    continue;
                };
                tokio::time::sleep(every).await;
                let Some(d) = gc.upgrade() else { return };
                let _ = d.run_gc(false).await;
            }
        });
        // The relay's uploader stops with the relay (the daemon holds the only strong ref).
        drop(
            self.relay
                .spawn_uploader(std::time::Duration::from_millis(250)),
        );
        tokio::spawn(async move {
            loop {
                let Some(d) = beat.upgrade() else { return };
                let st = d.node_status().await;
                if let Err(e) = d.engine.catalog().report_node(&st).await {
                    tracing::warn!(error = %e, "node heartbeat failed");
                }
                drop(d);
                tokio::time::sleep(HEARTBEAT).await;
            }
        });
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                let Some(d) = d.upgrade() else { return };
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|t| t.as_millis() as u64)
                    .unwrap_or(0);
                let expired = match d.engine.catalog().list_expired(now).await {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(error = %e, "listing expired workspaces failed");
                        continue;
                    }
                };
                for (t, w) in expired {
                    let attached_here = d.engine.volume(&t, &w).is_some();
                    if attached_here {
                        routes::stop_export(&d, &t, &w).await;
                    }
                    match d.engine.delete_workspace(&t, &w).await {
                        Ok(()) => {
                            d.expired_deleted
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tracing::info!(
                                tenant = t,
                                workspace = w,
                                "deleted ephemeral workspace at the end of its TTL"
                            );
                        }
                        // Held by another node: that node's daemon deletes it.
                        Err(e) => {
                            tracing::debug!(tenant = t, workspace = w, error = %e, "expired workspace not deleted here")
                        }
                    }
                }
            }
        })
    }

    /// Orderly stop: make every attached volume's acknowledged writes durable, stop exports,
    /// keep leases and local state so that a restart resumes at the same addresses.
    pub async fn shutdown(&self) {
        let mut ex = self.exports.lock().await;
        for ((t, w), h) in ex.drain() {
            h.task.abort();
            if let Some(v) = self.engine.volume(&t, &w) {
                if let Err(e) = v.flush().await {
                    tracing::error!(tenant = t, workspace = w, error = %e, "flush at shutdown failed");
                }
            }
            let _ = std::fs::remove_file(&h.socket);
        }
        self.engine.abandon().await;
    }
}
