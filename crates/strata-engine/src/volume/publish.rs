//! The publish protocol (checkpoint, background upload, sync-mode flush, detach) and rollback.
//! See the ordering invariants in the parent module's docs.

use super::*;

impl Volume {
    /// This volume's local state with the head it is now based on.
    pub(super) fn local_state(&self, version: u64, manifest: Hash, seq: u64) -> LocalState {
        LocalState {
            format: crate::local::LOCAL_FORMAT,
            tenant: self.tenant.clone(),
            workspace: self.name.clone(),
            journal_id: self.journal_id.clone(),
            base_version: version,
            base_manifest: manifest,
            base_seq: seq,
            created_ms: Some(self.created_ms),
        }
    }

    /// Checkpoints everything acknowledged so far and waits until it is published (in the
    /// object store and the catalog: any node can serve it).
    pub async fn checkpoint(&self, label: Option<String>) -> Result<Published> {
        self.checkpoint_with(label, None, true).await
    }

    /// A checkpoint kept at least until `keep_until_ms` by retention (see `gc`). Without `wait`
    /// it returns once its cut is durable on this node (a `local` receipt, its version
    /// reserved); publication follows in the background, in order (see `layers.rs`).
    pub async fn checkpoint_with(
        &self,
        label: Option<String>,
        keep_until_ms: Option<u64>,
        wait: bool,
    ) -> Result<Published> {
        self.checkpoint_run(label, keep_until_ms, wait, None).await
    }

    /// A checkpoint that reports its cut: `on_cut` receives the cut's sequence number as soon
    /// as the checkpoint's content is fixed (writes after that belong to the next version); it
    /// is dropped unsent if the checkpoint fails before its cut. A caller that paused its
    /// writers (a frozen filesystem) resumes them there.
    pub async fn checkpoint_reporting_cut(
        &self,
        label: Option<String>,
        keep_until_ms: Option<u64>,
        wait: bool,
        on_cut: tokio::sync::oneshot::Sender<u64>,
    ) -> Result<Published> {
        self.checkpoint_run(label, keep_until_ms, wait, Some(on_cut))
            .await
    }

    async fn checkpoint_run(
        &self,
        label: Option<String>,
        keep_until_ms: Option<u64>,
        wait: bool,
        on_cut: Option<tokio::sync::oneshot::Sender<u64>>,
    ) -> Result<Published> {
        self.in_own_task(move |v| async move {
            let started = std::time::Instant::now();
            let spec = CutSpec {
                label,
                keep_until_ms,
                ..CutSpec::of(CheckpointKind::Checkpoint)
            };
            let local = v.cut(spec, on_cut).await?;
            if !wait {
                v.kick();
                return Ok(local);
            }
            // On failure the cut stays pending and is retried (unless the lease was lost).
            // The published receipt comes from the catalog's row: this call's own times go on it.
            let mut p = v.publish_through(local.version).await?;
            p.stall = local.stall;
            p.total = started.elapsed();
            Ok(p)
        })
        .await
    }

    /// Background upload: publishes pending cuts, or cuts and publishes if the remote window
    /// exceeds its bounds.
    pub async fn maybe_upload(&self) -> Result<Option<Published>> {
        if self.has_pending() {
            return self
                .in_own_task(move |v| async move { v.drain(None, None).await })
                .await;
        }
        let due = {
            let w = lock(&self.window);
            w.bytes > 0
                && (w.bytes >= self.opts.upload_max_bytes
                    || w.since
                        .is_some_and(|s| s.elapsed() >= self.opts.upload_interval))
        } || (self.budget.pressed() && lock(&self.window).bytes > 0);
        if !due || self.mode == Mode::Ephemeral {
            return Ok(None);
        }
        let target = self.acked_seq.load(SeqCst);
        self.publish_inner(CheckpointKind::Auto, Some(target))
            .await
            .map(Some)
    }

    /// Grows the disk to `size` bytes (rounded up to whole blocks): a `resize` version holding
    /// everything acknowledged so far on the larger disk, its size committed with the head CAS.
    /// Writes past the old end are accepted once it has committed. None when the disk is
    /// already that large; a smaller size is refused (disks never shrink). A grow whose
    /// publish fails is withdrawn if it certainly did not commit (a head CAS whose reply was
    /// lost is adopted later, as for any publish).
    pub async fn grow(&self, size: u64) -> Result<Option<Published>> {
        let size = size
            .checked_next_multiple_of(BLOCK_SIZE)
            .filter(|s| *s <= strata_format::manifest::MAX_DISK_SIZE)
            .ok_or_else(|| Error::Invalid(format!("disk size {size} is above 1 PiB")))?;
        let now = self.size();
        if size < now {
            return Err(Error::Invalid(format!(
                "the disk has {now} bytes: a disk grows, it never shrinks (asked for {size})"
            )));
        }
        if size == now {
            return Ok(None);
        }
        self.usable()?;
        let p = self
            .in_own_task(move |v| async move {
                let spec = CutSpec {
                    disk_size: size,
                    ..CutSpec::of(CheckpointKind::Resize)
                };
                let local = v.cut(spec, None).await?;
                v.publish_through(local.version).await
            })
            .await?;
        if self.size() < size {
            return Err(Error::Unavailable(
                self.name.clone(),
                "the grow's publish failed; retry".into(),
            ));
        }
        Ok(Some(p))
    }

    pub(crate) async fn publish_kind(&self, kind: CheckpointKind) -> Result<Published> {
        self.publish_inner(kind, None).await
    }

    /// Runs `f` on this volume in a task of its own and waits for it. A publish, rollback or
    /// compaction thus runs to its end even when the caller's future is dropped (an HTTP client
    /// that goes away, a detach aborting the background uploader): its state changes (cut,
    /// pending layers, head CAS, new base) never stop halfway.
    pub(super) async fn in_own_task<T, Fut>(&self, f: impl FnOnce(Arc<Volume>) -> Fut) -> Result<T>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Unavailable(self.name.clone(), "detached".into()))?;
        tokio::spawn(f(me))
            .await
            .map_err(|e| Error::Unavailable(self.name.clone(), format!("publish task: {e}")))?
    }

    /// Publishes everything acknowledged so far (through `upto` if given: an earlier cut that
    /// covers it is enough, the group commit of sync-mode flushes), in its own task.
    pub(super) async fn publish_inner(
        &self,
        kind: CheckpointKind,
        upto: Option<u64>,
    ) -> Result<Published> {
        self.in_own_task(move |v| async move { v.publish_run(kind, upto).await })
            .await
    }

    async fn publish_run(&self, kind: CheckpointKind, upto: Option<u64>) -> Result<Published> {
        // The cut lock is held for the cut only: later checkpoints need not wait for uploads.
        let through = {
            let c = self.cut_lock.lock().await;
            self.cut_for(&c, kind, upto).await?
        };
        match through {
            Some(v) => self.publish_through(v).await,
            None => Ok(self.current_receipt()),
        }
    }

    /// The version that publishing everything acknowledged (through `upto` if given) must
    /// reach: an earlier cut that covers it is enough (the group commit of sync-mode flushes),
    /// otherwise a new cut of `kind`; without `upto`, every cut pending. None when it is all
    /// published already.
    pub(super) async fn cut_for(
        &self,
        c: &tokio::sync::MutexGuard<'_, ()>,
        kind: CheckpointKind,
        upto: Option<u64>,
    ) -> Result<Option<u64>> {
        self.usable()?;
        let target = upto.unwrap_or_else(|| self.acked_seq.load(SeqCst));
        // A live fork's head is only a base: its first publish always makes a version, even
        // with nothing new since the fork (or the fork could never leave this node).
        if self.published_seq.load(SeqCst) >= target
            && (upto.is_some() || !self.has_pending())
            && !self.is_live_fork()
        {
            return Ok(None);
        }
        let v = match self.pending_covering(target) {
            Some(v) => v,
            None => self.cut_locked(c, CutSpec::of(kind), None).await?.version,
        };
        let last = self.st().pending.back().map_or(v, |l| l.rec.version);
        Ok(Some(if upto.is_some() { v } else { last.max(v) }))
    }

    /// The receipt of the base (nothing left to publish).
    fn current_receipt(&self) -> Published {
        let st = self.st();
        Published {
            version: st.base_version,
            manifest: Some(st.base_id),
            cut_seq: self.published_seq.load(SeqCst),
            bytes_uploaded: 0,
            stall: Duration::ZERO,
            total: Duration::ZERO,
            state: CheckpointState::Published,
        }
    }

    /// Makes a committed head version (`manifest` holding every write up to `cut`) this
    /// volume's base, records it locally, then retires the journal segments it covers.
    pub(super) async fn finish_publish(
        &self,
        version: u64,
        manifest: Hash,
        m: Arc<Manifest>,
        cut: u64,
        bytes: u64,
    ) {
        // Writes may reach the end of the disk this version describes from now on.
        self.disk_size.fetch_max(m.disk_size, SeqCst);
        {
            let mut st = self.st_mut();
            // A local rollback to this version reads it from here on (later publishes move
            // the base past it).
            for l in st.pending.iter_mut() {
                if l.rec.rollback_to == Some(version) {
                    l.under = Some((manifest, m.clone()));
                }
            }
            st.base = m;
            st.base_id = manifest;
            st.base_version = version;
            // The layers through this version are in the new base (two cuts with no write
            // between them share a sequence number: the version tells them apart) …
            while st.pending.front().is_some_and(|l| l.rec.version <= version) {
                st.pending.pop_front();
            }
            // … and so are runs of the active overlay up to it (a layer folded back before an
            // ambiguous CAS that had committed); keeping them would pin segments about to go.
            let runs = st.active.runs();
            st.active.drop_through(cut);
            if st.active.runs() != runs {
                let mut w = lock(&self.window);
                w.bytes = st.active.data_blocks() * BLOCK_SIZE;
                if w.bytes == 0 {
                    w.since = None;
                }
            }
        }
        self.published_seq.fetch_max(cut, SeqCst);
        self.live_fork.store(false, SeqCst);
        self.counters.publishes.fetch_add(1, SeqCst);
        self.counters.bytes_uploaded.fetch_add(bytes, SeqCst);
        // Local state first, then drop the segments it covers.
        let ls = self.local_state(version, manifest, cut);
        let cleanup = async {
            ls.store(&*self.fs, &self.dir)?;
            self.retire_through(cut).await
        };
        if let Err(e) = cleanup.await {
            // The head is published; only local cleanup failed. Replay handles leftovers.
            tracing::warn!(tenant = %self.tenant, workspace = %self.name, error = %e, "post-publish cleanup failed");
        }
    }

    /// Retires every sealed segment whose records are all `<= cut` (published): taken out of
    /// the journal under the writer lock (in memory only), renamed or unlinked without it.
    /// A segment a read still holds is unlinked, never recycled (see [`SegFile`]).
    async fn retire_through(&self, cut: u64) -> Result<()> {
        let _r = self.retire_lock.lock().await;
        let retired = self.journal().await.detach_through(cut);
        let handles: Vec<_> = {
            let mut st = self.st_mut();
            retired
                .ids
                .iter()
                .filter_map(|id| st.files.remove(id).map(|f| (*id, f)))
                .collect()
        };
        self.apply_retired(retired, handles, "retiring published segments")
            .await
    }

    /// Renames or unlinks segments detached from the journal (and syncs the directory) on a
    /// blocking thread, without the writer lock; `handles` are their files, taken out of the
    /// state: one a read still holds is unlinked, never recycled. The recycled files then
    /// join the journal's pool.
    pub(super) async fn apply_retired(
        &self,
        retired: crate::journal::Retired,
        handles: Vec<(u64, SegFile)>,
        what: &'static str,
    ) -> Result<()> {
        let busy: Vec<u64> = handles
            .iter()
            .filter(|(_, f)| f.in_use())
            .map(|(id, _)| *id)
            .collect();
        let ids = retired.ids.clone();
        let free = tokio::task::spawn_blocking(move || {
            let free = retired.apply(&busy);
            drop(handles);
            free
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
        let free = match free {
            Ok(free) => free,
            Err(e) => {
                // The journal no longer lists these segments, but some may still be on disk:
                // deleting any later one (the next retirement or cleaning pass) would leave a
                // gap that ends replay before flushed records. The volume stops here; its
                // journal as it stands replays correctly.
                self.fail(format!("{what}: {e}"));
                return Err(Error::io(what)(e));
            }
        };
        self.journal().await.retired(&ids, free);
        Ok(())
    }

    /// Settles a head CAS whose outcome was unknown or that conflicted: if the head moved to a
    /// version this volume's journal published (its receipt names our journal id), that
    /// publish committed with its reply lost: its manifest becomes the base. Otherwise nothing
    /// changes, and the data it carried is still in the active overlay.
    pub(super) async fn resolve_ambiguous(&self) -> Result<()> {
        if !self.ambiguous.swap(false, SeqCst) {
            return Ok(());
        }
        let settle = async {
            let ws = self.catalog.get_workspace(&self.tenant, &self.name).await?;
            if ws.head_version <= self.st().base_version {
                self.keep_undecided(); // It did not commit.
                return Ok(());
            }
            let cp = self
                .catalog
                .get_checkpoint(&self.tenant, &self.name, ws.head_version)
                .await?;
            if cp.journal_id.as_deref() != Some(self.journal_id.as_str()) {
                return Ok(()); // Moved by someone else: the next CAS reports it.
            }
            // Only the front pending cut can have committed unseen (publishes run in order,
            // and compaction and rollback settle their own outcome): anything else adopted here
            // would be taken for that cut's publish and drop its data.
            let front = self
                .st()
                .pending
                .front()
                .map(|l| (l.rec.version, l.rec.cut, l.rec.kind));
            if let Some((v, cut, kind)) = front {
                if (v, cut, kind) != (ws.head_version, cp.cut_seq, cp.kind) {
                    self.fail(format!(
                        "version {} ({}) committed with its reply lost, but the cut pending is v{v} ({}); re-attach the workspace",
                        ws.head_version,
                        cp.kind.as_str(),
                        kind.as_str()
                    ));
                    return Ok(());
                }
            }
            let layered = self
                .st()
                .pending
                .front()
                .is_some_and(|l| l.rec.rollback_to.is_some());
            if cp.kind == CheckpointKind::Rollback && !layered {
                // A rollback changes what blocks read: adopting one now would
                // change data under a running guest. They settle themselves (see `rollback`);
                // one that did not is a volume that must be re-attached.
                self.fail(format!(
                    "version {} ({}) committed with its reply lost; re-attach the workspace",
                    ws.head_version,
                    cp.kind.as_str()
                ));
                return Ok(());
            }
            let m = self
                .reader
                .store()
                .get_manifest(&self.tenant, &ws.head_manifest)
                .await?;
            tracing::info!(tenant = %self.tenant, workspace = %self.name, version = ws.head_version, "a publish whose reply was lost had committed; adopting it");
            self.finish_publish(
                ws.head_version,
                ws.head_manifest,
                Arc::new(m),
                cp.cut_seq,
                0,
            )
            .await;
            // Its receipt, for whoever waits for that version.
            self.remember(Published {
                version: ws.head_version,
                manifest: Some(ws.head_manifest),
                cut_seq: cp.cut_seq,
                bytes_uploaded: 0,
                stall: Duration::ZERO,
                total: Duration::ZERO,
                state: CheckpointState::Published,
            });
            Ok::<_, Error>(())
        };
        let r = settle.await;
        if r.is_err() {
            self.ambiguous.store(true, SeqCst);
        }
        r
    }

    pub(super) async fn publish_cut(
        &self,
        frozen: &Overlay,
        base: &Manifest,
        base_version: u64,
        rec: &LayerRecord,
    ) -> Result<(u64, Hash, Manifest, u64)> {
        let uploads_began = Instant::now();
        let files: HashMap<u64, Arc<dyn FsFile>> = self
            .st()
            .files
            .iter()
            .map(|(id, f)| (*id, f.file.clone()))
            .collect();
        // 2. Pack and upload every live block <= cut.
        self.publish_done.store(0, SeqCst);
        self.publish_total
            .store(frozen.data_blocks() * BLOCK_SIZE, SeqCst);
        let packed = pack(
            &self.reader,
            &self.tenant,
            frozen,
            &files,
            self.opts.object_target_bytes,
            &self.publish_done,
        )
        .await;
        self.publish_total.store(0, SeqCst);
        let packed = packed?;
        // 3. The new cumulative manifest, on the larger disk if a grow asked for one.
        let mut m = base.apply(&packed.changes)?;
        m.disk_size = m.disk_size.max(rec.disk_size);
        let id = self.reader.store().put_manifest(&self.tenant, &m).await?;
        self.catalog
            .record_manifest(&self.tenant, id, &m.objects)
            .await?;
        // GC may collect objects that stay unreferenced longer than its grace period: a publish
        // slower than half of it gives up (its retry uploads fresh, salted keys).
        if uploads_began.elapsed() > self.opts.publish_deadline {
            return Err(Error::Unavailable(
                self.name.clone(),
                format!(
                    "publish took {:?}, more than half the GC grace period; retrying with new objects",
                    uploads_began.elapsed()
                ),
            ));
        }
        // 4 + 5. Move the head (expected version, lease epoch) and record the receipt.
        let cp = NewCheckpoint {
            manifest: id,
            disk_size: m.disk_size,
            label: rec.label.clone(),
            kind: rec.kind,
            bytes: packed.bytes_uploaded,
            cut_seq: rec.cut,
            journal_id: Some(self.journal_id.clone()),
            keep_until_ms: self.keep_for(rec),
        };
        let version = self.advance_head(base_version, &cp).await?;
        Ok((version, id, m, packed.bytes_uploaded))
    }

    /// The head CAS of a publish (step 4). When it fails, the head is read back: if it moved
    /// one version on to this very receipt (this publish's manifest, our journal, our cut),
    /// it committed and only the reply was lost. When that cannot be told now (the head is
    /// unreadable, or a conflict that an earlier lost reply may explain), `ambiguous` is set and
    /// the next publish settles it first ([`Volume::resolve_ambiguous`]), so the volume never
    /// keeps conflicting with itself.
    pub(super) async fn advance_head(&self, base_version: u64, cp: &NewCheckpoint) -> Result<u64> {
        let lease = self.lease();
        let err = match self
            .catalog
            .advance_head(&self.tenant, &self.name, base_version, &lease, cp)
            .await
        {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        match self.committed(base_version, cp).await {
            Ok(Some(v)) => {
                tracing::info!(tenant = %self.tenant, workspace = %self.name, version = v, error = %err, "head CAS reported an error but had committed");
                return Ok(v);
            }
            _ if matches!(
                err,
                CatalogError::Backend { .. } | CatalogError::Conflict { .. }
            ) =>
            {
                self.ambiguous.store(true, SeqCst);
            }
            _ => self.keep_undecided(), // Not committed: its retention was not decided.
        }
        Err(err.into())
    }

    /// Whether the head moved past `base_version` to exactly the receipt `cp` (its manifest,
    /// kind, this journal and cut): Some(version) if so.
    async fn committed(&self, base_version: u64, cp: &NewCheckpoint) -> Result<Option<u64>> {
        let ws = self.catalog.get_workspace(&self.tenant, &self.name).await?;
        if ws.head_version <= base_version || ws.head_manifest != cp.manifest {
            return Ok(None);
        }
        let r = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, ws.head_version)
            .await?;
        let ours = r.journal_id == cp.journal_id && r.cut_seq == cp.cut_seq && r.kind == cp.kind;
        Ok(ours.then_some(ws.head_version))
    }

    /// Rolls the head back to `version`'s manifest as a new version, after publishing the
    /// current state (so history keeps every acknowledged write). No write is in flight while it
    /// runs; on a frozen volume it runs inside the freeze (an orchestrator restoring a paired
    /// memory snapshot rolls the disk back before it thaws).
    /// `local`: a target still local on this node is rolled back to at once (a `local`
    /// receipt, published later); otherwise everything is published first, then the head moves
    /// (an error then means nothing changed).
    pub(crate) async fn rollback(&self, version: u64, local: bool) -> Result<Published> {
        self.in_own_task(move |v| async move {
            v.exclusive(async || v.rollback_exclusive(version, local).await)
                .await
        })
        .await
    }

    /// Reads the head back until it says whether `cp` committed (Some(version)) or not (Err:
    /// the caller's error stands). If the catalog stays unreadable, the volume fails: it must
    /// not go on writing on a base that may no longer be the head.
    pub(super) async fn settle(&self, base_version: u64, cp: &NewCheckpoint) -> Result<u64> {
        for _ in 0..40 {
            match self.committed(base_version, cp).await {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {
                    return Err(Error::Unavailable(
                        self.name.clone(),
                        "did not commit".into(),
                    ))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
        self.fail(format!(
            "the outcome of a {} could not be read back from the catalog; re-attach the workspace",
            cp.kind.as_str()
        ));
        Err(Error::Unavailable(
            self.name.clone(),
            "outcome unknown".into(),
        ))
    }

    async fn rollback_exclusive(&self, version: u64, local: bool) -> Result<Published> {
        // No cut while the head is replaced: versions reserved by cuts must stay the ones
        // they commit as. Everything acknowledged is published first (a local target too).
        let c = self.cut_lock.lock().await;
        let pending_target = {
            let st = self.st();
            version > st.base_version && version <= st.base_version + st.pending.len() as u64
        };
        if local && pending_target && !self.has_pending_grow() {
            // A local checkpoint: rolled back at once, published later (see `rebase.rs`).
            match self.rollback_local(&c, version).await? {
                None => {} // The published way, below.
                Some(p) => {
                    self.kick();
                    return Ok(p);
                }
            }
        }
        let still_pending = {
            let st = self.st();
            version > st.base_version && version <= st.base_version + st.pending.len() as u64
        };
        if !still_pending {
            // Published (possibly meanwhile), or unknown.
            self.catalog
                .get_checkpoint(&self.tenant, &self.name, version)
                .await?;
        }
        if let Some(v) = self.cut_for(&c, CheckpointKind::Auto, None).await? {
            self.publish_through(v).await?;
        }
        let target = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, version)
            .await?;
        if target.kind == CheckpointKind::LiveFork {
            return Err(Error::Invalid(format!(
                "version {version} is the start of a fork of a live workspace, not its data: roll back to a later version"
            )));
        }
        let _p = self.publish_lock.lock().await;
        self.usable()?;
        // A flag left by an earlier publish is settled first: it is not this rollback's.
        self.resolve_ambiguous().await?;
        let started = Instant::now();
        let m = self
            .reader
            .store()
            .get_manifest(&self.tenant, &target.manifest)
            .await?;
        let (manifest, m) = self.on_todays_disk(target.manifest, m).await?;
        let base_version = self.st().base_version;
        let cut = self.acked_seq.load(SeqCst);
        let cp = NewCheckpoint {
            manifest,
            disk_size: m.disk_size,
            label: Some(format!("rollback to v{version}")),
            kind: CheckpointKind::Rollback,
            bytes: 0,
            cut_seq: cut,
            journal_id: Some(self.journal_id.clone()),
            keep_until_ms: None,
        };
        let new_version = match self.advance_head(base_version, &cp).await {
            Ok(v) => v,
            Err(e) if self.ambiguous.swap(false, SeqCst) => {
                // Its outcome is unknown: settle it before writes resume, since adopting it
                // later would change what blocks read under a running guest.
                self.settle(base_version, &cp).await.map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        {
            let mut st = self.st_mut();
            st.base = Arc::new(m);
            st.base_id = manifest;
            st.base_version = new_version;
        }
        self.published_seq.fetch_max(cut, SeqCst);
        // The head and its receipt (journal, cut) are committed: a failed local record only
        // costs a replay that the receipt resolves (see `open.rs`).
        if let Err(e) = self
            .local_state(new_version, manifest, cut)
            .store(&*self.fs, &self.dir)
        {
            tracing::warn!(tenant = %self.tenant, workspace = %self.name, error = %e, "recording the rollback locally failed");
        }
        Ok(Published {
            version: new_version,
            manifest: Some(manifest),
            cut_seq: cut,
            bytes_uploaded: 0,
            stall: Duration::ZERO,
            total: started.elapsed(),
            state: CheckpointState::Published,
        })
    }
}
