//! Retention and GC through a real daemon: what a pass reclaims, and which versions it keeps.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_through_the_daemon_reclaims_deleted_history_and_keeps_the_rest() {
    let d = tempfile::tempdir().unwrap();
    let daemon = serve(
        d.path(),
        &[
            "--gc-grace",
            "1s",
            "--gc-interval",
            "off",
            "--keep-checkpoints",
            "0",
        ],
    );
    let a = tenant(&daemon.url, "alpha").await;
    let admin = Api::new(&daemon.url, ADMIN);
    for ws in ["stay", "drop"] {
        let (s, v) = a
            .post("/v1/workspaces", json!({"name": ws, "size": 8 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, att) = a
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), ws)
            .await
            .unwrap();
        for round in 1..=3u8 {
            c.write(0, &vec![round; 1 << 20], false).await.unwrap();
            let body = if round == 2 {
                json!({"label": "keep me", "keep_secs": 3600})
            } else {
                json!({})
            };
            let (s, v) = a
                .post(&format!("/v1/workspaces/{ws}/checkpoint"), body)
                .await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    }
    let (s, v) = a.delete("/v1/workspaces/drop").await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    // Admin only; a dry run changes nothing.
    assert_eq!(a.post("/v1/gc", json!({})).await.0, StatusCode::FORBIDDEN);
    let (s, dry) = admin.post("/v1/gc", json!({"dry_run": true})).await;
    assert_eq!(s, StatusCode::OK, "{dry}");
    assert_eq!(dry["deleted_keys"], 0, "{dry}");
    assert!(dry["checkpoints_expired"].as_u64().unwrap() >= 2, "{dry}");
    // Three passes at least: expire + condemn, condemn what the expiry released, delete. Each
    // step waits out the 1 s grace period by the catalog's clock, so a loaded machine can push
    // one to the next pass: up to six are allowed.
    let mut deleted = 0;
    for pass in 0..6 {
        if pass >= 3 && deleted >= 3 << 20 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await; // the grace period
        let (s, r) = admin.post("/v1/gc", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        deleted += r["deleted_bytes"].as_u64().unwrap();
    }
    assert!(
        deleted >= 3 << 20,
        "the deleted workspace's data is reclaimed: {deleted}"
    );
    // What is retained reads back: the head, and the labelled checkpoint with its promise.
    let (_, log) = a.get("/v1/workspaces/stay/log").await;
    let versions: Vec<u64> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, vec![3, 4], "{log}");
    let (s, v) = a
        .post(
            "/v1/workspaces/stay/fork",
            json!({"name": "old", "version": 3}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = a.post("/v1/workspaces/old/attach", json!({})).await;
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "old")
        .await
        .unwrap();
    assert!(c.read(0, 1 << 20).await.unwrap().iter().all(|&b| b == 2));
    let (_, m) = admin.get("/metrics").await;
    assert!(
        m.as_str()
            .unwrap()
            .contains("strata_gc_reclaimed_bytes_total"),
        "{m}"
    );
}

/// The versions of `ws`'s log, with their kinds.
async fn log_of(api: &Api, ws: &str) -> Vec<(u64, String)> {
    let (s, log) = api.get(&format!("/v1/workspaces/{ws}/log")).await;
    assert_eq!(s, StatusCode::OK, "{log}");
    log.as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let kind = c["kind"].as_str().unwrap().to_string();
            (c["version"].as_u64().unwrap(), kind)
        })
        .collect()
}

/// Waits until `ws`'s log lists a version newer than `past`.
async fn wait_listed_past(api: &Api, ws: &str, past: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while log_of(api, ws).await.last().unwrap().0 <= past {
        assert!(
            std::time::Instant::now() < deadline,
            "no version of {ws} past {past} published"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes, flushes and waits until the background uploader has published a new version.
async fn write_until_published(
    api: &Api,
    c: &mut Client<tokio::net::UnixStream>,
    ws: &str,
    fill: u8,
) {
    let before = log_of(api, ws).await.last().unwrap().0;
    c.write(0, &vec![fill; 256 << 10], false).await.unwrap();
    c.flush().await.unwrap();
    wait_listed_past(api, ws, before).await;
}

/// Background publishes are the durable window's uploads, not restore points: by default a GC
/// pass keeps none of them but the head, while every version a user made stays (up to
/// `--keep-checkpoints`); `--keep-auto N` keeps the newest N besides the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_versions_are_kept_only_when_asked_for() {
    let d = tempfile::tempdir().unwrap();
    for (keep_auto, data) in [(None, "a"), (Some("1"), "b")] {
        let mut flags = vec!["--upload-interval", "100ms", "--gc-interval", "off"];
        if let Some(n) = keep_auto {
            flags.extend(["--keep-auto", n]);
        }
        let daemon = serve(&d.path().join(data), &flags);
        let a = tenant(&daemon.url, "alpha").await;
        let admin = Api::new(&daemon.url, ADMIN);
        let (s, v) = a
            .post("/v1/workspaces", json!({"name": "w", "size": 8 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, att) = a.post("/v1/workspaces/w/attach", json!({})).await;
        let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
            .await
            .unwrap();
        write_until_published(&a, &mut c, "w", 1).await;
        write_until_published(&a, &mut c, "w", 2).await;
        c.write(0, &vec![3; 256 << 10], false).await.unwrap();
        let (s, made) = a.post("/v1/workspaces/w/checkpoint", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{made}");
        let made = made["version"].as_u64().unwrap();
        // A checkpoint answers at its cut; its version is listed once published.
        wait_listed_past(&a, "w", made - 1).await;
        write_until_published(&a, &mut c, "w", 4).await;
        write_until_published(&a, &mut c, "w", 5).await;
        let before = log_of(&a, "w").await;
        let autos: Vec<u64> = before
            .iter()
            .filter(|(_, k)| k == "auto")
            .map(|(v, _)| *v)
            .collect();
        assert!(autos.len() >= 4, "{before:?}");
        let (s, r) = admin.post("/v1/gc", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        let after: Vec<u64> = log_of(&a, "w").await.iter().map(|(v, _)| *v).collect();
        let head = before.last().unwrap().0;
        // Version 1 (the create) and the checkpoint are the user's; the head is kept …
        let mut want = vec![1, made, head];
        // … and with --keep-auto 1 the newest automatic version besides it.
        if keep_auto.is_some() {
            want.push(autos[autos.len() - 2]);
        }
        want.sort();
        assert_eq!(after, want, "keep_auto {keep_auto:?}: {before:?} then {r}");
        // What was kept reads back: the checkpoint forks with its data.
        let (s, v) = a
            .post(
                "/v1/workspaces/w/fork",
                json!({"name": "then", "version": made}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, att) = a.post("/v1/workspaces/then/attach", json!({})).await;
        let mut f = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "then")
            .await
            .unwrap();
        assert!(f.read(0, 256 << 10).await.unwrap().iter().all(|&b| b == 3));
    }
}
