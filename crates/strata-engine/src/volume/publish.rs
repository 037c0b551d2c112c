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
        }
    }

    /// Publishes everything acknowledged so far as a new head version (a checkpoint).
    pub async fn checkpoint(&self, label: Option<String>) -> Result<Published> {
        self.checkpoint_with(label, None).await
    }

    /// A checkpoint kept at least until `keep_until_ms` by retention (see `gc`).
    pub async fn checkpoint_with(
        &self,
        label: Option<String>,
        keep_until_ms: Option<u64>,
    ) -> Result<Published> {
        self.publish_inner(CheckpointKind::Checkpoint, (label, keep_until_ms), None)
            .await
    }

    /// Background upload: publishes if the remote window exceeds its bounds.
    pub async fn maybe_upload(&self) -> Result<Option<Published>> {
        let due = {
            let w = lock(&self.window);
            w.bytes > 0
                && (w.bytes >= self.opts.upload_max_bytes
                    || w.since
                        .is_some_and(|s| s.elapsed() >= self.opts.upload_interval))
        };
        if !due || self.mode == Mode::Ephemeral {
            return Ok(None);
        }
        let target = self.acked_seq.load(SeqCst);
        self.publish_inner(CheckpointKind::Auto, (None, None), Some(target))
            .await
            .map(Some)
    }

    pub(crate) async fn publish_kind(&self, kind: CheckpointKind) -> Result<Published> {
        self.publish_inner(kind, (None, None), None).await
    }

    /// The checkpoint protocol (see the module docs). With `upto`, returns early if an earlier
    /// publish already covered that sequence number (group commit for sync-mode flushes).
    pub(super) async fn publish_inner(
        &self,
        kind: CheckpointKind,
        (label, keep_until_ms): (Option<String>, Option<u64>),
        upto: Option<u64>,
    ) -> Result<Published> {
        let started = Instant::now();
        let _p = self.publish_lock.lock().await;
        self.usable()?;
        // Background and detach publishes with nothing new add no version (explicit
        // checkpoints always do: they carry a label or a retention promise).
        let nothing_new = self.acked_seq.load(SeqCst) <= self.published_seq.load(SeqCst);
        let upto = match kind {
            CheckpointKind::Auto | CheckpointKind::Detach if nothing_new => Some(upto.unwrap_or(0)),
            _ => upto,
        };
        if let Some(t) = upto {
            if self.published_seq.load(SeqCst) >= t {
                let st = self.st();
                return Ok(Published {
                    version: st.base_version,
                    manifest: st.base_id,
                    cut_seq: self.published_seq.load(SeqCst),
                    bytes_uploaded: 0,
                    stall: Duration::ZERO,
                    total: started.elapsed(),
                });
            }
        }
        // 1. Cut.
        let stall_start = Instant::now();
        let (cut, frozen, base, base_version) = {
            let mut j = self.writer.lock().await;
            let cut = j.last_seq();
            let (id, f) = j.rotate().map_err(Error::io("rotating journal segment"))?;
            let mut st = self.st_mut();
            st.files.insert(id, f);
            let frozen = Arc::new(std::mem::take(&mut st.active));
            st.frozen = Some(frozen.clone());
            let mut w = lock(&self.window);
            w.cutting = true;
            w.after_bytes = 0;
            w.after_since = None;
            (cut, frozen, st.base.clone(), st.base_version)
        };
        let stall = stall_start.elapsed();
        let res = self
            .publish_cut(
                &frozen,
                &base,
                base_version,
                cut,
                kind,
                (label, keep_until_ms),
            )
            .await;
        match res {
            Ok((version, manifest, m, bytes)) => {
                {
                    let mut st = self.st_mut();
                    st.base = Arc::new(m);
                    st.base_id = manifest;
                    st.base_version = version;
                    st.frozen = None;
                    let mut w = lock(&self.window);
                    w.bytes = w.after_bytes;
                    w.since = w.after_since;
                    w.cutting = false;
                }
                self.published_seq.fetch_max(cut, SeqCst);
                self.counters.publishes.fetch_add(1, SeqCst);
                self.counters.bytes_uploaded.fetch_add(bytes, SeqCst);
                // Local state first, then drop the segments it covers.
                let ls = self.local_state(version, manifest, cut);
                let cleanup = async {
                    ls.store(&*self.fs, &self.dir)?;
                    // Detached under the writer lock (in memory only), retired without it.
                    let retired = self.writer.lock().await.detach_through(cut);
                    let handles: Vec<_> = {
                        let mut st = self.st_mut();
                        retired
                            .ids
                            .iter()
                            .filter_map(|id| st.files.remove(id))
                            .collect()
                    };
                    let free = tokio::task::spawn_blocking(move || {
                        let free = retired.apply();
                        drop(handles);
                        free
                    })
                    .await
                    .map_err(std::io::Error::other)
                    .and_then(|r| r)
                    .map_err(Error::io("retiring published segments"))?;
                    self.writer.lock().await.add_free(free);
                    Ok::<_, Error>(())
                };
                if let Err(e) = cleanup.await {
                    // The head is published; only local cleanup failed. Replay handles leftovers.
                    tracing::warn!(workspace = %self.name, error = %e, "post-publish cleanup failed");
                }
                Ok(Published {
                    version,
                    manifest,
                    cut_seq: cut,
                    bytes_uploaded: bytes,
                    stall,
                    total: started.elapsed(),
                })
            }
            Err(e) => {
                // Fold the frozen overlay back under the active one: nothing is lost.
                let mut st = self.st_mut();
                let active = std::mem::take(&mut st.active);
                st.active = active.over(&frozen);
                st.frozen = None;
                lock(&self.window).cutting = false;
                if let Error::Catalog(CatalogError::Fenced { .. }) = &e {
                    self.fail(e.to_string());
                }
                Err(e)
            }
        }
    }

    async fn publish_cut(
        &self,
        frozen: &Overlay,
        base: &Manifest,
        base_version: u64,
        cut: u64,
        kind: CheckpointKind,
        (label, keep_until_ms): (Option<String>, Option<u64>),
    ) -> Result<(u64, Hash, Manifest, u64)> {
        let uploads_began = Instant::now();
        let files = self.st().files.clone();
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
        // 3. The new cumulative manifest.
        let m = base.apply(&packed.changes)?;
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
        let lease = self.lease();
        let version = self
            .catalog
            .advance_head(
                &self.tenant,
                &self.name,
                base_version,
                &lease,
                &NewCheckpoint {
                    manifest: id,
                    label,
                    kind,
                    bytes: packed.bytes_uploaded,
                    cut_seq: cut,
                    journal_id: Some(self.journal_id.clone()),
                    keep_until_ms,
                },
            )
            .await?;
        Ok((version, id, m, packed.bytes_uploaded))
    }

    /// Rolls the head back to `version`'s manifest as a new version, after publishing the
    /// current state (so history keeps every acknowledged write).
    pub(crate) async fn rollback(&self, version: u64) -> Result<Published> {
        let target = self
            .catalog
            .get_checkpoint(&self.tenant, &self.name, version)
            .await?;
        let _gate = self.gate.write().await;
        self.publish_inner(
            CheckpointKind::Auto,
            (None, None),
            Some(self.acked_seq.load(SeqCst)),
        )
        .await?;
        let _p = self.publish_lock.lock().await;
        let started = Instant::now();
        let m = self
            .reader
            .store()
            .get_manifest(&self.tenant, &target.manifest)
            .await?;
        let base_version = self.st().base_version;
        let cut = self.acked_seq.load(SeqCst);
        let new_version = self
            .catalog
            .advance_head(
                &self.tenant,
                &self.name,
                base_version,
                &self.lease(),
                &NewCheckpoint {
                    manifest: target.manifest,
                    label: Some(format!("rollback to v{version}")),
                    kind: CheckpointKind::Rollback,
                    bytes: 0,
                    cut_seq: cut,
                    journal_id: Some(self.journal_id.clone()),
                    keep_until_ms: None,
                },
            )
            .await?;
        {
            let mut st = self.st_mut();
            st.base = Arc::new(m);
            st.base_id = target.manifest;
            st.base_version = new_version;
        }
        self.published_seq.fetch_max(cut, SeqCst);
        self.local_state(new_version, target.manifest, cut)
            .store(&*self.fs, &self.dir)?;
        Ok(Published {
            version: new_version,
            manifest: target.manifest,
            cut_seq: cut,
            bytes_uploaded: 0,
            stall: Duration::ZERO,
            total: started.elapsed(),
        })
    }
}
