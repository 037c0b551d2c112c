//! Local copies evicted once uploaded, and files expired by their stream's retention.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use super::{get_bytes, put, wait_uploaded};
use crate::common::*;

/// Size of this node's copy of a relay file (None: no file).
fn local_len(data: &Path, stream: &str, name: &str) -> Option<u64> {
    std::fs::metadata(data.join("relay/alpha").join(stream).join(name))
        .ok()
        .map(|m| m.len())
}

/// The file store's keys of a relay file (data or parts, and meta).
fn store_keys(data: &Path, stream: &str, name: &str) -> Vec<String> {
    let root = data.join("objects/t/alpha/relay").join(stream);
    let mut out = vec![];
    for sub in ["data", "meta"] {
        for e in std::fs::read_dir(root.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if n == name || n.starts_with(&format!("{name}.p")) {
                out.push(format!("{sub}/{n}"));
            }
        }
    }
    out
}

/// Once uploaded, a file's bytes leave this node's disk (reads come from the store, verified;
/// retries are still answered from the local meta); a copy a crash kept is uploaded again
/// and evicted after the daemon starts. Streams with a retention lose their old files at a GC pass, from the store
/// and the node; a dry run only counts; streams without one keep everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploaded_files_leave_the_disk_and_old_ones_expire_by_retention() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let flags = ["--gc-interval", "off"];
    let mut a = serve(&data, &flags);
    let mut alpha = tenant(&a.url, "alpha").await;
    let beta = tenant(&a.url, "beta").await;
    for bad in [json!(0), json!(-1), json!("1d"), json!(u64::MAX)] {
        let (s, v) = alpha
            .post("/v1/relay", json!({"name": "x", "keep_secs": bad}))
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "keep_secs {bad}: {v}");
    }
    let (s, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    assert_eq!(s, StatusCode::CREATED, "{art}");
    let art_token = art["token"].as_str().unwrap().to_string();
    let (s, wal) = alpha
        .post("/v1/relay", json!({"name": "wal", "keep_secs": 2}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{wal}");
    let wal_token = wal["token"].as_str().unwrap().to_string();

    // Uploaded, then evicted: the name stays (a placeholder), the bytes come from the store.
    let one: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    let old = vec![5u8; 100_000];
    let p = put(&a.url, &wal_token, "/v1/relay/wal/seg1", old.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "art").await;
    wait_uploaded(&alpha, "wal").await;
    assert_eq!(local_len(&data, "art", "report.tar"), Some(0));
    assert_eq!(local_len(&data, "wal", "seg1"), Some(0));
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!((s, got == one), (StatusCode::OK, true));
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(
        p.status,
        StatusCode::OK,
        "a retry after eviction: {}",
        p.body
    );
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", vec![1; 10]).await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);

    // A crash between the upload's record and the eviction leaves the bytes: the next start
    // uploads the file again (the store's copy must be this file and whole) and evicts them;
    // reads are unchanged.
    drop(a);
    std::fs::write(data.join("relay/alpha/art/report.tar"), &one).unwrap();
    a = serve(&data, &flags);
    alpha = a.api(&alpha.token);
    let beta = a.api(&beta.token);
    let admin = a.api(ADMIN);
    wait_uploaded(&alpha, "art").await;
    assert_eq!(local_len(&data, "art", "report.tar"), Some(0));
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!((s, got == one), (StatusCode::OK, true));

    // Retention: seg1 is past the stream's 2 s, seg2 is not.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let young = vec![6u8; 50_000];
    let p = put(&a.url, &wal_token, "/v1/relay/wal/seg2", young.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "wal").await;
    let (s, dry) = admin.post("/v1/gc", json!({"dry_run": true})).await;
    assert_eq!(s, StatusCode::OK, "{dry}");
    assert_eq!(
        (
            dry["relay_files_expired"].as_u64(),
            dry["relay_bytes_expired"].as_u64()
        ),
        (Some(1), Some(100_000)),
        "{dry}"
    );
    assert_eq!(
        store_keys(&data, "wal", "seg1").len(),
        2,
        "a dry run deletes nothing"
    );
    let (s, r) = admin.post("/v1/gc", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["relay_files_expired"], 1, "{r}");
    assert!(store_keys(&data, "wal", "seg1").is_empty());
    assert_eq!(local_len(&data, "wal", "seg1"), None);
    assert!(!data.join("relay/alpha/wal/.meta/seg1.json").exists());
    let (s, _, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/wal/seg1").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/wal/seg2").await;
    assert_eq!((s, got == young), (StatusCode::OK, true));
    let (_, list) = alpha.get("/v1/relay/wal").await;
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["seg2"], "{list}");
    // A stream without retention kept its file through the pass.
    assert_eq!(store_keys(&data, "art", "report.tar").len(), 2);

    // Retention set later (tenant or relay token only; another tenant's stream is not found).
    let (s, v) = beta.patch("/v1/relay/art", json!({"keep_secs": 1})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = Api::new(&a.url, &art_token)
        .patch("/v1/relay/art", json!({"keep_secs": 1}))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "a stream token: {v}");
    let (s, v) = alpha.patch("/v1/relay/art", json!({"keep_secs": 0})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = alpha.patch("/v1/relay/art", json!({"keep_secs": 1})).await;
    assert_eq!(
        (s, v["keep_secs"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{v}"
    );
    let (_, streams) = alpha.get("/v1/relay").await;
    let art = streams
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "art")
        .cloned()
        .unwrap();
    assert_eq!(art["keep_secs"], 1, "{streams}");
    let (s, r) = admin.post("/v1/gc", json!({})).await;
    assert_eq!(
        (s, r["relay_files_expired"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{r}"
    );
    assert!(store_keys(&data, "art", "report.tar").is_empty());
    // Cleared: nothing more expires.
    let (s, v) = alpha
        .patch("/v1/relay/wal", json!({"keep_secs": null}))
        .await;
    assert_eq!((s, v["keep_secs"].is_null()), (StatusCode::OK, true), "{v}");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (_, r) = admin.post("/v1/gc", json!({})).await;
    assert_eq!(r["relay_files_expired"], 0, "{r}");
    assert_eq!(store_keys(&data, "wal", "seg2").len(), 2);
}

/// Two nodes share the catalog and the store. A name stays with its first file whatever the
/// sizes: another node's different file (in parts, so no data key collides) is a conflict in
/// the background and never replaces it, and the first node, which evicted its copy, still
/// serves its own bytes. A file one node's GC pass expired is forgotten by the node that
/// relayed it at the next PUT of the name, which stores it again (not a `200` for a file that
/// is nowhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_keeps_its_first_file_and_expiry_on_one_node_frees_it_on_all() {
    let d = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (d.path().join("a"), d.path().join("b"));
    let a = serve(&data_a, &["--gc-interval", "off"]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let art_a = art["token"].as_str().unwrap().to_string();
    let (_, wal) = alpha
        .post("/v1/relay", json!({"name": "wal", "keep_secs": 1}))
        .await;
    let wal_a = wal["token"].as_str().unwrap().to_string();
    let b = super::node_b(&data_a, &data_b);
    let alpha_b = b.api(&alpha.token);
    let (_, art) = alpha_b.post("/v1/relay/art", json!({})).await;
    let art_b = art["token"].as_str().unwrap().to_string();

    let small = vec![1u8; 1 << 20];
    let p = put(&a.url, &art_a, "/v1/relay/art/out.tar", small.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "art").await;
    assert_eq!(local_len(&data_a, "art", "out.tar"), Some(0));
    let big = vec![2u8; 17 << 20];
    let p = put(&b.url, &art_b, "/v1/relay/art/out.tar", big.clone()).await;
    assert_eq!(
        p.status,
        StatusCode::CREATED,
        "b does not know it yet: {}",
        p.body
    );
    wait_uploaded(&alpha_b, "art").await; // the conflict ends b's attempts
    let (_, m) = b.api(ADMIN).get("/metrics").await;
    assert!(
        m.as_str()
            .unwrap()
            .lines()
            .any(|l| l.starts_with("strata_relay_conflicts_total") && !l.ends_with(" 0")),
        "{m}"
    );
    let (s, got, h) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/out.tar").await;
    assert_eq!(
        (s, got == small, h.as_deref()),
        (
            StatusCode::OK,
            true,
            Some(super::blake3_hex(&small).as_str())
        ),
        "a's acknowledged file is the store's"
    );
    assert_eq!(
        local_len(&data_b, "art", "out.tar"),
        Some(17 << 20),
        "b keeps its own"
    );

    // Expired by b's pass; a, which relayed it, takes it again as a new file.
    let seg = vec![3u8; 10_000];
    let p = put(&a.url, &wal_a, "/v1/relay/wal/seg", seg.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "wal").await;
    assert_eq!(local_len(&data_a, "wal", "seg"), Some(0));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (s, r) = b.api(ADMIN).post("/v1/gc", json!({})).await;
    assert_eq!(
        (s, r["relay_files_expired"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{r}"
    );
    let p = put(&a.url, &wal_a, "/v1/relay/wal/seg", seg.clone()).await;
    assert_eq!(
        p.status,
        StatusCode::CREATED,
        "stored again, not 'already there': {}",
        p.body
    );
    wait_uploaded(&alpha, "wal").await;
    let (s, got, _) = get_bytes(&b.url, &alpha.token, "/v1/relay/wal/seg").await;
    assert_eq!((s, got == seg), (StatusCode::OK, true));
}
