//! Eviction: an uploaded file's bytes leave this node's disk.
//!
//! Once the object store holds a file (its meta names this file's size and BLAKE3, created
//! after every data key was created or matched), its name is replaced by an empty placeholder: a rename,
//! so a reader holding the file open keeps its bytes, and the name stays taken (a PUT racing
//! it still finds the name by its link). The local meta stays, so a retried PUT is still
//! answered `200` or `409` from this node's disk; reads of an evicted file come from the
//! object store, verified. Names are never deleted from the store (only with their tenant),
//! so a file whose bytes left is always there. Either side of a crash is a valid state: a full
//! file whose meta says uploaded is served from disk as before.

use crate::{rand_suffix, Relay, RelayFile};

impl Relay {
    /// Drops the local bytes of an uploaded file (see the module docs). A failure costs only
    /// space (the file is served from disk as before), so it is logged, not returned.
    pub(crate) fn evict(&self, tenant: &str, stream: &str, f: &RelayFile) {
        if let Err(e) = self.try_evict(tenant, stream, f) {
            tracing::warn!(tenant, stream, name = f.name, error = %e, "relay: evicting an uploaded file failed");
        }
    }

    /// A file of size 0 has nothing to drop.
    fn try_evict(&self, tenant: &str, stream: &str, f: &RelayFile) -> std::io::Result<()> {
        if f.uploaded_ms.is_none() || f.size == 0 {
            return Ok(());
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
}
