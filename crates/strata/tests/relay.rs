//! The durable relay end to end against the real daemon: idempotent PUTs, conflicts that keep
//! the original, stream tokens that can only append, bad input, uploads to the object store
//! and reads from another node; kill -9 mid-body, crash points between fsync, link and meta;
//! and a PostgreSQL point-in-time recovery from WAL archived through the relay; local copies
//! evicted once uploaded, and a name that keeps its first file across nodes.

mod common;
#[path = "relay/eviction.rs"]
mod eviction;

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Put {
    status: StatusCode,
    body: Value,
}

async fn put(url: &str, token: &str, path: &str, data: Vec<u8>) -> Put {
    let r = reqwest::Client::new()
        .put(format!("{url}{path}"))
        .bearer_auth(token)
        .body(data)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    Put {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
    }
}

async fn get_bytes(url: &str, token: &str, path: &str) -> (StatusCode, Vec<u8>, Option<String>) {
    let r = reqwest::Client::new()
        .get(format!("{url}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let s = r.status();
    let h = r
        .headers()
        .get("x-strata-blake3")
        .map(|v| v.to_str().unwrap().to_string());
    (s, r.bytes().await.unwrap().to_vec(), h)
}

fn blake3_hex(b: &[u8]) -> String {
    blake3::hash(b).to_hex().to_string()
}

/// Node b: its own data directory, sharing a's catalog and object store.
fn node_b(data_a: &Path, data_b: &Path) -> Daemon {
    let cat = format!("sqlite:{}", data_a.join("catalog.db").display());
    let store = format!("file:{}", data_a.join("objects").display());
    serve(data_b, &["--catalog", &cat, "--store", &store])
}

async fn wait_uploaded(api: &Api, stream: &str) {
    let t0 = Instant::now();
    loop {
        let (s, v) = api.get("/v1/relay").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let st = v
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == stream)
            .cloned()
            .unwrap();
        if st["pending_files"] == 0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never uploaded: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tmp_files(data: &Path) -> Vec<String> {
    let mut out = vec![];
    let mut stack = vec![data.join("relay")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if e.file_name().to_string_lossy().starts_with(".tmp-") {
                out.push(e.path().display().to_string());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_puts_are_durable_idempotent_and_scoped() {
    let d = tempfile::tempdir().unwrap();
    let data_a = d.path().join("a");
    let a = serve(&data_a, &["--relay-max-bytes", "1MiB"]);
    let alpha = tenant(&a.url, "alpha").await;
    let beta = tenant(&a.url, "beta").await;
    let (s, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    assert_eq!(s, StatusCode::CREATED, "{art}");
    let art_token = art["token"].as_str().unwrap().to_string();
    let (s, v) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, wal) = alpha
        .post("/v1/relay", json!({"name": "wal", "sync": true}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{wal}");
    let wal_token = wal["token"].as_str().unwrap().to_string();

    // New file: 201 with its hash; the same bytes again: 200; other bytes: 409, original kept.
    let one: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    assert_eq!(p.body["blake3"], blake3_hex(&one));
    assert_eq!(p.body["size"], 300_000);
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(p.status, StatusCode::OK, "idempotent retry: {}", p.body);
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", vec![1; 10]).await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);
    let (s, got, h) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!(
        (s, got == one, h),
        (StatusCode::OK, true, Some(blake3_hex(&one)))
    );
    // HEAD answers with the hash and no body.
    let r = reqwest::Client::new()
        .head(format!("{}/v1/relay/art/report.tar", a.url))
        .bearer_auth(&alpha.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["x-strata-blake3"].to_str().unwrap(),
        blake3_hex(&one)
    );
    // A sync stream answers once the object store has it.
    let seg = vec![7u8; 16384];
    let p = put(
        &a.url,
        &wal_token,
        "/v1/relay/wal/000000010000000000000001",
        seg.clone(),
    )
    .await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    assert!(p.body["uploaded_ms"].as_u64().is_some(), "{}", p.body);

    // Scopes and tenancy.
    let no = |s: StatusCode, want: StatusCode, what: &str| assert_eq!(s, want, "{what}");
    no(
        put(&a.url, &art_token, "/v1/relay/wal/x", vec![1])
            .await
            .status,
        StatusCode::FORBIDDEN,
        "a stream token for another stream",
    );
    no(
        get_bytes(&a.url, &art_token, "/v1/relay/art/report.tar")
            .await
            .0,
        StatusCode::FORBIDDEN,
        "a stream token reading",
    );
    no(
        Api::new(&a.url, &art_token).get("/v1/workspaces").await.0,
        StatusCode::FORBIDDEN,
        "a stream token on the workspace API",
    );
    no(
        put(&a.url, "st_wrong", "/v1/relay/art/x", vec![1])
            .await
            .status,
        StatusCode::UNAUTHORIZED,
        "a wrong token",
    );
    no(
        put(&a.url, &beta.token, "/v1/relay/art/x", vec![1])
            .await
            .status,
        StatusCode::NOT_FOUND,
        "another tenant's stream",
    );
    no(
        get_bytes(&a.url, &beta.token, "/v1/relay/art/report.tar")
            .await
            .0,
        StatusCode::NOT_FOUND,
        "another tenant's file",
    );
    // Hostile names and sizes (raw requests: an HTTP client would normalise the dots): a 4xx,
    // nothing stored.
    for (path, want) in [
        ("/v1/relay/art/..", 400),
        ("/v1/relay/art/.hidden", 400),
        ("/v1/relay/art/a%2Fb", 400),
        ("/v1/relay/art/%2E%2E%2Fetc", 400),
        ("/v1/relay/..%2Fbeta/x", 400),
        ("/v1/relay/art/a%00b", 400),
        ("/v1/relay/nostream/x", 404),
    ] {
        let (status, body) = raw(&a.url, &alpha.token, path, 3, b"abc");
        assert_eq!(status, want, "{path}: {body}");
    }
    let (status, body) = raw(&a.url, &art_token, "/v1/relay/art/big", (1 << 20) + 1, b"");
    assert_eq!(status, 413, "declared too large: {body}");
    let p = put(
        &a.url,
        &art_token,
        "/v1/relay/art/big",
        vec![0; (1 << 20) + 1],
    )
    .await;
    assert_eq!(p.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", p.body);
    let (_, list) = alpha.get("/v1/relay/art").await;
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["report.tar"], "{list}");
    assert!(tmp_files(&data_a).is_empty(), "{:?}", tmp_files(&data_a));

    // Uploads drain; another node then serves the files from the object store alone.
    wait_uploaded(&alpha, "art").await;
    let (s, m) = a.api(ADMIN).get("/metrics").await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        m.as_str()
            .unwrap()
            .contains("strata_relay_upload_lag_seconds"),
        "{m}"
    );
    drop(a);
    let b = node_b(&data_a, &d.path().join("b"));
    let (s, got, _) = get_bytes(&b.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!((s, got == one), (StatusCode::OK, true));
    let (s, got, _) = get_bytes(
        &b.url,
        &alpha.token,
        "/v1/relay/wal/000000010000000000000001",
    )
    .await;
    assert_eq!((s, got == seg), (StatusCode::OK, true));
    // The name is taken across nodes too: other bytes are refused on b.
    let (_, tok) = alpha_on(&b, &alpha).post("/v1/relay/wal", json!({})).await;
    let wal2 = tok["token"].as_str().unwrap().to_string();
    let p = put(
        &b.url,
        &wal2,
        "/v1/relay/wal/000000010000000000000001",
        vec![9; 10],
    )
    .await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);
    let p = put(
        &b.url,
        &wal2,
        "/v1/relay/wal/000000010000000000000001",
        seg.clone(),
    )
    .await;
    assert!(
        p.status.is_success(),
        "same bytes on another node: {}",
        p.body
    );
}

/// One raw HTTP/1.1 PUT (the path is sent exactly as given); returns the status and body.
fn raw(url: &str, token: &str, path: &str, len: usize, body: &[u8]) -> (u16, String) {
    let mut s = partial_put(url, token, path, len, 0);
    s.write_all(body).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

fn alpha_on(node: &Daemon, alpha: &Api) -> Api {
    Api::new(&node.url, &alpha.token)
}

/// Sends the head of a PUT and `send` of its `len` body bytes over a raw connection.
fn partial_put(url: &str, token: &str, path: &str, len: usize, send: usize) -> std::net::TcpStream {
    let addr = url.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\nContent-Length: {len}\r\n\r\n"
    )
    .unwrap();
    s.write_all(&vec![0x42; send]).unwrap();
    s.flush().unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_crashes_never_lose_an_acknowledged_file_nor_show_a_partial_one() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let a = serve(&data, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let tok = art["token"].as_str().unwrap().to_string();

    // 1. A client that disconnects mid-body leaves nothing.
    let s = partial_put(&a.url, &tok, "/v1/relay/art/gone", 1 << 20, 300_000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(alpha.get("/v1/relay/art").await.1, json!([]));
    assert!(tmp_files(&data).is_empty(), "{:?}", tmp_files(&data));

    // 2. kill -9 mid-body: the temp file is there, invisible; after restart it is gone.
    let s = partial_put(&a.url, &tok, "/v1/relay/art/half", 1 << 20, 300_000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(tmp_files(&data).len(), 1, "the body streams to a temp file");
    assert_eq!(alpha.get("/v1/relay/art").await.1, json!([]));
    drop(a);
    drop(s);
    let a = serve(&data, &[]);
    let alpha = Api::new(&a.url, &alpha.token);
    assert_eq!(alpha.get("/v1/relay/art").await.1, json!([]));
    assert!(tmp_files(&data).is_empty());

    // 3. 201 then kill -9 at once: the file is there after restart.
    let body: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let p = put(&a.url, &tok, "/v1/relay/art/kept", body.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED);
    drop(a);
    let a = serve(&data, &[]);
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/kept").await;
    assert_eq!((s, got == body), (StatusCode::OK, true));
    drop(a);

    // 4. Crash points inside the PUT: no 201 was given; after restart the name is either free
    //    or holds the complete file, and a retry of the same bytes succeeds.
    for (point, expect_present) in [("abort-after-fsync", false), ("abort-after-link", true)] {
        let a = serve_env(&data, &[], &[("STRATA_RELAY_FAULT", point)]);
        let name = format!("/v1/relay/art/{point}");
        let r = reqwest::Client::new()
            .put(format!("{}{name}", a.url))
            .bearer_auth(&tok)
            .body(body.clone())
            .send()
            .await;
        assert!(r.is_err(), "{point}: the daemon died before answering");
        drop(a);
        let a = serve(&data, &[]);
        let (s, got, _) = get_bytes(&a.url, &alpha.token, &name).await;
        if expect_present {
            assert_eq!((s, got == body), (StatusCode::OK, true), "{point}");
        } else {
            assert_eq!(s, StatusCode::NOT_FOUND, "{point}");
        }
        assert!(
            tmp_files(&data).is_empty(),
            "{point}: {:?}",
            tmp_files(&data)
        );
        let p = put(&a.url, &tok, &name, body.clone()).await;
        assert!(p.status.is_success(), "{point}: retry {}", p.body);
        let p = put(&a.url, &tok, &name, vec![1; 5]).await;
        assert_eq!(p.status, StatusCode::CONFLICT, "{point}");
        drop(a);
    }
}

fn runuser(cmd: &str) -> std::process::Output {
    std::process::Command::new("runuser")
        .args(["-u", "postgres", "--", "bash", "-c", cmd])
        .output()
        .unwrap()
}

fn pg_bin() -> Option<String> {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg("ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1")
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!p.is_empty() && Path::new(&p).join("pg_ctl").exists()).then_some(p)
}

fn psql(bin: &str, port: u16, sql: &str) -> String {
    let o = runuser(&format!(
        "{bin}/psql -h 127.0.0.1 -p {port} -U postgres -d postgres -XAtq -v ON_ERROR_STOP=1 -c \"{sql}\""
    ));
    assert!(
        o.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_recovers_to_a_point_in_time_from_wal_archived_through_the_relay() {
    let (Some(bin), true) = (pg_bin(), is_root() && have("runuser") && have("curl")) else {
        assert!(
            std::env::var("STRATA_REQUIRE_PG").as_deref() != Ok("1"),
            "STRATA_REQUIRE_PG=1 but PostgreSQL, root or curl is missing"
        );
        eprintln!("skipping: needs PostgreSQL binaries, root (runuser) and curl");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        d.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let data_a = d.path().join("a");
    let a = serve(&data_a, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, wal) = alpha.post("/v1/relay", json!({"name": "wal"})).await;
    let (_, base) = alpha.post("/v1/relay", json!({"name": "base"})).await;
    let (wal_tok, base_tok) = (
        wal["token"].as_str().unwrap().to_string(),
        base["token"].as_str().unwrap().to_string(),
    );
    // The source cluster archives every segment through the relay with the stream token.
    let pg = d.path().join("pg");
    std::fs::create_dir_all(&pg).unwrap();
    std::process::Command::new("chown")
        .args(["-R", "postgres:", pg.to_str().unwrap()])
        .status()
        .unwrap();
    let src = pg.join("src");
    let port = free_port();
    let o = runuser(&format!(
        "{bin}/initdb -D {src} -U postgres --auth=trust >/dev/null",
        src = src.display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let archive = format!(
        "curl --fail -sS -X PUT -H 'Authorization: Bearer {wal_tok}' --data-binary @%p {}/v1/relay/wal/%f",
        a.url
    );
    std::fs::write(
        src.join("postgresql.auto.conf"),
        format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nwal_level = replica\narchive_mode = on\narchive_command = '{}'\narchive_timeout = 60\n",
            pg.display(),
            archive.replace('\'', "''")
        ),
    )
    .unwrap();
    let start = |dir: &Path| {
        let o = runuser(&format!(
            "{bin}/pg_ctl -D {} -l {}.log -w -t 120 start",
            dir.display(),
            dir.display()
        ));
        assert!(
            o.status.success(),
            "pg_ctl start: {}{}",
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(format!("{}.log", dir.display())).unwrap_or_default()
        );
    };
    start(&src);
    let stop = |dir: &Path| {
        runuser(&format!(
            "{bin}/pg_ctl -D {} -m fast -w stop",
            dir.display()
        ));
    };
    // Base backup (tar, compressed) pushed through the relay.
    let o = runuser(&format!(
        "{bin}/pgbench -h 127.0.0.1 -p {port} -U postgres -i -s 2 -q postgres 2>&1"
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let bk = pg.join("bk");
    let o = runuser(&format!(
        "{bin}/pg_basebackup -h 127.0.0.1 -p {port} -U postgres -D {bk} -Ft -z -X none -c fast \
         && curl --fail -sS -X PUT -H 'Authorization: Bearer {base_tok}' --data-binary @{bk}/base.tar.gz {url}/v1/relay/base/base.tar.gz >/dev/null",
        bk = bk.display(),
        url = a.url
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Load, then a named restore point with known contents, then changes that must not survive.
    let o = runuser(&format!(
        "{bin}/pgbench -h 127.0.0.1 -p {port} -U postgres -T 4 -c 2 -n postgres 2>&1"
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    psql(&bin, port, "CREATE TABLE marker (phase text)");
    psql(&bin, port, "INSERT INTO marker VALUES ('before')");
    let sum_at_target = psql(&bin, port, "SELECT sum(abalance) FROM pgbench_accounts");
    let hist_at_target = psql(&bin, port, "SELECT count(*) FROM pgbench_history");
    psql(&bin, port, "SELECT pg_create_restore_point('target')");
    psql(&bin, port, "INSERT INTO marker VALUES ('after')");
    let o = runuser(&format!(
        "{bin}/pgbench -h 127.0.0.1 -p {port} -U postgres -T 2 -c 2 -n postgres 2>&1"
    ));
    assert!(o.status.success());
    let last = psql(&bin, port, "SELECT pg_walfile_name(pg_switch_wal())");
    // Every segment up to the switch is archived (the relay answered 201 for each).
    let t0 = Instant::now();
    while psql(
        &bin,
        port,
        "SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver",
    ) < last
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "archiving stalled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let failed = psql(&bin, port, "SELECT failed_count FROM pg_stat_archiver");
    stop(&src);
    // The relay drains to the object store; the node then dies. Another node serves restore.
    wait_uploaded(&alpha, "wal").await;
    wait_uploaded(&alpha, "base").await;
    drop(a);
    let b = node_b(&data_a, &d.path().join("b"));
    let dst = pg.join("dst");
    let port2 = free_port();
    let restore = format!(
        "curl --fail -sS -H 'Authorization: Bearer {}' -o %p {}/v1/relay/wal/%f",
        alpha.token, b.url
    );
    let o = runuser(&format!(
        "mkdir -m 700 {dst} && curl --fail -sS -H 'Authorization: Bearer {tok}' {url}/v1/relay/base/base.tar.gz | tar -xz -C {dst} && touch {dst}/recovery.signal",
        dst = dst.display(),
        tok = alpha.token,
        url = b.url
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut conf = std::fs::OpenOptions::new()
        .append(true)
        .open(dst.join("postgresql.auto.conf"))
        .unwrap();
    writeln!(
        conf,
        "port = {port2}\narchive_mode = off\nrestore_command = '{}'\nrecovery_target_name = 'target'\nrecovery_target_action = 'promote'",
        restore.replace('\'', "''")
    )
    .unwrap();
    drop(conf);
    start(&dst);
    let t0 = Instant::now();
    while psql(&bin, port2, "SELECT pg_is_in_recovery()") != "f" {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "recovery never finished"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let phases = psql(&bin, port2, "SELECT string_agg(phase, ',') FROM marker");
    let sum = psql(&bin, port2, "SELECT sum(abalance) FROM pgbench_accounts");
    let hist = psql(&bin, port2, "SELECT count(*) FROM pgbench_history");
    stop(&dst);
    let mut log = String::new();
    let _ = std::fs::File::open(format!("{}.log", dst.display()))
        .and_then(|mut f| f.read_to_string(&mut log));
    assert_eq!(
        phases, "before",
        "recovered exactly to the restore point\n{log}"
    );
    assert_eq!((sum, hist), (sum_at_target, hist_at_target), "{log}");
    eprintln!("PITR through the relay: archive failures {failed}, last segment {last}");
}

/// Peak resident memory of a process, from /proc (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb << 10
}

/// A file much larger than a part, on a sync stream: stored as parts, read back from another
/// node, and neither daemon ever holds the file in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_files_stream_through_in_bounded_memory() {
    let d = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (d.path().join("a"), d.path().join("b"));
    let a = serve(&data_a, &["--relay-max-bytes", "256MiB"]);
    let alpha = tenant(&a.url, "alpha").await;
    let (s, v) = alpha
        .post("/v1/relay", json!({"name": "big", "sync": true}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let token = v["token"].as_str().unwrap().to_string();
    let size = 120usize << 20;
    let data: Vec<u8> = (0..size).map(|i| (i / 4096 + i % 7) as u8).collect();
    let before = peak_rss(a.child.id());
    let p = put(&a.url, &token, "/v1/relay/big/base.tar", data.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    assert!(
        p.body["uploaded_ms"].is_u64(),
        "a sync stream answers once stored"
    );
    let grew_a = peak_rss(a.child.id()).saturating_sub(before);
    // Another node reads it from the store (parts verified before the first byte).
    let b = node_b(&data_a, &data_b);
    let before = peak_rss(b.child.id());
    let (s, got, h) = get_bytes(&b.url, &alpha.token, "/v1/relay/big/base.tar").await;
    let grew_b = peak_rss(b.child.id()).saturating_sub(before);
    assert_eq!(s, StatusCode::OK);
    assert!(got == data, "the bytes read back from the store differ");
    assert_eq!(h, Some(blake3_hex(&data)));
    eprintln!(
        "relay of {} MiB: peak RSS grew {} MiB on the writer, {} MiB on the reader",
        size >> 20,
        grew_a >> 20,
        grew_b >> 20
    );
    assert!(grew_a < 64 << 20, "the writer held {grew_a} bytes");
    assert!(grew_b < 64 << 20, "the reader held {grew_b} bytes");
    // Nothing spooled is left behind.
    let spool: Vec<_> = std::fs::read_dir(data_b.join("relay/.spool"))
        .map(|r| r.flatten().collect())
        .unwrap_or_default();
    assert!(spool.is_empty());
}
