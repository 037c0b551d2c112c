//! The conformance suite every catalog backend must pass. Each backend's test file
//! (`tests/sqlite.rs`, `tests/postgres.rs`) includes it as a module and calls [`run_all`] with a
//! fresh, empty catalog.

// Each backend's test file uses what its backend needs (a manual clock, real time).
#![allow(dead_code)]

use std::sync::Arc;

use strata_format::manifest::ObjectRef;
use strata_format::Hash;

use strata_catalog::*;
use strata_format::now_ms;

mod gc;
mod tenancy;
mod workspaces;
use gc::*;
use tenancy::*;
use workspaces::*;

fn h(n: u8) -> Hash {
    Hash::of(&[n])
}

fn new_ws(tenant: &str, name: &str, m: Hash) -> NewWorkspace {
    NewWorkspace {
        tenant: tenant.into(),
        name: name.into(),
        mode: Mode::Durable,
        disk_size: 1 << 30,
        manifest: m,
        source: "template:base".into(),
        kind: CheckpointKind::Create,
        ttl_ms: None,
    }
}

fn cp(m: Hash, label: Option<&str>) -> NewCheckpoint {
    NewCheckpoint {
        manifest: m,
        disk_size: 1 << 30,
        label: label.map(Into::into),
        kind: CheckpointKind::Checkpoint,
        bytes: 10,
        cut_seq: 5,
        journal_id: Some("j1".into()),
        keep_until_ms: None,
    }
}

/// How the suite lets time pass for lease expiry and GC grace: a catalog on its own
/// [`ManualClock`] is moved forward; one that reads a server's clock (PostgreSQL: the point of
/// its design) is waited for.
pub enum Time {
    Real,
    Manual(Arc<ManualClock>),
}

impl Time {
    pub async fn pass(&self, d: std::time::Duration) {
        match self {
            Time::Real => tokio::time::sleep(d).await,
            Time::Manual(c) => c.advance(d),
        }
    }
}

/// Runs every check; panics with a message naming the failed property.
pub async fn run_all(cat: Arc<dyn Catalog>, time: &Time) {
    tenants_and_templates(&*cat).await;
    heads_move_only_by_cas_with_the_current_lease(&*cat).await;
    leases_expire_and_fence(&*cat, time).await;
    a_node_renews_its_leases_in_one_call(&*cat, time).await;
    concurrent_checkpoints_one_winner_per_version(cat.clone()).await;
    ttls_expire(&*cat).await;
    tenants_do_not_see_each_other(&*cat).await;
    nodes_report_and_list(&*cat).await;
    scoped_tokens_and_streams(&*cat).await;
    retention_and_gc_state(&*cat, time).await;
    token_lifecycle(&*cat).await;
    quotas_limit_creates(&*cat).await;
    store_usage_follows_references(&*cat, time).await;
    tenant_deletion(&*cat, time).await;
    tenant_placement(&*cat).await;
    the_change_log_finds_what_the_full_mark_finds(&*cat, time).await;
    retention_is_due_on_change_or_time(&*cat).await;
    the_change_log_keeps_what_it_cannot_judge_yet(&*cat, time).await;
}

/// Checks for two handles on the same catalog (two nodes): `a` and `b` must be separate
/// connections/pools to one database. Run after [`run_all`] or on a fresh catalog.
pub async fn run_shared(a: Arc<dyn Catalog>, b: Arc<dyn Catalog>) {
    match a.create_tenant("shared").await {
        Ok(()) | Err(CatalogError::AlreadyExists { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    assert!(
        b.tenant_exists("shared").await.unwrap(),
        "b sees a's writes"
    );
    for round in 0..5u8 {
        let name = format!("contended{round}");
        a.create_workspace(&new_ws("shared", &name, h(1)))
            .await
            .unwrap();
        // Both nodes race for the lease: exactly one wins, the loser is told who holds it.
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let (cat, name) = (if i % 2 == 0 { a.clone() } else { b.clone() }, name.clone());
                tokio::spawn(async move {
                    let node = format!("node-{i}");
                    (
                        node.clone(),
                        cat.acquire_lease("shared", &name, &node, 60_000).await,
                    )
                })
            })
            .collect();
        let mut winner = None;
        for t in tasks {
            match t.await.unwrap() {
                (node, Ok(g)) => {
                    assert!(winner.is_none(), "two nodes acquired {name}");
                    assert_eq!(g.epoch, 1);
                    winner = Some((node, g));
                }
                (_, Err(CatalogError::LeaseHeld { .. })) => {}
                (_, Err(e)) => panic!("unexpected {e}"),
            }
        }
        let (node, g) = winner.expect("one node acquires");
        let l = b.get_lease("shared", &name).await.unwrap();
        assert_eq!((l.holder.as_deref(), l.epoch), (Some(node.as_str()), 1));
        // Checkpoints through both handles with the one valid grant: one winner per version.
        let mut versions = vec![];
        for step in 0..4u64 {
            let tasks: Vec<_> = [a.clone(), b.clone()]
                .into_iter()
                .enumerate()
                .map(|(i, cat)| {
                    let (g, name) = (g.clone(), name.clone());
                    tokio::spawn(async move {
                        cat.advance_head("shared", &name, step + 1, &g, &cp(h(50 + i as u8), None))
                            .await
                    })
                })
                .collect();
            let mut wins = 0;
            for t in tasks {
                match t.await.unwrap() {
                    Ok(v) => {
                        wins += 1;
                        versions.push(v);
                    }
                    Err(CatalogError::Conflict { .. }) => {}
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            assert_eq!(wins, 1);
        }
        assert_eq!(versions, vec![2, 3, 4, 5]);
        a.release_lease("shared", &name, &g).await.unwrap();
    }
}
