//! A node's relay files per tenant: the `.tenant` marker that binds them to one incarnation of
//! the tenant, durable directories, and their removal with the tenant.

use std::path::Path;

use crate::{rand_suffix, sync_dir, Relay};

impl Relay {
    /// Binds this node's relay files of `tenant` to the tenant created at `created_ms` (a
    /// `.tenant` marker in its directory): files of an earlier tenant of the name, deleted
    /// through another node while this one was away and then created again, are dropped first,
    /// never served, uploaded or taken for the new tenant's. A directory from before the
    /// markers is adopted.
    pub async fn bind_tenant(&self, tenant: &str, created_ms: u64) -> std::io::Result<()> {
        let dir = self.root.join(tenant);
        let marker = dir.join(".tenant");
        let want = created_ms.to_string();
        // The incarnation bound now: a tenant created again has a later `created_ms`.
        let bound = |m: &Path| -> std::io::Result<Option<u64>> {
            match std::fs::read_to_string(m) {
                // Unreadable: never taken for an earlier tenant's (that would drop files).
                Ok(s) => s.trim().parse().map(Some).map_err(std::io::Error::other),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            }
        };
        // A caller holding an earlier incarnation's `created_ms` (read before the tenant was
        // created again) must not undo a later binding, nor drop the files stored under it.
        let stale = || std::io::Error::other("the tenant was deleted and created again");
        match bound(&marker)? {
            Some(have) if have == created_ms => Ok(()),
            Some(have) if have > created_ms => Err(stale()),
            Some(_) => {
                // Under the gate, and only if no other request bound it meanwhile (which may
                // have stored the new tenant's first file already).
                let _gate = self.upload_gate.lock().await;
                match bound(&marker)? {
                    Some(have) if have == created_ms => return Ok(()),
                    Some(have) if have > created_ms => return Err(stale()),
                    _ => {}
                }
                self.drop_tenant_files(tenant)?;
                tracing::info!(
                    tenant,
                    "relay files of an earlier tenant of this name dropped"
                );
                self.write_marker(&dir, &want)
            }
            None => self.write_marker(&dir, &want),
        }
    }

    /// Creates `dir` (under `root`) if needed and makes its entry and every parent's up to
    /// `root` durable, once per directory and process: a new stream's first file is never
    /// acknowledged with the stream's (or its tenant's) directory entry still in the page
    /// cache, where a power cut takes the file with it. (After a restart the fsyncs run once
    /// again: a killed process may have left them undone.)
    pub(crate) fn durable_dir(&self, dir: &Path) -> std::io::Result<()> {
        let known = |d: &Path| {
            self.durable_dirs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(d)
        };
        if known(dir) {
            return Ok(());
        }
        std::fs::create_dir_all(dir)?;
        let mut d = dir;
        while d != self.root.as_path() {
            let Some(parent) = d.parent() else { break };
            if !known(d) {
                sync_dir(parent)?;
            }
            d = parent;
        }
        let mut done = self.durable_dirs.lock().unwrap_or_else(|p| p.into_inner());
        let mut d = dir;
        while d != self.root.as_path() {
            done.insert(d.to_path_buf());
            match d.parent() {
                Some(p) => d = p,
                None => break,
            }
        }
        Ok(())
    }

    /// Writes `dir/.tenant` durably (temp, fsync, rename, fsync of the directory).
    fn write_marker(&self, dir: &Path, want: &str) -> std::io::Result<()> {
        self.durable_dir(dir)?;
        let tmp = dir.join(format!(".tmp-tenant-{}", rand_suffix()));
        {
            use std::io::Write;
            let mut f = std::fs::File::create_new(&tmp)?;
            f.write_all(want.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, dir.join(".tenant"))?;
        sync_dir(dir)
    }

    /// The tenants with files on this node's disk (uploaded or not).
    pub fn local_tenants(&self) -> Vec<String> {
        std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|t| !t.starts_with('.'))
            .collect()
    }

    /// Forgets a tenant being deleted: nothing of it is uploaded any more (an upload under
    /// way finishes first) and its files leave this node's disk. `tenant` is a validated name.
    pub async fn forget_tenant(&self, tenant: &str) -> std::io::Result<()> {
        let _gate = self.upload_gate.lock().await;
        self.drop_tenant_files(tenant)
    }

    /// What [`Relay::forget_tenant`] does, for a caller holding the upload gate.
    fn drop_tenant_files(&self, tenant: &str) -> std::io::Result<()> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(t, _, _), _| t != tenant);
        let dir = self.root.join(tenant);
        let removed = match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        // Made again later, its directories need their fsyncs again (after the removal: one
        // made meanwhile is at worst synced twice).
        self.durable_dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|d| !d.starts_with(&dir));
        removed
    }
}

impl Relay {
    /// Deletes the keys of `tenant`'s earlier incarnations from the object store (files of an
    /// earlier tenant of the name that landed after its deletion purged its keys: an upload in
    /// flight on another node). Never read or listed (they are under another incarnation), they
    /// only cost space; `current` is the tenant's `created_ms` from the catalog. Returns the
    /// keys deleted. A listing by prefix of the incarnations, so a pass with none costs one
    /// request.
    pub async fn sweep_other_incarnations(
        &self,
        tenant: &str,
        current: u64,
    ) -> Result<u64, crate::RelayError> {
        use futures::StreamExt;
        use object_store::{ObjectStore, ObjectStoreExt};
        let store = self
            .store
            .inner_for(tenant)
            .await
            .map_err(crate::store_err)?;
        let root = strata_store::keys::relay_incarnations(tenant);
        let listed = store
            .list_with_delimiter(Some(&root))
            .await
            .map_err(crate::store_err)?;
        let mut deleted = 0;
        for p in listed.common_prefixes {
            // Only earlier incarnations: one that is not a number, or is the current one or
            // later (a tenant created again since the catalog was read), is left alone.
            match p.filename().and_then(|n| n.parse::<u64>().ok()) {
                Some(inc) if inc < current => {}
                _ => continue,
            }
            let keys: Vec<_> = store.list(Some(&p)).collect::<Vec<_>>().await;
            for k in keys {
                let k = k.map_err(crate::store_err)?;
                match store.delete(&k.location).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                    Err(e) => return Err(crate::store_err(e)),
                }
            }
        }
        if deleted > 0 {
            tracing::info!(
                tenant,
                deleted,
                "relay: keys of an earlier tenant of this name deleted"
            );
        }
        Ok(deleted)
    }
}
