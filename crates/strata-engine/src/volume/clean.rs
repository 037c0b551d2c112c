//! Segment cleaning: copies live records of the oldest sealed segment forward so that local
//! space stays bounded even for volumes that never publish.

use super::*;

impl Volume {
    /// Segment cleaning: while the journal holds more than twice its live data (plus
    /// `slack` bytes), copies the live blocks of the oldest sealed segment forward, makes the
    /// copies durable, and deletes that segment. Keeps local space bounded for volumes that
    /// never (or not yet) publish. Returns the bytes reclaimed.
    pub async fn clean_journal(&self, slack: u64) -> Result<u64> {
        let _p = self.publish_lock.lock().await;
        // A live fork links segments under this lock: none is removed meanwhile.
        let _r = self.retire_lock.lock().await;
        let mut reclaimed = 0u64;
        loop {
            self.usable()?;
            let mut j = self.writer.lock().await;
            if self.has_pending() {
                // The oldest segments hold pending layers' records: copying them forward would
                // move them past their cut. They retire when their layers publish.
                return Ok(reclaimed);
            }
            let live = self.st().active.data_blocks() * BLOCK_SIZE;
            if j.bytes() <= live.saturating_mul(2).saturating_add(slack) {
                return Ok(reclaimed);
            }
            let Some((victim, len, victim_last)) = j.oldest_sealed() else {
                return Ok(reclaimed);
            };
            // Live records of the victim: data runs stored in it, and zero runs (trims,
            // write-zeroes) whose record it holds. Being the oldest segment, it holds every
            // live record with a sequence number up to its last one.
            let runs: Vec<(u64, u64, Option<u64>)> = self
                .st()
                .active
                .iter()
                .filter_map(|(lba, r)| match r.loc {
                    Loc::Journal { seg, off } if seg == victim => Some((lba, r.len, Some(off))),
                    Loc::Zero if r.seq <= victim_last => Some((lba, r.len, None)),
                    _ => None,
                })
                .collect();
            let file = self.st().files.get(&victim).map(|f| f.file.clone());
            for (lba, n, off) in runs {
                let Some(off) = off else {
                    self.append_inner(&mut j, Kind::Zero, lba, n, &[], true)?;
                    continue;
                };
                let file = file
                    .clone()
                    .ok_or_else(|| Error::Invalid(format!("segment {victim} has no file")))?;
                let mut buf = vec![0u8; (n * BLOCK_SIZE) as usize];
                file.read_at(&mut buf, off)
                    .map_err(Error::io("reading segment to clean"))?;
                self.append_inner(&mut j, Kind::Write, lba, n, &buf, true)?;
            }
            // The copies must be durable before the originals go.
            let batch = j.take_dirty();
            for (_, f) in &batch.files {
                if let Err(e) = f.sync_data() {
                    self.fail(format!("fsync failed while cleaning: {e}"));
                    return Err(Error::io("fsync while cleaning")(e));
                }
            }
            if let Some(d) = &batch.dir {
                if let Err(e) = self.fs.sync_dir(d) {
                    // The directory still needs a sync (new segments' names): the next flush
                    // must not believe otherwise.
                    j.restore_dirty(batch);
                    return Err(Error::io("syncing journal directory")(e));
                }
            }
            self.synced_seq.fetch_max(batch.upto, SeqCst);
            let busy = self
                .st_mut()
                .files
                .remove(&victim)
                .is_some_and(|f| f.in_use());
            j.remove_oldest(victim, busy)
                .map_err(Error::io("deleting cleaned segment"))?;
            reclaimed += len;
        }
    }

    /// Keeps one prepared (zero-filled, allocated) segment file ready, and moves a young,
    /// growing active segment onto it, so FLUSH does not pay for file growth. Background work.
    pub async fn prepare_journal(&self) -> Result<()> {
        let dir = {
            let j = self.writer.lock().await;
            if !j.wants_prepared() {
                return Ok(());
            }
            j.dir().to_path_buf()
        };
        let (fs, size) = (self.fs.clone(), self.opts.segment_max_bytes);
        // A spare segment is an optimisation: never into the space kept for metadata.
        self.space.admit(size)?;
        let path =
            tokio::task::spawn_blocking(move || crate::journal::prepare_file(&*fs, &dir, size))
                .await
                .map_err(|e| Error::Invalid(format!("prepare task failed: {e}")))?
                .map_err(Error::io("preparing a journal segment"))?;
        self.usable()?;
        let mut j = self.writer.lock().await;
        if let Some((id, f)) = j
            .add_prepared(path)
            .map_err(Error::io("rotating onto a prepared segment"))?
        {
            self.st_mut().files.insert(id, SegFile::new(f));
        }
        Ok(())
    }
}
