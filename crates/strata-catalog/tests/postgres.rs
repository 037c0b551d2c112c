//! The PostgreSQL catalog against a real server: the same conformance suite as SQLite, plus
//! two pools (two nodes) racing on one database, and migrations that run once when several
//! nodes start together.
//!
//! Needs `STRATA_TEST_PG` (an admin URL such as `postgres://postgres@127.0.0.1:5432/postgres`);
//! `.ci/run` starts a throwaway server. With `STRATA_REQUIRE_PG=1` a missing server fails.

mod conformance;

use std::sync::Arc;

use strata_catalog::{create_database, Catalog, PostgresCatalog};

fn admin_url() -> Option<String> {
    match std::env::var("STRATA_TEST_PG") {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            assert!(
                std::env::var("STRATA_REQUIRE_PG").as_deref() != Ok("1"),
                "STRATA_REQUIRE_PG=1 but STRATA_TEST_PG is not set"
            );
            eprintln!("skipping: set STRATA_TEST_PG to a PostgreSQL admin URL");
            None
        }
    }
}

async fn fresh_db(tag: &str) -> Option<String> {
    let admin = admin_url()?;
    let name = format!(
        "strata_{tag}_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000
    );
    Some(create_database(&admin, &name).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passes_the_conformance_suite() {
    let Some(url) = fresh_db("conf").await else {
        return;
    };
    let cat = PostgresCatalog::connect(&url, 8).await.unwrap();
    // The server's clock: the suite waits for it.
    conformance::run_all(Arc::new(cat), &conformance::Time::Real).await;
    let a = PostgresCatalog::connect(&url, 4).await.unwrap();
    let b = PostgresCatalog::connect(&url, 4).await.unwrap();
    conformance::run_shared(Arc::new(a), Arc::new(b)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_starting_together_migrate_once_and_keep_state() {
    let Some(url) = fresh_db("mig").await else {
        return;
    };
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PostgresCatalog::connect(&url, 2).await })
        })
        .collect();
    let cats: Vec<_> = futures_join(tasks).await;
    cats[0].create_tenant("a").await.unwrap();
    assert!(cats[5].tenant_exists("a").await.unwrap());
    drop(cats);
    let again = PostgresCatalog::connect(&url, 2).await.unwrap();
    assert!(again.tenant_exists("a").await.unwrap());
    // A bad URL or an unreachable server is a clear error, not a hang.
    let e = PostgresCatalog::connect("postgres://nobody@127.0.0.1:1/x", 1)
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("postgres"), "{e}");
}

async fn futures_join(
    tasks: Vec<tokio::task::JoinHandle<strata_catalog::Result<PostgresCatalog>>>,
) -> Vec<PostgresCatalog> {
    let mut out = vec![];
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    out
}

/// A syntax error recurs; a server that cannot be reached may come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_errors_say_whether_a_retry_can_help() {
    let Some(url) = fresh_db("err").await else {
        return;
    };
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let e = client.execute("SELEC 1", &[]).await.unwrap_err();
    assert!(!strata_catalog::pg_retryable(&e), "{e}");
    // Nobody listens on this loopback port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = PostgresCatalog::connect(&format!("postgres://x@127.0.0.1:{port}/x"), 1)
        .await
        .err()
        .expect("nothing listens there");
    assert!(e.is_retryable(), "{e}");
}

/// `sslmode` as libpq means it, against a server that offers TLS with a certificate from a
/// throwaway CA naming `localhost` only (`.ci/postgres.sh`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_checks_the_server_as_sslmode_says() {
    let Some(url) = fresh_db("tls").await else {
        return;
    };
    let ca = match std::env::var("STRATA_TEST_PG_CA") {
        Ok(c) if !c.is_empty() => c,
        _ => {
            assert!(
                std::env::var("STRATA_REQUIRE_PG").as_deref() != Ok("1"),
                "STRATA_REQUIRE_PG=1 but STRATA_TEST_PG_CA is not set (.ci/postgres.sh sets both)"
            );
            eprintln!("SKIPPED: catalog TLS (set STRATA_TEST_PG_CA, as .ci/postgres.sh does)");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other-ca.pem");
    let ok = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=someone-else"])
        .arg("-keyout")
        .arg(dir.path().join("other.key"))
        .arg("-out")
        .arg(&other)
        .output()
        .expect("openssl (apt-get install openssl)")
        .status
        .success();
    assert!(ok, "openssl made no CA");
    let local = url.replacen("127.0.0.1", "localhost", 1);
    let other = other.display();
    let with = |u: &str, q: &str| format!("{u}?{q}");
    let encrypted = |u: String| async move {
        let c = PostgresCatalog::connect(&u, 1)
            .await
            .unwrap_or_else(|e| panic!("{u}: {e}"));
        c.encrypted().await.unwrap()
    };
    let refused = |u: String| async move {
        match PostgresCatalog::connect(&u, 1).await {
            Ok(_) => panic!("{u} connected"),
            Err(e) => {
                let msg = e.to_string();
                eprintln!("refused as it must be: {u}: {msg}");
                msg
            }
        }
    };
    assert!(!encrypted(with(&url, "sslmode=disable")).await);
    // libpq's default, prefer: TLS when offered, the certificate not checked.
    assert!(encrypted(url.clone()).await);
    assert!(encrypted(with(&url, "sslmode=require")).await);
    assert!(encrypted(with(&url, &format!("sslmode=verify-ca&sslrootcert={ca}"))).await);
    assert!(
        encrypted(with(
            &local,
            &format!("sslmode=verify-full&sslrootcert={ca}")
        ))
        .await
    );
    // The certificate names localhost, not 127.0.0.1.
    let m = refused(with(&url, &format!("sslmode=verify-full&sslrootcert={ca}"))).await;
    assert!(m.to_lowercase().contains("certificate"), "{m}");
    // Another CA's roots: neither verify-ca nor require-with-a-root accepts the server.
    for q in [
        format!("sslmode=verify-ca&sslrootcert={other}"),
        format!("sslmode=require&sslrootcert={other}"),
        format!("sslmode=verify-full&sslrootcert={other}"),
    ] {
        let m = refused(with(&local, &q)).await;
        assert!(m.to_lowercase().contains("certificate"), "{m}");
    }
    // A unix socket (the server's directory is the CA's grandparent, see .ci/postgres.sh):
    // no TLS there, and no host name for it, whatever the mode.
    let sock_dir = std::path::Path::new(&ca)
        .parent()
        .unwrap()
        .parent()
        .unwrap();
    let port = url.rsplit_once(':').unwrap().1.split('/').next().unwrap();
    let db = url.rsplit('/').next().unwrap();
    for mode in ["prefer", "disable"] {
        let kv = format!(
            "host={} port={port} user=postgres dbname={db} sslmode={mode}",
            sock_dir.display()
        );
        assert!(!encrypted(kv).await);
    }
    let m = refused(with(&url, "sslmode=verify-full")).await;
    assert!(m.contains("sslrootcert"), "{m}");
    let m = refused(with(
        &url,
        "sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
    ))
    .await;
    assert!(m.contains("/nonexistent/ca.pem"), "{m}");
}
