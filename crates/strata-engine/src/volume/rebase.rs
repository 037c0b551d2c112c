//! Layers that publish as a manifest that already exists: a live fork's first layer (the
//! fork rebases onto its source's checkpoint) and a local rollback.
//!
//! **Rebase.** A live fork rebases onto its source's checkpoint instead of uploading the same
//! data again.
//!
//! The fork starts (version 1, kind `livefork`) at its source's published base, with one
//! recorded layer on top holding what the source had not yet published at the fork's cut: the
//! disk at the source's local checkpoint `V` exactly. When the source publishes `V`, that layer
//! publishes as `V`'s manifest (version 2 of the fork, nothing uploaded); the fork's own writes
//! then publish on top of it as usual.
//!
//! The catalog's checkpoint `V` is taken only if it is that very cut: the source's journal and
//! cut sequence number (a node that took the source over after a crash of this one may have
//! committed other data as `V`). If `V` is not that cut, if the source is gone, or it does not
//! publish within the publish deadline, the layer is uploaded like any other: the rebase saves
//! work and space, correctness never depends on it. The head invariant holds either way: the
//! fork's head names only a manifest already fully in the object store.
//!
//! **Local rollback.** A rollback to a version still pending on this node is a cut too: what
//! was acknowledged is cut first (its own version, so history keeps it), then an empty layer
//! that names the target. Reads under that layer see only layers up to the target, then the
//! target's manifest once it is published (`Volume::plan`). It publishes, in order, as a
//! `rollback` version whose manifest is the target's (on today's disk size: a disk never
//! shrinks). Its receipt is `local` at once, like a checkpoint's, and survives a crash the same
//! way (the layer is recorded in `cuts.log` with its target).

use super::cutlog::Entry;
use super::layers::{Adopt, CheckpointState, CutSpec, Layer, LayerRecord, MAX_PENDING};
use super::*;

/// A new live fork's first layer (version 2, through the source's cut): the one entry of its
/// cut log, staged by the fork with its other files before its local state (`engine/fork.rs`).
pub(crate) fn fork_layer(adopt: &Adopt) -> Entry {
    Entry::Cut(LayerRecord {
        cut: adopt.cut,
        version: 2,
        kind: CheckpointKind::Auto,
        label: None,
        keep_until_ms: None,
        disk_size: 0,
        taken_ms: crate::now_ms(),
        adopt: Some(adopt.clone()),
        rollback_to: None,
    })
}

/// How long a live fork's first layer waits for its source's checkpoint when the source is
/// not known to be alive on this node (after a restart, or once it failed or was let go):
/// then the fork uploads its own data.
const ORPHAN_WAIT: Duration = Duration::from_secs(30);

impl Volume {
    /// The source a pending live fork's first layer waits for, if any.
    pub(crate) fn adopt_source(&self) -> Option<String> {
        let st = self.st();
        st.pending
            .front()
            .and_then(|l| l.rec.adopt.as_ref())
            .map(|a| a.workspace.clone())
    }

    /// Tells a live fork its source's volume (attached here).
    pub(crate) fn set_adopt_source(&self, src: &Arc<Volume>) {
        *lock(&self.adopt_source) = Some(Arc::downgrade(src));
    }

    /// Whether the source this fork waits for is attached here and can still publish.
    fn source_alive(&self) -> bool {
        lock(&self.adopt_source)
            .as_ref()
            .and_then(|w| w.upgrade())
            .is_some_and(|s| s.failure().is_none() && !s.closed.load(SeqCst))
    }

    /// Publishes the layer `rec` as the source checkpoint `a` once the catalog has it: Some
    /// receipt, or None when that checkpoint will not come (the caller uploads the layer).
    pub(super) async fn publish_adopted(
        &self,
        rec: &LayerRecord,
        a: &Adopt,
        base_version: u64,
    ) -> Result<Option<Published>> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(10);
        let cp = loop {
            self.usable()?;
            // The head first, then the row: a row missing once the head was already past it
            // before the look is gone for good (not about to be committed).
            let head = match self.catalog.get_workspace(&self.tenant, &a.workspace).await {
                Ok(w) => w.head_version,
                Err(CatalogError::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            match self
                .catalog
                .get_checkpoint(&self.tenant, &a.workspace, a.version)
                .await
            {
                Ok(cp) => {
                    // The fork's cut is a checkpoint (never withdrawn): a number of another kind
                    // with the same journal and cut is not it.
                    let same = cp.journal_id.as_deref() == Some(a.journal.as_str())
                        && cp.cut_seq == a.cut
                        && cp.kind == CheckpointKind::Checkpoint;
                    if !same {
                        tracing::info!(tenant = %self.tenant, workspace = %self.name, source = %a.workspace, version = a.version, "the source's version is not the fork's cut; uploading the fork's data instead");
                        return Ok(None);
                    }
                    break cp;
                }
                Err(CatalogError::NotFound { .. }) if head >= a.version => return Ok(None),
                Err(CatalogError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            // A live source publishes it in order (however much it had pending); a source that
            // failed, was let go without it, or is not here may never.
            let limit = if self.source_alive() {
                self.opts.publish_deadline
            } else {
                ORPHAN_WAIT.min(self.opts.publish_deadline)
            };
            if started.elapsed() > limit {
                tracing::warn!(tenant = %self.tenant, workspace = %self.name, source = %a.workspace, version = a.version, "the source did not publish the fork's checkpoint in time; uploading the fork's data instead");
                return Ok(None);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        };
        let m = self
            .reader
            .store()
            .get_manifest(&self.tenant, &cp.manifest)
            .await?;
        if m.disk_size != self.size() {
            return Ok(None); // Not the fork's disk (a fork is never made across a grow).
        }
        tracing::info!(tenant = %self.tenant, workspace = %self.name, source = %a.workspace, source_version = a.version, "a live fork rebases onto its source's checkpoint");
        self.publish_existing(rec, cp.manifest, m, base_version, started)
            .await
            .map(Some)
    }

    /// Rolls back to the pending version `version` at once (see the module docs); None when
    /// it cannot be done locally any more (the target's retention was decided meanwhile, or too
    /// many cuts are pending): then nothing was rolled back and the caller takes the published
    /// way. The caller holds the cut lock, inside an exclusive section (no write in flight);
    /// publication goes on meanwhile.
    ///
    /// The rollback's layer is made durable *before* it is pushed (it is empty: nothing to
    /// sync), so no publish can take it before its receipt is certain; a failure after its
    /// record withdraws it by a record of its own, and if even that fails the volume fails (the
    /// outcome would be unknown after a restart).
    pub(super) async fn rollback_local(
        &self,
        c: &tokio::sync::MutexGuard<'_, ()>,
        version: u64,
    ) -> Result<Option<Published>> {
        let started = Instant::now();
        // Everything acknowledged so far becomes a version of its own (no write is in flight:
        // what the active overlay holds is exactly what no cut holds).
        if self.st().active.runs() > 0 {
            self.cut_locked(c, CutSpec::of(CheckpointKind::Auto), None)
                .await?;
        }
        self.usable()?;
        self.lease_valid()?;
        if self.sealed.load(SeqCst) {
            return Err(Error::Unavailable(
                self.name.clone(),
                "detaching: no new checkpoint is taken".into(),
            ));
        }
        let rec = {
            // The writer lock orders the cut against appends (none is in flight: every record
            // written is in an earlier cut).
            let j = self.journal_whole().await?;
            let st = self.st();
            if !self.rollback_target_open(&st, version) || st.pending.len() + 1 >= MAX_PENDING {
                return Ok(None);
            }
            // Base + pending stays the same while layers publish, and no other cut is taken.
            LayerRecord {
                cut: j.last_seq(),
                version: st.base_version + st.pending.len() as u64 + 1,
                kind: CheckpointKind::Rollback,
                label: Some(format!("rollback to v{version}")),
                keep_until_ms: None,
                disk_size: 0,
                taken_ms: crate::now_ms(),
                adopt: None,
                rollback_to: Some(version),
            }
        };
        // Withdraws the recorded layer; an error if even that fails (the outcome is then
        // unknown after a restart, so the volume fails).
        let withdraw = async || -> Result<()> {
            let w = Entry::Withdraw {
                version: rec.version,
            };
            self.record(w).await.map_err(|w| {
                self.fail(format!(
                    "a failed rollback to v{version} could not be withdrawn ({w}); re-attach the workspace"
                ));
                Error::Unavailable(
                    self.name.clone(),
                    format!("the outcome of the rollback to v{version} is unknown ({w}); re-attach the workspace"),
                )
            })
        };
        if let Err(e) = self
            .record_also(Entry::Cut(rec.clone()), Some(rec.clone()))
            .await
        {
            return Err(withdraw().await.err().unwrap_or(e));
        }
        // Pushed only if still valid: the lease (as for any receipt) and the target.
        let pushed = {
            let lease = self.lease_valid();
            let mut st = self.st_mut();
            match lease {
                Err(e) => Err(e),
                Ok(()) if !self.rollback_target_open(&st, version) => Ok(false),
                Ok(()) => {
                    let under = (version == st.base_version).then(|| (st.base_id, st.base.clone()));
                    debug_assert_eq!(st.active.runs(), 0);
                    st.pending.push_back(Layer {
                        rec: rec.clone(),
                        overlay: Arc::new(Overlay::default()),
                        bytes: 0,
                        since: None,
                        under,
                    });
                    Ok(true)
                }
            }
        };
        match pushed {
            Ok(true) => Ok(Some(Published {
                version: rec.version,
                manifest: None,
                cut_seq: rec.cut,
                bytes_uploaded: 0,
                stall: Duration::ZERO,
                total: started.elapsed(),
                state: CheckpointState::Local,
            })),
            Ok(false) => withdraw().await.map(|()| None),
            Err(e) => Err(withdraw().await.err().unwrap_or(e)),
        }
    }

    /// Whether a rollback layer may still target `version` locally: it is pending, or the base
    /// whose retention no publish has decided yet (`keep_for` fixes it once, at the CAS), or
    /// another pending rollback already targets it (its retention was extended then).
    fn rollback_target_open(&self, st: &State, version: u64) -> bool {
        let pending =
            version > st.base_version && version <= st.base_version + st.pending.len() as u64;
        let undecided = version > st.keep_fixed;
        let targeted = st
            .pending
            .iter()
            .any(|l| l.rec.rollback_to == Some(version));
        (pending && undecided) || (version == st.base_version && targeted)
    }

    /// Publishes the rollback layer `rec` (to `target`, published before it) as the target's
    /// manifest.
    pub(super) async fn publish_rolled_back(
        &self,
        rec: &LayerRecord,
        target: u64,
        base_version: u64,
    ) -> Result<Published> {
        let started = Instant::now();
        let under = {
            let st = self.st();
            st.pending
                .front()
                .filter(|l| l.rec.version == rec.version)
                .and_then(|l| l.under.clone())
        };
        let Some((target_id, m)) = under else {
            // Published in order, so the target is; its manifest was kept when it was.
            return Err(Error::Unavailable(
                self.name.clone(),
                format!("the rollback to v{target} has no manifest for its target; re-attach the workspace"),
            ));
        };
        // Made from a row read now (GC's rule for a new reference): the target is still
        // retained (see `keep_for`) with that manifest.
        let row = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, target)
            .await?;
        if row.manifest != target_id {
            return Err(Error::Unavailable(
                self.name.clone(),
                format!("the rollback's target v{target} names another manifest in the catalog"),
            ));
        }
        let (manifest, m) = self.on_todays_disk(target_id, (*m).clone()).await?;
        self.publish_existing(rec, manifest, m, base_version, started)
            .await
    }

    /// `m` (stored as `id`) on today's disk size: a disk never shrinks (a mounted filesystem
    /// must not find its end gone), so an older, smaller version comes back with its new end
    /// reading as zeros, as a new manifest.
    pub(super) async fn on_todays_disk(
        &self,
        id: Hash,
        mut m: Manifest,
    ) -> Result<(Hash, Manifest)> {
        if m.disk_size >= self.size() {
            return Ok((id, m));
        }
        m.disk_size = self.size();
        let id = self.reader.store().put_manifest(&self.tenant, &m).await?;
        self.catalog
            .record_manifest(&self.tenant, id, &m.objects)
            .await?;
        Ok((id, m))
    }

    /// Publishes the layer `rec` as `manifest` (already in the store, `m`): the head CAS and
    /// the new base, nothing uploaded.
    async fn publish_existing(
        &self,
        rec: &LayerRecord,
        manifest: Hash,
        m: Manifest,
        base_version: u64,
        started: Instant,
    ) -> Result<Published> {
        let cp = NewCheckpoint {
            manifest,
            disk_size: m.disk_size,
            label: rec.label.clone(),
            kind: rec.kind,
            bytes: 0,
            cut_seq: rec.cut,
            journal_id: Some(self.journal_id.clone()),
            keep_until_ms: self.keep_for(rec),
        };
        let version = self.advance_head(base_version, &cp).await?;
        self.finish_publish(version, manifest, Arc::new(m), rec.cut, 0)
            .await;
        Ok(Published {
            version,
            manifest: Some(manifest),
            cut_seq: rec.cut,
            bytes_uploaded: 0,
            stall: Duration::ZERO,
            total: started.elapsed(),
            state: CheckpointState::Published,
        })
    }
}
