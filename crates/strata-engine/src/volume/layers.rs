//! Cuts taken now, published later: local checkpoints.
//!
//! Every version this volume publishes (a checkpoint, a background upload, a sync-mode flush,
//! a grow, the final publish of a detach) starts as a *cut*: under the writer lock the active
//! overlay becomes a pending layer holding every write up to the cut's sequence number. Reads
//! see `active ─▶ pending layers, newest first ─▶ base`. A cut is made durable on this node
//! (journal fdatasync'd through the cut, then the cut recorded in `cuts.log`) and then
//! returned: that is a `local` checkpoint. Layers are published strictly
//! in order, one at a time under the publish lock, by whoever asks first (the background loop,
//! a `wait`ing caller, the kick a cut gives): pack, upload, manifest, head CAS, then the layer
//! becomes the base and its segments retire.
//!
//! Version numbers are reserved at the cut: the `k`-th pending layer (from 1) publishes as
//! `base_version + k`. Nothing else moves this workspace's head while this node holds its
//! lease, and the other versions a volume makes (compaction, rollback) are made only with no
//! layer pending and under the cut lock, so a reserved number is the one it commits as.
//!
//! Cuts are recorded in `cuts.log` (see `cutlog.rs`: records written in place in a file of
//! zeros, one fdatasync each). After a crash the journal's records replay into the recorded
//! layers by sequence number (records `<= cut` of the first layer whose cut is at least
//! theirs); layers whose version the head has reached are published already and dropped. A
//! cut is only recorded once its records are durable, so a recorded cut survives with exactly
//! its content. A cut does not rotate the journal (a live fork's does: it links the sealed
//! segments): a segment may hold records of several layers (it retires once the last of them
//! is published), and a checkpoint adds no file. Recorded versions are never renumbered: a
//! number whose cut was never recorded (its record failed, no receipt was given) is kept after
//! a crash by an empty stand-in layer. Once a volume is sealed for detach, only the detach's
//! own cut is taken.
//!
//! A publish that fails leaves its layer pending, to be retried: a local checkpoint is never
//! withdrawn. The only exception keeps today's recovery for layers nobody holds a receipt
//! for: a background, detach or grow cut that is the only layer left, failing in a way known
//! not to have committed, folds back under the active overlay (so segment cleaning, which
//! runs only with no layer pending, can keep the journal bounded through a store outage).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::cutlog::Entry;
use super::*;

/// At most this many cuts wait for publication; a cut beyond waits for the oldest to publish.
pub(crate) const MAX_PENDING: usize = 64;

/// Whether a receipt's version is only on this node or in the object store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointState {
    /// Durable on this node (survives a crash of it); only this node can serve it until it
    /// is published.
    Local,
    /// In the object store and the catalog: any node can serve it.
    #[default]
    Published,
}

impl CheckpointState {
    pub fn as_str(&self) -> &'static str {
        match self {
            CheckpointState::Local => "local",
            CheckpointState::Published => "published",
        }
    }
}

/// One cut as recorded in `pending.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct LayerRecord {
    pub cut: u64,
    pub version: u64,
    pub kind: CheckpointKind,
    pub label: Option<String>,
    pub keep_until_ms: Option<u64>,
    /// The disk size this version publishes at, if a grow asked for more (0: the base's).
    pub disk_size: u64,
    pub taken_ms: u64,
    /// A live fork's first layer: the disk at a checkpoint of its source (see `rebase.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopt: Option<Adopt>,
    /// A rollback taken locally: this layer is the disk at this earlier version (reads under
    /// it see only that version; see `rebase.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_to: Option<u64>,
}

/// The source checkpoint a live fork's first layer holds exactly: version `version` of
/// `workspace`, cut `cut` of journal `journal`. Once the catalog has that very checkpoint, the
/// layer publishes as its manifest instead of uploading the same blocks again.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Adopt {
    pub workspace: String,
    pub version: u64,
    pub journal: String,
    pub cut: u64,
}

/// Where a live fork starts: the source's published base (`base_manifest`, `base_version`, its
/// cut `base_seq`) under the linked journal segments, and what it inherits of them.
pub(crate) struct ForkBase {
    pub base_manifest: Hash,
    pub base_version: u64,
    pub base_seq: u64,
    pub disk_size: u64,
    pub inherit: Inheritance,
    /// The source's checkpoint the fork starts from (its first layer, version 2).
    pub adopt: Adopt,
}

/// What a live fork's volume takes from its source instead of replaying the linked segments:
/// their journal metadata and the blocks they hold after the base (the source's pending layers
/// up to the fork's cut, merged), with their remote-window bytes.
pub(crate) struct Inheritance {
    pub segs: Vec<(u64, u64, u64, strata_format::journal::SegmentHeader)>,
    pub last_seq: u64,
    /// Shared with the source's pending layer when it had one (no run copied).
    pub overlay: Arc<Overlay>,
    pub bytes: u64,
    /// The source's base manifest (`ForkBase::base_manifest`), already read and decoded: the
    /// fork's base is the same, so its open neither fetches nor decodes it again (at 1 GiB
    /// of 4 KiB writes published that was most of a fork's open).
    pub base: (Hash, Arc<strata_format::manifest::Manifest>),
}

/// A pending layer: a cut's record, its overlay, and its share of the remote window.
pub(super) struct Layer {
    pub rec: LayerRecord,
    pub overlay: Arc<Overlay>,
    pub bytes: u64,
    pub since: Option<Instant>,
    /// For a rollback layer whose target version is published: that version's manifest (id
    /// and content), which reads under this layer resolve to.
    pub under: Option<(Hash, Arc<Manifest>)>,
}

/// The receipt of a published checkpoint row.
fn receipt_of(cp: &strata_catalog::Checkpoint) -> Published {
    Published {
        version: cp.version,
        manifest: Some(cp.manifest),
        cut_seq: cp.cut_seq,
        bytes_uploaded: cp.bytes,
        stall: Duration::ZERO,
        total: Duration::ZERO,
        state: CheckpointState::Published,
    }
}

/// What a cut is for.
pub(super) struct CutSpec {
    pub kind: CheckpointKind,
    pub label: Option<String>,
    pub keep_until_ms: Option<u64>,
    pub disk_size: u64,
    /// Seal the journal's active segment at the cut (a live fork links the sealed segments).
    pub rotate: bool,
}

impl CutSpec {
    pub fn of(kind: CheckpointKind) -> CutSpec {
        CutSpec {
            kind,
            label: None,
            keep_until_ms: None,
            disk_size: 0,
            rotate: false,
        }
    }
}

impl Volume {
    /// Takes a cut (see the module docs) and makes it durable on this node: the receipt of a
    /// `local` version. `on_cut` learns the cut's sequence number as soon as the content is
    /// fixed, before it is made durable.
    pub(super) async fn cut(
        &self,
        spec: CutSpec,
        on_cut: Option<tokio::sync::oneshot::Sender<u64>>,
    ) -> Result<Published> {
        // Counted while it waits (a compaction gives way), uncounted however the wait ends.
        struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
            }
        }
        self.cut_waiting.fetch_add(1, SeqCst);
        let waiting = Waiting(&self.cut_waiting);
        let c = self.cut_lock.lock().await;
        drop(waiting);
        Ok(self.cut_sealing(&c, spec, on_cut).await?.0)
    }

    /// [`Volume::cut`] for a caller that holds the cut lock.
    pub(super) async fn cut_locked(
        &self,
        held: &tokio::sync::MutexGuard<'_, ()>,
        spec: CutSpec,
        on_cut: Option<tokio::sync::oneshot::Sender<u64>>,
    ) -> Result<Published> {
        Ok(self.cut_sealing(held, spec, on_cut).await?.0)
    }

    /// A cut, and with `spec.rotate` the id of the segment it started (every segment before
    /// it ends at or before the cut).
    async fn cut_sealing(
        &self,
        _held: &tokio::sync::MutexGuard<'_, ()>,
        spec: CutSpec,
        on_cut: Option<tokio::sync::oneshot::Sender<u64>>,
    ) -> Result<(Published, Option<u64>)> {
        let started = Instant::now();
        self.usable()?;
        // Past the local lease deadline another node may hold the workspace: a cut taken now
        // could never be published, so no receipt is given for one (as for a flush).
        self.lease_valid()?;
        if self.sealed.load(SeqCst) && spec.kind != CheckpointKind::Detach {
            // Detaching: its final cut covers everything; a later one would never publish.
            return Err(Error::Unavailable(
                self.name.clone(),
                "detaching: no new checkpoint is taken".into(),
            ));
        }
        while self.st().pending.len() >= MAX_PENDING {
            // Backpressure: the oldest publishes first (its failure is this cut's).
            self.drain(None, Some(1)).await?;
        }
        let stall_start = Instant::now();
        let (rec, sealed) = {
            // The writer lock orders the cut against appends: every record up to `cut` is in
            // the overlay taken here, none after it.
            let mut j = self.journal_whole().await?;
            let cut = j.last_seq();
            // Under its tenant's journal quota, the publish of this cut must be able to free
            // the records it covers (see `TenantBudget::pressed`).
            let rotated = if spec.rotate || self.budget.pressed() {
                match j.rotate() {
                    Ok(r) => Some(r),
                    // A rotation only the quota asked for never fails a cut (a FLUSH in sync
                    // mode, a detach) on a full disk: the cut is taken unrotated.
                    Err(e) if crate::error::is_no_space(&e) && !spec.rotate => None,
                    Err(e) if crate::error::is_no_space(&e) => {
                        return Err(Error::NoSpace(format!("a new journal segment: {e}")))
                    }
                    Err(e) => return Err(Error::io("rotating journal segment")(e)),
                }
            } else {
                None
            };
            let mut st = self.st_mut();
            let sealed = rotated.map(|(id, f)| {
                st.files.insert(id, SegFile::new(f));
                id
            });
            let rec = LayerRecord {
                cut,
                version: st.base_version + st.pending.len() as u64 + 1,
                kind: spec.kind,
                label: spec.label,
                keep_until_ms: spec.keep_until_ms,
                disk_size: spec.disk_size,
                taken_ms: crate::now_ms(),
                adopt: None,
                rollback_to: None,
            };
            let overlay = Arc::new(std::mem::take(&mut st.active));
            let (bytes, since) = {
                let mut w = lock(&self.window);
                (std::mem::take(&mut w.bytes), w.since.take())
            };
            st.pending.push_back(Layer {
                rec: rec.clone(),
                overlay,
                bytes,
                since,
                under: None,
            });
            (rec, sealed)
        };
        let stall = stall_start.elapsed();
        if let Some(tx) = on_cut {
            let _ = tx.send(rec.cut);
        }
        // Durable on this node: the records through the cut, then the cut itself.
        // In this order: a recorded cut whose records were lost would, after a restart, claim
        // the sequence numbers of later writes. A rotating cut (a live fork's) syncs every
        // sealed segment whole, headers included: the fork links them all. The segment it
        // rotated into is not synced (`Journal::fresh`).
        let durable = async {
            self.sync_journal_with(spec.rotate).await?;
            self.record(Entry::Cut(rec.clone())).await
        };
        if let Err(e) = durable.await {
            // No receipt: withdraw the cut if no publish has it in hand (one may: then it
            // publishes, and after a crash its number is kept by an empty stand-in, `open.rs`).
            if let Ok(_p) = self.publish_lock.try_lock() {
                self.fold_back(rec.version);
            }
            return Err(e);
        }
        // Likewise once durable: if the lease may have passed meanwhile, the receipt is withheld.
        self.lease_valid()?;
        let p = Published {
            version: rec.version,
            manifest: None,
            cut_seq: rec.cut,
            bytes_uploaded: 0,
            stall,
            total: started.elapsed(),
            state: CheckpointState::Local,
        };
        Ok((p, sealed))
    }

    /// Appends `e` to the cut log, durably. Appends are serialised by the log's lock and each
    /// carries the layers pending at that moment for a rewrite of a full log.
    pub(super) async fn record(&self, e: Entry) -> Result<()> {
        self.record_also(e, None).await
    }

    /// [`Self::record`], with `also` counted among the pending cuts (one not pushed yet).
    pub(super) async fn record_also(&self, e: Entry, also: Option<LayerRecord>) -> Result<()> {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Unavailable(self.name.clone(), "detached".into()))?;
        crate::engine::blocking(move || {
            let mut log = lock(&me.cut_log);
            let live: Vec<Entry> = me
                .st()
                .pending
                .iter()
                .map(|l| Entry::Cut(l.rec.clone()))
                .chain(also.map(Entry::Cut))
                .collect();
            log.append(&e, &live)
        })
        .await
    }

    /// The retention a layer's version is published with: its own, and while a pending local
    /// rollback still targets it, at least a week from now (its manifest must not expire before
    /// the rollback publishes it again, even if this node is down for days meanwhile: automatic
    /// versions are otherwise expired at the next GC pass; a labelled one without a date is
    /// kept anyway).
    pub(super) fn keep_for(&self, rec: &LayerRecord) -> Option<u64> {
        // Decided here, once: a rollback cut later cannot target this version locally.
        let targeted = {
            let mut st = self.st_mut();
            st.keep_fixed = st.keep_fixed.max(rec.version);
            st.pending
                .iter()
                .any(|l| l.rec.rollback_to == Some(rec.version))
        };
        if !targeted || (rec.label.is_some() && rec.keep_until_ms.is_none()) {
            return rec.keep_until_ms;
        }
        let week = crate::now_ms() + 7 * 24 * 3600 * 1000;
        Some(rec.keep_until_ms.map_or(week, |k| k.max(week)))
    }

    /// After a head CAS known not to have committed: no version past the base has had its
    /// retention decided (versions publish in order).
    pub(super) fn keep_undecided(&self) {
        let mut st = self.st_mut();
        st.keep_fixed = st.keep_fixed.min(st.base_version);
    }

    /// Whether any cut waits for publication.
    pub(super) fn has_pending(&self) -> bool {
        !self.st().pending.is_empty()
    }

    /// The version of the first pending layer whose cut covers `seq`, if any.
    pub(super) fn pending_covering(&self, seq: u64) -> Option<u64> {
        self.st()
            .pending
            .iter()
            .find(|l| l.rec.cut >= seq)
            .map(|l| l.rec.version)
    }

    /// Publishes pending layers oldest first, until version `through` is the base (or none is
    /// left; at most `limit` of them). Returns the receipt of the last one it published.
    pub(super) async fn drain(
        &self,
        through: Option<u64>,
        limit: Option<usize>,
    ) -> Result<Option<Published>> {
        let _p = self.publish_lock.lock().await;
        let mut last = None;
        let mut n = 0;
        loop {
            self.usable()?;
            self.resolve_ambiguous().await?;
            let front = {
                let st = self.st();
                if through.is_some_and(|t| st.base_version >= t) || limit.is_some_and(|l| n >= l) {
                    break;
                }
                st.pending
                    .front()
                    .map(|l| (l.rec.clone(), l.overlay.clone()))
            };
            let Some((rec, overlay)) = front else { break };
            match self.publish_layer(&rec, &overlay).await {
                Ok(p) => {
                    self.remember(p.clone());
                    last = Some(p);
                    n += 1;
                }
                Err(e) => {
                    self.publish_failed(&e).await;
                    return Err(e);
                }
            }
        }
        Ok(last)
    }

    /// Publishes pending layers through version `v` and returns `v`'s receipt.
    pub(super) async fn publish_through(&self, v: u64) -> Result<Published> {
        self.drain(Some(v), None).await?;
        if let Some(p) = self.receipt(v) {
            return Ok(p);
        }
        if self.st().base_version < v {
            // Withdrawn (a background cut folded back): nothing holds its number any more.
            return Err(Error::Unavailable(
                self.name.clone(),
                format!("version {v} was withdrawn before it was published; retry"),
            ));
        }
        // Published by an earlier drain, or adopted after a lost reply: a publish of this
        // journal's cuts. A number a withdrawn cut left may have gone to another kind of version
        // (a compaction's, a rollback's): that is not this cut's receipt.
        let cp = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, v)
            .await?;
        let a_cut = matches!(
            cp.kind,
            CheckpointKind::Auto
                | CheckpointKind::Checkpoint
                | CheckpointKind::Detach
                | CheckpointKind::Resize
        );
        if !a_cut || cp.journal_id.as_deref() != Some(self.journal_id.as_str()) {
            return Err(Error::Unavailable(
                self.name.clone(),
                format!("version {v} was withdrawn before it was published; retry"),
            ));
        }
        Ok(receipt_of(&cp))
    }

    /// The published receipt of version `v`: waits for it if it is one of this volume's
    /// pending cuts (they publish in order); otherwise the catalog's (which may not have it).
    pub async fn published(&self, v: u64) -> Result<Published> {
        let pending = {
            let st = self.st();
            v > st.base_version && v <= st.base_version + st.pending.len() as u64
        };
        if pending {
            return self
                .in_own_task(move |me| async move { me.publish_through(v).await })
                .await;
        }
        self.catalog_receipt(v).await
    }

    /// The receipt of published version `v`, from its catalog row.
    async fn catalog_receipt(&self, v: u64) -> Result<Published> {
        let cp = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, v)
            .await?;
        Ok(receipt_of(&cp))
    }

    /// Publishes every pending cut (and no new one), in its own task.
    pub(crate) async fn publish_pending(&self) -> Result<Option<Published>> {
        self.in_own_task(move |me| async move { me.drain(None, None).await })
            .await
    }

    pub(super) fn remember(&self, p: Published) {
        let mut r = lock(&self.receipts);
        r.push_back(p);
        while r.len() > 2 * MAX_PENDING {
            r.pop_front();
        }
    }

    pub(super) fn receipt(&self, v: u64) -> Option<Published> {
        lock(&self.receipts)
            .iter()
            .rev()
            .find(|p| p.version == v)
            .cloned()
    }

    /// After a failed publish of the front layer: fenced volumes fail; a background, detach
    /// or grow cut that is the only layer and certainly did not commit folds back.
    async fn publish_failed(&self, e: &Error) {
        if let Error::Catalog(CatalogError::Fenced { .. }) = e {
            self.fail(e.to_string());
            return;
        }
        // Under the cut lock (tried: the caller holds the publish lock, which comes after it),
        // so no cut reserves the number again before the withdrawal is recorded.
        let Ok(_c) = self.cut_lock.try_lock() else {
            return;
        };
        let foldable = {
            let st = self.st();
            st.pending.len() == 1
                && !self.ambiguous.load(SeqCst)
                && st.pending.front().is_some_and(|l| {
                    // A live fork's first layer stays: folded, it could no longer rebase.
                    l.rec.adopt.is_none()
                        && matches!(
                            l.rec.kind,
                            CheckpointKind::Auto | CheckpointKind::Detach | CheckpointKind::Resize
                        )
                })
        };
        if !foldable {
            return;
        }
        let Some(version) = self.st().pending.front().map(|l| l.rec.version) else {
            return;
        };
        self.fold_back(version);
        // Recorded, or after a crash the cut would come back (a withdrawn grow applied).
        if let Err(e) = self.record(Entry::Withdraw { version }).await {
            tracing::warn!(tenant = %self.tenant, workspace = %self.name, error = %e, "recording a withdrawn cut failed");
        }
    }

    /// Folds the newest pending layer, if it is `version`, back under the active overlay.
    /// Callers hold the cut lock and know no publish has the layer in hand.
    fn fold_back(&self, version: u64) {
        let mut st = self.st_mut();
        if st.pending.back().map(|l| l.rec.version) != Some(version) {
            return;
        }
        let Some(l) = st.pending.pop_back() else {
            return;
        };
        let active = std::mem::take(&mut st.active);
        st.active = active.over(&l.overlay);
        let mut w = lock(&self.window);
        w.bytes += l.bytes;
        w.since = match (l.since, w.since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Publishes one layer on the current base (steps 2–5 of the protocol).
    async fn publish_layer(&self, rec: &LayerRecord, overlay: &Overlay) -> Result<Published> {
        let started = Instant::now();
        let (base, base_version) = {
            let st = self.st();
            (st.base.clone(), st.base_version)
        };
        if let Some(a) = &rec.adopt {
            if let Some(p) = self.publish_adopted(rec, a, base_version).await? {
                return Ok(p);
            }
        }
        if let Some(v) = rec.rollback_to {
            return self.publish_rolled_back(rec, v, base_version).await;
        }
        let (version, manifest, m, bytes) =
            self.publish_cut(overlay, &base, base_version, rec).await?;
        if version != rec.version {
            tracing::error!(tenant = %self.tenant, workspace = %self.name, reserved = rec.version, version, "a cut committed under another version than it reserved");
        }
        self.finish_publish(version, manifest, Arc::new(m), rec.cut, bytes)
            .await;
        Ok(Published {
            version,
            manifest: Some(manifest),
            cut_seq: rec.cut,
            bytes_uploaded: bytes,
            stall: Duration::ZERO,
            total: started.elapsed(),
            state: CheckpointState::Published,
        })
    }

    /// A live fork's start, taken from this volume: a local checkpoint whose cut seals the
    /// journal, then hard links (in `journal_dir`, not yet synced: the caller syncs it) to
    /// every segment holding a record after the published base and up to the cut. Returns the checkpoint's version, and the fork's base
    /// unless links cannot be made here (a file system without them, a grow being published):
    /// then the caller forks the checkpoint once it is published. Runs in its own task.
    pub(crate) async fn fork_into(&self, journal_dir: PathBuf) -> Result<(u64, Option<ForkBase>)> {
        self.in_own_task(move |v| async move { v.fork_into_now(&journal_dir).await })
            .await
    }

    async fn fork_into_now(&self, journal_dir: &Path) -> Result<(u64, Option<ForkBase>)> {
        let spec = CutSpec {
            rotate: true,
            ..CutSpec::of(CheckpointKind::Checkpoint)
        };
        let (cp, sealed) = {
            let c = self.cut_lock.lock().await;
            self.cut_sealing(&c, spec, None).await?
        };
        self.kick();
        let Some(sealed_at) = sealed else {
            return Ok((cp.version, None));
        };
        // No segment is renamed, recycled or removed while it is linked (retirement takes this
        // lock), and segments sealed after the cut hold later writes: only those before it.
        let _r = self.retire_lock.lock().await;
        // The published cut first, then the base: the base is at least that new, and records
        // it already holds replay harmlessly on top of it (after a crash of the fork).
        let base_seq = self.published_seq.load(SeqCst);
        let segs = self.journal_whole().await?.sealed_meta_before(sealed_at);
        // The base and the layers not yet in it, up to the fork's cut, in one look: together
        // they are the disk at the cut.
        // The layers are shared, not copied, under the state lock (writers take it for every
        // write): stacked into one after it goes, and a single layer is not copied at all.
        let (base_manifest, base, base_version, disk_size, layers, bytes, has_rollback) = {
            let st = self.st();
            let has_rollback = st
                .pending
                .iter()
                .any(|l| l.rec.version <= cp.version && l.rec.rollback_to.is_some());
            let mut layers = vec![];
            let mut bytes = 0;
            for l in st.pending.iter().filter(|l| l.rec.version <= cp.version) {
                layers.push(l.overlay.clone());
                bytes += l.bytes;
            }
            (
                st.base_id,
                st.base.clone(),
                st.base_version,
                st.base.disk_size,
                layers,
                bytes,
                has_rollback,
            )
        };
        let overlay = Overlay::stack(&layers);
        drop(layers);
        if disk_size != self.size() || self.has_pending_grow() {
            return Ok((cp.version, None)); // The fork's base would be the smaller disk.
        }
        if has_rollback {
            // Reads skip layers under a local rollback: a plain merge would not.
            return Ok((cp.version, None));
        }
        if base_version > cp.version {
            // Published past the fork's cut meanwhile (other cuts, concurrent forks): that base
            // holds later writes. The cut is published, so the fork is taken from it instead.
            return Ok((cp.version, None));
        }
        // (source's segment, the fork's name for it): the same file name in each journal.
        let from = self.dir.join("journal");
        let paths: Vec<(PathBuf, PathBuf)> = segs
            .iter()
            .map(|s| format!("{:016x}.seg", s.0))
            .map(|name| (from.join(&name), journal_dir.join(name)))
            .collect();
        let fs = self.fs.clone();
        let to = journal_dir.to_path_buf();
        let linked = crate::engine::blocking(move || {
            fs.create_dir_all(&to)
                .map_err(Error::io("making the fork's journal"))?;
            for (p, linked) in &paths {
                match fs.hard_link(p, linked) {
                    Ok(()) => {}
                    // No hard links here (FUSE passthroughs, other file systems).
                    Err(e)
                        if e.kind() == std::io::ErrorKind::Unsupported
                            || matches!(e.raw_os_error(), Some(1 | 18 | 31 | 38 | 95)) =>
                    {
                        return Ok(false)
                    }
                    Err(e) => return Err(Error::io("linking a journal segment into the fork")(e)),
                }
            }
            // Not synced here: the fork syncs this directory with its other files, before its
            // local state (`engine/fork.rs`).
            Ok(true)
        })
        .await?;
        if linked {
            self.writer
                .lock()
                .await
                .mark_shared(segs.iter().map(|s| s.0));
        }
        let base = linked.then_some(ForkBase {
            base_manifest,
            base_version,
            base_seq,
            disk_size,
            inherit: Inheritance {
                segs,
                last_seq: cp.cut_seq,
                overlay,
                bytes,
                base: (base_manifest, base),
            },
            adopt: Adopt {
                workspace: self.name.clone(),
                version: cp.version,
                journal: self.journal_id.clone(),
                cut: cp.cut_seq,
            },
        });
        Ok((cp.version, base))
    }

    pub(super) fn has_pending_grow(&self) -> bool {
        self.st().pending.iter().any(|l| l.rec.disk_size > 0)
    }

    /// Starts publishing pending layers in a task of its own (after a local checkpoint).
    pub(super) fn kick(&self) {
        let Some(me) = self.me.upgrade() else { return };
        tokio::spawn(async move {
            if let Err(e) = me.drain(None, None).await {
                if me.closed.load(SeqCst) {
                    return; // Detached: its final publish covered (or reported) the rest.
                }
                tracing::warn!(tenant = %me.tenant, workspace = %me.name, error = %e, "publishing a checkpoint failed; retried in the background");
            }
        });
    }
}
