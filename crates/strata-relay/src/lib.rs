//! The durable relay: files a sandbox pushes off the host while it runs (artifacts, PostgreSQL
//! WAL segments and base backups), answered `201` only once they are durable.
//!
//! ```text
//! PUT /v1/relay/{stream}/{name} ─▶ body streamed to DIR/.tmp-RAND (BLAKE3 while streaming,
//!     size limit) ─▶ fsync ─▶ [sync stream: conditional create in the object store]
//!     ─▶ hard link to DIR/{name} (never replaces) ─▶ unlink tmp ─▶ meta ─▶ fsync DIR ─▶ 201
//! background ─▶ oldest pending first: create-if-absent in the object store, then its meta,
//!     then mark the local meta uploaded (the upload lag per stream is a metric), then evict
//!     the local bytes (see `eviction`: reads come from the store from then on)
//! ```
//! `DIR` = `DATA/relay/{tenant}/{stream}`. A name once written never changes: the same bytes
//! again are a success (idempotent retry), other bytes a `409` that leaves the original alone.
//! PUTs of one name are serialised by a lock of that name. A same-bytes retry of a file that
//! is neither uploaded nor queued (its PUT failed after the link: `500`) makes it durable and
//! queues it before its `200`, as recovery at start does, restoring its bytes from the retry's
//! body if a crash lost them (`Relay::existing`).
//! Store keys: `t/{tenant}/relay2/{incarnation}/{stream}/data/{name}` and `…/meta/{name}`
//! (JSON, below), where the incarnation is the tenant's `created_ms`; a file over [`PART`]
//! bytes is stored as parts `…/parts/{name}/{i}`, each created if absent and hashed in its
//! meta (format 2), so no transfer ever holds more than one part in memory. Files stored
//! before incarnations were in keys (`t/{tenant}/relay/{stream}/…`) are still read, those
//! created since the tenant's incarnation began only (`upload::Layout`).
//!
//! Memory is bounded whatever the files' sizes: bodies stream to disk, uploads read one part
//! at a time, reads from the store are spooled to an unlinked temp file and verified before
//! their first byte is served, local files are streamed; at most [`TRANSFERS`] transfers hold a
//! part in memory at once.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use object_store::{ObjectStore, PutMode, PutOptions};
use serde::{Deserialize, Serialize};
use strata_store::Store;

mod eviction;
mod tenants;
mod upload;

/// What is known about one relayed file (also its on-disk and in-store meta format, version 1).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
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
    /// Format 2: the file is stored in parts of [`PART`] bytes, with these BLAKE3 hashes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parts: Option<Vec<String>>,
}

/// Files up to this size are one object; larger ones are parts of this size. (A PostgreSQL WAL
/// segment, 16 MiB by default, is one object.)
pub const PART: u64 = 16 << 20;

/// Transfers (uploads, reads from the store) that may hold a part in memory at once.
pub const TRANSFERS: usize = 4;

/// BLAKE3 and size of a local file, read in chunks.
fn hash_file(path: &Path) -> std::io::Result<(String, u64)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((h.finalize().to_hex().to_string(), n))
}

/// A file's bytes as a stream, 64 KiB at a time (what a response body is made of).
pub fn file_stream(
    f: tokio::fs::File,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    use tokio::io::AsyncReadExt;
    futures::stream::unfold(f, |mut f| async move {
        let mut buf = vec![0u8; 64 << 10];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    })
}

/// Why a relay operation failed. Each says what a client is told (the API maps it) and
/// whether a retry can help.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// This node's disk failed (retryable).
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The object store failed (retryable).
    #[error("object store: {0}")]
    Store(String),
    #[error(
        "{name:?} already exists with different content (blake3 {have}); the original is kept"
    )]
    Conflict { name: String, have: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{n} bytes is over the relay limit of {max} bytes; nothing was stored")]
    TooLarge { n: u64, max: u64 },
    #[error("relay file {0:?} on this node does not match its hash; not uploaded")]
    CorruptLocal(String),
    #[error("{0:?} in the object store does not match its recorded hash; not served")]
    CorruptRemote(String),
    #[error("relay closed")]
    Closed,
    /// The caller's admission refused the bytes: the node's free-space floor.
    #[error("{0}")]
    NoSpace(String),
    /// The caller's admission refused the bytes: the tenant's quota or share.
    #[error("{0}")]
    Quota(String),
    /// The caller's admission refused the bytes for now: the tenant holds its share of what
    /// the node lends (retryable).
    #[error("{0}")]
    Busy(String),
}

impl RelayError {
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RelayError::Io { .. } | RelayError::Store(_) | RelayError::Busy(_)
        )
    }
}

/// Admits bytes before they are written to this node's disk (its free-space floor, the
/// tenant's quota): called with each piece's length as it arrives, never with a declared
/// length alone, so a body sent chunked is held to the same limits as one that said its size.
pub type Admit<'a> = &'a (dyn Fn(u64) -> Result<(), RelayError> + Send + Sync);

/// A PUT's body: what its request declared (`Content-Length`), its bytes, and what admits them.
pub struct Incoming<'a, S> {
    pub declared_len: Option<u64>,
    pub body: S,
    pub admit: Admit<'a>,
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

/// A file waiting for its upload.
struct Pending {
    size: u64,
    created_ms: u64,
    /// Failed attempts in a row, and when the next may start: a file that keeps failing
    /// backs off on its own and never holds up the files behind it.
    failures: u32,
    retry_at: Option<std::time::Instant>,
}

pub struct Relay {
    root: PathBuf,
    pub max_bytes: AtomicU64,
    store: Store,
    /// Files on local disk only, oldest first by creation.
    pending: Mutex<BTreeMap<Key, Pending>>,
    pub uploaded_bytes: AtomicU64,
    pub conflicts: AtomicU64,
    pub failures: AtomicU64,
    transfers: tokio::sync::Semaphore,
    /// Held for each background upload and by [`Relay::forget_tenant`]: a deleted tenant's
    /// file is never uploaded after its keys were removed.
    upload_gate: tokio::sync::Mutex<()>,
    /// A lock per name being PUT (see [`Relay::lock_name`]): a PUT holds its name from the
    /// look-up to its meta being durable (released only around a sync stream's upload, and
    /// looked up again after), so no PUT sees another's file between its link and its meta.
    names: Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
    /// Directories under `root` whose entries (and their parents') this process has made
    /// durable: a file in one is acknowledged only once the chain up to `root` is.
    durable_dirs: Mutex<std::collections::HashSet<PathBuf>>,
}

use strata_format::now_ms;

fn io(what: &'static str) -> impl Fn(std::io::Error) -> RelayError {
    move |e| {
        tracing::error!(error = %e, "relay: {what}");
        RelayError::Io { what, source: e }
    }
}

fn store_err(e: impl std::fmt::Display) -> RelayError {
    RelayError::Store(e.to_string())
}

/// Test-only crash points (`STRATA_RELAY_FAULT=abort-after-fsync|abort-after-link`): the
/// process aborts there, as a power cut or kill -9 at that instant would stop it.
fn fault(point: &str) {
    if std::env::var("STRATA_RELAY_FAULT").as_deref() == Ok(point) {
        tracing::error!(point, "STRATA_RELAY_FAULT: aborting");
        std::process::abort();
    }
}

/// A name held by [`Relay::lock_name`]; its lock leaves the table when no one else holds or
/// waits for it.
struct NameGuard<'a> {
    relay: &'a Relay,
    key: Key,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for NameGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut names = self.relay.names.lock().unwrap_or_else(|p| p.into_inner());
        if names
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            names.remove(&self.key);
        }
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// A PUT of a name already taken: the same bytes are the file (`200`), others a conflict.
fn same_or_conflict(old: RelayFile, new: &RelayFile) -> Result<(RelayFile, bool), RelayError> {
    if old.blake3 == new.blake3 {
        Ok((old, false))
    } else {
        Err(conflict(&new.name, &old.blake3))
    }
}

fn conflict(name: &str, have: &str) -> RelayError {
    RelayError::Conflict {
        name: name.into(),
        have: have.into(),
    }
}

impl Relay {
    /// Opens the relay under `root`: removes temp files of interrupted uploads, rebuilds metas of
    /// files linked just before a crash, and queues whatever is not yet uploaded.
    pub fn open(root: PathBuf, store: Store, max_bytes: u64) -> std::io::Result<Relay> {
        std::fs::create_dir_all(&root)?;
        if let Some(parent) = root.parent() {
            sync_dir(parent)?; // the relay directory's own entry
        }
        let relay = Relay {
            root,
            max_bytes: AtomicU64::new(max_bytes),
            store,
            pending: Mutex::new(BTreeMap::new()),
            uploaded_bytes: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            transfers: tokio::sync::Semaphore::new(TRANSFERS),
            upload_gate: tokio::sync::Mutex::new(()),
            names: Mutex::new(HashMap::new()),
            durable_dirs: Mutex::new(Default::default()),
        };
        // A crash between creating and unlinking a spool file is all that can leave one.
        for e in std::fs::read_dir(relay.root.join(".spool"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_file(e.path());
        }
        for t in std::fs::read_dir(&relay.root)?.flatten() {
            let tenant = t.file_name().to_string_lossy().into_owned();
            if tenant.starts_with('.') {
                continue; // `.spool`: reads in flight (unlinked files)
            }
            for s in std::fs::read_dir(t.path())?.flatten() {
                let stream = s.file_name().to_string_lossy().into_owned();
                if stream.starts_with(".tmp-") {
                    std::fs::remove_file(s.path())?; // a `.tenant` marker never renamed
                    continue;
                }
                if stream.starts_with('.') || !s.file_type()?.is_dir() {
                    continue; // `.tenant`: which tenant of this name the files belong to
                }
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
            let len = e.metadata()?.len();
            let meta = match self.read_local_meta(tenant, stream, &name) {
                Ok(Some(m)) => m,
                // An unreadable meta beside an empty file: it may be an evicted file's
                // placeholder, which must never pass for an empty file. Left alone.
                Err(err) if len == 0 => {
                    tracing::warn!(tenant, stream, name, error = %err, "relay: unreadable meta beside an empty file; left alone");
                    continue;
                }
                // An empty file without a meta was never answered `201` (the meta is durable
                // before that): an interrupted PUT of an empty body, or a placeholder whose
                // meta went with a tenant's removal cut short. Never taken for a file.
                Ok(None) if len == 0 => {
                    std::fs::remove_file(e.path())?;
                    continue;
                }
                _ => {
                    // Linked (complete, fsync'd) but the meta was not written: derive it.
                    let (blake3, size) = hash_file(&e.path())?;
                    let m = RelayFile {
                        name: name.clone(),
                        size,
                        blake3,
                        created_ms: now_ms(),
                        uploaded_ms: None,
                    };
                    self.write_meta(tenant, stream, &m)?;
                    sync_dir(&dir)?; // the link itself may not be durable yet
                    m
                }
            };
            // (Uploaded with its bytes still here: a crash before the eviction, or an older
            // version. Served from disk as before; only the space is not given back.)
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
        self.read_local_meta(tenant, stream, name).ok().flatten()
    }

    /// This node's meta of a file: None if it has none, an error if it cannot be read or is
    /// not a valid format-1 meta of that name.
    fn read_local_meta(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
    ) -> std::io::Result<Option<RelayFile>> {
        let raw = match std::fs::read(self.meta_path(tenant, stream, name)) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let m: MetaV1 = serde_json::from_slice(&raw).map_err(std::io::Error::other)?;
        if m.format != 1 || m.file.name != name {
            return Err(std::io::Error::other("not a format-1 meta of this file"));
        }
        Ok(Some(m.file))
    }

    /// Writes the meta durably (temp, fsync, rename, fsync directory).
    fn write_meta(&self, tenant: &str, stream: &str, f: &RelayFile) -> std::io::Result<()> {
        let dir = self.dir(tenant, stream).join(".meta");
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join(format!(".tmp-{}", rand_suffix()));
        let body = serde_json::to_vec(&MetaV1 {
            format: 1,
            file: f.clone(),
            parts: None,
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
                Pending {
                    size: f.size,
                    created_ms: f.created_ms,
                    failures: 0,
                    retry_at: None,
                },
            );
    }

    /// The PUT path (see the module docs). Returns the file and whether it was new.
    pub async fn put(
        &self,
        tenant: &str,
        stream: &str,
        sync: bool,
        name: &str,
        incoming: Incoming<
            '_,
            impl futures::Stream<Item = Result<Bytes, impl std::fmt::Display>> + Send,
        >,
    ) -> Result<(RelayFile, bool), RelayError> {
        let Incoming {
            declared_len,
            body,
            admit,
        } = incoming;
        let max = self.max_bytes.load(Relaxed);
        if let Some(n) = declared_len.filter(|&n| n > max) {
            return Err(too_large(n, max));
        }
        let dir = self.dir(tenant, stream);
        self.durable_dir(&dir)
            .map_err(io("creating the stream directory"))?;
        let tmp = dir.join(format!(".tmp-{}", rand_suffix()));
        let guard = TmpGuard(Some(tmp.clone()));
        let mut file = tokio::fs::File::create_new(&tmp)
            .await
            .map_err(io("creating a temp file"))?;
        let mut hasher = blake3::Hasher::new();
        let mut size = 0u64;
        let mut s = std::pin::pin!(body);
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| {
                RelayError::Invalid(format!("request body interrupted: {e}; nothing was stored"))
            })?;
            size += chunk.len() as u64;
            if size > max {
                return Err(too_large(size, max));
            }
            admit(chunk.len() as u64)?;
            hasher.update(&chunk);
            use tokio::io::AsyncWriteExt;
            file.write_all(&chunk).await.map_err(io("writing"))?;
        }
        if let Some(n) = declared_len.filter(|&n| n != size) {
            return Err(RelayError::Invalid(format!(
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
        {
            let _name = self.lock_name(tenant, stream, name).await;
            if let Some(old) = self.existing(tenant, stream, name, (&tmp, &f)).await? {
                return same_or_conflict(old, &f);
            }
        }
        let mut f = f;
        if sync {
            self.upload(tenant, stream, &f, &tmp).await?;
            f.uploaded_ms = Some(now_ms());
        }
        {
            let _name = self.lock_name(tenant, stream, name).await;
            // A concurrent PUT of the same name may have committed meanwhile.
            if let Some(old) = self.existing(tenant, stream, name, (&tmp, &f)).await? {
                return same_or_conflict(old, &f);
            }
            std::fs::hard_link(&tmp, dir.join(name)).map_err(io("linking the file into place"))?;
            drop(guard); // removes the temp name; the data lives on under `name`
            fault("abort-after-link");
            self.write_meta(tenant, stream, &f)
                .map_err(io("writing the file's meta"))?;
            sync_dir(&dir).map_err(io("fsync of the stream directory"))?;
        }
        if f.uploaded_ms.is_none() {
            self.queue(tenant, stream, &f);
        } else {
            self.evict(tenant, stream, &f);
        }
        Ok((f, true))
    }

    /// Waits for a name of a stream, held until the guard drops: PUTs of other names (of any
    /// tenant) never wait for it. The lock table keeps only names in use (and, after a PUT
    /// cancelled while waiting, at most a bounded number of idle ones).
    async fn lock_name(&self, tenant: &str, stream: &str, name: &str) -> NameGuard<'_> {
        let key: Key = (tenant.into(), stream.into(), name.into());
        let m = {
            let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            if names.len() >= 1024 {
                names.retain(|_, m| Arc::strong_count(m) > 1);
            }
            names.entry(key.clone()).or_default().clone()
        };
        let guard = m.lock_owned().await;
        NameGuard {
            relay: self,
            key,
            guard: Some(guard),
        }
    }

    /// The file of that name on this node, with [`Relay::lock_name`] held by the caller: its
    /// meta, or, for a file linked whose meta was never written (a crash, or a meta write that
    /// failed and was answered `500`), a meta derived from its bytes.
    ///
    /// A `200` from it promises what a `201` does: a file not uploaded and not queued (its PUT
    /// failed after the link, at the meta or at an fsync; or the uploader gave it up) has its
    /// bytes checked against its meta, repaired from `incoming` (the PUT's own fsync'd temp
    /// file and meta) when those are the same bytes, its meta and directories made durable,
    /// and is queued, as the recovery at start does. An unreadable meta is an error, and an
    /// empty file without a meta is removed, never taken for a file: either may be an evicted
    /// file's placeholder.
    async fn existing(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
        incoming: (&Path, &RelayFile),
    ) -> Result<Option<RelayFile>, RelayError> {
        let dir = self.dir(tenant, stream);
        if let Some(m) = self
            .read_local_meta(tenant, stream, name)
            .map_err(io("reading the file's meta"))?
        {
            let key: Key = (tenant.into(), stream.into(), name.into());
            let queued = self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&key);
            // (Other bytes get their `409` from the meta alone.)
            if m.uploaded_ms.is_none() && !queued && incoming.1.blake3 == m.blake3 {
                self.restore_bytes(&dir, &m, incoming.0).await?;
                sync_dir(&dir.join(".meta")).map_err(io("fsync of the meta directory"))?;
                sync_dir(&dir).map_err(io("fsync of the stream directory"))?;
                self.queue(tenant, stream, &m);
            }
            return Ok(Some(m));
        }
        let path = dir.join(name);
        match std::fs::metadata(&path) {
            Ok(md) if md.len() == 0 => {
                // Never answered `201` (its meta would be here): not a file yet.
                std::fs::remove_file(&path).map_err(io("removing an empty file"))?;
                return Ok(None);
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("reading an existing file")(e)),
        }
        // Up to `max_bytes` to hash: off the runtime's workers.
        let (blake3, size) = tokio::task::spawn_blocking(move || hash_file(&path))
            .await
            .map_err(|e| io("hashing an existing file")(std::io::Error::other(e)))?
            .map_err(io("reading an existing file"))?;
        let m = RelayFile {
            name: name.into(),
            size,
            blake3,
            created_ms: now_ms(),
            uploaded_ms: None,
        };
        self.write_meta(tenant, stream, &m)
            .map_err(io("writing the file's meta"))?;
        sync_dir(&dir).map_err(io("fsync of the stream directory"))?;
        self.queue(tenant, stream, &m);
        Ok(Some(m))
    }

    /// Makes sure the bytes under `m`'s name are `m`'s (hashed off the runtime): a file whose
    /// PUT failed before its directory was synced may have lost its link in a crash, and one
    /// the uploader gave up on may not match its hash. When they are not, `tmp` (the incoming
    /// PUT's fsync'd temp file, which the caller found to hold `m`'s bytes) takes their place.
    async fn restore_bytes(&self, dir: &Path, m: &RelayFile, tmp: &Path) -> Result<(), RelayError> {
        let path = dir.join(&m.name);
        let p = path.clone();
        let have = tokio::task::spawn_blocking(move || hash_file(&p))
            .await
            .map_err(|e| io("hashing a file")(std::io::Error::other(e)))?;
        match have {
            Ok((h, size)) if h == m.blake3 && size == m.size => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("reading an existing file")(e)),
        }
        // A rename of a link to the temp file replaces the name atomically; the temp name
        // stays the PUT's (its guard removes it).
        let repair = dir.join(format!(".tmp-repair-{}", rand_suffix()));
        std::fs::hard_link(tmp, &repair).map_err(io("repairing a file"))?;
        if let Err(e) = std::fs::rename(&repair, &path) {
            let _ = std::fs::remove_file(&repair);
            return Err(io("repairing a file")(e));
        }
        tracing::warn!(
            name = m.name,
            "relay: a file's bytes were restored from a retried PUT"
        );
        Ok(())
    }

    /// A file's meta and an open file of its bytes (read it from the start): from this node's
    /// disk, else from the object store, spooled to an unlinked temp file and verified (every
    /// part, and the whole) before the first byte is served.
    ///
    /// A spool takes disk until the caller drops the file, which a slow reader of the response
    /// keeps open: `spool` is asked first, with the file's size, and what it returns (the
    /// tenant's share of spool bytes, say) goes back beside the file for the caller to hold as
    /// long as it holds the file. `None` beside a file read from this node's own copy.
    pub async fn get<G>(
        &self,
        tenant: &str,
        stream: &str,
        name: &str,
        spool: impl FnOnce(u64) -> Result<G, RelayError>,
    ) -> Result<(RelayFile, tokio::fs::File, Option<G>), RelayError> {
        let local = self.local_meta(tenant, stream, name);
        if let Some(m) = &local {
            match tokio::fs::File::open(self.dir(tenant, stream).join(name)).await {
                // Still holding its bytes (an eviction after the open leaves them to us).
                Ok(f) if f.metadata().await.is_ok_and(|x| x.len() == m.size) => {
                    return Ok((m.clone(), f, None))
                }
                Ok(_) => {} // evicted: the store has it
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("reading the file")(e)),
            }
        }
        let Some(upload::Remote {
            file: m,
            parts,
            layout,
        }) = self.remote_meta(tenant, stream, name).await?
        else {
            return Err(RelayError::NotFound(format!(
                "no file {name:?} in relay stream {stream:?}"
            )));
        };
        // An evicted file is read back only as the file this node acknowledged.
        if local.is_some_and(|l| l.size != m.size || l.blake3 != m.blake3) {
            return Err(corrupt_remote(name));
        }
        let held = spool(m.size)?;
        let _slot = self
            .transfers
            .acquire()
            .await
            .map_err(|_| RelayError::Closed)?;
        let spool_dir = self.root.join(".spool");
        std::fs::create_dir_all(&spool_dir).map_err(io("creating the spool directory"))?;
        let spool = spool_dir.join(format!("get-{}", rand_suffix()));
        let mut out = tokio::fs::File::create_new(&spool)
            .await
            .map_err(io("creating a spool file"))?;
        // Unlinked at once: nothing is left behind, whatever happens to this request.
        let _ = std::fs::remove_file(&spool);
        let keys: Vec<(object_store::path::Path, Option<&String>)> = match &parts {
            None => vec![(Self::data_key(tenant, stream, name, layout), None)],
            Some(p) => p
                .iter()
                .enumerate()
                .map(|(i, h)| (Self::part_key(tenant, stream, name, i, layout), Some(h)))
                .collect(),
        };
        let mut whole = blake3::Hasher::new();
        let mut size = 0u64;
        for (key, part_hash) in keys {
            // Streamed for a clear tenant; an encrypted one's part opens only whole (a part
            // is at most PART bytes).
            let mut s = self.store.get_value_stream(&key).await.map_err(store_err)?;
            let mut part = blake3::Hasher::new();
            while let Some(chunk) = s.next().await {
                let chunk = chunk.map_err(store_err)?;
                size += chunk.len() as u64;
                if size > m.size {
                    return Err(corrupt_remote(name));
                }
                whole.update(&chunk);
                part.update(&chunk);
                use tokio::io::AsyncWriteExt;
                out.write_all(&chunk).await.map_err(io("spooling"))?;
            }
            if part_hash.is_some_and(|h| part.finalize().to_hex().as_str() != h) {
                return Err(corrupt_remote(name));
            }
        }
        if size != m.size || whole.finalize().to_hex().as_str() != m.blake3 {
            return Err(corrupt_remote(name));
        }
        use tokio::io::AsyncSeekExt;
        out.seek(std::io::SeekFrom::Start(0))
            .await
            .map_err(io("spooling"))?;
        Ok((m, out, Some(held)))
    }

    /// Every file of a stream: this node's and the object store's (of this incarnation of the
    /// tenant: see [`Relay::remote_meta`]).
    pub async fn list(&self, tenant: &str, stream: &str) -> Result<Vec<RelayFile>, RelayError> {
        let mut out: BTreeMap<String, RelayFile> = BTreeMap::new();
        let inc = self.incarnation(tenant)?;
        let store = self.store.inner_for(tenant).await.map_err(store_err)?;
        let mut names = std::collections::BTreeSet::new();
        for layout in [upload::Layout::Incarnation(inc), upload::Layout::Legacy] {
            let prefix = Self::meta_prefix(tenant, stream, layout);
            let metas: Vec<_> = store.list(Some(&prefix)).collect::<Vec<_>>().await;
            for m in metas {
                let m = m.map_err(store_err)?;
                if let Some(name) = m.location.filename() {
                    names.insert(name.to_string());
                }
            }
        }
        for name in names {
            if let Some(r) = self.remote_meta(tenant, stream, &name).await? {
                out.insert(r.file.name.clone(), r.file);
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

    /// Bytes of `tenant`'s files waiting for upload on this node: its own entries only (a range
    /// of the pending set), so a check per received piece costs the tenant's backlog, not the
    /// node's.
    pub fn pending_bytes(&self, tenant: &str) -> u64 {
        let from: Key = (tenant.to_string(), String::new(), String::new());
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .range(from..)
            .take_while(|((t, _, _), _)| t == tenant)
            .map(|(_, p)| p.size)
            .sum()
    }

    /// Upload backlog per (tenant, stream).
    pub fn lag(&self) -> BTreeMap<(String, String), Lag> {
        let now = now_ms();
        let mut out: BTreeMap<(String, String), Lag> = BTreeMap::new();
        for ((t, s, _), p) in self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let l = out.entry((t.clone(), s.clone())).or_default();
            l.pending_files += 1;
            l.pending_bytes += p.size;
            l.lag_ms = l.lag_ms.max(now.saturating_sub(p.created_ms));
        }
        out
    }
}

fn corrupt_local(name: &str) -> RelayError {
    tracing::error!(
        name,
        "relay: local file does not match its hash; not uploaded"
    );
    RelayError::CorruptLocal(name.into())
}

fn corrupt_remote(name: &str) -> RelayError {
    RelayError::CorruptRemote(name.into())
}

fn too_large(n: u64, max: u64) -> RelayError {
    RelayError::TooLarge { n, max }
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
