//! The object read path: node cache, then verified, single-flight, unit-aligned range GETs.
//!
//! A read of bytes `[off, off+len)` of an object is split into *units* (aligned groups of
//! frames, 256 KiB by default): small misses are coalesced into one larger aligned GET, and
//! concurrent misses on the same unit share one GET (single flight). Every fetched unit is
//! verified against the object's frame table (itself verified against the object id) before it
//! is served or cached; a mismatch is re-fetched once, then reported as corrupt. Wrong bytes are
//! never returned.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash as StdHash;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use strata_format::manifest::ObjectRef;
use strata_format::object::{self, FrameTable, FRAME_SIZE};
use strata_format::Hash;
use tokio::sync::OnceCell;

use crate::cache::{Key, NodeCache};
use crate::{Result, Store, StoreError};

type Flights<K, V> = Mutex<HashMap<K, Arc<OnceCell<Result<V>>>>>;

/// Counters of the read path (monotonic).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReaderStats {
    pub gets: u64,
    pub bytes_fetched: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub verify_failures: u64,
    pub puts: u64,
    pub bytes_put: u64,
    /// Units fetched ahead of sequential readers.
    pub prefetches: u64,
    /// Frame tables held in memory, and their bytes (bounded: [`ObjectReader::set_table_budget`]).
    pub tables: u64,
    pub table_bytes: u64,
}

#[derive(Default)]
struct Counters {
    gets: AtomicU64,
    bytes_fetched: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    verify_failures: AtomicU64,
    puts: AtomicU64,
    bytes_put: AtomicU64,
    prefetches: AtomicU64,
}

/// A sequential read stream through one object: the unit it started at and the last unit
/// fetched or scheduled.
#[derive(Clone, Copy)]
struct Stream {
    start: u64,
    frontier: u64,
}

/// Read-ahead: 8 units (2 MiB at the default 256 KiB unit) past a sequential reader.
pub const DEFAULT_READAHEAD_UNITS: u64 = 8;

/// Units of objects in a local store that were verified since this process started: read in
/// place from the object files afterwards, bounded like the node cache (by recency).
#[derive(Default)]
struct InPlace {
    ticks: HashMap<Key, u64>,
    lru: std::collections::BTreeMap<u64, Key>,
    tick: u64,
    /// Open object files: a read of a verified unit is one `pread`, not an open, a read and a
    /// close. An object is immutable, and one deleted since (by GC) still reads the bytes that
    /// were verified, so a handle is never stale; at most [`OPEN_FILES`] stay open.
    files: HashMap<(String, Hash), Arc<std::fs::File>>,
}

/// Object files kept open by a reader of a local store.
const OPEN_FILES: usize = 128;

/// Memory the frame tables of objects read or written may hold (a table is 32 bytes per 64 KiB
/// frame: 4 KiB for an 8 MiB object), by default: 32 MiB, the tables of about 64 GiB of
/// objects. The least recently used go first; one evicted is fetched again (the object's
/// trailer, one ranged GET) when its object is next read from the store.
pub const DEFAULT_TABLE_BUDGET: u64 = 32 << 20;

/// Frame tables by (tenant, object), bounded in bytes, evicted by recency. Before this bound, a
/// table was kept for every object the node ever wrote or read, GC'd or not, its tenant deleted
/// or not: a tenant overwriting at 1 GB/s grew the daemon by about 1.9 GB an hour.
#[derive(Default)]
struct Tables {
    map: HashMap<(String, Hash), (Arc<FrameTable>, u64)>,
    lru: std::collections::BTreeMap<u64, (String, Hash)>,
    tick: u64,
    bytes: u64,
}

impl Tables {
    fn cost(t: &FrameTable) -> u64 {
        // The hashes, and what a map entry and its key cost beside them.
        t.n_frames() as u64 * 32 + 128
    }

    fn get(&mut self, k: &(String, Hash)) -> Option<Arc<FrameTable>> {
        self.tick += 1;
        let tick = self.tick;
        let (t, at) = self.map.get_mut(k)?;
        let old = std::mem::replace(at, tick);
        let t = t.clone();
        if let Some(key) = self.lru.remove(&old) {
            self.lru.insert(tick, key);
        }
        Some(t)
    }

    fn insert(&mut self, k: (String, Hash), t: Arc<FrameTable>, budget: u64) {
        self.remove(&k);
        self.tick += 1;
        self.bytes += Self::cost(&t);
        self.lru.insert(self.tick, k.clone());
        self.map.insert(k, (t, self.tick));
        self.shrink(budget);
    }

    /// Evicts the least recently used tables until they fit `budget`.
    fn shrink(&mut self, budget: u64) {
        while self.bytes > budget {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            if let Some((t, _)) = self.map.remove(&old) {
                self.bytes -= Self::cost(&t);
            }
        }
    }

    fn remove(&mut self, k: &(String, Hash)) {
        if let Some((t, at)) = self.map.remove(k) {
            self.bytes -= Self::cost(&t);
            self.lru.remove(&at);
        }
    }

    fn forget_tenant(&mut self, tenant: &str) {
        let gone: Vec<_> = self.map.keys().filter(|k| k.0 == tenant).cloned().collect();
        for k in gone {
            self.remove(&k);
        }
    }
}

impl InPlace {
    fn touch(&mut self, k: &Key) -> bool {
        self.tick += 1;
        let tick = self.tick;
        match self.ticks.get_mut(k) {
            Some(t) => {
                let old = std::mem::replace(t, tick);
                self.lru.remove(&old);
                self.lru.insert(tick, k.clone());
                true
            }
            None => false,
        }
    }
    fn insert(&mut self, k: Key, max: usize) {
        if self.touch(&k) {
            return;
        }
        self.lru.insert(self.tick, k.clone());
        self.ticks.insert(k, self.tick);
        while self.ticks.len() > max {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            self.ticks.remove(&old);
        }
    }
}

pub struct ObjectReader {
    store: Store,
    cache: NodeCache,
    /// With a local store: which units are verified (the objects themselves are the copy).
    in_place: Option<Mutex<InPlace>>,
    unit: u64,
    tables: Mutex<Tables>,
    table_budget: AtomicU64,
    table_flights: Flights<(String, Hash), Arc<FrameTable>>,
    unit_flights: Flights<Key, Bytes>,
    counters: Counters,
    streams: Mutex<HashMap<(String, Hash), Stream>>,
    readahead: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn single_flight<K, V, F>(map: &Flights<K, V>, key: K, f: F) -> Result<V>
where
    K: StdHash + Eq + Clone,
    V: Clone,
    F: Future<Output = Result<V>>,
{
    let cell = lock(map).entry(key.clone()).or_default().clone();
    let r = cell.get_or_init(|| f).await.clone();
    let mut m = lock(map);
    if m.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
        m.remove(&key);
    }
    r
}

impl ObjectReader {
    /// `unit` is the fetch granularity in bytes, a multiple of the 64 KiB frame size.
    pub fn new(store: Store, cache: NodeCache, unit: u64) -> ObjectReader {
        let unit = unit.max(FRAME_SIZE as u64) / FRAME_SIZE as u64 * FRAME_SIZE as u64;
        ObjectReader {
            in_place: store.is_local().then(Mutex::default),
            store,
            cache,
            unit,
            tables: Mutex::default(),
            table_budget: AtomicU64::new(DEFAULT_TABLE_BUDGET),
            table_flights: Mutex::default(),
            unit_flights: Mutex::default(),
            counters: Counters::default(),
            streams: Mutex::default(),
            readahead: AtomicU64::new(DEFAULT_READAHEAD_UNITS),
        }
    }

    /// Units fetched ahead of a sequential reader (0 turns read-ahead off).
    pub fn set_readahead(&self, units: u64) {
        self.readahead.store(units, Relaxed);
    }

    /// Call before reading `len` bytes at `offset` of `obj`: if this continues a sequential
    /// stream through the object, fetches the next units into the node cache in the background,
    /// so a cold sequential reader (a file system scan, an export) pays one store round trip per
    /// window instead of one per unit. Random readers never trigger it. Needs a tokio runtime;
    /// without one it does nothing.
    pub fn read_ahead(self: &Arc<Self>, tenant: &str, obj: &ObjectRef, offset: u64, len: u64) {
        let w = self.readahead.load(Relaxed);
        if w == 0 || len == 0 || offset + len > obj.data_len {
            return;
        }
        let units = obj.data_len.div_ceil(self.unit);
        let (first, last) = (offset / self.unit, (offset + len - 1) / self.unit);
        let next = {
            let mut m = lock(&self.streams);
            if m.len() > 4096 {
                m.clear();
            }
            let k = (tenant.to_string(), obj.id);
            let (stream, next) = match m.get(&k).copied() {
                // A continuation (at most one unit skipped): once it has crossed a unit boundary
                // since the stream began and is within half a window of the frontier, the next
                // window is fetched.
                Some(s) if first >= s.start && first <= s.frontier + 2 => {
                    let from = s.frontier.max(last) + 1;
                    if last > s.start && last + w / 2 >= s.frontier && from < units {
                        let end = (from + w).min(units);
                        let frontier = end - 1;
                        (Stream { frontier, ..s }, from..end)
                    } else {
                        let frontier = from - 1;
                        (Stream { frontier, ..s }, 0..0)
                    }
                }
                _ => (
                    Stream {
                        start: first,
                        frontier: last,
                    },
                    0..0,
                ),
            };
            m.insert(k, stream);
            next
        };
        if next.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for u in next {
            let key = Key {
                tenant: tenant.to_string(),
                id: obj.id,
                unit: u,
            };
            if self.has(&key) {
                continue;
            }
            self.counters.prefetches.fetch_add(1, Relaxed);
            let (this, obj) = (self.clone(), *obj);
            rt.spawn(async move {
                let r = single_flight(&this.unit_flights, key.clone(), this.fetch_unit(key, obj));
                if let Err(e) = r.await {
                    tracing::debug!(object = %obj.id, error = %e, "read-ahead failed");
                }
            });
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn cache(&self) -> &NodeCache {
        &self.cache
    }

    pub fn stats(&self) -> ReaderStats {
        let c = &self.counters;
        let tables = {
            let t = lock(&self.tables);
            (t.map.len() as u64, t.bytes)
        };
        ReaderStats {
            gets: c.gets.load(Relaxed),
            bytes_fetched: c.bytes_fetched.load(Relaxed),
            cache_hits: c.cache_hits.load(Relaxed),
            cache_misses: c.cache_misses.load(Relaxed),
            verify_failures: c.verify_failures.load(Relaxed),
            puts: c.puts.load(Relaxed),
            bytes_put: c.bytes_put.load(Relaxed),
            prefetches: c.prefetches.load(Relaxed),
            tables: tables.0,
            table_bytes: tables.1,
        }
    }

    /// Uploads `data` as an object and fills the node cache with it (write-through), so data
    /// that just left the journal is read back locally, not from the store.
    pub async fn put_object(&self, tenant: &str, data: &[u8]) -> Result<ObjectRef> {
        self.put_object_salted(tenant, data.to_vec(), rand::random())
            .await
    }

    /// Uploads data the caller hands over with a chosen salt (see [`Store::put_object_salted`]).
    pub async fn put_object_salted(
        &self,
        tenant: &str,
        data: Vec<u8>,
        salt: u32,
    ) -> Result<ObjectRef> {
        self.put_object_buf(tenant, data.into(), salt).await
    }

    /// [`ObjectReader::put_object_salted`] of an object built in an [`crate::ObjectBuf`].
    pub async fn put_object_buf(
        &self,
        tenant: &str,
        data: crate::ObjectBuf,
        salt: u32,
    ) -> Result<ObjectRef> {
        let (r, encoded) = self.store.put_object_buf(tenant, data, salt).await?;
        let data = &encoded[..r.data_len as usize];
        self.counters.puts.fetch_add(1, Relaxed);
        self.counters
            .bytes_put
            .fetch_add(encoded.len() as u64, Relaxed);
        let key = self.store.object_id_key(tenant).await?;
        if let Ok(table) =
            FrameTable::decode_keyed(&r.id, r.data_len, &encoded[data.len()..], key.as_ref())
        {
            self.keep_table((tenant.to_string(), r.id), Arc::new(table));
        }
        let mut u = 0;
        while u * self.unit < r.data_len {
            let end = ((u + 1) * self.unit).min(r.data_len);
            let key = Key {
                tenant: tenant.to_string(),
                id: r.id,
                unit: u,
            };
            self.keep(key, &data[(u * self.unit) as usize..end as usize]);
            u += 1;
        }
        Ok(r)
    }

    /// Keeps a verified unit for later reads: a copy in the node cache, or (local store) only
    /// the fact that the object file's bytes were verified.
    fn keep(&self, key: Key, bytes: &[u8]) {
        match self.in_place_for(&key.tenant) {
            Some(ip) => {
                let max = (self.cache.capacity() / self.unit).max(1024) as usize;
                lock(ip).insert(key, max);
            }
            None => self.cache.insert(&key, bytes),
        }
    }

    /// The in-place reads of a local store, for a tenant whose objects are in it (a tenant
    /// placed in a store of its own goes through the node cache).
    fn in_place_for(&self, tenant: &str) -> Option<&Mutex<InPlace>> {
        self.in_place
            .as_ref()
            .filter(|_| self.store.is_local_for(tenant))
    }

    fn has(&self, key: &Key) -> bool {
        match self.in_place_for(&key.tenant) {
            Some(ip) => lock(ip).ticks.contains_key(key),
            None => self.cache.contains(key),
        }
    }

    async fn table(&self, tenant: &str, obj: &ObjectRef) -> Result<Arc<FrameTable>> {
        let k = (tenant.to_string(), obj.id);
        if let Some(t) = lock(&self.tables).get(&k) {
            return Ok(t);
        }
        let t = single_flight(&self.table_flights, k.clone(), async {
            let id_key = self.store.object_id_key(tenant).await?;
            let key = Store::object_key(tenant, &obj.id);
            let range = obj.data_len..obj.data_len + object::trailer_len(obj.data_len);
            let mut last = String::new();
            for _ in 0..2 {
                let bytes = self.get_counted(&key, range.clone()).await?;
                match FrameTable::decode_keyed(&obj.id, obj.data_len, &bytes, id_key.as_ref()) {
                    Ok(t) => return Ok(Arc::new(t)),
                    Err(e) => {
                        self.counters.verify_failures.fetch_add(1, Relaxed);
                        tracing::warn!(object = %obj.id, error = %e, "object trailer failed verification");
                        last = e.to_string();
                    }
                }
            }
            Err(StoreError::Corrupt(format!("object {}: {last}", obj.id)))
        })
        .await?;
        self.keep_table(k, t.clone());
        Ok(t)
    }

    fn keep_table(&self, k: (String, Hash), t: Arc<FrameTable>) {
        let budget = self.table_budget.load(Relaxed);
        lock(&self.tables).insert(k, t, budget);
    }

    /// Bounds the memory frame tables may hold (default [`DEFAULT_TABLE_BUDGET`]).
    pub fn set_table_budget(&self, bytes: u64) {
        self.table_budget.store(bytes, Relaxed);
        lock(&self.tables).shrink(bytes);
    }

    /// Forgets everything of `tenant` this reader holds: frame tables, verified units of a
    /// local store, open object files, read-ahead streams, and the tenant's node cache
    /// entries (files included). For a tenant being deleted: nothing of it stays in memory or
    /// on this node's disk.
    pub fn forget_tenant(&self, tenant: &str) -> std::io::Result<()> {
        lock(&self.tables).forget_tenant(tenant);
        if let Some(ip) = &self.in_place {
            let mut ip = lock(ip);
            let gone: Vec<Key> = ip
                .ticks
                .keys()
                .filter(|k| k.tenant == tenant)
                .cloned()
                .collect();
            for k in gone {
                if let Some(t) = ip.ticks.remove(&k) {
                    ip.lru.remove(&t);
                }
            }
            ip.files.retain(|(t, _), _| t != tenant);
        }
        lock(&self.streams).retain(|(t, _), _| t != tenant);
        self.cache.forget_tenant(tenant)
    }

    /// One ranged GET, counted.
    async fn get_counted(
        &self,
        key: &object_store::path::Path,
        range: Range<u64>,
    ) -> Result<Bytes> {
        let bytes = self.store.get_range(key, range).await?;
        self.counters.gets.fetch_add(1, Relaxed);
        self.counters
            .bytes_fetched
            .fetch_add(bytes.len() as u64, Relaxed);
        Ok(bytes)
    }

    async fn fetch_unit(&self, key: Key, obj: ObjectRef) -> Result<Bytes> {
        let start = key.unit * self.unit;
        let end = (start + self.unit).min(obj.data_len);
        // A fetch of this unit may have completed between the caller's cache check and this
        // flight (a read-ahead, another reader): then the cache has it.
        if let Some(v) = self.cached(&key, &obj, 0, (end - start) as usize).await {
            return Ok(Bytes::from(v));
        }
        let okey = Store::object_key(&key.tenant, &obj.id);
        // Frames sit at fixed offsets, so the unit need not wait for the object's frame table:
        // both are fetched at once and a cold read of a new object costs one round trip.
        let (table, first) = futures::future::join(
            self.table(&key.tenant, &obj),
            self.get_counted(&okey, start..end),
        )
        .await;
        let table = table?;
        let mut first = Some(first);
        for _ in 0..2 {
            let bytes = match first.take() {
                Some(got) => got?,
                None => self.get_counted(&okey, start..end).await?,
            };
            let first = (start / FRAME_SIZE as u64) as usize;
            if bytes.len() as u64 == end - start && table.verify(first, &bytes).is_ok() {
                self.keep(key, &bytes);
                return Ok(bytes);
            }
            self.counters.verify_failures.fetch_add(1, Relaxed);
            tracing::warn!(object = %obj.id, start, end, "object range failed verification; re-fetching");
        }
        Err(StoreError::Corrupt(format!(
            "object {} bytes {start}..{end} do not match their hash",
            obj.id
        )))
    }

    /// Reads bytes `[off, off + len)` of `unit` from the cache, verifying an entry left by a
    /// previous run before trusting it. `None` is a miss.
    async fn cached(&self, key: &Key, obj: &ObjectRef, off: u64, len: usize) -> Option<Vec<u8>> {
        if let Some(ip) = self.in_place_for(&key.tenant) {
            use std::os::unix::fs::FileExt;
            if !lock(ip).touch(key) {
                return None;
            }
            let file = self.object_file(ip, &key.tenant, &obj.id)?;
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, key.unit * self.unit + off)
                .ok()?;
            return Some(buf);
        }
        let hit = self.cache.get(key)?;
        if hit.verified {
            return NodeCache::read_at(&hit.path, off, len);
        }
        let table = self.table(&key.tenant, obj).await.ok()?;
        let data = std::fs::read(&hit.path).ok()?;
        let first = (key.unit * self.unit / FRAME_SIZE as u64) as usize;
        let expect = ((key.unit + 1) * self.unit).min(obj.data_len) - key.unit * self.unit;
        if data.len() as u64 != expect || table.verify(first, &data).is_err() {
            tracing::warn!(object = %obj.id, unit = key.unit, "dropping node cache entry that failed re-verification");
            self.cache.remove(key);
            return None;
        }
        self.cache.mark_verified(key);
        Some(data[off as usize..off as usize + len].to_vec())
    }

    /// The open file of a local store's object (kept open for the next read; see
    /// [`InPlace::files`]). Opened outside the lock.
    fn object_file(
        &self,
        ip: &Mutex<InPlace>,
        tenant: &str,
        id: &Hash,
    ) -> Option<Arc<std::fs::File>> {
        let key = (tenant.to_string(), *id);
        if let Some(f) = lock(ip).files.get(&key) {
            return Some(f.clone());
        }
        let f = Arc::new(std::fs::File::open(self.store.local_object_path(tenant, id)?).ok()?);
        let mut ip = lock(ip);
        if ip.files.len() >= OPEN_FILES {
            let old = ip.files.keys().next().cloned();
            if let Some(old) = old {
                ip.files.remove(&old);
            }
        }
        Some(ip.files.entry(key).or_insert(f).clone())
    }

    /// A read of units all verified before, from a local store's object file straight into
    /// `buf`; false if any unit is not (the caller takes the general path).
    fn read_in_place(&self, tenant: &str, obj: &ObjectRef, offset: u64, buf: &mut [u8]) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(ip) = self.in_place_for(tenant) else {
            return false;
        };
        let end = offset + buf.len() as u64;
        let mut key = Key {
            tenant: tenant.to_string(),
            id: obj.id,
            unit: offset / self.unit,
        };
        let mut units = 0;
        {
            let mut ip = lock(ip);
            while key.unit * self.unit < end {
                if !ip.touch(&key) {
                    return false;
                }
                key.unit += 1;
                units += 1;
            }
        }
        let Some(file) = self.object_file(ip, tenant, &obj.id) else {
            return false;
        };
        if file.read_exact_at(buf, offset).is_err() {
            return false;
        }
        self.counters.cache_hits.fetch_add(units, Relaxed);
        true
    }

    /// Reads `buf.len()` bytes at `offset` of object `obj` into `buf`, verified.
    pub async fn read_into(
        &self,
        tenant: &str,
        obj: &ObjectRef,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let end = offset + buf.len() as u64;
        if end > obj.data_len {
            return Err(StoreError::Corrupt(format!(
                "read {offset}..{end} past the end of object {} ({} bytes)",
                obj.id, obj.data_len
            )));
        }
        if buf.is_empty() || self.read_in_place(tenant, obj, offset, buf) {
            return Ok(());
        }
        let first = offset / self.unit;
        let last = (end - 1) / self.unit;
        let parts = futures::future::join_all((first..=last).map(|u| {
            let ustart = u * self.unit;
            let a = offset.max(ustart);
            let b = end.min(ustart + self.unit);
            let key = Key {
                tenant: tenant.to_string(),
                id: obj.id,
                unit: u,
            };
            async move {
                if let Some(v) = self.cached(&key, obj, a - ustart, (b - a) as usize).await {
                    self.counters.cache_hits.fetch_add(1, Relaxed);
                    return Ok::<_, StoreError>((a, Bytes::from(v)));
                }
                self.counters.cache_misses.fetch_add(1, Relaxed);
                let unit =
                    single_flight(&self.unit_flights, key.clone(), self.fetch_unit(key, *obj))
                        .await?;
                Ok((a, unit.slice((a - ustart) as usize..(b - ustart) as usize)))
            }
        }))
        .await;
        for p in parts {
            let (a, bytes) = p?;
            let at = (a - offset) as usize;
            buf[at..at + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(())
    }
}
