//! A volume: the writable view of one attached workspace.
//!
//! ```text
//! write ─▶ gate (freeze) ─▶ writer lock: reserve a record's place (prepared segment), release,
//!          write it beside other writers ─▶ overlay (newer seq wins) ─▶ ack once every older
//!          record has landed too; RMW edges, trims and rotations wait for records in flight
//!          and append under the lock
//! flush ─▶ group commit: one fdatasync batch covers every write acked before the flush
//!          (ephemeral: no-op; durable: journal; sync: journal + publish)
//! read  ─▶ active overlay ─▶ pending layers (newest first) ─▶ base manifest
//!          ─▶ journal │ node cache │ store
//! cut (checkpoint, background upload, sync flush, grow, detach; see `layers.rs`):
//!   writer lock: the active overlay becomes a pending layer (the only stall: microseconds)
//!   ─▶ fdatasync through the cut ─▶ record in cuts.log: a `local` version, its number reserved
//! publish (each pending layer, oldest first, one at a time):
//!   pack + upload objects ─▶ put manifest ─▶ CAS head (version, lease epoch) + receipt
//!   ─▶ base := new manifest, local state := (version, manifest, cut seq), drop old segments
//! ```
//! Ordering invariants: a head never names data that is not fully in the object store (objects
//! and manifest are put before the CAS); local state names the new base before any segment it
//! covers is deleted; a cut is recorded only once its records are durable; a failed publish
//! leaves its layer pending (or folds it back under the active one), so nothing acknowledged is
//! lost; a fenced or failed-fsync volume refuses all further writes.
//!
//! Lock order (outermost first; a lock is only ever taken while holding ones above it):
//!
//! | # | lock | kind | guards |
//! |---|---|---|---|
//! | 1 | `freeze` | tokio | the thaw guard: frozen means it holds `gate` for writing |
//! | 2 | `gate` | tokio RwLock | writes read it; freeze and `exclusive` (rollback, seal) write it |
//! | 3 | `cut_lock` | tokio | taking a cut; rollback holds it for its whole run |
//! | 4 | `publish_lock` | tokio | publishing one layer, a compaction, segment cleaning |
//! | 5 | `retire_lock` | tokio | retiring segments, a live fork linking them |
//! | 6 | `sync_lock` | tokio | the group-commit fdatasync |
//! | 7 | `writer` | tokio | the journal ([`Volume::journal`] also waits for appends in flight) |
//! | 8 | `cut_log` | std | appends to `cuts.log` |
//! | 9 | `state` | std RwLock | base, pending layers, active overlay, segment files |
//! | 10 | `window` | std | the unpublished bytes and their age |
//! | 11 | `adopt_source` | std | a live fork's link to its source |
//! | 12 | `receipts`, `lease`, `lease_deadline`, `failed`, `unlanded` | std | leaves: nothing is taken under them |
//!
//! No std guard is held across an `.await`. The only reverse pair, `publish_lock` then
//! `cut_lock` (a failed publish folding its layer back, a compaction resolving an uncertain
//! head CAS), uses `try_lock` and gives up if it fails: keep it so. Cleaning and compaction
//! never take `gate` (rollback takes `gate`, `cut_lock`, `publish_lock` in that order).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use strata_catalog::{Catalog, CatalogError, CheckpointKind, LeaseGrant, Mode, NewCheckpoint};
use strata_format::journal::Kind;
use strata_format::manifest::{Manifest, ObjectRef};
use strata_format::{Hash, BLOCK_SIZE};
use strata_store::ObjectReader;
use tokio::sync::OwnedRwLockWriteGuard;

use crate::fs::{Fs, FsFile};
use crate::journal::Journal;
use crate::local::{new_journal_id, LocalState};
use crate::overlay::{Hit, Loc, Overlay};
use crate::pack::pack;
use crate::{Error, Result};

mod clean;
mod compact;
mod cutlog;
mod gate;
mod layers;
mod lease;
mod open;
mod publish;
mod read;
mod rebase;
mod write;

pub(crate) use compact::object_usage;
pub(crate) use cutlog::stage as stage_cut_log;
pub use layers::CheckpointState;
pub(crate) use layers::{Adopt, Inheritance};
use layers::{CutSpec, Layer, LayerRecord};
pub(crate) use rebase::fork_layer;

/// Tunables of one volume (from the engine's config).
#[derive(Clone, Debug)]
pub struct VolumeOptions {
    pub upload_interval: Duration,
    pub upload_max_bytes: u64,
    pub segment_max_bytes: u64,
    pub object_target_bytes: u64,
    pub lease_ttl: Duration,
    pub cache_unsafe: bool,
    /// A publish whose uploads began longer ago than this gives up before moving the head
    /// (half the GC grace period: unreferenced objects older than the grace may be collected).
    pub publish_deadline: Duration,
}

/// The receipt of a version: `local` (its cut durable on this node, publication pending) or
/// `published`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Published {
    pub version: u64,
    /// The version's manifest, once published.
    #[schema(value_type = Option<String>)]
    pub manifest: Option<Hash>,
    pub cut_seq: u64,
    pub bytes_uploaded: u64,
    /// How long writes were held for the cut.
    #[schema(value_type = DurationSchema)]
    pub stall: Duration,
    #[schema(value_type = DurationSchema)]
    pub total: Duration,
    #[serde(default)]
    pub state: CheckpointState,
}

/// A duration as serde writes it (`{"secs", "nanos"}`), for the API's schema.
#[derive(utoipa::ToSchema)]
#[schema(as = Duration)]
#[allow(dead_code)]
pub struct DurationSchema {
    pub secs: u64,
    pub nanos: u32,
}

/// Counters and gauges of one volume.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct VolumeStats {
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub flushes: u64,
    pub fsyncs: u64,
    pub publishes: u64,
    pub bytes_uploaded: u64,
    /// Acknowledged bytes not yet in the object store (the remote window).
    pub window_bytes: u64,
    /// Age of the oldest acknowledged byte not yet in the object store.
    pub window_age_ms: u64,
    pub journal_bytes: u64,
    /// Bytes of journal data still live (not overwritten, not yet published).
    pub journal_live_bytes: u64,
    /// A publish in progress: bytes of live data it packs (0 when none is running) …
    pub publish_total_bytes: u64,
    /// … and how many of them are uploaded so far (for progress bars).
    pub publish_done_bytes: u64,
    pub overlay_runs: u64,
    /// Cuts taken and not yet published (local checkpoints among them).
    #[serde(default)]
    pub pending_versions: u64,
    pub head_version: u64,
    pub lease_epoch: u64,
    pub frozen: bool,
    /// Journal records written outside the writer lock (the fast path of [`Volume::write`]).
    #[serde(default)]
    pub appends_unlocked: u64,
    /// Journal records written together with others in one journal write (writes that
    /// arrived together: [`Volume::write_many`]), outside the writer lock or under it.
    #[serde(default)]
    pub appends_grouped: u64,
    /// Of those, the ones whose acknowledgement waited for an older record still being written.
    #[serde(default)]
    pub acks_held: u64,
}

struct State {
    base: Arc<Manifest>,
    base_id: Hash,
    base_version: u64,
    /// Cuts not yet published, oldest first (see `layers.rs`).
    pending: VecDeque<Layer>,
    active: Overlay,
    files: HashMap<u64, SegFile>,
    /// Versions up to this one have had their retention decided (see `layers.rs` `keep_for`):
    /// a local rollback may only target a later one.
    keep_fixed: u64,
}

/// A journal segment's file as reads see it: the handle and a pin. A read holds the pin from
/// planning until its bytes are copied out; a retired segment whose pin is still held is
/// unlinked rather than recycled, so a reader never sees its blocks overwritten by a later
/// incarnation of the file.
#[derive(Clone)]
pub(crate) struct SegFile {
    pub file: Arc<dyn FsFile>,
    pin: Arc<()>,
}

impl SegFile {
    pub fn new(file: Arc<dyn FsFile>) -> SegFile {
        SegFile {
            file,
            pin: Arc::new(()),
        }
    }
    /// Whether a read still holds this segment (besides the one handle given up here).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.pin) > 1
    }
}

/// The remote window's share of the active overlay (pending layers carry their own).
#[derive(Default)]
struct Window {
    bytes: u64,
    since: Option<Instant>,
}

#[derive(Default)]
struct Counters {
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    flushes: AtomicU64,
    fsyncs: AtomicU64,
    publishes: AtomicU64,
    bytes_uploaded: AtomicU64,
    appends_unlocked: AtomicU64,
    appends_grouped: AtomicU64,
    acks_held: AtomicU64,
}

pub struct Volume {
    tenant: String,
    name: String,
    mode: Mode,
    /// The disk's size as committed in the catalog: writes end here. Grows (never shrinks)
    /// when a version on a larger disk commits.
    disk_size: AtomicU64,
    flush_honoured: bool,
    dir: PathBuf,
    fs: Arc<dyn Fs>,
    reader: Arc<ObjectReader>,
    catalog: Arc<dyn Catalog>,
    space: Arc<crate::space::SpaceGuard>,
    budget: Arc<crate::space::TenantBudget>,
    lease: Mutex<LeaseGrant>,
    /// Local, monotonic end of the lease: measured from *before* the acquire or renewal that
    /// granted it and shortened by a safety margin, so it always falls before the catalog's
    /// expiry. Past it, writes and flushes are refused until a renewal succeeds.
    lease_deadline: Mutex<Instant>,
    /// Set when the node stops renewing this volume's lease (a paused node, in fault tests).
    renewal_stopped: AtomicBool,
    /// The catalog row's creation time (its incarnation), kept in local state.
    created_ms: u64,
    journal_id: String,
    opts: VolumeOptions,
    gate: Arc<tokio::sync::RwLock<()>>,
    /// Held while frozen (lock order: see the module docs; writers take only the gate).
    freeze: tokio::sync::Mutex<Option<OwnedRwLockWriteGuard<()>>>,
    frozen_flag: AtomicBool,
    /// Set by [`Volume::seal`] (detach): writes are refused from then on; reads, flushes and
    /// publishes go on.
    sealed: AtomicBool,
    /// A head CAS failed in a way a lost reply may explain: the next publish first checks
    /// whether the head moved to a version this journal published (see `publish.rs`).
    ambiguous: AtomicBool,
    /// This volume, for work that must outlive its caller (publishes run in their own task).
    me: std::sync::Weak<Volume>,
    /// The journal (lock order: see the module docs). Taken as
    /// [`Volume::journal`] (which also waits for appends in flight) by everything but the
    /// write fast path.
    writer: tokio::sync::Mutex<Journal>,
    /// The journal's size in bytes ([`Journal::held`]), read by `stats` without its lock.
    journal_held: Arc<std::sync::atomic::AtomicU64>,
    /// Appends reserved under `writer` and being written outside it (see [`Volume::write`]).
    in_flight: AtomicU64,
    /// Woken when `in_flight` falls to zero.
    landed: tokio::sync::Notify,
    /// The sequence numbers of the appends in flight. A write is acknowledged only once none
    /// older than its own is left: replay stops at the first record missing from the journal,
    /// so a record written past one that never lands (a kill -9 between the two `pwrite`s)
    /// would be lost after an acknowledgement the guest builds on (see [`Volume::write`]).
    unlanded: Mutex<std::collections::BTreeSet<u64>>,
    /// Woken when the oldest append in flight lands (or fails to).
    prefix_landed: tokio::sync::Notify,
    state: RwLock<State>,
    sync_lock: tokio::sync::Mutex<()>,
    /// Held for a cut (and by rollback for its whole run).
    cut_lock: tokio::sync::Mutex<()>,
    /// Cuts waiting for `cut_lock` (a compaction gives way to them).
    cut_waiting: std::sync::atomic::AtomicUsize,
    /// Held while one pending layer (or a compaction) is published.
    publish_lock: tokio::sync::Mutex<()>,
    /// Its head is the `livefork` start of a fork of a live workspace (cleared by a publish).
    live_fork: AtomicBool,
    /// A live fork's source, when attached on this node: its first layer waits for the source
    /// to publish only while the source is alive (see `rebase.rs`).
    adopt_source: Mutex<Option<std::sync::Weak<Volume>>>,
    /// Held while segments are retired, and while a live fork links them.
    retire_lock: tokio::sync::Mutex<()>,
    /// Where cuts are recorded (`cutlog.rs`); its lock serialises the records.
    cut_log: Mutex<cutlog::CutLog>,
    /// Receipts of the latest publishes, for callers waiting on a version.
    receipts: Mutex<VecDeque<Published>>,
    acked_seq: AtomicU64,
    synced_seq: AtomicU64,
    published_seq: AtomicU64,
    window: Mutex<Window>,
    /// Woken when the remote window crosses `upload_max_bytes`: the background uploader
    /// publishes at once instead of at its next tick.
    upload_due: Arc<tokio::sync::Notify>,
    publish_total: AtomicU64,
    publish_done: AtomicU64,
    failed: Mutex<Option<String>>,
    closed: AtomicBool,
    counters: Counters,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Everything a volume needs from its engine.
pub(crate) struct VolumeParts {
    pub tenant: String,
    pub name: String,
    pub dir: PathBuf,
    pub fs: Arc<dyn Fs>,
    pub reader: Arc<ObjectReader>,
    pub catalog: Arc<dyn Catalog>,
    pub lease: LeaseGrant,
    /// When the request that obtained `lease` was sent (see [`lease::lease_deadline`]).
    pub lease_asked: Instant,
    pub opts: VolumeOptions,
    pub space: Arc<crate::space::SpaceGuard>,
    /// The tenant's journal quota on this node.
    pub budget: Arc<crate::space::TenantBudget>,
    /// A live fork's start, taken from its source instead of a replay (see `layers.rs`).
    pub inherit: Option<layers::Inheritance>,
}

impl Volume {
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn mode(&self) -> Mode {
        self.mode
    }
    pub fn size(&self) -> u64 {
        self.disk_size.load(SeqCst)
    }
    /// Notified when enough is unpublished that an upload is due (see `maybe_upload`).
    pub(crate) fn upload_due(&self) -> Arc<tokio::sync::Notify> {
        self.upload_due.clone()
    }

    /// Whether background uploads publish this volume (every mode but ephemeral).
    pub fn publishes(&self) -> bool {
        self.mode != Mode::Ephemeral
    }

    /// Whether the remote window holds at least `upload_max_bytes`: an upload is due by size,
    /// and it, not cleaning, will reclaim the journal.
    pub(crate) fn window_full(&self) -> bool {
        lock(&self.window).bytes >= self.opts.upload_max_bytes
    }

    /// Whether FLUSH does anything (false for ephemeral and for `STRATA_VOLUME_CACHE_UNSAFE=1`).
    pub fn flush_honoured(&self) -> bool {
        self.flush_honoured
    }
    pub fn lease(&self) -> LeaseGrant {
        lock(&self.lease).clone()
    }

    fn st(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }
    fn st_mut(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn usable(&self) -> Result<()> {
        if self.closed.load(SeqCst) {
            return Err(Error::Unavailable(self.name.clone(), "detached".into()));
        }
        if let Some(why) = lock(&self.failed).clone() {
            return Err(Error::Unavailable(self.name.clone(), why));
        }
        Ok(())
    }

    /// What a write checks under the gate and the writer lock: usable, not sealed for detach,
    /// and the lease still locally valid.
    fn writable(&self) -> Result<()> {
        self.usable()?;
        if self.sealed.load(SeqCst) {
            return Err(Error::Unavailable(
                self.name.clone(),
                "detaching: writes are no longer accepted".into(),
            ));
        }
        self.lease_valid()
    }

    /// Why the volume refuses writes for good (fenced, failed fsync), if it does.
    pub fn failure(&self) -> Option<String> {
        lock(&self.failed).clone()
    }

    pub(crate) fn fail(&self, why: String) {
        tracing::error!(tenant = %self.tenant, workspace = %self.name, %why, "volume failed; refusing further writes");
        lock(&self.failed).get_or_insert(why);
    }

    /// The volume's local directory (journal, local state).
    pub fn dir(&self) -> &PathBuf {
        &self.dir
    }

    pub fn head_version(&self) -> u64 {
        self.st().base_version
    }

    /// Whether the head is still the `livefork` start of a fork (its data only here).
    pub fn is_live_fork(&self) -> bool {
        self.live_fork.load(SeqCst)
    }

    pub fn stats(&self) -> VolumeStats {
        let c = &self.counters;
        let (overlay_runs, live_blocks, head_version, pending, window_bytes, window_age_ms) = {
            let st = self.st();
            let w = lock(&self.window);
            let layers = st.pending.iter();
            let oldest = layers.clone().find_map(|l| l.since).or(w.since);
            (
                (st.active.runs() + layers.clone().map(|l| l.overlay.runs()).sum::<usize>()) as u64,
                st.active.data_blocks()
                    + layers.clone().map(|l| l.overlay.data_blocks()).sum::<u64>(),
                st.base_version,
                st.pending.len() as u64,
                w.bytes + layers.map(|l| l.bytes).sum::<u64>(),
                oldest.map_or(0, |s| s.elapsed().as_millis() as u64),
            )
        };
        VolumeStats {
            bytes_written: c.bytes_written.load(SeqCst),
            bytes_read: c.bytes_read.load(SeqCst),
            flushes: c.flushes.load(SeqCst),
            fsyncs: c.fsyncs.load(SeqCst),
            publishes: c.publishes.load(SeqCst),
            bytes_uploaded: c.bytes_uploaded.load(SeqCst),
            window_bytes,
            window_age_ms,
            journal_bytes: self.journal_held.load(SeqCst),
            journal_live_bytes: live_blocks * BLOCK_SIZE,
            publish_total_bytes: self.publish_total.load(SeqCst),
            publish_done_bytes: self.publish_done.load(SeqCst),
            overlay_runs,
            pending_versions: pending,
            head_version,
            lease_epoch: self.lease().epoch,
            frozen: self.is_frozen(),
            appends_unlocked: self.counters.appends_unlocked.load(SeqCst),
            appends_grouped: self.counters.appends_grouped.load(SeqCst),
            acks_held: self.counters.acks_held.load(SeqCst),
        }
    }
}

/// Stand-in for a segment file that should exist but does not: every read fails.
struct MissingSegment(u64);

impl FsFile for MissingSegment {
    fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
        Err(std::io::Error::other(format!(
            "journal segment {} missing",
            self.0
        )))
    }
    fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
        Err(std::io::Error::other(format!(
            "journal segment {} missing",
            self.0
        )))
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn set_len(&self, _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn len(&self) -> std::io::Result<u64> {
        Ok(0)
    }
}
