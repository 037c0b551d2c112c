//! Retention and garbage collection.
//!
//! The catalog is the durable graph of what is live: workspace heads, checkpoints and templates
//! name manifests, manifests name objects. An ordinary pass costs what changed since the pass
//! before it (issue 46): it looks at the catalog's change log and the workspaces that changed,
//! never at everything retained, and makes no store request unless it deletes. A pass first
//! compacts sparse heads (workspaces attached here, and those detached everywhere for a while
//! whose lease was released since GC last looked; see [`GcOptions::compact_detached_after`]),
//! then, per tenant:
//!
//! 1. **Retention** expires checkpoints by policy (never a head; labelled ones only by their
//!    own `keep_until`; unlabelled ones a user made beyond the newest `keep_last`, automatic
//!    ones (see [`is_automatic`]) beyond the newest `keep_auto`, either older than `max_age`),
//!    of the workspaces whose checkpoints changed since retention last looked (a catalog
//!    trigger bumps a generation) or whose next expiry by time has come (recorded when it
//!    looked: [`retention_next`]). Expiry is soft: the rows vanish from listings at once but
//!    keep their manifests referenced for `grace`, so an operation that read one just before
//!    (a fork, a rollback) still completes safely; then the pass purges them.
//! 2. **Mark**: every referenced manifest's objects are live, from the catalog's record of the
//!    reference graph (`record_manifest`, written in one transaction before any head,
//!    checkpoint or template names the manifest), never by reading manifests; only a manifest
//!    the catalog has no record of is fetched from the store (an unreadable one aborts the
//!    tenant's pass: nothing is deleted on incomplete information). An ordinary pass judges
//!    only the manifests in the catalog's change log (`gc_log`, written by triggers in the
//!    transactions that drop a reference, record a manifest, or reference one without a
//!    record): an unreferenced one recorded more than `grace` ago is stale, and so are its
//!    objects no referenced manifest links. A reconciliation pass (`GcOptions::reconcile`)
//!    marks everything in one query instead.
//! 3. **Sweep, in two phases.** Store keys that are unreferenced are *condemned* in the
//!    catalog: the stale records the mark found, and in a reconciliation pass the keys a
//!    listing of the store finds unreferenced and older than `grace` by the store's clock
//!    (keys the catalog never knew). Then the log rows the mark judged are settled. A key is
//!    deleted only by a later pass that finds it condemned for at least `grace`, still
//!    unreferenced by its re-mark (one probe per condemned key), and last written more than
//!    `grace` ago by the store's clock (its listing, or a HEAD). A key that became referenced
//!    again, or was written again, is forgotten. Before a key is deleted, the catalog's rows
//!    for it (`record_manifest`'s manifests, links and objects) are pruned, so the catalog's
//!    record of the reference graph stays the size of what is live.
//!
//! Why that is safe under concurrent checkpoints, forks, restores and uploads:
//! - Every upload creates keys that never existed (objects and manifests carry a random salt),
//!   so a re-upload can race a delete of the same key only if a salt is drawn twice for the
//!   same content; the store-clock check before a delete covers that case too;
//! - a publish whose uploads began more than `grace / 2` ago gives up before moving the head,
//!   so fresh unreferenced objects are never older than the grace period when referenced;
//! - new references to existing manifests (fork, rollback, create from template) are made in a
//!   catalog transaction from a row that was live when read; the two-phase sweep re-marks after
//!   `grace`, which bounds how long such an operation may take;
//! - several nodes may run passes at once: each condemnation is valid on its own, deletes are
//!   idempotent, and every pass re-marks before deleting;
//! - the log misses nothing the full mark would find: every way a manifest stops being
//!   referenced is a row change a trigger sees, in the same transaction; what it cannot see
//!   (keys the catalog never knew, an object left without links) is the reconciliation's.
//!
//! A pass interrupted at any step leaves only condemned entries and deletions of keys that were
//! unreferenced twice `grace` apart, and log rows not yet settled; the next pass continues.
//! `stop_after` stops a pass after a number of mutating steps (crash tests).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::ObjectStoreExt;
use std::sync::Arc;

use strata_format::Hash;

mod report;
mod retention;
pub use report::{GcReport, TenantFailure};
pub use retention::{expired_versions, is_automatic, retention_next};

use crate::{Engine, Error, Result};

#[derive(Clone, Debug)]
pub struct GcOptions {
    pub grace: Duration,
    /// Unlabelled versions a user made (checkpoints, rollbacks, forks, ...) kept per workspace
    /// besides the head.
    pub keep_last: usize,
    /// Automatic versions (background and sync-mode publishes, detaches, compactions) kept per
    /// workspace besides the head: each pins the data written over since, so they are not
    /// restore points unless a node asks for them.
    pub keep_auto: usize,
    pub max_age: Duration,
    /// Report only: expire nothing, condemn nothing, delete nothing.
    pub dry_run: bool,
    /// Also list every tenant's keys in the store, to find what the catalog does not know
    /// (uploads whose publish failed before recording them, keys whose delete failed), and
    /// sweep local stores' staged files. A pass without it makes no listing: its cost follows
    /// what changed. The daemon reconciles on its first periodic pass and then once
    /// [`RECONCILE_AFTER`] has passed since the last reconciliation.
    pub reconcile: bool,
    /// Stop after this many mutating steps (tests of an interrupted pass).
    pub stop_after: Option<usize>,
    /// Compact the volumes attached on this node whose head objects are less live than this
    /// fraction (before retention, so the old objects are released by the same passes).
    pub compact_below: Option<f64>,
    /// Also compact workspaces detached everywhere (lease released after a clean detach) for
    /// at least this long (measured from its head's creation), attaching each on this node for
    /// the rewrite (`None`: only attached ones). Never a workspace whose lease is held or only
    /// expired: a node that crashed may still replay its journal onto the head, which must not
    /// move under it.
    pub compact_detached_after: Option<Duration>,
}

/// The daemon's periodic GC reconciles (lists the store) on its first pass, then on the first
/// pass at least this long after the last reconciliation: once a day, whatever the interval.
pub const RECONCILE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How long a workspace stays detached before GC compacts it (a sandbox paused for a moment is
/// likely resumed soon; an attach on another node during the compaction gets a lease conflict).
pub const COMPACT_DETACHED_AFTER: Duration = Duration::from_secs(600);

impl GcOptions {
    /// A pass with a node's configured grace, retention and compaction settings.
    pub fn from_config(cfg: &crate::EngineConfig, dry_run: bool, reconcile: bool) -> GcOptions {
        GcOptions {
            reconcile,
            grace: cfg.gc_grace,
            keep_last: cfg.keep_checkpoints,
            keep_auto: cfg.keep_auto_versions,
            max_age: cfg.keep_checkpoint_age,
            dry_run,
            stop_after: None,
            compact_below: Some(cfg.compact_below),
            compact_detached_after: Some(COMPACT_DETACHED_AFTER),
        }
    }
}

struct Steps {
    left: Option<usize>,
}

impl Steps {
    /// Whether another mutating step may run.
    fn take(&mut self) -> bool {
        match &mut self.left {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }
}

use strata_format::now_ms;

/// A store key's id, if it is an object or manifest key of `tenant`.
fn key_id(tenant: &str, key: &str) -> Option<(bool, Hash)> {
    use strata_store::keys::{parse, Kind};
    match parse(key)? {
        (t, Kind::Object(h)) if t == tenant => Some((true, h)),
        (t, Kind::Manifest(h)) if t == tenant => Some((false, h)),
        _ => None,
    }
}

impl Engine {
    /// One GC pass over every tenant (see the module docs).
    pub async fn gc(self: &Arc<Self>, opts: &GcOptions) -> Result<GcReport> {
        let started = Instant::now();
        let mut report = GcReport {
            dry_run: opts.dry_run,
            reconciled: opts.reconcile,
            ..Default::default()
        };
        let mut steps = Steps {
            left: opts.stop_after,
        };
        if let (Some(t), false) = (opts.compact_below, opts.dry_run) {
            // A fenced or failed volume publishes nothing more (its node lost it).
            for v in self
                .attached()
                .into_iter()
                .filter(|v| v.failure().is_none())
            {
                match v.compact(t).await {
                    Ok(Some(p)) => {
                        report.compactions += 1;
                        report.compacted_bytes += p.bytes_uploaded;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(tenant = v.tenant(), workspace = v.name(), error = %e, "compaction failed")
                    }
                }
            }
        }
        if let (Some(t), Some(after), false) = (
            opts.compact_below,
            opts.compact_detached_after,
            opts.dry_run,
        ) {
            for tenant in self.catalog().list_tenants().await? {
                if self.live_tenant(&tenant).await.unwrap_or(false) && self.servable(&tenant).await
                {
                    if let Err(e) = self
                        .compact_detached(&tenant, t, after, opts.reconcile, &mut report)
                        .await
                    {
                        report.tenant_failed(&tenant, "compacting detached workspaces", &e);
                    }
                }
            }
        }
        let tenants = self.catalog().list_tenants().await?;
        // Tenants the pass could not collect (to tell one tenant's failure from the pass's).
        let mut uncollected = 0u64;
        for tenant in tenants {
            match self.live_tenant(&tenant).await {
                Ok(true) if self.servable(&tenant).await => {}
                Ok(_) => continue,
                Err(e) => {
                    report.tenants += 1;
                    uncollected += 1;
                    report.tenant_failed(&tenant, "reading the tenant", &e);
                    continue;
                }
            }
            report.tenants += 1;
            // One tenant's failure (its own bucket refusing, say) is its own: the pass goes on
            // with the others. Stopping part way is safe (a pass can be cut off at any step).
            match self.gc_tenant(&tenant, opts, &mut steps, &mut report).await {
                Ok(true) => {}
                Ok(false) => {
                    report.stopped = true;
                    break;
                }
                Err(e) => {
                    uncollected += 1;
                    report.tenant_failed(&tenant, "collecting", &e);
                }
            }
        }
        if !opts.dry_run && !report.stopped && opts.reconcile {
            // What a crash mid-put left (a local store's listings never show it). At least an
            // hour old whatever the grace: a put that slow has stalled, not just begun.
            let age = opts.grace.max(Duration::from_secs(3600));
            match self.reader().store().sweep_staged(age).await {
                Ok(n) => report.staged_removed = n,
                Err(e) => tracing::warn!(error = %e, "sweeping staged files failed"),
            }
        }
        report.duration_ms = started.elapsed().as_millis() as u64;
        // Every tenant failing is the pass failing (the catalog is down, say), not a pass
        // that happened to collect nothing.
        if uncollected > 0 && uncollected == report.tenants {
            let f = &report.failed_tenants[0];
            return Err(Error::Unavailable(
                "gc".into(),
                format!(
                    "every tenant failed ({uncollected} of them); {}: {}",
                    f.tenant, f.error
                ),
            ));
        }
        Ok(report)
    }

    /// Whether this node can read and write the tenant's store, as the catalog places it now
    /// (a tenant of the name deleted and created again elsewhere is placed again): a tenant in
    /// a store this node lacks, or encrypted under a key it does not hold, is left to the
    /// nodes that can (and said so in the log), not a failure of the whole pass.
    async fn servable(&self, tenant: &str) -> bool {
        let store = self.reader().store();
        match store.refresh(tenant).await {
            Ok(()) if !store.is_locked(tenant) => true,
            Ok(()) => {
                tracing::warn!(
                    tenant,
                    "GC skips an encrypted tenant whose key this node does not hold"
                );
                false
            }
            Err(e) => {
                tracing::warn!(tenant, error = %e, "GC skips a tenant this node cannot place");
                false
            }
        }
    }

    /// Whether GC may work on the tenant: it exists and is not being deleted (here or on
    /// another node; a pass racing the purge would find its references unreadable).
    async fn live_tenant(&self, tenant: &str) -> Result<bool> {
        match self.catalog().get_tenant(tenant).await {
            Ok(t) => Ok(t.deleting_ms.is_none()),
            Err(strata_catalog::CatalogError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Compacts the tenant's workspaces that are detached everywhere (see
    /// [`GcOptions::compact_detached_after`]) and whose head has objects less live than
    /// `threshold`, each attached here for the call (a hold: a user's attach on this node
    /// meanwhile gets the same volume and keeps it; one on another node is refused with a
    /// lease conflict until the compaction ends). A workspace that cannot be looked at (deleted
    /// meanwhile, say) is skipped, not the pass.
    async fn compact_detached(
        self: &Arc<Self>,
        tenant: &str,
        threshold: f64,
        after: Duration,
        reconcile: bool,
        report: &mut GcReport,
    ) -> Result<()> {
        // Only workspaces detached since they were last looked at (every one in a
        // reconciliation): a pass after no change reads none.
        let idle_before = now_ms().saturating_sub(after.as_millis() as u64);
        let candidates = self
            .catalog()
            .compaction_candidates(tenant, idle_before, reconcile)
            .await?;
        for (name, head) in candidates {
            if self.volume(tenant, &name).is_some() {
                continue; // attached here: compacted above
            }
            match self.sparse_head(tenant, &name, head, threshold).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(tenant, workspace = %name, error = %e, "not compacting a detached workspace");
                    continue;
                }
            }
            match self.compact(tenant, &name, threshold).await {
                Ok(Some(p)) => {
                    report.compactions += 1;
                    report.compacted_bytes += p.bytes_uploaded;
                    tracing::info!(tenant, workspace = %name, version = p.version, "compacted a detached workspace");
                }
                Ok(None) => {}
                // Attached elsewhere meanwhile, say: the next pass looks again.
                Err(e) => {
                    tracing::warn!(tenant, workspace = %name, error = %e, "compacting a detached workspace failed")
                }
            }
        }
        Ok(())
    }

    /// Whether a detached workspace's head (a candidate: see
    /// [`strata_catalog::Catalog::compaction_candidates`]) has objects less live than
    /// `threshold`. A dense one is recorded as judged, so no later pass reads its manifest
    /// again until the head moves (a threshold changed later applies from then on).
    async fn sparse_head(
        &self,
        tenant: &str,
        name: &str,
        head: Hash,
        threshold: f64,
    ) -> Result<bool> {
        let m = self.reader().store().get_manifest(tenant, &head).await?;
        let sparse = crate::volume::object_usage(&m)
            .iter()
            .any(|(live, stored)| (*live as f64) < threshold * *stored as f64);
        if !sparse {
            self.catalog().compaction_judged(tenant, name, head).await?;
        }
        Ok(sparse)
    }

    /// Returns false when `steps` ran out.
    async fn gc_tenant(
        &self,
        tenant: &str,
        opts: &GcOptions,
        steps: &mut Steps,
        report: &mut GcReport,
    ) -> Result<bool> {
        let cat = self.catalog().clone();
        let grace_ms = opts.grace.as_millis() as u64;
        // 1. Retention, of the workspaces whose checkpoints changed since it last looked or
        // whose next expiry has come (a reconciliation looks at every workspace).
        let now = now_ms();
        for d in cat.retention_due(tenant, now, opts.reconcile).await? {
            report.retention_looked += 1;
            let cps = match cat.list_checkpoints(tenant, &d.workspace).await {
                Ok(cps) => cps,
                Err(strata_catalog::CatalogError::NotFound { .. }) => continue, // deleted
                Err(e) => return Err(e.into()),
            };
            let exp = expired_versions(&cps, d.head_version, now, opts);
            if opts.dry_run {
                report.checkpoints_expired += exp.len() as u64;
                continue;
            }
            if !exp.is_empty() {
                if !steps.take() {
                    return Ok(false);
                }
                report.checkpoints_expired +=
                    cat.expire_checkpoints(tenant, &d.workspace, &exp).await?;
            }
            // A checkpoint added or kept meanwhile leaves the workspace due.
            let next = retention_next(&cps, d.head_version, &exp, now, opts);
            cat.retention_done(tenant, &d.workspace, d.generation, next)
                .await?;
        }
        // 2. Rows expired for longer than the grace period go: their manifests' references end
        // here (the catalog logs them for the mark).
        if !opts.dry_run {
            if !steps.take() {
                return Ok(false);
            }
            report.checkpoints_purged += cat.purge_expired_checkpoints(tenant, grace_ms).await?;
        }
        // 3. Mark, from the catalog's record of what each manifest references, never by reading
        // manifests (only one the catalog has no record of is read from the store: none unless
        // rows were lost). An ordinary pass looks only at what changed since the last one (the
        // catalog's change log: manifests that lost a reference or were recorded); a
        // reconciliation marks everything. (An unrecorded manifest is not recorded by GC: a pass
        // on another node may be deleting it meanwhile, when its last reference expired, and a
        // record made after that delete would never be pruned.)
        let store = self.reader().store();
        let mut live_manifests: HashSet<Hash> = HashSet::new();
        let mut live_objects: HashSet<Hash> = HashSet::new();
        // Unreferenced keys: the catalog's stale records (recorded more than the grace period
        // ago, referenced by nothing; no store request), and in a reconciliation pass every key
        // a listing of the tenant's prefix finds unreferenced and older than the grace period by
        // the store's clock: keys the catalog does not know (uploads whose publish failed before
        // recording them, keys whose delete failed after their records were pruned).
        let mut unreferenced: HashMap<String, u64> = HashMap::new();
        // Change-log rows this pass settles once what they found is condemned.
        let mut settled = vec![];
        // The change log, in batches of `CHANGES_PER_BATCH` rows up to `CHANGES_PER_PASS` (a
        // longer backlog is worked off over passes). A reconciliation reads it too, only to
        // settle it (read before its full mark, so whatever the log found stale the mark finds
        // stale or referenced again).
        let (mut log_manifests, mut log_objects) = (vec![], vec![]);
        let mut unrecorded = vec![];
        let (mut after, mut looked) = (0, 0u64);
        loop {
            let ch = cat
                .gc_changes(tenant, grace_ms, after, CHANGES_PER_BATCH)
                .await?;
            report.changes += ch.looked;
            looked += ch.looked;
            settled.extend(ch.settled);
            log_manifests.extend(ch.stale_manifests);
            log_objects.extend(ch.stale_objects);
            if after == 0 {
                unrecorded = ch.unrecorded; // the first batch lists them all
            }
            after = ch.last_seq;
            if !ch.more || looked >= CHANGES_PER_PASS as u64 {
                break;
            }
        }
        let (stale_manifests, stale_objects) = if opts.reconcile {
            let mark = cat.gc_mark(tenant, grace_ms).await?;
            live_manifests.extend(mark.manifests.iter().copied());
            live_objects.extend(mark.objects.iter().copied());
            live_objects.extend(
                self.unrecorded_objects(tenant, &mark.unrecorded, report)
                    .await?,
            );
            report.live_manifests += live_manifests.len() as u64;
            report.live_objects += live_objects.len() as u64;
            (mark.stale_manifests, mark.stale_objects)
        } else {
            // Every referenced manifest without a record, whatever the batches read: their
            // objects are live, though no record links them.
            live_objects.extend(self.unrecorded_objects(tenant, &unrecorded, report).await?);
            (log_manifests, log_objects)
        };
        for m in &stale_manifests {
            if !live_manifests.contains(m) {
                unreferenced.insert(strata_store::Store::manifest_key(tenant, m).to_string(), 0);
            }
        }
        for (o, len) in &stale_objects {
            // An object an unrecorded manifest names is live, though no record links it.
            if !live_objects.contains(o) {
                unreferenced.insert(strata_store::Store::object_key(tenant, o).to_string(), *len);
            }
        }
        let tenant_store = store
            .inner_for(tenant)
            .await
            .map_err(|e| Error::Invalid(format!("GC of tenant {tenant:?}: {e}")))?;
        // When each unreferenced key the listing saw was last written (store clock).
        let mut written: HashMap<String, i64> = HashMap::new();
        let cutoff = chrono_cutoff(opts.grace);
        if opts.reconcile {
            let mut listing = store
                .list_tenant(tenant)
                .await
                .map_err(|e| Error::Invalid(format!("GC of tenant {tenant:?}: {e}")))?;
            while let Some(meta) = listing.next().await {
                let meta = meta.map_err(|e| Error::Invalid(format!("listing the store: {e}")))?;
                let key = meta.location.to_string();
                let Some((is_obj, id)) = key_id(tenant, &key) else {
                    continue;
                };
                report.stored_keys += 1;
                report.stored_bytes += meta.size;
                if live_in(&live_manifests, &live_objects, is_obj, &id) {
                    report.live_bytes += meta.size;
                    continue;
                }
                let at = meta.last_modified.timestamp_millis();
                if at < cutoff {
                    unreferenced.insert(key.clone(), meta.size);
                } else {
                    // Written since the grace period began: not condemned now, whatever an
                    // old record of the same key says.
                    unreferenced.remove(&key);
                }
                written.insert(key, at);
            }
        }
        report.unreferenced_keys += unreferenced.len() as u64;
        report.unreferenced_bytes += unreferenced.values().sum::<u64>();
        if opts.dry_run {
            return Ok(true);
        }
        let condemned = cat.gc_condemned(tenant).await?;
        let known: HashSet<&String> = condemned.iter().map(|(k, _)| k).collect();
        let fresh: Vec<String> = unreferenced
            .keys()
            .filter(|k| !known.contains(k))
            .cloned()
            .collect();
        if !fresh.is_empty() {
            if !steps.take() {
                return Ok(false);
            }
            cat.gc_condemn(tenant, &fresh).await?;
            report.condemned += fresh.len() as u64;
        }
        // What the log found is condemned (or needs nothing): its rows go. A pass cut off
        // before this looks at them again.
        if !settled.is_empty() {
            if !steps.take() {
                return Ok(false);
            }
            cat.gc_settle(tenant, &settled).await?;
        }
        // The recorded data length of condemned objects found unreferenced by the re-mark.
        let mut dead_len: HashMap<Hash, u64> = HashMap::new();
        if !opts.reconcile {
            // The re-mark before a delete: of the condemned keys not found unreferenced just
            // now, those referenced again (one probe each, no store request).
            let (ms, os) = ids_by_kind(
                tenant,
                condemned
                    .iter()
                    .map(|(k, _)| k)
                    .filter(|k| !unreferenced.contains_key(*k)),
            );
            if !ms.is_empty() || !os.is_empty() {
                let l = cat.gc_live(tenant, &ms, &os).await?;
                live_manifests.extend(l.manifests);
                live_objects.extend(l.objects);
                for (o, len) in l.dead_objects {
                    dead_len.insert(o, len);
                }
            }
        }
        let live = |is_obj: bool, id: &Hash| live_in(&live_manifests, &live_objects, is_obj, id);
        // Where a condemned key stands now. Unreferenced by this pass's mark: it may go once
        // condemned for the grace period (it was unreferenced then too). Without a listing, a
        // condemned key neither stale in the catalog nor live (one a reconciliation pass
        // condemned, unknown to the catalog) is judged by the mark alone; a listing that did
        // not find it unreferenced means it is gone or live again.
        let standing = |k: &String| -> Standing {
            if let Some(size) = unreferenced.get(k) {
                return Standing::Unreferenced(*size);
            }
            match key_id(tenant, k) {
                Some((is_obj, id)) if live(is_obj, &id) => Standing::Revived,
                _ if opts.reconcile => Standing::Revived,
                Some((is_obj, id)) => Standing::Unreferenced(if is_obj {
                    dead_len.get(&id).copied().unwrap_or(0)
                } else {
                    0
                }),
                None => Standing::Unknown,
            }
        };
        // Doomed: condemned for the grace period, unreferenced by this pass's mark, and last
        // written more than the grace period ago by the store's clock (the listing's time, or
        // one HEAD per key: a request per deletion, so the cost still follows what changed).
        // A key written again since it was condemned (a salt drawn twice for the same content)
        // is forgotten, not deleted; one already gone still has its rows pruned.
        let mut doomed: Vec<(String, u64)> = vec![];
        let mut revived = vec![];
        for (key, age_ms) in &condemned {
            match standing(key) {
                Standing::Unreferenced(size)
                    if *age_ms >= grace_ms && key_id(tenant, key).is_some() =>
                {
                    let at = match written.get(key) {
                        Some(at) => Some(*at),
                        None => {
                            let path = object_store::path::Path::from(key.as_str());
                            match tenant_store.head(&path).await {
                                Ok(meta) => Some(meta.last_modified.timestamp_millis()),
                                Err(object_store::Error::NotFound { .. }) => None,
                                Err(e) => {
                                    return Err(Error::Invalid(format!("looking at {key}: {e}")))
                                }
                            }
                        }
                    };
                    match at {
                        Some(at) if at >= cutoff => revived.push(key.clone()),
                        Some(_) => doomed.push((key.clone(), size)),
                        None => doomed.push((key.clone(), 0)),
                    }
                }
                Standing::Unreferenced(_) | Standing::Unknown => {} // not yet for long enough
                Standing::Revived => revived.push(key.clone()),     // referenced again, or gone
            }
        }
        // The last look before a delete: a key judged unreferenced earlier in this pass (by a
        // batch of the log, or the full mark, each read before the condemnation above) may have
        // been referenced again since; one probe per key about to go.
        if !doomed.is_empty() {
            let (ms, os) = ids_by_kind(tenant, doomed.iter().map(|(k, _)| k));
            let l = cat.gc_live(tenant, &ms, &os).await?;
            let (again_m, again_o): (HashSet<Hash>, HashSet<Hash>) = (
                l.manifests.into_iter().collect(),
                l.objects.into_iter().collect(),
            );
            doomed.retain(|(k, _)| match key_id(tenant, k) {
                Some((is_obj, id)) if live_in(&again_m, &again_o, is_obj, &id) => {
                    revived.push(k.clone());
                    false
                }
                _ => true,
            });
        }
        // The catalog's rows for what is deleted go first: a failure after leaves a key
        // without rows (deleted by a reconciliation pass), never rows without a key.
        let (mans, objs) = ids_by_kind(tenant, doomed.iter().map(|(k, _)| k));
        if !mans.is_empty() || !objs.is_empty() {
            if !steps.take() {
                return Ok(false);
            }
            report.pruned_rows += cat.prune_references(tenant, &mans, &objs).await?;
        }
        let mut deleted = vec![];
        for (key, size) in &doomed {
            if !steps.take() {
                cat.gc_forget(tenant, &deleted).await?;
                return Ok(false);
            }
            let path = object_store::path::Path::from(key.as_str());
            match tenant_store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => {
                    cat.gc_forget(tenant, &deleted).await?;
                    return Err(Error::Invalid(format!("deleting {key}: {e}")));
                }
            }
            report.deleted_keys += 1;
            report.deleted_bytes += size;
            deleted.push(key.clone());
        }
        deleted.extend(revived);
        if !deleted.is_empty() {
            if !steps.take() {
                return Ok(false);
            }
            cat.gc_forget(tenant, &deleted).await?;
        }
        Ok(true)
    }

    /// The objects of referenced manifests the catalog has no record of, read from the store
    /// (an unreadable one stops the tenant's pass: nothing is deleted on incomplete
    /// information).
    async fn unrecorded_objects(
        &self,
        tenant: &str,
        manifests: &[Hash],
        report: &mut GcReport,
    ) -> Result<HashSet<Hash>> {
        let mut out = HashSet::new();
        for m in manifests {
            let man = self.reader().store().get_manifest(tenant, m).await.map_err(|e| {
                Error::Invalid(format!(
                    "GC of tenant {tenant:?} stopped: referenced manifest {m} is unreadable ({e}); nothing was deleted"
                ))
            })?;
            report.manifests_read += 1;
            out.extend(man.objects.iter().map(|o| o.id));
        }
        Ok(out)
    }
}

/// Change-log rows one read takes (what a pass holds in memory at once is about this).
pub const CHANGES_PER_BATCH: usize = 100_000;

/// Change-log rows one pass looks at per tenant at most (a longer backlog is worked off over
/// passes).
pub const CHANGES_PER_PASS: usize = 1_000_000;

/// The manifest and object ids among `keys` (other keys skipped).
fn ids_by_kind<'a>(tenant: &str, keys: impl Iterator<Item = &'a String>) -> (Vec<Hash>, Vec<Hash>) {
    let (mut manifests, mut objects) = (vec![], vec![]);
    for k in keys {
        match key_id(tenant, k) {
            Some((true, id)) => objects.push(id),
            Some((false, id)) => manifests.push(id),
            None => {}
        }
    }
    (manifests, objects)
}

fn live_in(manifests: &HashSet<Hash>, objects: &HashSet<Hash>, is_obj: bool, id: &Hash) -> bool {
    if is_obj {
        objects.contains(id)
    } else {
        manifests.contains(id)
    }
}

/// Where a condemned key stands in a pass (see `gc_tenant`).
enum Standing {
    /// Unreferenced now (with its size, if known).
    Unreferenced(u64),
    /// Referenced again, or (by a listing) gone: forgotten.
    Revived,
    /// Not a key GC knows how to judge without a listing: left as it is.
    Unknown,
}

/// Store keys last modified before this (ms since the epoch) may be condemned.
fn chrono_cutoff(grace: Duration) -> i64 {
    now_ms() as i64 - grace.as_millis() as i64
}
