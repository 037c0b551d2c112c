//! Fault-injecting wrappers around the real things, for faults a real peer cannot be made to
//! produce on demand: a full disk, a directory fsync that fails, a read that stalls at the
//! wrong moment, a catalog whose reply is lost after it committed.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};

use async_trait::async_trait;
use strata_catalog::*;
use strata_engine::fs::{Fs, FsFile, RealFs};
use strata_format::manifest::ObjectRef;
use strata_format::Hash;

/// Switches shared by a [`FaultFs`] and the files it opened.
#[derive(Default)]
pub struct Switches {
    /// Every write and every file creation fails with ENOSPC.
    pub full: AtomicBool,
    /// Writes past a file's first block (records, not segment headers) fail with ENOSPC: the
    /// last free block went to a new segment's header.
    pub full_after_header: AtomicBool,
    /// The next directory fsync fails with EIO.
    pub fail_sync_dir: AtomicBool,
    pub sync_dirs: AtomicU64,
    /// The next read of a journal segment (`.seg`) blocks until [`Switches::release`].
    pub stall_next_read: AtomicBool,
    /// The next write to a journal segment stalls until `release`, then fails (EIO).
    pub stall_then_fail_next_write: AtomicBool,
    /// The next write to a journal segment stalls until `release`, then goes through.
    pub stall_next_write: AtomicBool,
    /// Writes to a spare segment being zero-filled (`.prep`) fail with ENOSPC.
    pub full_for_spares: AtomicBool,
    /// The next fsync of a journal segment panics.
    pub panic_next_sync: AtomicBool,
    /// The next fsync of a journal segment stalls until `release`, then fails (EIO).
    pub stall_then_fail_next_sync: AtomicBool,
    /// The next write to a journal segment longer than this many bytes writes only its first
    /// this many, then fails with ENOSPC (a short write on a full disk); 0: off.
    pub short_next_write: AtomicU64,
    /// Say the file system overwrites in place (records may then be written outside the
    /// journal's lock). Off by default: the injected ENOSPC of `full` fails overwrites too.
    pub in_place: AtomicBool,
    stalled: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Switches {
    /// Waits until a read is stalled.
    pub fn wait_stalled(&self) {
        let mut g = self.stalled.lock().unwrap();
        while !g.0 {
            g = self.cv.wait(g).unwrap();
        }
    }
    pub fn release(&self) {
        self.stalled.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
    fn stall(&self) {
        let mut g = self.stalled.lock().unwrap();
        g.0 = true;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap();
        }
    }
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

/// [`RealFs`] with switches.
pub struct FaultFs(pub Arc<Switches>);

struct FaultFile {
    inner: Arc<dyn FsFile>,
    segment: bool,
    spare: bool,
    sw: Arc<Switches>,
}

impl FsFile for FaultFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if self.segment && self.sw.stall_then_fail_next_write.swap(false, SeqCst) {
            self.sw.stall();
            return Err(io::Error::from_raw_os_error(5));
        }
        if self.segment && self.sw.stall_next_write.swap(false, SeqCst) {
            self.sw.stall();
        }
        let short = self.sw.short_next_write.load(SeqCst) as usize;
        if self.segment
            && short > 0
            && buf.len() > short
            && self.sw.short_next_write.swap(0, SeqCst) > 0
        {
            self.inner.write_at(&buf[..short], off)?;
            return Err(enospc());
        }
        if self.sw.full.load(SeqCst)
            || (off > 0 && self.sw.full_after_header.load(SeqCst))
            || (self.spare && self.sw.full_for_spares.load(SeqCst))
        {
            return Err(enospc());
        }
        self.inner.write_at(buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if self.segment && self.sw.stall_next_read.swap(false, SeqCst) {
            self.sw.stall();
        }
        self.inner.read_at(buf, off)
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.segment && self.sw.panic_next_sync.swap(false, SeqCst) {
            panic!("injected panic in fsync");
        }
        if self.segment && self.sw.stall_then_fail_next_sync.swap(false, SeqCst) {
            self.sw.stall();
            return Err(io::Error::from_raw_os_error(5));
        }
        self.inner.sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn links(&self) -> io::Result<u64> {
        self.inner.links()
    }
}

impl Fs for FaultFs {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn FsFile>> {
        if create && self.0.full.load(SeqCst) && !path.exists() {
            return Err(enospc());
        }
        Ok(Arc::new(FaultFile {
            inner: RealFs.open(path, create)?,
            segment: path.extension().is_some_and(|e| e == "seg"),
            spare: path.extension().is_some_and(|e| e == "prep"),
            sw: self.0.clone(),
        }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        RealFs.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.0.sync_dirs.fetch_add(1, SeqCst);
        if self.0.fail_sync_dir.swap(false, SeqCst) {
            return Err(io::Error::other("injected directory fsync failure"));
        }
        RealFs.sync_dir(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        RealFs.exists(path)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.remove_dir_all(dir)
    }
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.hard_link(from, to)
    }
    fn lock_exclusive(
        &self,
        path: &Path,
    ) -> io::Result<Result<strata_engine::fs::FileLock, String>> {
        RealFs.lock_exclusive(path)
    }
    fn overwrites_in_place(&self, _dir: &Path) -> bool {
        self.0.in_place.load(SeqCst)
    }
}

/// A real catalog whose next head CAS commits and then reports a backend error (the reply was
/// lost); with `blind`, reading the workspace fails as well until cleared.
pub struct LossyCatalog {
    pub inner: Arc<dyn Catalog>,
    pub lose_next_cas_reply: AtomicBool,
    pub blind: AtomicBool,
    /// Every head CAS fails without committing (the catalog is unreachable for it).
    pub refuse_cas: AtomicBool,
    /// Recording a new manifest fails (a publish fails before its head CAS).
    pub refuse_manifests: AtomicBool,
    /// Lease renewal calls: single, batched, and leases in all batches.
    pub single_renewals: AtomicU64,
    pub batch_renewals: AtomicU64,
    pub batched_leases: AtomicU64,
}

impl LossyCatalog {
    pub fn new(inner: Arc<dyn Catalog>) -> Arc<LossyCatalog> {
        Arc::new(LossyCatalog {
            inner,
            lose_next_cas_reply: AtomicBool::new(false),
            blind: AtomicBool::new(false),
            refuse_cas: AtomicBool::new(false),
            refuse_manifests: AtomicBool::new(false),
            single_renewals: AtomicU64::new(0),
            batch_renewals: AtomicU64::new(0),
            batched_leases: AtomicU64::new(0),
        })
    }
}

#[async_trait]
impl Catalog for LossyCatalog {
    async fn advance_head(
        &self,
        tenant: &str,
        workspace: &str,
        expected: u64,
        lease: &LeaseGrant,
        cp: &NewCheckpoint,
    ) -> Result<u64> {
        if self.refuse_cas.load(SeqCst) {
            return Err(CatalogError::unavailable("catalog unreachable"));
        }
        let r = self
            .inner
            .advance_head(tenant, workspace, expected, lease, cp)
            .await;
        if r.is_ok() && self.lose_next_cas_reply.swap(false, SeqCst) {
            return Err(CatalogError::unavailable("connection reset (reply lost)"));
        }
        r
    }
    async fn get_workspace(&self, tenant: &str, name: &str) -> Result<Workspace> {
        if self.blind.load(SeqCst) {
            return Err(CatalogError::unavailable("catalog unreachable"));
        }
        self.inner.get_workspace(tenant, name).await
    }
    async fn create_tenant_placed(
        &self,
        tenant: &str,
        store: Option<&str>,
        data_key: Option<&str>,
    ) -> Result<()> {
        self.inner
            .create_tenant_placed(tenant, store, data_key)
            .await
    }
    async fn tenant_placement(&self, tenant: &str) -> Result<strata_catalog::TenantPlacement> {
        self.inner.tenant_placement(tenant).await
    }
    async fn shred_data_key(&self, tenant: &str) -> Result<()> {
        self.inner.shred_data_key(tenant).await
    }
    async fn tenant_exists(&self, tenant: &str) -> Result<bool> {
        self.inner.tenant_exists(tenant).await
    }
    async fn add_token(&self, t: &NewToken) -> Result<TokenInfo> {
        self.inner.add_token(t).await
    }
    async fn list_tokens(&self, tenant: &str) -> Result<Vec<TokenInfo>> {
        self.inner.list_tokens(tenant).await
    }
    async fn revoke_token(&self, tenant: &str, id: &str) -> Result<TokenInfo> {
        self.inner.revoke_token(tenant, id).await
    }
    async fn get_tenant(&self, tenant: &str) -> Result<TenantInfo> {
        self.inner.get_tenant(tenant).await
    }
    async fn store_usage(&self, tenant: &str) -> Result<StoreUsage> {
        self.inner.store_usage(tenant).await
    }
    async fn meter_usage(&self, tenant: &str, live_bytes: u64) -> Result<Meter> {
        self.inner.meter_usage(tenant, live_bytes).await
    }
    async fn set_quotas(&self, tenant: &str, q: &Quotas) -> Result<()> {
        self.inner.set_quotas(tenant, q).await
    }
    async fn begin_tenant_delete(&self, tenant: &str) -> Result<()> {
        self.inner.begin_tenant_delete(tenant).await
    }
    async fn purge_tenant(&self, tenant: &str) -> Result<()> {
        self.inner.purge_tenant(tenant).await
    }
    async fn token_info(&self, hash: &str) -> Result<Option<TokenInfo>> {
        self.inner.token_info(hash).await
    }
    async fn create_stream(&self, s: &RelayStream) -> Result<()> {
        self.inner.create_stream(s).await
    }
    async fn get_stream(&self, tenant: &str, name: &str) -> Result<RelayStream> {
        self.inner.get_stream(tenant, name).await
    }
    async fn list_streams(&self, tenant: &str) -> Result<Vec<RelayStream>> {
        self.inner.list_streams(tenant).await
    }
    async fn record_manifest(&self, t: &str, m: Hash, objects: &[ObjectRef]) -> Result<()> {
        if self.refuse_manifests.load(SeqCst) {
            return Err(CatalogError::unavailable("catalog unreachable"));
        }
        self.inner.record_manifest(t, m, objects).await
    }
    async fn create_template(&self, t: &Template) -> Result<()> {
        self.inner.create_template(t).await
    }
    async fn get_template(&self, tenant: &str, name: &str) -> Result<Template> {
        self.inner.get_template(tenant, name).await
    }
    async fn list_templates(&self, tenant: &str) -> Result<Vec<Template>> {
        self.inner.list_templates(tenant).await
    }
    async fn delete_template(&self, tenant: &str, name: &str) -> Result<()> {
        self.inner.delete_template(tenant, name).await
    }
    async fn create_workspace(&self, w: &NewWorkspace) -> Result<Workspace> {
        self.inner.create_workspace(w).await
    }
    async fn list_workspaces(&self, tenant: &str) -> Result<Vec<Workspace>> {
        self.inner.list_workspaces(tenant).await
    }
    async fn list_expired(&self, now_ms: u64) -> Result<Vec<(String, String)>> {
        self.inner.list_expired(now_ms).await
    }
    async fn delete_workspace(&self, tenant: &str, name: &str) -> Result<()> {
        self.inner.delete_workspace(tenant, name).await
    }
    async fn list_checkpoints(&self, tenant: &str, ws: &str) -> Result<Vec<Checkpoint>> {
        self.inner.list_checkpoints(tenant, ws).await
    }
    async fn get_checkpoint(&self, tenant: &str, ws: &str, version: u64) -> Result<Checkpoint> {
        self.inner.get_checkpoint(tenant, ws, version).await
    }
    async fn acquire_lease(&self, t: &str, ws: &str, node: &str, ttl: u64) -> Result<LeaseGrant> {
        self.inner.acquire_lease(t, ws, node, ttl).await
    }
    async fn renew_lease(&self, t: &str, ws: &str, l: &LeaseGrant, ttl: u64) -> Result<()> {
        self.single_renewals.fetch_add(1, SeqCst);
        self.inner.renew_lease(t, ws, l, ttl).await
    }
    async fn renew_leases(&self, l: &[LeaseRenewal], ttl: u64) -> Result<Vec<Result<()>>> {
        self.batch_renewals.fetch_add(1, SeqCst);
        self.batched_leases.fetch_add(l.len() as u64, SeqCst);
        self.inner.renew_leases(l, ttl).await
    }
    async fn release_lease(&self, t: &str, ws: &str, l: &LeaseGrant) -> Result<()> {
        self.inner.release_lease(t, ws, l).await
    }
    async fn get_lease(&self, tenant: &str, ws: &str) -> Result<Lease> {
        self.inner.get_lease(tenant, ws).await
    }
    async fn list_tenants(&self) -> Result<Vec<String>> {
        self.inner.list_tenants().await
    }
    async fn expire_checkpoints(&self, t: &str, ws: &str, versions: &[u64]) -> Result<u64> {
        self.inner.expire_checkpoints(t, ws, versions).await
    }
    async fn gc_references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>> {
        self.inner.gc_references(tenant, grace_ms).await
    }
    async fn gc_mark(&self, tenant: &str, grace_ms: u64) -> Result<GcMark> {
        self.inner.gc_mark(tenant, grace_ms).await
    }
    async fn compaction_candidates(
        &self,
        tenant: &str,
        idle_before_ms: u64,
        all: bool,
    ) -> Result<Vec<(String, Hash)>> {
        self.inner
            .compaction_candidates(tenant, idle_before_ms, all)
            .await
    }

    async fn compaction_judged(&self, tenant: &str, workspace: &str, manifest: Hash) -> Result<()> {
        self.inner
            .compaction_judged(tenant, workspace, manifest)
            .await
    }

    async fn purge_expired_checkpoints(&self, tenant: &str, grace_ms: u64) -> Result<u64> {
        self.inner.purge_expired_checkpoints(tenant, grace_ms).await
    }
    async fn gc_changes(
        &self,
        tenant: &str,
        grace_ms: u64,
        after_seq: i64,
        limit: usize,
    ) -> Result<GcChanges> {
        self.inner
            .gc_changes(tenant, grace_ms, after_seq, limit)
            .await
    }
    async fn gc_settle(&self, tenant: &str, seqs: &[i64]) -> Result<()> {
        self.inner.gc_settle(tenant, seqs).await
    }
    async fn gc_live(&self, t: &str, ms: &[Hash], os: &[Hash]) -> Result<GcLive> {
        self.inner.gc_live(t, ms, os).await
    }
    async fn retention_due(&self, t: &str, now: u64, all: bool) -> Result<Vec<RetentionDue>> {
        self.inner.retention_due(t, now, all).await
    }
    async fn retention_done(&self, t: &str, ws: &str, seen: u64, next: u64) -> Result<bool> {
        self.inner.retention_done(t, ws, seen, next).await
    }
    async fn gc_condemn(&self, tenant: &str, keys: &[String]) -> Result<()> {
        self.inner.gc_condemn(tenant, keys).await
    }
    async fn gc_condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>> {
        self.inner.gc_condemned(tenant).await
    }
    async fn gc_forget(&self, tenant: &str, keys: &[String]) -> Result<()> {
        self.inner.gc_forget(tenant, keys).await
    }
    async fn prune_references(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64> {
        self.inner
            .prune_references(tenant, manifests, objects)
            .await
    }
    async fn recorded_references(&self, tenant: &str) -> Result<(u64, u64)> {
        self.inner.recorded_references(tenant).await
    }
    async fn report_node(&self, status: &NodeStatus) -> Result<()> {
        self.inner.report_node(status).await
    }
    async fn list_nodes(&self) -> Result<Vec<NodeStatus>> {
        self.inner.list_nodes().await
    }
}
