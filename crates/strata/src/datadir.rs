//! Who works on a data directory at a time.
//!
//! A daemon (`strata serve`) owns its data directory: it resumes what it finds there, serves
//! the relay's files and removes what a crash left half-written. A CLI process without
//! `STRATA_URL` works on the same files itself (an API verb run in process, a foreground
//! `ws attach`, `ws write`, `ws export`), so the two must not meet: the daemon holds
//! `DATA/daemon.lock` exclusively for its life and CLI processes hold it shared for theirs
//! (the kernel lets go when a process ends, kill -9 included). A CLI process refuses to run
//! while a daemon holds it (its requests belong to that daemon); a daemon waits a while for
//! CLI processes to finish. Two CLI processes may share the directory: a workspace's own lock
//! (in the engine) keeps two of them from attaching the same workspace.

use std::io::{Read, Seek, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::client::ApiFailure;

/// Held for the process's life (dropping it lets go).
pub struct DataDirLock(std::fs::File);

const FILE: &str = "daemon.lock";

/// How long a starting daemon waits for CLI processes on its data directory.
const DAEMON_WAIT: Duration = Duration::from_secs(30);

fn open(data: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(data)
        .map_err(|e| anyhow::anyhow!("creating data directory {}: {e}", data.display()))?;
    let p = data.join(FILE);
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", p.display()))
}

fn holder(f: &mut std::fs::File) -> String {
    let mut s = String::new();
    let _ = f.rewind();
    let _ = f.take(256).read_to_string(&mut s);
    s.trim().to_string()
}

/// For a CLI process working on `data` itself; refused while a daemon owns it.
pub fn local(data: &Path) -> anyhow::Result<DataDirLock> {
    let mut f = open(data)?;
    match f.try_lock_shared() {
        Ok(()) => Ok(DataDirLock(f)),
        Err(std::fs::TryLockError::WouldBlock) => {
            let who = holder(&mut f);
            Err(ApiFailure::refused(409, "conflict", format!(
                "a daemon serves {} ({}): send it the request (STRATA_URL=its address, STRATA_TOKEN)",
                data.display(),
                if who.is_empty() { "starting" } else { who.as_str() }
            ))
            .into())
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e.into()),
    }
}

impl DataDirLock {
    /// For `strata serve`: waits (up to 30 s) for CLI processes working on `data`, then owns
    /// it. Another daemon on the same directory is refused the same way.
    pub fn daemon(data: &Path) -> anyhow::Result<DataDirLock> {
        let f = open(data)?;
        let started = Instant::now();
        let mut told = false;
        loop {
            match f.try_lock() {
                Ok(()) => {
                    let mut l = DataDirLock(f);
                    l.say(&format!("pid {}", std::process::id()))?;
                    return Ok(l);
                }
                Err(std::fs::TryLockError::WouldBlock) if started.elapsed() < DAEMON_WAIT => {
                    if !told {
                        tracing::warn!(data = %data.display(), "another strata process works on this data directory; waiting for it");
                        told = true;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    // Not the file's text: a CLI process (shared) writes none, and what is
                    // there may be an earlier daemon's.
                    return Err(ApiFailure::refused(409, "conflict", format!(
                        "another strata process works on {} (a CLI command, a foreground `ws attach` or another daemon): stop it first",
                        data.display()
                    ))
                    .into());
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
            }
        }
    }

    /// What another process is told about the holder (a daemon: its pid and address).
    pub fn say(&mut self, what: &str) -> std::io::Result<()> {
        self.0.set_len(0)?;
        self.0.rewind()?;
        self.0.write_all(what.as_bytes())
    }
}
