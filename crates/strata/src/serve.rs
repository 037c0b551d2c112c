//! `strata serve` (the daemon) and `strata ws attach` (one workspace over NBD, foreground).

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::units::{Dur, Every, Size};
use std::sync::Arc;

use strata_engine::Engine;
use strata_nbd::{Export, Exports, Server, ServerConfig};

use crate::Global;

/// Which front-end a foreground attach serves.
pub struct Front {
    pub vhost_user: bool,
    pub read_only: bool,
    pub queues: Option<u16>,
}

pub async fn attach(
    e: &Arc<Engine>,
    g: &Global,
    ws: &str,
    socket: Option<PathBuf>,
    tcp: Option<SocketAddr>,
    front: Front,
) -> anyhow::Result<()> {
    let t = g.tenant.as_str();
    if let Some(q) = front.queues {
        let max = strata_vhost::MAX_QUEUES;
        anyhow::ensure!((1..=max).contains(&q), "--queues must be 1..={max}");
    }
    let vol = e.attach(t, ws).await?;
    let socket = match socket {
        Some(s) => s,
        None => {
            let run = g.data.join("run");
            std::fs::create_dir_all(&run)?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700))?;
            let ext = if front.vhost_user {
                "vhost.sock"
            } else {
                "sock"
            };
            run.join(format!("{ws}.{ext}"))
        }
    };
    let device: Arc<dyn strata_nbd::BlockDevice> = if front.read_only {
        Arc::new(strata_nbd::ReadOnly(vol.clone()))
    } else {
        vol.clone()
    };
    if front.vhost_user {
        let features = strata_vhost::Features::new(
            front.read_only,
            vol.mode() != strata_catalog::Mode::Ephemeral,
            front.queues,
            format!("strata-{ws}"),
        );
        let served =
            strata_vhost::serve(&socket, device, features, tokio::runtime::Handle::current())?;
        if g.json {
            println!(
                "{}",
                serde_json::json!({"workspace": ws, "protocol": "vhost-user", "socket": socket, "mode": vol.mode()})
            );
        } else {
            println!("{}", socket.display());
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        wait_for_signal().await?;
        eprint_stopping(g, ws);
        stoppable(tokio::task::spawn_blocking(move || served.stop()), ws, &vol).await?;
        return finish(e, g, &vol, ws).await;
    }
    let exports = Exports::new();
    exports.insert(
        ws,
        Export {
            device,
            description: format!("strata workspace {ws} ({})", vol.mode()),
            multi_conn: true,
        },
    );
    let server = Server::new(exports, ServerConfig::default());
    let unix = Server::bind_unix(&socket)?;
    let mut addrs = vec![format!("nbd+unix:///{ws}?socket={}", socket.display())];
    let tcp_task = match tcp {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "serving NBD beyond loopback: anyone who can reach it can read and write this disk");
            }
            let l = tokio::net::TcpListener::bind(addr).await?;
            addrs.push(format!("nbd://{}/{ws}", l.local_addr()?));
            Some(tokio::spawn(server.clone().serve_tcp(l)))
        }
        None => None,
    };
    let unix_task = tokio::spawn(server.clone().serve_unix(unix));
    if g.json {
        println!(
            "{}",
            serde_json::json!({"workspace": ws, "exports": addrs, "mode": vol.mode()})
        );
    } else {
        for a in &addrs {
            println!("{a}");
        }
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    wait_for_signal().await?;
    // Clients finish what they sent, then their connections close; then the final publish.
    eprint_stopping(g, ws);
    let drained = async {
        server.shutdown().await;
        let _ = unix_task.await;
        if let Some(t) = tcp_task {
            let _ = t.await;
        }
    };
    stoppable(drained, ws, &vol).await;
    let _ = std::fs::remove_file(&socket);
    finish(e, g, &vol, ws).await
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

fn eprint_stopping(g: &Global, ws: &str) {
    if !g.json {
        eprintln!("detaching {ws}: connections end, then the final publish (signal again to stop and keep the local journal)");
    }
}

/// Runs a step of a foreground attach's end; a second signal meanwhile exits at once. The
/// steps can take long (a large upload) or not end at all (an unreachable store retried, a
/// client that never finishes). Everything flushed is in the journal, which the next attach
/// on this node replays (the lease is left to expire, not released). Out at once: the final
/// publish holds the workspace (an orderly shutdown would wait for it), and a thread blocked
/// in the store must not hold the exit either.
async fn stoppable<T>(
    step: impl std::future::Future<Output = T>,
    ws: &str,
    vol: &strata_engine::Volume,
) -> T {
    tokio::select! {
        r = step => r,
        _ = wait_for_signal() => {
            eprintln!(
                "strata: detaching {ws} stopped before its final publish completed: every flushed write is in the local journal under {}; attaching {ws} again on this node replays and publishes it",
                vol.dir().display()
            );
            std::process::exit(1);
        }
    }
}

/// The end of a foreground attach, once nothing serves the volume: flush, final publish.
async fn finish(
    e: &Arc<Engine>,
    g: &Global,
    vol: &Arc<strata_engine::Volume>,
    ws: &str,
) -> anyhow::Result<()> {
    stoppable(vol.flush(), ws, vol).await?;
    let p = stoppable(e.detach(&g.tenant, ws), ws, vol).await?;
    if !g.json {
        eprintln!(
            "detached {ws}{}",
            p.map(|p| format!(": head v{}", p.version))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// `strata serve`: `--config FILE` and the settings.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// TOML config file: any setting below by its flag's name with `_` for `-` (sizes and
    /// durations as strings or integers of bytes and seconds), plus the secrets that have no
    /// flag: admin_token, metrics_token, s3_access_key_id, s3_secret_access_key,
    /// s3_session_token. Unknown keys are refused.
    #[arg(long, env = "STRATA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    set: Settings,
}

/// The daemon's settings, declared once: each is a flag, a `STRATA_*` variable and a key of the
/// `--config` file, parsed by the same type whichever it came from. Precedence: defaults <
/// TOML file < environment < flags ([`Settings::over`]).
#[derive(clap::Args, serde::Deserialize, serde::Serialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// HTTP listen address.
    #[arg(long, env = "STRATA_LISTEN")]
    listen: Option<String>,
    /// Also serve the relay routes (and only them) on this address: the one sandboxes reach,
    /// apart from the admin API. Same TLS as `listen`.
    #[arg(long, env = "STRATA_RELAY_LISTEN")]
    relay_listen: Option<String>,
    /// Serve HTTPS: the certificate chain (PEM), re-read when the file changes (replace it by
    /// rename, the key too). Needs `tls_key`.
    #[arg(long, env = "STRATA_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "STRATA_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Catalog: sqlite:PATH (default DATA/catalog.db) or postgres://user@host:port/db (shared
    /// by several nodes).
    #[arg(long, env = "STRATA_CATALOG")]
    catalog: Option<String>,
    /// Most connections this node opens to a PostgreSQL catalog.
    #[arg(long, env = "STRATA_CATALOG_POOL")]
    catalog_pool: Option<usize>,
    /// This node's name in leases and the nodes view (default: DATA/node-id, created once).
    #[arg(long, env = "STRATA_NODE_ID")]
    node_id: Option<String>,
    /// Object store: file:DIR (default DATA/objects) or s3://bucket/prefix?endpoint=….
    #[arg(long, env = "STRATA_STORE")]
    store: Option<String>,
    #[arg(long, env = "STRATA_UPLOAD_INTERVAL")]
    upload_interval: Option<Dur>,
    #[arg(long, env = "STRATA_UPLOAD_MAX_BYTES")]
    upload_max_bytes: Option<Size>,
    #[arg(long, env = "STRATA_LEASE_TTL")]
    lease_ttl: Option<Dur>,
    #[arg(long, env = "STRATA_CACHE_CAPACITY")]
    cache_capacity: Option<Size>,
    /// How often garbage collection runs (default 1h; "off" disables).
    #[arg(long, env = "STRATA_GC_INTERVAL")]
    gc_interval: Option<Every>,
    /// GC grace period: unreferenced data is deleted only after this long (default 1h; every
    /// node sharing a store must use the same or a larger value).
    #[arg(long, env = "STRATA_GC_GRACE")]
    gc_grace: Option<Dur>,
    /// Units (256 KiB) fetched ahead of a sequential cold reader of an object (default 8; 0: off).
    #[arg(long, env = "STRATA_READAHEAD_UNITS")]
    readahead_units: Option<u64>,
    /// Retention: unlabelled versions users made (checkpoints, rollbacks, forks, resizes)
    /// kept per workspace besides the head (default 16) …
    #[arg(long, env = "STRATA_KEEP_CHECKPOINTS")]
    keep_checkpoints: Option<usize>,
    /// … automatic versions (background and sync-mode publishes, detaches, compactions) kept
    /// per workspace besides the head (default 0: each pins the data written over since, so
    /// history costs disk only when asked for) …
    #[arg(long, env = "STRATA_KEEP_AUTO")]
    keep_auto: Option<usize>,
    /// … and for how long at most (default 7d).
    #[arg(long, env = "STRATA_KEEP_CHECKPOINT_AGE")]
    keep_checkpoint_age: Option<Dur>,
    /// Journal segment size per volume (default 64MiB); each attached volume keeps up to two
    /// spare segments ready, so local spare space is about 2x this per workspace (1MiB to
    /// 64GiB).
    #[arg(long, env = "STRATA_SEGMENT_SIZE")]
    segment_size: Option<Size>,
    /// GC compacts attached workspaces whose objects are less live than this (default 0.5).
    #[arg(long, env = "STRATA_COMPACT_BELOW")]
    compact_below: Option<f64>,
    /// Largest file one relay PUT may store (default 256MiB).
    #[arg(long, env = "STRATA_RELAY_MAX_BYTES")]
    relay_max_bytes: Option<Size>,
    /// Where export sockets live (default DATA/run): short enough for unix socket paths
    /// (about 70 bytes at most), and free to be off the data disk.
    #[arg(long, env = "STRATA_RUN_DIR")]
    run_dir: Option<PathBuf>,
    /// Operator import directory: a tenant may build templates from what is under
    /// IMPORT/TENANT/ (off by default; tenants otherwise upload the content).
    #[arg(long, env = "STRATA_IMPORT_DIR")]
    import_dir: Option<PathBuf>,
    /// Turns mounts on (`ws mount`; the host kernel then parses filesystems tenants wrote):
    /// tenant T's mounts may be bound onto empty directories under ROOT/T/. Off by default.
    #[arg(long, env = "STRATA_MOUNT_ROOT")]
    mount_root: Option<PathBuf>,
    /// Kernel NBD mounts: a request unanswered this long is retried on another connection
    /// (or after a reconnect), never failed (default 60s).
    #[arg(long, env = "STRATA_NBD_TIMEOUT")]
    nbd_timeout: Option<Dur>,
    /// Kernel NBD mounts: how long the kernel holds a mounted filesystem's requests while the
    /// daemon is down (a restart) before failing them with EIO (default 10m).
    #[arg(long, env = "STRATA_NBD_DEAD_TIMEOUT")]
    nbd_dead_timeout: Option<Dur>,
    /// Guest writes get ENOSPC while the data disk has less than this free, so the node's own
    /// metadata (catalog, leases, local state) always has room (default 64MiB; 0: no floor).
    #[arg(long, env = "STRATA_MIN_FREE")]
    min_free: Option<Size>,
    /// Largest template upload (default 16GiB).
    #[arg(long, env = "STRATA_TEMPLATE_MAX_BYTES")]
    template_max_bytes: Option<Size>,
    /// Requests that only touch the catalog (views, lists, creates, tokens) answer within this
    /// or get a retryable 503 (default 30s). Attach, detach, checkpoint, fork, rollback,
    /// resize, mounts, deletes, template and relay transfers, relay listings and GC are not
    /// limited.
    #[arg(long, env = "STRATA_REQUEST_TIMEOUT")]
    request_timeout: Option<Dur>,
    /// A request whose body sends nothing this long fails (408): an idle upload holds nothing
    /// of its tenant's, nor the tenant's deletion, for longer (default 30s).
    #[arg(long, env = "STRATA_BODY_IDLE_TIMEOUT")]
    body_idle_timeout: Option<Dur>,
    /// What one tenant may hold on this node at once (past it: 429, retryable) … template
    /// uploads being received or built (default 2) …
    #[arg(long, env = "STRATA_TENANT_TEMPLATE_UPLOADS")]
    tenant_template_uploads: Option<u64>,
    /// … bytes of relay files spooled for GETs still being sent (default 256MiB) …
    #[arg(long, env = "STRATA_TENANT_RELAY_SPOOL")]
    tenant_relay_spool: Option<Size>,
    /// … mounts (default 32; the node holds 128 at most) …
    #[arg(long, env = "STRATA_TENANT_MOUNTS")]
    tenant_mounts: Option<u64>,
    /// … requests in the daemon (default 256) …
    #[arg(long, env = "STRATA_TENANT_REQUESTS")]
    tenant_requests: Option<u64>,
    /// … workspaces attached, unless its `attached_per_node` quota says otherwise (default 64) …
    #[arg(long, env = "STRATA_TENANT_ATTACHED")]
    tenant_attached: Option<u64>,
    /// … NBD connections per attached workspace (default 16; past it a connection is closed) …
    #[arg(long, env = "STRATA_TENANT_NBD_CONNECTIONS")]
    tenant_nbd_connections: Option<u64>,
    /// … bytes of NBD requests in flight over all its workspaces (default 256MiB, at least
    /// 32MiB) …
    #[arg(long, env = "STRATA_TENANT_INFLIGHT")]
    tenant_inflight: Option<Size>,
    /// … and bytes a second it may write into the node: guest writes on every front-end, relay
    /// files, template uploads (default unlimited; e.g. 64MiB).
    #[arg(long, env = "STRATA_TENANT_WRITE_RATE")]
    tenant_write_rate: Option<Size>,
    /// … and requests that change something (attaches, detaches, checkpoints, forks, relay
    /// files…) a second, beyond a second's burst (default unlimited; past 5 s of wait: 429).
    #[arg(long, env = "STRATA_TENANT_OPS_RATE")]
    tenant_ops_rate: Option<u64>,
    /// vhost-user: serve guest memory that is not sealed against shrinking. A VMM that then
    /// truncates its memory crashes the daemon with every tenant's exports: only for VMMs the
    /// operator trusts (QEMU's memory-backend-memfd seals by default).
    #[arg(long, env = "STRATA_VHOST_UNSEALED_MEMORY", num_args = 0..=1, default_missing_value = "true")]
    vhost_unsealed_memory: Option<bool>,
    /// Secrets have no flag (argv is visible to every user of the host): the file, or
    /// `STRATA_ADMIN_TOKEN`.
    #[arg(skip)]
    admin_token: Option<String>,
    /// More admin tokens, one per line (or `blake3:HEX`), re-read whenever the file changes:
    /// add the new token, move clients over, remove the old one, with no restart.
    #[arg(long, env = "STRATA_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// May read /metrics only: the file, or `STRATA_METRICS_TOKEN`.
    #[arg(skip)]
    metrics_token: Option<String>,
    /// S3 credentials: the file, or the `AWS_*` environment.
    #[arg(skip)]
    s3_access_key_id: Option<String>,
    #[arg(skip)]
    s3_secret_access_key: Option<String>,
    #[arg(skip)]
    s3_session_token: Option<String>,
    /// Named stores tenants can be placed in (`tenant create --store NAME`), config file only:
    /// `[stores.NAME]` with `url` and the store's own `s3_access_key_id`,
    /// `s3_secret_access_key`, `s3_session_token` (or `STRATA_STORE_NAME_S3_ACCESS_KEY_ID` …
    /// in the environment, NAME upper-cased with `-` as `_`). Every node needs the same names.
    #[arg(skip)]
    stores: Option<std::collections::BTreeMap<String, NamedStore>>,
    /// The master key (64 hex digits, mode 600) that wraps encrypted tenants' data keys
    /// (`tenant create --encrypted`); every node serving them needs the same one.
    #[arg(long, env = "STRATA_MASTER_KEY_FILE")]
    master_key_file: Option<PathBuf>,
}

/// A store a tenant can be placed in: its own bucket, with its own credentials.
#[derive(serde::Deserialize, serde::Serialize, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct NamedStore {
    url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    s3_access_key_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    s3_secret_access_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    s3_session_token: Option<String>,
}

impl NamedStore {
    fn open(&self, name: &str) -> anyhow::Result<strata_store::Store> {
        let var = |k: &str| {
            let v = format!(
                "STRATA_STORE_{}_{k}",
                name.to_uppercase().replace(['-', '.'], "_")
            );
            std::env::var(v).ok().filter(|v| !v.is_empty())
        };
        let creds = strata_store::Credentials {
            access_key_id: var("S3_ACCESS_KEY_ID").or_else(|| self.s3_access_key_id.clone()),
            secret_access_key: var("S3_SECRET_ACCESS_KEY")
                .or_else(|| self.s3_secret_access_key.clone()),
            session_token: var("S3_SESSION_TOKEN").or_else(|| self.s3_session_token.clone()),
        };
        Ok(strata_store::Store::open_with(&self.url, &creds)?)
    }
}

impl Settings {
    /// These settings (flags and environment) over `file`'s: what one leaves unset, the
    /// other's.
    fn over(self, file: Settings) -> anyhow::Result<Settings> {
        // Checked before the merge: JSON has no NaN (it would read as unset).
        for t in [self.compact_below, file.compact_below]
            .into_iter()
            .flatten()
        {
            anyhow::ensure!(
                (0.0..=1.0).contains(&t),
                "compact_below must be between 0 and 1"
            );
        }
        let mut merged = serde_json::to_value(file)?;
        if let (Some(m), serde_json::Value::Object(mine)) =
            (merged.as_object_mut(), serde_json::to_value(self)?)
        {
            m.extend(mine.into_iter().filter(|(_, v)| !v.is_null()));
        }
        Ok(serde_json::from_value(merged)?)
    }

    /// Reads `--config`, refusing unknown keys and bad values (with the key named).
    fn file(path: &std::path::Path) -> anyhow::Result<Settings> {
        use anyhow::Context;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

pub async fn serve(g: &Global, a: ServeArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let file = match &a.config {
        Some(p) => Settings::file(p)?,
        None => Settings::default(),
    };
    let mut s = a.set.over(file)?;
    if let Ok(t) = std::env::var("STRATA_ADMIN_TOKEN") {
        s.admin_token = Some(t);
    }
    if let Ok(t) = std::env::var("STRATA_METRICS_TOKEN") {
        s.metrics_token = Some(t);
    }
    let nonzero = |what: &str, v: Option<Size>| -> anyhow::Result<Option<u64>> {
        match v {
            Some(Size(0)) => anyhow::bail!("{what} must not be 0"),
            v => Ok(v.map(|v| v.0)),
        }
    };
    let mut cfg = crate::engine_config(&g.data);
    if let Some(Dur(d)) = s.upload_interval {
        cfg.upload_interval = d;
    }
    if let Some(n) = nonzero("--upload-max-bytes", s.upload_max_bytes)? {
        cfg.upload_max_bytes = n;
    }
    if let Some(Dur(d)) = s.lease_ttl {
        cfg.lease_ttl = d;
    }
    if let Some(n) = nonzero("--cache-capacity", s.cache_capacity)? {
        cfg.cache_capacity = n;
    }
    cfg.node_id = s.node_id.clone();
    if let Some(Dur(d)) = s.gc_grace {
        cfg.gc_grace = d;
    }
    if let Some(n) = s.readahead_units {
        cfg.readahead_units = n;
    }
    if let Some(n) = s.keep_checkpoints {
        cfg.keep_checkpoints = n;
    }
    if let Some(n) = s.keep_auto {
        cfg.keep_auto_versions = n;
    }
    if let Some(Dur(d)) = s.keep_checkpoint_age {
        cfg.keep_checkpoint_age = d;
    }
    if let Some(Size(n)) = s.min_free {
        cfg.min_free_bytes = n;
    }
    if let Some(Size(n)) = s.segment_size {
        anyhow::ensure!(
            (1 << 20..=strata_engine::MAX_SEGMENT_BYTES).contains(&n),
            "--segment-size must be between 1MiB and 64GiB"
        );
        cfg.segment_max_bytes = n;
    }
    if let Some(t) = s.compact_below {
        anyhow::ensure!(
            (0.0..=1.0).contains(&t),
            "--compact-below must be between 0 and 1"
        );
        cfg.compact_below = t;
    }
    let gc_interval = match s.gc_interval {
        None => Some(std::time::Duration::from_secs(3600)),
        Some(Every(e)) => e,
    };
    let listen = s.listen.clone().unwrap_or_else(|| "127.0.0.1:7420".into());
    let admin = s.admin_token.clone();
    let catalog_url = s
        .catalog
        .clone()
        .unwrap_or_else(|| format!("sqlite:{}", g.data.join("catalog.db").display()));
    let store_url = s
        .store
        .clone()
        .unwrap_or_else(|| format!("file:{}", g.data.join("objects").display()));
    let pool = s.catalog_pool.unwrap_or(16);
    let catalog = strata_catalog::open_url(&catalog_url, pool)
        .await
        .with_context(|| format!("opening catalog {}", redact(&catalog_url)))?;
    let store = strata_store::Store::open_with(
        &store_url,
        &strata_store::Credentials {
            access_key_id: s.s3_access_key_id.clone(),
            secret_access_key: s.s3_secret_access_key.clone(),
            session_token: s.s3_session_token.clone(),
        },
    )?;
    let mut named = vec![];
    let mut env_names = std::collections::BTreeMap::new();
    for name in s.stores.clone().unwrap_or_default().keys() {
        let var = name.to_uppercase().replace(['-', '.'], "_");
        if let Some(other) = env_names.insert(var.clone(), name.clone()) {
            anyhow::bail!(
                "stores {other:?} and {name:?} would both read STRATA_STORE_{var}_*: rename one"
            );
        }
    }
    for (name, ns) in s.stores.clone().unwrap_or_default() {
        let st = ns
            .open(&name)
            .with_context(|| format!("opening store {name:?}"))?;
        named.push((name, st));
    }
    let master = match &s.master_key_file {
        Some(p) => Some(
            strata_store::MasterKey::from_file(p)
                .with_context(|| format!("reading the master key {}", p.display()))?,
        ),
        None => None,
    };
    if let Some(m) = &master {
        tracing::info!(master_key = m.id(), "encrypted tenants can be served");
    }
    let store = store.with_named(named, master)?;
    let mut owner = crate::datadir::DataDirLock::daemon(&g.data)?;
    let engine = Engine::open_with(cfg, catalog, store, Arc::new(strata_engine::fs::RealFs))?;
    if admin.is_none() && s.admin_token_file.is_none() {
        tracing::warn!("no admin token (STRATA_ADMIN_TOKEN or admin_token in the config): tenants cannot be created over the API");
    }
    let metrics_token = s.metrics_token.clone();
    let daemon = strata_daemon::Daemon::new(
        engine,
        strata_daemon::DaemonConfig {
            admin_token: admin.clone(),
            admin_token_file: s.admin_token_file.clone(),
            metrics_token,
            run_dir: s.run_dir.clone(),
            import_dir: s.import_dir.clone(),
            mount_root: s.mount_root.clone(),
            nbd_timeout: s.nbd_timeout.map(|d| d.0),
            nbd_dead_timeout: s.nbd_dead_timeout.map(|d| d.0),
            template_max_bytes: nonzero("--template-max-bytes", s.template_max_bytes)?,
            in_process: false,
            request_timeout: s.request_timeout.map(|d| d.0),
            body_idle_timeout: s.body_idle_timeout.map(|d| d.0),
            shares: {
                let d = strata_daemon::ShareLimits::default();
                strata_daemon::ShareLimits {
                    template_uploads: s.tenant_template_uploads.unwrap_or(d.template_uploads),
                    relay_spool_bytes: s.tenant_relay_spool.map_or(d.relay_spool_bytes, |n| n.0),
                    mounts: s.tenant_mounts.unwrap_or(d.mounts),
                    requests: s.tenant_requests.unwrap_or(d.requests),
                    nbd_connections: s.tenant_nbd_connections.unwrap_or(d.nbd_connections),
                    attached: s.tenant_attached.unwrap_or(d.attached),
                    inflight_bytes: s.tenant_inflight.map_or(d.inflight_bytes, |n| n.0),
                    write_rate: s.tenant_write_rate.map_or(d.write_rate, |n| n.0),
                    ops_rate: s.tenant_ops_rate.unwrap_or(d.ops_rate),
                }
            },
            vhost_unsealed_memory: s.vhost_unsealed_memory.unwrap_or(false),
        },
    )
    .context("starting the daemon")?;
    if let Some(n) = nonzero("--relay-max-bytes", s.relay_max_bytes)? {
        daemon.set_relay_max_bytes(n);
    }
    daemon.set_gc_interval(gc_interval);
    let tls = match (&s.tls_cert, &s.tls_key) {
        (Some(c), Some(k)) => Some(
            strata_daemon::tls::ReloadingCert::open(c, k)
                .and_then(|r| r.server_config())
                .map_err(|e| anyhow::anyhow!("TLS: {e}"))?,
        ),
        (None, None) => None,
        _ => anyhow::bail!("tls_cert and tls_key go together"),
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let resumed = daemon.resume().await;
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let relay_listener = match &s.relay_listen {
        Some(r) => Some(
            tokio::net::TcpListener::bind(r)
                .await
                .with_context(|| format!("binding {r}"))?,
        ),
        None => None,
    };
    let relay_addr = relay_listener
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?;
    daemon.set_url(&format!("{scheme}://{addr}"));
    owner.say(&format!("pid {}, {scheme}://{addr}", std::process::id()))?;
    let _background = daemon.spawn_background();
    if g.json {
        println!(
            "{}",
            serde_json::json!({"listening": addr.to_string(), "url": format!("{scheme}://{addr}"),
                "relay_listening": relay_addr.map(|a| a.to_string()),
                "node": daemon_node(&daemon), "resumed": resumed})
        );
    } else {
        println!(
            "strata listening on {scheme}://{addr} (node {}, {} workspace(s) resumed)",
            daemon_node(&daemon),
            resumed.len()
        );
        if let Some(r) = relay_addr {
            println!("relay listening on {scheme}://{r}");
        }
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => return,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        let _ = stop_tx.send(true);
    });
    let mut servers = tokio::task::JoinSet::new();
    for (l, router) in std::iter::once((listener, daemon.router()))
        .chain(relay_listener.map(|l| (l, daemon.relay_router())))
    {
        let mut stop = stop_rx.clone();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        match &tls {
            Some(cfg) => {
                let l = strata_daemon::tls::TlsListener::new(l, cfg.clone())?;
                servers.spawn(async move {
                    axum::serve(l, router).with_graceful_shutdown(stopped).await
                });
            }
            None => {
                servers.spawn(async move {
                    axum::serve(l, router).with_graceful_shutdown(stopped).await
                });
            }
        }
    }
    // A listener that fails stops the others, and the daemon still shuts down in order.
    let mut failed = None;
    while let Some(r) = servers.join_next().await {
        let e = match r {
            Ok(Ok(())) => continue,
            Err(e) if e.is_cancelled() => continue,
            Ok(Err(e)) => anyhow::Error::from(e),
            Err(e) => anyhow::Error::from(e),
        };
        tracing::error!(error = %e, "an HTTP listener failed; stopping");
        failed.get_or_insert(e);
        servers.abort_all();
    }
    daemon.shutdown().await;
    if let Some(e) = failed {
        std::mem::forget(owner);
        return Err(e);
    }
    // Held until the process has ended, not only this function: the runtime's teardown may
    // still wait on blocking work touching the directory.
    std::mem::forget(owner);
    Ok(())
}

/// A URL with any password replaced, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

fn daemon_node(d: &strata_daemon::Daemon) -> String {
    d.node_id().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct T {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn file(text: &str) -> anyhow::Result<Settings> {
        Ok(toml::from_str(text)?)
    }

    /// One declaration per setting: a flag beats the file, the file fills what flags leave
    /// unset, values parse the same from both, and the file refuses unknown keys and bad
    /// values by name.
    #[test]
    fn settings_layer_flags_over_the_file() {
        let f = file(
            "lease_ttl = \"5s\"\nupload_interval = 2\nsegment_size = \"8MiB\"\nmin_free = 0\n\
             gc_interval = \"off\"\nlisten = \"127.0.0.1:1\"\nadmin_token = \"secret\"\n\
             keep_auto = 2\n",
        )
        .unwrap();
        let t = T::try_parse_from(["t", "--lease-ttl", "1m", "--segment-size", "2097152"]).unwrap();
        let s = t.a.set.over(f).unwrap();
        assert_eq!(s.lease_ttl, Some(Dur(std::time::Duration::from_secs(60))));
        assert_eq!(
            s.upload_interval,
            Some(Dur(std::time::Duration::from_secs(2)))
        );
        assert_eq!(s.segment_size, Some(Size(2 << 20)));
        assert_eq!(s.min_free, Some(Size(0)));
        assert_eq!(s.gc_interval, Some(Every(None)));
        assert_eq!(s.listen.as_deref(), Some("127.0.0.1:1"));
        assert_eq!(s.admin_token.as_deref(), Some("secret"));
        assert_eq!(s.keep_auto, Some(2));
        let e = file("lease_tll = \"5s\"").err().unwrap().to_string();
        assert!(e.contains("lease_tll"), "{e}");
        let e = file("lease_ttl = \"soon\"").err().unwrap().to_string();
        assert!(e.contains("soon"), "{e}");
        let e = file("cache_capacity = \"4XB\"").err().unwrap().to_string();
        assert!(e.contains("XB"), "{e}");
        // Secrets are never flags.
        assert!(T::try_parse_from(["t", "--admin-token", "x"]).is_err());
        assert!(T::try_parse_from(["t", "--min-free", "0"]).is_ok());
        let nan = T::try_parse_from(["t", "--compact-below", "nan"]).unwrap();
        assert!(nan.a.set.over(Settings::default()).is_err());
    }
}
