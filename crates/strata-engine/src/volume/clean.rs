//! Segment cleaning: copies live records of the oldest sealed segment forward so that local
//! space stays bounded even for volumes that never publish.

use super::*;
use crate::overlay::{Hit, Run};

/// Blocks a cleaning copy appends under one hold of the writer lock (1 MiB).
const CLEAN_PIECE_BLOCKS: u64 = 256;

/// Work one cleaning call does before it gives way (uploads, the next tick).
const CLEAN_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether run `r` is a live record of segment `victim` (the oldest, ending at `victim_last`).
fn holds(victim: u64, victim_last: u64, r: &Run) -> bool {
    match r.loc {
        Loc::Journal { seg, .. } => seg == victim,
        Loc::Zero => r.seq <= victim_last,
    }
}

impl Volume {
    /// Segment cleaning: while the journal holds more than twice its live data (plus
    /// `slack` bytes), copies the live blocks of the oldest sealed segment forward, makes the
    /// copies durable, and deletes that segment. Keeps local space bounded for volumes that
    /// never (or not yet) publish. Returns the bytes reclaimed.
    ///
    /// Guest writes go on meanwhile: the writer lock is held for one piece of at most
    /// [`CLEAN_PIECE_BLOCKS`] at a time, never for a read or an fsync. A piece is read without
    /// the lock and copied only where the overlay still points at the victim's record under
    /// it (a newer write wins); the victim goes only if, under the lock after the copies are
    /// durable, nothing points at it any more and no cut has taken a layer that could.
    ///
    /// It runs in its own task (a caller that goes away never leaves a sync half done) and
    /// stops after about [`CLEAN_BUDGET`] of work, so that a writer making garbage as fast as
    /// it is reclaimed cannot keep it (and the publish lock it holds) forever.
    pub async fn clean_journal(&self, slack: u64) -> Result<u64> {
        self.in_own_task(move |v| async move { v.clean_run(slack).await })
            .await
    }

    async fn clean_run(&self, slack: u64) -> Result<u64> {
        let began = Instant::now();
        let _p = self.publish_lock.lock().await;
        // A live fork links segments under this lock: none is removed meanwhile.
        let _r = self.retire_lock.lock().await;
        let mut reclaimed = 0u64;
        loop {
            self.usable()?;
            if began.elapsed() > CLEAN_BUDGET {
                return Ok(reclaimed);
            }
            let (victim, len, victim_last, runs, file) = {
                let j = self.journal().await;
                if self.has_pending() {
                    // The oldest segments hold pending layers' records: copying them forward
                    // would move them past their cut. They retire when their layers publish.
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
                let st = self.st();
                let runs: Vec<(u64, Run)> = st
                    .active
                    .iter()
                    .filter(|(_, r)| holds(victim, victim_last, r))
                    .collect();
                let file = st.files.get(&victim).map(|f| f.file.clone());
                (victim, len, victim_last, runs, file)
            };
            for (lba, run) in runs {
                let mut done = 0u64;
                while done < run.len {
                    if self.has_pending() || began.elapsed() > CLEAN_BUDGET {
                        // A cut keeps the victim (nothing more to copy), or time is up: the
                        // copies so far are harmless, and a later pass goes on.
                        return Ok(reclaimed);
                    }
                    let n = match run.loc {
                        Loc::Zero => run.len,
                        Loc::Journal { .. } => (run.len - done).min(CLEAN_PIECE_BLOCKS),
                    };
                    let piece = Run {
                        len: n,
                        loc: run.loc.advance(done),
                        ..run
                    };
                    let data = match piece.loc {
                        Loc::Zero => Vec::new(),
                        Loc::Journal { off, .. } => {
                            let file = file.clone().ok_or_else(|| {
                                Error::Invalid(format!("segment {victim} has no file"))
                            })?;
                            tokio::task::spawn_blocking(move || {
                                let mut buf = vec![0u8; (n * BLOCK_SIZE) as usize];
                                file.read_at(&mut buf, off).map(|()| buf)
                            })
                            .await
                            .map_err(|e| Error::Invalid(format!("cleaning read task: {e}")))?
                            .map_err(Error::io("reading segment to clean"))?
                        }
                    };
                    self.relocate(lba + done, piece, &data).await?;
                    done += n;
                }
            }
            // The copies must be durable before the originals go.
            self.sync_copies().await?;
            let (retired, handle) = {
                let mut j = self.journal_whole().await?;
                let mut st = self.st_mut();
                if !st.pending.is_empty()
                    || st
                        .active
                        .iter()
                        .any(|(_, r)| holds(victim, victim_last, &r))
                {
                    // A cut took a layer meanwhile (it may name the victim's records): the
                    // victim stays until that layer publishes.
                    return Ok(reclaimed);
                }
                let retired = j
                    .detach_oldest(victim)
                    .map_err(Error::io("deleting cleaned segment"))?;
                let handles: Vec<_> = st
                    .files
                    .remove(&victim)
                    .map(|f| (victim, f))
                    .into_iter()
                    .collect();
                (retired, handles)
            };
            self.apply_retired(retired, handle, "deleting cleaned segment")
                .await?;
            reclaimed += len;
        }
    }

    /// Makes every record so far durable, as a flush does, except that a failed directory
    /// fsync leaves the directory to the next flush instead of failing the volume (cleaning is
    /// background work; a flush then still syncs it, or fails the volume).
    async fn sync_copies(&self) -> Result<()> {
        let _s = self.sync_lock.lock().await;
        self.usable()?;
        let batch = self.journal_whole().await?.take_dirty();
        let fs = self.fs.clone();
        // The same path as a flush's fsync (see `blocking_here`): a panic in it comes back as
        // an error, which fails the volume below.
        let (batch, files, dir) = crate::blocking::blocking_here(move || {
            let files = batch.files.iter().try_for_each(|(_, f)| f.sync_data());
            let dir = match (&files, &batch.dir) {
                (Ok(()), Some(d)) => fs.sync_dir(d),
                _ => Ok(()),
            };
            Ok((batch, files, dir))
        })
        .await
        .map_err(|e| {
            // Only a panic gets here: the batch is gone with it, so no later flush may believe
            // it synced.
            self.fail(format!("cleaning's fsync failed: {e}"));
            Error::io("syncing cleaned records")(e)
        })?;
        if let Err(e) = files {
            self.fail(format!("fsync failed while cleaning: {e}"));
            return Err(Error::io("fsync while cleaning")(e));
        }
        if let Err(e) = dir {
            // The directory still needs a sync (new segments' names): the next flush must not
            // believe otherwise.
            self.journal().await.restore_dirty(batch);
            return Err(Error::io("syncing journal directory")(e));
        }
        self.counters
            .fsyncs
            .fetch_add(batch.files.len() as u64, SeqCst);
        self.synced_seq.fetch_max(batch.upto, SeqCst);
        Ok(())
    }

    /// Copies one piece of a cleaning victim forward, under the writer lock, wherever the
    /// active overlay still maps it exactly as when it was read (same record).
    async fn relocate(&self, lba: u64, piece: Run, data: &[u8]) -> Result<()> {
        // Not under the freeze gate: a copy changes no content, and the publish lock held here
        // is one a freeze may be waiting for.
        let mut j = self.journal().await;
        self.usable()?;
        let mut hits = Vec::new();
        self.st().active.resolve(lba, piece.len, &mut hits);
        for (at, n, hit) in hits {
            let want = Run {
                len: n,
                loc: piece.loc.advance(at - lba),
                ..piece
            };
            if hit != Hit::Here(want) {
                continue; // Rewritten (or trimmed) since: the newer record is the live one.
            }
            match piece.loc {
                Loc::Zero => self.append_inner(&mut j, Kind::Zero, at, n, &[], true)?,
                Loc::Journal { .. } => {
                    let from = ((at - lba) * BLOCK_SIZE) as usize;
                    let bytes = &data[from..from + (n * BLOCK_SIZE) as usize];
                    self.append_inner(&mut j, Kind::Write, at, n, bytes, true)?
                }
            }
        }
        Ok(())
    }

    /// Keeps one prepared (zero-filled, allocated) segment file ready, and moves a young,
    /// growing active segment onto it, so FLUSH does not pay for file growth. Background work.
    pub async fn prepare_journal(&self) -> Result<()> {
        let dir = {
            let j = self.journal().await;
            if !j.wants_prepared() {
                return Ok(());
            }
            j.dir().to_path_buf()
        };
        let (fs, size) = (self.fs.clone(), self.opts.segment_max_bytes);
        // A spare segment is an optimisation: never into the space kept for metadata.
        self.space.admit(size)?;
        let path =
            // On the low-priority background thread: a 64 MiB zero-fill must not take the
            // cores from the guest's writer (see `strata_store::background`).
            strata_store::background(move || crate::journal::prepare_file(&*fs, &dir, size))
                .await
                .map_err(Error::io("preparing a journal segment"))?;
        self.usable()?;
        let mut j = self.journal().await;
        if let Some((id, f)) = j
            .add_prepared(path)
            .map_err(Error::io("rotating onto a prepared segment"))?
        {
            self.st_mut().files.insert(id, SegFile::new(f));
        }
        Ok(())
    }
}
