//! Tenant quotas through the daemon: a tenant at its journal quota gets ENOSPC while another
//! writes on; creates, forks, resizes and attaches past their quotas are refused; live and relay
//! byte quotas refuse what adds to the store.

use std::path::Path;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use strata_nbd::client::Client;

use crate::common::*;

/// Writes 1 MiB writes (a flush after each 8) cycling through 64 MiB from `at` for `secs`;
/// the MiB/s.
async fn write_for(c: &mut Client<tokio::net::UnixStream>, at: u64, secs: f64) -> f64 {
    let buf = vec![0xabu8; 1 << 20];
    let t = std::time::Instant::now();
    let mut i = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        c.write(at + ((i % 64) << 20), &buf, false).await.unwrap();
        i += 1;
        if i.is_multiple_of(8) {
            c.flush().await.unwrap();
        }
    }
    c.flush().await.unwrap();
    i as f64 / t.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_quota_gets_enospc_and_the_other_writes_on() {
    use strata_nbd::client::ClientError;
    let d = tempfile::tempdir().unwrap();
    // No background publish but the quota's: the journal shrinks only when it asks.
    let daemon = serve(
        &d.path().join("data"),
        &["--upload-interval", "1h", "--upload-max-bytes", "1GiB"],
    );
    let url = daemon.url.clone();
    let admin = Api::new(&url, ADMIN);
    let small = tenant(&url, "small").await;
    let big = tenant(&url, "big").await;
    let (s, v) = admin
        .call(
            Method::PUT,
            "/v1/tenants/small/quotas",
            Some(json!({"local_journal_bytes": 8u64 << 20, "workspaces": 2,
                        "disk_bytes": 512u64 << 20, "attached_per_node": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["quotas"]["local_journal_bytes"], 8u64 << 20);
    let mut socks = vec![];
    for t in [&small, &big] {
        let (s, v) = t
            .post("/v1/workspaces", json!({"name": "w", "size": 256u64 << 20}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, att) = t.post("/v1/workspaces/w/attach", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{att}");
        socks.push(att["socket"].as_str().unwrap().to_string());
    }
    let mut sc = Client::connect_unix(Path::new(&socks[0]), "w")
        .await
        .unwrap();
    let mut bc = Client::connect_unix(Path::new(&socks[1]), "w")
        .await
        .unwrap();

    // The other quotas: a second workspace fits the count but not the disk bytes; it cannot
    // be attached beside the first, nor grown past the disk bytes; a third is one too many.
    let quota = |(s, v): (StatusCode, Value)| {
        assert_eq!(
            (s, v["error"]["kind"].as_str()),
            (StatusCode::FORBIDDEN, Some("quota")),
            "{v}"
        )
    };
    quota(
        small
            .post("/v1/workspaces", json!({"name": "x", "size": 512u64 << 20}))
            .await,
    );
    let (s, v) = small
        .post(
            "/v1/workspaces",
            json!({"name": "x", "size": 64u64 << 20, "mode": "ephemeral"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    quota(small.post("/v1/workspaces/x/attach", json!({})).await);
    quota(
        small
            .post("/v1/workspaces/x/resize", json!({"size": 300u64 << 20}))
            .await,
    );
    quota(
        small
            .post("/v1/workspaces", json!({"name": "y", "size": 4096}))
            .await,
    );

    // A durable workspace writing three times its tenant's journal quota: every write goes
    // through, paced by the publishes the quota starts, and the journal stays bounded.
    let t0 = std::time::Instant::now();
    let buf = vec![0x11u8; 1 << 20];
    let mut peak = 0u64;
    for i in 0..24u64 {
        sc.write(i << 20, &buf, false).await.unwrap();
        if i % 4 == 3 {
            sc.flush().await.unwrap();
            let (_, u) = small.get("/v1/usage").await;
            peak = peak.max(u["local_journal_bytes"].as_u64().unwrap());
        }
    }
    sc.flush().await.unwrap();
    println!(
        "quota: 24 MiB through an 8 MiB journal quota in {:?}, journal at most {peak} bytes",
        t0.elapsed()
    );
    assert!(peak <= (9 << 20), "{peak}");
    assert_eq!(sc.read(23 << 20, 4096).await.unwrap(), vec![0x11u8; 4096]);
    drop(sc);
    let (s, v) = small.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // An ephemeral workspace never publishes: at the quota its writes wait, then get ENOSPC.
    let (s, att) = small.post("/v1/workspaces/x/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut sc = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "x")
        .await
        .unwrap();
    let mut written = 0u64;
    let refused = loop {
        match sc.write(written << 20, &buf, false).await {
            Ok(()) => written += 1,
            Err(ClientError::Nbd { errno, .. }) => break errno,
            Err(e) => panic!("{e}"),
        }
        assert!(written <= 9, "no ENOSPC after {written} MiB");
    };
    assert_eq!(refused, 28, "ENOSPC");
    assert!((7..=8).contains(&written), "{written} MiB before the quota");
    sc.flush().await.unwrap();

    // Big writes on while small keeps hitting its quota: rounds of big alone and big beside
    // small's refused writes, alternating (so other load on the machine falls on both).
    let active = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (active2, stop2) = (active.clone(), stop.clone());
    let hammer = tokio::spawn(async move {
        let mut refusals = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if !active2.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                continue;
            }
            match sc.write(32 << 20, &vec![0x22u8; 1 << 20], false).await {
                Err(ClientError::Nbd { errno: 28, .. }) => refusals += 1,
                other => panic!("{other:?}"),
            }
        }
        (sc, refusals)
    });
    let (mut alone, mut during) = (vec![], vec![]);
    for round in 0..6u64 {
        let busy = round % 2 == 1;
        active.store(busy, std::sync::atomic::Ordering::Relaxed);
        let speed = write_for(&mut bc, (round % 3) << 26, 0.8).await;
        if busy {
            during.push(speed)
        } else {
            alone.push(speed)
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut sc, refusals) = hammer.await.unwrap();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (alone, during) = (mean(&alone), mean(&during));
    println!(
        "quota: big alone {alone:.0} MiB/s, beside small held at its quota {during:.0} MiB/s ({:.2}x); small: {refusals} writes refused",
        during / alone
    );
    assert!(refusals > 0);
    assert!(
        during > 0.5 * alone,
        "big slowed to {during:.0} from {alone:.0} MiB/s"
    );

    // Usage against a recount: the workspaces, their sizes, and the journal the volume
    // reports.
    let (s, u) = small.get("/v1/usage").await;
    assert_eq!(s, StatusCode::OK, "{u}");
    let (_, list) = small.get("/v1/workspaces").await;
    let list = list.as_array().unwrap();
    assert_eq!(u["workspaces"], list.len());
    let disk: u64 = list.iter().map(|w| w["disk_size"].as_u64().unwrap()).sum();
    assert_eq!(u["disk_bytes"], disk);
    assert_eq!(u["attached_here"], 1);
    let (_, view) = small.get("/v1/workspaces/x").await;
    let journal = view["stats"]["journal_bytes"].as_u64().unwrap();
    assert_eq!(u["local_journal_bytes"], journal, "{u} {view}");
    assert!(journal <= 8 << 20 && journal > 7 << 20, "{journal}");
    let (_, bu) = big.get("/v1/usage").await;
    assert!(bu["local_journal_bytes"].as_u64() > Some(32 << 20), "{bu}");
    assert!(bu["quotas"].as_object().unwrap().is_empty(), "{bu}");
    assert_eq!(sc.read(0, 4096).await.unwrap(), vec![0x11u8; 4096]);

    // The node's metrics name the tenant's journal against its quota.
    let (_, m) = admin.get("/metrics").await;
    let m = m.as_str().unwrap_or_default().to_string();
    for line in [
        "strata_tenant_journal_quota_bytes{tenant=\"small\"} 8388608",
        "strata_tenant_attached{tenant=\"small\"} 1",
        &format!("strata_tenant_journal_bytes{{tenant=\"small\"}} {journal}"),
    ] {
        assert!(m.contains(line), "{line} not in {m}");
    }

    // Live bytes in the store (w's published 24 MiB) and their meter: each reading adds the
    // previous one's bytes times the time since it.
    let live = u["store"]["live_bytes"].as_u64().unwrap();
    assert!(live >= 24 << 20, "{u}");
    let before = u["meter"]["byte_seconds"].as_f64().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (_, later) = small.get("/v1/usage").await;
    let gained = later["meter"]["byte_seconds"].as_f64().unwrap() - before;
    assert!(
        gained >= live as f64 * 0.29 && gained <= live as f64 * 2.0,
        "{gained} byte-seconds over 0.3 s of {live} bytes: {later}"
    );
}

/// The store quotas: past `live_bytes`, what adds data to the store is refused (a guest's
/// writes and their publishes are not); a relay file that would pass `relay_bytes` waiting on
/// the node is refused. Usage's live bytes match a recount from the bucket's own files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_and_relay_byte_quotas_refuse_what_adds_to_the_store() {
    let d = tempfile::tempdir().unwrap();
    let node = serve(&d.path().join("data"), &["--upload-interval", "1h"]);
    let admin = Api::new(&node.url, ADMIN);
    let t = tenant(&node.url, "lq").await;
    let (s, v) = t
        .put_bytes("/v1/templates/base?format=raw", vec![9u8; 2 << 20])
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = t
        .post("/v1/workspaces", json!({"name": "w", "template": "base"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, u) = t.get("/v1/usage").await;
    let live = u["store"]["live_bytes"].as_u64().unwrap();
    // Recount from scratch: the template's objects, on the store's own disk.
    let mut on_disk = 0;
    let mut stack = vec![d.path().join("data/objects/t/lq/obj")];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                on_disk += e.metadata().unwrap().len();
            }
        }
    }
    eprintln!("live bytes: usage {live}, recount of the object files {on_disk}");
    // Usage counts the objects' data (here the 2 MiB image), the files add their framing.
    assert_eq!(live, 2 << 20, "{u}");
    assert!(on_disk >= live && on_disk - live < 64 << 10, "{on_disk}");
    let quota = |q: Value| {
        let admin = &admin;
        async move {
            let (s, v) = admin
                .call(Method::PUT, "/v1/tenants/lq/quotas", Some(q))
                .await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    };
    quota(json!({"live_bytes": live})).await;
    let refused = |(s, v): (StatusCode, Value)| {
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
        assert_eq!(v["error"]["kind"], "quota", "{v}");
    };
    refused(
        t.post("/v1/workspaces", json!({"name": "w2", "template": "base"}))
            .await,
    );
    refused(t.post("/v1/workspaces/w/fork", json!({"name": "f"})).await);
    refused(t.post("/v1/workspaces/w/checkpoint", json!({})).await);
    refused(
        t.put_bytes("/v1/templates/more?format=raw", vec![1u8; 1 << 20])
            .await,
    );
    // (The refused upload's body was never read: the server closed that connection.)
    let t = Api::new(&node.url, &t.token);
    // A guest's writes and their publish are not refused.
    let (s, att) = t.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    c.write(0, &[3u8; 65536], false).await.unwrap();
    c.flush().await.unwrap();
    drop(c);
    let (s, v) = t.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Raised: allowed again.
    quota(json!({"live_bytes": live * 4, "relay_bytes": 1000})).await;
    let (s, v) = t.post("/v1/workspaces/w/checkpoint", json!({})).await;
    assert_ne!(s, StatusCode::FORBIDDEN, "{v}");
    // Relay bytes waiting on this node (uploads every hour here).
    let (s, v) = t.post("/v1/relay", json!({"name": "out"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = t.put_bytes("/v1/relay/out/a", vec![1u8; 600]).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    refused(t.put_bytes("/v1/relay/out/b", vec![1u8; 600]).await);
    let t = Api::new(&node.url, &t.token);
    let (s, v) = t.put_bytes("/v1/relay/out/c", vec![1u8; 300]).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}
