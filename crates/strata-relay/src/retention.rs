//! What leaves this node's disk and the object store: local copies once uploaded (eviction),
//! and files past their stream's retention (expiry, run by GC).
//!
//! Eviction replaces an uploaded file's name with an empty placeholder (a rename, so a reader
//! holding the file open keeps its bytes, and the name stays taken: a PUT racing it still
//! finds the name by its link). The local meta stays too, so a retried PUT is still answered
//! `200` or `409` from this node's disk; reads of an evicted file come from the object store,
//! verified. Either side of a crash is a valid state: a full file with an uploaded meta is
//! evicted again when the relay opens.

use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::{rand_suffix, store_err, Relay, RelayError, RelayFile};

/// What one expiry pass over a stream found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expired {
    pub files: u64,
    pub bytes: u64,
}

impl Relay {
    /// Drops the local bytes of an uploaded file (see the module docs). A file of size 0 has
    /// nothing to drop.
    pub(crate) fn evict(&self, tenant: &str, stream: &str, f: &RelayFile) -> std::io::Result<()> {
        if f.uploaded_ms.is_none() || f.size == 0 {
            return Ok(());
        }
        let _g = self.local_gate.lock().unwrap_or_else(|p| p.into_inner());
        // Still this node's file, recorded as uploaded (an expiry may have removed it).
        match self.local_meta(tenant, stream, &f.name) {
            Some(m) if m.uploaded_ms.is_some() && m.size == f.size && m.blake3 == f.blake3 => {}
            _ => return Ok(()),
        }
        let dir = self.dir(tenant, stream);
        let path = dir.join(&f.name);
        match std::fs::metadata(&path) {
            Ok(m) if m.len() == f.size => {}
            Ok(_) => return Ok(()), // evicted already
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
        // A `.tmp-` name: a crash before the rename leaves only what the next open removes.
        let placeholder = dir.join(format!(".tmp-evict-{}", rand_suffix()));
        std::fs::File::create_new(&placeholder)?;
        if let Err(e) = std::fs::rename(&placeholder, &path) {
            let _ = std::fs::remove_file(&placeholder);
            return Err(e);
        }
        Ok(())
    }

    /// Deletes the files of `stream` created more than `keep_ms` before `now_ms` from the
    /// object store (data or parts first, the meta last, so a pass cut short leaves a listed
    /// file that the next pass finishes), and this node's meta and placeholder of each. A file
    /// not uploaded yet is not in the store's listing: it is expired by a pass after its
    /// upload. Only metas the store last wrote more than `keep_ms` ago are read (a meta is
    /// written after its file's creation, so no younger file is among the rest, whatever the
    /// clocks' skew in the store's favour). `dry_run` only counts.
    pub async fn expire(
        &self,
        tenant: &str,
        stream: &str,
        keep_ms: u64,
        now_ms: u64,
        dry_run: bool,
    ) -> Result<Expired, RelayError> {
        let inner = self.store.inner_for(tenant).await.map_err(store_err)?;
        let prefix = object_store::path::Path::from(format!("t/{tenant}/relay/{stream}/meta"));
        let old_before = now_ms.saturating_sub(keep_ms) as i64;
        let mut names: Vec<String> = vec![];
        let mut listing = inner.list(Some(&prefix));
        while let Some(m) = listing.next().await {
            let m = m.map_err(store_err)?;
            if m.last_modified.timestamp_millis() <= old_before {
                names.extend(m.location.filename().map(str::to_string));
            }
        }
        let mut out = Expired::default();
        for name in names {
            let Some((f, parts)) = self.remote_meta(tenant, stream, &name).await? else {
                continue; // deleted meanwhile (another node's pass)
            };
            if f.created_ms.saturating_add(keep_ms) > now_ms {
                continue;
            }
            out.files += 1;
            out.bytes += f.size;
            if dry_run {
                continue;
            }
            let data: Vec<object_store::path::Path> = match &parts {
                None => vec![Self::data_key(tenant, stream, &name)],
                Some(p) => (0..p.len())
                    .map(|i| Self::part_key(tenant, stream, &name, i))
                    .collect(),
            };
            for key in data.iter().chain([&Self::meta_key(tenant, stream, &name)]) {
                match inner.delete(key).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(store_err(e)),
                }
            }
            self.forget_local(tenant, stream, &name);
            tracing::info!(
                tenant,
                stream,
                name,
                size = f.size,
                "relay: file expired by its stream's retention"
            );
        }
        Ok(out)
    }

    /// Removes this node's copy of an expired (uploaded) file: its bytes or placeholder, then
    /// its meta (in that order: a crash between leaves a meta the next PUT of the name checks
    /// against the store, never a placeholder without a meta). A file still pending upload
    /// here is left alone.
    pub(crate) fn forget_local(&self, tenant: &str, stream: &str, name: &str) {
        let _g = self.local_gate.lock().unwrap_or_else(|p| p.into_inner());
        let Some(m) = self.local_meta(tenant, stream, name) else {
            return;
        };
        if m.uploaded_ms.is_none() {
            return;
        }
        let dir = self.dir(tenant, stream);
        for p in [dir.join(name), self.meta_path(tenant, stream, name)] {
            if let Err(e) = std::fs::remove_file(&p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %p.display(), error = %e, "relay: removing an expired file's local copy failed");
                }
            }
        }
    }
}
