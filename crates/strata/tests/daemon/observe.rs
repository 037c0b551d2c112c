//! Request ids, spans in the JSON log and per-route metrics, through a real daemon.

use reqwest::StatusCode;
use serde_json::Value;

use crate::common::*;

/// Every request has an id (the client's if short, else the daemon's), runs in a span that
/// names its tenant and workspace (in the JSON log), and is timed by route template: a
/// tenant's names never become metric labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_carry_ids_spans_and_route_metrics() {
    let d = tempfile::tempdir().unwrap();
    let log = d.path().join("daemon.log");
    let daemon = serve_logged(
        &d.path().join("a"),
        &[
            ("STRATA_LOG", "tower_http=debug,strata_daemon=info"),
            ("STRATA_LOG_FORMAT", "json"),
        ],
        &log,
    );
    let a = tenant(&daemon.url, "alpha").await;
    let call = |id: Option<String>| {
        let mut r = a
            .http
            .get(format!("{}/v1/workspaces/nope-7", daemon.url))
            .bearer_auth(&a.token);
        if let Some(id) = id {
            r = r.header("x-request-id", id);
        }
        async move {
            let resp = r.send().await.unwrap();
            assert_eq!(resp.status(), StatusCode::NOT_FOUND);
            resp.headers()["x-request-id"].to_str().unwrap().to_string()
        }
    };
    assert_eq!(call(Some("job-42".into())).await, "job-42");
    let made = call(Some("x".repeat(500))).await;
    assert!(made.starts_with("req-"), "{made}");
    let other = call(None).await;
    assert!(other.starts_with("req-") && other != made, "{other}");

    let (_, m) = Api::new(&daemon.url, ADMIN).get("/metrics").await;
    let m = m.as_str().unwrap();
    assert!(
        m.contains(
            "strata_http_request_seconds_count{method=\"GET\",route=\"/v1/workspaces/{name}\",status=\"404\"} 3"
        ),
        "{m}"
    );
    assert!(!m.contains("nope-7"), "a path's name became a label: {m}");

    drop(daemon);
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["span"]["request_id"] == "job-42" && v["span"]["tenant"] == "alpha")
        .unwrap_or_else(|| panic!("no JSON log line of request job-42 naming its tenant:\n{text}"));
    assert_eq!(line["span"]["workspace"], "nope-7", "{line}");
}

/// A request that only touches the catalog is held to the request timeout: with the catalog
/// locked by another process (SQLite `BEGIN EXCLUSIVE`, held 3 s; the catalog itself waits up
/// to 10 s for it), a create gets a retryable 503 in the error body within the timeout
/// instead of hanging the client; once the lock is gone, requests are answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_catalog_gets_a_timely_retryable_503() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let daemon = serve(&data, &["--request-timeout", "300ms"]);
    let a = tenant(&daemon.url, "alpha").await;
    let db = data.join("catalog.db");
    let mut holder = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import sqlite3, sys, time\n\
             c = sqlite3.connect(sys.argv[1], isolation_level=None)\n\
             c.execute('BEGIN EXCLUSIVE')\n\
             print('locked', flush=True)\n\
             time.sleep(3)\n\
             c.execute('COMMIT')\n",
        )
        .arg(&db)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "locked");
    let started = std::time::Instant::now();
    let (s, v) = a
        .post(
            "/v1/workspaces",
            serde_json::json!({"name": "w", "size": 1048576}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["kind"], "unavailable", "{v}");
    assert_eq!(v["error"]["retryable"], true, "{v}");
    assert!(took < std::time::Duration::from_secs(2), "{took:?}");
    holder.wait().unwrap();
    // Answered again; the create either completed behind the 503 or can be repeated.
    let (s, v) = a
        .post(
            "/v1/workspaces",
            serde_json::json!({"name": "w", "size": 1048576}),
        )
        .await;
    assert!(
        s == StatusCode::CREATED || s == StatusCode::CONFLICT,
        "{s} {v}"
    );
    assert_eq!(a.get("/v1/workspaces/w").await.0, StatusCode::OK);
}
