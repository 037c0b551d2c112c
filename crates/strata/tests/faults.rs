//! Object-store faults against the real daemon: a fault-injecting proxy sits between `strata
//! serve` and the S3-protocol server (503s, slow responses, connection resets, truncated
//! bodies, writes that land but whose reply is lost). Under each kind: checkpoints publish
//! completely or fail and succeed on retry, background uploads drain, and another node reading
//! the store directly finds every head and checkpoint complete. Reads through the faults return
//! the right bytes or a clean error, never wrong data.
//!
//! Needs `STRATA_TEST_S3_ENDPOINT` (`.ci/run` starts moto); `STRATA_FAULT_RATE` (default 0.3).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::faultproxy;
use common::*;
use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

fn s3() -> Option<String> {
    match std::env::var("STRATA_TEST_S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => Some(e),
        _ => {
            assert!(
                std::env::var("STRATA_REQUIRE_S3").as_deref() != Ok("1"),
                "STRATA_REQUIRE_S3=1 but no endpoint"
            );
            eprintln!("skipping: needs STRATA_TEST_S3_ENDPOINT");
            None
        }
    }
}

fn bucket(endpoint: &str, tag: &str) -> String {
    let b = format!("faults-{tag}-{}", std::process::id());
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
        .arg(format!("{endpoint}/{b}"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with('2'));
    b
}

fn store_url(bucket: &str, endpoint: &str) -> String {
    format!("s3://{bucket}/strata?endpoint={endpoint}&region=us-east-1&allow_http=true")
}

fn block(ws: usize, i: u64) -> Vec<u8> {
    let mut b = vec![0u8; 256 << 10];
    for (j, x) in b.iter_mut().enumerate() {
        *x = (ws as u64 * 31 + i * 7 + j as u64 / 4096) as u8;
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_head_is_complete_under_object_store_faults() {
    let Some(moto) = s3() else { return };
    let rate: f64 = std::env::var("STRATA_FAULT_RATE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.3);
    let b = bucket(&moto, "w");
    let proxy = faultproxy::start(&moto, 11).await;
    let d = tempfile::tempdir().unwrap();
    let data_a = d.path().join("a");
    let a = serve_env(
        &data_a,
        &[
            "--store",
            &store_url(&b, &proxy.url),
            "--upload-interval",
            "300ms",
        ],
        S3_ENV,
    );
    let t = tenant(&a.url, "alpha").await;
    let api = a.api(&t.token);
    let mut versions = vec![];
    for (k, fault) in faultproxy::ALL.iter().enumerate() {
        let ws = format!("w{k}");
        proxy.set(&[], 0.0);
        let (s, v) = api
            .post("/v1/workspaces", json!({"name": ws, "size": 16 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, att) = api
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), &ws)
            .await
            .unwrap();
        proxy.set(&[*fault], rate);
        // Six rounds of writes and a checkpoint: each publishes completely or fails; retried,
        // it succeeds.
        let mut tries = 0;
        let mut version = 0;
        for round in 0..6u64 {
            for i in round * 2..round * 2 + 2 {
                c.write(i * (256 << 10), &block(k, i), false).await.unwrap();
            }
            c.flush().await.unwrap();
            version = loop {
                tries += 1;
                let (s, v) = api
                    .post(
                        &format!("/v1/workspaces/{ws}/checkpoint"),
                        json!({ "wait": true }),
                    )
                    .await;
                if s == StatusCode::OK {
                    break v["version"].as_u64().unwrap();
                }
                assert!(tries < 60, "{fault:?}: checkpoints keep failing: {v}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
        }
        // More writes after the checkpoint; the background uploader drains them.
        for i in 12..16u64 {
            c.write(i * (256 << 10), &block(k, i), false).await.unwrap();
        }
        c.flush().await.unwrap();
        let t0 = Instant::now();
        loop {
            let (_, v) = api.get(&format!("/v1/workspaces/{ws}")).await;
            if v["stats"]["window_bytes"] == 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "{fault:?}: uploads never drained: {}",
                v["stats"]
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "{fault:?}: 6 checkpoints in {tries} tries; so far {}",
            proxy.counts.summary()
        );
        versions.push((ws, version));
    }
    assert!(proxy.counts.injected() > 0, "{}", proxy.counts.summary());
    proxy.set(&[], 0.0);
    // Another node reading the store directly: every checkpoint and every head is complete.
    let cat = format!("sqlite:{}", data_a.join("catalog.db").display());
    let b_node = serve_env(
        &d.path().join("b"),
        &["--catalog", &cat, "--store", &store_url(&b, &moto)],
        S3_ENV,
    );
    let api_b = b_node.api(&t.token);
    for (k, (ws, version)) in versions.iter().enumerate() {
        for (name, v, blocks) in [
            (format!("{ws}-cp"), Some(*version), 12u64),
            (format!("{ws}-head"), None, 16u64),
        ] {
            let (s, r) = api_b
                .post(
                    &format!("/v1/workspaces/{ws}/fork"),
                    json!({"name": name, "version": v}),
                )
                .await;
            assert_eq!(s, StatusCode::CREATED, "{r}");
            let (_, att) = api_b
                .post(&format!("/v1/workspaces/{name}/attach"), json!({}))
                .await;
            let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), &name)
                .await
                .unwrap();
            for i in 0..blocks {
                let got = c.read(i * (256 << 10), 256 << 10).await.unwrap();
                assert!(got == block(k, i), "{name} block {i}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_through_faults_are_right_or_clean_errors() {
    let Some(moto) = s3() else { return };
    let b = bucket(&moto, "r");
    let d = tempfile::tempdir().unwrap();
    let data_a = d.path().join("a");
    let a = serve_env(&data_a, &["--store", &store_url(&b, &moto)], S3_ENV);
    let t = tenant(&a.url, "alpha").await;
    let api = a.api(&t.token);
    let (s, v) = api
        .post("/v1/workspaces", json!({"name": "src", "size": 16 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = api.post("/v1/workspaces/src/attach", json!({})).await;
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "src")
        .await
        .unwrap();
    for i in 0..16u64 {
        c.write(i * (256 << 10), &block(9, i), false).await.unwrap();
    }
    // Published: a cold node forks it next.
    let (s, v) = api
        .post("/v1/workspaces/src/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // A cold node reads through the faulty proxy.
    let proxy = faultproxy::start(&moto, 5).await;
    proxy.set(&faultproxy::ALL, 0.3);
    let cat = format!("sqlite:{}", data_a.join("catalog.db").display());
    let n = serve_env(
        &d.path().join("c"),
        &[
            "--catalog",
            &cat,
            "--store",
            &store_url(&b, &proxy.url),
            "--cache-capacity",
            "1MiB",
        ],
        S3_ENV,
    );
    let api_n = n.api(&t.token);
    let (s, v) = api_n
        .post("/v1/workspaces/src/fork", json!({"name": "r"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let mut att = None;
    for _ in 0..20 {
        let (s, v) = api_n.post("/v1/workspaces/r/attach", json!({})).await;
        if s == StatusCode::OK {
            att = Some(v);
            break;
        }
    }
    let att = att.expect("attach succeeds within 20 tries");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "r")
        .await
        .unwrap();
    let (mut ok, mut errors) = (0, 0);
    for round in 0..3 {
        for i in 0..16u64 {
            match c.read(i * (256 << 10), 256 << 10).await {
                Ok(got) => {
                    assert!(
                        got == block(9, i),
                        "round {round} block {i}: wrong data served"
                    );
                    ok += 1;
                }
                Err(_) => errors += 1,
            }
        }
    }
    eprintln!(
        "reads through faults: {ok} right, {errors} clean errors; {}",
        proxy.counts.summary()
    );
    assert!(
        proxy
            .counts
            .truncate
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
            || proxy.counts.injected() > 3
    );
    proxy.set(&[], 0.0);
    for i in 0..16u64 {
        assert!(c.read(i * (256 << 10), 256 << 10).await.unwrap() == block(9, i));
    }
}
