//! `cuts.log`: where a volume records its cuts (local checkpoints) so they survive a crash.
//!
//! A file of [`LOG_BYTES`] written zeros, made once (fdatasync'd, directory fsync'd), in which
//! records are written in place one after another. An append is one `write` plus one
//! `fdatasync` of blocks that are already allocated and written: no metadata changes, so no
//! file-system journal commit (which on ext4 would also wait for other files' data, the
//! background uploads' among them). Each record:
//!
//! ```text
//! len u32 LE │ n u64 LE │ check u64 LE (first 8 bytes of BLAKE3(n ‖ payload)) │ payload (JSON)
//! ```
//!
//! Reading stops at the first record that is zero, torn, fails its check or does not continue
//! the count `n` (records left from an earlier round of the file). Payloads are `Entry` values:
//! a cut, or the withdrawal of one (a background cut folded back); for a version, the last
//! entry wins. When the file is full, the entries still pending are written into a fresh file
//! that atomically replaces it (temp, fdatasync, rename, directory fsync).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::layers::LayerRecord;
use crate::fs::{Fs, FsFile};
use crate::{Error, Result};

pub(crate) const LOG_BYTES: u64 = 256 << 10;
const FILE: &str = "cuts.log";
const HEADER: usize = 4 + 8 + 8;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Entry {
    Cut(LayerRecord),
    Withdraw { version: u64 },
}

#[derive(Serialize, Deserialize)]
struct Payload {
    /// The journal these cuts belong to (a log left by another journal is ignored).
    journal: String,
    entry: Entry,
}

/// The open log: where the next record goes.
pub(crate) struct CutLog {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    journal: String,
    file: Arc<dyn FsFile>,
    pos: u64,
    next_n: u64,
}

fn check(n: u64, payload: &[u8]) -> u64 {
    let mut b = n.to_le_bytes().to_vec();
    b.extend_from_slice(payload);
    u64::from_le_bytes(
        strata_format::Hash::of(&b).0[..8]
            .try_into()
            .expect("8 bytes"),
    )
}

fn frame(n: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&n.to_le_bytes());
    f.extend_from_slice(&check(n, payload).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// The valid records of `buf`: (entries, end of the last, next count).
fn parse(buf: &[u8], journal: &str) -> (Vec<Entry>, u64, u64) {
    let mut out = Vec::new();
    let (mut pos, mut prev): (usize, Option<u64>) = (0, None);
    while pos + HEADER <= buf.len() {
        let len = u32::from_le_bytes(buf[pos..pos + 4].try_into().expect("4")) as usize;
        let n = u64::from_le_bytes(buf[pos + 4..pos + 12].try_into().expect("8"));
        let c = u64::from_le_bytes(buf[pos + 12..pos + 20].try_into().expect("8"));
        let end = pos + HEADER + len;
        if len == 0 || end > buf.len() || prev.is_some_and(|p| p.checked_add(1) != Some(n)) {
            break;
        }
        let payload = &buf[pos + HEADER..end];
        if check(n, payload) != c {
            break;
        }
        let Ok(p) = serde_json::from_slice::<Payload>(payload) else {
            break;
        };
        if p.journal == journal {
            out.push(p.entry);
        }
        prev = Some(n);
        pos = end;
    }
    (out, pos as u64, prev.map_or(0, |p| p.saturating_add(1)))
}

/// A file of `LOG_BYTES` zeros holding `records` at its start, written and synced beside the
/// log (`cuts.log.tmp`, returned): not yet in place.
fn write_staged(fs: &dyn Fs, dir: &Path, records: &[u8]) -> std::io::Result<PathBuf> {
    let tmp = dir.join("cuts.log.tmp");
    let f = fs.open(&tmp, true)?;
    f.set_len(0)?;
    let mut img = vec![0u8; LOG_BYTES as usize];
    img[..records.len()].copy_from_slice(records);
    f.write_at(&img, 0)?;
    f.sync_data()?;
    Ok(tmp)
}

/// A file of `LOG_BYTES` zeros holding `records` at its start, durably in place.
fn make(fs: &dyn Fs, dir: &Path, records: &[u8]) -> std::io::Result<()> {
    let tmp = write_staged(fs, dir, records)?;
    fs.rename(&tmp, &dir.join(FILE))?;
    fs.sync_dir(dir)
}

fn encode(journal: &str, e: &Entry) -> Result<Vec<u8>> {
    serde_json::to_vec(&Payload {
        journal: journal.to_string(),
        entry: e.clone(),
    })
    .map_err(|e| Error::Invalid(format!("encoding a cut: {e}")))
}

/// A new volume's log holding `entries`, written and synced but not in place: returns (the
/// staged file, the log's name) for the caller to rename and then make durable with one fsync
/// of the directory, shared with its other files (a live fork's first layer, `engine/fork.rs`).
pub(crate) fn stage(
    fs: &dyn Fs,
    dir: &Path,
    journal: &str,
    entries: &[Entry],
) -> Result<(PathBuf, PathBuf)> {
    let mut img = Vec::new();
    for (n, e) in entries.iter().enumerate() {
        img.extend(frame(n as u64, &encode(journal, e)?));
    }
    if img.len() as u64 > LOG_BYTES {
        return Err(Error::Invalid("the cuts do not fit the cut log".into()));
    }
    let tmp = write_staged(fs, dir, &img).map_err(Error::io("staging the cut log"))?;
    Ok((tmp, dir.join(FILE)))
}

impl CutLog {
    /// Opens (or makes) the log of the volume in `dir` whose journal is `journal`, returning
    /// it with the entries it holds, in order.
    pub fn open(fs: Arc<dyn Fs>, dir: &Path, journal: &str) -> Result<(CutLog, Vec<Entry>)> {
        let path = dir.join(FILE);
        if !fs.exists(&path) {
            make(&*fs, dir, &[]).map_err(Error::io("making the cut log"))?;
        }
        let file = fs
            .open(&path, false)
            .map_err(Error::io("opening the cut log"))?;
        let len = file
            .len()
            .map_err(Error::io("reading the cut log"))?
            .min(LOG_BYTES);
        let mut buf = vec![0u8; len as usize];
        file.read_at(&mut buf, 0)
            .map_err(Error::io("reading the cut log"))?;
        let (entries, pos, next_n) = parse(&buf, journal);
        let mut log = CutLog {
            fs,
            dir: dir.to_path_buf(),
            journal: journal.to_string(),
            file,
            pos,
            next_n,
        };
        if len < LOG_BYTES || next_n > u64::MAX / 2 {
            // Not one of ours (shorter than made, or a count near its end): a fresh file with
            // what it held, counting from 0.
            log.next_n = 0;
            log.rewrite(&entries)?;
        }
        Ok((log, entries))
    }

    fn payload(&self, e: &Entry) -> Result<Vec<u8>> {
        encode(&self.journal, e)
    }

    /// Appends `e` durably. When the file is full, it is replaced by one holding `live`
    /// (everything still pending, `e` included) instead.
    pub fn append(&mut self, e: &Entry, live: &[Entry]) -> Result<()> {
        let f = frame(self.next_n, &self.payload(e)?);
        if self.pos + f.len() as u64 > LOG_BYTES {
            return self.rewrite(live);
        }
        let io = || -> std::io::Result<()> {
            self.file.write_at(&f, self.pos)?;
            self.file.sync_data()
        };
        io().map_err(Error::io("recording a checkpoint's cut"))?;
        self.pos += f.len() as u64;
        self.next_n = self.next_n.saturating_add(1);
        Ok(())
    }

    /// Replaces the file with one holding exactly `entries`.
    fn rewrite(&mut self, entries: &[Entry]) -> Result<()> {
        let mut img = Vec::new();
        let mut n = self.next_n;
        for e in entries {
            img.extend(frame(n, &self.payload(e)?));
            n = n.saturating_add(1);
        }
        if img.len() as u64 > LOG_BYTES {
            return Err(Error::Invalid(format!(
                "{} pending cuts do not fit the cut log",
                entries.len()
            )));
        }
        make(&*self.fs, &self.dir, &img).map_err(Error::io("rewriting the cut log"))?;
        self.file = self
            .fs
            .open(&self.dir.join(FILE), false)
            .map_err(Error::io("opening the cut log"))?;
        self.pos = img.len() as u64;
        self.next_n = n;
        Ok(())
    }
}

/// The cuts still pending after `entries` (for each version the last entry wins; withdrawn
/// versions are dropped), oldest first.
pub(crate) fn pending(entries: Vec<Entry>) -> Vec<LayerRecord> {
    let mut by: std::collections::BTreeMap<u64, Option<LayerRecord>> = Default::default();
    for e in entries {
        match e {
            Entry::Cut(r) => {
                by.insert(r.version, Some(r));
            }
            Entry::Withdraw { version } => {
                by.insert(version, None);
            }
        }
    }
    by.into_values().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::RealFs;
    use strata_catalog::CheckpointKind;

    fn rec(version: u64) -> LayerRecord {
        LayerRecord {
            cut: version * 10,
            version,
            kind: CheckpointKind::Checkpoint,
            label: None,
            keep_until_ms: None,
            disk_size: 0,
            taken_ms: 0,
            adopt: None,
            rollback_to: None,
        }
    }

    #[test]
    fn records_survive_reopen_torn_tails_and_rewrites() {
        let d = tempfile::tempdir().unwrap();
        let fs: Arc<dyn Fs> = Arc::new(RealFs);
        let (mut log, e) = CutLog::open(fs.clone(), d.path(), "j").unwrap();
        assert!(e.is_empty());
        for v in 1..=3 {
            log.append(&Entry::Cut(rec(v)), &[]).unwrap();
        }
        log.append(&Entry::Withdraw { version: 3 }, &[]).unwrap();
        let end = log.pos;
        drop(log);
        let (log, e) = CutLog::open(fs.clone(), d.path(), "j").unwrap();
        assert_eq!(pending(e), vec![rec(1), rec(2)]);
        // A torn record after the last one is ignored, and overwritten by the next.
        log.file.write_at(&[7u8; 30], end).unwrap();
        drop(log);
        let (mut log, e) = CutLog::open(fs.clone(), d.path(), "j").unwrap();
        assert_eq!(pending(e).len(), 2);
        log.append(&Entry::Cut(rec(3)), &[]).unwrap();
        drop(log);
        // Another journal's log holds nothing for this one.
        assert!(CutLog::open(fs.clone(), d.path(), "k")
            .unwrap()
            .1
            .is_empty());
        let (mut log, e) = CutLog::open(fs.clone(), d.path(), "j").unwrap();
        assert_eq!(pending(e), vec![rec(1), rec(2), rec(3)]);
        // Filling the file rewrites it with what is live; stale records of the earlier round
        // that follow are not read as a continuation.
        let live: Vec<Entry> = vec![Entry::Cut(rec(3))];
        let mut v = 4;
        while log.pos > 200 || v == 4 {
            log.append(&Entry::Cut(rec(v)), &live).unwrap();
            v += 1;
        }
        drop(log);
        let (_, e) = CutLog::open(fs, d.path(), "j").unwrap();
        assert_eq!(pending(e), vec![rec(3)]);
    }

    proptest::proptest! {
        /// Hostile or damaged bytes (the log is read back from disk): parsing never panics, and
        /// a valid log with any byte changed or cut short yields a prefix of its entries.
        #[test]
        fn damaged_logs_yield_a_prefix_never_a_panic(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            at in 0usize..4096,
            byte in proptest::prelude::any::<u8>(),
            cut in 0usize..4096,
        ) {
            let _ = parse(&junk, "j");
            let entries: Vec<Entry> = (1..=6)
                .map(|v| if v == 4 { Entry::Withdraw { version: 2 } } else { Entry::Cut(rec(v)) })
                .collect();
            let mut img = Vec::new();
            for (n, e) in entries.iter().enumerate() {
                let payload = serde_json::to_vec(&Payload { journal: "j".into(), entry: e.clone() }).unwrap();
                img.extend(frame(n as u64, &payload));
            }
            let (all, end, next) = parse(&img, "j");
            proptest::prop_assert_eq!(&all, &entries);
            proptest::prop_assert_eq!((end as usize, next), (img.len(), 6));
            let mut bad = img.clone();
            if let Some(b) = bad.get_mut(at) {
                *b ^= byte | 1;
            }
            bad.truncate(cut.max(at.min(bad.len())));
            let (got, _, _) = parse(&bad, "j");
            proptest::prop_assert!(got.len() <= entries.len());
            proptest::prop_assert_eq!(&got[..], &entries[..got.len()]);
        }
    }
}
