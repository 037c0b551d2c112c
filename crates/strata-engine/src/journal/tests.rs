//! Replay, retirement and recycling of journal segments.

use super::*;
use crate::fs::RealFs;

const MAX: u64 = 1 << 20;

fn open(dir: &Path, skip_upto: u64) -> (Journal, Vec<u64>) {
    let mut seqs = vec![];
    let (j, _) = Journal::open(Arc::new(RealFs), dir, skip_upto, MAX, |r, _| {
        seqs.push(r.seq)
    })
    .unwrap();
    (j, seqs)
}

fn append(j: &mut Journal, n: u64) -> Vec<(u64, u64, u64)> {
    (0..n)
        .map(|i| {
            let (seq, seg, off) = j.append(Kind::Write, i, 1, &[i as u8; 4096]).unwrap();
            (seq, seg, off)
        })
        .collect()
}

/// A sealed segment keeps the unused, zero-filled rest of a prepared file: replay ends that
/// segment at its last record and goes on with the next.
#[test]
fn a_sealed_segment_with_an_unused_tail_is_followed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    let first = append(&mut j, 3);
    let seg = first[0].1;
    j.file(seg).unwrap().set_len(MAX).unwrap(); // as a prepared file would be
    j.rotate().unwrap();
    append(&mut j, 2);
    drop(j);
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);
    let len = std::fs::metadata(seg_path(dir.path(), seg)).unwrap().len();
    assert!(len < MAX, "replay truncates the unused tail");
}

/// Three records with the third torn, then a sealed segment and two more records in the
/// next one. Returns the later segment's id.
fn torn_third_then_two_more(dir: &Path) -> u64 {
    let (mut j, _) = open(dir, 0);
    let first = append(&mut j, 3);
    let (_, seg, off) = first[2];
    j.file(seg).unwrap().write_at(&[0xff; 16], off).unwrap();
    j.rotate().unwrap();
    append(&mut j, 2)[0].1
}

/// A record lost at the end of a sealed segment leaves a gap before the next segment's
/// records: replay stops at the gap and deletes what follows (a clean prefix).
#[test]
fn a_lost_record_ends_the_journal_even_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let later = torn_third_then_two_more(dir.path());
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2]);
    assert!(!seg_path(dir.path(), later).exists());
}

/// Every record of the first segment lost (a power cut before anything was synced) and the
/// next segments' records there: the headers say where records begin, so replay stops rather
/// than start at a later segment (the crash campaign's seed 6527 recovered later writes
/// without earlier ones). Also after published records (the first unpublished one is named by
/// its segment's header, not assumed to follow them: cleaning deletes whole old segments).
#[test]
fn a_first_segment_whose_records_are_all_lost_ends_the_journal() {
    for skip in [0, 5] {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path(), skip);
        let first = append(&mut j, 2);
        assert_eq!(first[0].0, skip + 1);
        let (_, seg, off) = first[0];
        j.file(seg).unwrap().write_at(&[0xff; 16], off).unwrap();
        j.rotate().unwrap();
        let later = append(&mut j, 2)[0].1;
        j.rotate().unwrap();
        append(&mut j, 1);
        drop(j);
        let (j, seqs) = open(dir.path(), skip);
        assert_eq!(seqs, Vec::<u64>::new(), "skip {skip}");
        assert!(!seg_path(dir.path(), later + 1).exists());
        assert_eq!(
            j.last_seq(),
            skip,
            "the journal goes on from the published records"
        );
    }
}

/// What the header check must not catch: segments rotated away from before holding any
/// record, and the oldest segments deleted whole (cleaning, retirement): every record replays.
#[test]
fn empty_segments_and_a_deleted_oldest_one_replay_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    let oldest = append(&mut j, 2)[0].1; // records 1, 2
    j.rotate().unwrap();
    j.rotate().unwrap(); // an empty sealed segment
    append(&mut j, 2); // 3, 4
    j.rotate().unwrap();
    j.rotate().unwrap();
    append(&mut j, 1); // 5
    drop(j);
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);
    // The oldest segment deleted whole, its records published (or copied forward by cleaning).
    std::fs::remove_file(seg_path(dir.path(), oldest)).unwrap();
    let (_, seqs) = open(dir.path(), 2);
    assert_eq!(seqs, vec![3, 4, 5]);
    // Segments written before the header named the first record (0: unknown) are not judged.
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    let first = append(&mut j, 2);
    let (_, seg, off) = first[0];
    j.file(seg).unwrap().write_at(&[0xff; 16], off).unwrap();
    let f = j.file(seg).unwrap();
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    f.read_at(&mut h, 0).unwrap();
    h[12..16].copy_from_slice(&[0; 4]);
    f.write_at(&h, 0).unwrap();
    j.rotate().unwrap();
    append(&mut j, 1);
    drop(j);
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(
        seqs,
        vec![3],
        "an old header says nothing; the next record is taken as before"
    );
}

/// Published records left in a sealed segment also count for the gap check.
#[test]
fn a_gap_right_after_published_records_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    torn_third_then_two_more(dir.path());
    let (_, seqs) = open(dir.path(), 2); // records 1 and 2 are published
    assert_eq!(seqs, Vec::<u64>::new());
}

fn sync(fs: &dyn Fs, batch: SyncBatch) {
    for (_, f) in &batch.files {
        f.sync_data().unwrap();
    }
    if let Some(d) = &batch.dir {
        fs.sync_dir(d).unwrap();
    }
}

/// A segment retired after a publish keeps its name until the rename is durable: if its
/// header never reached the disk, a power cut would end replay there and drop later,
/// flushed segments. So retirement leaves it for the next flush to sync.
#[test]
fn a_retired_segment_is_synced_by_the_next_flush() {
    let fs = strata_simfs::SimFs::new();
    let dir = Path::new("/vol/journal");
    let (mut j, _) = Journal::open(Arc::new(fs.clone()), dir, 0, MAX, |_, _| {}).unwrap();
    sync(&fs, j.take_dirty());
    append(&mut j, 1);
    sync(&fs, j.take_dirty());
    j.rotate().unwrap(); // a segment created at a cut, never flushed …
    append(&mut j, 2); // … holding records 2 and 3, which a publish then covers
    j.rotate().unwrap();
    let _retired = j.detach_through(3); // its rename is not applied (durably) yet
    let later = append(&mut j, 2); // records 4 and 5, flushed:
    sync(&fs, j.take_dirty());
    fs.power_loss(7, false);
    let mut seqs = vec![];
    Journal::open(Arc::new(fs.clone()), dir, 3, MAX, |r, _| seqs.push(r.seq)).unwrap();
    assert_eq!(
        seqs,
        vec![4, 5],
        "flushed records after a retired segment survive"
    );
    assert_eq!(later[0].0, 4);
}

#[test]
fn a_segment_shared_with_a_fork_is_never_recycled() {
    let fs = strata_simfs::SimFs::new();
    let dir = Path::new("/vol/journal");
    let fork = Path::new("/fork/journal");
    fs.create_dir_all(fork).unwrap();
    let (mut j, _) = Journal::open(Arc::new(fs.clone()), dir, 0, MAX, |_, _| {}).unwrap();
    append(&mut j, 3);
    j.rotate().unwrap();
    let shared: Vec<PathBuf> = j
        .sealed_meta_before(j.active())
        .iter()
        .map(|m| seg_path(dir, m.0))
        .collect();
    for p in &shared {
        fs.hard_link(p, &fork.join(p.file_name().unwrap())).unwrap();
    }
    let linked = fs.read(&fork.join(shared[0].file_name().unwrap())).unwrap();
    // Published and retired: the pool has room, but the file has a second name.
    let retired = j.detach_through(3);
    let ids = retired.ids.clone();
    let free = retired.apply(&[]).unwrap();
    assert!(
        free.is_empty(),
        "a shared segment went to the pool: {free:?}"
    );
    j.retired(&ids, free);
    // Rotations reuse pooled files: the fork's copy must never change.
    for _ in 0..3 {
        append(&mut j, 2);
        j.rotate().unwrap();
    }
    let again = fs.read(&fork.join(shared[0].file_name().unwrap())).unwrap();
    assert!(again == linked, "the fork's segment was overwritten");
    let (_, gone) = Journal::open(Arc::new(fs.clone()), fork, 0, MAX, |_, _| {}).unwrap();
    assert_eq!(gone, 0);
}

/// Retirement goes oldest first whatever goes where (deleted or recycled), and stops at an
/// error: what it leaves is the newer part of the journal. (Before, recycled segments were
/// renamed before the deleted ones went: an older segment shared with a fork left behind a
/// newer, recycled one ended the next replay before flushed records.)
#[test]
fn retirement_goes_oldest_first_and_leaves_the_newer_part_on_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    let old = append(&mut j, 2)[0].1; // records 1, 2
    j.rotate().unwrap();
    let newer = append(&mut j, 2)[0].1; // 3, 4
    j.rotate().unwrap();
    append(&mut j, 2); // 5, 6: flushed, unpublished
    j.mark_shared([old]); // linked into a fork: deleted, never recycled
    let retired = j.detach_through(4);
    assert_eq!(retired.ids, vec![old, newer]);
    // The older segment cannot be removed (a directory stands at its name).
    let old_path = seg_path(dir.path(), old);
    std::fs::rename(&old_path, dir.path().join("aside")).unwrap();
    std::fs::create_dir(&old_path).unwrap();
    assert!(retired.apply(&[]).is_err());
    assert!(
        seg_path(dir.path(), newer).exists(),
        "a newer segment went while an older one stayed"
    );
    std::fs::remove_dir(&old_path).unwrap();
    std::fs::rename(dir.path().join("aside"), &old_path).unwrap();
    drop(j);
    let (_, seqs) = open(dir.path(), 4);
    assert_eq!(seqs, vec![5, 6], "the flushed records replay");
}

/// The journal's size is kept as segments grow, rotate, are prepared and retire: it is what
/// metrics read without the journal's lock, and it must equal a recount at every step.
#[test]
fn held_bytes_match_a_recount_through_appends_rotations_and_retirement() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    let held = j.held();
    let recount = |j: &Journal| j.segments.values().map(|s| s.len).sum::<u64>();
    let check = |j: &Journal| {
        assert_eq!(held.load(std::sync::atomic::Ordering::Relaxed), recount(j));
        assert_eq!(j.bytes(), recount(j));
    };
    check(&j);
    append(&mut j, 5);
    check(&j);
    j.rotate().unwrap();
    append(&mut j, 3);
    check(&j);
    let p = prepare_file(&RealFs, dir.path(), MAX).unwrap();
    j.add_prepared(p).unwrap();
    append(&mut j, 2);
    check(&j);
    let last = j.last_seq();
    let r = j.detach_through(last);
    assert!(!r.ids.is_empty());
    check(&j);
    drop(j);
    let (j, _) = open(dir.path(), 0);
    let n = j.bytes();
    assert!(n > 0);
    assert_eq!(n, recount(&j));
}

/// A journal written before the CRC check (segment version 1, BLAKE3 checks) replays after an
/// upgrade, torn tail and all, and the records that follow go into a version-2 segment; both
/// replay together after another restart.
#[test]
fn a_version_1_journal_replays_and_continues_in_version_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = seg_path(dir.path(), 1);
    let mut bytes = rec::encode_segment_header_version(1, 1, 0x5eed).to_vec();
    for seq in 1..=3u64 {
        bytes.extend(rec::encode_version(
            1,
            0x5eed,
            Kind::Write,
            seq,
            seq * 10,
            1,
            &[seq as u8; 4096],
        ));
    }
    let good = bytes.len() as u64;
    // A torn fourth record, and one with the current check: neither is version 1's.
    let mut torn = rec::encode_version(1, 0x5eed, Kind::Write, 4, 0, 1, &[4; 4096]);
    torn[100] ^= 1;
    bytes.extend(&torn);
    std::fs::write(&path, &bytes).unwrap();
    let mut v2 = bytes[..good as usize].to_vec();
    v2.extend(rec::encode(0x5eed, Kind::Write, 4, 0, 1, &[4; 4096]));

    let (mut j, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3]);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        good,
        "torn tail cut"
    );
    let more = append(&mut j, 2);
    assert_eq!(more.iter().map(|m| m.0).collect::<Vec<_>>(), vec![4, 5]);
    let head = std::fs::read(seg_path(dir.path(), more[0].1)).unwrap();
    let h = rec::decode_segment_header(&head).unwrap();
    assert_eq!((h.id, h.version), (more[0].1, rec::SEGMENT_VERSION));
    drop(j);
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);

    // The same version-1 segment with a version-2 record after its last: not taken.
    let d2 = tempfile::tempdir().unwrap();
    std::fs::write(seg_path(d2.path(), 1), &v2).unwrap();
    let (_, seqs) = open(d2.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3]);
}

/// The real file system, with every read at or past an offset failing (EIO).
struct EioFs(Arc<std::sync::atomic::AtomicU64>);
struct EioFile(Arc<dyn FsFile>, Arc<std::sync::atomic::AtomicU64>);

impl FsFile for EioFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.0.write_at(buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if off + buf.len() as u64 > self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.0.read_at(buf, off)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }
}

impl Fs for EioFs {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn FsFile>> {
        Ok(Arc::new(EioFile(
            RealFs.open(path, create)?,
            self.0.clone(),
        )))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        RealFs.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealFs.sync_dir(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        RealFs.exists(path)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.remove_dir_all(dir)
    }
}

/// A read error during replay fails the open and changes nothing: before, it was taken for a
/// torn tail, the segment truncated there and every later segment deleted (acknowledged
/// records lost to a transient EIO). Once the disk reads again, everything replays.
#[test]
fn a_read_error_during_replay_fails_the_open_and_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = open(dir.path(), 0);
    append(&mut j, 3);
    j.rotate().unwrap();
    append(&mut j, 2);
    drop(j);
    let lens = |d: &Path| -> Vec<(String, u64)> {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.metadata().unwrap().len(),
                )
            })
            .filter(|(n, _)| n.ends_with(".seg"))
            .collect();
        v.sort();
        v
    };
    let before = lens(dir.path());
    assert!(before.len() >= 2, "{before:?}");
    // Reads failing from the segment header on, from the first record's header on, and from
    // its payload on.
    for from in [
        0,
        SEGMENT_HEADER_LEN as u64,
        (SEGMENT_HEADER_LEN + HEADER_LEN) as u64,
    ] {
        let fail = Arc::new(std::sync::atomic::AtomicU64::new(from));
        let r = Journal::open(Arc::new(EioFs(fail)), dir.path(), 0, MAX, |_, _| {});
        assert!(r.is_err(), "a read error (from {from}) must fail the open");
        assert_eq!(lens(dir.path()), before, "nothing truncated or deleted");
    }
    let (_, seqs) = open(dir.path(), 0);
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);
}

/// Records acknowledged but never flushed in a pooled file rotated into, whose rename a power
/// cut undid: the next open rotates into that file again under the same id, with its new header
/// not yet synced. Those records were dropped by the replay after the first cut and must not
/// come back after a second one (a disk read and flushed without them would change under its
/// user): the open zeroes a pooled file's header before pooling it again.
#[test]
fn records_dropped_by_one_replay_never_return_after_the_next_power_cut() {
    for seed in 0..300 {
        let fs = strata_simfs::SimFs::new();
        let dir = Path::new("/vol/journal");
        let reopen = |fs: &strata_simfs::SimFs| {
            let mut seqs = vec![];
            let (mut j, _) =
                Journal::open(Arc::new(fs.clone()), dir, 0, MAX, |r, _| seqs.push(r.seq)).unwrap();
            // As `Volume::open` does: what replayed is synced, and the directory.
            sync(fs, j.take_dirty());
            fs.sync_dir(dir).unwrap();
            (j, seqs)
        };
        let (mut j, _) = reopen(&fs);
        append(&mut j, 3);
        sync(&fs, j.take_dirty());
        let p = prepare_file(&fs, dir, MAX).unwrap();
        j.add_prepared(p).unwrap(); // rotates into the pooled file
        append(&mut j, 3); // records 4..6, never flushed
        drop(j);
        fs.power_loss(seed, true);
        let (j, first) = reopen(&fs);
        drop(j);
        fs.power_loss(seed + 1000, true);
        let (_, second) = reopen(&fs);
        assert!(
            second.len() <= first.len(),
            "seed {seed}: records dropped by one replay came back: {first:?}, then {second:?}"
        );
    }
}
