//! The `strata` command.
//!
//! Every API verb is one request to the daemon's router (`client.rs`): with `STRATA_URL` set,
//! over HTTP to that daemon; without it, to the same router run in this process on a local
//! data directory (the embedded default: SQLite catalog, local object directory, node cache
//! and the volumes' journals). `serve`, `csi` and `demo` run here, and a foreground
//! `ws attach`, `ws write` and `ws export` work on a local data directory only.

mod units;

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use strata_engine::{Engine, EngineConfig, Mode};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Durable, forkable, object-storage-backed disks for agent sandboxes"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args)]
struct Global {
    /// Data directory (catalog, objects, cache, journals).
    #[arg(
        long,
        global = true,
        env = "STRATA_DATA",
        default_value = "strata-data"
    )]
    data: PathBuf,
    /// Tenant to act as.
    #[arg(long, global = true, env = "STRATA_TENANT", default_value = "default")]
    tenant: String,
    /// Machine-readable output.
    #[arg(long, global = true)]
    json: bool,
    /// Log lines on stderr as text or as one JSON object per line (with the request's span:
    /// request id, tenant, workspace, export). The level comes from STRATA_LOG (default warn).
    #[arg(long, global = true, env = "STRATA_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once per process: the size of the `serve` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Templates: immutable base disks in object storage.
    #[command(subcommand)]
    Template(TemplateCmd),
    /// Workspaces: named disks with a head, checkpoints and forks.
    #[command(subcommand)]
    Ws(WsCmd),
    /// Runs the whole lifecycle on a fresh temporary data directory and explains it.
    Demo,
    /// Runs the daemon: HTTP API, NBD exports, background uploads, lease renewal.
    Serve(serve::ServeArgs),
    /// Runs the Kubernetes CSI driver (Identity, Node, Controller) in front of this node's
    /// daemon (STRATA_URL, STRATA_TOKEN).
    Csi(csi::CsiArgs),
    /// Tenants (through the daemon; needs STRATA_URL and the admin token in STRATA_TOKEN).
    #[command(subcommand)]
    Tenant(TenantCmd),
    /// Your tenant's tokens: issue scoped or expiring ones, list, revoke.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Your tenant's usage (workspaces, disk bytes, what it holds on this node) and quotas.
    Usage,
    /// Garbage collection: expire checkpoints by retention, delete unreferenced data (admin
    /// token through the daemon). Deletion is two-phase: data is deleted by a pass at least the
    /// grace period after one that found it unreferenced.
    Gc {
        /// Report what would be expired and deleted; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Also list the object store, to find data the catalog does not know (uploads cut off
        /// before they were recorded); without it a pass costs what changed.
        #[arg(long)]
        reconcile: bool,
    },
    /// Nodes sharing the catalog: which workspaces each serves, lease epochs, remote windows
    /// (through the daemon with the admin token, or from the local catalog).
    Nodes,
}

#[derive(Subcommand)]
enum TenantCmd {
    /// Creates a tenant and prints its first token (shown once).
    Create {
        name: String,
        /// Place its data in this named store (the daemons' `[stores.NAME]`: its own bucket
        /// and credentials) instead of the default one; fixed for the tenant's life.
        #[arg(long)]
        store: Option<String>,
        /// Encrypt its data at rest under a key of its own, wrapped by the daemons' master
        /// key (`master_key_file`); fixed for the tenant's life.
        #[arg(long)]
        encrypted: bool,
    },
    /// Every tenant, with its workspace and token counts.
    List,
    /// Deletes a tenant and everything it owns (refused while a workspace is attached).
    Delete { name: String },
    /// Issues another token for a tenant (printed once).
    Token {
        name: String,
        #[command(flatten)]
        opts: TokenOpts,
    },
    /// A tenant's tokens: ids and metadata.
    Tokens { name: String },
    /// Revokes one of a tenant's tokens by id.
    Revoke { name: String, id: String },
    /// Sets a tenant's quotas, replacing them (a limit left out is no limit).
    Quota {
        name: String,
        /// Workspaces it may have.
        #[arg(long)]
        workspaces: Option<u64>,
        /// The sum of its workspaces' disk sizes (e.g. 100GiB).
        #[arg(long)]
        disk_bytes: Option<units::Size>,
        /// Its workspaces attached at once on one node.
        #[arg(long)]
        attached_per_node: Option<u64>,
        /// Journal bytes it may hold on one node's disk; writes past it get ENOSPC.
        #[arg(long)]
        local_journal_bytes: Option<units::Size>,
        /// Live bytes in the object store; past it, creates, forks, checkpoints, templates and
        /// relay files are refused (guest writes are not).
        #[arg(long)]
        live_bytes: Option<units::Size>,
        /// Relay bytes waiting for upload on one node; a relay file past it is refused.
        #[arg(long)]
        relay_bytes: Option<units::Size>,
    },
}

/// Your tenant's own tokens (a full tenant token in STRATA_TOKEN).
#[derive(Subcommand)]
enum TokenCmd {
    /// Issues a token (printed once).
    Create {
        #[command(flatten)]
        opts: TokenOpts,
    },
    /// Ids and metadata of this tenant's tokens.
    List,
    /// Revokes a token by id.
    Revoke { id: String },
}

#[derive(clap::Args)]
struct TokenOpts {
    /// read, attach, relay or relay:STREAM (default: the tenant's full rights).
    #[arg(long)]
    scope: Option<String>,
    /// Stops working after this long (e.g. 12h, 30d).
    #[arg(long)]
    ttl: Option<units::Dur>,
    /// A note shown in listings.
    #[arg(long)]
    label: Option<String>,
}

impl TokenOpts {
    fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "scope": self.scope,
            "ttl_seconds": self.ttl.as_ref().map(|d| d.0.as_secs().max(1)),
            "label": self.label,
        })
    }
}

#[derive(Subcommand)]
enum TemplateCmd {
    /// Builds a template from a directory (ext4 via mkfs.ext4 -d) or a raw/qcow2 image.
    Build {
        name: String,
        #[arg(
            long,
            conflicts_with = "from_image",
            required_unless_present = "from_image"
        )]
        from_dir: Option<PathBuf>,
        #[arg(long)]
        from_image: Option<PathBuf>,
        /// Disk size for --from-dir, e.g. 4GiB (derived from the directory if omitted).
        #[arg(long, value_parser = units::parse_size)]
        size: Option<u64>,
    },
    List,
    Show {
        name: String,
    },
    Delete {
        name: String,
    },
}

#[derive(Subcommand)]
enum WsCmd {
    /// Creates a workspace from a template, another workspace's checkpoint, or an empty disk.
    Create {
        ws: String,
        #[arg(long, group = "src")]
        template: Option<String>,
        /// WS or WS@VERSION.
        #[arg(long, group = "src")]
        from: Option<String>,
        /// An empty disk of this size, e.g. 10GiB.
        #[arg(long, group = "src", value_parser = units::parse_size)]
        size: Option<u64>,
        #[arg(long, default_value = "durable")]
        mode: Mode,
        #[arg(long, value_parser = units::parse_duration)]
        ttl: Option<std::time::Duration>,
    },
    List,
    Show {
        ws: String,
    },
    /// The checkpoint history.
    Log {
        ws: String,
    },
    Checkpoint {
        ws: String,
        #[arg(long)]
        label: Option<String>,
        /// Keep it at least this long (e.g. 30d); otherwise retention decides.
        #[arg(long, value_parser = units::parse_duration)]
        keep: Option<std::time::Duration>,
        /// Of a mounted workspace: do not freeze its filesystem around the cut
        /// (crash-consistent instead of application-consistent).
        #[arg(long)]
        no_freeze: bool,
        /// Return only once the checkpoint is published (in the object store: any node can
        /// serve it). Without it, a workspace attached to a daemon gets a `local` checkpoint
        /// as soon as its cut is durable on that node; publication follows in the background.
        #[arg(long)]
        wait: bool,
    },
    /// Mounts the workspace's filesystem on this host (daemon only): attaches it, makes the
    /// filesystem if asked and the volume is blank, mounts it, and binds it onto DIR if given
    /// (DIR must be under the daemon's --mount-root, in ROOT/TENANT/). The daemon remounts it
    /// after a restart.
    Mount {
        ws: String,
        dir: Option<PathBuf>,
        /// fuse: the native FUSE export under a loop device (no kernel module beyond fuse and
        /// loop); nbd: /dev/nbdN through the kernel NBD client over netlink (needs nbd.ko; the
        /// mount survives a daemon restart).
        #[arg(long, default_value = "fuse")]
        backend: String,
        /// Make this filesystem on a blank volume (ext4).
        #[arg(long)]
        mkfs: Option<String>,
        #[arg(long)]
        read_only: bool,
    },
    /// Unmounts a mounted workspace (by its directory or name) and detaches it (daemon only).
    Umount {
        dir_or_ws: String,
    },
    /// Workspaces mounted on the daemon's host.
    Mounts,
    /// Releases the workspace on this node: publishes unpublished writes, stops the export.
    Detach {
        ws: String,
    },
    /// Stops acknowledging writes after draining in-flight ones (daemon only).
    Freeze {
        ws: String,
    },
    /// Resumes acknowledging writes (daemon only).
    Thaw {
        ws: String,
    },
    /// Forks SRC[@VERSION] into NEW without copying data.
    Fork {
        src: String,
        new: String,
    },
    /// Makes VERSION's disk the head again, as a new version.
    Rollback {
        ws: String,
        version: u64,
        /// Return only once the rollback is published. Without it, a rollback to a version
        /// still local on the daemon's node returns as soon as it is durable there (`local`);
        /// a sync-mode workspace always waits.
        #[arg(long)]
        wait: bool,
    },
    /// Grows the disk to SIZE (never shrinks it); mounted, its filesystem grows too.
    Resize {
        ws: String,
        #[arg(value_parser = units::parse_size)]
        size: u64,
    },
    Delete {
        ws: String,
    },
    /// Writes a file's bytes into the workspace at an offset, flushes, and publishes.
    Write {
        ws: String,
        file: PathBuf,
        #[arg(long, default_value_t = 0)]
        offset: u64,
    },
    /// Attaches the workspace on this node and serves it over NBD in the foreground until
    /// SIGINT/SIGTERM, then detaches (publishing what is unpublished). Prints the export address.
    Attach {
        ws: String,
        /// Unix socket path (default: DATA/run/WS.sock, owner-only).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Also listen on TCP, e.g. 127.0.0.1:10809 (loopback unless you mean otherwise).
        #[arg(long)]
        tcp: Option<std::net::SocketAddr>,
        /// Serve vhost-user-blk for a VMM (QEMU vhost-user-blk-pci, Cloud Hypervisor,
        /// Firecracker) instead of NBD; docs/VHOST_USER.md.
        #[arg(long, conflicts_with = "tcp")]
        vhost_user: bool,
        /// Serve it read-only.
        #[arg(long)]
        read_only: bool,
        /// vhost-user queues offered (1..=8, default 2).
        #[arg(long, requires = "vhost_user")]
        queues: Option<u16>,
    },
    /// Writes a checkpoint's whole disk (head by default) to a raw file, from the object store.
    Export {
        ws: String,
        out: PathBuf,
    },
}

/// On a terminal, shows upload progress while a publish runs, by polling `poll` for
/// (bytes uploaded, bytes to pack). Returns the ticker to pass to [`end_progress`].
pub(crate) fn upload_progress<F, Fut>(poll: F) -> Option<tokio::task::JoinHandle<()>>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<(u64, u64)>> + Send,
{
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            if let Some((done, total)) = poll().await.filter(|(_, t)| *t > 0) {
                eprint!(
                    "\r\x1b[Kuploading: {} of up to {}",
                    units::fmt_size(done),
                    units::fmt_size(total)
                );
            }
        }
    }))
}

pub(crate) fn end_progress(ticker: Option<tokio::task::JoinHandle<()>>) {
    if let Some(t) = ticker {
        t.abort();
        eprint!("\r\x1b[K");
    }
}

pub(crate) fn split_at_version(s: &str) -> anyhow::Result<(String, Option<u64>)> {
    match s.split_once('@') {
        Some((w, v)) => Ok((
            w.to_string(),
            Some(v.parse().map_err(|_| {
                client::ApiFailure::refused(400, "invalid", format!("bad version in {s:?}"))
            })?),
        )),
        None => Ok((s.to_string(), None)),
    }
}

/// The engine settings of this process for a data directory: the defaults, and the one
/// environment opt-out (`STRATA_VOLUME_CACHE_UNSAFE=1`, a power-loss test's control).
pub(crate) fn engine_config(data: &std::path::Path) -> EngineConfig {
    let mut c = EngineConfig::new(data);
    c.cache_unsafe = strata_engine::cache_unsafe_from_env();
    c
}

/// The engine on the local data directory (for the in-process router, and the verbs outside
/// the API), acting as `--tenant`; refused while a daemon owns the directory (the lock is
/// held until the process ends: no daemon may start on it meanwhile).
async fn open(g: &Global) -> anyhow::Result<Arc<Engine>> {
    std::mem::forget(datadir::local(&g.data)?);
    let e = Engine::open_embedded(engine_config(&g.data)).await?;
    e.ensure_tenant(&g.tenant).await?;
    Ok(e)
}

fn progress() -> impl Fn(u64, u64) + Send + Sync {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    move |done, total| {
        if tty && total > 0 {
            eprint!(
                "\r{:>5.1}% of {}",
                done as f64 * 100.0 / total as f64,
                units::fmt_size(total)
            );
            if done >= total {
                eprintln!();
            }
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let g = &cli.global;
    let t = g.tenant.as_str();
    let url = std::env::var("STRATA_URL").ok().filter(|u| !u.is_empty());
    match cli.cmd {
        Cmd::Demo => demo::run(g.json).await,
        Cmd::Serve(a) => serve::serve(g, a).await,
        Cmd::Csi(a) => csi::run(a).await,
        // The verbs that work on a local data directory outside the API: a foreground
        // attach (the process is the server), raw writes into the disk, raw exports, and
        // template builds from host paths.
        Cmd::Ws(WsCmd::Attach {
            ws,
            socket,
            tcp,
            vhost_user,
            read_only,
            queues,
        }) if url.is_none() => {
            let e = open(g).await?;
            let front = serve::Front {
                vhost_user,
                read_only,
                queues,
            };
            serve::attach(&e, g, &ws, socket, tcp, front).await
        }
        Cmd::Ws(WsCmd::Write { ws, file, offset }) if url.is_none() => {
            let e = open(g).await?;
            let data = std::fs::read(&file)?;
            let v = e.attach(t, &ws).await?;
            v.write(offset, &data, false).await?;
            v.flush().await?;
            let p = e.detach(t, &ws).await?;
            let head = match p {
                Some(p) => p.version,
                None => e.workspace(t, &ws).await?.head_version,
            };
            let v =
                serde_json::json!({"bytes": data.len(), "offset": offset, "head_version": head});
            print(g.json, View::Written, &v);
            Ok(())
        }
        // The API never takes a host path (a tenant could name any file); a process on the
        // host reads its own: mkfs.ext4 -d straight from the directory (owners, modes,
        // device nodes and xattrs kept), or the image file, without an upload's copies.
        Cmd::Template(TemplateCmd::Build {
            name,
            from_dir,
            from_image,
            size,
        }) if url.is_none() => {
            let e = open(g).await?;
            let p = progress();
            let tpl = match (from_dir, from_image) {
                (Some(d), _) => e.build_template_from_dir(t, &name, &d, size, &p).await?,
                (None, Some(i)) => e.build_template_from_image(t, &name, &i, &p).await?,
                _ => return output::usage("give --from-dir DIR or --from-image FILE"),
            };
            print(g.json, View::Template, &serde_json::to_value(&tpl)?);
            Ok(())
        }
        Cmd::Ws(WsCmd::Export { ws, out }) if url.is_none() => {
            let e = open(g).await?;
            let (w, v) = split_at_version(&ws)?;
            let n = e.export(t, &w, v, &out).await?;
            print(
                g.json,
                View::Exported,
                &serde_json::json!({"bytes": n, "out": out}),
            );
            Ok(())
        }
        // Every other verb is a request to the API: to a daemon, or to the same router here.
        cmd => {
            let c = match &url {
                Some(u) => client::Client::http(u)?,
                None => client::Client::in_process(g).await?,
            };
            let r = client::run(&c, g.json, cmd).await;
            c.close().await;
            r
        }
    }
}

mod client;
mod csi;
mod datadir;
mod demo;
mod output;
mod serve;

use output::{print, View};

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr);
    match cli.global.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("strata: cannot start runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let json = cli.global.json;
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let f = output::Failure::of(&e);
            f.report(json);
            std::process::ExitCode::from(f.exit_code())
        }
    }
}
