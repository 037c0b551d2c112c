//! The engine: one node's catalog, store, node cache and attached volumes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_catalog::{
    Catalog, CatalogError, Checkpoint, CheckpointKind, Mode, NewWorkspace, SqliteCatalog, Workspace,
};
use strata_format::manifest::Manifest;
use strata_format::name;
use strata_store::{NodeCache, ObjectReader, Store};
use tokio::task::JoinHandle;

use crate::fs::{Fs, RealFs};
mod attach;
mod background;
mod detach;
mod fork;
mod hold;
mod templates;

use crate::volume::{Published, Volume, VolumeOptions, VolumeParts};
use crate::{EngineConfig, Error, Result};
use background::{renew_leases, work};

/// Where a new workspace starts.
#[derive(Clone, Debug)]
pub enum Source {
    Template(String),
    /// Another workspace's checkpoint (its head when `version` is `None`).
    Checkpoint {
        workspace: String,
        version: Option<u64>,
    },
    /// An all-zero disk of this many bytes.
    Empty {
        size: u64,
    },
}

struct Attached {
    vol: Arc<Volume>,
    task: JoinHandle<()>,
    /// Attached at a user's request (not only to publish a live fork, or for one call).
    claimed: bool,
    /// Calls running on it that attached it for themselves (see `engine/hold.rs`): it is
    /// detached when the last ends, unless a user claimed it meanwhile.
    holds: u32,
    /// This process's hold on the workspace's lock file (`DATA/locks/TENANT/WS`): another
    /// process on the same data directory shares this node's id, so the lease cannot tell
    /// the two apart; the lock keeps the second from opening the same journal.
    _owner: crate::fs::FileLock,
}

type Key = (String, String);
/// One workspace's attachment on this node. Attach, detach and delete of that workspace hold
/// its slot's lock for their whole run (lease, replay, final publish), so they never interleave
/// (two volumes on one journal), while other workspaces and lookups never wait for them.
type Slot = Arc<tokio::sync::Mutex<Option<Attached>>>;

pub struct Engine {
    cfg: EngineConfig,
    node: String,
    fs: Arc<dyn Fs>,
    catalog: Arc<dyn Catalog>,
    reader: Arc<ObjectReader>,
    slots: std::sync::Mutex<HashMap<Key, Slot>>,
    space: Arc<crate::space::SpaceGuard>,
    /// Each tenant's journal quota on this node (entries are never removed: one per tenant
    /// seen, a few bytes each).
    budgets: std::sync::Mutex<HashMap<String, Arc<crate::space::TenantBudget>>>,
    /// The write rate new budgets get (`u64::MAX`: none); see `set_tenant_write_rate`.
    write_rate: std::sync::atomic::AtomicU64,
    /// Attached volumes, for lookups: changed only by the holder of the workspace's slot.
    live: std::sync::RwLock<HashMap<Key, Arc<Volume>>>,
    /// The node's lease renewal (one catalog call for every attached volume), started at the
    /// first attach.
    renewer: std::sync::OnceLock<JoinHandle<()>>,
}

fn key(tenant: &str, ws: &str) -> Key {
    (tenant.to_string(), ws.to_string())
}

fn node_id(data_dir: &Path) -> Result<String> {
    let p = data_dir.join("node-id");
    if let Ok(s) = std::fs::read_to_string(&p) {
        let s = s.trim().to_string();
        name::validate("node id", &s)?;
        return Ok(s);
    }
    let id = format!("node-{}", &crate::local::new_journal_id()[..12]);
    std::fs::create_dir_all(data_dir).map_err(Error::io("creating data directory"))?;
    // Durably (temp, fsync, rename, fsync directory): a power cut must never leave an empty
    // or missing identity behind a node that already took leases under it (found by the
    // power-loss campaign on strata-lossyfs).
    crate::fs::RealFs
        .write_atomic(&p, id.as_bytes())
        .map_err(Error::io("writing node-id"))?;
    Ok(id)
}

impl Engine {
    /// The embedded default: `catalog.db` (SQLite) and `objects/` (local directory) under the
    /// data directory, plus the node cache and volumes.
    pub async fn open_embedded(cfg: EngineConfig) -> Result<Arc<Engine>> {
        let catalog = SqliteCatalog::open(&cfg.data_dir.join("catalog.db"))?;
        let store = Store::open(&format!("file:{}", cfg.data_dir.join("objects").display()))?;
        Engine::open_with(cfg, Arc::new(catalog), store, Arc::new(RealFs))
    }

    /// An engine over any catalog, store and file layer (tests inject a power-loss file system).
    pub fn open_with(
        cfg: EngineConfig,
        catalog: Arc<dyn Catalog>,
        store: Store,
        fs: Arc<dyn Fs>,
    ) -> Result<Arc<Engine>> {
        if !(1..=crate::config::MAX_SEGMENT_BYTES).contains(&cfg.segment_max_bytes) {
            return Err(Error::Invalid(format!(
                "segment size {} is outside 1..={} bytes",
                cfg.segment_max_bytes,
                crate::config::MAX_SEGMENT_BYTES
            )));
        }
        let node = match &cfg.node_id {
            Some(n) => {
                name::validate("node id", n)?;
                n.clone()
            }
            None => node_id(&cfg.data_dir)?,
        };
        let cache = NodeCache::open(&cfg.data_dir.join("cache"), cfg.cache_capacity)
            .map_err(Error::io("opening node cache"))?;
        // Each tenant's keys go to the store the catalog places it in (read once per tenant):
        // a tenant this node cannot place reaches no store.
        let cat = catalog.clone();
        store.set_resolver(Arc::new(move |tenant: String| {
            let cat = cat.clone();
            Box::pin(async move {
                cat.tenant_placement(&tenant)
                    .await
                    .map(|p| strata_store::Placed {
                        store: p.store,
                        data_key: p.data_key,
                        incarnation: p.created_ms,
                    })
                    .map_err(|e| strata_store::StoreError::Placement {
                        retryable: e.is_retryable(),
                        message: format!("placing tenant {tenant:?}: {e}"),
                    })
            })
        }));
        let reader = Arc::new(ObjectReader::new(store, cache, cfg.fetch_unit));
        reader.set_readahead(cfg.readahead_units);
        let space = Arc::new(crate::space::SpaceGuard::new(
            fs.clone(),
            cfg.data_dir.clone(),
            cfg.min_free_bytes,
        ));
        Ok(Arc::new(Engine {
            cfg,
            node,
            fs,
            catalog,
            reader,
            slots: Default::default(),
            live: Default::default(),
            budgets: Default::default(),
            write_rate: std::sync::atomic::AtomicU64::new(u64::MAX),
            space,
            renewer: Default::default(),
        }))
    }

    pub fn node_id(&self) -> &str {
        &self.node
    }
    pub fn catalog(&self) -> &Arc<dyn Catalog> {
        &self.catalog
    }
    pub fn reader(&self) -> &Arc<ObjectReader> {
        &self.reader
    }
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    fn volume_dir(&self, tenant: &str, ws: &str) -> PathBuf {
        self.cfg.data_dir.join("volumes").join(tenant).join(ws)
    }

    fn opts(&self) -> VolumeOptions {
        VolumeOptions {
            upload_interval: self.cfg.upload_interval,
            upload_max_bytes: self.cfg.upload_max_bytes,
            segment_max_bytes: self.cfg.segment_max_bytes,
            object_target_bytes: self.cfg.object_target_bytes,
            lease_ttl: self.cfg.lease_ttl,
            cache_unsafe: self.cfg.cache_unsafe,
            publish_deadline: self.cfg.gc_grace / 2,
        }
    }

    fn spawn_background(self: &Arc<Self>, vol: &Arc<Volume>) -> JoinHandle<()> {
        self.renewer
            .get_or_init(|| tokio::spawn(renew_leases(Arc::downgrade(self), self.cfg.lease_ttl)));
        // Everything the volume's background work logs carries its tenant and workspace (a
        // warn-level span: enabled under the default filter, where the warnings are). A root
        // span: a caller's request span must not follow the volume's work for its lifetime.
        let span = tracing::warn_span!(parent: None, "volume", tenant = %vol.tenant(), workspace = %vol.name());
        tokio::spawn(tracing::Instrument::instrument(
            work(
                Arc::downgrade(vol),
                self.cfg.upload_interval,
                self.cfg.segment_max_bytes,
            ),
            span,
        ))
    }

    /// Admits `bytes` of new local data against the node's free-space floor (see `space.rs`):
    /// for callers that write to the data disk on a tenant's behalf (template uploads).
    pub fn admit_local(&self, bytes: u64) -> Result<()> {
        self.space.admit(bytes)
    }

    /// Creates the tenant if it does not exist.
    /// The tenant's journal budget on this node.
    pub(crate) fn budget(&self, tenant: &str) -> Arc<crate::space::TenantBudget> {
        self.budgets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.to_string())
            .or_insert_with(|| {
                let b = crate::space::TenantBudget::default();
                let rate = self.write_rate.load(std::sync::atomic::Ordering::Relaxed);
                b.set_rate((rate != u64::MAX).then_some(rate));
                Arc::new(b)
            })
            .clone()
    }

    /// Every tenant's write rate on this node (bytes a second; `None`: unlimited): guest
    /// writes, and what [`Engine::pace`] is told of (relay files, template uploads).
    pub fn set_tenant_write_rate(&self, rate: Option<u64>) {
        let r = rate.filter(|r| *r > 0).unwrap_or(u64::MAX);
        self.write_rate
            .store(r, std::sync::atomic::Ordering::Relaxed);
        for b in self
            .budgets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            b.set_rate(rate);
        }
    }

    /// Charges `bytes` a tenant is writing into this node to its write rate; how long to wait
    /// first (see `TenantBudget::pace`).
    pub fn pace(&self, tenant: &str, bytes: u64) -> Option<std::time::Duration> {
        self.budget(tenant).pace(bytes)
    }

    /// Forgets a deleted tenant's budget on this node.
    pub fn forget_tenant_budget(&self, tenant: &str) {
        self.budgets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(tenant);
    }

    /// Sets the tenant's `local_journal_bytes` quota on this node now (attaches read it from
    /// the catalog too).
    pub fn set_local_journal_quota(&self, tenant: &str, limit: Option<u64>) {
        self.budget(tenant).set_limit(limit);
    }

    /// Journal bytes the tenant's attached workspaces hold on this node, and its quota.
    pub fn local_journal_usage(&self, tenant: &str) -> (u64, Option<u64>) {
        let b = self.budget(tenant);
        (b.used(), b.limit())
    }

    pub async fn ensure_tenant(&self, tenant: &str) -> Result<()> {
        name::validate("tenant name", tenant)?;
        match self.catalog.create_tenant(tenant).await {
            Ok(()) | Err(CatalogError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn create_workspace(
        &self,
        tenant: &str,
        ws: &str,
        source: Source,
        mode: Mode,
        ttl: Option<Duration>,
    ) -> Result<Workspace> {
        name::validate("workspace name", ws)?;
        if ttl.is_some() && mode != Mode::Ephemeral {
            return Err(Error::Invalid(
                "a TTL applies to ephemeral workspaces only: durable and sync workspaces are never deleted behind your back".into(),
            ));
        }
        let (manifest, disk_size, source, kind) = match source {
            Source::Template(t) => {
                let t = self.catalog.get_template(tenant, &t).await?;
                (
                    t.manifest,
                    t.disk_size,
                    format!("template:{}", t.name),
                    CheckpointKind::Create,
                )
            }
            Source::Checkpoint { workspace, version } => {
                let (cp, _) = self.resolve_checkpoint(tenant, &workspace, version).await?;
                // That version's size: the source may have grown since.
                let m = self
                    .reader
                    .store()
                    .get_manifest(tenant, &cp.manifest)
                    .await?;
                (
                    cp.manifest,
                    m.disk_size,
                    format!("ws:{workspace}@{}", cp.version),
                    CheckpointKind::Fork,
                )
            }
            Source::Empty { size } => {
                let m = Manifest::empty(
                    size.div_ceil(strata_format::BLOCK_SIZE) * strata_format::BLOCK_SIZE,
                )?;
                let id = self.reader.store().put_manifest(tenant, &m).await?;
                self.catalog.record_manifest(tenant, id, &[]).await?;
                (id, m.disk_size, "empty".to_string(), CheckpointKind::Create)
            }
        };
        Ok(self
            .catalog
            .create_workspace(&NewWorkspace {
                tenant: tenant.into(),
                name: ws.into(),
                mode,
                disk_size,
                manifest,
                source,
                kind,
                ttl_ms: ttl.map(|d| d.as_millis() as u64),
            })
            .await?)
    }

    async fn resolve_checkpoint(
        &self,
        tenant: &str,
        ws: &str,
        version: Option<u64>,
    ) -> Result<(Checkpoint, Workspace)> {
        let w = self.catalog.get_workspace(tenant, ws).await?;
        let cp = self
            .catalog
            .get_checkpoint(tenant, ws, version.unwrap_or(w.head_version))
            .await?;
        if cp.kind == CheckpointKind::LiveFork {
            // Only the base under data that was in the forking node's journal: never a disk.
            return Err(Error::Unavailable(
                ws.to_string(),
                format!(
                    "version {} is the start of a fork of a live workspace, not its data; {}",
                    cp.version,
                    if w.head_version > cp.version {
                        "use a later version"
                    } else {
                        "it is available once the fork has published (on the node that forked it)"
                    }
                ),
            ));
        }
        Ok((cp, w))
    }

    fn slot(&self, k: &Key) -> Slot {
        let mut m = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(k.clone()).or_default().clone()
    }

    /// Forgets a workspace's slot once nobody holds or waits for it and it is empty.
    fn tidy_slot(&self, k: &Key, slot: Slot) {
        drop(slot);
        let mut m = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let idle = m
            .get(k)
            .is_some_and(|s| Arc::strong_count(s) == 1 && s.try_lock().is_ok_and(|g| g.is_none()));
        if idle {
            m.remove(k);
        }
    }

    fn set_live(&self, k: &Key, vol: Option<Arc<Volume>>) {
        let mut m = self.live.write().unwrap_or_else(|p| p.into_inner());
        match vol {
            Some(v) => m.insert(k.clone(), v),
            None => m.remove(k),
        };
    }

    /// Runs `f` in a task of its own and waits for it: attach, detach and delete complete (or
    /// fail) as a whole even when the caller goes away (an HTTP client that disconnects), so a
    /// workspace is never left half attached or half detached.
    async fn in_own_task<T, Fut>(self: &Arc<Self>, f: impl FnOnce(Arc<Engine>) -> Fut) -> Result<T>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        tokio::spawn(f(self.clone()))
            .await
            .map_err(|e| Error::Invalid(format!("engine task failed: {e}")))?
    }

    /// Checkpoints everything acknowledged so far, with an optional label, and waits until it
    /// is published.
    pub async fn checkpoint(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        label: Option<String>,
    ) -> Result<Published> {
        self.checkpoint_with(tenant, ws, label, None, true).await
    }

    /// Compacts the workspace's head (see [`Volume::compact`]); attaches it for the duration if
    /// it is not attached here.
    pub async fn compact(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        threshold: f64,
    ) -> Result<Option<Published>> {
        if !(0.0..=1.0).contains(&threshold) {
            return Err(Error::Invalid(format!(
                "compaction threshold {threshold} is not between 0 and 1"
            )));
        }
        self.with_volume(tenant, ws, async |v| v.compact(threshold).await)
            .await
    }

    /// A checkpoint that retention keeps at least until `keep_until_ms`. Of a workspace
    /// attached here, without `wait`: returned once its cut is durable on this node (a `local`
    /// receipt; see [`Volume::checkpoint_with`]). A workspace attached for the call is
    /// published before it is detached again.
    pub async fn checkpoint_with(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        label: Option<String>,
        keep_until_ms: Option<u64>,
        wait: bool,
    ) -> Result<Published> {
        if let Some(l) = &label {
            name::validate_label(l)?;
        }
        let attached = self.volume(tenant, ws).is_some();
        self.with_volume(tenant, ws, async |v| {
            v.checkpoint_with(label, keep_until_ms, wait || !attached)
                .await
        })
        .await
    }

    /// Grows the workspace's disk to `size` bytes (see [`Volume::grow`]); attaches it for the
    /// call if it is not attached here. Returns the disk's size afterwards.
    pub async fn grow(self: &Arc<Self>, tenant: &str, ws: &str, size: u64) -> Result<u64> {
        self.with_volume(tenant, ws, async |v| {
            v.grow(size).await?;
            Ok(v.size())
        })
        .await
    }

    /// Rolls back to `version` as a new head version; the current state is kept in history.
    pub async fn rollback(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        version: u64,
    ) -> Result<Published> {
        self.rollback_with(tenant, ws, version, false).await
    }

    /// Rolls back to `version`: at once (a `local` receipt) when it is still local on this node,
    /// unless `wait` or the workspace is in sync mode (then once published).
    pub async fn rollback_with(
        self: &Arc<Self>,
        tenant: &str,
        ws: &str,
        version: u64,
        wait: bool,
    ) -> Result<Published> {
        // Waiting (or sync mode): publish first, then move the head, so that an error means
        // nothing changed.
        self.with_volume(tenant, ws, async |v| {
            v.rollback(version, !wait && v.mode() != Mode::Sync).await
        })
        .await
    }

    /// Forks `src` (at `version`, or its current state) into a new workspace. O(1): no data is
    /// copied. Forking a workspace attached here without a version is a live fork (see
    /// `engine/fork.rs`): a local checkpoint, whose journal the fork shares; it holds every
    /// write acknowledged before the call and is usable at once on this node.
    pub async fn fork(
        self: &Arc<Self>,
        tenant: &str,
        src: &str,
        version: Option<u64>,
        new: &str,
        mode: Option<Mode>,
    ) -> Result<Workspace> {
        let mode = match mode {
            Some(m) => m,
            None => self.catalog.get_workspace(tenant, src).await?.mode,
        };
        let version = match (version, self.volume(tenant, src)) {
            (None, Some(v)) => match self.fork_live(tenant, v.clone(), src, new, mode).await? {
                Ok(w) => return Ok(w),
                // Not here (no hard links, a grow being published): once it is published.
                Err(local) => Some(v.published(local).await?.version),
            },
            // A local checkpoint of this node: forked once it is published.
            (Some(n), Some(v)) => Some(v.published(n).await?.version),
            (v, _) => v,
        };
        self.create_workspace(
            tenant,
            new,
            Source::Checkpoint {
                workspace: src.into(),
                version,
            },
            mode,
            None,
        )
        .await
    }

    pub async fn workspace(&self, tenant: &str, ws: &str) -> Result<Workspace> {
        Ok(self.catalog.get_workspace(tenant, ws).await?)
    }
    pub async fn list_workspaces(&self, tenant: &str) -> Result<Vec<Workspace>> {
        Ok(self.catalog.list_workspaces(tenant).await?)
    }
    pub async fn log(&self, tenant: &str, ws: &str) -> Result<Vec<Checkpoint>> {
        Ok(self.catalog.list_checkpoints(tenant, ws).await?)
    }

    /// Reads a whole checkpoint (the head by default) straight from the object store into a
    /// raw file, without attaching: what another node restoring it would see.
    pub async fn export(
        &self,
        tenant: &str,
        ws: &str,
        version: Option<u64>,
        out: &Path,
    ) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let (cp, _) = self.resolve_checkpoint(tenant, ws, version).await?;
        let m = self
            .reader
            .store()
            .get_manifest(tenant, &cp.manifest)
            .await?;
        let f =
            std::fs::File::create(out).map_err(Error::io(format!("creating {}", out.display())))?;
        f.set_len(m.disk_size).map_err(Error::io("sizing export"))?;
        for e in &m.extents {
            let o = m.objects[e.object as usize];
            let mut buf = vec![0u8; e.len as usize * strata_format::BLOCK_SIZE as usize];
            self.reader
                .read_ahead(tenant, &o, e.offset, buf.len() as u64);
            self.reader
                .read_into(tenant, &o, e.offset, &mut buf)
                .await?;
            f.write_all_at(&buf, e.lba * strata_format::BLOCK_SIZE)
                .map_err(Error::io("writing export"))?;
        }
        f.sync_all().map_err(Error::io("syncing export"))?;
        Ok(m.disk_size)
    }
}

/// Per-volume background work: lease renewal and window-bounded uploads, as two independent
/// loops so a slow upload can never delay a renewal past the lease's local deadline.
/// Runs blocking work (tools, file-tree walks) off the runtime's workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Invalid(format!("blocking task failed: {e}")))?
}

/// A fresh private (0700) directory under `DATA/tmp`.
pub fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let root = dir.join("tmp");
    std::fs::create_dir_all(&root).map_err(Error::io("creating temp directory"))?;
    let p = root.join(crate::local::new_journal_id());
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&p)
        .map_err(Error::io("creating temp directory"))?;
    Ok(p)
}
