//! The node cache: verified ranges ("units") of immutable objects on local disk.
//!
//! Keyed by immutable identity (tenant, object hash, unit index), so an entry never goes stale;
//! shared by every volume on the node; bounded in bytes with least-recently-used eviction.
//!
//! Crash safety: an entry is written to `tmp/` and renamed into place, so a visible entry is
//! never partially written by this process. After a restart, entries found on disk are marked
//! *unverified*: the first read re-verifies the unit against the object's frame hashes and drops
//! it on mismatch. Nothing is fsync'd: a lost entry is only a future miss.
//!
//! Layout: `{dir}/{tenant}/{hh}/{hash}.{unit}` and `{dir}/tmp/`.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use strata_format::Hash;

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Key {
    pub tenant: String,
    pub id: Hash,
    pub unit: u64,
}

struct Entry {
    len: u64,
    tick: u64,
    verified: bool,
}

#[derive(Default)]
struct Index {
    map: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
    used: u64,
}

pub struct NodeCache {
    dir: PathBuf,
    capacity: u64,
    index: Mutex<Index>,
    tmp_seq: AtomicU64,
}

/// A lookup result: the entry's file and whether it still needs verification.
pub(crate) struct Hit {
    pub path: PathBuf,
    pub verified: bool,
}

impl NodeCache {
    /// Opens (or creates) the cache in `dir`, holding at most `capacity` bytes. Entries left by a
    /// previous run are indexed as unverified; temp files are removed.
    pub fn open(dir: &Path, capacity: u64) -> std::io::Result<NodeCache> {
        std::fs::create_dir_all(dir.join("tmp"))?;
        for e in std::fs::read_dir(dir.join("tmp"))? {
            let _ = std::fs::remove_file(e?.path());
        }
        let cache = NodeCache {
            dir: dir.to_path_buf(),
            capacity,
            index: Mutex::new(Index::default()),
            tmp_seq: AtomicU64::new(0),
        };
        let mut found = vec![];
        for t in std::fs::read_dir(dir)? {
            let t = t?;
            let tenant = t.file_name().to_string_lossy().into_owned();
            if tenant == "tmp" || !t.file_type()?.is_dir() {
                continue;
            }
            for sub in std::fs::read_dir(t.path())? {
                for f in std::fs::read_dir(sub?.path())? {
                    let f = f?;
                    let name = f.file_name().to_string_lossy().into_owned();
                    let parsed = name
                        .split_once('.')
                        .and_then(|(h, u)| Some((h.parse::<Hash>().ok()?, u.parse::<u64>().ok()?)));
                    match parsed {
                        Some((id, unit)) => found.push((
                            Key {
                                tenant: tenant.clone(),
                                id,
                                unit,
                            },
                            f.metadata()?.len(),
                        )),
                        None => {
                            let _ = std::fs::remove_file(f.path());
                        }
                    }
                }
            }
        }
        {
            let mut ix = cache.lock();
            for (k, len) in found {
                ix.tick += 1;
                let tick = ix.tick;
                ix.used += len;
                ix.lru.insert(tick, k.clone());
                ix.map.insert(
                    k,
                    Entry {
                        len,
                        tick,
                        verified: false,
                    },
                );
            }
        }
        cache.evict();
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, k: &Key) -> PathBuf {
        let hex = k.id.to_hex();
        self.dir
            .join(&k.tenant)
            .join(&hex[..2])
            .join(format!("{hex}.{}", k.unit))
    }

    /// Drops every entry of `tenant` (a deleted tenant's data leaves the node). An insert
    /// racing this may leave a file that only costs space until evicted or the next open.
    pub fn forget_tenant(&self, tenant: &str) -> std::io::Result<()> {
        let gone: Vec<Key> = {
            let mut ix = self.lock();
            let gone: Vec<Key> = ix
                .map
                .keys()
                .filter(|k| k.tenant == tenant)
                .cloned()
                .collect();
            for k in &gone {
                if let Some(e) = ix.map.remove(k) {
                    ix.used -= e.len;
                    ix.lru.remove(&e.tick);
                }
            }
            gone
        };
        for k in &gone {
            match std::fs::remove_file(self.path(k)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        // The tenant's directory too, unless it is the cache's own temp directory (a tenant
        // may be named `tmp`).
        if tenant != "tmp" {
            match std::fs::remove_dir_all(self.dir.join(tenant)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Bytes currently held.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn get(&self, k: &Key) -> Option<Hit> {
        let mut ix = self.lock();
        ix.tick += 1;
        let tick = ix.tick;
        let e = ix.map.get_mut(k)?;
        let old = std::mem::replace(&mut e.tick, tick);
        let verified = e.verified;
        ix.lru.remove(&old);
        ix.lru.insert(tick, k.clone());
        Some(Hit {
            path: self.path(k),
            verified,
        })
    }

    /// Whether `k` is cached, without touching its recency.
    pub(crate) fn contains(&self, k: &Key) -> bool {
        self.lock().map.contains_key(k)
    }

    pub(crate) fn mark_verified(&self, k: &Key) {
        if let Some(e) = self.lock().map.get_mut(k) {
            e.verified = true;
        }
    }

    pub(crate) fn remove(&self, k: &Key) {
        let mut ix = self.lock();
        if let Some(e) = ix.map.remove(k) {
            ix.lru.remove(&e.tick);
            ix.used -= e.len;
        }
        drop(ix);
        let _ = std::fs::remove_file(self.path(k));
    }

    /// Stores a verified unit. Failures are logged and ignored: the cache is an optimisation.
    pub(crate) fn insert(&self, k: &Key, data: &[u8]) {
        if data.len() as u64 > self.capacity {
            return;
        }
        if self.lock().map.contains_key(k) {
            return;
        }
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{}.{n}", std::process::id()));
        let path = self.path(k);
        let res = (|| {
            std::fs::write(&tmp, data)?;
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = res {
            tracing::warn!(error = %e, "node cache insert failed");
            let _ = std::fs::remove_file(&tmp);
            return;
        }
        {
            let mut ix = self.lock();
            ix.tick += 1;
            let tick = ix.tick;
            if ix.map.contains_key(k) {
                return;
            }
            ix.used += data.len() as u64;
            ix.lru.insert(tick, k.clone());
            ix.map.insert(
                k.clone(),
                Entry {
                    len: data.len() as u64,
                    tick,
                    verified: true,
                },
            );
        }
        self.evict();
    }

    fn evict(&self) {
        let mut victims = vec![];
        {
            let mut ix = self.lock();
            while ix.used > self.capacity {
                let Some((_, k)) = ix.lru.pop_first() else {
                    break;
                };
                if let Some(e) = ix.map.remove(&k) {
                    ix.used -= e.len;
                }
                victims.push(k);
            }
        }
        for k in victims {
            let _ = std::fs::remove_file(self.path(&k));
        }
    }

    /// Reads `len` bytes at `off` from an entry file; `None` if it vanished (evicted).
    pub(crate) fn read_at(path: &Path, off: u64, len: usize) -> Option<Vec<u8>> {
        let f = std::fs::File::open(path).ok()?;
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, off).ok()?;
        Some(buf)
    }
}
