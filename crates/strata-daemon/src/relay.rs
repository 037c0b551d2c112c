//! The durable relay: files a sandbox pushes off the host while it runs (artifacts, PostgreSQL
//! WAL segments and base backups), answered `201` only once they are durable.
//!
//! ```text
//! PUT /v1/relay/{stream}/{name} ─▶ body streamed to DIR/.tmp-RAND (BLAKE3 while streaming,
//!     size limit) ─▶ fsync ─▶ [sync stream: conditional create in the object store]
//!     ─▶ hard link to DIR/{name} (never replaces) ─▶ unlink tmp ─▶ meta ─▶ fsync DIR ─▶ 201
//! background ─▶ oldest pending first: create-if-absent in the object store, then its meta,
//!     then mark the local meta uploaded (the upload lag per stream is a metric)
//! ```
//! `DIR` = `DATA/relay/{tenant}/{stream}`. A name once written never changes: the same bytes
//! again are a success (idempotent retry), other bytes a `409` that leaves the original alone.
//! Store keys: `t/{tenant}/relay/{stream}/data/{name}` and `…/meta/{name}` (JSON, below).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use strata_store::Store;

use crate::error::ApiError;
use axum::http::StatusCode;

/// What is known about one relayed file (also its on-disk and in-store meta format, version 1).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RelayFile {
    pub name: String,
    pub size: u64,
    pub blake3: String,
    pub created_ms: u64,
    /// When the object store acknowledged it (None: only on this node's disk so far).
    pub uploaded_ms: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct MetaV1 {
    format: u32,
    #[serde(flatten)]
    file: RelayFile,
}

/// Per-stream upload backlog.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Lag {
    pub pending_files: u64,
    pub pending_bytes: u64,
    /// Age of the oldest file not yet in the object store (the data-loss window off the host).
    pub lag_ms: u64,
}

type Key = (String, String, String); // tenant, stream, name

pub struct Relay {
    root: PathBuf,
    pub max_bytes: AtomicU64,
    store: Store,
    /// Files on local disk only, oldest first by creation.
    pending: Mutex<BTreeMap<Key, (u64, u64)>>, // (size, created_ms)
    pub uploaded_bytes: AtomicU64,
    pub conflicts: AtomicU64,
    pub failures: AtomicU64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn io(what: &str) -> impl Fn(std::io::Error) -> ApiError + '_ {
    move |e| {
        tracing::error!(error = %e, "relay: {what}");
        let mut a = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            format!("{what}: {e}"),
        );
        a.retryable = true;
        a
    }
}

fn store_err(e: impl std::fmt::Display) -> ApiError {
    let mut a = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        format!("object store: {e}"),
    );
    a.retryable = true;
    a
}

/// Test-only crash points (`STRATA_RELAY_FAULT=abort-after-fsync|abort-after-link`): the
/// process aborts there, as a power cut or kill -9 at that instant would stop it.
fn fault(point: &str) {
    if std::env::var("STRATA_RELAY_FAULT").as_deref() == Ok(point) {
        tracing::error!(point, "STRATA_RELAY_FAULT: aborting");
        std::process::abort();
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

fn conflict(name: &str, have: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "conflict",
        format!(
            "{name:?} already exists with different content (blake3 {have}); the original is kept"
        ),
    )
}

impl Relay {
    /// Opens the relay under `root`: removes temp files of interrupted uploads, rebuilds metas of
    /// files linked just before a crash, and queues whatever is not yet uploaded.
    pub fn open(root: PathBuf, store: Store, max_bytes: u64) -> std::io::Result<Relay> {
        std::fs::create_dir_all(&root)?;
        let relay = Relay {
            root,
            max_bytes: AtomicU64::new(max_bytes),
            store,
            pending: Mutex::new(BTreeMap::new()),
            uploaded_bytes: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        };
        for t in std::fs::read_dir(&relay.root)?.flatten() {
            let tenant = t.file_name().to_string_lossy().into_owned();
            for s in std::fs::read_dir(t.path())?.flatten() {
                let stream = s.file_name().to_string_lossy().into_owned();
                relay.recover_stream(&tenant, &stream)?;
            }
        }
        Ok(relay)
    }

    fn recover_stream(&self, tenant: &str, stream: &str) -> std::io::Result<()> {
        let dir = self.dir(tenant, stream);
        for e in std::fs::read_dir(&dir)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                std::fs::remove_file(e.path())?; // never answered 201: not ours to keep
                continue;
            }
            if name.starts_with('.') || !e.file_type()?.is_file() {
                continue;
            }
            let meta = match self.local_meta(tenant, stream, &name) {
                Some(m) => m,
                None => {
                    // Linked (complete, fsync'd) but the meta was not written: derive it.
                    let data = std::fs::read(e.path())?;
                    let m = RelayFile {
                        name: name.clone(),
                        size: data.len() as u64,
                        blake3: blake3::hash(&data).to_hex().to_string(),
                        created_ms: now_ms(),
                        uploaded_ms: None,
                    };
                    self.write_meta(tenant, stream, &m)?;
                    m
                }
            };
            if meta.uploaded_ms.is_none() {
                self.queue(tenant, stream, &meta);
            }
        }
        Ok(())
    }

    fn dir(&self, tenant: &str, stream: &str) -> PathBuf {
        self.root.join(tenant).join(stream)
    }

    fn meta_path(&self, tenant: &str, stream: &str, name: &str) -> PathBuf {
        self.dir(tenant, stream)
            .join(".meta")
            .join(format!("{name}.json"))
    }

    fn local_meta(&self, tenant: &str, stream: &str, name: &str) -> Option<RelayFile> {
        let raw = std::fs::read(self.meta_path(tenant, stream, name)).ok()?;
        let m: MetaV1 = serde_json::from_slice(&raw).ok()?;
        (m.format == 1 && m.file.name == name).then_some(m.file)
    }

    /// Writes the meta durably (temp, fsync, rename, fsync directory).
    fn write_meta(&self, tenant: &str, stream: &str, f: &RelayFile) -> std::io::Result<()> {
        let dir = self.dir(tenant, stream).join(".meta");
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join(format!(".tmp-{}", rand_suffix()));
        let body = serde_json::to_vec(&MetaV1 {
            format: 1,
            file: f.clone(),
        })
        .map_err(std::io::Error::other)?;
        {
            use std::io::Write;
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&body)?;
            file.sync_all()?;
        }
        std::fs::rename(&tmp, dir.join(format!("{}.json", f.name)))?;
        sync_dir(&dir)
    }

    fn queue(&self, tenant: &str, stream: &str, f: &RelayFile) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                (tenant.into(), stream.into(), f.name.clone()),
                (f.size, f.created_ms),
            );
    }

    fn data_key(tenant: &str, stream: &str, name: &str) -> object_store::path::Path {
        object_store::path::Path::from(format!("t/{tenant}/relay/{stream}/data/{name}"))
    }

    fn meta_key(tenant: &str, stream: &str, name: &str) -> object_store::path::Path {
        object_store::path::Path::from(format!("t/{tenant}/relay/{stream}/meta/{name}"))
    }

    async fn remote_meta(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
    ) -> Result<Option<RelayFile>, ApiError> {
        match self
            .store
            .inner()
            .get(&Self::meta_key(tenant, stream, name))
            .await
        {
            Ok(r) => {
                let b = r.bytes().await.map_err(store_err)?;
                let m: MetaV1 = serde_json::from_slice(&b)
                    .map_err(|e| store_err(format!("corrupt relay meta for {name:?}: {e}")))?;
                Ok(Some(m.file))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(e)),
        }
    }

    /// Creates the object if absent; if present, it must hold the same bytes. Then its meta.
    async fn upload(
        &self,
        tenant: &str,
        stream: &str,
        f: &RelayFile,
        data: Bytes,
    ) -> Result<(), ApiError> {
        let key = Self::data_key(tenant, stream, &f.name);
        let put = self
            .store
            .inner()
            .put_opts(
                &key,
                PutPayload::from(data.clone()),
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        match put {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                // An earlier attempt whose reply was lost, or another node's file of that name.
                let have = self.store.inner().get(&key).await.map_err(store_err)?;
                let have = have.bytes().await.map_err(store_err)?;
                let h = blake3::hash(&have).to_hex().to_string();
                if h != f.blake3 {
                    self.conflicts.fetch_add(1, Relaxed);
                    return Err(conflict(&f.name, &h));
                }
            }
            Err(e) => return Err(store_err(e)),
        }
        let meta = RelayFile {
            uploaded_ms: Some(now_ms()),
            ..f.clone()
        };
        let body = serde_json::to_vec(&MetaV1 {
            format: 1,
            file: meta,
        })
        .map_err(store_err)?;
        self.store
            .inner()
            .put(
                &Self::meta_key(tenant, stream, &f.name),
                PutPayload::from(body),
            )
            .await
            .map_err(store_err)?;
        self.uploaded_bytes.fetch_add(f.size, Relaxed);
        Ok(())
    }

    /// The PUT path (see the module docs). Returns the file and whether it was new.
    pub async fn put(
        &self,
        tenant: &str,
        stream: &str,
        sync: bool,
        name: &str,
        declared_len: Option<u64>,
        body: Body,
    ) -> Result<(RelayFile, bool), ApiError> {
        let max = self.max_bytes.load(Relaxed);
        if let Some(n) = declared_len.filter(|&n| n > max) {
            return Err(too_large(n, max));
        }
        let dir = self.dir(tenant, stream);
        std::fs::create_dir_all(&dir).map_err(io("creating the stream directory"))?;
        let tmp = dir.join(format!(".tmp-{}", rand_suffix()));
        let guard = TmpGuard(Some(tmp.clone()));
        let mut file = tokio::fs::File::create_new(&tmp)
            .await
            .map_err(io("creating a temp file"))?;
        let mut hasher = blake3::Hasher::new();
        let mut size = 0u64;
        let mut data = Vec::new(); // kept only for a sync stream's upload
        let mut s = body.into_data_stream();
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("request body interrupted: {e}; nothing was stored"))
            })?;
            size += chunk.len() as u64;
            if size > max {
                return Err(too_large(size, max));
            }
            hasher.update(&chunk);
            if sync {
                data.extend_from_slice(&chunk);
            }
            use tokio::io::AsyncWriteExt;
            file.write_all(&chunk).await.map_err(io("writing"))?;
        }
        if let Some(n) = declared_len.filter(|&n| n != size) {
            return Err(ApiError::invalid(format!(
                "Content-Length said {n} bytes, the body had {size}; nothing was stored"
            )));
        }
        file.sync_all().await.map_err(io("fsync of the file"))?;
        drop(file);
        fault("abort-after-fsync");
        let f = RelayFile {
            name: name.into(),
            size,
            blake3: hasher.finalize().to_hex().to_string(),
            created_ms: now_ms(),
            uploaded_ms: None,
        };
        if let Some(old) = self.existing(tenant, stream, name)? {
            return if old.blake3 == f.blake3 {
                Ok((old, false))
            } else {
                Err(conflict(name, &old.blake3))
            };
        }
        let mut f = f;
        if sync {
            self.upload(tenant, stream, &f, Bytes::from(data)).await?;
            f.uploaded_ms = Some(now_ms());
        }
        let target = dir.join(name);
        match std::fs::hard_link(&tmp, &target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // A concurrent PUT of the same name won the link.
                let old = self.existing(tenant, stream, name)?.ok_or_else(|| {
                    io("resolving a concurrent upload")(std::io::Error::other("no meta"))
                })?;
                return if old.blake3 == f.blake3 {
                    Ok((old, false))
                } else {
                    Err(conflict(name, &old.blake3))
                };
            }
            Err(e) => return Err(io("linking the file into place")(e)),
        }
        drop(guard); // removes the temp name; the data lives on under `name`
        fault("abort-after-link");
        self.write_meta(tenant, stream, &f)
            .map_err(io("writing the file's meta"))?;
        sync_dir(&dir).map_err(io("fsync of the stream directory"))?;
        if f.uploaded_ms.is_none() {
            self.queue(tenant, stream, &f);
        }
        Ok((f, true))
    }

    /// The file of that name on this node (meta, or derived from a file whose meta a crash
    /// lost).
    fn existing(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
    ) -> Result<Option<RelayFile>, ApiError> {
        if let Some(m) = self.local_meta(tenant, stream, name) {
            return Ok(Some(m));
        }
        let p = self.dir(tenant, stream).join(name);
        match std::fs::read(&p) {
            Ok(data) => Ok(Some(RelayFile {
                name: name.into(),
                size: data.len() as u64,
                blake3: blake3::hash(&data).to_hex().to_string(),
                created_ms: now_ms(),
                uploaded_ms: None,
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading an existing file")(e)),
        }
    }

    /// A file's meta and bytes: from this node's disk, else from the object store (verified).
    pub async fn get(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
    ) -> Result<(RelayFile, Bytes), ApiError> {
        if let Some(m) = self.local_meta(tenant, stream, name) {
            let data = tokio::fs::read(self.dir(tenant, stream).join(name))
                .await
                .map_err(io("reading the file"))?;
            return Ok((m, Bytes::from(data)));
        }
        let Some(m) = self.remote_meta(tenant, stream, name).await? else {
            return Err(ApiError::not_found(format!(
                "no file {name:?} in relay stream {stream:?}"
            )));
        };
        let data = self
            .store
            .inner()
            .get(&Self::data_key(tenant, stream, name))
            .await
            .map_err(store_err)?
            .bytes()
            .await
            .map_err(store_err)?;
        let h = blake3::hash(&data).to_hex().to_string();
        if h != m.blake3 || data.len() as u64 != m.size {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "corrupt",
                format!(
                    "{name:?} in the object store does not match its recorded hash; not served"
                ),
            ));
        }
        Ok((m, data))
    }

    /// Every file of a stream: this node's and the object store's.
    pub async fn list(&self, tenant: &str, stream: &str) -> Result<Vec<RelayFile>, ApiError> {
        let mut out: BTreeMap<String, RelayFile> = BTreeMap::new();
        let prefix = object_store::path::Path::from(format!("t/{tenant}/relay/{stream}/meta"));
        let metas: Vec<_> = self
            .store
            .inner()
            .list(Some(&prefix))
            .collect::<Vec<_>>()
            .await;
        for m in metas {
            let m = m.map_err(store_err)?;
            if let Some(name) = m.location.filename() {
                if let Some(f) = self.remote_meta(tenant, stream, name).await? {
                    out.insert(f.name.clone(), f);
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.dir(tenant, stream)) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                if let Some(f) = self.local_meta(tenant, stream, &name) {
                    out.entry(name).or_insert(f);
                }
            }
        }
        Ok(out.into_values().collect())
    }

    /// Upload backlog per (tenant, stream).
    pub fn lag(&self) -> BTreeMap<(String, String), Lag> {
        let now = now_ms();
        let mut out: BTreeMap<(String, String), Lag> = BTreeMap::new();
        for ((t, s, _), (size, created)) in self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let l = out.entry((t.clone(), s.clone())).or_default();
            l.pending_files += 1;
            l.pending_bytes += size;
            l.lag_ms = l.lag_ms.max(now.saturating_sub(*created));
        }
        out
    }

    /// One pass of the background uploader: every pending file, oldest first.
    pub async fn upload_pending(&self) {
        let mut todo: Vec<(Key, u64)> = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.1))
            .collect();
        todo.sort_by_key(|(_, created)| *created);
        for ((t, s, n), _) in todo {
            let Some(mut f) = self.local_meta(&t, &s, &n) else {
                continue;
            };
            let data = match tokio::fs::read(self.dir(&t, &s).join(&n)).await {
                Ok(d) => Bytes::from(d),
                Err(e) => {
                    tracing::warn!(tenant = t, stream = s, name = n, error = %e, "relay: reading a pending file failed");
                    continue;
                }
            };
            if blake3::hash(&data).to_hex().as_str() != f.blake3 {
                tracing::error!(
                    tenant = t,
                    stream = s,
                    name = n,
                    "relay: local file does not match its hash; not uploaded"
                );
                self.failures.fetch_add(1, Relaxed);
                continue;
            }
            match self.upload(&t, &s, &f, data).await {
                Ok(()) => {
                    f.uploaded_ms = Some(now_ms());
                    if let Err(e) = self.write_meta(&t, &s, &f) {
                        tracing::warn!(error = %e, "relay: recording an upload failed (it will be re-verified)");
                        continue;
                    }
                    self.pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&(t, s, n));
                }
                Err(e) => {
                    self.failures.fetch_add(1, Relaxed);
                    tracing::warn!(tenant = t, stream = s, name = n, error = %e.message, "relay: upload failed; will retry");
                    if e.status == StatusCode::CONFLICT {
                        // Another node holds other bytes under this name: keep ours local,
                        // stop retrying, count it.
                        self.pending
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&(t, s, n));
                    }
                    return; // back off until the next pass
                }
            }
        }
    }

    /// Runs [`Relay::upload_pending`] every `every` until the relay is dropped.
    pub fn spawn_uploader(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let r = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(r) = r.upgrade() else { return };
                r.upload_pending().await;
            }
        })
    }
}

fn too_large(n: u64, max: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!("{n} bytes is over the relay limit of {max} bytes; nothing was stored"),
    )
}

fn rand_suffix() -> String {
    use rand::Rng;
    format!("{:016x}", rand::rng().random::<u64>())
}

/// Removes a temp file unless disarmed.
struct TmpGuard(Option<PathBuf>);

impl Drop for TmpGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}
