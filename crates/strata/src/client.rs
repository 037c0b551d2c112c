//! Every API verb of the CLI, in one implementation: as requests to the daemon's router,
//! either over HTTP to a daemon (`STRATA_URL`, `STRATA_TOKEN`) or to the same router run in
//! this process on a local data directory (the embedded default). Both ways print the same
//! forms and exit with the same codes, because they are the same requests and responses.
//!
//! The in-process router acts for the `--tenant` given (and as the admin: whoever runs the
//! CLI on a data directory owns it) through a `LocalCaller` request extension, not a token.
//! When the verb is done the in-process daemon is stopped the way `strata serve` stops.
//! (Outside the API, a local process also has a foreground `ws attach`, `ws write`,
//! `ws export` and `template build` from host paths: `main.rs`.)

use std::sync::Arc;

use axum::http::Method;
use serde_json::{json, Value};

use crate::output::{print, usage, View};
use crate::{Cmd, TemplateCmd, TenantCmd, TokenCmd, WsCmd};

/// Where the requests go.
#[derive(Clone)]
pub enum Client {
    Http {
        c: reqwest::Client,
        url: String,
        token: String,
    },
    InProcess {
        router: axum::Router,
        daemon: Arc<strata_daemon::Daemon>,
        caller: strata_daemon::LocalCaller,
    },
}

/// A request body.
enum Body {
    None,
    Json(Value),
    /// A local file, streamed (template uploads).
    File(std::path::PathBuf),
}

impl Client {
    /// A client of the daemon at `url`; with `STRATA_CA_CERT` set, an `https://` daemon's
    /// certificate must chain to one of the CA certificates in that file (PEM), and to nothing
    /// else.
    pub fn http(url: &str) -> anyhow::Result<Client> {
        use anyhow::Context;
        let mut b = reqwest::Client::builder();
        if let Some(ca) = std::env::var_os("STRATA_CA_CERT").filter(|v| !v.is_empty()) {
            let pem = std::fs::read(&ca)
                .with_context(|| format!("reading STRATA_CA_CERT {}", ca.to_string_lossy()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("parsing STRATA_CA_CERT {}", ca.to_string_lossy()))?;
            anyhow::ensure!(!certs.is_empty(), "STRATA_CA_CERT holds no certificate");
            b = b.tls_certs_only(certs);
        }
        Ok(Client::Http {
            c: b.build()?,
            url: url.trim_end_matches('/').to_string(),
            token: std::env::var("STRATA_TOKEN").unwrap_or_default(),
        })
    }

    /// The daemon's router over the engine of a local data directory, acting as `tenant`.
    pub async fn in_process(g: &crate::Global) -> anyhow::Result<Client> {
        let e = crate::open(g).await?;
        let daemon = strata_daemon::Daemon::new(
            e,
            strata_daemon::DaemonConfig {
                // The owner of the data directory builds templates of any size it can hold.
                template_max_bytes: Some(u64::MAX),
                in_process: true,
                ..Default::default()
            },
        )?;
        Ok(Client::InProcess {
            router: daemon.router(),
            daemon,
            caller: strata_daemon::LocalCaller::new(g.tenant.clone()),
        })
    }

    /// After the verb: an in-process daemon stops as `strata serve` does (what is still
    /// attached, only for a call whose final publish failed, is flushed and kept on disk for
    /// the next process, never thrown away).
    pub async fn close(&self) {
        if let Client::InProcess { daemon, .. } = self {
            daemon.shutdown().await;
        }
    }

    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        self.send(method, path, body.map_or(Body::None, Body::Json))
            .await
    }

    async fn upload(&self, path: &str, file: &std::path::Path) -> anyhow::Result<Value> {
        self.send(Method::PUT, path, Body::File(file.to_path_buf()))
            .await
    }

    async fn send(&self, method: Method, path: &str, body: Body) -> anyhow::Result<Value> {
        let (status, text) = match self {
            Client::Http { c, url, token } => {
                let mut r = c.request(method, format!("{url}{path}"));
                if !token.is_empty() {
                    r = r.bearer_auth(token);
                }
                r = match body {
                    Body::None => r,
                    Body::Json(v) => r.json(&v),
                    Body::File(p) => {
                        let f = tokio::fs::File::open(&p).await?;
                        let len = f.metadata().await?.len();
                        r.header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                            .header(reqwest::header::CONTENT_LENGTH, len)
                            .body(reqwest::Body::from(f))
                    }
                };
                let resp = r.send().await.map_err(|e| {
                    // The cause is down the chain (refused, a certificate not trusted).
                    let mut m = format!("cannot reach the daemon at {url}: {e}");
                    let mut s = std::error::Error::source(&e);
                    while let Some(x) = s {
                        m.push_str(&format!(": {x}"));
                        s = x.source();
                    }
                    anyhow::anyhow!(m)
                })?;
                (resp.status().as_u16(), resp.text().await?)
            }
            Client::InProcess { router, caller, .. } => {
                use axum::http::header;
                use tower::ServiceExt;
                let b = axum::http::Request::builder().method(method).uri(path);
                let req = match body {
                    Body::None => b.body(axum::body::Body::empty()),
                    Body::Json(v) => b
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(axum::body::Body::from(serde_json::to_vec(&v)?)),
                    Body::File(p) => {
                        let f = tokio::fs::File::open(&p).await?;
                        let len = f.metadata().await?.len();
                        b.header(header::CONTENT_TYPE, "application/octet-stream")
                            .header(header::CONTENT_LENGTH, len)
                            .body(axum::body::Body::from_stream(
                                tokio_util::io::ReaderStream::new(f),
                            ))
                    }
                };
                let mut req = req?;
                req.extensions_mut().insert(caller.clone());
                let resp = router.clone().oneshot(req).await?;
                let status = resp.status().as_u16();
                let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await?;
                (status, String::from_utf8_lossy(&bytes).into_owned())
            }
        };
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if !(200..300).contains(&status) {
            let msg = v["error"]["message"].as_str().unwrap_or(&text).to_string();
            let kind = v["error"]["kind"].as_str().unwrap_or("error").to_string();
            let retryable = v["error"]["retryable"].as_bool().unwrap_or(false);
            return Err(ApiFailure {
                status,
                kind,
                msg,
                retryable,
            }
            .into());
        }
        Ok(v)
    }

    fn is_local(&self) -> bool {
        matches!(self, Client::InProcess { .. })
    }
}

/// A name as one path segment: every byte but unreserved ones percent-encoded, so any name
/// reaches the API whole (and is refused there if it is not a valid name), whichever
/// transport carries it.
fn seg(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An error the API returned (over HTTP or in process); exit code 2 for client errors.
#[derive(Debug)]
pub struct ApiFailure {
    pub status: u16,
    pub kind: String,
    pub msg: String,
    pub retryable: bool,
}

impl std::fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, HTTP {})", self.msg, self.kind, self.status)
    }
}

impl std::error::Error for ApiFailure {}

impl ApiFailure {
    /// A refusal made by the CLI itself, reported as the API reports its own.
    pub fn refused(status: u16, kind: &str, msg: impl Into<String>) -> ApiFailure {
        ApiFailure {
            status,
            kind: kind.into(),
            msg: msg.into(),
            retryable: false,
        }
    }
}

/// Polls the API's view of a workspace for upload progress while a publish runs.
fn poll_publish(h: &Client, ws: &str) -> Option<tokio::task::JoinHandle<()>> {
    let (h, ws) = (h.clone(), ws.to_string());
    crate::upload_progress(move || {
        let (h, ws) = (h.clone(), ws.clone());
        async move {
            let v = h
                .call(Method::GET, &format!("/v1/workspaces/{}", seg(&ws)), None)
                .await
                .ok()?;
            Some((
                v["stats"]["publish_done_bytes"].as_u64()?,
                v["stats"]["publish_total_bytes"].as_u64()?,
            ))
        }
    })
}

/// On a terminal, shows how much of the disk a mount has read so far (a cold template's
/// blocks come from the object store on first read: mkfs, journal replay and the mount itself
/// wait on them).
fn poll_mount(h: &Client, ws: &str) -> Option<tokio::task::JoinHandle<()>> {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let (h, ws) = (h.clone(), ws.to_string());
    let started = std::time::Instant::now();
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            let v = h
                .call(Method::GET, &format!("/v1/workspaces/{}", seg(&ws)), None)
                .await
                .ok();
            if let Some(read) = v.as_ref().and_then(|v| v["stats"]["bytes_read"].as_u64()) {
                eprint!(
                    "\r\x1b[Kmounting {ws}: {} read, {:.1} s",
                    crate::units::fmt_size(read),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }))
}

/// `template build`: the CLI sends the content (a tar archive of the
/// directory, or the image with its format stated), never a path on the daemon's host.
async fn upload_template(
    h: &Client,
    name: &str,
    from_dir: Option<std::path::PathBuf>,
    from_image: Option<std::path::PathBuf>,
    size: Option<u64>,
) -> anyhow::Result<Value> {
    let mut q = String::new();
    let spool;
    let file = match (from_dir, from_image) {
        (Some(dir), None) => {
            anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
            spool = tempfile::NamedTempFile::new()?;
            let out = spool.reopen()?;
            let d = dir.clone();
            tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                let mut b = tar::Builder::new(std::io::BufWriter::new(out));
                b.follow_symlinks(false);
                b.append_dir_all(".", &d)?;
                b.into_inner()?
                    .into_inner()
                    .map_err(|e| e.into_error())?
                    .sync_all()
            })
            .await??;
            q.push_str("format=tar");
            if let Some(s) = size {
                q.push_str(&format!("&size={s}"));
            }
            spool.path().to_path_buf()
        }
        (None, Some(img)) => {
            let f = strata_engine::template::detect_format(&img)?;
            q.push_str(match f {
                strata_engine::template::ImageFormat::Raw => "format=raw",
                strata_engine::template::ImageFormat::Qcow2 => "format=qcow2",
            });
            img
        }
        _ => return usage("give --from-dir DIR or --from-image FILE"),
    };
    h.upload(&format!("/v1/templates/{}?{q}", seg(name)), &file)
        .await
}

/// Runs one API verb through `h`.
pub async fn run(h: &Client, json_out: bool, cmd: Cmd) -> anyhow::Result<()> {
    use Method as M;
    if h.is_local() {
        match &cmd {
            Cmd::Ws(WsCmd::Freeze { .. } | WsCmd::Thaw { .. }) => {
                return usage(
                    "freeze and thaw act on a workspace attached in a daemon: set STRATA_URL",
                )
            }
            Cmd::Ws(WsCmd::Mount { .. } | WsCmd::Umount { .. } | WsCmd::Mounts) => {
                return usage(
                    "mounts are held by a daemon (`strata serve`, as root): set STRATA_URL",
                )
            }
            _ => {}
        }
    }
    let ws_path = |ws: &str, tail: &str| format!("/v1/workspaces/{}{tail}", seg(ws));
    match cmd {
        Cmd::Tenant(TenantCmd::Create {
            name,
            store,
            encrypted,
        }) => {
            let mut body = json!({"name": name});
            if let Some(s) = store {
                body["store"] = json!(s);
            }
            if encrypted {
                body["encrypted"] = json!(true);
            }
            let v = h.call(M::POST, "/v1/tenants", Some(body)).await?;
            print(json_out, View::TenantCreated, &v);
        }
        Cmd::Tenant(TenantCmd::Token { name, opts }) => {
            let v = h
                .call(
                    M::POST,
                    &format!("/v1/tenants/{}/tokens", seg(&name)),
                    Some(opts.body()),
                )
                .await?;
            print(json_out, View::Token, &v);
        }
        Cmd::Tenant(TenantCmd::List) => {
            let v = h.call(M::GET, "/v1/tenants", None).await?;
            print(json_out, View::Tenants, &v);
        }
        Cmd::Tenant(TenantCmd::Delete { name }) => {
            let v = h
                .call(M::DELETE, &format!("/v1/tenants/{}", seg(&name)), None)
                .await?;
            print(json_out, View::TenantDeleted, &v);
        }
        Cmd::Tenant(TenantCmd::Tokens { name }) => {
            let v = h
                .call(M::GET, &format!("/v1/tenants/{}/tokens", seg(&name)), None)
                .await?;
            print(json_out, View::Tokens, &v);
        }
        Cmd::Tenant(TenantCmd::Revoke { name, id }) => {
            let v = h
                .call(
                    M::DELETE,
                    &format!("/v1/tenants/{}/tokens/{}", seg(&name), seg(&id)),
                    None,
                )
                .await?;
            print(json_out, View::Revoked, &v);
        }
        Cmd::Tenant(TenantCmd::Quota {
            name,
            workspaces,
            disk_bytes,
            attached_per_node,
            local_journal_bytes,
            live_bytes,
            relay_bytes,
        }) => {
            let body = json!({
                "workspaces": workspaces,
                "disk_bytes": disk_bytes.map(|s| s.0),
                "attached_per_node": attached_per_node,
                "local_journal_bytes": local_journal_bytes.map(|s| s.0),
                "live_bytes": live_bytes.map(|s| s.0),
                "relay_bytes": relay_bytes.map(|s| s.0),
            });
            let v = h
                .call(
                    M::PUT,
                    &format!("/v1/tenants/{}/quotas", seg(&name)),
                    Some(body),
                )
                .await?;
            print(json_out, View::Quotas, &v);
        }
        Cmd::Usage => {
            let v = h.call(M::GET, "/v1/usage", None).await?;
            print(json_out, View::Usage, &v);
        }
        Cmd::Token(TokenCmd::Create { opts }) => {
            let v = h.call(M::POST, "/v1/tokens", Some(opts.body())).await?;
            print(json_out, View::Token, &v);
        }
        Cmd::Token(TokenCmd::List) => {
            let v = h.call(M::GET, "/v1/tokens", None).await?;
            print(json_out, View::Tokens, &v);
        }
        Cmd::Token(TokenCmd::Revoke { id }) => {
            let v = h
                .call(M::DELETE, &format!("/v1/tokens/{}", seg(&id)), None)
                .await?;
            print(json_out, View::Revoked, &v);
        }
        Cmd::Template(c) => {
            let (view, v) = match c {
                TemplateCmd::Build {
                    name,
                    from_dir,
                    from_image,
                    size,
                } => (
                    View::Template,
                    upload_template(h, &name, from_dir, from_image, size).await?,
                ),
                TemplateCmd::List => (
                    View::Templates,
                    h.call(M::GET, "/v1/templates", None).await?,
                ),
                TemplateCmd::Show { name } => (
                    View::Template,
                    h.call(M::GET, &format!("/v1/templates/{}", seg(&name)), None)
                        .await?,
                ),
                TemplateCmd::Delete { name } => {
                    h.call(M::DELETE, &format!("/v1/templates/{}", seg(&name)), None)
                        .await?;
                    (View::Deleted("template"), json!({"deleted": name}))
                }
            };
            print(json_out, view, &v);
        }
        Cmd::Gc { dry_run, reconcile } => {
            let v = h
                .call(
                    M::POST,
                    "/v1/gc",
                    Some(json!({"dry_run": dry_run, "reconcile": reconcile})),
                )
                .await?;
            print(json_out, View::Gc, &v);
        }
        Cmd::Nodes => {
            let v = h.call(M::GET, "/v1/nodes", None).await?;
            print(json_out, View::Nodes, &v);
        }
        Cmd::Ws(c) => {
            let (view, v) = match c {
                WsCmd::Create { ws, template, from, size, mode, ttl } => {
                    (View::Workspace, h.call(M::POST, "/v1/workspaces", Some(json!({"name": ws, "template": template, "from": from, "size": size, "mode": mode, "ttl_secs": ttl.map(|d| d.as_secs())}))).await?)
                }
                WsCmd::List => (View::Workspaces, h.call(M::GET, "/v1/workspaces", None).await?),
                WsCmd::Show { ws } => (View::WorkspaceDetail, h.call(M::GET, &ws_path(&ws, ""), None).await?),
                WsCmd::Log { ws } => (View::Log, h.call(M::GET, &ws_path(&ws, "/log"), None).await?),
                WsCmd::Attach { ws, socket, tcp, vhost_user, read_only, queues } => {
                    if socket.is_some() || tcp.is_some() {
                        return usage("--socket and --tcp apply to a foreground attach without a daemon (unset STRATA_URL)");
                    }
                    let protocol = if vhost_user { "vhost-user" } else { "nbd" };
                    let body = json!({"protocol": protocol, "read_only": read_only, "queues": queues});
                    (View::Attached, h.call(M::POST, &ws_path(&ws, "/attach"), Some(body)).await?)
                }
                WsCmd::Detach { ws } => {
                    let ticker = poll_publish(h, &ws);
                    let r = h.call(M::POST, &ws_path(&ws, "/detach"), Some(json!({}))).await;
                    crate::end_progress(ticker);
                    (View::Detached, r?)
                }
                WsCmd::Checkpoint { ws, label, keep, no_freeze, wait } => {
                    let ticker = poll_publish(h, &ws);
                    let r = h.call(M::POST, &ws_path(&ws, "/checkpoint"), Some(json!({"label": label, "keep_secs": keep.map(|k| k.as_secs()), "no_freeze": no_freeze, "wait": wait}))).await;
                    crate::end_progress(ticker);
                    (View::Checkpoint, r?)
                }
                WsCmd::Fork { src, new } => {
                    let (s, v) = crate::split_at_version(&src)?;
                    (View::Workspace, h.call(M::POST, &ws_path(&s, "/fork"), Some(json!({"name": new, "version": v}))).await?)
                }
                WsCmd::Rollback { ws, version, wait } => {
                    // Sent only when asked for: a daemon older than the field refuses it.
                    let body = if wait { json!({"version": version, "wait": true}) } else { json!({"version": version}) };
                    (View::Rollback, h.call(M::POST, &ws_path(&ws, "/rollback"), Some(body)).await?)
                }
                WsCmd::Resize { ws, size } => (View::Resized, h.call(M::POST, &ws_path(&ws, "/resize"), Some(json!({"size": size}))).await?),
                WsCmd::Freeze { ws } => (View::Frozen, h.call(M::POST, &ws_path(&ws, "/freeze"), Some(json!({}))).await?),
                WsCmd::Thaw { ws } => (View::Thawed, h.call(M::POST, &ws_path(&ws, "/thaw"), Some(json!({}))).await?),
                WsCmd::Mount { ws, dir, backend, mkfs, read_only } => {
                    let target = match dir {
                        Some(d) => Some(
                            std::fs::canonicalize(&d)
                                .map_err(|e| anyhow::anyhow!("{}: {e}", d.display()))?
                                .display()
                                .to_string(),
                        ),
                        None => None,
                    };
                    let body = json!({"backend": backend, "mkfs": mkfs, "target": target, "read_only": read_only});
                    let ticker = poll_mount(h, &ws);
                    let r = h.call(M::POST, &ws_path(&ws, "/mount"), Some(body)).await;
                    crate::end_progress(ticker);
                    (View::Mount, r?)
                }
                WsCmd::Umount { dir_or_ws } => {
                    // An argument with a slash is a directory: the mount whose target (or own
                    // directory) it is, symlinks resolved; anything else is a workspace name.
                    let ws = if dir_or_ws.contains('/') {
                        let dir = std::fs::canonicalize(&dir_or_ws)
                            .map_err(|e| anyhow::anyhow!("{dir_or_ws}: {e}"))?
                            .display()
                            .to_string();
                        let mounts = h.call(M::GET, "/v1/mounts", None).await?;
                        mounts
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|m| m["target"].as_str() == Some(&*dir) || m["dir"].as_str() == Some(&*dir))
                            .and_then(|m| m["workspace"].as_str().map(str::to_string))
                            .ok_or_else(|| anyhow::anyhow!("no workspace of yours is mounted at {dir}"))?
                    } else {
                        dir_or_ws
                    };
                    let ticker = poll_publish(h, &ws);
                    let r = h.call(M::DELETE, &ws_path(&ws, "/mount"), None).await;
                    crate::end_progress(ticker);
                    (View::Unmounted, r?)
                }
                WsCmd::Mounts => (View::Mounts, h.call(M::GET, "/v1/mounts", None).await?),
                WsCmd::Delete { ws } => {
                    h.call(M::DELETE, &ws_path(&ws, ""), None).await?;
                    (View::Deleted("workspace"), json!({"deleted": ws}))
                }
                WsCmd::Write { .. } | WsCmd::Export { .. } => {
                    return usage("`ws write` and `ws export` work on a local data directory: unset STRATA_URL, or attach and use an NBD client")
                }
            };
            print(json_out, view, &v);
        }
        Cmd::Serve(_) | Cmd::Demo | Cmd::Csi(_) => unreachable!("not API verbs"),
    }
    Ok(())
}
