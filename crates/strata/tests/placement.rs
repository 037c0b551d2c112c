//! Tenants placed in buckets of their own: two tenants on separate buckets with separate
//! credentials on moto's S3 server (behind a proxy that refuses, as a bucket policy would, any
//! request to a bucket signed with another bucket's key), and a third on the default bucket.
//! Templates, checkpoints, relay files, restore on a second node, GC and tenant deletion all
//! keep each tenant's keys in its own bucket; a node that lacks a tenant's store serves none
//! of its data rather than put it anywhere else.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

/// Every key in `bucket` (read directly from moto, not through the proxy).
async fn keys(endpoint: &str, bucket: &str) -> Vec<String> {
    let s = strata_store::Store::open_with(
        &format!("s3://{bucket}?endpoint={endpoint}&region=us-east-1&allow_http=true"),
        &strata_store::Credentials {
            access_key_id: Some("lister".into()),
            secret_access_key: Some("lister".into()),
            session_token: None,
        },
    )
    .unwrap();
    let mut out: Vec<String> = s
        .default_inner()
        .list(None)
        .map(|m| m.unwrap().location.to_string())
        .collect()
        .await;
    out.sort();
    out
}

/// The tenants whose keys are in `keys` (`…/t/{tenant}/…`), and any key outside a tenant.
fn owners(keys: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in keys {
        let parts: Vec<&str> = k.split('/').collect();
        let owner = match parts.iter().position(|p| *p == "t") {
            Some(i) if i + 1 < parts.len() => parts[i + 1].to_string(),
            _ => format!("(no tenant: {k})"),
        };
        *m.entry(owner).or_insert(0) += 1;
    }
    m
}

/// The bucket and access key of an S3 request's head (path-style requests).
fn bucket_and_key(head: &str) -> (String, String) {
    let path = head.split_whitespace().nth(1).unwrap_or("");
    let bucket = path
        .trim_start_matches('/')
        .split(['/', '?'])
        .next()
        .unwrap_or("")
        .to_string();
    let akid = head
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("authorization:"))
        .and_then(|l| l.split("Credential=").nth(1))
        .and_then(|c| c.split('/').next())
        .unwrap_or("")
        .to_string();
    (bucket, akid)
}

/// What each test tenant stores: a raw template `image`, a workspace `w` made from it with
/// `block` written at `at`, checkpointed and detached, and `relayed` as relay file
/// `out/result` (a sync stream: in the store before the PUT returns).
async fn seed(api: &Api, image: Vec<u8>, at: u64, block: &[u8], relayed: Vec<u8>) {
    let (s, v) = api.put_bytes("/v1/templates/base?format=raw", image).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = api
        .post("/v1/workspaces", json!({"name": "w", "template": "base"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, att) = api.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    c.write(at, block, false).await.unwrap();
    c.flush().await.unwrap();
    drop(c);
    let (s, v) = api
        .post("/v1/workspaces/w/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = api.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = api
        .post("/v1/relay", json!({"name": "out", "sync": true}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = api.put_bytes("/v1/relay/out/result", relayed).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_in_their_own_buckets_stay_there() {
    let Some(sh) = shared("place").await else {
        return;
    };
    let moto = std::env::var("STRATA_TEST_S3_ENDPOINT").unwrap();
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000;
    let (b_default, b_acme, b_beta) = (
        format!("shared-{n}"),
        format!("acme-{n}"),
        format!("beta-{n}"),
    );
    for b in [&b_default, &b_acme, &b_beta] {
        create_bucket(&moto, b);
    }
    // The bucket policy: each bucket takes requests signed with its own key only.
    let proxy = faultproxy::start(&moto, 1).await;
    let owner: BTreeMap<String, String> = [
        (b_default.clone(), "shared-key".to_string()),
        (b_acme.clone(), "acme-key".to_string()),
        (b_beta.clone(), "beta-key".to_string()),
    ]
    .into();
    let seen: Arc<Mutex<BTreeMap<(String, String), u64>>> = Arc::default();
    let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let (seen, refused) = (seen.clone(), refused.clone());
        proxy.set_gate(Arc::new(move |head: &str| {
            let (bucket, akid) = bucket_and_key(head);
            *seen
                .lock()
                .unwrap()
                .entry((bucket.clone(), akid.clone()))
                .or_insert(0) += 1;
            let ok = owner.get(&bucket) == Some(&akid);
            if !ok {
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                eprintln!("refused: bucket {bucket:?} with key {akid:?}");
            }
            ok
        }));
    }
    let url = |b: &str| {
        format!(
            "s3://{b}/strata?endpoint={}&region=us-east-1&allow_http=true",
            proxy.url
        )
    };
    let d = tempfile::tempdir().unwrap();
    let config = |with_acme: bool| {
        let mut c = format!(
            "store = \"{}\"\ncatalog = \"{}\"\ns3_access_key_id = \"shared-key\"\ns3_secret_access_key = \"s\"\n",
            url(&b_default),
            sh.catalog
        );
        if with_acme {
            c += &format!(
                "[stores.acme]\nurl = \"{}\"\ns3_access_key_id = \"acme-key\"\ns3_secret_access_key = \"a\"\n",
                url(&b_acme)
            );
        }
        c += &format!(
            "[stores.beta-store]\nurl = \"{}\"\ns3_access_key_id = \"beta-key\"\ns3_secret_access_key = \"b\"\n",
            url(&b_beta)
        );
        c
    };
    let write_config = |name: &str, with_acme: bool| {
        let p = d.path().join(name);
        std::fs::write(&p, config(with_acme)).unwrap();
        p.display().to_string()
    };
    let (cfg_full, cfg_partial) = (
        write_config("full.toml", true),
        write_config("partial.toml", false),
    );
    // No AWS_* in the environment: every store signs with the key its config names.
    let node = |dir: &str, id: &str, cfg: &str| {
        serve_env(
            &d.path().join(dir),
            &["--config", cfg, "--node-id", id, "--upload-interval", "1s"],
            &[],
        )
    };
    let a = node("a", "node-a", &cfg_full);
    let admin = Api::new(&a.url, ADMIN);

    // Placement is the admin's, by name only; a name this node lacks is refused.
    let mut tokens = BTreeMap::new();
    for (t, store) in [
        ("alpha", Some("acme")),
        ("beta", Some("beta-store")),
        ("gamma", None),
    ] {
        let mut body = json!({"name": t});
        if let Some(s) = store {
            body["store"] = json!(s);
        }
        let (s, v) = admin.post("/v1/tenants", body).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        tokens.insert(t, v["token"].as_str().unwrap().to_string());
    }
    let (s, v) = admin
        .post("/v1/tenants", json!({"name": "delta", "store": "nope"}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = admin
        .post(
            "/v1/tenants",
            json!({"name": "delta", "store": "s3://elsewhere?endpoint=http://evil"}),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (_, list) = admin.get("/v1/tenants").await;
    let placed: BTreeMap<String, Option<String>> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["store"].as_str().map(str::to_string),
            )
        })
        .collect();
    assert_eq!(placed["alpha"].as_deref(), Some("acme"), "{list}");
    assert_eq!(placed["gamma"], None, "{list}");

    // Each tenant: a template, a workspace written and checkpointed, a relay file.
    let marker = |t: &str| format!("{t}-was-here-").into_bytes().repeat(64);
    for t in ["alpha", "beta", "gamma"] {
        let mut block = marker(t);
        block.resize(65536, 0);
        seed(
            &Api::new(&a.url, &tokens[t]),
            vec![7u8; 1 << 20],
            0,
            &block,
            marker(t),
        )
        .await;
    }

    // Every key is in its tenant's bucket, and only there.
    let check_buckets = |when: &'static str| {
        let (moto, b_default, b_acme, b_beta) = (
            moto.clone(),
            b_default.clone(),
            b_acme.clone(),
            b_beta.clone(),
        );
        async move {
            let (kd, ka, kb) = (
                keys(&moto, &b_default).await,
                keys(&moto, &b_acme).await,
                keys(&moto, &b_beta).await,
            );
            let (od, oa, ob) = (owners(&kd), owners(&ka), owners(&kb));
            eprintln!("{when}: shared {od:?}, acme {oa:?}, beta {ob:?}");
            assert!(
                od.keys().all(|t| t == "gamma"),
                "{when}: shared bucket: {od:?}"
            );
            assert!(
                oa.keys().all(|t| t == "alpha"),
                "{when}: acme bucket: {oa:?}"
            );
            assert!(
                ob.keys().all(|t| t == "beta"),
                "{when}: beta bucket: {ob:?}"
            );
            (od, oa, ob)
        }
    };
    let (od, oa, ob) = check_buckets("after writes").await;
    assert!(od["gamma"] > 0 && oa["alpha"] > 0 && ob["beta"] > 0);

    // A second node restores alpha from its own bucket; GC there walks every tenant's bucket.
    let b = node("b", "node-b", &cfg_full);
    let alpha_b = Api::new(&b.url, &tokens["alpha"]);
    let (s, att) = alpha_b.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    let got = c.read(0, 65536).await.unwrap();
    assert!(got.starts_with(&marker("alpha")), "alpha's data on node b");
    drop(c);
    let (s, v) = alpha_b.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = alpha_b.get("/v1/relay/out/result").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = Api::new(&b.url, ADMIN).post("/v1/gc", json!({})).await;
    assert_eq!(s, StatusCode::OK, "GC over three buckets: {v}");

    // A node without [stores.acme] serves none of alpha's data (and puts it nowhere else);
    // the other tenants work there.
    let c_node = node("c", "node-c", &cfg_partial);
    let alpha_c = Api::new(&c_node.url, &tokens["alpha"]);
    let (s, v) = alpha_c.post("/v1/workspaces/w/attach", json!({})).await;
    assert_ne!(
        s,
        StatusCode::OK,
        "alpha attached where its store is unknown: {v}"
    );
    let msg = v.to_string();
    assert!(msg.contains("acme"), "{msg}");
    let (s, _) = alpha_c.get("/v1/relay/out/result").await;
    assert_ne!(s, StatusCode::OK);
    let gamma_c = Api::new(&c_node.url, &tokens["gamma"]);
    let (s, att) = gamma_c.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let (s, v) = gamma_c.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    check_buckets("after restore, GC and the partial node").await;

    // Deleting beta empties its bucket of its keys and touches no other bucket.
    let (s, v) = admin.delete("/v1/tenants/beta").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (od2, oa2, ob2) = check_buckets("after beta's deletion").await;
    assert!(ob2.is_empty(), "{ob2:?}");
    assert_eq!((od2, oa2), (od, oa.clone()));

    // A new tenant of that name, in the default store, used through node b, which had bound
    // the old one to its bucket (GC above): b reads the placement again.
    let (s, v) = admin.post("/v1/tenants", json!({"name": "beta"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let beta2 = Api::new(&b.url, v["token"].as_str().unwrap());
    let (s, v) = beta2
        .put_bytes("/v1/templates/base?format=raw", vec![5u8; 1 << 20])
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = beta2
        .post("/v1/workspaces", json!({"name": "w", "template": "base"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, att) = beta2.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let (s, v) = beta2
        .post("/v1/workspaces/w/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = beta2.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let od3 = owners(&keys(&moto, &b_default).await);
    let ob3 = owners(&keys(&moto, &b_beta).await);
    eprintln!("after beta's re-creation: shared {od3:?}, beta bucket {ob3:?}");
    assert!(
        ob3.is_empty(),
        "the new beta's data went to the old beta's bucket: {ob3:?}"
    );
    assert!(od3.get("beta").copied().unwrap_or(0) > 0, "{od3:?}");

    let refused = refused.load(std::sync::atomic::Ordering::Relaxed);
    let seen = seen.lock().unwrap().clone();
    eprintln!("requests by (bucket, key): {seen:?}");
    assert_eq!(
        refused, 0,
        "a request reached a bucket with another bucket's key"
    );
    for (bucket, key) in [
        (&b_default, "shared-key"),
        (&b_acme, "acme-key"),
        (&b_beta, "beta-key"),
    ] {
        assert!(
            seen.get(&(bucket.clone(), key.to_string()))
                .copied()
                .unwrap_or(0)
                > 0,
            "no request reached {bucket}"
        );
    }
}

/// Every 4 KiB block of `known` found whole in `hay`.
fn known_blocks_in(hay: &[u8], known: &[Vec<u8>]) -> usize {
    let firsts: std::collections::HashMap<&[u8], Vec<&Vec<u8>>> =
        known.iter().fold(Default::default(), |mut m, b| {
            m.entry(&b[..32]).or_default().push(b);
            m
        });
    let mut found = std::collections::HashSet::new();
    for i in 0..hay.len().saturating_sub(4095) {
        if let Some(cands) = firsts.get(&hay[i..i + 32]) {
            for c in cands {
                if &hay[i..i + 4096] == c.as_slice() {
                    found.insert(c.as_ptr());
                }
            }
        }
    }
    found.len()
}

/// The raw bytes of every key of `tenant` in `bucket`.
async fn raw_of(endpoint: &str, bucket: &str, tenant: &str) -> Vec<u8> {
    let s = strata_store::Store::open_with(
        &format!("s3://{bucket}?endpoint={endpoint}&region=us-east-1&allow_http=true"),
        &strata_store::Credentials {
            access_key_id: Some("scan".into()),
            secret_access_key: Some("scan".into()),
            session_token: None,
        },
    )
    .unwrap();
    let mut out = vec![];
    for k in keys(endpoint, bucket).await {
        if k.contains(&format!("/t/{tenant}/")) {
            let b = s
                .default_inner()
                .get(&object_store::path::Path::from(k.as_str()))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            out.extend_from_slice(&b);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encrypted_tenant_leaves_only_ciphertext_in_the_bucket() {
    let Some(sh) = shared("enc").await else {
        return;
    };
    let moto = std::env::var("STRATA_TEST_S3_ENDPOINT").unwrap();
    let bucket = sh
        .store
        .trim_start_matches("s3://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let d = tempfile::tempdir().unwrap();
    let key_file = |name: &str, hex: &str| {
        use std::os::unix::fs::PermissionsExt;
        let p = d.path().join(name);
        std::fs::write(&p, format!("{hex}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p.display().to_string()
    };
    let master = key_file("master.key", &"3c".repeat(32));
    let other = key_file("other.key", &"c3".repeat(32));
    let node = |dir: &str, id: &str, key: Option<&str>| {
        let mut extra = vec!["--upload-interval", "1s"];
        if let Some(k) = key {
            extra.extend(["--master-key-file", k]);
        }
        sh.node(&d.path().join(dir), id, &extra)
    };
    let a = node("a", "node-a", Some(&master));
    let admin = Api::new(&a.url, ADMIN);
    let mut tok = BTreeMap::new();
    for (t, enc) in [("sealed", true), ("clear", false)] {
        let (s, v) = admin
            .post("/v1/tenants", json!({"name": t, "encrypted": enc}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        tok.insert(t, v["token"].as_str().unwrap().to_string());
    }
    let (_, list) = admin.get("/v1/tenants").await;
    let enc_of = |t: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == t)
            .unwrap()["encrypted"]
            .clone()
    };
    assert_eq!(
        (enc_of("sealed"), enc_of("clear")),
        (json!(true), json!(false))
    );

    // The known file: 256 blocks of 4 KiB, each unique and readable.
    let block = |tag: &str, i: usize| -> Vec<u8> {
        let line = format!("{tag} known block {i:06} of a file the bucket must not show. ");
        line.into_bytes().repeat(100)[..4096].to_vec()
    };
    let image: Vec<u8> = (0..256).flat_map(|i| block("image", i)).collect();
    let written: Vec<u8> = (0..16).flat_map(|i| block("written", i)).collect();
    let relayed: Vec<u8> = (0..4).flat_map(|i| block("relayed", i)).collect();
    let known: Vec<Vec<u8>> = [&image, &written, &relayed]
        .iter()
        .flat_map(|f| f.chunks(4096).map(<[u8]>::to_vec).collect::<Vec<_>>())
        .collect();
    for t in ["sealed", "clear"] {
        seed(
            &Api::new(&a.url, &tok[t]),
            image.clone(),
            512 << 10,
            &written,
            relayed.clone(),
        )
        .await;
    }

    // The scan: the clear tenant's keys show the file (the scan works), the sealed one's none.
    let clear_raw = raw_of(&moto, &bucket, "clear").await;
    let sealed_raw = raw_of(&moto, &bucket, "sealed").await;
    let (in_clear, in_sealed) = (
        known_blocks_in(&clear_raw, &known),
        known_blocks_in(&sealed_raw, &known),
    );
    eprintln!(
        "known 4 KiB blocks found: clear tenant {in_clear} of {} in {} bytes; encrypted tenant {in_sealed} in {} bytes",
        known.len(),
        clear_raw.len(),
        sealed_raw.len()
    );
    assert!(
        in_clear >= 256 + 16,
        "the scan found too little: {in_clear}"
    );
    assert_eq!(in_sealed, 0, "plaintext of a known file in the bucket");
    for needle in [&b"known block"[..], b"relayed", b"written"] {
        assert!(!sealed_raw.windows(needle.len()).any(|w| w == needle));
    }

    // Restore on another node with the master key: the data reads back.
    let b = node("b", "node-b", Some(&master));
    let sealed_b = Api::new(&b.url, &tok["sealed"]);
    let (s, att) = sealed_b.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    assert_eq!(
        c.read(512 << 10, written.len() as u32).await.unwrap(),
        written
    );
    assert_eq!(c.read(0, 512 << 10).await.unwrap(), image[..512 << 10]);
    drop(c);
    let (s, v) = sealed_b.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let r = reqwest::Client::new()
        .get(format!("{}/v1/relay/out/result", b.url))
        .bearer_auth(&tok["sealed"])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.bytes().await.unwrap().to_vec(), relayed);

    // Without the master key, or with another: refused, saying why; the clear tenant works.
    for (dir, id, key) in [("c", "node-c", None), ("d", "node-d", Some(other.as_str()))] {
        let n = node(dir, id, key);
        let api = Api::new(&n.url, &tok["sealed"]);
        let (s, v) = api.post("/v1/workspaces/w/attach", json!({})).await;
        assert_ne!(s, StatusCode::OK, "{id}: {v}");
        assert!(v.to_string().contains("master key"), "{id}: {v}");
        let (s, v) = api.get("/v1/relay/out/result").await;
        assert_ne!(s, StatusCode::OK, "{id}: {v}");
        let clear = Api::new(&n.url, &tok["clear"]);
        let (s, v) = clear.post("/v1/workspaces/w/attach", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{id}: {v}");
        let (s, v) = clear.post("/v1/workspaces/w/detach", json!({})).await;
        assert_eq!(s, StatusCode::OK, "{id}: {v}");
        // Nor can it create encrypted tenants.
        if key.is_none() {
            let (s, v) = Api::new(&n.url, ADMIN)
                .post("/v1/tenants", json!({"name": "nokey", "encrypted": true}))
                .await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        }
    }

    // Deleting the tenant destroys its key and its keys.
    let (s, v) = admin.delete("/v1/tenants/sealed").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(raw_of(&moto, &bucket, "sealed").await.is_empty());
}
