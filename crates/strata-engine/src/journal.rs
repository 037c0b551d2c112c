//! The local journal: append-only segment files of checksummed records.
//!
//! Ordering invariants:
//! - sequence numbers strictly increase across records and segments;
//! - a write is acknowledged only after its record is written (page cache) and the overlay
//!   points at it; it is durable after a flush has `fdatasync`ed every dirty segment and, if a
//!   segment was created since, `fsync`ed the directory;
//! - a record [`Journal::reserve`]d is written after the lock is released, so records can land
//!   out of order; the volume lets nothing read the dirty set, cut, rotate or retire while one
//!   is unwritten (`Volume::journal`), so every flushed record has all earlier ones before it;
//! - recovery replays records in order; a segment ends at its first invalid record (a torn
//!   tail, or the unused rest of a recycled or prepared file, which rotation leaves in place)
//!   and is truncated there; the first gap in the (contiguous) sequence numbers, checked
//!   across segments, ends the journal: every later segment is deleted, so the journal is
//!   always a clean prefix;
//! - segments are only ever deleted oldest first (publish, cleaning), so what remains is
//!   contiguous;
//! - a segment is deleted only when every record in it is covered by a published manifest
//!   recorded in the durable local state (see `volume.rs`).
//!
//! - deleted segments are recycled (renamed to `{id}.free`, then to the next segment's name) so
//!   that appends overwrite allocated blocks and an fdatasync need not commit a size change;
//!   stale bytes after a segment's records never verify (a fresh nonce per incarnation), and a
//!   lost record anywhere shows as a gap in the sequence numbers that follow it.
//!
//! Files: `{dir}/{id:016x}.seg`, records per `strata_format::journal`; `{id:016x}.free` are
//! recyclable.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_format::journal::{
    self as rec, Kind, HEADER_LEN, MAX_RECORD_BLOCKS, SEGMENT_HEADER_LEN,
};

use crate::fs::{Fs, FsFile};

pub(crate) struct Replayed {
    pub seq: u64,
    pub kind: Kind,
    pub lba: u64,
    pub nblocks: u64,
    pub seg: u64,
    pub data_off: u64,
}

struct SegMeta {
    file: Arc<dyn FsFile>,
    len: u64,
    last_seq: u64,
    /// Its incarnation: nonce and version (which check its records carry).
    header: rec::SegmentHeader,
    /// Bytes already written in the file when it became this segment: non-zero for one from
    /// the pool (recycled or zero-filled), whose appends overwrite written blocks. A record
    /// wholly below it allocates nothing (so no ENOSPC) and may be written outside the
    /// journal's lock ([`Journal::reserve`]).
    alloc: u64,
}

pub(crate) struct Journal {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    segments: BTreeMap<u64, SegMeta>,
    active: u64,
    next_seq: u64,
    dirty: BTreeMap<u64, Arc<dyn FsFile>>,
    dir_dirty: bool,
    /// The active segment while it holds no record since [`Journal::rotate`] made it: its
    /// header and name are left out of the sync set until its first record (or the next
    /// rotation) puts them in. Lost to a power cut, a segment without records loses nothing,
    /// and a later segment's records are never synced without it: so a cut that rotates (a
    /// live fork) or an open syncs no new file and no directory for it.
    fresh: Option<u64>,
    max_segment: u64,
    /// Recyclable segment files.
    free: Vec<PathBuf>,
    /// Segments `append` rotated into, not yet handed to the volume.
    rotated: Vec<(u64, Arc<dyn FsFile>)>,
    /// The file system overwrites written blocks in place ([`Fs::overwrites_in_place`]):
    /// only then may a record be written outside the lock ([`Journal::reserve`]).
    in_place: bool,
    /// Segments shared with a live fork (or from its source) since this journal opened:
    /// never recycled, even once the other side let go (a read there may still be running).
    shared: std::collections::BTreeSet<u64>,
    /// Bytes held by all segments (the sum of their lengths), kept beside them so that
    /// metrics read it without the journal's lock ([`Journal::held`]).
    held: Arc<std::sync::atomic::AtomicU64>,
}

/// Recycled files kept for reuse; more are deleted.
const FREE_POOL: usize = 2;

/// What a flush must make durable, taken from the journal in one step.
pub(crate) struct SyncBatch {
    /// (segment id, file) to `fdatasync`.
    pub files: Vec<(u64, Arc<dyn FsFile>)>,
    pub dir: Option<PathBuf>,
    pub upto: u64,
}

fn seg_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.seg"))
}

impl Journal {
    /// Opens the journal in `dir`, replaying every valid record with `seq > skip_upto` through
    /// `apply`, and starts a fresh active segment. Returns the journal and how many bytes of torn
    /// tail were discarded.
    pub fn open(
        fs: Arc<dyn Fs>,
        dir: &Path,
        skip_upto: u64,
        max_segment: u64,
        mut apply: impl FnMut(Replayed, &Arc<dyn FsFile>),
    ) -> io::Result<(Journal, u64)> {
        fs.create_dir_all(dir)?;
        let names = fs.list(dir)?;
        let mut ids: Vec<u64> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".seg"))
            .filter_map(|h| u64::from_str_radix(h, 16).ok())
            .collect();
        for n in names.iter().filter(|n| n.ends_with(".prep")) {
            // An interrupted preparation: never part of the journal.
            fs.remove(&dir.join(n))?;
        }
        // A pooled file may hold a valid segment header and records under the name a rotation
        // gave it before a power cut undid the rename: rotated into again under that same id
        // (this open's next one), with its new header not yet synced (`Journal::fresh`) and
        // its name made durable by any directory fsync, those records (dropped by the replay
        // before, never flushed) would replay after the next power cut. Their header is
        // zeroed, durably, before the file is pooled again; a file that cannot be is dropped.
        let mut free: Vec<PathBuf> = Vec::new();
        for n in names.iter().filter(|n| n.ends_with(".free")) {
            let path = dir.join(n);
            let scrub = || -> io::Result<()> {
                let f = fs.open(&path, false)?;
                if f.len()? >= SEGMENT_HEADER_LEN as u64 {
                    f.write_at(&[0u8; SEGMENT_HEADER_LEN], 0)?;
                    f.sync_data()?;
                }
                Ok(())
            };
            match scrub() {
                Ok(()) => free.push(path),
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "dropping a pooled journal file");
                    fs.remove(&path)?;
                }
            }
        }
        ids.sort_unstable();
        let mut segments = BTreeMap::new();
        let mut last_seq = skip_upto;
        // The last valid record seen in any segment: sequence numbers continue across segments,
        // so once one is known every later record must follow it exactly.
        let mut prev_seq: Option<u64> = None;
        // Where the headers say the first record is (`seq_code`), until a record is seen.
        let mut first_code: Option<u32> = None;
        let mut discarded = 0u64;
        let mut torn = false;
        let mut dir_dirty = false;
        for &id in &ids {
            let path = seg_path(dir, id);
            if torn {
                discarded += fs.open(&path, false)?.len()?;
                fs.remove(&path)?;
                dir_dirty = true;
                continue;
            }
            let file = fs.open(&path, false)?;
            let len = file.len()?;
            // The segment header names this incarnation; without it nothing here is trusted.
            let mut sh = [0u8; SEGMENT_HEADER_LEN];
            // A file too short for a header is one a crash cut right after its creation; an
            // error reading one that is long enough is the disk's, and fails the open: taking it
            // for a torn segment would drop this segment's acknowledged records and every later
            // segment's.
            let header = if len >= SEGMENT_HEADER_LEN as u64 {
                file.read_at(&mut sh, 0)?;
                rec::decode_segment_header(&sh).ok().filter(|h| h.id == id)
            } else {
                None
            };
            let mut pos = SEGMENT_HEADER_LEN as u64;
            let mut ended = false;
            let mut seg_last = 0u64;
            let mut head = [0u8; HEADER_LEN];
            if header.is_none() {
                torn = true;
                pos = 0;
            }
            let header = header.unwrap_or(rec::SegmentHeader {
                id,
                nonce: 0,
                version: rec::SEGMENT_VERSION,
                first: 0,
            });
            // Until a record is seen, the segments' headers say where the records begin: a
            // segment that held none legitimately (rotated away from at once) names the same
            // first record as the next one; one whose every record was lost (a power cut
            // before its first sync) names an earlier one, and replay must stop there rather
            // than go on with a later segment's records.
            if !torn && prev_seq.is_none() && header.first != 0 {
                match first_code {
                    Some(c) if c != header.first => torn = true,
                    _ => first_code = Some(header.first),
                }
            }
            while !torn && pos < len {
                // Bytes that are not a valid record end the segment; an error reading bytes
                // that are there fails the open (as above).
                let ok = (|| -> io::Result<Option<Result<rec::RecordHeader, ()>>> {
                    if pos + HEADER_LEN as u64 > len {
                        return Ok(None);
                    }
                    file.read_at(&mut head, pos)?;
                    let Ok(h) = rec::decode_header(&head) else {
                        return Ok(None);
                    };
                    // Unpublished sequence numbers are contiguous: a gap means a lost record, so
                    // stop there. (Published records, <= skip_upto, may be left over from an
                    // interrupted deletion; they are skipped, not checked.)
                    // (No record of ours lies past what the overlay can name.)
                    if pos + h.total_len() > len.min(crate::overlay::MAX_OFF) {
                        return Ok(None);
                    }
                    let mut payload = vec![0u8; h.payload_len as usize];
                    file.read_at(&mut payload, pos + HEADER_LEN as u64)?;
                    if !rec::verify(&header, &head, &h, &payload) {
                        return Ok(None);
                    }
                    // A valid record that does not follow the previous one: a record between
                    // them was lost. (Bytes from a file's earlier life never verify, so they
                    // cannot look like a gap.)
                    if h.seq > skip_upto && prev_seq.is_some_and(|p| h.seq != p + 1) {
                        return Ok(Some(Err(())));
                    }
                    // The first record seen must be the one the headers named.
                    if h.seq > skip_upto
                        && prev_seq.is_none()
                        && first_code.is_some_and(|c| c != rec::seq_code(h.seq))
                    {
                        return Ok(Some(Err(())));
                    }
                    Ok(Some(Ok(h)))
                })()?;
                let h = match ok {
                    Some(Ok(h)) => h,
                    // A gap in the sequence: a record was lost, nothing after it counts.
                    Some(Err(())) => {
                        torn = true;
                        break;
                    }
                    // The end of this segment's records: a torn tail, or in a sealed segment
                    // the unused rest of a recycled or prepared file (rotation does not
                    // truncate it). Later segments still count if their sequence numbers
                    // continue without a gap, which the check above enforces record by record.
                    None => {
                        ended = true;
                        break;
                    }
                };
                if h.seq > skip_upto {
                    apply(
                        Replayed {
                            seq: h.seq,
                            kind: h.kind,
                            lba: h.lba,
                            nblocks: h.nblocks as u64,
                            seg: id,
                            data_off: pos + HEADER_LEN as u64,
                        },
                        &file,
                    );
                }
                seg_last = h.seq;
                prev_seq = Some(h.seq);
                last_seq = last_seq.max(h.seq);
                pos += h.total_len();
            }
            if torn || ended {
                discarded += len.saturating_sub(pos);
                if pos < len {
                    file.set_len(pos)?;
                    file.sync_data()?;
                }
            }
            if seg_last <= skip_upto {
                // Empty, or entirely covered by the published base: garbage.
                fs.remove(&path)?;
                dir_dirty = true;
                continue;
            }
            segments.insert(
                id,
                SegMeta {
                    file,
                    len: pos,
                    last_seq: seg_last,
                    header,
                    alloc: 0,
                },
            );
        }
        if dir_dirty {
            fs.sync_dir(dir)?;
        }
        let in_place = fs.overwrites_in_place(dir);
        let mut j = Journal {
            fs,
            dir: dir.to_path_buf(),
            segments,
            active: ids.last().copied().unwrap_or(0),
            next_seq: last_seq + 1,
            dirty: BTreeMap::new(),
            dir_dirty: false,
            fresh: None,
            max_segment,
            free,
            rotated: vec![],
            in_place,
            shared: Default::default(),
            held: Default::default(),
        };
        j.count_held();
        j.rotate()?;
        Ok((j, discarded))
    }

    /// A journal over segments hard-linked from a live source (a live fork): their
    /// metadata (id, length, last record, incarnation) is taken from the source's journal, which
    /// wrote and synced them, instead of replaying them; records continue after `last_seq`
    /// in a new active segment.
    pub fn adopt(
        fs: Arc<dyn Fs>,
        dir: &Path,
        segs: &[(u64, u64, u64, rec::SegmentHeader)],
        last_seq: u64,
        max_segment: u64,
    ) -> io::Result<Journal> {
        let mut segments = BTreeMap::new();
        for &(id, len, last, header) in segs {
            let file = fs.open(&seg_path(dir, id), false)?;
            segments.insert(
                id,
                SegMeta {
                    file,
                    len,
                    last_seq: last,
                    header,
                    alloc: 0,
                },
            );
        }
        let in_place = fs.overwrites_in_place(dir);
        let mut j = Journal {
            fs,
            dir: dir.to_path_buf(),
            active: segs.iter().map(|s| s.0).max().unwrap_or(0),
            segments,
            next_seq: last_seq + 1,
            dirty: BTreeMap::new(),
            dir_dirty: false,
            fresh: None,
            max_segment,
            free: vec![],
            rotated: vec![],
            in_place,
            shared: segs.iter().map(|s| s.0).collect(),
            held: Default::default(),
        };
        j.count_held();
        j.rotate()?;
        Ok(j)
    }

    /// (id, length, last record, incarnation) of the segments before segment `id`, oldest
    /// first.
    pub fn sealed_meta_before(&self, id: u64) -> Vec<(u64, u64, u64, rec::SegmentHeader)> {
        self.segments
            .range(..id)
            .map(|(i, m)| (*i, m.len, m.last_seq, m.header))
            .collect()
    }

    /// Marks segments as shared with a live fork (see `shared`).
    pub fn mark_shared(&mut self, ids: impl IntoIterator<Item = u64>) {
        self.shared.extend(ids);
    }

    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    pub fn active(&self) -> u64 {
        self.active
    }

    /// Bytes held by all segments.
    pub fn bytes(&self) -> u64 {
        self.held.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The live count behind [`Journal::bytes`], readable without the journal's lock.
    pub fn held(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.held.clone()
    }

    fn count_held(&self) {
        let n = self.segments.values().map(|s| s.len).sum();
        self.held.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn file(&self, seg: u64) -> Option<Arc<dyn FsFile>> {
        self.segments.get(&seg).map(|s| s.file.clone())
    }

    /// Seals the active segment and starts a new one (reusing a recycled file when there is
    /// one). Returns the new segment's id and file.
    pub fn rotate(&mut self) -> io::Result<(u64, Arc<dyn FsFile>)> {
        // The sealed segment keeps any unused bytes of a recycled or prepared file past its
        // last record: truncating here would free blocks under the writer lock (milliseconds on
        // a busy disk). Replay ends a segment at its first invalid record and goes on with the
        // next one only if the sequence continues without a gap.
        let id = self.active + 1;
        let path = seg_path(&self.dir, id);
        // Rotating away from a segment that never got a record: its header and name are synced
        // with (before) anything written after it, or replay would end there.
        if let Some(prev) = self.fresh.take() {
            if let Some(m) = self.segments.get(&prev) {
                self.dirty.insert(prev, m.file.clone());
                self.dir_dirty = true;
            }
        }
        let recycled = self.free.pop();
        let file = match &recycled {
            Some(f) => {
                if let Err(e) = self.fs.rename(f, &path) {
                    self.free.push(f.clone());
                    return Err(e);
                }
                self.fs.open(&path, false)
            }
            None => self.fs.open(&path, true),
        };
        // A fresh nonce per incarnation: records left in a recycled file never verify again.
        let header = rec::SegmentHeader {
            id,
            nonce: rand::random(),
            version: rec::SEGMENT_VERSION,
            first: rec::seq_code(self.next_seq),
        };
        let file = file.and_then(|f| {
            f.write_at(
                &rec::encode_segment_header_first(header.version, id, header.nonce, header.first),
                0,
            )?;
            Ok(f)
        });
        let file = file.and_then(|f| {
            // A recycled file's length is what was written before (a prepared one, zeros).
            let alloc = if recycled.is_some() { f.len()? } else { 0 };
            Ok((f, alloc))
        });
        let (file, alloc) = match file {
            Ok(f) => f,
            Err(e) => {
                // A full disk, say: the half-made segment (last, with no records) goes, so
                // nothing is left for replay to stop at, and the next append tries again.
                let _ = self.fs.remove(&path);
                return Err(e);
            }
        };
        self.fresh = Some(id);
        self.segments.insert(
            id,
            SegMeta {
                file: file.clone(),
                len: SEGMENT_HEADER_LEN as u64,
                last_seq: 0,
                header,
                alloc,
            },
        );
        self.active = id;
        self.held.fetch_add(
            SEGMENT_HEADER_LEN as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok((id, file))
    }

    /// Whether a prepared (allocated, written) file should be made for the pool.
    pub fn wants_prepared(&self) -> bool {
        self.free.is_empty()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Adds a prepared file to the pool; if the active segment is a fresh (growing) file that
    /// is still young, rotates into the prepared one at once so flushes stop paying for file
    /// growth. Returns the new active segment if it rotated.
    pub fn add_prepared(&mut self, path: PathBuf) -> io::Result<Option<(u64, Arc<dyn FsFile>)>> {
        self.free.push(path);
        let fresh = self
            .segments
            .get(&self.active)
            .is_some_and(|s| s.alloc == 0 && s.len < self.max_segment / 2);
        if fresh {
            return self.rotate().map(Some);
        }
        Ok(None)
    }

    /// Appends one record; returns (seq, segment, offset of its payload). Rotates first when
    /// the active segment is full: the new segment is then in [`Journal::take_rotated`], even
    /// when the record itself could not be written (a full disk), so readers can find every
    /// segment later records land in. A record that fails to write is not counted (the next
    /// append overwrites it).
    pub fn append(
        &mut self,
        kind: Kind,
        lba: u64,
        nblocks: u32,
        payload: &[u8],
    ) -> io::Result<(u64, u64, u64)> {
        if self.segments[&self.active].len >= self.max_segment {
            let r = self.rotate()?;
            self.rotated.push(r);
        }
        let r = self.place(kind, lba, nblocks)?;
        let off = r.write(payload)?;
        self.commit(&r, payload.len() as u64);
        Ok((r.seq, r.seg, off))
    }

    /// Reserves the place of one record in the active segment without writing it, when the
    /// record overwrites written blocks of a file from the pool (so writing it cannot run out
    /// of space), fits in one record and needs no rotation; `None` otherwise (the caller
    /// appends under the lock). The caller writes it with [`Reserved::write`] outside the
    /// journal's lock, and anything that needs every reserved record written (a sync, a cut,
    /// replay's contiguity) waits for that first: a record reserved and never written is a
    /// hole at which replay would stop.
    pub fn reserve(
        &mut self,
        kind: Kind,
        lba: u64,
        nblocks: u64,
        payload_len: u64,
    ) -> Option<Reserved> {
        let seg = self.segments.get(&self.active)?;
        if !self.in_place
            || nblocks > MAX_RECORD_BLOCKS as u64
            || seg.len >= self.max_segment
            || seg.len + HEADER_LEN as u64 + payload_len > seg.alloc
        {
            return None;
        }
        let r = self.place(kind, lba, nblocks as u32).ok()?;
        self.commit(&r, payload_len);
        Some(r)
    }

    /// [`Journal::append`] for several write records at once, under the lock: one write for
    /// all of them, in the active segment (rotated first when full; the group may run past
    /// the segment's size as one long record would). Items are (lba, blocks, payload); returns
    /// (seq, segment, payload offset) of each. On an error no record is counted.
    pub fn append_many(&mut self, items: &[(u64, u32, &[u8])]) -> io::Result<Vec<(u64, u64, u64)>> {
        if self.segments[&self.active].len >= self.max_segment {
            let r = self.rotate()?;
            self.rotated.push(r);
        }
        let mut rs = Vec::with_capacity(items.len());
        let mut at = None;
        for &(lba, n, p) in items {
            let mut r = self.place(Kind::Write, lba, n)?;
            // Back to back: each after the one before (`place` sees the segment uncommitted).
            let here = at.unwrap_or(r.at);
            r.at = here;
            r.seq = self.next_seq + rs.len() as u64;
            at = Some(here + (HEADER_LEN + p.len()) as u64);
            rs.push(r);
        }
        let payloads: Vec<&[u8]> = items.iter().map(|i| i.2).collect();
        let offs = match write_group(&rs, &payloads) {
            Ok(offs) => offs,
            Err(e) => {
                // A short write (a full disk) may have left whole, valid records of this
                // group past the segment's end, with sequence numbers the next appends will
                // reuse: one of them could then replay as a later record (a write refused
                // here applied over one acknowledged after it), or end the journal at a gap
                // in a sealed segment. Cut the file back to its records; if that fails too,
                // the error is not a full disk's, and the volume fails.
                let seg = self
                    .segments
                    .get_mut(&self.active)
                    .ok_or_else(|| io::Error::other("journal has no active segment"))?;
                // Synced at once: a power cut must not bring the stale records back under a
                // record written over the first of them later.
                if let Err(e2) = seg
                    .file
                    .set_len(seg.len)
                    .and_then(|()| seg.file.sync_data())
                {
                    return Err(io::Error::other(format!(
                        "{e}; cutting the segment back to its records failed: {e2}"
                    )));
                }
                // A growing file from here on (nothing past its records is written), so that a
                // prepared file is taken as soon as there is one.
                seg.alloc = 0;
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(rs.len());
        for ((r, off), p) in rs.iter().zip(offs).zip(&payloads) {
            self.commit(r, p.len() as u64);
            out.push((r.seq, r.seg, off));
        }
        Ok(out)
    }

    /// Reserves places for several records (each as [`Journal::reserve`]), stopping at the
    /// first that cannot be reserved: they lie back to back in the active segment, so one
    /// write lands them all ([`write_group`]). Items are (lba, blocks, payload bytes) of
    /// writes.
    pub fn reserve_many(&mut self, items: &[(u64, u64, u64)]) -> Vec<Reserved> {
        let mut out = Vec::with_capacity(items.len());
        for &(lba, n, len) in items {
            match self.reserve(Kind::Write, lba, n, len) {
                Some(r) => out.push(r),
                None => break,
            }
        }
        out
    }

    /// The next record's place in the active segment (not yet taken: see `commit`).
    fn place(&self, kind: Kind, lba: u64, nblocks: u32) -> io::Result<Reserved> {
        let seg = self
            .segments
            .get(&self.active)
            .ok_or_else(|| io::Error::other("journal has no active segment"))?;
        Ok(Reserved {
            seq: self.next_seq,
            seg: self.active,
            at: seg.len,
            file: seg.file.clone(),
            header: seg.header,
            kind,
            lba,
            nblocks,
        })
    }

    /// Takes the place `r` for a record with `payload_len` bytes of payload.
    fn commit(&mut self, r: &Reserved, payload_len: u64) {
        if let Some(seg) = self.segments.get_mut(&r.seg) {
            seg.len += HEADER_LEN as u64 + payload_len;
            self.held.fetch_add(
                HEADER_LEN as u64 + payload_len,
                std::sync::atomic::Ordering::Relaxed,
            );
            seg.last_seq = r.seq;
            self.dirty.insert(r.seg, seg.file.clone());
            if self.fresh == Some(r.seg) {
                // Its first record: the header and the segment's name are synced with it.
                self.fresh = None;
                self.dir_dirty = true;
            }
        }
        self.next_seq += 1;
    }

    /// Segments [`Journal::append`] rotated into since the last call.
    pub fn take_rotated(&mut self) -> Vec<(u64, Arc<dyn FsFile>)> {
        std::mem::take(&mut self.rotated)
    }

    /// Puts back what a failed sync of `batch` was meant to make durable, so a later flush
    /// tries again rather than believing it done.
    pub fn restore_dirty(&mut self, batch: SyncBatch) {
        for (id, f) in batch.files {
            self.dirty.entry(id).or_insert(f);
        }
        self.dir_dirty |= batch.dir.is_some();
    }

    /// Everything a flush must sync to make every record so far durable.
    pub fn take_dirty(&mut self) -> SyncBatch {
        let files = std::mem::take(&mut self.dirty).into_iter().collect();
        let dir = std::mem::take(&mut self.dir_dirty).then(|| self.dir.clone());
        SyncBatch {
            files,
            dir,
            upto: self.last_seq(),
        }
    }

    /// The oldest sealed segment: (id, bytes, last sequence number in it).
    pub fn oldest_sealed(&self) -> Option<(u64, u64, u64)> {
        self.segments
            .iter()
            .next()
            .filter(|(id, _)| **id != self.active)
            .map(|(id, s)| (*id, s.len, s.last_seq))
    }

    /// Takes the oldest sealed segment `id` out of the journal (cleaning copied its live records
    /// forward and synced them) to be retired by [`Retired::apply`] without the journal's lock.
    /// Until then the file keeps its name; replay after a crash applies its records under their
    /// newer copies, so the disk is the same.
    pub fn detach_oldest(&mut self, id: u64) -> io::Result<Retired> {
        if self.oldest_sealed().map(|(o, _, _)| o) != Some(id) {
            return Err(io::Error::other(format!(
                "segment {id} is not the oldest sealed segment"
            )));
        }
        Ok(self.detach(vec![id]))
    }

    /// Takes every sealed segment whose records are all `<= seq` out of the journal and returns
    /// them to be retired by [`Retired::apply`] *without* the journal's lock: unlinking and
    /// closing large files and the directory fsync take tens of milliseconds each, which writers
    /// must not wait for. Until then the files keep their segment names; replay after a crash
    /// skips them (their records are all published).
    pub fn detach_through(&mut self, seq: u64) -> Retired {
        let victims: Vec<u64> = self
            .segments
            .iter()
            .filter(|(id, s)| **id != self.active && s.last_seq <= seq)
            .map(|(id, _)| *id)
            .collect();
        self.detach(victims)
    }

    fn detach(&mut self, mut victims: Vec<u64>) -> Retired {
        victims.sort_unstable();
        let mut room = FREE_POOL.saturating_sub(self.free.len());
        let mut r = Retired {
            ids: victims.clone(),
            files: vec![],
            steps: vec![],
            fs: self.fs.clone(),
            dir: self.dir.clone(),
        };
        for id in victims {
            let file = self.segments.remove(&id).map(|m| {
                self.held
                    .fetch_sub(m.len, std::sync::atomic::Ordering::Relaxed);
                m.file
            });
            if let Some(f) = &file {
                r.files.push(f.clone());
            }
            // A retired segment stays in the dirty set until a flush syncs it: its name may
            // outlive a power cut (the rename below may not be durable yet), and a segment
            // whose header never reached the disk would end replay before later, flushed
            // segments.
            let path = seg_path(&self.dir, id);
            if let (true, Some(f)) = (room > 0 && !self.shared.contains(&id), file) {
                room -= 1;
                let to = self.dir.join(format!("{id:016x}.free"));
                r.steps.push((path, Some((to, f))));
            } else {
                r.steps.push((path, None));
            }
        }
        r
    }

    /// Takes back what [`Retired::apply`] finished: recycled paths join the pool, and the
    /// retired segments leave the dirty set (their renames are durable now, so no later flush
    /// needs to sync them, and their files can close and free their space).
    pub fn retired(&mut self, ids: &[u64], paths: Vec<PathBuf>) {
        for id in ids {
            self.dirty.remove(id);
        }
        self.free.extend(paths);
    }
}

/// The place of one record, reserved by [`Journal::reserve`].
pub(crate) struct Reserved {
    pub seq: u64,
    pub seg: u64,
    at: u64,
    file: Arc<dyn FsFile>,
    header: rec::SegmentHeader,
    kind: Kind,
    lba: u64,
    nblocks: u32,
}

impl Reserved {
    /// Writes the record; returns the offset of its payload.
    pub fn write(&self, payload: &[u8]) -> io::Result<u64> {
        let record = rec::encode_version(
            self.header.version,
            self.header.nonce,
            self.kind,
            self.seq,
            self.lba,
            self.nblocks,
            payload,
        );
        self.file.write_at(&record, self.at)?;
        Ok(self.at + HEADER_LEN as u64)
    }
}

/// Writes records reserved back to back by [`Journal::reserve_many`] with one write; returns
/// the offset of each payload. A torn write leaves a prefix of them, which replay reads as it
/// would the same records written one by one.
pub(crate) fn write_group(rs: &[Reserved], payloads: &[&[u8]]) -> io::Result<Vec<u64>> {
    let Some(first) = rs.first() else {
        return Ok(vec![]);
    };
    assert_eq!(rs.len(), payloads.len(), "one payload per record");
    let len: usize = payloads.iter().map(|p| HEADER_LEN + p.len()).sum();
    let mut buf = Vec::with_capacity(len);
    let mut offs = Vec::with_capacity(rs.len());
    for (r, p) in rs.iter().zip(payloads) {
        // Reserved back to back in one segment, or the one write would put them elsewhere.
        assert!(
            r.seg == first.seg && r.at == first.at + buf.len() as u64,
            "records of a group are contiguous"
        );
        offs.push(r.at + HEADER_LEN as u64);
        rec::encode_version_into(
            &mut buf,
            r.header.version,
            r.header.nonce,
            r.kind,
            r.seq,
            r.lba,
            r.nblocks,
            p,
        );
    }
    first.file.write_at(&buf, first.at)?;
    Ok(offs)
}

/// Segments detached from the journal, retired off its lock.
pub(crate) struct Retired {
    pub ids: Vec<u64>,
    files: Vec<Arc<dyn FsFile>>,
    /// Oldest first: each segment's path, and where it goes in the pool if it is recycled.
    steps: Vec<(PathBuf, Option<Recycle>)>,
    fs: Arc<dyn Fs>,
    dir: PathBuf,
}

/// A retired segment's name in the pool, and its handle (to see whether a fork links it).
type Recycle = (PathBuf, Arc<dyn FsFile>);

impl Retired {
    /// Renames the recyclable files and deletes the rest (and those of segments in `busy`,
    /// which a read still holds: unlinked, their blocks are never reused under it), one by one
    /// from the oldest, stopping at the first error; syncs the directory and closes the
    /// handles. Returns the recycled paths for [`Journal::add_free`].
    ///
    /// Oldest first, whatever goes where: what a crash or an error leaves is always the newer
    /// part of the journal, which replay reads whole. A newer segment gone with an older one
    /// left would look like lost records (replay's gap checks) and end the journal before
    /// flushed records.
    pub fn apply(self, busy: &[u64]) -> io::Result<Vec<PathBuf>> {
        let mut free = vec![];
        for (from, recycle) in &self.steps {
            match recycle {
                Some((to, file))
                    if !busy.iter().any(|id| *from == seg_path(&self.dir, *id))
                        // Shared with a fork (a hard link): overwriting it would change the
                        // fork's data.
                        && matches!(file.links(), Ok(1)) =>
                {
                    self.fs.rename(from, to)?;
                    free.push(to.clone());
                }
                _ => self.fs.remove(from)?,
            }
        }
        if !self.ids.is_empty() {
            self.fs.sync_dir(&self.dir)?;
        }
        drop(self.files);
        Ok(free)
    }
}

/// Makes a segment-sized file of written zeros (so later appends overwrite allocated blocks and
/// an fdatasync commits no metadata), durably, under a name replay ignores until it is ready.
pub(crate) fn prepare_file(fs: &dyn Fs, dir: &Path, size: u64) -> io::Result<PathBuf> {
    let tag: u64 = rand::random();
    let tmp = dir.join(format!("p{tag:016x}.prep"));
    let fill = || -> io::Result<()> {
        let f = fs.open(&tmp, true)?;
        let zeros = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < size {
            let n = (size - off).min(zeros.len() as u64) as usize;
            f.write_at(&zeros[..n], off)?;
            off += n as u64;
        }
        f.sync_data()
    };
    if let Err(e) = fill() {
        // A full disk, say: the partial file goes now, not at the next open of the journal.
        let _ = fs.remove(&tmp);
        return Err(e);
    }
    let ready = dir.join(format!("p{tag:016x}.free"));
    fs.rename(&tmp, &ready)?;
    fs.sync_dir(dir)?;
    Ok(ready)
}

#[cfg(test)]
mod tests;
