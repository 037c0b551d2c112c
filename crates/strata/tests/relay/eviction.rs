//! Local copies evicted once uploaded; a name keeps its first file across nodes.

use std::path::Path;

use reqwest::StatusCode;
use serde_json::json;

use super::{blake3_hex, get_bytes, put, wait_uploaded};
use crate::common::*;

/// Size of this node's copy of a relay file (None: no file).
/// A stream's directory of `what` (`data`, `meta`, `parts`) in a local store: under the
/// tenant's one incarnation (relay key layout 2, docs/FORMATS.md).
fn store_dir(data: &Path, tenant: &str, stream: &str, what: &str) -> std::path::PathBuf {
    let root = data.join(format!("objects/t/{tenant}/relay2"));
    let incarnations: Vec<_> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("the store layout changed: {root:?}: {e}"))
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(incarnations.len(), 1, "{incarnations:?}");
    incarnations[0].join(stream).join(what)
}

fn local_len(data: &Path, stream: &str, name: &str) -> Option<u64> {
    std::fs::metadata(data.join("relay/alpha").join(stream).join(name))
        .ok()
        .map(|m| m.len())
}

/// Once uploaded, a file's bytes leave this node's disk (an empty placeholder keeps the
/// name): reads come from the store, verified, and retries are still answered from the local
/// meta. A sync stream's file leaves at its PUT. Across a restart nothing changes; bytes a
/// crash left behind (written back by the test) are served as before; an evicted file whose
/// meta became unreadable is left alone at start, never taken for an empty file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploaded_files_leave_the_disk_and_read_back_from_the_store() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let mut a = serve(&data, &[]);
    let mut alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let art_token = art["token"].as_str().unwrap().to_string();
    let (_, wal) = alpha
        .post("/v1/relay", json!({"name": "wal", "sync": true}))
        .await;
    let wal_token = wal["token"].as_str().unwrap().to_string();

    let one: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    let seg = vec![5u8; 100_000];
    let p = put(&a.url, &wal_token, "/v1/relay/wal/seg1", seg.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    assert_eq!(
        local_len(&data, "wal", "seg1"),
        Some(0),
        "a sync file leaves at once"
    );
    wait_uploaded(&alpha, "art").await;
    assert_eq!(local_len(&data, "art", "report.tar"), Some(0));
    let (s, got, h) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!(
        (s, got == one, h),
        (StatusCode::OK, true, Some(blake3_hex(&one)))
    );
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/wal/seg1").await;
    assert_eq!((s, got == seg), (StatusCode::OK, true));
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", one.clone()).await;
    assert_eq!(
        p.status,
        StatusCode::OK,
        "a retry after eviction: {}",
        p.body
    );
    let p = put(&a.url, &art_token, "/v1/relay/art/report.tar", vec![1; 10]).await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);
    let p = put(&a.url, &wal_token, "/v1/relay/wal/seg1", vec![1; 10]).await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);

    // Restarts: with bytes a crash before the eviction left, and with an evicted file whose
    // meta cannot be read.
    drop(a);
    std::fs::write(data.join("relay/alpha/art/report.tar"), &one).unwrap();
    std::fs::write(data.join("relay/alpha/wal/.meta/seg1.json"), b"{not json").unwrap();
    a = serve(&data, &[]);
    alpha = a.api(&alpha.token);
    assert_eq!(local_len(&data, "wal", "seg1"), Some(0), "left alone");
    assert_eq!(
        std::fs::read(data.join("relay/alpha/wal/.meta/seg1.json")).unwrap(),
        b"{not json",
        "not rebuilt as an empty file"
    );
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/report.tar").await;
    assert_eq!((s, got == one), (StatusCode::OK, true));
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/wal/seg1").await;
    assert_eq!(
        (s, got == seg),
        (StatusCode::OK, true),
        "read from the store"
    );
    let (_, list) = alpha.get("/v1/relay/art").await;
    assert_eq!(list[0]["name"], "report.tar", "{list}");
}

/// Two nodes share the catalog and the store. A name stays with its first file whatever the
/// sizes: another node's different file (in parts, so no data key collides) is a conflict in
/// the background and never replaces it, and the first node, which evicted its copy, still
/// serves its own bytes; the other keeps its bytes local. The same bytes relayed through the
/// second node are the same file: they leave its disk too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_keeps_its_first_file_across_nodes() {
    let d = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (d.path().join("a"), d.path().join("b"));
    let a = serve(&data_a, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let art_a = art["token"].as_str().unwrap().to_string();
    let b = super::node_b(&data_a, &data_b);
    let alpha_b = b.api(&alpha.token);
    let (_, art) = alpha_b.post("/v1/relay/art", json!({})).await;
    let art_b = art["token"].as_str().unwrap().to_string();

    let small = vec![1u8; 1 << 20];
    for name in ["out.tar", "same.tar"] {
        let p = put(
            &a.url,
            &art_a,
            &format!("/v1/relay/art/{name}"),
            small.clone(),
        )
        .await;
        assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    }
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
    let p = put(&b.url, &art_b, "/v1/relay/art/same.tar", small.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha_b, "art").await; // the conflict ends b's attempts at out.tar
    let (_, m) = b.api(ADMIN).get("/metrics").await;
    assert!(
        m.as_str()
            .unwrap()
            .lines()
            .any(|l| l == "strata_relay_conflicts_total 1"),
        "one conflict counted"
    );
    let (s, got, h) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/out.tar").await;
    assert_eq!(
        (s, got == small, h),
        (StatusCode::OK, true, Some(blake3_hex(&small))),
        "a's acknowledged file is the store's"
    );
    assert_eq!(
        local_len(&data_b, "art", "out.tar"),
        Some(17 << 20),
        "b keeps its own"
    );
    assert_eq!(
        local_len(&data_b, "art", "same.tar"),
        Some(0),
        "the same file leaves b"
    );
    let (s, got, _) = get_bytes(&b.url, &alpha.token, "/v1/relay/art/same.tar").await;
    assert_eq!((s, got == small), (StatusCode::OK, true));
}

/// A tenant deleted through another node while this one was down, and created again under the
/// same name: this node's relay files of the old tenant are dropped, never taken for the new
/// one's. The new tenant's PUT of the same bytes under the old name is a new file (`201`),
/// stored, and reads back everywhere (answering `200` from the old tenant's meta would lose it:
/// the store was purged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_created_again_never_inherits_the_old_ones_relay_files() {
    let d = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (d.path().join("a"), d.path().join("b"));
    let a = serve(&data_a, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let token = art["token"].as_str().unwrap().to_string();
    let bytes = vec![7u8; 200_000];
    let p = put(&a.url, &token, "/v1/relay/art/f", bytes.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    let pending = vec![8u8; 1000];
    wait_uploaded(&alpha, "art").await;
    assert_eq!(local_len(&data_a, "art", "f"), Some(0));
    // A file still to upload when the node goes down (written as a crash would leave it).
    std::fs::write(data_a.join("relay/alpha/art/g"), &pending).unwrap();
    drop(a);

    let b = super::node_b(&data_a, &data_b);
    let (s, v) = b.api(ADMIN).delete("/v1/tenants/alpha").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let alpha2 = tenant(&b.url, "alpha").await;
    let (_, art) = alpha2.post("/v1/relay", json!({"name": "art"})).await;
    let token2 = art["token"].as_str().unwrap().to_string();

    let a = serve(&data_a, &[]);
    let p = put(&a.url, &token2, "/v1/relay/art/f", bytes.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "a new file: {}", p.body);
    let alpha2_a = a.api(&alpha2.token);
    wait_uploaded(&alpha2_a, "art").await;
    let (s, got, _) = get_bytes(&b.url, &alpha2.token, "/v1/relay/art/f").await;
    assert_eq!((s, got == bytes), (StatusCode::OK, true));
    let (s, _, _) = get_bytes(&b.url, &alpha2.token, "/v1/relay/art/g").await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "the old tenant's pending file was never uploaded"
    );
    let (_, list) = alpha2_a.get("/v1/relay/art").await;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
}

/// A PUT whose meta cannot be written after its link is answered `500`; its retry is answered
/// `200` only once the meta is durable and the file queued: it is uploaded and evicted like any
/// other. (Before, the retry's `200` came from the linked bytes alone: no meta, no upload.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_failed_meta_write_is_made_durable_before_its_answer() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let a = serve(&data, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let token = art["token"].as_str().unwrap().to_string();
    let first = vec![3u8; 50_000];
    let p = put(&a.url, &token, "/v1/relay/art/first", first).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "art").await;

    // The meta directory made immutable (even root cannot create in it): the meta's write
    // fails after the file was linked, as a full or failing disk would make it.
    let metas = data.join("relay/alpha/art/.meta");
    let meta = metas.join("out.bin.json");
    let immutable = Immutable::set(&metas);
    let body: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
    let p = put(&a.url, &token, "/v1/relay/art/out.bin", body.clone()).await;
    assert_eq!(p.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", p.body);
    assert_eq!(local_len(&data, "art", "out.bin"), Some(200_000), "linked");
    let p = put(&a.url, &token, "/v1/relay/art/out.bin", body.clone()).await;
    assert_eq!(
        p.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "no 200 while the meta cannot be written: {}",
        p.body
    );

    drop(immutable);
    let p = put(&a.url, &token, "/v1/relay/art/out.bin", body.clone()).await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.body);
    assert!(meta.is_file(), "the retry's answer came after the meta");
    wait_uploaded(&alpha, "art").await;
    assert_eq!(
        local_len(&data, "art", "out.bin"),
        Some(0),
        "uploaded, evicted"
    );
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/out.bin").await;
    assert_eq!((s, got == body), (StatusCode::OK, true));
}

/// The immutable flag on a directory, cleared on drop (also when the test fails, so its
/// temporary directory can be removed). It needs root and a file system with the flag (ext4
/// here); without them the test fails loudly.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn set(dir: &Path) -> Immutable {
        let out = std::process::Command::new("chattr")
            .arg("+i")
            .arg(dir)
            .output()
            .expect("chattr (e2fsprogs) is needed by this test");
        assert!(
            out.status.success(),
            "chattr +i {}: {} (this test needs root and a file system with the immutable flag)",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Immutable(dir.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-i")
            .arg(&self.0)
            .status();
    }
}

/// One tenant's file that keeps failing to upload (its prefix in the store made immutable)
/// backs off on its own: another tenant's newer file is uploaded meanwhile, and the failing
/// one goes up once the store takes it again. (Before, the oldest failing file ended every
/// pass, so no tenant's file behind it was ever uploaded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_upload_never_holds_up_other_tenants_files() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let a = serve(&data, &[]);
    let mut streams = vec![];
    for name in ["alpha", "beta"] {
        let api = tenant(&a.url, name).await;
        let (_, art) = api.post("/v1/relay", json!({"name": "art"})).await;
        let token = art["token"].as_str().unwrap().to_string();
        let p = put(&a.url, &token, "/v1/relay/art/first", vec![1; 1000]).await;
        assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
        wait_uploaded(&api, "art").await;
        streams.push((api, token));
    }
    let alpha_data = store_dir(&data, "alpha", "art", "data");
    assert!(
        alpha_data.is_dir(),
        "the store layout changed: {alpha_data:?}"
    );
    let immutable = Immutable::set(&alpha_data);
    let (alpha, beta) = (&streams[0], &streams[1]);
    let p = put(&a.url, &alpha.1, "/v1/relay/art/stuck", vec![2; 5000]).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await; // a failed attempt or two
    let p = put(&a.url, &beta.1, "/v1/relay/art/next", vec![3; 5000]).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&beta.0, "art").await;
    let (_, list) = alpha.0.get("/v1/relay").await;
    assert_eq!(list[0]["pending_files"], 1, "still failing: {list}");
    let (_, m) = a.api(ADMIN).get("/metrics").await;
    let failures: u64 = m
        .as_str()
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("strata_relay_upload_failures_total "))
        .expect("a failure counter")
        .parse()
        .unwrap();
    assert!(failures >= 1, "the upload was attempted and failed");

    drop(immutable);
    wait_uploaded(&alpha.0, "art").await;
    assert_eq!(
        local_len(&data, "art", "stuck"),
        Some(0),
        "uploaded, evicted"
    );
}

/// Concurrent PUTs of one name, on a sync stream (which uploads before it takes the name) and
/// on a normal one: exactly one `201`, the same bytes `200`, other bytes `409`, and the stored
/// file is the `201`'s; PUTs of other names go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_of_one_name_have_one_winner() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let a = serve(&data, &[]);
    let alpha = tenant(&a.url, "alpha").await;
    for (stream, sync) in [("art", false), ("wal", true)] {
        let (_, st) = alpha
            .post("/v1/relay", json!({"name": stream, "sync": sync}))
            .await;
        let token = st["token"].as_str().unwrap().to_string();
        for round in 0..3 {
            let name = format!("/v1/relay/{stream}/f{round}");
            let puts = (0..8u8).map(|i| {
                let (url, token, name) = (a.url.clone(), token.clone(), name.clone());
                // Four PUTs of one body, four of another, and one of another name each;
                // in the last round eight empty bodies (a PUT that saw another's link before
                // its meta would take that empty file for no file and remove it).
                let body = if round == 2 {
                    vec![]
                } else {
                    vec![i % 2; 70_000]
                };
                let other = format!("{name}-{i}");
                async move {
                    let (p, q) = tokio::join!(
                        put(&url, &token, &name, body.clone()),
                        put(&url, &token, &other, vec![9; 1000])
                    );
                    assert_eq!(q.status, StatusCode::CREATED, "{}", q.body);
                    (p.status, body)
                }
            });
            let got = futures::future::join_all(puts).await;
            let won: Vec<_> = got
                .iter()
                .filter(|(s, _)| *s == StatusCode::CREATED)
                .collect();
            assert_eq!(
                won.len(),
                1,
                "{stream} {round}: {:?}",
                got.iter().map(|g| g.0).collect::<Vec<_>>()
            );
            let winner = won[0].1.clone();
            for (s, body) in &got {
                let want = if *body == winner {
                    [StatusCode::CREATED, StatusCode::OK]
                } else {
                    [StatusCode::CONFLICT, StatusCode::CONFLICT]
                };
                assert!(want.contains(s), "{stream} {round}: {s}");
            }
            let (s, stored, _) = get_bytes(&a.url, &alpha.token, &name).await;
            assert_eq!((s, stored == winner), (StatusCode::OK, true));
        }
    }
}

/// A file whose bytes a crash lost under its durable meta (the link was not yet synced into
/// the stream's directory), not uploaded: at start nothing is queued for it (recovery walks
/// the files). Other bytes under its name are still `409`; a retry of its own bytes restores
/// the file from the retry's body before its `200`, and it is uploaded and evicted like any
/// other (before, that `200` came from the meta alone and the file was never uploaded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_restores_a_file_whose_bytes_a_crash_lost() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("a");
    let mut a = serve(&data, &[]);
    let mut alpha = tenant(&a.url, "alpha").await;
    let (_, art) = alpha.post("/v1/relay", json!({"name": "art"})).await;
    let token = art["token"].as_str().unwrap().to_string();
    let p = put(&a.url, &token, "/v1/relay/art/first", vec![1; 1000]).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    wait_uploaded(&alpha, "art").await;
    let store = store_dir(&data, "alpha", "art", "data");
    let immutable = Immutable::set(&store); // uploads fail: the file stays local
    let body: Vec<u8> = (0..90_000u32).map(|i| (i % 233) as u8).collect();
    let p = put(&a.url, &token, "/v1/relay/art/lost", body.clone()).await;
    assert_eq!(p.status, StatusCode::CREATED, "{}", p.body);
    drop(a);
    drop(immutable);
    std::fs::remove_file(data.join("relay/alpha/art/lost")).unwrap();
    a = serve(&data, &[]);
    alpha = a.api(&alpha.token);
    let p = put(&a.url, &token, "/v1/relay/art/lost", vec![2; 10]).await;
    assert_eq!(p.status, StatusCode::CONFLICT, "{}", p.body);
    let p = put(&a.url, &token, "/v1/relay/art/lost", body.clone()).await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.body);
    wait_uploaded(&alpha, "art").await;
    assert_eq!(
        local_len(&data, "art", "lost"),
        Some(0),
        "restored, uploaded, evicted"
    );
    let (s, got, _) = get_bytes(&a.url, &alpha.token, "/v1/relay/art/lost").await;
    assert_eq!((s, got == body), (StatusCode::OK, true));
}
