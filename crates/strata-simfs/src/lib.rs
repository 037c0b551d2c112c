//! An in-memory file system that models power loss, for crash tests.
//!
//! Every file keeps two images: what a reader sees now, and what is *durable* (as of its last
//! `sync_data`). Directory entries are likewise durable only after `sync_dir` of their directory.
//! [`SimFs::power_loss`] throws away everything not durable, except that each file keeps a random
//! subset of its un-synced writes, the last kept one possibly torn at a random byte: the disk may
//! have written some of them, in any order, before the lights went out.
//!
//! A [`SimFs::process`] handle stands for one process's view: after a power cut every call
//! through it (and through files it opened) fails, as the process is gone. Work that was still
//! running in it (a background publish) thus stops at its next file operation instead of
//! writing into the disk the next process recovers.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use strata_fs::{Fs, FsFile};

#[derive(Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
    /// Writes (offset, bytes) and truncations (offset, empty, Some(len)) since the last sync.
    pending: Vec<(u64, Vec<u8>, Option<u64>)>,
}

#[derive(Default)]
struct State {
    /// path -> inode, as visible now.
    names: BTreeMap<PathBuf, Arc<Mutex<Inode>>>,
    /// path -> inode, as durable.
    durable_names: BTreeMap<PathBuf, Arc<Mutex<Inode>>>,
    dirs: Vec<PathBuf>,
}

#[derive(Clone, Default)]
pub struct SimFs {
    state: Arc<Mutex<State>>,
    counters: Arc<Mutex<HashMap<&'static str, u64>>>,
    /// Power cuts so far.
    boots: Arc<AtomicU64>,
    /// Of a process handle: the boot it was made in.
    born: Option<u64>,
    /// Microseconds every write of a whole block or more waits before it lands (a writer
    /// preempted in its `pwrite`), to widen the windows concurrent writes race in.
    write_delay_us: Arc<AtomicU64>,
    /// A power cut armed by [`SimFs::power_loss_after`]: (operations left, seed); 0 left is
    /// none armed.
    cut_armed: Arc<(AtomicU64, AtomicU64)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct SimFile(Arc<Mutex<Inode>>, SimFs);

impl FsFile for SimFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.1.alive()?;
        let delay = self.1.write_delay_us.load(SeqCst);
        if delay > 0 && buf.len() >= 4096 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        let mut i = lock(&self.0);
        let end = off as usize + buf.len();
        if i.data.len() < end {
            i.data.resize(end, 0);
        }
        i.data[off as usize..end].copy_from_slice(buf);
        i.pending.push((off, buf.to_vec(), None));
        Ok(())
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.1.alive()?;
        let i = lock(&self.0);
        let end = off as usize + buf.len();
        if end > i.data.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past end",
            ));
        }
        buf.copy_from_slice(&i.data[off as usize..end]);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.1.alive()?;
        let mut i = lock(&self.0);
        i.durable = i.data.clone();
        i.pending.clear();
        self.1.count("sync_data");
        Ok(())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.1.alive()?;
        let mut i = lock(&self.0);
        i.data.resize(len as usize, 0);
        i.pending.push((0, vec![], Some(len)));
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.1.alive()?;
        Ok(lock(&self.0).data.len() as u64)
    }
    fn links(&self) -> io::Result<u64> {
        self.1.alive()?;
        let st = lock(&self.1.state);
        Ok(st
            .names
            .values()
            .filter(|i| Arc::ptr_eq(i, &self.0))
            .count() as u64)
    }
}

fn not_found(p: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} not found", p.display()),
    )
}

impl SimFs {
    pub fn new() -> SimFs {
        SimFs::default()
    }

    /// One process's view of this disk: it dies at the next power cut (see the module docs).
    pub fn process(&self) -> SimFs {
        SimFs {
            born: Some(self.boots.load(SeqCst)),
            ..self.clone()
        }
    }

    fn alive(&self) -> io::Result<()> {
        if self.born.is_some() {
            self.count("op");
            let left = &self.cut_armed.0;
            if left
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok_and(|n| n == 1)
            {
                self.power_loss(self.cut_armed.1.load(SeqCst), true);
            }
        }
        match self.born {
            Some(b) if b != self.boots.load(SeqCst) => {
                self.count("dead");
                Err(io::Error::other("the process died in a power cut"))
            }
            _ => Ok(()),
        }
    }

    fn count(&self, what: &'static str) {
        *lock(&self.counters).entry(what).or_default() += 1;
    }

    /// Makes every write of a block or more wait `d` before it lands (see `write_delay_us`).
    pub fn set_write_delay(&self, d: std::time::Duration) {
        self.write_delay_us.store(d.as_micros() as u64, SeqCst);
    }

    /// How many times an operation ran (`sync_data`, `sync_dir`; `op`: any call through a
    /// process handle).
    pub fn counter(&self, what: &'static str) -> u64 {
        lock(&self.counters).get(what).copied().unwrap_or(0)
    }

    /// Simulates a power cut: see the module docs. `tear` allows torn and partially kept writes.
    pub fn power_loss(&self, seed: u64, tear: bool) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut st = lock(&self.state);
        self.boots.fetch_add(1, SeqCst);
        st.names = st.durable_names.clone();
        let inodes: Vec<_> = st.names.values().cloned().collect();
        for ino in inodes {
            let mut i = lock(&ino);
            let mut img = i.durable.clone();
            if tear {
                let pending = std::mem::take(&mut i.pending);
                for (off, bytes, trunc) in pending {
                    if !rng.random_bool(0.5) {
                        continue;
                    }
                    if let Some(len) = trunc {
                        img.resize(len as usize, 0);
                        continue;
                    }
                    let keep = if rng.random_bool(0.2) {
                        rng.random_range(0..=bytes.len())
                    } else {
                        bytes.len()
                    };
                    let end = off as usize + keep;
                    if img.len() < end {
                        img.resize(end, 0);
                    }
                    img[off as usize..end].copy_from_slice(&bytes[..keep]);
                }
            }
            i.pending.clear();
            i.data = img.clone();
            i.durable = img;
        }
    }

    /// Arms a power cut (torn, `seed`) at the `ops`-th file operation from now by any process
    /// handle (1: the next one), which then fails with every later one: a crash at a chosen
    /// step of what runs next.
    pub fn power_loss_after(&self, ops: u64, seed: u64) {
        self.cut_armed.1.store(seed, SeqCst);
        self.cut_armed.0.store(ops, SeqCst);
    }

    /// Sum of visible file sizes (for space checks).
    pub fn total_bytes(&self) -> u64 {
        let st = lock(&self.state);
        st.names.values().map(|i| lock(i).data.len() as u64).sum()
    }
}

impl Fs for SimFs {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn FsFile>> {
        self.alive()?;
        let mut st = lock(&self.state);
        let ino = match st.names.get(path) {
            Some(i) => i.clone(),
            None if create => {
                let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
                if !st.dirs.contains(&parent) {
                    return Err(not_found(&parent));
                }
                let i = Arc::new(Mutex::new(Inode::default()));
                st.names.insert(path.to_path_buf(), i.clone());
                i
            }
            None => return Err(not_found(path)),
        };
        Ok(Arc::new(SimFile(ino, self.clone())))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.alive()?;
        lock(&self.state)
            .names
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.alive()?;
        let mut st = lock(&self.state);
        let i = st.names.remove(from).ok_or_else(|| not_found(from))?;
        st.names.insert(to.to_path_buf(), i);
        Ok(())
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.alive()?;
        let st = lock(&self.state);
        if !st.dirs.iter().any(|d| d == dir) {
            return Err(not_found(dir));
        }
        Ok(st
            .names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect())
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.alive()?;
        // Directories themselves are modelled as always durable.
        let mut st = lock(&self.state);
        let mut d = Some(dir);
        while let Some(p) = d {
            if !st.dirs.iter().any(|x| x == p) {
                st.dirs.push(p.to_path_buf());
            }
            d = p.parent();
        }
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.alive()?;
        let mut st = lock(&self.state);
        let now: Vec<_> = st
            .names
            .iter()
            .filter(|(p, _)| p.parent() == Some(dir))
            .map(|(p, i)| (p.clone(), i.clone()))
            .collect();
        st.durable_names.retain(|p, _| p.parent() != Some(dir));
        st.durable_names.extend(now);
        drop(st);
        self.count("sync_dir");
        Ok(())
    }
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.alive()?;
        let mut st = lock(&self.state);
        let i = st.names.get(from).cloned().ok_or_else(|| not_found(from))?;
        if st.names.contains_key(to) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "link target exists",
            ));
        }
        let parent = to.parent().map(Path::to_path_buf).unwrap_or_default();
        if !st.dirs.contains(&parent) {
            return Err(not_found(&parent));
        }
        st.names.insert(to.to_path_buf(), i);
        Ok(())
    }
    fn exists(&self, path: &Path) -> bool {
        if self.alive().is_err() {
            return false;
        }
        let st = lock(&self.state);
        st.names.contains_key(path) || st.dirs.iter().any(|d| d == path)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.alive()?;
        let mut st = lock(&self.state);
        st.names.retain(|p, _| !p.starts_with(dir));
        st.dirs.retain(|p| !p.starts_with(dir));
        Ok(())
    }
}
