//! Engine benchmarks: volume data path against a raw file with the same I/O pattern, fork time
//! against disk size, checkpoint stall against dirty size.
//!
//! `cargo bench -p strata-engine --bench engine` runs the full sizes and prints a Markdown table
//! for docs/BENCHMARKS.md; under `cargo test` (no `--bench` argument) it runs a seconds-long
//! smoke version that only checks the code paths work. No timing is asserted anywhere.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, Mode, Source};
use strata_store::Store;

const T: &str = "bench";

fn pct(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p) as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

struct Row(String, String, String, String);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (n_io, disk, dirty_sizes): (usize, u64, Vec<u64>) = if full {
        (
            20_000,
            1 << 30,
            vec![1 << 20, 16 << 20, 64 << 20, 256 << 20],
        )
    } else {
        (200, 16 << 20, vec![256 << 10, 1 << 20])
    };
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
    let e = Engine::open_with(cfg, catalog, store, Arc::new(RealFs)).unwrap();
    let mut rows: Vec<Row> = vec![];

    // Data path: volume vs raw file, same offsets.
    e.create_workspace(T, "io", Source::Empty { size: disk }, Mode::Durable, None)
        .await
        .unwrap();
    let v = e.attach(T, "io").await.unwrap();
    let raw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("raw"))
        .unwrap();
    raw.set_len(disk).unwrap();
    let mut rng = SmallRng::seed_from_u64(1);
    let offs: Vec<u64> = (0..n_io)
        .map(|_| rng.random_range(0..disk / 4096) * 4096)
        .collect();
    let block = vec![0x5au8; 4096];

    let t = Instant::now();
    for &o in &offs {
        v.write(o, &block, false).await.unwrap();
    }
    let vol_w = t.elapsed();
    let t = Instant::now();
    for &o in &offs {
        raw.write_all_at(&block, o).unwrap();
    }
    let raw_w = t.elapsed();
    rows.push(Row(
        "4 KiB random write (no flush)".into(),
        format!("{:.0} IOPS", n_io as f64 / vol_w.as_secs_f64()),
        format!("{:.0} IOPS", n_io as f64 / raw_w.as_secs_f64()),
        format!("{:.2}x", raw_w.as_secs_f64() / vol_w.as_secs_f64()),
    ));

    let t = Instant::now();
    for &o in &offs {
        std::hint::black_box(v.read(o, 4096).await.unwrap());
    }
    let vol_r = t.elapsed();
    let mut b = vec![0u8; 4096];
    let t = Instant::now();
    for &o in &offs {
        raw.read_exact_at(&mut b, o).unwrap();
    }
    let raw_r = t.elapsed();
    rows.push(Row(
        "4 KiB random read (journal, page cache)".into(),
        format!("{:.0} IOPS", n_io as f64 / vol_r.as_secs_f64()),
        format!("{:.0} IOPS", n_io as f64 / raw_r.as_secs_f64()),
        format!("{:.2}x", raw_r.as_secs_f64() / vol_r.as_secs_f64()),
    ));

    let n_flush = (n_io / 20).max(20);
    let (mut lv, mut lr) = (vec![], vec![]);
    for &o in offs.iter().take(n_flush) {
        let t = Instant::now();
        v.write(o, &block, false).await.unwrap();
        v.flush().await.unwrap();
        lv.push(t.elapsed());
        let t = Instant::now();
        raw.write_all_at(&block, o).unwrap();
        raw.sync_data().unwrap();
        lr.push(t.elapsed());
    }
    rows.push(Row(
        "4 KiB write+flush p50 / p99".into(),
        format!(
            "{:.0} / {:.0} µs",
            us(pct(lv.clone(), 0.5)),
            us(pct(lv.clone(), 0.99))
        ),
        format!(
            "{:.0} / {:.0} µs",
            us(pct(lr.clone(), 0.5)),
            us(pct(lr.clone(), 0.99))
        ),
        format!("{:.2}x", us(pct(lr, 0.5)) / us(pct(lv, 0.5))),
    ));

    let mb = vec![0xa5u8; 1 << 20];
    let n_seq = (disk >> 20).min(256);
    let t = Instant::now();
    for i in 0..n_seq {
        v.write(i << 20, &mb, false).await.unwrap();
    }
    v.flush().await.unwrap();
    let vs = t.elapsed();
    let t = Instant::now();
    for i in 0..n_seq {
        raw.write_all_at(&mb, i << 20).unwrap();
    }
    raw.sync_data().unwrap();
    let rs = t.elapsed();
    rows.push(Row(
        "1 MiB sequential write + flush".into(),
        format!("{:.0} MiB/s", n_seq as f64 / vs.as_secs_f64()),
        format!("{:.0} MiB/s", n_seq as f64 / rs.as_secs_f64()),
        format!("{:.2}x", rs.as_secs_f64() / vs.as_secs_f64()),
    ));
    e.detach(T, "io").await.unwrap();

    // Fork time against logical disk size.
    for (label, size) in [("1 GiB", 1u64 << 30), ("1 TiB", 1u64 << 40)] {
        let src = format!("src-{}", size >> 30);
        e.create_workspace(T, &src, Source::Empty { size }, Mode::Durable, None)
            .await
            .unwrap();
        let mut ts = vec![];
        for i in 0..20 {
            let t = Instant::now();
            e.fork(T, &src, Some(1), &format!("{src}-f{i}"), None)
                .await
                .unwrap();
            ts.push(t.elapsed());
        }
        rows.push(Row(
            format!("fork, {label} disk (p50 of 20)"),
            format!("{:.2} ms", us(pct(ts, 0.5)) / 1000.0),
            "-".into(),
            "-".into(),
        ));
    }

    // Checkpoint stall against dirty size.
    for &dirty in &dirty_sizes {
        let name = format!("cp-{}", dirty >> 10);
        e.create_workspace(
            T,
            &name,
            Source::Empty {
                size: disk.max(dirty * 2),
            },
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        let v = e.attach(T, &name).await.unwrap();
        let mut rng = SmallRng::seed_from_u64(dirty);
        let n = dirty / 4096;
        for _ in 0..n {
            let b: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
            v.write(rng.random_range(0..dirty * 2 / 4096) * 4096, &b, false)
                .await
                .unwrap();
        }
        let p = v.checkpoint(None).await.unwrap();
        rows.push(Row(
            format!("checkpoint, {} KiB dirty (random 4 KiB)", dirty >> 10),
            format!("stall {:.0} µs", us(p.stall)),
            format!("publish {:.0} ms", p.total.as_secs_f64() * 1000.0),
            "-".into(),
        ));
        e.detach(T, &name).await.unwrap();
    }

    println!("| measurement | strata volume | raw file / detail | ratio (strata ÷ raw speed) |");
    println!("|---|---|---|---|");
    for Row(a, b, c, d) in rows {
        println!("| {a} | {b} | {c} | {d} |");
    }
}
