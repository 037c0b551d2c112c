#![allow(dead_code)]
//! Shared test scaffolding: a "cluster" is one catalog and one object store; nodes are engines
//! with their own data directories (and optionally a simulated file system) on top of it.

pub mod faults;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::{Fs, RealFs};
use strata_engine::{Engine, EngineConfig};
use strata_store::Store;

pub const TENANT: &str = "acme";

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub catalog: Arc<dyn Catalog>,
    pub store: Store,
}

fn scratch() -> tempfile::TempDir {
    // Prefer memory-backed scratch space: the catalog fsyncs every commit.
    match std::fs::metadata("/dev/shm") {
        Ok(m) if m.is_dir() => {
            tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
        }
        _ => tempfile::tempdir().unwrap(),
    }
}

impl Cluster {
    /// A catalog on SQLite and an object store in a local directory.
    pub async fn new() -> Cluster {
        let dir = scratch();
        let catalog: Arc<dyn Catalog> =
            Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
        let store = Store::open(&format!("file:{}", dir.path().join("objects").display())).unwrap();
        catalog.create_tenant(TENANT).await.unwrap();
        Cluster {
            dir,
            catalog,
            store,
        }
    }

    /// The same, with the object store on the S3-protocol server named by
    /// `STRATA_TEST_S3_ENDPOINT` (None when unset and not required).
    pub async fn new_s3() -> Option<Cluster> {
        let Ok(endpoint) = std::env::var("STRATA_TEST_S3_ENDPOINT") else {
            assert!(
                std::env::var("STRATA_REQUIRE_S3").as_deref() != Ok("1"),
                "STRATA_REQUIRE_S3=1 but no endpoint"
            );
            return None;
        };
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
        let dir = scratch();
        let bucket = format!("engine-{}", std::process::id());
        let out = std::process::Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
            .arg(format!("{endpoint}/{bucket}"))
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with('2'),
            "cannot create bucket"
        );
        let catalog: Arc<dyn Catalog> =
            Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
        let store = Store::open(&format!(
            "s3://{bucket}/strata?endpoint={endpoint}&region=us-east-1&allow_http=true"
        ))
        .unwrap();
        catalog.create_tenant(TENANT).await.unwrap();
        Some(Cluster {
            dir,
            catalog,
            store,
        })
    }

    pub fn config(&self, node: &str) -> EngineConfig {
        let mut cfg = EngineConfig::new(self.dir.path().join(node));
        cfg.node_id = Some(node.to_string());
        cfg.upload_interval = Duration::from_secs(3600);
        cfg.upload_max_bytes = u64::MAX;
        cfg.lease_ttl = Duration::from_secs(60);
        cfg.cache_capacity = 256 << 20;
        cfg.segment_max_bytes = 256 << 10;
        cfg.object_target_bytes = 256 << 10;
        cfg.cache_unsafe = false;
        cfg
    }

    pub fn node(&self, node: &str) -> Arc<Engine> {
        self.node_with(self.config(node), Arc::new(RealFs))
    }

    pub fn node_with(&self, cfg: EngineConfig, fs: Arc<dyn Fs>) -> Arc<Engine> {
        Engine::open_with(cfg, self.catalog.clone(), self.store.clone(), fs).unwrap()
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
}

/// Creates an empty workspace of `size` bytes in `mode` and attaches it on `node`.
pub async fn empty_volume(
    node: &Arc<Engine>,
    name: &str,
    size: u64,
    mode: strata_engine::Mode,
) -> Arc<strata_engine::Volume> {
    node.create_workspace(
        TENANT,
        name,
        strata_engine::Source::Empty { size },
        mode,
        None,
    )
    .await
    .unwrap();
    node.attach(TENANT, name).await.unwrap()
}

/// A block whose contents say what it is: (tag, lba) repeated. Tag 0 is reserved for zeros.
pub fn tagged(tag: u64, lba: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    while b.len() < 4096 {
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(&lba.to_le_bytes());
    }
    b
}

/// Decodes a tagged block: Some(tag) (0 for an all-zero block), None if torn or foreign.
pub fn tag_of(block: &[u8], lba: u64) -> Option<u64> {
    if block.iter().all(|&x| x == 0) {
        return Some(0);
    }
    let tag = u64::from_le_bytes(block[..8].try_into().ok()?);
    (block == tagged(tag, lba).as_slice()).then_some(tag)
}

/// The tags of every block of `v` (panics on a torn or foreign block).
pub async fn image(v: &strata_engine::Volume) -> Vec<u64> {
    let img = v.read(0, v.size()).await.unwrap();
    (0..v.size() / 4096)
        .map(|b| {
            tag_of(&img[(b * 4096) as usize..((b + 1) * 4096) as usize], b)
                .unwrap_or_else(|| panic!("block {b} is torn or foreign"))
        })
        .collect()
}

/// Writes blocks `lba..lba+n` of `v`, tagged `tag`.
pub async fn write_tag(v: &strata_engine::Volume, tag: u64, lba: u64, n: u64) {
    let mut data = Vec::new();
    for b in lba..lba + n {
        data.extend(tagged(tag, b));
    }
    v.write(lba * 4096, &data, false).await.unwrap();
}

/// A node on the cluster's store whose catalog can lose a head CAS's reply (see `faults`).
pub fn lossy_node(c: &Cluster, node: &str) -> (Arc<Engine>, Arc<faults::LossyCatalog>) {
    let lossy = faults::LossyCatalog::new(c.catalog.clone());
    let e = Engine::open_with(
        c.config(node),
        lossy.clone(),
        c.store.clone(),
        Arc::new(strata_engine::fs::RealFs),
    )
    .unwrap();
    (e, lossy)
}
