//! Compaction: the live data of sparse objects (live fraction below a threshold) is rewritten
//! into new objects and the head moves to a manifest with the same contents, so stored bytes
//! stay proportional to live data once retention and GC release the old objects. The new
//! version records this volume's journal and its published cut, like any publish.

use std::collections::HashSet;

use strata_format::manifest::Change;

use super::*;

/// Rewrite pieces of at most this many blocks (bounded memory per read).
const PIECE_BLOCKS: u64 = 1024;

/// Live and stored bytes of a manifest's objects: (live, stored) per object index.
pub(crate) fn object_usage(m: &Manifest) -> Vec<(u64, u64)> {
    let mut u: Vec<(u64, u64)> = m.objects.iter().map(|o| (0, o.data_len)).collect();
    for e in &m.extents {
        u[e.object as usize].0 += e.len as u64 * BLOCK_SIZE;
    }
    u
}

impl Volume {
    /// Whether a compaction gives way: cuts are pending or waiting (checkpoints never wait for
    /// a compaction, and versions they reserved come first), or the volume is an unpublished
    /// live fork.
    fn yields(&self) -> bool {
        // A live fork's head is only a base: its next version must be its data, not a rewrite.
        self.has_pending() || self.cut_waiting.load(SeqCst) > 0 || self.is_live_fork()
    }

    /// Rewrites the live data of every head object whose live fraction is below `threshold`
    /// (0..=1) and publishes it as a `compact` version. None when nothing is that sparse.
    pub async fn compact(&self, threshold: f64) -> Result<Option<Published>> {
        self.in_own_task(move |v| async move { v.compact_run(threshold).await })
            .await
    }

    async fn compact_run(&self, threshold: f64) -> Result<Option<Published>> {
        let started = Instant::now();
        let _p = self.publish_lock.lock().await;
        self.usable()?;
        if self.yields() {
            return Ok(None);
        }
        let (base, base_version) = {
            let st = self.st();
            (st.base.clone(), st.base_version)
        };
        let usage = object_usage(&base);
        let sparse: HashSet<u32> = usage
            .iter()
            .enumerate()
            .filter(|(_, (live, stored))| (*live as f64) < threshold * *stored as f64)
            .map(|(i, _)| i as u32)
            .collect();
        if sparse.is_empty() {
            return Ok(None);
        }
        let salt: u32 = rand::random();
        let target = self.opts.object_target_bytes.max(BLOCK_SIZE) as usize;
        let mut changes: Vec<Change> = Vec::new();
        let mut buf: Vec<u8> = Vec::new();
        let mut runs: Vec<(u64, u64, u64)> = Vec::new(); // lba, blocks, offset in buf
        let mut uploaded = 0u64;
        let tenant = self.tenant.clone();
        let flush = async |buf: &mut Vec<u8>,
                           runs: &mut Vec<(u64, u64, u64)>,
                           changes: &mut Vec<Change>,
                           uploaded: &mut u64|
               -> Result<()> {
            if buf.is_empty() {
                return Ok(());
            }
            let len = buf.len() as u64;
            let r = self
                .reader
                .put_object_salted(&tenant, std::mem::take(buf), salt)
                .await?;
            *uploaded += len;
            for (lba, len, off) in runs.drain(..) {
                changes.push(Change {
                    lba,
                    len,
                    at: Some((r, off)),
                });
            }
            buf.clear();
            Ok(())
        };
        for e in base.extents.iter().filter(|e| sparse.contains(&e.object)) {
            let o = base.objects[e.object as usize];
            let mut done = 0u64;
            while done < e.len as u64 {
                let n = (e.len as u64 - done).min(PIECE_BLOCKS);
                let at = buf.len();
                buf.resize(at + (n * BLOCK_SIZE) as usize, 0);
                self.reader
                    .read_into(
                        &self.tenant,
                        &o,
                        e.offset + done * BLOCK_SIZE,
                        &mut buf[at..],
                    )
                    .await?;
                runs.push((e.lba + done, n, at as u64));
                done += n;
                if self.yields() {
                    // Its uploads are unreferenced garbage for GC; the next pass tries again.
                    return Ok(None);
                }
                if buf.len() >= target {
                    flush(&mut buf, &mut runs, &mut changes, &mut uploaded).await?;
                }
            }
        }
        flush(&mut buf, &mut runs, &mut changes, &mut uploaded).await?;
        if started.elapsed() > self.opts.publish_deadline {
            return Err(Error::Unavailable(
                self.name.clone(),
                "compaction took more than half the GC grace period; try again".into(),
            ));
        }
        let m = base.apply(&changes)?;
        let id = self.reader.store().put_manifest(&self.tenant, &m).await?;
        self.catalog
            .record_manifest(&self.tenant, id, &m.objects)
            .await?;
        // Its version must not take a number a cut reserved: no cut runs while it commits, and
        // none may be pending (the cut lock is only tried: the lock order puts it first).
        let Ok(_c) = self.cut_lock.try_lock() else {
            return Ok(None);
        };
        if self.has_pending() {
            return Ok(None);
        }
        let cut = self.published_seq.load(SeqCst);
        let cp = NewCheckpoint {
            manifest: id,
            disk_size: m.disk_size,
            label: None,
            kind: CheckpointKind::Compact,
            bytes: uploaded,
            cut_seq: cut,
            journal_id: Some(self.journal_id.clone()),
            keep_until_ms: None,
        };
        let version = match self.advance_head(base_version, &cp).await {
            Ok(v) => v,
            Err(e @ Error::Catalog(CatalogError::Fenced { .. })) => {
                self.fail(e.to_string());
                return Err(e);
            }
            // Settled before the cut lock goes: a cut must not reserve the number this may
            // have taken (adopting it later would be read as that cut's publish).
            Err(e) if self.ambiguous.swap(false, SeqCst) => {
                self.settle(base_version, &cp).await.map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        {
            let mut st = self.st_mut();
            st.base = Arc::new(m);
            st.base_id = id;
            st.base_version = version;
        }
        self.local_state(version, id, cut)
            .store(&*self.fs, &self.dir)?;
        self.counters.publishes.fetch_add(1, SeqCst);
        self.counters.bytes_uploaded.fetch_add(uploaded, SeqCst);
        tracing::info!(tenant = %self.tenant, workspace = %self.name, version, rewritten = uploaded, "compacted");
        Ok(Some(Published {
            version,
            manifest: Some(id),
            cut_seq: cut,
            bytes_uploaded: uploaded,
            stall: Duration::ZERO,
            total: started.elapsed(),
            state: CheckpointState::Published,
        }))
    }
}
