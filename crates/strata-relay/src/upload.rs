//! The relay's side facing the object store: its keys, conditional creates, part by part
//! uploads of pending files, and the background uploader's pass.

use super::*;

use object_store::path::Path as ObjectPath;

/// Where a relay file's keys are in the object store (`strata_store::keys`; docs/FORMATS.md,
/// "Relay keys"). `Legacy`: `t/{T}/relay/{stream}/{meta,data}/…`, parts `data/{name}.p{i}`:
/// files stored before incarnations were in keys; read only, and only those created since the
/// tenant's current incarnation began. `Incarnation`: `t/{T}/relay2/{incarnation}/{stream}/
/// {meta,data,parts}/…`, parts `parts/{name}/{i}`: the tenant's `created_ms` in every key, so
/// a tenant created again under a deleted one's name starts from an empty key space whatever
/// lands late under the old one.
pub(crate) use strata_store::keys::RelayLayout as Layout;

/// A file's meta as the object store holds it.
pub(crate) struct Remote {
    pub file: RelayFile,
    /// Format 2: the BLAKE3 of each part.
    pub parts: Option<Vec<String>>,
    pub layout: Layout,
}

impl Relay {
    /// A key of a relay file's in `layout`: `what` is `meta`, `data` or `parts`.
    fn key(tenant: &str, stream: &str, layout: Layout, what: &str, rest: &str) -> ObjectPath {
        strata_store::keys::relay(tenant, stream, layout, what, rest)
    }

    pub(crate) fn data_key(tenant: &str, stream: &str, name: &str, layout: Layout) -> ObjectPath {
        Self::key(tenant, stream, layout, "data", name)
    }

    /// Part `i` of a file stored in parts. In the legacy layout `data/{name}.p{i}`, which is
    /// also the data key of a file named `{name}.p{i}`: the two could not both be stored.
    pub(crate) fn part_key(
        tenant: &str,
        stream: &str,
        name: &str,
        i: usize,
        layout: Layout,
    ) -> ObjectPath {
        match layout {
            Layout::Legacy => Self::key(tenant, stream, layout, "data", &format!("{name}.p{i}")),
            Layout::Incarnation(_) => {
                Self::key(tenant, stream, layout, "parts", &format!("{name}/{i}"))
            }
        }
    }

    pub(crate) fn meta_key(tenant: &str, stream: &str, name: &str, layout: Layout) -> ObjectPath {
        Self::key(tenant, stream, layout, "meta", name)
    }

    /// The prefix of a stream's metas in `layout` (listings).
    pub(crate) fn meta_prefix(tenant: &str, stream: &str, layout: Layout) -> ObjectPath {
        strata_store::keys::relay_prefix(tenant, stream, layout, "meta")
    }

    /// The tenant incarnation this node's relay files of `tenant` are bound to (its
    /// `created_ms`, from the `.tenant` marker [`Relay::bind_tenant`] writes before any file of
    /// the tenant is stored, read or uploaded).
    pub(crate) fn incarnation(&self, tenant: &str) -> Result<u64, RelayError> {
        let marker = self.root.join(tenant).join(".tenant");
        match std::fs::read_to_string(&marker) {
            Ok(s) => s.trim().parse().map_err(|e| {
                io("reading the tenant marker")(std::io::Error::other(format!("{e}")))
            }),
            Err(e) => Err(io("reading the tenant marker")(e)),
        }
    }

    /// A file's meta in the object store, and where its bytes are: under the tenant's
    /// incarnation, else (a file stored before incarnations were in keys) the legacy layout,
    /// but there only a file created since this incarnation of the tenant began. A file of an
    /// earlier tenant of the name (an upload in flight on another node when that tenant was
    /// deleted, landing after its keys were purged) is never found, listed or served.
    pub(crate) async fn remote_meta(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
    ) -> Result<Option<Remote>, RelayError> {
        let inc = self.incarnation(tenant)?;
        for layout in [Layout::Incarnation(inc), Layout::Legacy] {
            let key = Self::meta_key(tenant, stream, name, layout);
            let b = match self.store.get_value(&key).await {
                Ok(b) => b,
                Err(object_store::Error::NotFound { .. }) => continue,
                Err(e) => return Err(store_err(e)),
            };
            let m: MetaV1 = serde_json::from_slice(&b)
                .map_err(|e| store_err(format!("corrupt relay meta for {name:?}: {e}")))?;
            let parts_ok = match (&m.parts, m.format) {
                (None, 1) => true,
                (Some(p), 2) => p.len() as u64 == m.file.size.div_ceil(PART),
                _ => false,
            };
            if !parts_ok || m.file.name != name {
                return Err(store_err(format!(
                    "relay meta for {name:?} is inconsistent"
                )));
            }
            if layout == Layout::Legacy && m.file.created_ms < inc {
                return Ok(None); // an earlier tenant's
            }
            return Ok(Some(Remote {
                file: m.file,
                parts: m.parts,
                layout,
            }));
        }
        Ok(None)
    }

    /// Creates `key` with `bytes` if absent; if present, it must hold bytes hashing to `hash`.
    pub(crate) async fn create_or_match(
        &self,
        key: &object_store::path::Path,
        bytes: Bytes,
        hash: &str,
        name: &str,
    ) -> Result<(), RelayError> {
        let put = self
            .store
            .put_value_opts(
                key,
                bytes,
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        match put {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. }) => {
                // An earlier attempt whose reply was lost, or another node's file of that name.
                let have = self.store.get_value(key).await.map_err(store_err)?;
                let h = blake3::hash(&have).to_hex().to_string();
                if h != hash {
                    self.conflicts.fetch_add(1, Relaxed);
                    return Err(conflict(name, &h));
                }
                Ok(())
            }
            Err(e) => Err(store_err(e)),
        }
    }

    /// Uploads the local file at `path` (whose meta is `f`): one object, or parts of [`PART`]
    /// bytes read one at a time; each created if absent or matched; then its meta, created if
    /// absent (one already there must name the same size and bytes: otherwise the name's first
    /// file keeps it, whatever its size, and this is a conflict). The bytes read must hash to
    /// the meta's hash, or nothing is recorded. Success means the store holds this file whole
    /// (names leave the store only with their tenant): its local bytes may go.
    pub(crate) async fn upload(
        &self,
        tenant: &str,
        stream: &str,
        f: &RelayFile,
        path: &Path,
    ) -> Result<(), RelayError> {
        use tokio::io::AsyncReadExt;
        let _slot = self
            .transfers
            .acquire()
            .await
            .map_err(|_| RelayError::Closed)?;
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(io("opening the file to upload"))?;
        let n = f.size.div_ceil(PART).max(1) as usize;
        let layout = Layout::Incarnation(self.incarnation(tenant)?);
        // A name the store holds already, in either layout (an earlier attempt whose reply
        // was lost, another node's file, a file stored before incarnations were in keys):
        // the same file is done, another is a conflict. Without this a file under the
        // legacy layout would be shadowed by another one created under the new.
        if let Some(r) = self.remote_meta(tenant, stream, &f.name).await? {
            if r.file.size == f.size && r.file.blake3 == f.blake3 {
                return Ok(());
            }
            self.conflicts.fetch_add(1, Relaxed);
            return Err(conflict(&f.name, &r.file.blake3));
        }
        let mut whole = blake3::Hasher::new();
        let mut parts = vec![];
        for i in 0..n {
            let len = (f.size - i as u64 * PART).min(PART) as usize;
            let mut buf = vec![0u8; len];
            file.read_exact(&mut buf)
                .await
                .map_err(io("reading the file to upload"))?;
            whole.update(&buf);
            if n == 1 {
                if whole.finalize().to_hex().as_str() != f.blake3 {
                    return Err(corrupt_local(&f.name));
                }
                let key = Self::data_key(tenant, stream, &f.name, layout);
                self.create_or_match(&key, Bytes::from(buf), &f.blake3, &f.name)
                    .await?;
                break;
            }
            let h = blake3::hash(&buf).to_hex().to_string();
            let key = Self::part_key(tenant, stream, &f.name, i, layout);
            if i == n - 1 && whole.finalize().to_hex().as_str() != f.blake3 {
                return Err(corrupt_local(&f.name));
            }
            self.create_or_match(&key, Bytes::from(buf), &h, &f.name)
                .await?;
            parts.push(h);
        }
        let meta = RelayFile {
            uploaded_ms: Some(now_ms()),
            ..f.clone()
        };
        let parted = n > 1;
        let body = serde_json::to_vec(&MetaV1 {
            format: if parted { 2 } else { 1 },
            file: meta,
            parts: parted.then_some(parts),
        })
        .map_err(store_err)?;
        let put = self
            .store
            .put_value_opts(
                &Self::meta_key(tenant, stream, &f.name, layout),
                Bytes::from(body),
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        match put {
            Ok(_) => {}
            // An earlier attempt whose reply was lost, or another node's file of the name.
            Err(object_store::Error::AlreadyExists { .. }) => {
                match self.remote_meta(tenant, stream, &f.name).await? {
                    Some(r) if r.file.size == f.size && r.file.blake3 == f.blake3 => {}
                    Some(r) => {
                        self.conflicts.fetch_add(1, Relaxed);
                        return Err(conflict(&f.name, &r.file.blake3));
                    }
                    None => return Err(store_err(format!("meta of {:?} vanished", f.name))),
                }
            }
            Err(e) => return Err(store_err(e)),
        }
        self.uploaded_bytes.fetch_add(f.size, Relaxed);
        Ok(())
    }

    /// One pass of the background uploader: every pending file whose turn has come, each
    /// tenant's oldest first, the tenants in turn (one file of each in turn, so a tenant with
    /// thousands of files waiting delays another's by one file, not by its backlog). A failing file waits longer after each failure (up to [`MAX_BACKOFF`]) and the
    /// pass goes on with the next tenant's files, so one tenant's failing uploads (a store
    /// prefix refusing writes, a key the store keeps failing) never stall the others'. Uploads
    /// run one at a time: a store that fails only after a long timeout still delays the other
    /// tenants by that attempt, once per pass.
    pub async fn upload_pending(&self) {
        let now = std::time::Instant::now();
        let mut todo: Vec<(Key, u64)> = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, p)| p.retry_at.is_none_or(|at| at <= now))
            .map(|(k, p)| (k.clone(), p.created_ms))
            .collect();
        todo.sort_by_key(|(_, created)| *created);
        let todo = in_turns(todo);
        // Tenants whose upload failed in this pass: their other files wait for the next one
        // (they most likely fail the same way), so a store that fails slowly costs the other
        // tenants one attempt per failing tenant and pass, not one per file.
        let mut failed = std::collections::HashSet::new();
        for ((t, s, n), _) in todo {
            if failed.contains(&t) {
                continue;
            }
            let _gate = self.upload_gate.lock().await;
            let key = (t.clone(), s.clone(), n.clone());
            if !self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&key)
            {
                continue; // its tenant was deleted meanwhile
            }
            let mut f = match self.read_local_meta(&t, &s, &n) {
                Ok(Some(f)) => f,
                // No meta: its directory went (a tenant removed), nothing to upload.
                Ok(None) => {
                    self.pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                    continue;
                }
                // Unreadable: kept, and retried after the backoff like a failed upload.
                Err(e) => {
                    tracing::warn!(tenant = t, stream = s, name = n, error = %e, "relay: a queued file's meta cannot be read; will retry");
                    self.back_off(&key);
                    continue;
                }
            };
            if f.uploaded_ms.is_some() {
                // Queued again by a PUT that read the meta just before this uploader marked
                // it uploaded: done (its bytes may be gone already, else they go now).
                self.evict(&t, &s, &f);
                self.pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&key);
                continue;
            }
            let path = self.dir(&t, &s).join(&n);
            let res = match self.upload(&t, &s, &f, &path).await {
                Ok(()) => {
                    f.uploaded_ms = Some(now_ms());
                    self.write_meta(&t, &s, &f).map_err(|e| {
                        tracing::warn!(error = %e, "relay: recording an upload failed (it will be re-verified)");
                        RelayError::Io { what: "recording an upload", source: e }
                    })
                }
                Err(e) => {
                    self.failures.fetch_add(1, Relaxed);
                    tracing::warn!(tenant = t, stream = s, name = n, error = %e, "relay: upload failed; will retry");
                    Err(e)
                }
            };
            if res.is_ok() {
                self.evict(&t, &s, &f);
            }
            match res {
                Ok(())
                // Another node holds other bytes under this name: keep ours local, stop
                // retrying (counted).
                | Err(
                    RelayError::Conflict { .. }
                    | RelayError::CorruptLocal(_)
                    | RelayError::CorruptRemote(_),
                ) => {
                    self.pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                }
                Err(_) => {
                    failed.insert(t.clone());
                    self.back_off(&key);
                }
            }
        }
    }

    /// A queued file's attempt failed: its next waits longer (0.5 s, doubling to
    /// [`MAX_BACKOFF`]).
    fn back_off(&self, key: &Key) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pending.get_mut(key) {
            p.failures = p.failures.saturating_add(1);
            let wait = FIRST_BACKOFF
                .saturating_mul(2u32.saturating_pow(p.failures - 1))
                .min(MAX_BACKOFF);
            p.retry_at = Some(std::time::Instant::now() + wait);
        }
    }
}

/// How long a file waits after its first failed upload; each further failure doubles it.
const FIRST_BACKOFF: std::time::Duration = std::time::Duration::from_millis(500);
/// The longest a failing file waits between attempts.
pub const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);

/// Files (oldest first) reordered so that tenants take turns: the oldest file of each tenant
/// in the order of their oldest, then the second of each, and so on.
fn in_turns(files: Vec<(Key, u64)>) -> Vec<(Key, u64)> {
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut per: Vec<std::collections::VecDeque<(Key, u64)>> = Vec::new();
    for f in files {
        let i = *index.entry(f.0 .0.clone()).or_insert_with(|| {
            per.push(Default::default());
            per.len() - 1
        });
        per[i].push_back(f);
    }
    let mut out = Vec::new();
    while !per.is_empty() {
        per.retain_mut(|q| match q.pop_front() {
            Some(f) => {
                out.push(f);
                true
            }
            None => false,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41, item 6: the uploader went oldest file first across tenants, so one tenant's
    /// backlog held every other tenant's files behind it.
    #[test]
    fn tenants_take_turns_in_an_upload_pass() {
        let k = |t: &str, n: u64| ((t.to_string(), "s".to_string(), n.to_string()), n);
        let mut files: Vec<_> = (0..50).map(|n| k("heavy", n)).collect();
        files.push(k("light", 60));
        files.push(k("late", 70));
        let order: Vec<String> = in_turns(files)
            .into_iter()
            .map(|((t, _, _), _)| t)
            .collect();
        assert_eq!(&order[..3], ["heavy", "light", "late"]);
        assert_eq!(order.len(), 52);
    }
}
