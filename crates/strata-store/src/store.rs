//! The object store and its key layout.
//!
//! ```text
//! {prefix}/t/{tenant}/obj/{hh}/{hash}   immutable framed objects (see strata_format::object)
//! {prefix}/t/{tenant}/man/{hash}        immutable manifests
//! ```
//! Tenant names are validated (strata_format::name) so no key can leave its tenant's prefix.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use crate::ObjectBuf;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use strata_format::manifest::{Manifest, ObjectRef};
use strata_format::{object, Hash};

use crate::seal::{DataKey, MasterKey};
use crate::{Result, StoreError};

/// One bucket (or directory) and its client.
struct Backend {
    inner: Arc<dyn ObjectStore>,
    url: String,
    /// For `file:` stores: the directory whose files are the objects (read in place, never
    /// copied into the node cache).
    local_root: Option<std::path::PathBuf>,
}

/// A tenant's placement as the catalog records it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    /// The named store its keys go to; `None`: the default store.
    pub store: Option<String>,
    /// Its data key wrapped by a master key (an encrypted tenant); `None`: not encrypted.
    pub data_key: Option<String>,
    /// Which tenant of that name (its creation time): one deleted and created again is
    /// another, perhaps placed elsewhere.
    pub incarnation: u64,
}

/// Finds a tenant's placement.
pub type Resolver =
    Arc<dyn Fn(String) -> futures::future::BoxFuture<'static, Result<Placed>> + Send + Sync>;

/// Where a tenant's keys go, and how they are sealed.
#[derive(Clone)]
struct Target {
    backend: Arc<Backend>,
    key: Sealing,
    incarnation: u64,
}

/// How a tenant's contents are sealed.
#[derive(Clone)]
enum Sealing {
    Clear,
    Key(Arc<DataKey>),
    /// Encrypted under a key this node cannot use (no master key, another one, or destroyed):
    /// its keys can be listed and deleted, its contents neither written nor read.
    Locked(String),
}

impl Sealing {
    fn key(&self) -> Result<Option<&DataKey>> {
        match self {
            Sealing::Clear => Ok(None),
            Sealing::Key(k) => Ok(Some(k)),
            Sealing::Locked(why) => Err(StoreError::Placement {
                message: why.clone(),
                retryable: false,
            }),
        }
    }
}

/// Where tenants' keys go: the default store, or a named store the node's configuration
/// defines (a tenant's own bucket and credentials); and, for an encrypted tenant, its data key
/// (unwrapped with the node's master key). A tenant's placement is recorded in the catalog when
/// it is created and never changes; the engine installs a [`Resolver`] that reads it. Fail
/// closed: with a resolver installed, a tenant whose placement cannot be read, names a store
/// this node does not have, or is encrypted under a master key this node does not hold,
/// reaches no store at all.
#[derive(Default)]
struct Placement {
    /// Listings of a tenant's whole prefix ([`Store::list_tenant`]) since this store was made.
    listings: std::sync::atomic::AtomicU64,
    /// Manifests fetched ([`Store::get_manifest`]) since this store was made.
    manifest_gets: std::sync::atomic::AtomicU64,
    named: std::collections::BTreeMap<String, Arc<Backend>>,
    master: Option<Arc<MasterKey>>,
    bound: std::sync::RwLock<std::collections::HashMap<String, Target>>,
    resolver: std::sync::RwLock<Option<Resolver>>,
}

#[derive(Clone)]
pub struct Store {
    default: Arc<Backend>,
    placement: Arc<Placement>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.default.url)
    }
}

fn read<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

impl Store {
    /// Opens a store by URL:
    /// - `file:DIR`: a local directory, every put fsync'd (the embedded default);
    /// - `s3://BUCKET[/PREFIX][?endpoint=URL&region=R&allow_http=true]`: any S3-compatible store
    ///   (AWS, MinIO, R2, Ceph RGW, GCS's S3 interoperability); options are object_store's S3
    ///   configuration keys, plus `retries` and `timeout_ms`; credentials from [`Credentials`]
    ///   or the usual `AWS_*` environment variables, never from the URL; path-style requests
    ///   unless `virtual_hosted_style_request=true`;
    /// - `memory:`: in memory (tests).
    pub fn open(url: &str) -> Result<Store> {
        Store::open_with(url, &Credentials::default())
    }

    /// [`Store::open`] with S3 credentials from configuration (they override `AWS_*`).
    pub fn open_with(url: &str, creds: &Credentials) -> Result<Store> {
        let mut local_root = None;
        let inner: Arc<dyn ObjectStore> = if let Some(dir) = url.strip_prefix("file:") {
            let dir = dir.strip_prefix("//").unwrap_or(dir);
            std::fs::create_dir_all(dir)?;
            local_root = Some(std::fs::canonicalize(dir)?);
            Arc::new(
                LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| StoreError::BadUrl(url.into(), e.to_string()))?
                    .with_fsync(true),
            )
        } else if let Some(rest) = url.strip_prefix("s3://") {
            open_s3(url, rest, creds)?
        } else if url == "memory:" {
            Arc::new(InMemory::new())
        } else {
            return Err(StoreError::BadUrl(
                url.into(),
                "expected file:DIR, s3://BUCKET[/PREFIX][?endpoint=..] or memory:".into(),
            ));
        };
        Ok(Store::of(Backend {
            inner,
            url: url.into(),
            local_root,
        }))
    }

    fn of(b: Backend) -> Store {
        Store {
            default: Arc::new(b),
            placement: Arc::default(),
        }
    }

    /// Wraps any `object_store` implementation (fault-injecting wrappers in tests).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, url: &str) -> Store {
        Store::of(Backend {
            inner,
            url: url.into(),
            local_root: None,
        })
    }

    /// This store as the default, with `named` stores tenants can be placed in (each given by
    /// its default; names follow the rules of workspace names) and the node's master key, if
    /// it has one (needed to create or serve encrypted tenants).
    pub fn with_named(
        self,
        named: Vec<(String, Store)>,
        master: Option<MasterKey>,
    ) -> Result<Store> {
        let mut map = std::collections::BTreeMap::new();
        for (name, s) in named {
            strata_format::name::validate("store", &name)
                .map_err(|e| StoreError::BadUrl(s.default.url.clone(), e.to_string()))?;
            map.insert(name, s.default.clone());
        }
        Ok(Store {
            default: self.default,
            placement: Arc::new(Placement {
                named: map,
                master: master.map(Arc::new),
                ..Placement::default()
            }),
        })
    }

    /// The named stores this node has.
    pub fn named(&self) -> Vec<String> {
        self.placement.named.keys().cloned().collect()
    }

    /// From now on, tenants' placements are read through `r` (once per tenant, then kept).
    pub fn set_resolver(&self, r: Resolver) {
        *write(&self.placement.resolver) = Some(r);
    }

    /// Whether `name` is a store this node has.
    pub fn has_named(&self, name: &str) -> bool {
        self.placement.named.contains_key(name)
    }

    /// A new wrapped data key for `tenant` (to record at its creation); refused without a
    /// master key.
    pub fn new_data_key(&self, tenant: &str) -> Result<String> {
        match &self.placement.master {
            Some(m) => Ok(m.new_wrapped(tenant)),
            None => Err(StoreError::Placement {
                message: "this node has no master key (master_key_file): it cannot create encrypted tenants".into(),
                retryable: false,
            }),
        }
    }

    /// Records `tenant`'s placement (its creation, or a resolver's answer); refused if it
    /// names a store this node does not have or a data key this node cannot unwrap.
    pub fn bind(&self, tenant: &str, placed: &Placed) -> Result<()> {
        let refuse = |message: String| StoreError::Placement {
            message,
            retryable: false,
        };
        let backend = match &placed.store {
            None => self.default.clone(),
            Some(n) => self.placement.named.get(n).cloned().ok_or_else(|| {
                refuse(format!(
                    "tenant {tenant:?} is placed in store {n:?}, which this node does not have (configure [stores.{n}])"
                ))
            })?,
        };
        let key = match (&placed.data_key, &self.placement.master) {
            (None, _) => Sealing::Clear,
            (Some(w), _) if w == "shredded" => Sealing::Locked(format!(
                "tenant {tenant:?}: its data key was destroyed with its deletion"
            )),
            (Some(_), None) => Sealing::Locked(format!(
                "tenant {tenant:?} is encrypted and this node has no master key (master_key_file)"
            )),
            (Some(w), Some(m)) => match m.unwrap(tenant, w) {
                Ok(k) => Sealing::Key(Arc::new(k)),
                Err(StoreError::Placement { message, .. }) => Sealing::Locked(message),
                Err(e) => Sealing::Locked(e.to_string()),
            },
        };
        let incarnation = placed.incarnation;
        write(&self.placement.bound).insert(
            tenant.to_string(),
            Target {
                backend,
                key,
                incarnation,
            },
        );
        Ok(())
    }

    /// Reads `tenant`'s placement again and binds it if it is another tenant of that name than
    /// the one bound (deleted and created again, perhaps by another node). Called where a
    /// tenant starts writing on this node (attach, creates, templates, relay, GC).
    pub async fn refresh(&self, tenant: &str) -> Result<()> {
        let r = read(&self.placement.resolver).clone();
        let Some(r) = r else {
            return Ok(());
        };
        let placed = r(tenant.to_string()).await?;
        let same = read(&self.placement.bound)
            .get(tenant)
            .is_some_and(|t| t.incarnation == placed.incarnation);
        if !same {
            self.bind(tenant, &placed)?;
        }
        Ok(())
    }

    /// The tenants whose placement this node holds.
    pub fn bound_tenants(&self) -> Vec<String> {
        read(&self.placement.bound).keys().cloned().collect()
    }

    /// Forgets `tenant`'s placement and data key (it was deleted; a new tenant of that name
    /// may be placed elsewhere).
    pub fn unbind(&self, tenant: &str) {
        write(&self.placement.bound).remove(tenant);
    }

    /// Whether `tenant` is known to be encrypted.
    pub fn is_encrypted(&self, tenant: &str) -> bool {
        self.known(tenant)
            .is_some_and(|t| !matches!(t.key, Sealing::Clear))
    }

    /// Whether `tenant` is encrypted under a key this node cannot use.
    pub fn is_locked(&self, tenant: &str) -> bool {
        self.known(tenant)
            .is_some_and(|t| matches!(t.key, Sealing::Locked(_)))
    }

    /// Where a tenant whose placement is known now goes (no resolver: the default, clear).
    fn known(&self, tenant: &str) -> Option<Target> {
        match read(&self.placement.bound).get(tenant) {
            Some(t) => Some(t.clone()),
            None if read(&self.placement.resolver).is_none() => Some(Target {
                backend: self.default.clone(),
                key: Sealing::Clear,
                incarnation: 0,
            }),
            None => None,
        }
    }

    async fn target(&self, tenant: &str) -> Result<Target> {
        if let Some(t) = self.known(tenant) {
            return Ok(t);
        }
        let r = read(&self.placement.resolver).clone();
        let Some(r) = r else {
            return Ok(Target {
                backend: self.default.clone(),
                key: Sealing::Clear,
                incarnation: 0,
            });
        };
        let placed = r(tenant.to_string()).await?;
        self.bind(tenant, &placed)?;
        self.known(tenant).ok_or_else(|| StoreError::Placement {
            message: format!("tenant {tenant:?}: no store"),
            retryable: false,
        })
    }

    /// The object store holding `tenant`'s keys (its own bucket, or the default). Raw: for
    /// listing and deleting; contents go through the methods that seal and open them.
    pub async fn inner_for(&self, tenant: &str) -> Result<Arc<dyn ObjectStore>> {
        Ok(self.target(tenant).await?.backend.inner.clone())
    }

    /// Every key under `tenant`'s prefix in its store, as the store pages them (one request per
    /// 1,000 keys on S3). Counted ([`Store::tenant_listings`]): GC makes one only in a
    /// reconciliation pass.
    pub async fn list_tenant(
        &self,
        tenant: &str,
    ) -> Result<futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>>
    {
        let inner = self.inner_for(tenant).await?;
        self.placement
            .listings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(inner.list(Some(&crate::keys::tenant(tenant))))
    }

    /// How many manifests [`Store::get_manifest`] fetched.
    pub fn manifest_gets(&self) -> u64 {
        self.placement
            .manifest_gets
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times [`Store::list_tenant`] listed a tenant's prefix.
    pub fn tenant_listings(&self) -> u64 {
        self.placement
            .listings
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The object store holding `key` (`t/{tenant}/…`): its tenant's.
    pub async fn inner_for_key(&self, key: &Path) -> Result<Arc<dyn ObjectStore>> {
        self.inner_for(&Self::tenant_of(key)?).await
    }

    /// The default store's client (tests and tools; tenants' data goes through
    /// [`Store::inner_for`]).
    pub fn default_inner(&self) -> &Arc<dyn ObjectStore> {
        &self.default.inner
    }

    /// The file holding object `id` of `tenant`, when the tenant's store is a local directory
    /// and its placement is known.
    pub fn local_object_path(&self, tenant: &str, id: &Hash) -> Option<std::path::PathBuf> {
        let t = self
            .known(tenant)
            .filter(|t| matches!(t.key, Sealing::Clear))?;
        let root = t.backend.local_root.as_ref()?;
        Some(root.join(Self::object_key(tenant, id).as_ref()))
    }

    /// Whether the default store's objects are files in a local directory (the embedded
    /// default).
    pub fn is_local(&self) -> bool {
        self.default.local_root.is_some()
    }

    /// Whether `tenant`'s objects are known to be files in a local directory, in clear (read
    /// in place).
    pub fn is_local_for(&self, tenant: &str) -> bool {
        self.known(tenant)
            .is_some_and(|t| matches!(t.key, Sealing::Clear) && t.backend.local_root.is_some())
    }

    /// Removes the staged files (`{key}#{digits}`) that puts interrupted by a crash left in
    /// this node's local object directories (the default store and named ones), once older
    /// than `older_than`; listings skip them, so nothing else would. What cannot be read or
    /// removed is passed over with a warning. Returns how many went.
    pub async fn sweep_staged(&self, older_than: std::time::Duration) -> Result<u64> {
        let mut roots: Vec<std::path::PathBuf> = std::iter::once(&self.default)
            .chain(self.placement.named.values())
            .filter_map(|b| b.local_root.clone())
            .collect();
        roots.sort();
        roots.dedup();
        let n = tokio::task::spawn_blocking(move || {
            let mut n = 0;
            for r in &roots {
                let (removed, failed, first) = crate::local_put::sweep_staged(r, older_than);
                n += removed;
                if let Some(e) = first {
                    tracing::warn!(root = %r.display(), failed, error = %e, "some staged files could not be swept");
                }
            }
            n
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(n)
    }

    /// The default store's URL.
    pub fn url(&self) -> &str {
        &self.default.url
    }

    /// The tenant a key belongs to ([`crate::keys::parse`]).
    fn tenant_of(key: &Path) -> Result<String> {
        match crate::keys::parse(key.as_ref()) {
            Some((tenant, _)) => Ok(tenant.to_string()),
            None => Err(StoreError::Placement {
                message: format!("key {key} is not under a tenant"),
                retryable: false,
            }),
        }
    }

    pub fn object_key(tenant: &str, id: &Hash) -> Path {
        crate::keys::object(tenant, id)
    }

    pub fn manifest_key(tenant: &str, id: &Hash) -> Path {
        crate::keys::manifest(tenant, id)
    }

    /// The key `tenant`'s object ids and frame hashes are keyed with (an encrypted tenant's);
    /// `None` for a tenant in clear.
    pub async fn object_id_key(&self, tenant: &str) -> Result<Option<[u8; 32]>> {
        let t = self.target(tenant).await?;
        Ok(t.key.key()?.map(DataKey::object_id_key))
    }

    /// Uploads `data` as a framed, content-addressed object under a fresh random salt: a new
    /// key every time, even for the same data (see [`Store::put_object_salted`]). Returns the
    /// reference and the encoded object.
    pub async fn put_object(&self, tenant: &str, data: &[u8]) -> Result<(ObjectRef, Bytes)> {
        self.put_object_salted(tenant, data.to_vec(), rand::random())
            .await
    }

    /// [`Store::put_object`] with a chosen salt (see [`object::encode_salted`]): writers pick a
    /// fresh random salt per publish or template build, so every upload creates keys that never
    /// existed before and garbage collection can never race a re-upload. The caller hands the
    /// data over: the object is sealed onto it in place (no copy).
    pub async fn put_object_salted(
        &self,
        tenant: &str,
        data: Vec<u8>,
        salt: u32,
    ) -> Result<(ObjectRef, Bytes)> {
        self.put_object_buf(tenant, ObjectBuf::from(data), salt)
            .await
    }

    /// [`Store::put_object_salted`] of an object built in an [`ObjectBuf`]: a local store
    /// writes it from where it is.
    pub async fn put_object_buf(
        &self,
        tenant: &str,
        data: ObjectBuf,
        salt: u32,
    ) -> Result<(ObjectRef, Bytes)> {
        let (data, lead) = data.into_parts();
        let data_len = (data.len() - lead) as u64;
        // Hashing runs on the caller's runtime thread, 1 MiB at a time with a yield between:
        // an 8 MiB object would otherwise hold a worker (and the requests queued on it) for
        // milliseconds. (Blocking threads were slower: on a small node they take the cores
        // the runtime serves requests with.)
        // An encrypted tenant's ids are keyed (object format 2): they name nothing to a reader
        // of the bucket's listing.
        let key = self.object_id_key(tenant).await?;
        let mut sealer = object::Sealer::new_keyed_at(data, lead, key);
        while !sealer.hash_frames(16) {
            tokio::task::yield_now().await;
        }
        let (id, encoded) = sealer.finish(salt);
        // Its buffer goes back to the pool once the last holder of these bytes lets go.
        let encoded = crate::object_buf::pooled(encoded, lead);
        let key = Self::object_key(tenant, &id);
        self.put_verified(&key, encoded.clone()).await?;
        Ok((ObjectRef { id, data_len }, encoded))
    }

    /// Puts immutable bytes; after a failed remote attempt the key is checked (HEAD) before
    /// retrying, so an upload whose reply was lost is recognised rather than assumed.
    async fn put_verified(&self, key: &Path, bytes: Bytes) -> Result<()> {
        let tenant = Self::tenant_of(key)?;
        let t = self.target(&tenant).await?;
        let bytes = seal(t.key.key()?, key, bytes);
        // A local directory: puts go to its one paced writer (see `local_put`), each attempt a
        // fresh staged file that is gone if the attempt failed.
        let local = t.backend.local_root.as_ref().map(|r| r.join(key.as_ref()));
        let inner = t.backend.inner.clone();
        let mut last: Option<StoreError> = None;
        for attempt in 0..3u32 {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(50 << attempt)).await;
                // A remote put whose reply was lost may have landed.
                if local.is_none() {
                    if let Ok(meta) = inner.head(key).await {
                        if meta.size == bytes.len() as u64 {
                            return Ok(());
                        }
                    }
                }
            }
            let res = match &local {
                Some(path) => crate::local_put::put(&tenant, path.clone(), bytes.clone())
                    .await
                    .map_err(|e| object_store::Error::Generic {
                        store: "LocalFileSystem",
                        source: Box::new(e),
                    }),
                None => inner
                    .put(key, PutPayload::from(bytes.clone()))
                    .await
                    .map(drop),
            };
            match res {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(%key, attempt, error = %e, "put failed");
                    let e = StoreError::from(e);
                    if !e.is_retryable() {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| StoreError::Corrupt(format!("put of {key} failed"))))
    }

    /// Stores a manifest under a fresh random salt: a new key every time (see
    /// [`Store::put_object_salted`]).
    pub async fn put_manifest(&self, tenant: &str, m: &Manifest) -> Result<Hash> {
        let bytes = m.encode_salted(rand::random());
        let id = Hash::of(&bytes);
        self.put_verified(&Self::manifest_key(tenant, &id), Bytes::from(bytes))
            .await?;
        Ok(id)
    }

    /// Fetches and verifies a manifest: its bytes must hash to `id` and decode cleanly.
    pub async fn get_manifest(&self, tenant: &str, id: &Hash) -> Result<Manifest> {
        let key = Self::manifest_key(tenant, id);
        let t = self.target(tenant).await?;
        self.placement
            .manifest_gets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let k = t.key.key()?;
        let bytes = t.backend.inner.get(&key).await?.bytes().await?;
        let bytes = open_whole(k, &key, bytes)?;
        if Hash::of(&bytes) != *id {
            return Err(StoreError::Corrupt(format!("manifest {id}: hash mismatch")));
        }
        Manifest::decode(&bytes).map_err(|e| StoreError::Corrupt(format!("manifest {id}: {e}")))
    }

    pub async fn get_range(&self, key: &Path, range: Range<u64>) -> Result<Bytes> {
        let tenant = Self::tenant_of(key)?;
        let t = self.target(&tenant).await?;
        let k = t.key.key()?;
        let got = t.backend.inner.get_range(key, range.clone()).await?;
        match k {
            None => Ok(got),
            Some(k) if DataKey::is_object(key.as_ref()) => {
                let mut v = got.to_vec();
                k.object_xor(key.as_ref(), range.start, &mut v);
                Ok(Bytes::from(v))
            }
            Some(_) => Err(StoreError::Corrupt(format!(
                "{key}: a sealed value is read whole, not by range"
            ))),
        }
    }

    /// Puts a value (relay files) with `opts`, sealed for an encrypted tenant.
    pub async fn put_value_opts(
        &self,
        key: &Path,
        bytes: Bytes,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        let tenant = Self::tenant_of(key)?;
        let t = self.target(&tenant).await?;
        let bytes = seal(t.key.key()?, key, bytes);
        t.backend
            .inner
            .put_opts(key, PutPayload::from(bytes), opts)
            .await
    }

    /// A value's bytes as a stream (relay files): streamed from the store for a clear tenant;
    /// for an encrypted one, opened whole first (a sealed value opens only whole).
    pub async fn get_value_stream(
        &self,
        key: &Path,
    ) -> object_store::Result<futures::stream::BoxStream<'static, object_store::Result<Bytes>>>
    {
        use futures::StreamExt;
        let tenant = Self::tenant_of(key)?;
        let t = self.target(&tenant).await?;
        let get = t.backend.inner.get(key).await?;
        match t.key.key()? {
            None => Ok(get.into_stream()),
            Some(k) => {
                let opened = open_whole(Some(k), key, get.bytes().await?)?;
                Ok(futures::stream::once(async move { Ok(opened) }).boxed())
            }
        }
    }

    /// Gets a whole value (relay files), opened for an encrypted tenant.
    pub async fn get_value(&self, key: &Path) -> object_store::Result<Bytes> {
        let tenant = Self::tenant_of(key)?;
        let t = self.target(&tenant).await?;
        let k = t.key.key()?;
        let bytes = t.backend.inner.get(key).await?.bytes().await?;
        Ok(open_whole(k, key, bytes)?)
    }

    pub async fn exists(&self, key: &Path) -> Result<bool> {
        let inner = self.inner_for(&Self::tenant_of(key)?).await?;
        match inner.head(key).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

/// `bytes` as stored at `key` for a tenant with data key `k`.
fn seal(k: Option<&DataKey>, key: &Path, bytes: Bytes) -> Bytes {
    match k {
        None => bytes,
        Some(k) if DataKey::is_object(key.as_ref()) => {
            let mut v = bytes.to_vec();
            k.object_xor(key.as_ref(), 0, &mut v);
            Bytes::from(v)
        }
        Some(k) => Bytes::from(k.seal_value(key.as_ref(), &bytes)),
    }
}

/// The bytes stored whole at `key`, opened.
fn open_whole(k: Option<&DataKey>, key: &Path, bytes: Bytes) -> Result<Bytes> {
    match k {
        None => Ok(bytes),
        Some(k) if DataKey::is_object(key.as_ref()) => {
            let mut v = bytes.to_vec();
            k.object_xor(key.as_ref(), 0, &mut v);
            Ok(Bytes::from(v))
        }
        Some(k) => Ok(Bytes::from(k.open_value(key.as_ref(), &bytes)?)),
    }
}

impl From<StoreError> for object_store::Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(path) => object_store::Error::NotFound {
                path,
                source: "not found".into(),
            },
            e => object_store::Error::Generic {
                store: "strata",
                source: Box::new(e),
            },
        }
    }
}

/// S3 credentials from a config file (when not taken from the `AWS_*` environment).
#[derive(Clone, Default)]
pub struct Credentials {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
}

fn open_s3(url: &str, rest: &str, creds: &Credentials) -> Result<Arc<dyn ObjectStore>> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey as AmazonConfigKey};
    use object_store::prefix::PrefixStore;
    use object_store::{BackoffConfig, ClientConfigKey, ClientOptions, RetryConfig};
    use std::str::FromStr;
    let bad = |why: &str| StoreError::BadUrl(url.into(), why.into());
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
    if bucket.is_empty() {
        return Err(bad("missing bucket name"));
    }
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(k) = &creds.access_key_id {
        b = b.with_access_key_id(k);
    }
    if let Some(k) = &creds.secret_access_key {
        b = b.with_secret_access_key(k);
    }
    if let Some(k) = &creds.session_token {
        b = b.with_token(k);
    }
    // Transient errors (5xx, throttling, resets, timeouts) are retried with jittered
    // exponential backoff inside object_store; puts are additionally verified by HEAD before
    // being retried by us (see `put_verified`).
    let mut retry = RetryConfig {
        max_retries: 8,
        retry_timeout: std::time::Duration::from_secs(180),
        backoff: BackoffConfig {
            init_backoff: std::time::Duration::from_millis(100),
            max_backoff: std::time::Duration::from_secs(15),
            base: 2.0,
        },
    };
    // Our defaults first: the URL's options below override them key by key.
    b = b.with_client_options(
        ClientOptions::new()
            .with_connect_timeout(std::time::Duration::from_secs(5))
            .with_timeout(std::time::Duration::from_secs(120)),
    );
    // Options are object_store's own S3 configuration keys (`endpoint`, `region`,
    // `allow_http`, `virtual_hosted_style_request`, `checksum_algorithm`, `timeout`, …, with
    // or without `aws_`), checked and parsed by object_store; plus `retries`, `timeout_ms`
    // and `virtual_hosted`, kept from before. Secrets never ride in a URL (it is logged and
    // shown in the nodes view): they come from the config file or the `AWS_*` environment.
    for kv in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| bad("query parameters must be key=value"))?;
        match k {
            "retries" => {
                retry.max_retries = v.parse().map_err(|_| bad("retries must be a number"))?;
                continue;
            }
            "timeout_ms" => {
                let ms: u64 = v.parse().map_err(|_| bad("timeout_ms must be a number"))?;
                b = b.with_config(
                    AmazonConfigKey::Client(ClientConfigKey::Timeout),
                    format!("{}ms", ms.max(1)),
                );
                continue;
            }
            _ => {}
        }
        let key = match k {
            "virtual_hosted" => AmazonConfigKey::VirtualHostedStyleRequest,
            k => AmazonConfigKey::from_str(k).map_err(|_| {
                bad(&format!(
                    "unknown parameter {k:?}: use object_store's S3 configuration keys (endpoint, region, allow_http, virtual_hosted_style_request, …), retries or timeout_ms"
                ))
            })?,
        };
        match key {
            AmazonConfigKey::AccessKeyId
            | AmazonConfigKey::SecretAccessKey
            | AmazonConfigKey::Token => {
                return Err(bad(&format!(
                    "{k:?} is a secret: put it in the config file (s3_*) or the AWS_* environment, not in the store URL"
                )))
            }
            AmazonConfigKey::Encryption(_) if key.as_ref() == "aws_sse_customer_key_base64" => {
                return Err(bad(&format!(
                    "{k:?} is a secret: put it in the AWS_* environment, not in the store URL"
                )))
            }
            AmazonConfigKey::Client(_) if k.contains("proxy") && v.contains('@') => {
                return Err(bad(
                    "a proxy URL with credentials is a secret: use the HTTPS_PROXY environment",
                ))
            }
            AmazonConfigKey::Bucket => {
                return Err(bad("the bucket is the URL's host: s3://BUCKET[/PREFIX]"))
            }
            key => b = b.with_config(key, v),
        }
    }
    let s3 = b
        .with_retry(retry)
        .build()
        .map_err(|e| StoreError::BadUrl(url.into(), e.to_string()))?;
    let prefix = prefix.trim_matches('/');
    Ok(if prefix.is_empty() {
        Arc::new(s3)
    } else {
        Arc::new(PrefixStore::new(s3, prefix))
    })
}

#[cfg(test)]
mod tests;
