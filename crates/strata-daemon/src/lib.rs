//! `strata serve`: one node of strata as a long-running daemon.
//!
//! - HTTP API under `/v1` (JSON; OpenAPI at `/v1/openapi.json`, committed as `openapi.json`),
//!   Prometheus text at `/metrics`;
//! - tenancy: every request carries a bearer token, stored only as a BLAKE3 hash; another
//!   tenant's workspace is indistinguishable from a missing one (404);
//! - exports: an attached workspace is served on a unix socket, NBD at `RUN/{hash}.sock` or
//!   vhost-user-blk at `RUN/{hash}.vhost.sock` (the run directory, `DATA/run` by default, is
//!   0700; sockets 0600), see `exports.rs`;
//! - `/metrics` needs the admin token or the scrape token (it names every tenant's workspaces);
//! - templates come from content sent in the request or from the operator's import directory,
//!   never from a host path a tenant names (`template_api.rs`);
//! - restart: workspaces with local state on this node are re-attached at the same socket
//!   paths, unless their lease was lost (then they are not served).

mod api;
mod auth;
mod error;
mod exports;
mod metrics;
pub mod mount;
mod observe;
pub mod openapi;
pub use strata_relay as relay;
mod relay_api;
mod routes;
mod shares;
mod template_api;
mod tenants;
pub mod tls;
mod tokens;
mod workspace_api;

pub use api::*;
pub use auth::LocalCaller;
pub use error::classify;
pub use shares::ShareLimits;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use strata_engine::Engine;
use tokio::task::JoinHandle;

use exports::{ExportHandle, Key};

/// How a daemon is set up beyond its engine.
#[derive(Clone, Debug, Default)]
pub struct DaemonConfig {
    /// Manages tenants, runs GC, reads the nodes view and `/metrics`.
    pub admin_token: Option<String>,
    /// More admin tokens, one per line (or `blake3:HEX`), read again whenever the file
    /// changes: rotation without a restart.
    pub admin_token_file: Option<PathBuf>,
    /// May read `/metrics` and nothing else (a Prometheus scraper's token).
    pub metrics_token: Option<String>,
    /// Where export sockets live (default `DATA/run`): short enough for unix socket paths,
    /// and free to be off the data disk.
    pub run_dir: Option<PathBuf>,
    /// The operator's import directory: a tenant may build templates from what the operator
    /// put under `IMPORT/{tenant}/` (images or directories). Off when `None`.
    pub import_dir: Option<PathBuf>,
    /// Largest template upload, in bytes of the request body (default 16 GiB).
    pub template_max_bytes: Option<u64>,
    /// Where a tenant may have a mounted workspace bound (`ws mount --target`): targets must
    /// be directories under it. Off when `None`: mounts stay in the daemon's own directory.
    pub mount_root: Option<PathBuf>,
    /// Kernel NBD mounts: the kernel's per-request timeout (a request unanswered this long is
    /// retried on another connection or after a reconnect; default 60 s).
    pub nbd_timeout: Option<std::time::Duration>,
    /// Kernel NBD mounts: how long the kernel holds requests while every connection is dead
    /// (the daemon restarting) before failing them (default 10 min).
    pub nbd_dead_timeout: Option<std::time::Duration>,
    /// Answers one CLI process's requests and then stops (`strata` without a daemon): it
    /// serves no exports, so its run directory is not checked against socket path limits.
    pub in_process: bool,
    /// How long a request that does not move data (see `observe::unbounded`) may take before
    /// the client gets a retryable 503 (default 30 s; `None` in a config: the default).
    pub request_timeout: Option<std::time::Duration>,
    /// How long a request body may send nothing before the request fails (default 30 s;
    /// `None` in a config: the default).
    pub body_idle_timeout: Option<std::time::Duration>,
    /// What one tenant may hold of this node's shared resources (`shares.rs`).
    pub shares: ShareLimits,
    /// vhost-user: accept guest memory not sealed against shrinking (a VMM the operator
    /// trusts; see `strata_vhost::Features::unsealed_memory`).
    pub vhost_unsealed_memory: bool,
}

/// Default of [`DaemonConfig::body_idle_timeout`].
pub const BODY_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Default of [`DaemonConfig::request_timeout`].
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Template builds that may run at once on a node (each is disk- and CPU-heavy).
pub const TEMPLATE_BUILDS: usize = 2;

/// Default size limit of a template upload.
pub const TEMPLATE_MAX_BYTES: u64 = 16 << 30;

pub struct Daemon {
    pub(crate) engine: Arc<Engine>,
    pub(crate) nbd_metrics: Arc<strata_nbd::NbdMetrics>,
    /// `/metrics` (`metrics.rs`).
    pub(crate) metrics: metrics::Metrics,
    pub(crate) admin: tokens::AdminTokens,
    pub(crate) metrics_hash: Option<String>,
    pub(crate) run_dir: PathBuf,
    pub(crate) import_dir: Option<PathBuf>,
    pub(crate) mount_root: Option<PathBuf>,
    pub(crate) nbd_timeouts: (std::time::Duration, std::time::Duration),
    pub(crate) template_max_bytes: u64,
    /// Template builds (upload, unpack, mkfs, import) running at once on this node.
    pub(crate) builds: Arc<tokio::sync::Semaphore>,
    /// Live exports; locked only briefly (never across an await).
    pub(crate) exports: std::sync::Mutex<HashMap<Key, ExportHandle>>,
    /// Workspaces mounted on this host (`mount.rs`); locked only briefly.
    pub(crate) mounts: std::sync::Mutex<HashMap<Key, mount::Mounted>>,
    /// Set when the daemon stops: no new mounts, and no new exports.
    pub(crate) mounts_stopping: std::sync::atomic::AtomicBool,
    /// Mount operations (mount, umount, reattach, remount) running now: a stop waits for them
    /// (`mount::MountOp`), so none serves a volume after the stop has closed it.
    pub(crate) mount_ops: tokio::sync::watch::Sender<usize>,
    /// One gate per tenant: every request of the tenant holds it shared; a deletion of the
    /// tenant takes it exclusively (waiting for the requests admitted before its mark) and
    /// counts itself in it while it runs, so no request of the tenant runs beside it.
    pub(crate) tenant_gates: std::sync::Mutex<HashMap<String, Arc<tokio::sync::RwLock<u32>>>>,
    /// One lock per workspace: its attach, detach and delete never interleave.
    pub(crate) ops: std::sync::Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
    /// This node's API address, as reported to the `nodes` view.
    pub(crate) url: std::sync::Mutex<Option<String>>,
    /// The durable relay (`/v1/relay`).
    pub(crate) relay: Arc<relay::Relay>,
    pub(crate) gc: GcState,
    /// See [`DaemonConfig::request_timeout`] (`None`: no limit, in process).
    pub(crate) request_timeout: Option<std::time::Duration>,
    /// See [`DaemonConfig::body_idle_timeout`] (`None`: no limit, in process).
    pub(crate) body_idle_timeout: Option<std::time::Duration>,
    /// Each tenant's part of this node's shared resources.
    pub(crate) shares: Arc<shares::Shares>,
    /// See [`DaemonConfig::vhost_unsealed_memory`].
    pub(crate) vhost_unsealed_memory: bool,
}

/// Garbage collection: schedule and counters (exported on `/metrics`).
#[derive(Default)]
pub(crate) struct GcState {
    pub interval: std::sync::Mutex<Option<std::time::Duration>>,
    pub runs: std::sync::atomic::AtomicU64,
    pub failures: std::sync::atomic::AtomicU64,
    /// Tenants whose part of a pass failed, summed over passes (the pass went on without them).
    pub tenant_failures: std::sync::atomic::AtomicU64,
    pub deleted_keys: std::sync::atomic::AtomicU64,
    pub deleted_bytes: std::sync::atomic::AtomicU64,
    pub checkpoints_expired: std::sync::atomic::AtomicU64,
    pub last: std::sync::Mutex<Option<strata_engine::GcReport>>,
    /// The last pass that listed the store: its stored and live bytes.
    pub last_listed: std::sync::Mutex<Option<strata_engine::GcReport>>,
    /// One pass at a time on this node.
    pub lock: tokio::sync::Mutex<()>,
}

/// How often each node meters every tenant's live bytes (byte-seconds for billing).
pub const METER_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

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
    /// The tenant's gate (see [`Daemon::tenant_gates`]).
    pub(crate) fn tenant_gate(&self, tenant: &str) -> Arc<tokio::sync::RwLock<u32>> {
        self.tenant_gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.to_string())
            .or_default()
            .clone()
    }

    /// A daemon over `engine`; fails if the relay directory cannot be opened or the run
    /// directory is too long for socket paths.
    pub fn new(engine: Arc<Engine>, cfg: DaemonConfig) -> std::io::Result<Arc<Daemon>> {
        let run_dir = cfg
            .run_dir
            .clone()
            .unwrap_or_else(|| engine.config().data_dir.join("run"));
        if !cfg.in_process {
            exports::check_run_dir(&run_dir)?;
        }
        let hash = |t: &Option<String>| t.as_deref().filter(|t| !t.is_empty()).map(token_hash);
        let relay = Arc::new(relay::Relay::open(
            engine.config().data_dir.join("relay"),
            engine.reader().store().clone(),
            RELAY_MAX_BYTES,
        )?);
        let nbd_metrics = Arc::new(strata_nbd::NbdMetrics::default());
        let admin = tokens::AdminTokens::new(cfg.admin_token.as_deref(), cfg.admin_token_file)?;
        engine.set_tenant_write_rate(Some(cfg.shares.write_rate).filter(|r| *r > 0));
        Ok(Arc::new_cyclic(|me| Daemon {
            engine,
            metrics: metrics::Metrics::new(me.clone(), nbd_metrics.clone()),
            nbd_metrics,
            admin,
            metrics_hash: hash(&cfg.metrics_token),
            run_dir,
            import_dir: cfg.import_dir,
            // The operator's path, resolved once: tenants' targets are compared with it.
            mount_root: cfg
                .mount_root
                .map(|r| std::fs::canonicalize(&r).unwrap_or(r)),
            template_max_bytes: cfg.template_max_bytes.unwrap_or(TEMPLATE_MAX_BYTES),
            nbd_timeouts: (
                cfg.nbd_timeout.unwrap_or(mount::kernel::IO_TIMEOUT),
                cfg.nbd_dead_timeout
                    .unwrap_or(mount::kernel::DEAD_CONN_TIMEOUT),
            ),
            builds: Arc::new(tokio::sync::Semaphore::new(TEMPLATE_BUILDS)),
            exports: Default::default(),
            mounts: Default::default(),
            mounts_stopping: Default::default(),
            mount_ops: tokio::sync::watch::Sender::new(0),
            ops: Default::default(),
            tenant_gates: Default::default(),
            url: std::sync::Mutex::new(None),
            relay,
            gc: GcState::default(),
            // One CLI process waits for its own requests as long as they take.
            request_timeout: (!cfg.in_process)
                .then(|| cfg.request_timeout.unwrap_or(REQUEST_TIMEOUT)),
            body_idle_timeout: (!cfg.in_process)
                .then(|| cfg.body_idle_timeout.unwrap_or(BODY_IDLE_TIMEOUT)),
            shares: shares::Shares::new(cfg.shares),
            vhost_unsealed_memory: cfg.vhost_unsealed_memory,
        }))
    }

    /// Runs garbage collection every `every` (None: never) from `spawn_background` on.
    pub fn set_gc_interval(&self, every: Option<std::time::Duration>) {
        *self.gc.interval.lock().unwrap_or_else(|p| p.into_inner()) = every;
    }

    /// One GC pass with the engine's retention and grace settings; `reconcile` also lists the
    /// store (and sweeps relay keys of tenants' earlier incarnations).
    pub async fn run_gc(
        &self,
        dry_run: bool,
        reconcile: bool,
    ) -> strata_engine::Result<strata_engine::GcReport> {
        use std::sync::atomic::Ordering::Relaxed;
        let _one = self.gc.lock.lock().await;
        let cfg = self.engine.config();
        let r = self
            .engine
            .gc(&strata_engine::GcOptions::from_config(
                cfg, dry_run, reconcile,
            ))
            .await;
        match &r {
            Ok(rep) => {
                if !dry_run {
                    self.gc.runs.fetch_add(1, Relaxed);
                    self.gc
                        .tenant_failures
                        .fetch_add(rep.failed_tenants.len() as u64, Relaxed);
                    self.gc.deleted_keys.fetch_add(rep.deleted_keys, Relaxed);
                    self.gc.deleted_bytes.fetch_add(rep.deleted_bytes, Relaxed);
                    self.gc
                        .checkpoints_expired
                        .fetch_add(rep.checkpoints_expired, Relaxed);
                    *self.gc.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(rep.clone());
                    // A listing that skipped a failed tenant would under-count the gauges.
                    if rep.reconciled && rep.failed_tenants.is_empty() {
                        *self
                            .gc
                            .last_listed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner()) = Some(rep.clone());
                    }
                }
                tracing::info!(
                    dry_run,
                    reconcile,
                    deleted = rep.deleted_keys,
                    bytes = rep.deleted_bytes,
                    condemned = rep.condemned,
                    live_bytes = rep.live_bytes,
                    failed_tenants = rep.failed_tenants.len(),
                    ms = rep.duration_ms,
                    "gc pass"
                );
            }
            Err(e) => {
                self.gc.failures.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "gc pass failed; nothing more was deleted");
            }
        }
        if !dry_run && reconcile && r.is_ok() {
            self.sweep_relay_incarnations().await;
        }
        r
    }

    /// Deletes relay keys of tenants' earlier incarnations (`Relay::sweep_other_incarnations`):
    /// one listing per tenant. Failures are logged; the next pass tries again.
    async fn sweep_relay_incarnations(&self) {
        let cat = self.engine.catalog();
        let Ok(tenants) = cat.list_tenants().await else {
            return;
        };
        for t in tenants {
            let Ok(info) = cat.get_tenant(&t).await else {
                continue;
            };
            if info.deleting_ms.is_some() {
                continue;
            }
            if let Err(e) = self
                .relay
                .sweep_other_incarnations(&t, info.created_ms)
                .await
            {
                tracing::warn!(tenant = %t, error = %e, "sweeping relay keys of an earlier tenant failed");
            }
        }
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

    /// The relay routes alone, for a separate address that sandboxes reach (`--relay-listen`).
    pub fn relay_router(self: &Arc<Self>) -> axum::Router {
        routes::relay_router(self.clone())
    }

    /// Attaches a workspace and serves it over NBD (what `POST …/attach` does); returns the
    /// export address and socket.
    pub async fn attach(self: &Arc<Self>, tenant: &str, ws: &str) -> Result<Attached, String> {
        self.attach_and_export(tenant, ws, AttachRequest::default())
            .await
            .map_err(|e| e.message)
    }

    /// Re-attaches and re-exports every workspace this node has local state for (after a clean
    /// restart or a kill -9), unless its lease is now held by another node.
    pub async fn resume(self: &Arc<Self>) -> Vec<(String, String)> {
        // What an interrupted live fork left (links without local state) goes first.
        self.engine.sweep_unfinished_forks();
        // Mounted workspaces first: they are mounted again, not exported.
        let mut resumed = self.resume_mounts().await;
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
                if !w.path().join("state.json").exists()
                    || resumed.contains(&(tenant.clone(), ws.clone()))
                    || self.has_mount_record(&tenant, &ws)
                {
                    continue;
                }
                if self.engine.was_held(&tenant, &ws) {
                    // Attached only for a call (a GC compaction, a checkpoint of a detached
                    // workspace) when the node stopped: settled, not served.
                    if let Err(e) = self.engine.settle_held(&tenant, &ws).await {
                        tracing::warn!(tenant, workspace = ws, error = %e, "settling a workspace held for a call");
                    }
                    continue;
                }
                // Served as it was: over vhost-user where a record says so (the VMM reconnects).
                let req = self.resume_request(&tenant, &ws);
                match self.attach_and_export(&tenant, &ws, req).await {
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
            // The first pass lists the store (and sweeps staged files and relay incarnations),
            // then the first pass at least RECONCILE_AFTER since the last that did; the others
            // cost what changed.
            let mut reconciled: Option<std::time::Instant> = None;
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
                // A failed reconciliation waits for the next one's turn (logged and counted in
                // strata_gc_failures), so a failing tenant cannot make every pass list the store.
                let reconcile =
                    reconciled.is_none_or(|at| at.elapsed() >= strata_engine::RECONCILE_AFTER);
                if reconcile {
                    reconciled = Some(std::time::Instant::now());
                }
                let _ = d.run_gc(false, reconcile).await;
            }
        });
        let meter = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(METER_EVERY).await;
                let Some(d) = meter.upgrade() else { return };
                d.meter_all().await;
            }
        });
        // The relay's uploader stops with the daemon. Before each pass, files of tenants that
        // are gone or being deleted (perhaps by another node) are dropped, never uploaded.
        let up = Arc::downgrade(self);
        tokio::spawn(async move {
            for pass in 0u64.. {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                let Some(d) = up.upgrade() else { return };
                // Every pass: tenants with files to upload; every minute: all on this disk.
                d.forget_deleted_relay_tenants(pass % 240 == 0).await;
                if pass % 240 == 0 {
                    d.sweep_placements().await;
                }
                d.relay.upload_pending().await;
            }
        });
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
                let now = strata_format::now_ms();
                let expired = match d.engine.catalog().list_expired(now).await {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(error = %e, "listing expired workspaces failed");
                        continue;
                    }
                };
                for (t, w) in expired {
                    match d.delete_workspace(&t, &w).await {
                        Ok(()) => {
                            d.metrics.expired_deleted.inc();
                            tracing::info!(
                                tenant = t,
                                workspace = w,
                                "deleted ephemeral workspace at the end of its TTL"
                            );
                        }
                        // Held by another node: that node's daemon deletes it.
                        Err(e) => {
                            tracing::debug!(tenant = t, workspace = w, error = %e.message, "expired workspace not deleted here")
                        }
                    }
                }
            }
        })
    }

    /// Orderly stop: make every attached volume's acknowledged writes durable, stop exports,
    /// keep leases and local state so that a restart resumes at the same addresses.
    pub async fn shutdown(&self) {
        // Mounted filesystems are synced and unmounted (their records stay: the next start
        // mounts them again); connections finish what they accepted before the final flush.
        self.stop_all_mounts().await;
        self.stop_all_exports().await;
        for v in self.engine.attached() {
            if let Err(e) = v.flush().await {
                tracing::error!(tenant = v.tenant(), workspace = v.name(), error = %e, "flush at shutdown failed");
            }
        }
        self.engine.abandon().await;
    }
}
