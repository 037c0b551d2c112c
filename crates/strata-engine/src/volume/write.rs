//! The write path: whole-block records reserved under the writer lock and written beside
//! other writers, read-modify-write of partial blocks, zeroing and trims under the lock, and
//! FLUSH's group commit (see `journal.rs` for the ordering the journal keeps).

use std::sync::atomic::Ordering::SeqCst;
use std::time::Instant;

use strata_catalog::{CheckpointKind, Mode};
use strata_format::journal::{Kind, MAX_RECORD_BLOCKS};
use strata_format::BLOCK_SIZE;

use super::{lock, SegFile, Volume};
use crate::journal::Journal;
use crate::overlay::Loc;
use crate::space::QUOTA_WAIT;
use crate::{Error, Result};

impl Volume {
    /// Appends records for whole blocks and points the overlay at them. Caller holds `writer`.
    pub(super) fn append(
        &self,
        j: &mut Journal,
        kind: Kind,
        lba: u64,
        n: u64,
        data: &[u8],
    ) -> Result<()> {
        self.append_inner(j, kind, lba, n, data, false)
    }

    /// `relocated`: the data was already acknowledged (segment cleaning copies it forward), so
    /// it does not count as new guest bytes or widen the remote window.
    pub(super) fn append_inner(
        &self,
        j: &mut Journal,
        kind: Kind,
        lba: u64,
        n: u64,
        data: &[u8],
        relocated: bool,
    ) -> Result<()> {
        let mut done = 0u64;
        while done < n {
            let k = (n - done).min(MAX_RECORD_BLOCKS as u64);
            let payload = match kind {
                Kind::Write => {
                    &data[(done * BLOCK_SIZE) as usize..((done + k) * BLOCK_SIZE) as usize]
                }
                Kind::Zero => &[][..],
            };
            let appended = j.append(kind, lba + done, k as u32, payload);
            let (seq, seg, off) = self.appended(j, appended)?;
            let loc = match kind {
                Kind::Write => Loc::Journal { seg, off },
                Kind::Zero => Loc::Zero,
            };
            // Under the lock with no record in flight: this is the newest record.
            debug_assert_eq!(self.in_flight.load(SeqCst), 0);
            self.st_mut().active.insert(lba + done, k, seq, loc);
            self.acked_seq.fetch_max(seq, SeqCst);
            done += k;
        }
        if kind == Kind::Write && !relocated {
            self.count_written(n);
        }
        Ok(())
    }

    /// After an append under the lock: the segments it rotated into join the volume's files
    /// (even when the append failed: later records land in them), and its error is the
    /// request's. A full disk refuses the request only: a failed record was never counted (the
    /// next append overwrites it), so the journal stays a clean prefix; any other failure
    /// fails the volume.
    fn appended<T>(&self, j: &mut Journal, appended: std::io::Result<T>) -> Result<T> {
        let rotated = j.take_rotated();
        if !rotated.is_empty() {
            let mut st = self.st_mut();
            for (id, f) in rotated {
                st.files.insert(id, SegFile::new(f));
            }
        }
        match appended {
            Ok(r) => Ok(r),
            Err(e) if crate::error::is_no_space(&e) => {
                Err(Error::NoSpace(format!("the journal of {}: {e}", self.name)))
            }
            Err(e) => {
                self.fail(format!("journal write failed: {e}"));
                Err(Error::io("appending to journal")(e))
            }
        }
    }

    /// Counts `n` blocks of new guest data and widens the remote window by them.
    fn count_written(&self, n: u64) {
        let bytes = n * BLOCK_SIZE;
        self.counters.bytes_written.fetch_add(bytes, SeqCst);
        let mut w = lock(&self.window);
        let max = self.opts.upload_max_bytes;
        if w.bytes < max && w.bytes + bytes >= max {
            self.upload_due.notify_one();
        }
        w.bytes += bytes;
        w.since.get_or_insert_with(Instant::now);
    }

    /// Waits up to [`QUOTA_WAIT`] for the tenant's journal quota to admit `bytes`, asking for
    /// a publish (which frees what it covers) while it waits.
    async fn await_budget(&self, bytes: u64) {
        let until = Instant::now() + QUOTA_WAIT;
        while self.budget.admit(bytes).is_err() && Instant::now() < until {
            self.upload_due.notify_one();
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Writes `data` at `offset`. Partial blocks are read, merged and rewritten whole. With `fua`
    /// the call returns only once the write is as durable as a FLUSH would make it.
    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        // Past the tenant's journal quota the write waits (no lock held) for its uploads to
        // free room, up to `QUOTA_WAIT`: a burst faster than uploads is slowed, not failed.
        self.await_budget(data.len() as u64).await;
        // Past the tenant's write rate on this node, it waits its turn (no lock held).
        if let Some(wait) = self.budget.pace(data.len() as u64) {
            tokio::time::sleep(wait).await;
        }
        self.write_now(offset, data).await?;
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    /// [`Volume::write`] once the quota and the rate let it go (without FUA).
    async fn write_now(&self, offset: u64, data: &[u8]) -> Result<()> {
        {
            let _gate = self.gate.read().await;
            let mut j = self.writer.lock().await;
            self.writable()?;
            // The quota first: a write it refuses must not take from the node's free-space
            // estimate, which every tenant's writes share.
            if let Err(e) = self.budget.admit(data.len() as u64) {
                self.upload_due.notify_one();
                return Err(e);
            }
            self.space.admit(data.len() as u64)?;
            let lba = offset / BLOCK_SIZE;
            let end = (offset + data.len() as u64).div_ceil(BLOCK_SIZE);
            let n = end - lba;
            let aligned =
                offset.is_multiple_of(BLOCK_SIZE) && (data.len() as u64).is_multiple_of(BLOCK_SIZE);
            let reserved = aligned
                .then(|| j.reserve(Kind::Write, lba, n, data.len() as u64))
                .flatten();
            if let Some(r) = reserved {
                // Counted before the lock goes: whoever takes it next and waits for appends
                // in flight must see this one.
                self.in_flight.fetch_add(1, SeqCst);
                let seq = r.seq;
                lock(&self.unlanded).insert(seq);
                drop(j);
                self.land(r, lba, n, data)?;
                // Not acknowledged while an older record is still being written: replay stops
                // at the first record missing from the journal, so this one only survives a
                // kill -9 once every record before it is there too. (Dropped here, the write
                // is simply not acknowledged: it has landed, and nothing else waits for it.)
                self.await_prefix(seq).await?;
            } else if aligned {
                self.await_landed().await;
                self.writable()?;
                self.append(&mut j, Kind::Write, lba, n, data)?;
            } else {
                // A read-modify-write must see every write reserved before it.
                self.await_landed().await;
                self.writable()?;
                let mut buf = vec![0u8; (n * BLOCK_SIZE) as usize];
                let head = (offset - lba * BLOCK_SIZE) as usize;
                if head != 0 {
                    self.read_blocks(lba, 1, &mut buf[..BLOCK_SIZE as usize])
                        .await?;
                }
                let tail_block = end - 1;
                if !(offset + data.len() as u64).is_multiple_of(BLOCK_SIZE)
                    && (tail_block != lba || head == 0)
                {
                    let at = ((tail_block - lba) * BLOCK_SIZE) as usize;
                    self.read_blocks(tail_block, 1, &mut buf[at..at + BLOCK_SIZE as usize])
                        .await?;
                }
                buf[head..head + data.len()].copy_from_slice(data);
                self.append(&mut j, Kind::Write, lba, n, &buf)?;
            }
        }
        Ok(())
    }

    /// Writes that arrived together (an NBD client's pipelined requests, none with FUA), with
    /// one result each, in order. Whole-block writes of one record each are reserved back to
    /// back under one hold of the writer lock and written to the journal with one write
    /// ([`crate::journal::write_group`]); each is acknowledged exactly when `write` would have
    /// acknowledged it (its record and every earlier one landed). Anything else, or what the
    /// active segment has no room for, is written one by one.
    pub async fn write_many(&self, writes: &[(u64, &[u8])]) -> Vec<Result<()>> {
        let whole = |&(offset, data): &(u64, &[u8])| {
            !data.is_empty()
                && offset.is_multiple_of(BLOCK_SIZE)
                && (data.len() as u64).is_multiple_of(BLOCK_SIZE)
                && data.len() as u64 <= MAX_RECORD_BLOCKS as u64 * BLOCK_SIZE
                && self.check_range(offset, data.len() as u64).is_ok()
        };
        if writes.len() < 2 || !writes.iter().all(whole) {
            let mut out = Vec::with_capacity(writes.len());
            for (offset, data) in writes {
                out.push(self.write(*offset, data, false).await);
            }
            return out;
        }
        let total: u64 = writes.iter().map(|(_, d)| d.len() as u64).sum();
        if self.budget.admit(total).is_err() {
            // Near the tenant's journal quota: each write waits for room on its own, as if
            // it had come alone (a group larger than the room left would wait for nothing).
            let mut out = Vec::with_capacity(writes.len());
            for (offset, data) in writes {
                out.push(self.write(*offset, data, false).await);
            }
            return out;
        }
        if let Some(wait) = self.budget.pace(total) {
            tokio::time::sleep(wait).await;
        }
        let mut out: Vec<Result<()>> = Vec::with_capacity(writes.len());
        // Held until the group is acknowledged, as `write` holds it: a freeze, seal or
        // rollback that takes the gate sees no write of it in flight.
        let gate = self.gate.read().await;
        let mut refused = false;
        let group = {
            let mut j = self.writer.lock().await;
            let admitted = self
                .writable()
                .and_then(|()| self.budget.admit(total))
                .and_then(|()| self.space.admit(total));
            match admitted {
                // Each on its own below: one refusal must not fail the others.
                Err(_) => {
                    refused = true;
                    vec![]
                }
                Ok(()) => {
                    let items: Vec<(u64, u64, u64)> = writes
                        .iter()
                        .map(|(o, d)| (o / BLOCK_SIZE, d.len() as u64 / BLOCK_SIZE, d.len() as u64))
                        .collect();
                    let group = j.reserve_many(&items);
                    if !group.is_empty() {
                        // As in `write`: counted before the lock goes.
                        self.in_flight.fetch_add(group.len() as u64, SeqCst);
                        lock(&self.unlanded).extend(group.iter().map(|r| r.seq));
                    } else {
                        // No room written in place (a new segment, not from the pool): the
                        // records are appended under the lock, as `write`'s slow path does,
                        // but in one write.
                        self.await_landed().await;
                        let res = self
                            .writable()
                            .and_then(|()| self.append_group(&mut j, writes));
                        return match res {
                            Ok(()) => writes.iter().map(|_| Ok(())).collect(),
                            Err(e) => writes.iter().map(|_| Err(self.again(&e))).collect(),
                        };
                    }
                    group
                }
            }
        };
        let k = group.len();
        if k > 0 {
            let last = group[k - 1].seq;
            let landed = self.land_group(group, &writes[..k]);
            let acked = match landed {
                Ok(()) => self.await_prefix(last).await,
                Err(e) => Err(e),
            };
            for _ in 0..k {
                out.push(match &acked {
                    Ok(()) => Ok(()),
                    Err(e) => Err(self.again(e)),
                });
            }
        }
        // Before the rest: each takes the gate again (a second read hold could wait behind a
        // writer queued for it, which waits for this one).
        drop(gate);
        for (offset, data) in &writes[k..] {
            out.push(if refused {
                // The quota or the disk refused the group: each waits for room as `write`
                // does (the quota may free some) and is refused alone.
                self.write(*offset, data, false).await
            } else {
                self.write_now(*offset, data).await
            });
        }
        out
    }

    /// The same failure again, for each write of a group that failed together (the journal
    /// write, a full disk, or the volume failed).
    fn again(&self, e: &Error) -> Error {
        match e {
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            Error::NoSpace(why) => Error::NoSpace(why.clone()),
            e => Error::Unavailable(self.name.clone(), e.to_string()),
        }
    }

    /// [`Volume::append`] for a group of whole-block writes, one record each: one journal
    /// write under the writer lock (the caller holds it, with nothing in flight).
    fn append_group(&self, j: &mut Journal, writes: &[(u64, &[u8])]) -> Result<()> {
        let items: Vec<(u64, u32, &[u8])> = writes
            .iter()
            .map(|(o, d)| (o / BLOCK_SIZE, (d.len() as u64 / BLOCK_SIZE) as u32, *d))
            .collect();
        let appended = j.append_many(&items);
        let placed = self.appended(j, appended)?;
        let mut blocks = 0;
        {
            let mut st = self.st_mut();
            for ((seq, seg, off), (lba, n, _)) in placed.iter().zip(&items) {
                st.active.insert(
                    *lba,
                    *n as u64,
                    *seq,
                    Loc::Journal {
                        seg: *seg,
                        off: *off,
                    },
                );
                blocks += *n as u64;
            }
        }
        if let Some((seq, _, _)) = placed.last() {
            self.acked_seq.fetch_max(*seq, SeqCst);
        }
        if placed.len() > 1 {
            self.counters
                .appends_grouped
                .fetch_add(placed.len() as u64, SeqCst);
        }
        self.count_written(blocks);
        Ok(())
    }

    /// [`Volume::land`] for records reserved back to back: one journal write for all of them,
    /// then the overlay points at each, under one hold of the state's lock.
    fn land_group(&self, rs: Vec<crate::journal::Reserved>, writes: &[(u64, &[u8])]) -> Result<()> {
        struct InFlight<'a>(&'a Volume, bool, Vec<u64>);
        impl Drop for InFlight<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    self.0
                        .fail("a reserved journal record was never written".into());
                }
                let oldest = {
                    let mut u = lock(&self.0.unlanded);
                    let oldest = u.first().is_some_and(|s| self.2.contains(s));
                    for s in &self.2 {
                        u.remove(s);
                    }
                    oldest
                };
                if oldest {
                    self.0.prefix_landed.notify_waiters();
                }
                let k = self.2.len() as u64;
                if self.0.in_flight.fetch_sub(k, SeqCst) == k {
                    self.0.landed.notify_waiters();
                }
            }
        }
        let mut guard = InFlight(self, false, rs.iter().map(|r| r.seq).collect());
        let payloads: Vec<&[u8]> = writes.iter().map(|(_, d)| *d).collect();
        let offs = match crate::journal::write_group(&rs, &payloads) {
            Ok(offs) => offs,
            Err(e) => {
                self.fail(format!("journal write failed: {e}"));
                guard.1 = true;
                return Err(Error::io("appending to journal")(e));
            }
        };
        let mut blocks = 0;
        {
            let mut st = self.st_mut();
            for ((r, off), (offset, data)) in rs.iter().zip(offs).zip(writes) {
                let n = data.len() as u64 / BLOCK_SIZE;
                st.active.insert_newer(
                    offset / BLOCK_SIZE,
                    n,
                    r.seq,
                    Loc::Journal { seg: r.seg, off },
                );
                blocks += n;
            }
        }
        if let Some(r) = rs.last() {
            self.acked_seq.fetch_max(r.seq, SeqCst);
        }
        self.count_written(blocks);
        self.counters
            .appends_unlocked
            .fetch_add(rs.len() as u64, SeqCst);
        if rs.len() > 1 {
            self.counters
                .appends_grouped
                .fetch_add(rs.len() as u64, SeqCst);
        }
        guard.1 = true;
        drop(guard);
        Ok(())
    }

    /// The fast path's second half: writes the record reserved under the writer lock without
    /// it, so a writer preempted in its `pwrite` (on a small node, the norm under load) holds
    /// up only itself, then points the overlay at it. It never awaits, so a dropped caller
    /// cannot leave it half done; anything that needs every reserved record written first
    /// ([`Volume::journal`]) waits for `in_flight`, which the caller raised under the lock.
    fn land(&self, r: crate::journal::Reserved, lba: u64, n: u64, data: &[u8]) -> Result<()> {
        struct InFlight<'a>(&'a Volume, bool, u64);
        impl Drop for InFlight<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    // Unwinding with the record unwritten: a hole replay would stop at.
                    self.0
                        .fail("a reserved journal record was never written".into());
                }
                let oldest = {
                    let mut u = lock(&self.0.unlanded);
                    let oldest = u.first() == Some(&self.2);
                    u.remove(&self.2);
                    oldest
                };
                if oldest {
                    self.0.prefix_landed.notify_waiters();
                }
                if self.0.in_flight.fetch_sub(1, SeqCst) == 1 {
                    self.0.landed.notify_waiters();
                }
            }
        }
        let mut guard = InFlight(self, false, r.seq);
        let off = match r.write(data) {
            Ok(off) => off,
            Err(e) => {
                // The place is taken: a record that is not there ends replay, so nothing after
                // it may be acknowledged as durable. (The file is prepared and the file system
                // overwrites in place: no ENOSPC here.)
                self.fail(format!("journal write failed: {e}"));
                guard.1 = true; // failed for its own reason, above
                return Err(Error::io("appending to journal")(e));
            }
        };
        self.st_mut()
            .active
            .insert_newer(lba, n, r.seq, Loc::Journal { seg: r.seg, off });
        self.acked_seq.fetch_max(r.seq, SeqCst);
        // Counted before the record stops being in flight: a cut waiting for it takes the
        // window with this write's bytes in it.
        self.count_written(n);
        self.counters.appends_unlocked.fetch_add(1, SeqCst);
        guard.1 = true;
        drop(guard);
        Ok(())
    }

    /// The journal with every reserved record written and in the overlay: what the journal's
    /// lock meant before appends were written outside it.
    pub(crate) async fn journal(&self) -> tokio::sync::MutexGuard<'_, Journal> {
        let j = self.writer.lock().await;
        self.await_landed().await;
        j
    }

    /// [`Volume::journal`] for work that relies on the journal replaying through its last
    /// record (a sync, a cut, cleaning's copies, a fork's links): an append that failed while
    /// this waited left a hole replay stops at, and has failed the volume, which this checks
    /// after the wait.
    pub(crate) async fn journal_whole(&self) -> Result<tokio::sync::MutexGuard<'_, Journal>> {
        let j = self.journal().await;
        self.usable()?;
        Ok(j)
    }

    /// Waits until every append reserved before `seq` has landed, then fails if one of them
    /// failed to: a record missing from the journal ends replay, so `seq` is not safe to
    /// acknowledge past it.
    async fn await_prefix(&self, seq: u64) -> Result<()> {
        let mut held = false;
        loop {
            let landed = self.prefix_landed.notified();
            tokio::pin!(landed);
            landed.as_mut().enable();
            if lock(&self.unlanded).first().is_none_or(|&s| s > seq) {
                break;
            }
            if !held {
                held = true;
                self.counters.acks_held.fetch_add(1, SeqCst);
            }
            landed.await;
        }
        match lock(&self.failed).clone() {
            Some(why) => Err(Error::Unavailable(self.name.clone(), why)),
            None => Ok(()),
        }
    }

    /// Waits until no append is in flight (the caller holds the writer lock, so none starts).
    pub(super) async fn await_landed(&self) {
        loop {
            let landed = self.landed.notified();
            tokio::pin!(landed);
            landed.as_mut().enable();
            if self.in_flight.load(SeqCst) == 0 {
                return;
            }
            landed.await;
        }
    }

    /// Makes `len` bytes at `offset` read as zeros without storing zero bytes (whole blocks);
    /// partial blocks at the edges are written as data.
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let first_full = offset.div_ceil(BLOCK_SIZE);
        let end_full = (offset + len) / BLOCK_SIZE;
        if first_full >= end_full {
            return self.write(offset, &vec![0u8; len as usize], fua).await;
        }
        let head = first_full * BLOCK_SIZE - offset;
        if head > 0 {
            self.write(offset, &vec![0u8; head as usize], false).await?;
        }
        let tail = offset + len - end_full * BLOCK_SIZE;
        if tail > 0 {
            self.write(end_full * BLOCK_SIZE, &vec![0u8; tail as usize], false)
                .await?;
        }
        {
            let _gate = self.gate.read().await;
            let mut j = self.journal().await;
            self.writable()?;
            self.append(&mut j, Kind::Zero, first_full, end_full - first_full, &[])?;
        }
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    /// TRIM: the whole blocks in the range read as zeros afterwards (strata never exposes stale
    /// data after a trim). Partial blocks are left alone, as the NBD spec allows.
    pub async fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        let first_full = offset.div_ceil(BLOCK_SIZE);
        let end_full = (offset + len) / BLOCK_SIZE;
        if first_full >= end_full {
            return Ok(());
        }
        let _gate = self.gate.read().await;
        let mut j = self.journal().await;
        self.writable()?;
        self.append(&mut j, Kind::Zero, first_full, end_full - first_full, &[])
    }

    /// Group commit: one batch of `fdatasync`s covers every write acknowledged before the call.
    pub(super) async fn sync_journal(&self) -> Result<()> {
        self.sync_journal_with(false).await
    }

    /// [`Self::sync_journal`]; `whole`: also when every record is synced, whatever the journal
    /// still holds unsynced (the header of a segment rotated away from before it got a
    /// record): a live fork links every sealed segment, and its replay ends at one whose header
    /// was lost.
    pub(super) async fn sync_journal_with(&self, whole: bool) -> Result<()> {
        let target = self.acked_seq.load(SeqCst);
        if !whole && self.synced_seq.load(SeqCst) >= target {
            return Ok(());
        }
        let _s = self.sync_lock.lock().await;
        if !whole && self.synced_seq.load(SeqCst) >= target {
            return Ok(());
        }
        let batch = self.journal_whole().await?.take_dirty();
        let fs = self.fs.clone();
        let n = batch.files.len() as u64;
        let res = crate::blocking::blocking_here(move || -> std::io::Result<()> {
            for (_, f) in &batch.files {
                f.sync_data()?;
            }
            if let Some(d) = &batch.dir {
                fs.sync_dir(d)?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = res {
            // After a failed fsync the page cache may have dropped the data: never pretend.
            self.fail(format!("fsync failed: {e}"));
            return Err(Error::io("fsync of journal")(e));
        }
        self.counters.fsyncs.fetch_add(n, SeqCst);
        self.synced_seq.fetch_max(batch.upto, SeqCst);
        Ok(())
    }

    /// FLUSH: returns when every write acknowledged before it is as safe as the mode promises.
    pub async fn flush(&self) -> Result<()> {
        self.counters.flushes.fetch_add(1, SeqCst);
        if !self.flush_honoured {
            return Ok(());
        }
        self.sync_journal().await?;
        if self.mode == Mode::Sync {
            let target = self.acked_seq.load(SeqCst);
            if self.published_seq.load(SeqCst) < target {
                self.publish_inner(CheckpointKind::Auto, Some(target))
                    .await?;
            }
        }
        // A flush that completes after the lease could have passed to another node must not
        // claim success: that node restores from the head, without this node's journal.
        self.lease_valid()
    }
}
