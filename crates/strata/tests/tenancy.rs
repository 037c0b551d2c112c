//! Tenants as the daemon enforces them, through HTTP only: every documented endpoint against
//! every kind of token (admin, rotated admin, tenant, scoped, stream, expired, revoked, another
//! tenant, none), token lifecycle, admin token rotation through the token file, and deleting a
//! tenant with everything it owns while other tenants carry on. Quotas: `tenancy/quotas.rs`;
//! one tenant's misbehaviour bounded to its own share: `tenancy/neighbours.rs` (and all of it at
//! once beside a steady tenant: `tests/noisy.rs`).

use std::collections::BTreeMap;
use std::path::Path;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use strata_nbd::client::Client;

mod common;
use common::*;
#[path = "tenancy/neighbours.rs"]
mod neighbours;
#[path = "tenancy/quotas.rs"]
mod quotas;

/// A tenant "alpha" with a template, a workspace, a relay stream with one file, and a spare
/// token whose id the matrix names.
struct World {
    alpha: Api,
    names: BTreeMap<&'static str, String>,
}

async fn world(url: &str) -> World {
    let alpha = tenant(url, "alpha").await;
    let (s, v) = alpha
        .put_bytes("/v1/templates/base?format=raw", vec![0u8; 1 << 20])
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = alpha
        .post("/v1/workspaces", json!({"name": "w1", "template": "base"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = alpha.post("/v1/workspaces/w1/checkpoint", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = alpha.post("/v1/relay", json!({"name": "s1"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = alpha
        .put_bytes("/v1/relay/s1/f1", b"relayed".to_vec())
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, spare) = alpha.post("/v1/tokens", json!({"label": "spare"})).await;
    assert_eq!(s, StatusCode::CREATED, "{spare}");
    let names = BTreeMap::from([
        ("workspace", "w1".to_string()),
        ("template", "base".to_string()),
        ("tenant", "alpha".to_string()),
        ("stream", "s1".to_string()),
        ("file", "f1".to_string()),
        ("version", "1".to_string()),
        ("id", spare["id"].as_str().unwrap().to_string()),
    ]);
    World { alpha, names }
}

/// A documented path with alpha's names in it.
fn fill(path: &str, names: &BTreeMap<&'static str, String>) -> String {
    let name = if path.starts_with("/v1/workspaces") {
        &names["workspace"]
    } else if path.starts_with("/v1/templates") {
        &names["template"]
    } else if path.starts_with("/v1/tenants") {
        &names["tenant"]
    } else {
        &names["file"]
    };
    path.replace("{name}", name)
        .replace("{stream}", &names["stream"])
        .replace("{version}", &names["version"])
        .replace("{id}", &names["id"])
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Admin,
    RotatedAdmin,
    Full,
    Read,
    Attach,
    Relay,
    Stream,
    Expired,
    Revoked,
    OtherTenant,
    Nobody,
}

/// Whether `kind` may call `method path` on alpha's names (the policy the daemon must keep).
fn allowed(kind: Kind, method: &str, path: &str) -> bool {
    let public = matches!(path, "/v1/health" | "/v1/openapi.json");
    let admin_route =
        path.starts_with("/v1/tenants") || matches!(path, "/v1/nodes" | "/v1/gc" | "/metrics");
    let get = method == "get";
    if public {
        return true;
    }
    match kind {
        Kind::Admin | Kind::RotatedAdmin => admin_route,
        Kind::Full => !admin_route,
        Kind::Read => {
            get && [
                "/v1/workspaces",
                "/v1/templates",
                "/v1/mounts",
                "/v1/relay",
                "/v1/usage",
            ]
            .iter()
            .any(|p| path.starts_with(p))
        }
        Kind::Attach => matches!(
            (method, path),
            ("get", "/v1/workspaces")
                | ("get", "/v1/workspaces/{name}")
                | ("post", "/v1/workspaces/{name}/attach")
                | ("post", "/v1/workspaces/{name}/detach")
        ),
        Kind::Relay => path.starts_with("/v1/relay"),
        Kind::Stream => method == "put" && path == "/v1/relay/{stream}/{name}",
        // Collection routes answer with the caller's own (checked below), and a template
        // upload names one in the caller's own namespace; alpha's names are never reachable.
        Kind::OtherTenant => {
            !admin_route
                && (!path.contains('{') || (method == "put" && path == "/v1/templates/{name}"))
        }
        Kind::Expired | Kind::Revoked | Kind::Nobody => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_refuses_every_token_that_may_not_call_it() {
    let d = tempfile::tempdir().unwrap();
    let admin_file = d.path().join("admin-tokens");
    std::fs::write(&admin_file, "# rotated in\nadmin-next\n").unwrap();
    let daemon = serve(
        &d.path().join("data"),
        &["--admin-token-file", admin_file.to_str().unwrap()],
    );
    let url = daemon.url.clone();
    let w = world(&url).await;
    let beta = tenant(&url, "beta").await;
    let mut tokens: Vec<(Kind, String)> = vec![
        (Kind::Admin, ADMIN.into()),
        (Kind::RotatedAdmin, "admin-next".into()),
        (Kind::Full, w.alpha.token.clone()),
        (Kind::OtherTenant, beta.token.clone()),
        (
            Kind::Nobody,
            "st_0000000000000000000000000000000000000000".into(),
        ),
    ];
    for (kind, body) in [
        (Kind::Read, json!({"scope": "read"})),
        (Kind::Attach, json!({"scope": "attach"})),
        (Kind::Relay, json!({"scope": "relay"})),
        (Kind::Stream, json!({"scope": "relay:s1"})),
        (Kind::Expired, json!({"ttl_seconds": 1})),
        (Kind::Revoked, json!({})),
    ] {
        let (s, v) = w.alpha.post("/v1/tokens", body).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        if kind == Kind::Revoked {
            let (s, r) = w
                .alpha
                .delete(&format!("/v1/tokens/{}", v["id"].as_str().unwrap()))
                .await;
            assert_eq!(s, StatusCode::OK, "{r}");
        }
        tokens.push((kind, v["token"].as_str().unwrap().to_string()));
    }
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;

    let (_, doc) = w.alpha.get("/v1/openapi.json").await;
    let mut ops: Vec<(String, String)> = vec![];
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            ops.push((method.clone(), path.clone()));
        }
    }
    assert!(ops.len() >= 42, "{} operations documented", ops.len());
    let http = reqwest::Client::new();
    let (mut refused, mut allowed_reads, mut successes_where_none_allowed) = (0, 0, vec![]);
    for (kind, token) in &tokens {
        for (method, path) in &ops {
            let may = allowed(*kind, method, path);
            // Allowed calls that change something would wreck the fixture: only reads run.
            if may && method != "get" {
                continue;
            }
            let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let mut r = http
                .request(m, format!("{url}{}", fill(path, &w.names)))
                .bearer_auth(token);
            // A well-formed body, so what answers is the check of who may, not of the body.
            if method == "post" {
                r = r.json(&match path.rsplit('/').next().unwrap() {
                    "fork" => json!({"name": "stolen"}),
                    "rollback" => json!({"version": 1}),
                    "resize" => json!({"size": 2u64 << 30}),
                    _ => json!({}),
                });
            }
            let r = r.send().await.unwrap();
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            if may {
                assert!(
                    status.is_success(),
                    "{kind:?} {method} {path}: {status} {body}"
                );
                if *kind == Kind::OtherTenant {
                    for name in ["w1", "base", "s1", "f1"] {
                        assert!(
                            !body.contains(&format!("\"{name}\"")),
                            "{method} {path} shows beta alpha's {name}: {body}"
                        );
                    }
                }
                allowed_reads += 1;
                continue;
            }
            if status.is_success() {
                successes_where_none_allowed.push(format!("{kind:?} {method} {path}: {status}"));
                continue;
            }
            let want: &[StatusCode] = match kind {
                Kind::Expired | Kind::Revoked | Kind::Nobody => &[StatusCode::UNAUTHORIZED],
                Kind::OtherTenant => &[StatusCode::NOT_FOUND, StatusCode::FORBIDDEN],
                _ => &[StatusCode::FORBIDDEN],
            };
            assert!(
                want.contains(&status),
                "{kind:?} {method} {path}: {status} {body}"
            );
            let v: Value = serde_json::from_str(&body).unwrap_or_default();
            assert!(
                v["error"]["message"].is_string(),
                "{kind:?} {method} {path}: {body}"
            );
            refused += 1;
        }
    }
    println!(
        "isolation matrix: {} token kinds x {} operations: {refused} refused as they must be, \
         {allowed_reads} allowed reads answered, {} successes where none is allowed",
        tokens.len(),
        ops.len(),
        successes_where_none_allowed.len()
    );
    assert!(
        successes_where_none_allowed.is_empty(),
        "{successes_where_none_allowed:#?}"
    );
    assert!(refused > 300, "{refused}");

    // Nothing of alpha's changed.
    let a = &w.alpha;
    assert_eq!(a.get("/v1/workspaces/w1").await.0, StatusCode::OK);
    assert_eq!(a.get("/v1/templates/base").await.0, StatusCode::OK);
    let (_, files) = a.get("/v1/relay/s1").await;
    assert!(files.to_string().contains("f1"), "{files}");
    let (_, log) = a.get("/v1/workspaces/w1/log").await;
    assert_eq!(log.as_array().map(Vec::len), Some(2), "{log}");
    let (_, toks) = a.get("/v1/tokens").await;
    let spare = toks
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == w.names["id"].as_str())
        .unwrap();
    assert!(spare["revoked_ms"].is_null(), "{spare}");
    let (_, tenants) = Api::new(&url, ADMIN).get("/v1/tenants").await;
    assert_eq!(tenants.as_array().map(Vec::len), Some(2), "{tenants}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_listed_scoped_revoked_expired_and_admin_tokens_rotate() {
    let d = tempfile::tempdir().unwrap();
    let admin_file = d.path().join("admin-tokens");
    std::fs::write(&admin_file, "").unwrap();
    let daemon = serve(
        &d.path().join("data"),
        &["--admin-token-file", admin_file.to_str().unwrap()],
    );
    let url = daemon.url.clone();
    let a = tenant(&url, "alpha").await;

    // Issued once, listed by id and metadata only.
    let (s, t) = a
        .post(
            "/v1/tokens",
            json!({"scope": "read", "ttl_seconds": 3600, "label": "dashboard"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{t}");
    let read_token = t["token"].as_str().unwrap().to_string();
    let (s, list) = a.get("/v1/tokens").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let text = list.to_string();
    assert!(
        !text.contains(&read_token) && !text.contains(&a.token),
        "{text}"
    );
    let listed = list
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == t["id"])
        .unwrap();
    assert_eq!(listed["scope"], "read");
    assert_eq!(listed["label"], "dashboard");
    assert!(listed["expires_ms"].as_u64() > Some(strata_format::now_ms()));

    // A scoped token cannot mint itself more rights, or list or revoke tokens.
    let r = Api::new(&url, &read_token);
    assert_eq!(r.get("/v1/workspaces").await.0, StatusCode::OK);
    for (s, v) in [
        r.post("/v1/tokens", json!({})).await,
        r.get("/v1/tokens").await,
        r.delete(&format!("/v1/tokens/{}", t["id"].as_str().unwrap()))
            .await,
        r.post("/v1/workspaces", json!({"name": "x", "size": 1048576}))
            .await,
    ] {
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("read"),
            "{v}"
        );
    }

    // Bad requests are refused by name.
    for body in [
        json!({"scope": "admin"}),
        json!({"scope": "relay:../x"}),
        json!({"scope": "relay:nostream"}),
        json!({"ttl_seconds": 0}),
        json!({"ttl_seconds": 1u64 << 40}),
        json!({"label": "bell\u{7}"}),
        json!({"label": "x".repeat(101)}),
        json!({"scopes": "read"}),
    ] {
        let (s, v) = a.post("/v1/tokens", body.clone()).await;
        assert!(s.is_client_error(), "{body}: {s} {v}");
    }
    assert_eq!(
        a.delete("/v1/tokens/not-hex").await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        a.delete("/v1/tokens/0000000000000000").await.0,
        StatusCode::NOT_FOUND
    );

    // Revocation takes effect on the next request, and says why.
    let (s, v) = a
        .delete(&format!("/v1/tokens/{}", t["id"].as_str().unwrap()))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["revoked_ms"].is_u64());
    let (s, v) = r.get("/v1/workspaces").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("revoked"),
        "{v}"
    );

    // Expiry; a token minted by an expiring one (a tenant token or a stream token) expires
    // no later.
    let (_, e) = a.post("/v1/tokens", json!({"ttl_seconds": 1})).await;
    let e = Api::new(&url, e["token"].as_str().unwrap());
    let (s, child) = e.post("/v1/tokens", json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{child}");
    let child = Api::new(&url, child["token"].as_str().unwrap());
    let (s, st) = e.post("/v1/relay", json!({"name": "short"})).await;
    assert_eq!(s, StatusCode::CREATED, "{st}");
    let stream_tok = st["token"].as_str().unwrap().to_string();
    assert_eq!(e.get("/v1/workspaces").await.0, StatusCode::OK);
    assert_eq!(child.get("/v1/workspaces").await.0, StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    for (who, api) in [("token", &e), ("its child", &child)] {
        let (s, v) = api.get("/v1/workspaces").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{who}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("expired"),
            "{who}: {v}"
        );
    }
    let r = reqwest::Client::new()
        .put(format!("{url}/v1/relay/short/f"))
        .bearer_auth(&stream_tok)
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        StatusCode::UNAUTHORIZED,
        "the stream token expired too"
    );

    // The admin's view of alpha's tokens, and its revocation.
    let admin = Api::new(&url, ADMIN);
    let (s, list) = admin.get("/v1/tenants/alpha/tokens").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list.as_array().unwrap().len(), 5, "{list}");
    let (s, issued) = admin
        .post("/v1/tenants/alpha/tokens", json!({"scope": "attach"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{issued}");
    let (s, _) = admin
        .delete(&format!(
            "/v1/tenants/alpha/tokens/{}",
            issued["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        Api::new(&url, issued["token"].as_str().unwrap())
            .get("/v1/workspaces")
            .await
            .0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin.get("/v1/tenants/nope/tokens").await.0,
        StatusCode::NOT_FOUND
    );

    // Admin rotation without a restart: add the next token, move over, drop the old one (here
    // by its hash, so the file need not hold the token itself).
    let next = Api::new(&url, "admin-two");
    assert_eq!(next.get("/v1/tenants").await.0, StatusCode::UNAUTHORIZED);
    std::fs::write(&admin_file, "admin-two\n").unwrap();
    assert_eq!(next.get("/v1/tenants").await.0, StatusCode::OK);
    let three = "admin-three";
    let tmp = d.path().join("admin-tokens.tmp");
    std::fs::write(
        &tmp,
        format!(
            "# rotated\nblake3:{}\n",
            blake3::hash(three.as_bytes()).to_hex()
        ),
    )
    .unwrap();
    std::fs::rename(&tmp, &admin_file).unwrap();
    assert_eq!(next.get("/v1/tenants").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        Api::new(&url, three).get("/v1/tenants").await.0,
        StatusCode::OK
    );
    // A malformed file keeps the tokens read before (a typo does not lock the admin out);
    // removing the file revokes its tokens.
    std::fs::write(&tmp, "blake3:nothex\n").unwrap();
    std::fs::rename(&tmp, &admin_file).unwrap();
    assert_eq!(
        Api::new(&url, three).get("/v1/tenants").await.0,
        StatusCode::OK
    );
    std::fs::remove_file(&admin_file).unwrap();
    assert_eq!(
        Api::new(&url, three).get("/v1/tenants").await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(admin.get("/v1/tenants").await.0, StatusCode::OK);

    // The CLI through the daemon.
    let cli = |args: &[&str], token: &str| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .env("STRATA_URL", &url)
            .env("STRATA_TOKEN", token)
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}: {o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    let out = cli(&["tenant", "list"], ADMIN);
    assert!(out.starts_with("alpha\t"), "{out}");
    let out = cli(
        &[
            "--json", "token", "create", "--scope", "relay", "--ttl", "1h",
        ],
        &a.token,
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["scope"], "relay");
    let out = cli(&["token", "list"], &a.token);
    assert!(
        out.contains(&format!("{}\trelay\texpires in", v["id"].as_str().unwrap())),
        "{out}"
    );
    let out = cli(&["token", "revoke", v["id"].as_str().unwrap()], &a.token);
    assert!(out.starts_with("revoked "), "{out}");
}

/// Every file under `dir` whose path names `tenant` as a component (what the tenant left on
/// this node), except the per-workspace lock files (empty; no data).
fn leftovers(dir: &Path, tenant: &str) -> Vec<String> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
            let path = e.path();
            let rel = path
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel.starts_with("locks/") || rel == "locks" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                stack.push(path);
            } else if rel.split('/').any(|c| c == tenant) {
                out.push(rel);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_removes_everything_it_owns_and_no_one_elses() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    let daemon = serve(&data, &[]);
    let url = daemon.url.clone();
    let admin = Api::new(&url, ADMIN);
    let g = tenant(&url, "gamma").await;
    let b = tenant(&url, "beta").await;
    for t in [&g, &b] {
        let (s, v) = t
            .put_bytes("/v1/templates/base?format=raw", vec![7u8; 1 << 20])
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, v) = t
            .post("/v1/workspaces", json!({"name": "w", "template": "base"}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (s, att) = g.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{att}");
    let mut c = Client::connect_unix(Path::new(att["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    c.write(0, &[0x5a; 65536], false).await.unwrap();
    c.flush().await.unwrap();
    let (s, v) = g
        .post("/v1/workspaces/w/checkpoint", json!({"wait": true}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = g.post("/v1/relay", json!({"name": "logs"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = g
        .put_bytes("/v1/relay/logs/a.txt", b"gamma's log".to_vec())
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, battach) = b.post("/v1/workspaces/w/attach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{battach}");

    // Attached: refused, and nothing changed (its token still works).
    let (s, v) = admin.delete("/v1/tenants/gamma").await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("attached"),
        "{v}"
    );
    assert_eq!(g.get("/v1/workspaces/w").await.0, StatusCode::OK);
    c.write(65536, &[0x5b; 4096], false).await.unwrap();
    c.flush().await.unwrap();
    drop(c);
    let (s, v) = g.post("/v1/workspaces/w/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        !leftovers(&data, "gamma").is_empty(),
        "the check sees gamma's files"
    );

    let (s, v) = admin.delete("/v1/tenants/gamma").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["workspaces"], 1, "{v}");
    assert_eq!(v["templates"], 1, "{v}");
    assert_eq!(v["streams"], 1, "{v}");
    assert!(v["store_keys"].as_u64() > Some(2), "{v}");
    // Its token speaks for nobody; its names are gone everywhere on this node and in the
    // store.
    assert_eq!(g.get("/v1/workspaces").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(leftovers(&data, "gamma"), Vec::<String>::new());
    let (_, tenants) = admin.get("/v1/tenants").await;
    assert_eq!(tenants.as_array().unwrap().len(), 1, "{tenants}");
    assert_eq!(
        admin.delete("/v1/tenants/gamma").await.0,
        StatusCode::NOT_FOUND
    );

    // Beta carried on: attached throughout, still serving, its data intact.
    let mut bc = Client::connect_unix(Path::new(battach["socket"].as_str().unwrap()), "w")
        .await
        .unwrap();
    let got = bc.read(0, 4096).await.unwrap();
    assert_eq!(got, vec![7u8; 4096]);
    bc.write(0, &[1; 4096], false).await.unwrap();
    bc.flush().await.unwrap();
    drop(bc);
    assert_eq!(b.get("/v1/templates/base").await.0, StatusCode::OK);

    // The name is free again, and the new gamma starts with nothing.
    let g2 = tenant(&url, "gamma").await;
    assert_eq!(g2.get("/v1/workspaces").await.1, json!([]));
    assert_eq!(g2.get("/v1/relay").await.1, json!([]));
    assert_eq!(
        g2.get("/v1/relay/logs/a.txt").await.0,
        StatusCode::NOT_FOUND
    );

    // A deletion waits for the tenant's requests already running: a template upload whose
    // body trickles in for over a second either lands before the deletion takes anything,
    // or is refused; either way nothing of it outlives the tenant.
    let slow = tenant(&url, "slow").await;
    let body = futures::stream::unfold(0u32, |i| async move {
        if i == 8 {
            return None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        Some((Ok::<_, std::io::Error>(vec![0x33u8; 128 << 10]), i + 1))
    });
    let up_url = format!("{url}/v1/templates/late?format=raw");
    let up_token = slow.token.clone();
    let upload = tokio::spawn(async move {
        reqwest::Client::new()
            .put(up_url)
            .bearer_auth(up_token)
            .body(reqwest::Body::wrap_stream(body))
            .send()
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    let (s, v) = admin.delete("/v1/tenants/slow").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let up = upload.await.unwrap();
    println!(
        "tenant deletion waited {:?} for an upload in flight ({up:?}); deleted {} templates",
        started.elapsed(),
        v["templates"]
    );
    assert!(started.elapsed() > std::time::Duration::from_millis(900));
    assert_eq!(leftovers(&data, "slow"), Vec::<String>::new());
    let again = tenant(&url, "slow").await;
    assert_eq!(again.get("/v1/templates").await.1, json!([]));

    // A delete racing an attach: never both.
    for round in 0..4 {
        let name = format!("racer{round}");
        let t = tenant(&url, &name).await;
        let (s, v) = t
            .post("/v1/workspaces", json!({"name": "w", "size": 1048576}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let path = format!("/v1/tenants/{name}");
        let (att, del) = tokio::join!(
            t.post("/v1/workspaces/w/attach", json!({})),
            admin.delete(&path)
        );
        assert!(
            !(att.0.is_success() && del.0.is_success()),
            "round {round}: attach {att:?} and delete {del:?} both succeeded"
        );
        if att.0.is_success() {
            assert_eq!(del.0, StatusCode::CONFLICT, "{del:?}");
            let (s, v) = t.post("/v1/workspaces/w/detach", json!({})).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let (s, v) = admin.delete(&path).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
        assert_eq!(leftovers(&data, &name), Vec::<String>::new());
    }
}
