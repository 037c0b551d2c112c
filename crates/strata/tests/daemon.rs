//! `strata serve` end to end, through HTTP and NBD only: lifecycle, tenant isolation, bad
//! input, kill -9 and resume, restore on a second daemon with another data directory.

use std::path::Path;
use std::process::Command;

use reqwest::StatusCode;
use serde_json::{json, Value};
use strata_nbd::client::Client;

mod common;
use common::*;
#[path = "daemon/observe.rs"]
mod observe;
#[path = "daemon/retention.rs"]
mod retention;
#[path = "daemon/schema.rs"]
mod schema;
use schema::conforms;

/// Another node: its own data directory, sharing node A's catalog and object store.
fn second_node(data_a: &Path, data_b: &Path, token: &str) -> (Daemon, Api) {
    let cat = format!("sqlite:{}", data_a.join("catalog.db").display());
    let store = format!("file:{}", data_a.join("objects").display());
    let other = serve(data_b, &["--catalog", &cat, "--store", &store]);
    let api = Api::new(&other.url, token);
    (other, api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_isolation_and_bad_input() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let daemon = serve(&data, &[]);
    let a = tenant(&daemon.url, "alpha").await;
    let b = tenant(&daemon.url, "beta").await;
    let (s, v) = a.get("/v1/health").await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ok")));

    // Template from a host directory, workspace, attach, write through NBD, checkpoint, fork.
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("hello.txt"), "hello from the template\n").unwrap();
    let (s, v) = a.template_from_dir("base", &src, 32 << 20).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = a
        .post(
            "/v1/workspaces",
            json!({"name": "w1", "template": "base", "mode": "durable"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, att) = a.post("/v1/workspaces/w1/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let (_, att2) = a.post("/v1/workspaces/w1/attach", json!({})).await;
    assert_eq!(att["export"], att2["export"], "attach is idempotent");
    let sock = att["socket"].as_str().unwrap().to_string();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let mut c = Client::connect_unix(Path::new(&sock), "w1").await.unwrap();
    c.write(20 << 20, &[0x42; 8192], false).await.unwrap();
    c.flush().await.unwrap();
    let (s, cp) = a
        .post(
            "/v1/workspaces/w1/checkpoint",
            json!({"label": "after write"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{cp}");
    let version = cp["version"].as_u64().unwrap();
    let (s, v) = a
        .post(
            "/v1/workspaces/w1/fork",
            json!({"name": "w2", "version": version}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, view) = a.get("/v1/workspaces/w1").await;
    assert_eq!(view["attached"], true);
    assert!(view["stats"]["window_bytes"].is_u64());
    let (_, log) = a.get("/v1/workspaces/w1/log").await;
    assert!(log
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["label"] == "after write"));
    let (s, _) = a.post("/v1/workspaces/w1/freeze", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = a.post("/v1/workspaces/w1/thaw", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    // /metrics names every tenant's workspaces: not for anonymous callers or tenants.
    let anon = reqwest::get(format!("{}/metrics", daemon.url))
        .await
        .unwrap();
    assert_eq!(anon.status(), StatusCode::UNAUTHORIZED);
    let (s, _) = a.get("/metrics").await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "a tenant token does not read metrics"
    );
    let (s, metrics) = Api::new(&daemon.url, ADMIN).get("/metrics").await;
    assert_eq!(s, StatusCode::OK);
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics.contains("strata_volume_remote_window_bytes{tenant=\"alpha\",workspace=\"w1\"}"),
        "{metrics}"
    );
    // Typed, documented, in base units: every family has HELP and TYPE, none is in
    // milliseconds, and the journal's size is real (it read 0 whenever the writer was busy).
    let families: Vec<&str> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    assert!(families.len() > 30, "{metrics}");
    for f in &families {
        let name = f.split(' ').next().unwrap();
        assert!(
            metrics.contains(&format!("# HELP {name} ")),
            "{name} has no HELP"
        );
        assert!(!name.ends_with("_ms"), "{name} is not in a base unit");
    }
    let journal: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("strata_volume_journal_bytes{tenant=\"alpha\",workspace=\"w1\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no journal size for w1: {metrics}"));
    assert!(journal > 0, "{journal}");
    for name in [
        "strata_checkpoint_seconds_count 1",
        "strata_fork_seconds_count 1",
        "strata_nbd_bytes_total{command=\"write\"} 8192",
    ] {
        assert!(metrics.contains(name), "{name}: {metrics}");
    }

    // Tenant isolation: beta sees nothing of alpha's, on every endpoint, and changes nothing.
    for (m, p, body) in [
        ("GET", "/v1/workspaces/w1", None),
        ("GET", "/v1/workspaces/w1/log", None),
        ("POST", "/v1/workspaces/w1/attach", Some(json!({}))),
        ("POST", "/v1/workspaces/w1/detach", Some(json!({}))),
        ("POST", "/v1/workspaces/w1/checkpoint", Some(json!({}))),
        (
            "POST",
            "/v1/workspaces/w1/fork",
            Some(json!({"name": "stolen"})),
        ),
        (
            "POST",
            "/v1/workspaces/w1/rollback",
            Some(json!({"version": 1})),
        ),
        ("POST", "/v1/workspaces/w1/freeze", Some(json!({}))),
        (
            "POST",
            "/v1/workspaces/w1/resize",
            Some(json!({"size": 1u64 << 40})),
        ),
        ("DELETE", "/v1/workspaces/w1", None),
        ("GET", "/v1/templates/base", None),
        ("DELETE", "/v1/templates/base", None),
    ] {
        let (s, v) = b.call(m.parse().unwrap(), p, body).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{m} {p}: {v}");
        assert_eq!(v["error"]["kind"], "not_found");
    }
    let (s, v) = b
        .post("/v1/workspaces", json!({"name": "mine", "from": "w1"}))
        .await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "forking another tenant's workspace: {v}"
    );
    assert_eq!(b.get("/v1/workspaces").await.1, json!([]));
    assert!(a.get("/v1/workspaces/stolen").await.0 == StatusCode::NOT_FOUND);
    assert_eq!(a.get("/v1/workspaces/w1").await.1["attached"], true);

    // Authentication.
    let nobody = Api::new(&daemon.url, "st_wrong");
    assert_eq!(
        nobody.get("/v1/workspaces").await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        a.post("/v1/tenants", json!({"name": "x"})).await.0,
        StatusCode::FORBIDDEN
    );
    let admin = Api::new(&daemon.url, ADMIN);
    // The nodes view: this node, alive, serving w1 with its lease epoch.
    let (s, v) = admin.get("/v1/nodes").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let me = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == v["this"])
        .cloned()
        .unwrap_or_default();
    assert_eq!(me["alive"], true, "{v}");
    assert!(
        me["attached"].as_array().is_some_and(|a| a
            .iter()
            .any(|w| w["workspace"] == "w1" && w["epoch"].as_u64() > Some(0))),
        "{v}"
    );
    assert_eq!(
        a.get("/v1/nodes").await.0,
        StatusCode::FORBIDDEN,
        "admin only"
    );
    assert_eq!(admin.get("/v1/workspaces").await.0, StatusCode::FORBIDDEN);

    // A path or query parameter of the wrong type is refused in the API's error body too
    // (axum's own refusal is plain text, which clients following the OpenAPI document
    // cannot read).
    for (s, v) in [
        a.delete("/v1/workspaces/w1/checkpoints/seven").await,
        a.put_bytes("/v1/templates/t?format=floppy", vec![0; 512])
            .await,
    ] {
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["kind"], "invalid", "{v}");
    }

    // Bad input: a 4xx with a JSON message, and nothing changed.
    for (body, why) in [
        (json!({"name": "../x", "size": 1048576}), "hostile name"),
        (json!({"name": "a/b", "size": 1048576}), "slash"),
        (json!({"name": "a\u{0}b", "size": 1048576}), "NUL"),
        (
            json!({"name": "x".repeat(300), "size": 1048576}),
            "too long",
        ),
        (json!({"name": "ok", "size": -5}), "negative size"),
        (json!({"name": "ok", "size": 1u64 << 62}), "absurd size"),
        (json!({"name": "ok", "size": 0}), "zero size"),
        (
            json!({"name": "ok", "size": 4096, "colour": "blue"}),
            "unknown field",
        ),
        (json!({"name": "ok"}), "no source"),
        (
            json!({"name": "ok", "size": 4096, "template": "base"}),
            "two sources",
        ),
        (
            json!({"name": "ok", "template": "nope"}),
            "missing template",
        ),
    ] {
        let (s, v) = a.post("/v1/workspaces", body).await;
        assert!(s.is_client_error(), "{why}: {s} {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{why}: {v}"
        );
    }
    // Every endpoint that takes a body: malformed JSON, unknown fields, hostile values.
    for (path, bodies) in [
        (
            "/v1/templates",
            vec![
                json!({"name": "../t", "from_dir": "/tmp"}),
                json!({"name": "t"}),
                json!({"name": "t", "from_dir": "/nonexistent/dir"}),
                json!({"name": "t", "from_dir": "/tmp", "from_image": "/x"}),
                json!({"name": "t", "x": 1}),
            ],
        ),
        (
            "/v1/workspaces/w1/fork",
            vec![
                json!({"name": "a/b"}),
                json!({"name": "ok", "version": -1}),
                json!({"name": "ok", "extra": true}),
                json!({}),
            ],
        ),
        (
            "/v1/workspaces/w1/rollback",
            vec![
                json!({"version": "one"}),
                json!({}),
                json!({"version": 1, "now": true}),
            ],
        ),
        (
            "/v1/workspaces/w1/checkpoint",
            vec![
                json!({"label": "bell\u{7}"}),
                json!({"label": "x".repeat(300)}),
                json!({"labels": "a"}),
            ],
        ),
    ] {
        for b in bodies {
            let (s, v) = a.post(path, b.clone()).await;
            assert!(s.is_client_error(), "{path} {b}: {s} {v}");
            assert!(v["error"]["message"].as_str().is_some(), "{path} {b}: {v}");
        }
        let raw = reqwest::Client::new()
            .post(format!("{}{path}", daemon.url))
            .bearer_auth(&a.token)
            .header("content-type", "application/json")
            .body("[1,")
            .send()
            .await
            .unwrap();
        assert_eq!(raw.status(), StatusCode::BAD_REQUEST, "{path}");
    }
    let (s, v) = admin.post("/v1/tenants", json!({"name": "../evil"})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (_, log) = a.get("/v1/workspaces/w1/log").await;
    assert!(
        log.as_array()
            .unwrap()
            .iter()
            .all(|c| c["kind"] != "rollback"),
        "a refused request changed history"
    );
    let raw = reqwest::Client::new()
        .post(format!("{}/v1/workspaces", daemon.url))
        .bearer_auth(&a.token)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), StatusCode::BAD_REQUEST);
    let huge = reqwest::Client::new()
        .post(format!("{}/v1/workspaces", daemon.url))
        .bearer_auth(&a.token)
        .header("content-type", "application/json")
        .body(format!("{{\"name\": \"{}\"}}", "x".repeat(200_000)))
        .send()
        .await
        .unwrap();
    assert_eq!(huge.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let names: Vec<String> = a
        .get("/v1/workspaces")
        .await
        .1
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, vec!["w1", "w2"]);
    assert_eq!(
        a.delete("/v1/workspaces/w2").await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(a.get("/v1/workspaces/w2").await.0, StatusCode::NOT_FOUND);

    // The OpenAPI document, generated from the handlers and types (strata-daemon checks the
    // committed copy against the generator), is what is served; every operation it lists is
    // routed (none reaches the fallback), and responses match their schemas.
    let (_, doc) = a.get("/v1/openapi.json").await;
    let committed: Value =
        serde_json::from_str(include_str!("../../strata-daemon/openapi.json")).unwrap();
    assert_eq!(doc, committed);
    let mut operations = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let url = format!(
                "{}{}",
                daemon.url,
                path.replace("{name}", "zz-probe")
                    .replace("{stream}", "zz-probe")
                    .replace("{version}", "1")
            );
            let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let mut r = a.http.request(m, url).bearer_auth(ADMIN);
            if path == "/v1/gc" {
                // A real pass would compact w1 under the rest of this test.
                r = r.json(&json!({"dry_run": true}));
            }
            let r = r.send().await.unwrap();
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            assert!(
                !body.contains("no such endpoint") && status != StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path} is documented but not routed: {status} {body}"
            );
            operations += 1;
        }
    }
    assert!(operations >= 35, "{operations} operations documented");
    let schemas = &doc["components"]["schemas"];
    let (_, view) = a.get("/v1/workspaces/w1").await;
    conforms(schemas, "WorkspaceView", &view);
    let (_, list) = a.get("/v1/workspaces").await;
    for w in list.as_array().unwrap() {
        conforms(schemas, "Workspace", w);
    }
    let (_, log) = a.get("/v1/workspaces/w1/log").await;
    for c in log.as_array().unwrap() {
        conforms(schemas, "Checkpoint", c);
    }
    let (_, e) = a.get("/v1/workspaces/nope").await;
    conforms(schemas, "ErrorBody", &e);
    conforms(schemas, "Published", &cp);
    for p in [
        "/v1/workspaces/{name}/attach",
        "/v1/workspaces/{name}/freeze",
        "/v1/templates",
        "/v1/tenants",
        "/v1/nodes",
        "/v1/gc",
        "/v1/relay",
        "/v1/relay/{stream}",
        "/v1/relay/{stream}/{name}",
        "/metrics",
    ] {
        assert!(
            doc["paths"].get(p).is_some(),
            "{p} missing from openapi.json"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_resume_and_restore_on_another_daemon() {
    let d = tempfile::tempdir().unwrap();
    let data_a = d.path().join("a");
    let daemon = serve(&data_a, &[]);
    let a = tenant(&daemon.url, "alpha").await;
    let (s, v) = a
        .post("/v1/workspaces", json!({"name": "w", "size": 16 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
    let sock = att["socket"].as_str().unwrap().to_string();
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    c.write(0, &[7; 65536], false).await.unwrap();
    c.flush().await.unwrap();
    drop(c);
    drop(daemon); // SIGKILL
                  // Restart: the workspace is served again at the same socket, with every flushed write.
    let daemon = serve(&data_a, &[]);
    let mut c = Client::connect_unix(Path::new(&sock), "w").await.unwrap();
    assert!(c.read(0, 65536).await.unwrap().iter().all(|&b| b == 7));
    c.write(65536, &[8; 4096], true).await.unwrap();
    let a = Api::new(&daemon.url, &a.token);
    let (s, v) = a.post("/v1/workspaces/w/checkpoint", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = a.post("/v1/workspaces/w/fork", json!({"name": "f"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // A second daemon, its own data directory, sharing the catalog and the object store.
    let (_other, b) = second_node(&data_a, &d.path().join("b"), &a.token);
    // w is attached on node a: node b is refused, with the holder named.
    let (s, v) = b.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    // f is a fork of the live workspace: node a holds it until it has published its data
    // (at once, in the background) and let go; until then node b is refused, never served the
    // base it started from.
    let started = std::time::Instant::now();
    let att = loop {
        let (s, att) = b.post("/v1/workspaces/f/attach", json!({})).await;
        if s == StatusCode::OK {
            break att;
        }
        assert!(
            s == StatusCode::CONFLICT || s == StatusCode::SERVICE_UNAVAILABLE,
            "{s} {att}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the live fork never became attachable elsewhere: {att}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "f")
        .await
        .unwrap();
    assert!(c.read(0, 65536).await.unwrap().iter().all(|&b| b == 7));
    assert!(c.read(65536, 4096).await.unwrap().iter().all(|&b| b == 8));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_drives_the_daemon() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(&d.path().join("a"), &[]);
    let cli = |token: &str, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .env("STRATA_URL", &daemon.url)
            .env("STRATA_TOKEN", token)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (c, o, e) = cli(ADMIN, &["--json", "tenant", "create", "gamma"]);
    assert_eq!(c, 0, "{e}");
    let token = serde_json::from_str::<Value>(&o).unwrap()["token"]
        .as_str()
        .unwrap()
        .to_string();
    let (c, _, e) = cli(
        &token,
        &["ws", "create", "w", "--size", "4MiB", "--mode", "sync"],
    );
    assert_eq!(c, 0, "{e}");
    let (c, o, e) = cli(&token, &["ws", "attach", "w"]);
    assert_eq!(c, 0, "{e}");
    assert!(o.trim().starts_with("nbd+unix:///w?socket="), "{o}");
    let (c, o, e) = cli(&token, &["--json", "ws", "checkpoint", "w", "--label", "v"]);
    assert_eq!(c, 0, "{e}");
    assert!(serde_json::from_str::<Value>(&o).unwrap()["version"]
        .as_u64()
        .is_some());
    let (c, _, e) = cli(&token, &["ws", "fork", "w@1", "w2"]);
    assert_eq!(c, 0, "{e}");
    let (c, o, _) = cli(&token, &["--json", "ws", "list"]);
    assert_eq!(c, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&o)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let (c, _, e) = cli(&token, &["ws", "show", "nope"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("not_found"), "{e}");
    // One presentation and one exit code, whichever way a verb runs: the same verbs on a
    // local data directory print the same forms (they printed a table here and JSON there,
    // Rust debug output for `template show`, and exited 1 locally on a missing template).
    let data = d.path().join("local");
    let local = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("--data")
            .arg(&data)
            .args(args)
            .env_remove("STRATA_URL")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (c, _, e) = local(&["ws", "create", "w", "--size", "4MiB", "--mode", "sync"]);
    assert_eq!(c, 0, "{e}");
    // The daemon's own data directory is its alone: a CLI process there is sent to it.
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--data")
        .arg(d.path().join("a"))
        .args(["ws", "list"])
        .env_remove("STRATA_URL")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("a daemon serves") && e.contains(&daemon.url),
        "{e}"
    );
    let (_, remote_list, _) = cli(&token, &["ws", "list"]);
    let (_, local_list, _) = local(&["ws", "list"]);
    assert_eq!(
        remote_list.lines().next(),
        Some("w\tsync\tv2\t4.0 MiB"),
        "{remote_list}"
    );
    assert_eq!(local_list.trim(), "w\tsync\tv1\t4.0 MiB", "{local_list}");
    for (c, out, e) in [
        cli(&token, &["template", "show", "nope"]),
        local(&["template", "show", "nope"]),
    ] {
        assert_eq!(c, 2, "{out}{e}");
        assert!(e.contains("not_found"), "{e}");
    }
    for (c, out, e) in [
        cli(&token, &["--json", "ws", "show", "nope"]),
        local(&["--json", "ws", "show", "nope"]),
    ] {
        assert_eq!((c, out.as_str()), (2, ""), "{e}");
        let line = e
            .lines()
            .find(|l| l.starts_with("{\"error\""))
            .unwrap_or_default();
        let v: Value = serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {e}"));
        assert_eq!(v["error"]["kind"], "not_found", "{v}");
        assert_eq!(v["error"]["retryable"], false, "{v}");
    }
    let (c, out, _) = local(&["--json", "ws", "create", "x"]);
    assert_eq!(c, 2, "a usage error: {out}");
    let (c, _, e) = cli("wrong", &["ws", "list"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("token"), "{e}");
    let (c, _, e) = cli(&token, &["ws", "detach", "w"]);
    assert_eq!(c, 0, "{e}");
}

/// A real ext4 through the daemon's NBD export (nbdfuse + loop), checkpointed, then read back
/// on a second daemon with another data directory that shares only the catalog and the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_written_on_one_daemon_reads_back_on_another() {
    if !can_mount() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let data_a = d.path().join("a");
    let daemon = serve(&data_a, &[]);
    let a = tenant(&daemon.url, "alpha").await;
    let (s, v) = a
        .post("/v1/workspaces", json!({"name": "fs", "size": 128 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = a.post("/v1/workspaces/fs/attach", json!({})).await;
    let uri = att["export"].as_str().unwrap().to_string();
    let mount = |uri: &str, tag: &str, body: &str| mount_script(d.path(), uri, tag, body);
    let write = mount(
        &uri,
        "w",
        r#"mkfs.ext4 -q -F "$file"
loop=$(losetup -f --show "$file")
mount "$loop" "$mnt"
mkdir "$mnt/agent"
for i in $(seq 1 10); do head -c $((i * 50000)) /dev/urandom > "$mnt/agent/out$i"; done
(cd "$mnt/agent" && sha256sum out* > ../SUMS)
umount "$mnt"
e2fsck -f -n "$loop""#,
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash").arg("-c").arg(write).output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (s, cp) = a
        .post(
            "/v1/workspaces/fs/checkpoint",
            json!({"label": "ext4 written"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{cp}");
    let (s, v) = a
        .post(
            "/v1/workspaces/fs/fork",
            json!({"name": "fs2", "version": cp["version"]}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Node B: its own data directory; restores the fork from the head alone.
    let (_other, b) = second_node(&data_a, &d.path().join("b"), &a.token);
    let (s, att) = b.post("/v1/workspaces/fs2/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let uri_b = att["export"].as_str().unwrap().to_string();
    let read = mount(
        &uri_b,
        "r",
        r#"loop=$(losetup -f --show -r "$file")
e2fsck -f -n "$loop"
mount -o ro "$loop" "$mnt"
(cd "$mnt/agent" && sha256sum -c --quiet ../SUMS)
ls "$mnt/agent" | wc -l"#,
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash").arg("-c").arg(read).output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .map(str::trim),
        Some("10")
    );
}
