//! Scale-out: several `strata serve` nodes sharing one PostgreSQL catalog and one S3-protocol
//! object store (a real PostgreSQL server and moto's S3 server on loopback, started by
//! `.ci/run`). Black-box: the real binary, HTTP, NBD and a real ext4.
//!
//! - a node is killed with SIGKILL; another takes its workspaces over after the lease expires
//!   and restores them from their heads: checkpointed data is always there, flushed-only data is
//!   there exactly when the dead node had reported its remote window drained (and always in
//!   `sync` mode), and e2fsck accepts every result;
//! - split brain: a node paused (SIGSTOP) past its lease is fenced after it resumes: it
//!   acknowledges nothing more and can never move the head;
//! - a race of forks and checkpoints through both nodes leaves every head history linear.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};
use strata_nbd::client::Client;

/// Attaches `ws` through `api`, retrying while another node's lease is live (up to `wait`).
async fn attach_when_free(api: &Api, ws: &str, wait: Duration) -> Value {
    let t0 = Instant::now();
    loop {
        let (s, v) = api
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        match s {
            StatusCode::OK => return v,
            StatusCode::CONFLICT if t0.elapsed() < wait => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            _ => panic!("attach {ws}: {s} {v}"),
        }
    }
}

async fn stats(api: &Api, ws: &str) -> Value {
    let (s, v) = api.get(&format!("/v1/workspaces/{ws}")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["stats"].clone()
}

const WRITE_SET: &str = r#"
mkdir -p "$mnt/$set"
for i in $(seq 1 6); do head -c $((i * 40000 + 123)) /dev/urandom > "$mnt/$set/f$i"; done
(cd "$mnt" && sha256sum $set/f* > "$mnt/SUMS-$set")
"#;

/// mkfs (first time only), mount, write file set `set`, unmount, fsck, and flush the device.
fn write_phase(dir: &Path, uri: &str, tag: &str, set: &str, mkfs: bool) -> String {
    mount_script(
        dir,
        uri,
        tag,
        &format!(
            r#"{mkfs}
loop=$(losetup -f --show "$file")
mount "$loop" "$mnt"
set={set}
{WRITE_SET}
umount "$mnt"
e2fsck -f -n "$loop"
losetup -d "$loop"; loop=
sync "$file""#,
            mkfs = if mkfs {
                r#"mkfs.ext4 -q -F "$file""#
            } else {
                ""
            },
        ),
    )
}

/// Read-only check: e2fsck clean, set one verifies; prints HAS-two or NO-two (verifying set two
/// when present).
fn read_phase(dir: &Path, uri: &str, tag: &str) -> String {
    mount_script(
        dir,
        uri,
        tag,
        r#"loop=$(losetup -f --show -r "$file")
e2fsck -f -n "$loop" >/dev/null
mount -o ro "$loop" "$mnt"
(cd "$mnt" && sha256sum -c --quiet SUMS-one)
if [ -e "$mnt/SUMS-two" ]; then (cd "$mnt" && sha256sum -c --quiet SUMS-two); echo HAS-two; else [ ! -e "$mnt/two" ] || { echo "two/ exists without SUMS-two" >&2; exit 1; }; echo NO-two; fi"#,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_s_workspaces_restore_on_another_node_from_their_heads() {
    let Some(sh) = shared("kill").await else {
        return;
    };
    if !can_mount() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    // a1 never publishes on its own (its remote window stays open); a2 drains within ~300 ms.
    let a1 = sh.node(
        &d.path().join("a1"),
        "node-a1",
        &["--upload-interval", "1h", "--upload-max-bytes", "1TiB"],
    );
    let a2 = sh.node(
        &d.path().join("a2"),
        "node-a2",
        &["--upload-interval", "300ms"],
    );
    let b = sh.node(&d.path().join("b"), "node-b", &[]);
    let t = tenant(&a1.url, "alpha").await;
    let (api1, api2, apib) = (a1.api(&t.token), a2.api(&t.token), b.api(&t.token));
    let cases = [
        ("held", &api1, "durable"),
        ("drained", &api2, "durable"),
        ("synced", &api2, "sync"),
    ];
    let mut windows = vec![];
    for (ws, api, mode) in cases {
        let (s, v) = api
            .post(
                "/v1/workspaces",
                json!({"name": ws, "size": 64 << 20, "mode": mode}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, att) = api
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{att}");
        let uri = att["export"].as_str().unwrap().to_string();
        let (ok, _, err) = bash(write_phase(d.path(), &uri, &format!("{ws}1"), "one", true)).await;
        assert!(ok, "{ws} phase one: {err}");
        let (s, cp) = api
            .post(
                &format!("/v1/workspaces/{ws}/checkpoint"),
                // Published before the node dies: that is what another node may count on.
                json!({"label": "one", "wait": true}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{cp}");
        let (ok, _, err) = bash(write_phase(d.path(), &uri, &format!("{ws}2"), "two", false)).await;
        assert!(ok, "{ws} phase two: {err}");
        // What the node reports before it dies decides what another node may find.
        let mut st = stats(api, ws).await;
        if ws == "drained" {
            let t0 = Instant::now();
            while st["window_bytes"].as_u64() != Some(0) {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "never drained: {st}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
                st = stats(api, ws).await;
            }
        }
        let window = st["window_bytes"].as_u64().unwrap();
        eprintln!("{ws} ({mode}): remote window {window} bytes when its node is killed");
        windows.push((ws, window));
    }
    assert!(windows[0].1 > 0, "held keeps an open window: {windows:?}");
    assert_eq!(windows[2].1, 0, "a sync-mode flush drains the window");
    // Node b is refused while a1 lives, and told who holds the workspace.
    let (s, v) = apib.post("/v1/workspaces/held/attach", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(v.to_string().contains("node-a1"), "{v}");
    // The nodes view shows both writers with their windows.
    let (s, nodes) = b.api(ADMIN).get("/v1/nodes").await;
    assert_eq!(s, StatusCode::OK, "{nodes}");
    let a1_view = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "node-a1")
        .cloned()
        .unwrap_or_default();
    assert_eq!(a1_view["alive"], true, "{nodes}");
    assert_eq!(a1_view["attached"][0]["workspace"], "held", "{nodes}");
    drop(a1); // SIGKILL
    drop(a2);
    for (ws, window) in windows {
        let att = attach_when_free(&apib, ws, Duration::from_secs(20)).await;
        let uri = att["export"].as_str().unwrap().to_string();
        let (ok, out, err) = bash(read_phase(d.path(), &uri, &format!("{ws}r"))).await;
        assert!(ok, "{ws} on node b: {err}{out}");
        let expect = if window == 0 { "HAS-two" } else { "NO-two" };
        assert_eq!(
            out.lines().last(),
            Some(expect),
            "{ws}: window {window} at the kill, node b found {out}"
        );
    }
    let (_, nodes) = b.api(ADMIN).get("/v1/nodes").await;
    let b_view = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "node-b")
        .cloned()
        .unwrap_or_default();
    assert!(b_view.to_string().contains("held"), "{nodes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_is_fenced_and_never_moves_the_head() {
    let Some(sh) = shared("split").await else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let a = sh.node(
        &d.path().join("a"),
        "node-a",
        &["--upload-interval", "200ms"],
    );
    let b = sh.node(&d.path().join("b"), "node-b", &[]);
    let t = tenant(&a.url, "alpha").await;
    let (api_a, api_b) = (a.api(&t.token), b.api(&t.token));
    let (s, v) = api_a
        .post("/v1/workspaces", json!({"name": "sb", "size": 16 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = api_a.post("/v1/workspaces/sb/attach", json!({})).await;
    let sock_a = att["socket"].as_str().unwrap().to_string();
    let mut ca = Client::connect_unix(Path::new(&sock_a), "sb")
        .await
        .unwrap();
    ca.write(0, &[1; 65536], false).await.unwrap();
    ca.flush().await.unwrap();
    let (s, v) = api_a
        .post("/v1/workspaces/sb/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Pause a past its lease (2 s TTL); b takes over.
    a.signal("STOP");
    let att = attach_when_free(&api_b, "sb", Duration::from_secs(10)).await;
    let mut cb = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "sb")
        .await
        .unwrap();
    assert!(cb.read(0, 65536).await.unwrap().iter().all(|&x| x == 1));
    cb.write(65536, &[2; 4096], false).await.unwrap();
    cb.flush().await.unwrap();
    let (s, cp_b) = api_b
        .post("/v1/workspaces/sb/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{cp_b}");
    let head_b = cp_b["version"].as_u64().unwrap();
    let lease_b = api_b.get("/v1/workspaces/sb").await.1["lease"].clone();
    assert_eq!(lease_b["holder"], "node-b", "{lease_b}");
    // a resumes: nothing it does is acknowledged as durable, and the head does not move.
    a.signal("CONT");
    let w = ca.write(131072, &[3; 4096], false).await;
    let f = ca.flush().await;
    assert!(
        w.is_err() || f.is_err(),
        "a fenced node acknowledged a write and a flush"
    );
    let (s, v) = api_a.post("/v1/workspaces/sb/checkpoint", json!({})).await;
    assert_ne!(s, StatusCode::OK, "a fenced checkpoint succeeded: {v}");
    // Give a's background uploader time to try (200 ms interval).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, log) = api_b.get("/v1/workspaces/sb/log").await;
    let log = log.as_array().unwrap().clone();
    let versions: Vec<u64> = log.iter().map(|c| c["version"].as_u64().unwrap()).collect();
    assert_eq!(
        versions,
        (1..=head_b).collect::<Vec<_>>(),
        "no version after b's: {log:?}"
    );
    let epochs: Vec<u64> = log.iter().map(|c| c["epoch"].as_u64().unwrap()).collect();
    assert!(epochs.windows(2).all(|w| w[0] <= w[1]), "{epochs:?}");
    assert_eq!(
        log.last().unwrap()["epoch"],
        lease_b["epoch"],
        "the head was moved by the current holder"
    );
    // b's view has its own write and never a's late one.
    assert!(cb.read(65536, 4096).await.unwrap().iter().all(|&x| x == 2));
    assert!(cb.read(131072, 4096).await.unwrap().iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_forks_and_checkpoints_through_two_nodes_keep_histories_linear() {
    let Some(sh) = shared("race").await else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let a = sh.node(&d.path().join("a"), "node-a", &["--upload-interval", "1h"]);
    let b = sh.node(&d.path().join("b"), "node-b", &["--upload-interval", "1h"]);
    let t = tenant(&a.url, "alpha").await;
    let apis = [a.api(&t.token), b.api(&t.token)];
    const WS: usize = 4;
    for i in 0..WS {
        let (s, v) = apis[0]
            .post(
                "/v1/workspaces",
                json!({"name": format!("w{i}"), "size": 16 << 20}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        // w0, w1 on node a; w2, w3 on node b; each with some data.
        let (s, att) = apis[i / 2]
            .post(&format!("/v1/workspaces/w{i}/attach"), json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{att}");
        let mut c =
            Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), &format!("w{i}"))
                .await
                .unwrap();
        c.write(0, &[i as u8 + 1; 8192], true).await.unwrap();
    }
    let apis = std::sync::Arc::new(apis);
    let tasks: Vec<_> = (0..16)
        .map(|client| {
            let apis = apis.clone();
            tokio::spawn(async move {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::SmallRng::seed_from_u64(client);
                let mut cps = vec![];
                let mut forks = vec![];
                for op in 0..6 {
                    let ws = rng.random_range(0..WS);
                    let node = rng.random_range(0..2);
                    let api = &apis[node];
                    if rng.random_bool(0.6) {
                        let (s, v) = api
                            .post(
                                &format!("/v1/workspaces/w{ws}/checkpoint"),
                                json!({ "wait": true }),
                            )
                            .await;
                        if node == ws / 2 {
                            assert_eq!(s, StatusCode::OK, "checkpoint on the holder: {v}");
                            cps.push((ws, v["version"].as_u64().unwrap()));
                        } else {
                            assert_eq!(s, StatusCode::CONFLICT, "checkpoint elsewhere: {v}");
                            let holder = if ws / 2 == 0 { "node-a" } else { "node-b" };
                            assert!(v.to_string().contains(holder), "{v}");
                        }
                    } else {
                        let name = format!("f{client}x{op}");
                        let (s, v) = api
                            .post(&format!("/v1/workspaces/w{ws}/fork"), json!({"name": name}))
                            .await;
                        assert_eq!(s, StatusCode::CREATED, "fork: {v}");
                        forks.push((ws, name, v["source"].as_str().unwrap().to_string()));
                    }
                }
                (cps, forks)
            })
        })
        .collect();
    let mut cps = vec![];
    let mut forks = vec![];
    for t in tasks {
        let (c, f) = t.await.unwrap();
        cps.extend(c);
        forks.extend(f);
    }
    for i in 0..WS {
        let (_, log) = apis[1].get(&format!("/v1/workspaces/w{i}/log")).await;
        let versions: Vec<u64> = log
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["version"].as_u64().unwrap())
            .collect();
        let n = versions.len() as u64;
        assert_eq!(
            versions,
            (1..=n).collect::<Vec<_>>(),
            "w{i}: linear history"
        );
        let mut mine: Vec<u64> = cps.iter().filter(|c| c.0 == i).map(|c| c.1).collect();
        let k = mine.len();
        mine.sort();
        mine.dedup();
        assert_eq!(mine.len(), k, "w{i}: a version was handed out twice");
        assert!(mine.iter().all(|v| *v <= n), "w{i}: lost version");
    }
    assert!(!forks.is_empty() && !cps.is_empty());
    for (ws, name, source) in &forks {
        let (s, v) = apis[0].get(&format!("/v1/workspaces/{name}/log")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        // A fork of a live workspace on its holder starts at the published base (`livefork`)
        // and publishes its data as version 2 in the background.
        let log = v.as_array().unwrap();
        let kinds: Vec<&str> = log.iter().filter_map(|c| c["kind"].as_str()).collect();
        assert!(
            kinds == ["fork"] || kinds == ["livefork"] || kinds == ["livefork", "auto"],
            "{name}: {v}"
        );
        let (src, ver) = source
            .strip_prefix("ws:")
            .and_then(|s| s.split_once('@'))
            .unwrap_or_else(|| panic!("{name}: source {source}"));
        assert_eq!(src, format!("w{ws}"));
        let ver: u64 = ver.parse().unwrap();
        let (s, _) = apis[0].get(&format!("/v1/workspaces/w{ws}/log")).await;
        assert_eq!(s, StatusCode::OK);
        assert!(ver >= 1, "{name} forks an existing version");
    }
    // Every fork reads its source's data, on either node (a live fork once it has published
    // and its node has let go of it: until then the other node is refused).
    let (ws, name, _) = &forks[0];
    let started = std::time::Instant::now();
    let att = loop {
        let (s, att) = apis[1]
            .post(&format!("/v1/workspaces/{name}/attach"), json!({}))
            .await;
        if s == StatusCode::OK {
            break att;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{name} never attached on the other node: {s} {att}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), name)
        .await
        .unwrap();
    assert!(c
        .read(0, 8192)
        .await
        .unwrap()
        .iter()
        .all(|&x| x == *ws as u8 + 1));
}

/// The remote window (acknowledged bytes not yet in a published head: what a node loss costs a
/// durable workspace) under a steady write load on S3, sampled from the API. The age of the
/// window must stay within the upload interval plus the time one publish takes.
/// `STRATA_WINDOW_SECS` (default 6) and `STRATA_WINDOW_RATE_MIB` (default 4) set the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_remote_window_stays_bounded_under_a_steady_write_load() {
    let Some(sh) = shared("window").await else {
        return;
    };
    let secs: u64 = std::env::var("STRATA_WINDOW_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let rate_mib: u64 = std::env::var("STRATA_WINDOW_RATE_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let d = tempfile::tempdir().unwrap();
    let a = sh.node(
        &d.path().join("a"),
        "node-a",
        &["--upload-interval", "1s", "--upload-max-bytes", "8MiB"],
    );
    let t = tenant(&a.url, "alpha").await;
    let api = a.api(&t.token);
    let (s, v) = api
        .post("/v1/workspaces", json!({"name": "load", "size": 256 << 20}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, att) = api.post("/v1/workspaces/load/attach", json!({})).await;
    let sock = att["socket"].as_str().unwrap().to_string();
    let writer = tokio::spawn(async move {
        let mut c = Client::connect_unix(Path::new(&sock), "load")
            .await
            .unwrap();
        let t0 = Instant::now();
        let block = vec![0x5a; 64 << 10];
        let mut written = 0u64;
        let mut off = 0u64;
        while t0.elapsed() < Duration::from_secs(secs) {
            // Pace to the target rate; flush every 1 MiB like a guest fsync'ing its log.
            let due = t0.elapsed().as_secs_f64() * (rate_mib << 20) as f64;
            if (written as f64) < due {
                c.write(off, &block, false).await.unwrap();
                written += block.len() as u64;
                off = (off + block.len() as u64) % (256 << 20);
                if written.is_multiple_of(1 << 20) {
                    c.flush().await.unwrap();
                }
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        c.flush().await.unwrap();
        written
    });
    let mut samples = vec![];
    while !writer.is_finished() {
        let st = stats(&api, "load").await;
        samples.push((
            st["window_bytes"].as_u64().unwrap(),
            st["window_age_ms"].as_u64().unwrap(),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let written = writer.await.unwrap();
    let mut bytes: Vec<u64> = samples.iter().map(|s| s.0).collect();
    let mut ages: Vec<u64> = samples.iter().map(|s| s.1).collect();
    bytes.sort();
    ages.sort();
    let pct = |v: &[u64], p: f64| v[((v.len() - 1) as f64 * p) as usize];
    let st = stats(&api, "load").await;
    eprintln!(
        "remote window under {rate_mib} MiB/s for {secs} s ({} MiB written, {} samples, {} publishes): \
         bytes p50 {} p99 {} max {}; age ms p50 {} p99 {} max {}",
        written >> 20,
        samples.len(),
        st["publishes"],
        pct(&bytes, 0.5),
        pct(&bytes, 0.99),
        bytes[bytes.len() - 1],
        pct(&ages, 0.5),
        pct(&ages, 0.99),
        ages[ages.len() - 1]
    );
    assert!(st["publishes"].as_u64().unwrap() >= 2, "uploads ran: {st}");
    assert!(
        ages[ages.len() - 1] < 1_000 + 10_000,
        "window age beyond interval + 10 s: {:?}",
        &ages[ages.len() - 5..]
    );
}

/// GC on PostgreSQL + S3 (real listings, last-modified times and deletes): node b collects
/// what a workspace deleted on node a held, while node a's other workspace keeps every
/// retained version readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_s3_and_postgres_reclaims_only_what_nobody_references() {
    let Some(sh) = shared("gc").await else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let flags = [
        "--gc-grace",
        "1s",
        "--gc-interval",
        "off",
        "--keep-checkpoints",
        "0",
    ];
    let a = sh.node(&d.path().join("a"), "node-a", &flags);
    let b = sh.node(&d.path().join("b"), "node-b", &flags);
    let t = tenant(&a.url, "alpha").await;
    let api = a.api(&t.token);
    for ws in ["stay", "drop"] {
        let (s, v) = api
            .post("/v1/workspaces", json!({"name": ws, "size": 8 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, att) = api
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), ws)
            .await
            .unwrap();
        for round in 1..=3u8 {
            c.write(0, &vec![round; 1 << 20], false).await.unwrap();
            let body = if round == 2 {
                json!({"label": "keep", "wait": true})
            } else {
                json!({ "wait": true })
            };
            let (s, v) = api
                .post(&format!("/v1/workspaces/{ws}/checkpoint"), body)
                .await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    }
    let (s, v) = api.delete("/v1/workspaces/drop").await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let admin_b = b.api(ADMIN);
    let mut deleted = 0;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (s, r) = admin_b.post("/v1/gc", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        deleted += r["deleted_bytes"].as_u64().unwrap();
    }
    assert!(deleted >= 3 << 20, "reclaimed {deleted}");
    let (_, dry) = admin_b.post("/v1/gc", json!({"dry_run": true})).await;
    assert_eq!(dry["unreferenced_keys"], 0, "{dry}");
    // Every retained version of "stay" reads back through a third node with a cold cache.
    let (_, log) = api.get("/v1/workspaces/stay/log").await;
    let c3 = sh.node(&d.path().join("c"), "node-c", &flags);
    let api_c = c3.api(&t.token);
    for cp in log.as_array().unwrap() {
        let v = cp["version"].as_u64().unwrap();
        let name = format!("check{v}");
        let (s, r) = api_c
            .post(
                "/v1/workspaces/stay/fork",
                json!({"name": name, "version": v}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{r}");
        let (_, att) = api_c
            .post(&format!("/v1/workspaces/{name}/attach"), json!({}))
            .await;
        let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), &name)
            .await
            .unwrap();
        let data = c.read(0, 1 << 20).await.unwrap();
        let want = if cp["label"] == "keep" { 2 } else { 3 };
        assert!(data.iter().all(|&x| x == want), "v{v}");
    }
}
