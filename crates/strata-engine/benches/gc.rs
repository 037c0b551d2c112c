//! Space reclamation under a steady random-overwrite load: bytes written to the object store per
//! byte written by the guest (write amplification of publishing + compaction), and stored bytes
//! per live byte after compaction, for several compaction thresholds.
//!
//! `cargo bench -p strata-engine --bench gc` (256 MiB disk, 3x its size in random 4 KiB
//! overwrites, a publish + GC pass every 1/8 of the disk); under `cargo test` a smoke version.

use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, GcOptions, Mode, Source};
use strata_store::Store;

const T: &str = "bench";

async fn manifest_bytes(store: &Store, id: &strata_format::Hash) -> u64 {
    store
        .default_inner()
        .head(&Store::manifest_key(T, id))
        .await
        .map(|m| m.size)
        .unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (disk, rounds): (u64, u64) = if full { (256 << 20, 24) } else { (8 << 20, 4) };
    let per_round = disk / 8;
    println!("| compact below | guest writes | store writes | write amplification | stored / live, steady | then one full compaction (0.9): rewritten, stored / live | head extents | head manifest | time |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for threshold in [0.3, 0.5, 0.7, 0.9] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let catalog: Arc<dyn Catalog> =
            Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
        catalog.create_tenant(T).await.unwrap();
        let store = Store::open(&format!("file:{}", dir.path().join("objects").display())).unwrap();
        let mut cfg = EngineConfig::new(dir.path().join("node"));
        cfg.node_id = Some("bench".into());
        cfg.upload_interval = Duration::from_secs(3600);
        cfg.upload_max_bytes = u64::MAX;
        cfg.cache_unsafe = false;
        let e = Engine::open_with(cfg, catalog, store.clone(), Arc::new(RealFs)).unwrap();
        e.create_workspace(T, "w", Source::Empty { size: disk }, Mode::Durable, None)
            .await
            .unwrap();
        let v = e.attach(T, "w").await.unwrap();
        let gc = |keep: usize| GcOptions {
            grace: Duration::ZERO,
            keep_last: keep,
            keep_auto: keep,
            max_age: Duration::from_secs(3600),
            dry_run: false,
            reconcile: true,
            stop_after: None,
            compact_below: Some(threshold),
            compact_detached_after: None,
        };
        // Fill the disk once with distinct data: every block live, nothing dedups.
        let mut rng = SmallRng::seed_from_u64(42);
        let mut chunk = vec![0u8; 1 << 20];
        for off in (0..disk).step_by(1 << 20) {
            rng.fill(&mut chunk[..]);
            v.write(off, &chunk, false).await.unwrap();
        }
        v.checkpoint(None).await.unwrap();
        e.gc(&gc(1)).await.unwrap();
        let base_put = e.reader().stats().bytes_put;
        let mut man_bytes = 0u64;
        let mut seen_versions = v.head_version();
        let mut block = vec![0u8; 4096];
        let t0 = Instant::now();
        let mut guest = 0u64;
        for _ in 0..rounds {
            for _ in 0..per_round / 4096 {
                let lba = rng.random_range(0..disk / 4096);
                rng.fill(&mut block[..]);
                v.write(lba * 4096, &block, false).await.unwrap();
                guest += 4096;
            }
            v.checkpoint(None).await.unwrap();
            e.gc(&gc(1)).await.unwrap();
            // Count every manifest this round wrote (the publish and any compaction).
            for c in e.log(T, "w").await.unwrap() {
                if c.version > seen_versions {
                    man_bytes += manifest_bytes(&store, &c.manifest).await;
                }
            }
            seen_versions = v.head_version();
        }
        let obj_bytes = e.reader().stats().bytes_put - base_put;
        let elapsed = t0.elapsed();
        // Quiesce: only the head retained, then two more passes delete what was released.
        for _ in 0..3 {
            e.gc(&gc(0)).await.unwrap();
        }
        let dry = |e: Arc<Engine>| async move {
            e.gc(&GcOptions {
                dry_run: true,
                reconcile: true,
                ..gc(0)
            })
            .await
            .unwrap()
        };
        let steady = dry(e.clone()).await;
        let head = store
            .get_manifest(T, &e.workspace(T, "w").await.unwrap().head_manifest)
            .await
            .unwrap();
        let live: u64 = head.extents.iter().map(|x| x.len as u64 * 4096).sum();
        // A periodic full compaction, then quiesce again.
        let full = v
            .compact(0.9)
            .await
            .unwrap()
            .map_or(0, |p| p.bytes_uploaded);
        for _ in 0..3 {
            e.gc(&gc(0)).await.unwrap();
        }
        let r = dry(e.clone()).await;
        let mib = |b: u64| format!("{:.0} MiB", b as f64 / (1 << 20) as f64);
        println!(
            "| {threshold} | {} | {} | {:.2} | {:.2} | {}, {:.2} | {} | {} KiB | {:.1} s |",
            mib(guest),
            mib(obj_bytes + man_bytes),
            (obj_bytes + man_bytes) as f64 / guest as f64,
            steady.stored_bytes as f64 / live as f64,
            mib(full),
            r.stored_bytes as f64 / live as f64,
            head.extents.len(),
            manifest_bytes(&store, &e.workspace(T, "w").await.unwrap().head_manifest).await >> 10,
            elapsed.as_secs_f64()
        );
        drop(v);
        e.abandon().await;
    }
}
