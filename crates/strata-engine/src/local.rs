//! The volume's durable local state: which published head its journal sits on.
//!
//! `state.json`, replaced atomically (temp, fdatasync, rename, directory fsync):
//! `{ "format": 1, "tenant", "workspace", "journal_id", "base_version", "base_manifest",
//!    "base_seq", "created_ms"? }`. Every journal record with `seq <= base_seq` is already in
//! `base_manifest`. `created_ms` is the catalog row's (the workspace's incarnation): a journal
//! left by a deleted workspace never applies to another one made under its name.

use std::path::Path;

use serde::{Deserialize, Serialize};
use strata_format::Hash;

use crate::fs::Fs;
use crate::{Error, Result};

pub const LOCAL_FORMAT: u32 = 1;

/// A live fork's marker (`engine/fork.rs`), in its directory until a local state naming the
/// fork's catalog row replaces the one the fork wrote before the row existed.
pub const FORK_MARKER: &str = "forking.json";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LocalState {
    pub format: u32,
    pub tenant: String,
    pub workspace: String,
    pub journal_id: String,
    pub base_version: u64,
    pub base_manifest: Hash,
    pub base_seq: u64,
    /// The catalog row's creation time: which incarnation of the name this journal belongs
    /// to. Absent in states written before it was kept, and in a live fork's first state
    /// (written before its row exists; its marker guards it until then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_ms: Option<u64>,
}

impl LocalState {
    /// Whether this state can belong to the catalog's workspace created at `created_ms`.
    pub fn same_incarnation(&self, created_ms: u64) -> bool {
        self.created_ms.is_none_or(|c| c == created_ms)
    }
}

impl LocalState {
    pub fn load(fs: &dyn Fs, dir: &Path) -> Result<Option<LocalState>> {
        let p = dir.join("state.json");
        if !fs.exists(&p) {
            return Ok(None);
        }
        let bytes = fs
            .read(&p)
            .map_err(Error::io(format!("reading {}", p.display())))?;
        match serde_json::from_slice::<LocalState>(&bytes) {
            Ok(s) if s.format == LOCAL_FORMAT => Ok(Some(s)),
            Ok(s) => Err(Error::Invalid(format!(
                "{}: unsupported local state format {}",
                p.display(),
                s.format
            ))),
            Err(e) => Err(Error::Invalid(format!(
                "{}: corrupt local state: {e}",
                p.display()
            ))),
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self)
            .map_err(|e| Error::Invalid(format!("encoding local state: {e}")))
    }

    pub fn store(&self, fs: &dyn Fs, dir: &Path) -> Result<()> {
        let bytes = self.encode()?;
        fs.write_atomic(&dir.join("state.json"), &bytes)
            .map_err(Error::io(format!("writing {}/state.json", dir.display())))?;
        // Durable with the incarnation: a live fork's marker has done its work (its removal
        // need not be synced: one that comes back is settled against the catalog).
        let marker = dir.join(FORK_MARKER);
        if self.created_ms.is_some() && fs.exists(&marker) {
            if let Err(e) = fs.remove(&marker) {
                tracing::warn!(file = %marker.display(), error = %e, "removing a fork's marker failed; the next attach settles it");
            }
        }
        Ok(())
    }
}

pub fn new_journal_id() -> String {
    use rand::Rng;
    let mut b = [0u8; 16];
    rand::rng().fill(&mut b);
    strata_format::Hash::of(&b).to_hex()[..32].to_string()
}
