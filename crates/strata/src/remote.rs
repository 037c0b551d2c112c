//! The CLI talking to a daemon (`STRATA_URL`, `STRATA_TOKEN`).

use serde_json::{json, Value};

use crate::output::{print, usage, View};
use crate::{Cmd, TemplateCmd, TenantCmd, WsCmd};

struct Http {
    c: reqwest::Client,
    url: String,
    token: String,
}

impl Http {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self
            .c
            .request(method, format!("{}{path}", self.url.trim_end_matches('/')));
        if self.token.is_empty() {
            r
        } else {
            r.bearer_auth(&self.token)
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut r = self.request(method, path);
        if let Some(b) = body {
            r = r.json(&b);
        }
        self.send(r).await
    }

    /// Streams a local file as the request body.
    async fn upload(&self, path: &str, file: &std::path::Path) -> anyhow::Result<Value> {
        let f = tokio::fs::File::open(file).await?;
        let len = f.metadata().await?.len();
        let r = self
            .request(reqwest::Method::PUT, path)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(reqwest::Body::from(f));
        self.send(r).await
    }

    async fn send(&self, r: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let resp = r
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the daemon at {}: {e}", self.url))?;
        let status = resp.status();
        let text = resp.text().await?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if !status.is_success() {
            let msg = v["error"]["message"].as_str().unwrap_or(&text).to_string();
            let kind = v["error"]["kind"].as_str().unwrap_or("error").to_string();
            let retryable = v["error"]["retryable"].as_bool().unwrap_or(false);
            return Err(RemoteError {
                status: status.as_u16(),
                kind,
                msg,
                retryable,
            }
            .into());
        }
        Ok(v)
    }
}

/// An error reported by the daemon; exit code 2 for client errors.
#[derive(Debug)]
pub struct RemoteError {
    pub status: u16,
    pub kind: String,
    pub msg: String,
    pub retryable: bool,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, HTTP {})", self.msg, self.kind, self.status)
    }
}

impl std::error::Error for RemoteError {}

/// Polls the daemon's view of a workspace for upload progress while a publish runs.
fn poll_remote(h: &Http, ws: &str) -> Option<tokio::task::JoinHandle<()>> {
    let (c, url, token, ws) = (h.c.clone(), h.url.clone(), h.token.clone(), ws.to_string());
    crate::upload_progress(move || {
        let (c, url, token, ws) = (c.clone(), url.clone(), token.clone(), ws.clone());
        async move {
            let v: Value = c
                .get(format!("{}/v1/workspaces/{ws}", url.trim_end_matches('/')))
                .bearer_auth(token)
                .send()
                .await
                .ok()?
                .json()
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
fn poll_mount(h: &Http, ws: &str) -> Option<tokio::task::JoinHandle<()>> {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let (c, url, token, ws) = (h.c.clone(), h.url.clone(), h.token.clone(), ws.to_string());
    let started = std::time::Instant::now();
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            let v: Option<Value> = async {
                c.get(format!("{}/v1/workspaces/{ws}", url.trim_end_matches('/')))
                    .bearer_auth(&token)
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()
            }
            .await;
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

/// `template build` through a daemon: the CLI sends the content (a tar archive of the
/// directory, or the image with its format stated), never a path on the daemon's host.
async fn upload_template(
    h: &Http,
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
    h.upload(&format!("/v1/templates/{name}?{q}"), &file).await
}

pub async fn run(url: &str, json_out: bool, cmd: Cmd) -> anyhow::Result<()> {
    use reqwest::Method as M;
    let h = Http {
        c: reqwest::Client::new(),
        url: url.into(),
        token: std::env::var("STRATA_TOKEN").unwrap_or_default(),
    };
    let ws_path = |ws: &str, tail: &str| format!("/v1/workspaces/{ws}{tail}");
    match cmd {
        Cmd::Tenant(TenantCmd::Create { name }) => {
            let v = h
                .call(M::POST, "/v1/tenants", Some(json!({"name": name})))
                .await?;
            print(json_out, View::TenantCreated, &v);
        }
        Cmd::Tenant(TenantCmd::Token { name }) => {
            let v = h
                .call(M::POST, &format!("/v1/tenants/{name}/tokens"), None)
                .await?;
            print(json_out, View::Token, &v);
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
                    upload_template(&h, &name, from_dir, from_image, size).await?,
                ),
                TemplateCmd::List => (
                    View::Templates,
                    h.call(M::GET, "/v1/templates", None).await?,
                ),
                TemplateCmd::Show { name } => (
                    View::Template,
                    h.call(M::GET, &format!("/v1/templates/{name}"), None)
                        .await?,
                ),
                TemplateCmd::Delete { name } => {
                    h.call(M::DELETE, &format!("/v1/templates/{name}"), None)
                        .await?;
                    (View::Deleted("template"), json!({"deleted": name}))
                }
            };
            print(json_out, view, &v);
        }
        Cmd::Gc { dry_run } => {
            let v = h
                .call(M::POST, "/v1/gc", Some(json!({"dry_run": dry_run})))
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
                    let ticker = poll_remote(&h, &ws);
                    let r = h.call(M::POST, &ws_path(&ws, "/detach"), Some(json!({}))).await;
                    crate::end_progress(ticker);
                    (View::Detached, r?)
                }
                WsCmd::Checkpoint { ws, label, keep, no_freeze, wait } => {
                    let ticker = poll_remote(&h, &ws);
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
                    let ticker = poll_mount(&h, &ws);
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
                    let ticker = poll_remote(&h, &ws);
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
        Cmd::Serve(_) | Cmd::Demo | Cmd::Csi(_) => unreachable!("handled locally"),
    }
    Ok(())
}
