//! The SQLite catalog passes the conformance suite every backend passes.

mod conformance;

use std::sync::Arc;

use strata_catalog::{ManualClock, SqliteCatalog};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_passes_the_conformance_suite() {
    let d = tempfile::tempdir().unwrap();
    // Time moves when the suite says (lease expiry, grace periods), not after sleeps.
    let clock = Arc::new(ManualClock::new());
    let cat = SqliteCatalog::open_with_clock(&d.path().join("catalog.db"), clock.clone()).unwrap();
    conformance::run_all(Arc::new(cat), &conformance::Time::Manual(clock)).await;
    // Two handles on one file stand in for two processes sharing it.
    let a = SqliteCatalog::open(&d.path().join("catalog.db")).unwrap();
    let b = SqliteCatalog::open(&d.path().join("catalog.db")).unwrap();
    conformance::run_shared(Arc::new(a), Arc::new(b)).await;
}

#[tokio::test]
async fn reopen_keeps_state_and_schema_version() {
    use strata_catalog::Catalog;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("catalog.db");
    SqliteCatalog::open(&p)
        .unwrap()
        .create_tenant("a")
        .await
        .unwrap();
    let c = SqliteCatalog::open(&p).unwrap();
    assert!(c.tenant_exists("a").await.unwrap());
}
