use std::path::PathBuf;
use std::time::Duration;

/// The one opt-out that turns off a durable workspace's flushes. Only the exact value `1`
/// counts: `true`, `yes`, empty or ` 1` leave durability on.
pub const UNSAFE_ENV: &str = "STRATA_VOLUME_CACHE_UNSAFE";

/// Whether `value` (of [`UNSAFE_ENV`]) disables flushes.
pub fn cache_unsafe(value: Option<&str>) -> bool {
    value == Some("1")
}

/// Reads [`UNSAFE_ENV`] from the environment.
pub fn cache_unsafe_from_env() -> bool {
    cache_unsafe(std::env::var(UNSAFE_ENV).ok().as_deref())
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Holds `catalog.db`, `objects/`, `cache/`, `volumes/` and `node-id` in the embedded setup.
    pub data_dir: PathBuf,
    /// This node's name in leases; read from `data_dir/node-id` (created once) if `None`.
    pub node_id: Option<String>,
    /// Durable mode: publish at least this often while there is unpublished data (the RPO bound).
    pub upload_interval: Duration,
    /// Durable mode: publish as soon as this many bytes are unpublished.
    pub upload_max_bytes: u64,
    pub lease_ttl: Duration,
    pub cache_capacity: u64,
    /// Object read granularity (misses are fetched in aligned units of this size).
    pub fetch_unit: u64,
    /// Units fetched ahead of a sequential reader of an object (0: off).
    pub readahead_units: u64,
    pub segment_max_bytes: u64,
    /// Target size of packed objects.
    pub object_target_bytes: u64,
    /// Durable flushes are not honoured (a control for power-loss tests; the `strata` binary
    /// sets it from `STRATA_VOLUME_CACHE_UNSAFE=1`). Off by default.
    pub cache_unsafe: bool,
    /// Garbage collection: objects and manifests are deleted only after staying unreferenced
    /// this long (two GC passes at least this far apart); publishes slower than half of it
    /// give up. Every node sharing a store must use the same value or larger.
    pub gc_grace: Duration,
    /// Retention: unlabelled versions users made (checkpoints, rollbacks, forks, resizes)
    /// beyond the newest `keep_checkpoints` of a workspace …
    pub keep_checkpoints: usize,
    /// … automatic versions (background and sync-mode publishes, detaches, compactions)
    /// beyond the newest `keep_auto_versions` besides the head (each pins what was written
    /// over since: history costs disk, so it is kept only when asked for) …
    pub keep_auto_versions: usize,
    /// … or older than this expire (labelled ones expire only by their own `keep_until`).
    pub keep_checkpoint_age: Duration,
    /// GC compacts attached volumes whose head objects are less live than this fraction.
    pub compact_below: f64,
    /// Guest writes get ENOSPC while the data directory's file system has less than this
    /// available, so the node's own metadata always has room (0: no floor).
    pub min_free_bytes: u64,
}

/// Largest journal segment (`segment_max_bytes`): the overlay names offsets in a segment in
/// 40 bits ([`crate::overlay`]), and a segment ends past its limit by at most one record.
pub const MAX_SEGMENT_BYTES: u64 = 64 << 30;

impl EngineConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> EngineConfig {
        EngineConfig {
            data_dir: data_dir.into(),
            node_id: None,
            upload_interval: Duration::from_secs(10),
            upload_max_bytes: 64 << 20,
            lease_ttl: Duration::from_secs(30),
            cache_capacity: 8 << 30,
            fetch_unit: 256 << 10,
            readahead_units: strata_store::DEFAULT_READAHEAD_UNITS,
            segment_max_bytes: 64 << 20,
            object_target_bytes: 8 << 20,
            // The process decides (the `strata` binary reads [`UNSAFE_ENV`]): a library
            // constructor does not read the environment.
            cache_unsafe: false,
            gc_grace: Duration::from_secs(3600),
            keep_checkpoints: 16,
            keep_auto_versions: 0,
            keep_checkpoint_age: Duration::from_secs(7 * 24 * 3600),
            compact_below: 0.5,
            min_free_bytes: 64 << 20,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exact_one_disables_flushes() {
        assert!(cache_unsafe(Some("1")));
        for v in [
            None,
            Some(""),
            Some("true"),
            Some("yes"),
            Some(" 1"),
            Some("1 "),
            Some("01"),
            Some("0"),
        ] {
            assert!(!cache_unsafe(v), "{v:?} must leave durability on");
        }
    }
}
