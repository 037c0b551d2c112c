//! Encryption in transit for the HTTP API: `strata serve --tls-cert/--tls-key` against real
//! clients (reqwest, the `strata` CLI) with certificates from throwaway CAs made by `openssl`;
//! a renewed certificate served without a restart; and the relay-only listener.
//! (The PostgreSQL catalog's `sslmode` is tested in strata-catalog's `tests/postgres.rs`.)

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use reqwest::StatusCode;
use serde_json::json;

/// A CA: (certificate, key).
fn ca(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    let mut c = Command::new("openssl");
    c.args([
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
    ])
    .args(["-nodes", "-days", "2", "-subj", &format!("/CN={name}")])
    .arg("-keyout")
    .arg(&key)
    .arg("-out")
    .arg(&cert);
    let out = c
        .output()
        .expect("openssl (apt-get install openssl; .ci/run installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// A server certificate for 127.0.0.1 and localhost signed by `ca`: (certificate, key).
fn server_cert(dir: &Path, name: &str, ca: &(PathBuf, PathBuf)) -> (PathBuf, PathBuf) {
    let (cert, key, csr, ext) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}.csr")),
        dir.join(format!("{name}.ext")),
    );
    std::fs::write(&ext, "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    let mut c = Command::new("openssl");
    c.args([
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ])
    .args(["-subj", &format!("/CN={name}"), "-keyout"])
    .arg(&key)
    .arg("-out")
    .arg(&csr);
    assert!(c.output().unwrap().status.success());
    let mut c = Command::new("openssl");
    c.args(["x509", "-req", "-days", "2", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(&ca.0)
        .arg("-CAkey")
        .arg(&ca.1)
        .args(["-CAcreateserial", "-extfile"])
        .arg(&ext)
        .arg("-out")
        .arg(&cert);
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// A client that trusts `ca` only, with a fresh connection per client.
fn trusting(ca: &Path) -> reqwest::Client {
    let pem = std::fs::read(ca).unwrap();
    reqwest::Client::builder()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Whether a new connection to `url` trusting only `ca` gets an answer from /v1/health.
async fn reaches(url: &str, ca: &Path) -> Result<StatusCode, String> {
    trusting(ca)
        .get(format!("{url}/v1/health"))
        .send()
        .await
        .map(|r| r.status())
        .map_err(|e| {
            let mut m = e.to_string();
            let mut s = std::error::Error::source(&e);
            while let Some(x) = s {
                m.push_str(&format!(": {x}"));
                s = x.source();
            }
            m
        })
}

fn cli(url: &str, token: &str, ca: Option<&Path>, args: &[&str]) -> (bool, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(args)
        .env("STRATA_URL", url)
        .env("STRATA_TOKEN", token)
        .env_remove("STRATA_CA_CERT");
    if let Some(ca) = ca {
        c.env("STRATA_CA_CERT", ca);
    }
    let out = c.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_over_tls_with_a_certificate_renewed_in_place() {
    let d = tempfile::tempdir().unwrap();
    let certs = d.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    let ca1 = ca(&certs, "ca-one");
    let ca2 = ca(&certs, "ca-two");
    let one = server_cert(&certs, "server-one", &ca1);
    let two = server_cert(&certs, "server-two", &ca2);
    // What the daemon reads: the files a renewal replaces by rename.
    let (cert, key) = (d.path().join("tls.pem"), d.path().join("tls.key"));
    std::fs::copy(&one.0, &cert).unwrap();
    std::fs::copy(&one.1, &key).unwrap();
    let cert_s = cert.display().to_string();
    let key_s = key.display().to_string();
    let node = serve(
        &d.path().join("data"),
        &[
            "--tls-cert",
            &cert_s,
            "--tls-key",
            &key_s,
            "--relay-listen",
            "127.0.0.1:0",
        ],
    );
    assert!(node.url.starts_with("https://127.0.0.1:"), "{}", node.url);
    let url = node.url.clone();

    // Trusting the right CA: answered. Trusting another, or the system's roots: refused.
    assert_eq!(reaches(&url, &ca1.0).await, Ok(StatusCode::OK));
    let e = reaches(&url, &ca2.0).await.unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // Plain HTTP to the TLS port gets no answer.
    let plain = url.replacen("https://", "http://", 1);
    let r = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap()
        .get(format!("{plain}/v1/health"))
        .send()
        .await;
    assert!(r.is_err() || !r.unwrap().status().is_success());

    // The CLI: STRATA_CA_CERT names the CA; without it the system's roots refuse the node.
    let (ok, out) = cli(&url, ADMIN, Some(&ca1.0), &["tenant", "create", "alpha"]);
    assert!(ok, "{out}");
    let (ok, out) = cli(&url, ADMIN, None, &["tenant", "list"]);
    assert!(!ok, "the system's roots trusted a throwaway CA: {out}");
    assert!(out.to_lowercase().contains("certificate"), "{out}");
    let (ok, out) = cli(&url, ADMIN, Some(&ca1.0), &["--json", "tenant", "list"]);
    assert!(ok && out.contains("alpha"), "{out}");

    // A client that connects and never says hello holds nobody up.
    let _silent = std::net::TcpStream::connect(url.trim_start_matches("https://")).unwrap();
    let t = std::time::Instant::now();
    assert_eq!(reaches(&url, &ca1.0).await, Ok(StatusCode::OK));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    // A connection opened before the renewal stays usable after it.
    let kept = Api::with_http(trusting(&ca1.0), &url, ADMIN);
    assert_eq!(kept.get("/v1/tenants").await.0, StatusCode::OK);

    // A renewal half done: the new certificate renamed into place, the old key still there.
    // The pair does not match, so the old one is still served.
    let swap = |from: &Path, to: &Path| {
        let tmp = to.with_extension("new");
        std::fs::copy(from, &tmp).unwrap();
        std::fs::rename(&tmp, to).unwrap();
    };
    swap(&two.0, &cert);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(reaches(&url, &ca1.0).await, Ok(StatusCode::OK));
    // The key follows: from the next check on, the new pair is served.
    swap(&two.1, &key);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while reaches(&url, &ca2.0).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let e = reaches(&url, &ca1.0).await.unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    let (ok, out) = cli(&url, ADMIN, Some(&ca2.0), &["tenant", "list"]);
    assert!(ok, "{out}");
    assert_eq!(kept.get("/v1/tenants").await.0, StatusCode::OK);
    // A broken file is not served: the pair before it stays.
    std::fs::write(&cert, "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(reaches(&url, &ca2.0).await, Ok(StatusCode::OK));

    // The relay address: the relay routes (over the same TLS), nothing else.
    let relay = node.relay_url.clone().expect("relay_listening");
    assert!(relay.starts_with("https://"), "{relay}");
    let http = trusting(&ca2.0);
    let admin = Api::with_http(http.clone(), &url, ADMIN);
    let (s, v) = admin.post("/v1/tenants", json!({"name": "beta"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let beta_token = v["token"].as_str().unwrap().to_string();
    let beta_relay = Api::with_http(http.clone(), &relay, &beta_token);
    let (s, v) = beta_relay.post("/v1/relay", json!({"name": "out"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let stream_token = v["token"].as_str().unwrap().to_string();
    let r = http
        .put(format!("{relay}/v1/relay/out/result.txt"))
        .bearer_auth(&stream_token)
        .body(b"forty-two".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = http
        .get(format!("{relay}/v1/relay/out/result.txt"))
        .bearer_auth(&beta_token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(&r.bytes().await.unwrap()[..], b"forty-two");
    let mut refused = 0;
    for (token, path) in [
        (ADMIN, "/v1/tenants"),
        (ADMIN, "/v1/nodes"),
        (ADMIN, "/metrics"),
        (beta_token.as_str(), "/v1/workspaces"),
        (beta_token.as_str(), "/v1/tokens"),
        (beta_token.as_str(), "/v1/usage"),
        (beta_token.as_str(), "/v1/templates"),
        (beta_token.as_str(), "/v1/openapi.json"),
    ] {
        let (s, v) = Api::with_http(http.clone(), &relay, token).get(path).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path} on the relay address: {v}");
        refused += 1;
    }
    let (s, v) = Api::with_http(http.clone(), &relay, ADMIN)
        .post("/v1/tenants", json!({"name": "gamma"}))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    refused += 1;
    eprintln!("relay address: {refused} non-relay requests refused with 404");
    // The admin API still serves the relay too (existing clients keep working).
    let (s, _) = Api::with_http(http, &url, &beta_token)
        .get("/v1/relay")
        .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_does_not_start_with_a_certificate_it_cannot_serve() {
    let d = tempfile::tempdir().unwrap();
    let ca1 = ca(d.path(), "ca");
    let a = server_cert(d.path(), "a", &ca1);
    let b = server_cert(d.path(), "b", &ca1);
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("--data")
            .arg(d.path().join("data"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap()
    };
    let s = |p: &Path| p.display().to_string();
    // A certificate with another certificate's key.
    let out = run(&["--tls-cert", &s(&a.0), "--tls-key", &s(&b.1)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("does not match"),
        "{err}"
    );
    // One without the other.
    let out = run(&["--tls-cert", &s(&a.0)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("go together"),
        "{err}"
    );
    // A missing file.
    let out = run(&["--tls-cert", "/nonexistent.pem", "--tls-key", &s(&a.1)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/nonexistent.pem"),
        "{err}"
    );
}
