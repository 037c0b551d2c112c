//! What the CLI prints, whichever way a verb ran (through a daemon, `remote.rs`, or on a local
//! data directory, `main.rs`): one human format per kind of result, read from the same JSON
//! the API returns (`--json` prints that JSON as it is), and one mapping from an error's kind
//! to the exit code: 2 when the request was refused (the API's 4xx: invalid, not found, no
//! permission, too large, or in conflict with the workspace's state, such as a lease held by
//! another node), 1 when something failed (an unavailable store, an internal error). Results
//! go to stdout; errors to stderr, with `--json` as the API's error body on one line:
//! `{"error": {"kind", "message", "retryable"}}`.

use serde_json::Value;

use crate::units::fmt_size;

/// The kind of result a verb returns.
#[derive(Clone, Copy)]
pub enum View {
    Template,
    Templates,
    Workspace,
    Workspaces,
    WorkspaceDetail,
    Log,
    Checkpoint,
    Rollback,
    Detached,
    Resized,
    /// `{"deleted": NAME}` of a template or a workspace.
    Deleted(&'static str),
    Attached,
    Frozen,
    Thawed,
    Mount,
    Mounts,
    Unmounted,
    TenantCreated,
    Token,
    Tokens,
    Revoked,
    Tenants,
    TenantDeleted,
    Quotas,
    Usage,
    Gc,
    Nodes,
    Written,
    Exported,
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or("")
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn lines(v: &Value, f: impl Fn(&Value) -> String) -> String {
    v.as_array()
        .into_iter()
        .flatten()
        .map(f)
        .collect::<Vec<_>>()
        .join("\n")
}

fn workspace_line(w: &Value) -> String {
    format!(
        "workspace {} ({} mode, {}, head v{}, from {})",
        s(w, "name"),
        s(w, "mode"),
        fmt_size(n(w, "disk_size")),
        n(w, "head_version"),
        s(w, "source")
    )
}

/// A publish receipt (`Published`): version, state, bytes uploaded.
fn quotas(q: &Value) -> String {
    let parts: Vec<String> = q
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some(format!("{k} {}", v.as_u64()?)))
        .collect();
    if parts.is_empty() {
        "no quotas".into()
    } else {
        parts.join(", ")
    }
}

/// An instant as its distance from now ("in 3h", "5m ago").
fn fmt_time(ms: u64) -> String {
    let now = strata_format::now_ms();
    let span = |d: u64| {
        let s = d / 1000;
        match s {
            0..=119 => format!("{s}s"),
            120..=7199 => format!("{}m", s / 60),
            7200..=172_799 => format!("{}h", s / 3600),
            _ => format!("{}d", s / 86_400),
        }
    };
    if ms >= now {
        format!("in {}", span(ms - now))
    } else {
        format!("{} ago", span(now - ms))
    }
}

fn token_line(t: &Value) -> String {
    let mut out = format!("{}\t{}", s(t, "id"), t["scope"].as_str().unwrap_or("full"));
    if let Some(e) = t["expires_ms"].as_u64() {
        out += &format!(
            "\t{} {}",
            if e > strata_format::now_ms() {
                "expires"
            } else {
                "expired"
            },
            fmt_time(e)
        );
    }
    if let Some(r) = t["revoked_ms"].as_u64() {
        out += &format!("\trevoked {}", fmt_time(r));
    }
    if let Some(l) = t["label"].as_str() {
        out += &format!("\t{l}");
    }
    out
}

fn published(what: &str, p: &Value) -> String {
    format!(
        "{what} v{} {} ({} uploaded)",
        n(p, "version"),
        s(p, "state"),
        fmt_size(n(p, "bytes_uploaded"))
    )
}

/// The human form of a result.
pub fn human(view: View, v: &Value) -> String {
    match view {
        View::Template => format!(
            "template {}: {} disk, {} stored, manifest {}",
            s(v, "name"),
            fmt_size(n(v, "disk_size")),
            fmt_size(n(v, "stored_bytes")),
            s(v, "manifest")
        ),
        View::Templates => lines(v, |t| {
            format!(
                "{}\t{}\t{}",
                s(t, "name"),
                fmt_size(n(t, "disk_size")),
                s(t, "manifest")
            )
        }),
        View::Workspace => workspace_line(v),
        View::Workspaces => lines(v, |w| {
            format!(
                "{}\t{}\tv{}\t{}",
                s(w, "name"),
                s(w, "mode"),
                n(w, "head_version"),
                fmt_size(n(w, "disk_size"))
            )
        }),
        View::WorkspaceDetail => {
            let mut out = workspace_line(&v["workspace"]);
            let l = &v["lease"];
            match l["holder"].as_str() {
                Some(h) => out += &format!("\nlease: epoch {} held by {h}", n(l, "epoch")),
                None => out += &format!("\nlease: epoch {}, not held", n(l, "epoch")),
            }
            match v["export"].as_str() {
                Some(e) => out += &format!("\nattached here: {e}"),
                None => out += "\nnot attached here",
            }
            if let Some(st) = v.get("stats").filter(|s| !s.is_null()) {
                out += &format!(
                    "\nremote window: {} ({} ms); journal {}",
                    fmt_size(n(st, "window_bytes")),
                    n(st, "window_age_ms"),
                    fmt_size(n(st, "journal_bytes"))
                );
            }
            out
        }
        View::Log => lines(v, |c| {
            format!(
                "v{}\t{}\t{}\t{}",
                n(c, "version"),
                s(c, "kind"),
                fmt_size(n(c, "bytes")),
                s(c, "label")
            )
        }),
        View::Checkpoint => published("checkpoint", v),
        View::Rollback => published("rolled back: now", v),
        View::Detached => match v.get("version") {
            Some(_) => published("detached; published", v),
            None => "detached".into(),
        },
        View::Unmounted => match v.get("version") {
            Some(_) => published("unmounted and detached; published", v),
            None => "unmounted and detached".into(),
        },
        View::Resized => format!("disk is {}", fmt_size(n(v, "disk_size"))),
        View::Deleted(what) => format!("{what} {} deleted", s(v, "deleted")),
        View::Attached => s(v, "export").to_string(),
        View::Frozen => "frozen".into(),
        View::Thawed => "thawed".into(),
        View::Mount => format!(
            "{} mounted at {} ({}, {})",
            s(v, "workspace"),
            v["target"].as_str().unwrap_or(s(v, "dir")),
            s(v, "fstype"),
            v["device"].as_str().unwrap_or("-")
        ),
        View::Mounts => lines(v, |m| {
            format!(
                "{}\t{}\t{}",
                s(m, "workspace"),
                m["target"].as_str().unwrap_or(s(m, "dir")),
                s(m, "backend")
            )
        }),
        View::TenantCreated => format!(
            "tenant {} created; its token (shown once):\n{}",
            s(v, "tenant"),
            s(v, "token")
        ),
        View::Token => s(v, "token").to_string(),
        View::Tokens => lines(v, token_line),
        View::Revoked => format!("revoked {}", token_line(v)),
        View::Tenants => lines(v, |t| {
            format!(
                "{}\t{} workspaces\t{} tokens{}",
                s(t, "name"),
                n(t, "workspaces"),
                n(t, "tokens"),
                if t["deleting_ms"].is_u64() {
                    "\tbeing deleted"
                } else {
                    ""
                }
            )
        }),
        View::Quotas => format!("tenant {}: {}", s(v, "name"), quotas(&v["quotas"])),
        View::Usage => {
            let q = &v["quotas"];
            let of = |used: String, k: &str, size: bool| match q[k].as_u64() {
                Some(l) if size => format!("{used} of {}", fmt_size(l)),
                Some(l) => format!("{used} of {l}"),
                None => used,
            };
            format!(
                "tenant {}\nworkspaces: {}\ndisk bytes: {}\nattached here: {}\njournal here: {}\nlive in the store: {} in {} objects\nmetered: {:.0} byte-seconds",
                s(v, "tenant"),
                of(n(v, "workspaces").to_string(), "workspaces", false),
                of(fmt_size(n(v, "disk_bytes")), "disk_bytes", true),
                of(
                    n(v, "attached_here").to_string(),
                    "attached_per_node",
                    false
                ),
                of(
                    fmt_size(n(v, "local_journal_bytes")),
                    "local_journal_bytes",
                    true
                ),
                fmt_size(n(&v["store"], "live_bytes")),
                n(&v["store"], "live_objects"),
                v["meter"]["byte_seconds"].as_f64().unwrap_or(0.0),
            )
        }
        View::TenantDeleted => format!(
            "tenant {} deleted: {} workspaces, {} templates, {} relay streams, {} objects ({})",
            s(v, "tenant"),
            n(v, "workspaces"),
            n(v, "templates"),
            n(v, "streams"),
            n(v, "store_keys"),
            fmt_size(n(v, "store_bytes"))
        ),
        View::Gc => gc(v),
        View::Nodes => nodes(v),
        View::Written => format!(
            "wrote {} at {}; head v{}",
            fmt_size(n(v, "bytes")),
            n(v, "offset"),
            n(v, "head_version")
        ),
        View::Exported => format!("exported {} to {}", fmt_size(n(v, "bytes")), s(v, "out")),
    }
}

/// Prints a result: its JSON with `--json`, else its human form.
pub fn print(json: bool, view: View, v: &Value) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        let h = human(view, v);
        if !h.is_empty() {
            println!("{h}");
        }
    }
}

fn gc(v: &Value) -> String {
    let b = |k: &str| fmt_size(n(v, k));
    // Bytes stored and live are known only when the pass listed the store.
    let stored = if v["reconciled"] == true {
        format!(
            "live {} in {} object(s) and {} manifest(s) of {} stored (store listed)",
            b("live_bytes"),
            v["live_objects"],
            v["live_manifests"],
            b("stored_bytes")
        )
    } else {
        format!(
            "{} catalog change(s) and {} workspace(s)' retention looked at (--reconcile marks everything and lists the store)",
            v["changes"], v["retention_looked"]
        )
    };
    let failed: String = v["failed_tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            format!(
                "\ntenant {} not collected: {}",
                f["tenant"].as_str().unwrap_or("?"),
                f["error"].as_str().unwrap_or("?")
            )
        })
        .collect();
    format!(
        "{}{} checkpoint(s) expired, {} purged; {stored}; \
         unreferenced {} ({} key(s)); condemned {} key(s) now; deleted {} key(s), {} reclaimed ({} ms){failed}",
        if v["dry_run"] == true { "dry run: " } else { "" },
        v["checkpoints_expired"],
        v["checkpoints_purged"],
        b("unreferenced_bytes"),
        v["unreferenced_keys"],
        v["condemned"],
        v["deleted_keys"],
        b("deleted_bytes"),
        v["duration_ms"]
    )
}

/// One line per node, one indented line per workspace it serves.
fn nodes(v: &Value) -> String {
    let mut out = vec![];
    for node in v["nodes"].as_array().into_iter().flatten() {
        let alive = match node.get("alive").and_then(|a| a.as_bool()) {
            Some(true) => "alive",
            Some(false) => "silent",
            None => "",
        };
        out.push(format!(
            "{}  {}  last seen {} ms ago  {}",
            node["node"].as_str().unwrap_or("?"),
            node["url"].as_str().unwrap_or("-"),
            node["seen_ago_ms"],
            alive
        ));
        for a in node["attached"].as_array().into_iter().flatten() {
            out.push(format!(
                "  {}/{}  {}  epoch {}  head v{}  remote window {} ({} ms)",
                s(a, "tenant"),
                s(a, "workspace"),
                s(a, "mode"),
                a["epoch"],
                a["head_version"],
                fmt_size(n(a, "remote_window_bytes")),
                a["remote_window_age_ms"]
            ));
        }
    }
    out.join("\n")
}

/// Fails with a usage error of the CLI itself (a missing flag, a verb that needs a daemon):
/// reported as the API reports an invalid request, exit 2.
pub fn usage<T>(m: impl Into<String>) -> anyhow::Result<T> {
    Err(crate::client::ApiFailure::refused(400, "invalid", m).into())
}

/// How an error is reported: the API's kind and status, whichever way the verb ran.
pub struct Failure {
    pub kind: String,
    pub status: u16,
    pub message: String,
    pub retryable: bool,
}

impl Failure {
    pub fn of(e: &anyhow::Error) -> Failure {
        if let Some(r) = e.downcast_ref::<crate::client::ApiFailure>() {
            return Failure {
                kind: r.kind.clone(),
                status: r.status,
                message: r.msg.clone(),
                retryable: r.retryable,
            };
        }
        // Catalog and store errors met outside the engine are classified as the engine's.
        let wrapped = e
            .downcast_ref::<strata_catalog::CatalogError>()
            .map(|c| strata_engine::Error::Catalog(c.clone()))
            .or_else(|| {
                e.downcast_ref::<strata_store::StoreError>()
                    .map(|s| strata_engine::Error::Store(s.clone()))
            });
        if let Some(err) = wrapped
            .as_ref()
            .or(e.downcast_ref::<strata_engine::Error>())
        {
            let (status, kind) = strata_daemon::classify(err);
            return Failure {
                kind: kind.into(),
                status: status.as_u16(),
                message: format!("{e:#}"),
                retryable: err.is_retryable(),
            };
        }
        Failure {
            kind: "error".into(),
            status: 500,
            message: format!("{e:#}"),
            retryable: false,
        }
    }

    /// 2: the request was refused (any 4xx: fix it, or wait for the state it conflicts with);
    /// 1: anything else (something failed; a retry may help).
    pub fn exit_code(&self) -> u8 {
        if (400..500).contains(&self.status) {
            2
        } else {
            1
        }
    }

    /// Reports the error on stderr: the API's error body with `--json`, a line otherwise.
    pub fn report(&self, json: bool) {
        if json {
            let body = serde_json::json!({"error": {
                "kind": self.kind,
                "message": self.message,
                "retryable": self.retryable,
            }});
            // One line, so that it can be told from log lines on the same stream.
            eprintln!("{body}");
        } else {
            eprintln!("strata: {} ({})", self.message, self.kind);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The same result reads the same whichever way it came: a workspace list is a table, a
    /// template is a line (it was Rust debug output locally and pretty JSON remotely).
    #[test]
    fn human_forms() {
        let ws = json!([{"name": "a", "mode": "durable", "head_version": 3, "disk_size": 1048576}]);
        assert_eq!(human(View::Workspaces, &ws), "a\tdurable\tv3\t1.0 MiB");
        let t = json!({"name": "py", "disk_size": 4096, "stored_bytes": 100, "manifest": "ab"});
        assert_eq!(
            human(View::Template, &t),
            "template py: 4.0 KiB disk, 100 B stored, manifest ab"
        );
        assert_eq!(
            human(View::Deleted("workspace"), &json!({"deleted": "w"})),
            "workspace w deleted"
        );
        assert_eq!(human(View::Detached, &Value::Null), "detached");
    }

    #[test]
    fn exit_codes_follow_the_kind() {
        let f = Failure::of(&anyhow::Error::new(strata_engine::Error::Catalog(
            strata_catalog::CatalogError::NotFound {
                what: "template",
                name: "x".into(),
            },
        )));
        assert_eq!((f.kind.as_str(), f.exit_code()), ("not_found", 2));
        let f = Failure::of(&anyhow::Error::new(strata_engine::Error::Catalog(
            strata_catalog::CatalogError::unavailable("down"),
        )));
        assert_eq!((f.exit_code(), f.retryable), (1, true));
        // A conflict is a refusal (a lease held elsewhere, another front-end serving it).
        let f = Failure::of(&anyhow::Error::new(strata_engine::Error::Catalog(
            strata_catalog::CatalogError::LeaseHeld {
                holder: "n".into(),
                epoch: 1,
                expires_in_ms: 10,
            },
        )));
        assert_eq!((f.kind.as_str(), f.exit_code()), ("conflict", 2));
        let f = Failure::of(&usage::<()>("give --size").unwrap_err());
        assert_eq!((f.kind.as_str(), f.exit_code()), ("invalid", 2));
    }
}
