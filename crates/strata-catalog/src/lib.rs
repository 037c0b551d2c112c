//! The catalog: strata's durable control-plane graph.
//!
//! Tenants, templates, workspaces and their heads, checkpoints (the receipts of published
//! heads), leases with epochs, and which objects every manifest references (for GC). Every
//! backend implements [`Catalog`] and passes the same conformance suite (`tests/conformance/`).
//!
//! The one invariant everything else leans on: a head moves only through
//! [`Catalog::advance_head`], a compare-and-set on the expected version *and* the caller's
//! lease epoch, in one transaction with the checkpoint row that records it. A writer whose lease
//! was taken over (a higher epoch exists) can never move the head.

mod postgres;
mod sqlite;
mod types;

pub use postgres::{create_database, pg_retryable, PostgresCatalog};
pub use sqlite::SqliteCatalog;
pub use types::*;

use async_trait::async_trait;
use strata_format::manifest::ObjectRef;
use strata_format::Hash;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CatalogError {
    #[error("{what} {name:?} not found")]
    NotFound { what: &'static str, name: String },
    #[error("{what} {name:?} already exists")]
    AlreadyExists { what: &'static str, name: String },
    #[error("head moved: expected version {expected}, found {actual}")]
    Conflict { expected: u64, actual: u64 },
    #[error("lease lost: this writer holds epoch {held}, the lease is now epoch {current} held by {holder:?}")]
    Fenced {
        held: u64,
        current: u64,
        holder: Option<String>,
    },
    #[error("workspace is attached by node {holder:?} (lease epoch {epoch}, expires in {expires_in_ms} ms)")]
    LeaseHeld {
        holder: String,
        epoch: u64,
        expires_in_ms: u64,
    },
    #[error("{0}")]
    InUse(String),
    /// A tenant's quota would be exceeded.
    #[error("quota exceeded: {0}")]
    Quota(String),
    /// The catalog's database or its connection failed. The source is kept (a
    /// `rusqlite::Error`, `tokio_postgres::Error`, pool or I/O error) and so is whether a
    /// retry can help: a lost connection, a busy database or a serialization failure can; a
    /// syntax error, a constraint, a corrupt row or a bad URL cannot.
    #[error("catalog backend: {message}")]
    Backend {
        message: String,
        retryable: bool,
        #[source]
        source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
    },
}

/// What a head CAS that would make a disk smaller gets: sizes only grow (a mounted filesystem
/// must never find its end gone).
pub(crate) fn shrink(current: u64, asked: u64) -> CatalogError {
    CatalogError::InUse(format!(
        "a workspace's disk never shrinks: it has {current} bytes, the new version {asked}"
    ))
}

/// Equal when of the same kind with the same details; backend errors compare by message and
/// retryability (their sources are not comparable).
impl PartialEq for CatalogError {
    fn eq(&self, other: &Self) -> bool {
        use CatalogError::*;
        match (self, other) {
            (NotFound { what: a, name: b }, NotFound { what: c, name: d })
            | (AlreadyExists { what: a, name: b }, AlreadyExists { what: c, name: d }) => {
                a == c && b == d
            }
            (
                Conflict {
                    expected: a,
                    actual: b,
                },
                Conflict {
                    expected: c,
                    actual: d,
                },
            ) => a == c && b == d,
            (
                Fenced {
                    held: a,
                    current: b,
                    holder: h,
                },
                Fenced {
                    held: c,
                    current: d,
                    holder: i,
                },
            ) => a == c && b == d && h == i,
            (
                LeaseHeld {
                    holder: h,
                    epoch: a,
                    expires_in_ms: b,
                },
                LeaseHeld {
                    holder: i,
                    epoch: c,
                    expires_in_ms: d,
                },
            ) => h == i && a == c && b == d,
            (InUse(a), InUse(b)) | (Quota(a), Quota(b)) => a == b,
            (
                Backend {
                    message: a,
                    retryable: r,
                    ..
                },
                Backend {
                    message: b,
                    retryable: s,
                    ..
                },
            ) => a == b && r == s,
            _ => false,
        }
    }
}

impl Eq for CatalogError {}

impl CatalogError {
    /// Whether retrying the same call may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            CatalogError::Backend {
                retryable: true,
                ..
            }
        )
    }

    /// A backend failure no retry fixes (corrupt data, a bad URL, a newer schema).
    pub fn backend(message: impl Into<String>) -> Self {
        CatalogError::Backend {
            message: message.into(),
            retryable: false,
            source: None,
        }
    }

    /// A backend that cannot be reached now (a retry may succeed).
    pub fn unavailable(message: impl Into<String>) -> Self {
        CatalogError::Backend {
            message: message.into(),
            retryable: true,
            source: None,
        }
    }

    /// A backend failure with its source; the message names both.
    pub fn from_source(
        context: &str,
        retryable: bool,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        // The whole chain: a TLS failure's reason (an unknown issuer, a name the certificate
        // does not hold) is two sources down.
        let mut message = format!("{context}: {source}");
        let mut next = source.source();
        while let Some(s) = next {
            let s_text = s.to_string();
            if !message.ends_with(&s_text) {
                message.push_str(": ");
                message.push_str(&s_text);
            }
            next = s.source();
        }
        CatalogError::Backend {
            message,
            retryable,
            source: Some(std::sync::Arc::new(source)),
        }
    }
}

pub use strata_format::io_retryable;

/// The tenant's live objects, deduplicated: `?1`/`$1` is the tenant (the same SQL runs on
/// both backends with the placeholder swapped).
pub(crate) const TENANT_LIVE_SQL: &str = "
WITH refs(manifest) AS (
    SELECT manifest FROM checkpoints WHERE tenant = ?1 AND expired_ms IS NULL
    UNION SELECT head_manifest FROM workspaces WHERE tenant = ?1
    UNION SELECT manifest FROM templates WHERE tenant = ?1),
objs(object) AS (
    SELECT DISTINCT mo.object FROM manifest_objects mo JOIN refs r ON mo.manifest = r.manifest
    WHERE mo.tenant = ?1)
SELECT count(*), coalesce(sum(o.data_len), 0) FROM objs JOIN objects o
    ON o.tenant = ?1 AND o.id = objs.object";

/// Per workspace: the objects its head and retained checkpoints reference.
pub(crate) const WORKSPACE_LIVE_SQL: &str = "
WITH refs(ws, manifest) AS (
    SELECT workspace, manifest FROM checkpoints WHERE tenant = ?1 AND expired_ms IS NULL
    UNION SELECT name, head_manifest FROM workspaces WHERE tenant = ?1),
objs(ws, object) AS (
    SELECT DISTINCT r.ws, mo.object FROM manifest_objects mo JOIN refs r ON mo.manifest = r.manifest
    WHERE mo.tenant = ?1)
SELECT objs.ws, count(*), coalesce(sum(o.data_len), 0) FROM objs JOIN objects o
    ON o.tenant = ?1 AND o.id = objs.object
GROUP BY objs.ws ORDER BY objs.ws";

/// The mark of a GC pass ([`Catalog::gc_mark`]): `?1`/`$1` the tenant, `?2`/`$2` the instant
/// (catalog clock, ms) from which an expired checkpoint still counts, `?3`/`$3` the instant
/// (the clock rows were recorded by) before which an unreferenced record is stale. Rows:
/// `(0, manifest, recorded)` per referenced manifest, `(1, object, 1)` per distinct object the
/// recorded ones reference, `(2, manifest, 0)` per stale unreferenced manifest record, and
/// `(3, object, data_len)` per stale unreferenced object record; one statement, so one snapshot.
pub(crate) const GC_MARK_SQL: &str = "
WITH refs(manifest) AS (
    SELECT head_manifest FROM workspaces WHERE tenant = ?1
    UNION SELECT manifest FROM checkpoints WHERE tenant = ?1 AND (expired_ms IS NULL OR expired_ms >= ?2)
    UNION SELECT manifest FROM templates WHERE tenant = ?1),
live(object) AS (
    SELECT DISTINCT mo.object FROM manifest_objects mo JOIN refs r ON mo.manifest = r.manifest
    WHERE mo.tenant = ?1)
SELECT 0, r.manifest, CASE WHEN EXISTS (SELECT 1 FROM manifests m WHERE m.tenant = ?1 AND m.id = r.manifest)
    THEN 1 ELSE 0 END FROM refs r
UNION ALL SELECT 1, l.object, 1 FROM live l
UNION ALL SELECT 2, m.id, 0 FROM manifests m WHERE m.tenant = ?1 AND m.created_ms < ?3
    AND NOT EXISTS (SELECT 1 FROM refs r WHERE r.manifest = m.id)
UNION ALL SELECT 3, o.id, o.data_len FROM objects o WHERE o.tenant = ?1 AND o.created_ms < ?3
    AND NOT EXISTS (SELECT 1 FROM live l WHERE l.object = o.id)";

/// Whether manifest `x` (an SQL expression) is referenced now: a workspace's head, any
/// checkpoint row (expired ones too, until purged) or a template names it. `?1`/`$1` is the
/// tenant; each test is one probe of an index (`*_manifest` in the schema).
pub(crate) fn referenced_sql(x: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM workspaces rw WHERE rw.tenant = ?1 AND rw.head_manifest = {x}) \
         OR EXISTS (SELECT 1 FROM checkpoints rc WHERE rc.tenant = ?1 AND rc.manifest = {x}) \
         OR EXISTS (SELECT 1 FROM templates rt WHERE rt.tenant = ?1 AND rt.manifest = {x}))"
    )
}

/// Whether object `x` (an SQL expression) is live: a referenced manifest links it.
pub(crate) fn object_live_sql(x: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM manifest_objects ol WHERE ol.tenant = ?1 AND ol.object = {x} AND {})",
        referenced_sql("ol.manifest")
    )
}

/// The change log's rows for a tenant after sequence number `?3`, oldest first, at most `?2`:
/// each row's sequence number, manifest, the manifest's record time (NULL: no record) and
/// whether it is referenced now (1 or 0). See [`Catalog::gc_changes`].
pub(crate) fn gc_changes_sql() -> String {
    format!(
        "SELECT l.seq, l.manifest, m.created_ms, CASE WHEN {} THEN 1 ELSE 0 END \
         FROM gc_log l LEFT JOIN manifests m ON m.tenant = l.tenant AND m.id = l.manifest \
         WHERE l.tenant = ?1 AND l.seq > ?3 ORDER BY l.seq LIMIT ?2",
        referenced_sql("l.manifest")
    )
}

/// Every manifest the tenant's change log names that is referenced and has no record (a
/// row stays in the log for each while that lasts), whatever the log's length.
pub(crate) fn gc_unrecorded_sql() -> String {
    format!(
        "SELECT DISTINCT l.manifest FROM gc_log l WHERE l.tenant = ?1 \
         AND NOT EXISTS (SELECT 1 FROM manifests m WHERE m.tenant = ?1 AND m.id = l.manifest) \
         AND {}",
        referenced_sql("l.manifest")
    )
}

/// The objects of the manifests `manifest {is}` names (unreferenced manifests) that no
/// referenced manifest links: `(manifest, object, data_len, recorded at)`. Each distinct object
/// is judged once (materialized: an object every version of a workspace shares is linked by
/// each of the stale manifests, and judging it means walking its links to a referenced one).
pub(crate) fn gc_stale_objects_sql(is: &str) -> String {
    format!(
        "WITH cand(object) AS MATERIALIZED (SELECT DISTINCT c.object FROM manifest_objects c \
             WHERE c.tenant = ?1 AND c.manifest {is}), \
         dead(object) AS MATERIALIZED (SELECT cand.object FROM cand WHERE NOT {}) \
         SELECT mo.manifest, o.id, o.data_len, o.created_ms FROM manifest_objects mo \
         JOIN dead ON dead.object = mo.object \
         JOIN objects o ON o.tenant = mo.tenant AND o.id = mo.object \
         WHERE mo.tenant = ?1 AND mo.manifest {is}",
        object_live_sql("cand.object")
    )
}

/// Detached compaction ([`Catalog::compaction_candidates`]), `?1`/`$1` the tenant: the
/// workspaces to look at that cannot be candidates until their lease is released again
/// (attached, never attached, a live fork's or a template's head, judged at this head) are
/// cleared, then the others made before `?2`/`$2` are returned.
pub(crate) const COMPACTION_SETTLE_SQL: &str = "
UPDATE workspaces SET compact_check = 0 WHERE tenant = ?1 AND compact_check = 1 AND (
    compact_judged = head_manifest
    OR NOT EXISTS (SELECT 1 FROM leases l WHERE l.tenant = workspaces.tenant
        AND l.workspace = workspaces.name AND l.holder IS NULL AND l.epoch > 0)
    OR NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.tenant = workspaces.tenant
        AND c.workspace = workspaces.name AND c.version = workspaces.head_version
        AND c.kind <> 'livefork' AND c.journal_id IS NOT NULL))";
/// `{from}` is `workspaces w`, with SQLite's `INDEXED BY workspaces_compact_check` (its
/// planner, without statistics, would walk every workspace of the tenant by the primary key).
pub(crate) const COMPACTION_CANDIDATES_SQL: &str = "
SELECT w.name, w.head_manifest FROM {from}
WHERE w.tenant = ?1 AND w.compact_check = 1 AND EXISTS (SELECT 1 FROM checkpoints c
    WHERE c.tenant = w.tenant AND c.workspace = w.name AND c.version = w.head_version
    AND c.created_ms < ?2)
ORDER BY w.name";

/// Tables with a `tenant` column, in the order a tenant's purge empties them (tokens before
/// the tenant row PostgreSQL's foreign key names).
pub(crate) const TENANT_TABLES: &[&str] = &[
    "usage_meter",
    "gc_condemned",
    "relay_streams",
    "manifest_objects",
    "manifests",
    "objects",
    "checkpoints",
    "leases",
    "workspaces",
    "templates",
    "gc_log",
    "tokens",
];

/// What a change to a tenant being deleted gets.
pub(crate) fn deleting(tenant: &str) -> CatalogError {
    CatalogError::InUse(format!("tenant {tenant:?} is being deleted"))
}

/// What deleting a tenant with an attached workspace gets.
pub(crate) fn attached_refusal(tenant: &str, ws: &str, node: &str) -> CatalogError {
    CatalogError::InUse(format!(
        "tenant {tenant:?} has workspace {ws:?} attached on node {node:?}: detach it first"
    ))
}

/// Checks a tenant's workspace count and total disk size, with the new or grown workspace
/// counted, against its quotas.
pub(crate) fn check_workspace_quotas(
    tenant: &str,
    q: &Quotas,
    workspaces: u64,
    disk_bytes: u64,
) -> Result<()> {
    if let Some(max) = q.workspaces.filter(|m| workspaces > *m) {
        return Err(CatalogError::Quota(format!(
            "tenant {tenant:?} may have {max} workspaces"
        )));
    }
    if let Some(max) = q.disk_bytes.filter(|m| disk_bytes > *m) {
        return Err(CatalogError::Quota(format!(
            "tenant {tenant:?} may have {max} bytes of workspace disks in all; this would make {disk_bytes}"
        )));
    }
    Ok(())
}

/// The meter after a reading of `live` bytes at `now` (the first reading starts it).
pub(crate) fn advance_meter(prev: Option<Meter>, live: u64, now: u64) -> Meter {
    match prev {
        None => Meter {
            live_bytes: live,
            byte_seconds: 0.0,
            since_ms: now,
            last_ms: now,
        },
        Some(m) => {
            let now = now.max(m.last_ms);
            Meter {
                live_bytes: live,
                byte_seconds: m.byte_seconds
                    + m.live_bytes as f64 * (now - m.last_ms) as f64 / 1000.0,
                since_ms: m.since_ms,
                last_ms: now,
            }
        }
    }
}

/// A purge needs the tenant marked as being deleted and its workspaces gone.
pub(crate) fn purge_check(tenant: &str, info: &TenantInfo, workspaces: u64) -> Result<()> {
    if info.deleting_ms.is_none() {
        return Err(CatalogError::InUse(format!(
            "tenant {tenant:?} is not being deleted"
        )));
    }
    if workspaces > 0 {
        return Err(CatalogError::InUse(format!(
            "tenant {tenant:?} still has {workspaces} workspaces"
        )));
    }
    Ok(())
}

pub type Result<T, E = CatalogError> = std::result::Result<T, E>;

#[async_trait]
pub trait Catalog: Send + Sync + 'static {
    async fn create_tenant(&self, tenant: &str) -> Result<()> {
        self.create_tenant_placed(tenant, None, None).await
    }
    /// Creates a tenant whose data is placed in the named store `store` (`None`: the default)
    /// and, if `data_key` (wrapped) is given, encrypted.
    async fn create_tenant_placed(
        &self,
        tenant: &str,
        store: Option<&str>,
        data_key: Option<&str>,
    ) -> Result<()>;
    /// A tenant's placement: its named store, its wrapped data key, and when it was created
    /// (a tenant deleted and created again under its name is another one).
    async fn tenant_placement(&self, tenant: &str) -> Result<TenantPlacement>;
    /// Destroys a tenant's data key (crypto-shredding), once its deletion is marked: what is
    /// left of its data in the store can no longer be opened.
    async fn shred_data_key(&self, tenant: &str) -> Result<()>;
    async fn tenant_exists(&self, tenant: &str) -> Result<bool>;
    /// Records an API token (by its hash, never the token itself) for a tenant.
    async fn add_token(&self, token: &NewToken) -> Result<TokenInfo>;
    /// What a token hash speaks for, revoked and expired ones included (the caller decides);
    /// `None` for an unknown hash or a tenant being deleted.
    async fn token_info(&self, hash: &str) -> Result<Option<TokenInfo>>;
    /// A tenant's tokens, oldest first (ids and metadata; hashes never leave the catalog).
    async fn list_tokens(&self, tenant: &str) -> Result<Vec<TokenInfo>>;
    /// Revokes the tenant's token `id` (idempotent: an already revoked one keeps its time).
    async fn revoke_token(&self, tenant: &str, id: &str) -> Result<TokenInfo>;
    /// One tenant.
    async fn get_tenant(&self, tenant: &str) -> Result<TenantInfo>;
    /// What the tenant's live data takes in the object store (see [`StoreUsage`]).
    async fn store_usage(&self, tenant: &str) -> Result<StoreUsage>;
    /// Records a reading of the tenant's live bytes (see [`Meter`]) and returns the meter.
    async fn meter_usage(&self, tenant: &str, live_bytes: u64) -> Result<Meter>;
    /// Sets a tenant's quotas (replacing all of them; `None` fields: no limit).
    async fn set_quotas(&self, tenant: &str, q: &Quotas) -> Result<()>;
    /// Marks a tenant as being deleted, atomically with checking that none of its workspaces
    /// holds a live lease (`InUse` if one does). From then on its tokens resolve to nothing
    /// and leases on its workspaces are refused. Idempotent.
    async fn begin_tenant_delete(&self, tenant: &str) -> Result<()>;
    /// Removes every row of a tenant being deleted (`InUse` if it is not marked, or still has
    /// workspaces). The caller has deleted its workspaces and objects first.
    async fn purge_tenant(&self, tenant: &str) -> Result<()>;

    /// Creates a relay stream (`AlreadyExists` if it exists).
    async fn create_stream(&self, s: &RelayStream) -> Result<()>;
    async fn get_stream(&self, tenant: &str, name: &str) -> Result<RelayStream>;
    async fn list_streams(&self, tenant: &str) -> Result<Vec<RelayStream>>;

    /// Records that `manifest` exists and references `objects` (idempotent).
    async fn record_manifest(
        &self,
        tenant: &str,
        manifest: Hash,
        objects: &[ObjectRef],
    ) -> Result<()>;

    async fn create_template(&self, t: &Template) -> Result<()>;
    async fn get_template(&self, tenant: &str, name: &str) -> Result<Template>;
    async fn list_templates(&self, tenant: &str) -> Result<Vec<Template>>;
    async fn delete_template(&self, tenant: &str, name: &str) -> Result<()>;

    /// Creates a workspace whose head is version 1 at `w.manifest`, with its checkpoint row.
    async fn create_workspace(&self, w: &NewWorkspace) -> Result<Workspace>;
    async fn get_workspace(&self, tenant: &str, name: &str) -> Result<Workspace>;
    async fn list_workspaces(&self, tenant: &str) -> Result<Vec<Workspace>>;
    /// Workspaces whose TTL has run out: (tenant, name).
    async fn list_expired(&self, now_ms: u64) -> Result<Vec<(String, String)>>;
    /// Deletes the workspace and its history. Refused while a live lease is held.
    async fn delete_workspace(&self, tenant: &str, name: &str) -> Result<()>;

    /// Compare-and-set of the head: from `expected` to `expected + 1` at `cp.manifest`, only if
    /// `lease` is the current lease (holder and epoch). Records the checkpoint in the same
    /// transaction. Returns the new version.
    async fn advance_head(
        &self,
        tenant: &str,
        workspace: &str,
        expected: u64,
        lease: &LeaseGrant,
        cp: &NewCheckpoint,
    ) -> Result<u64>;
    async fn list_checkpoints(&self, tenant: &str, workspace: &str) -> Result<Vec<Checkpoint>>;
    async fn get_checkpoint(
        &self,
        tenant: &str,
        workspace: &str,
        version: u64,
    ) -> Result<Checkpoint>;

    /// Takes the lease for `node`: allowed when free, expired, or already held by `node`.
    /// Always increments the epoch, fencing every earlier holder.
    async fn acquire_lease(
        &self,
        tenant: &str,
        workspace: &str,
        node: &str,
        ttl_ms: u64,
    ) -> Result<LeaseGrant>;
    /// Extends a held lease; fails with `Fenced` if it was taken over.
    async fn renew_lease(
        &self,
        tenant: &str,
        workspace: &str,
        lease: &LeaseGrant,
        ttl_ms: u64,
    ) -> Result<()>;
    /// Extends many held leases at once: a node renews everything it holds in one round trip
    /// (one transaction), so the catalog's load does not grow with its attached workspaces.
    /// One outcome per lease, in order: `Ok`, or `Fenced` if it was taken over; an error of
    /// the whole call (catalog unreachable) is the outer `Err`. The default renews one by one.
    async fn renew_leases(&self, leases: &[LeaseRenewal], ttl_ms: u64) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(leases.len());
        for l in leases {
            match self
                .renew_lease(&l.tenant, &l.workspace, &l.lease, ttl_ms)
                .await
            {
                Ok(()) => out.push(Ok(())),
                Err(e @ CatalogError::Fenced { .. }) => out.push(Err(e)),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    /// Releases a held lease (no-op if already taken over).
    async fn release_lease(&self, tenant: &str, workspace: &str, lease: &LeaseGrant) -> Result<()>;
    async fn get_lease(&self, tenant: &str, workspace: &str) -> Result<Lease>;

    /// Every tenant.
    async fn list_tenants(&self) -> Result<Vec<String>>;
    /// Expires checkpoints: they disappear from listings at once, but their manifests stay
    /// referenced for the GC grace period (an operation that read one just before still
    /// completes safely). The head version is never expired. Returns how many were expired.
    async fn expire_checkpoints(
        &self,
        tenant: &str,
        workspace: &str,
        versions: &[u64],
    ) -> Result<u64>;
    /// Every manifest the tenant references: workspace heads, checkpoints (including those
    /// expired less than `grace_ms` ago by the catalog's clock) and templates.
    async fn gc_references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>>;
    /// A GC pass's mark in one consistent read: every manifest [`Catalog::gc_references`]
    /// returns, which of them [`Catalog::record_manifest`] has no record of, the distinct
    /// objects the recorded ones reference, and the recorded manifests and objects that nothing
    /// marked references and that were recorded more than `grace_ms` ago (by the clock that
    /// recorded them). A recorded manifest's links were written in the transaction that
    /// recorded it, so they are whole; an unrecorded one (written before the catalog kept the
    /// record) is the caller's to read from the store.
    async fn gc_mark(&self, tenant: &str, grace_ms: u64) -> Result<GcMark>;
    /// The incremental mark: the manifests that lost a reference, or were recorded, or were
    /// referenced without a record, since the log was last settled (triggers write the log
    /// `gc_log` in the transactions that make those changes), at most `limit` log rows after
    /// sequence number `after_seq` (0: from the start), each judged now; and every referenced
    /// manifest without a record the whole log names. An unreferenced manifest recorded more than `grace_ms` ago (by the clock
    /// that recorded it) is stale, and so are its objects recorded before then that no
    /// referenced manifest links. Its cost follows the rows read, not the tenant's size.
    async fn gc_changes(
        &self,
        tenant: &str,
        grace_ms: u64,
        after_seq: i64,
        limit: usize,
    ) -> Result<GcChanges>;
    /// Removes log rows [`Catalog::gc_changes`] settled (once what they found is condemned).
    async fn gc_settle(&self, tenant: &str, seqs: &[i64]) -> Result<()>;
    /// Which of `manifests` are referenced now, and which of `objects` a referenced manifest
    /// links (the re-mark of condemned keys before they are deleted); the recorded length of
    /// the others.
    async fn gc_live(&self, tenant: &str, manifests: &[Hash], objects: &[Hash]) -> Result<GcLive>;
    /// The workspaces whose retention may have changed: a checkpoint was added, labelled or
    /// kept since retention last looked ([`Catalog::retention_done`]), or a time it named has
    /// come (`now_ms`, the caller's clock, as it computed that time). `all`: every workspace.
    async fn retention_due(
        &self,
        tenant: &str,
        now_ms: u64,
        all: bool,
    ) -> Result<Vec<RetentionDue>>;
    /// Retention looked at `workspace` as of `seen` (its [`RetentionDue::generation`]); look
    /// again at `next_ms` (caller's clock) unless a checkpoint changes first. A workspace that
    /// changed since `seen` stays due. Returns whether it was recorded.
    async fn retention_done(
        &self,
        tenant: &str,
        workspace: &str,
        seen: u64,
        next_ms: u64,
    ) -> Result<bool>;
    /// Workspaces GC may compact while detached: the lease released by a clean detach (a
    /// node whose attach failed keeps it until it expires; an expired lease may still have a
    /// journal behind it), the head published by one of its own volumes (not a template's, not
    /// a live fork's) before `idle_before_ms` (caller's clock), and not judged dense at this
    /// head ([`Catalog::compaction_judged`]). Each with its head manifest. Only workspaces
    /// whose lease was released since they were last looked at are read (a trigger marks them),
    /// so the cost follows detaches; `all` looks at every workspace again (reconciliation).
    async fn compaction_candidates(
        &self,
        tenant: &str,
        idle_before_ms: u64,
        all: bool,
    ) -> Result<Vec<(String, Hash)>>;
    /// GC judged `workspace`'s head `manifest` dense enough not to compact: it is not a
    /// candidate again until its lease is released again. (Ignored if the head moved.)
    async fn compaction_judged(&self, tenant: &str, workspace: &str, manifest: Hash) -> Result<()>;
    /// Deletes checkpoint rows expired more than `grace_ms` ago.
    async fn purge_expired_checkpoints(&self, tenant: &str, grace_ms: u64) -> Result<u64>;
    /// Records store keys found unreferenced (first GC phase); existing entries keep their time.
    async fn gc_condemn(&self, tenant: &str, keys: &[String]) -> Result<()>;
    /// Condemned keys with how long ago (catalog clock) each was first condemned.
    async fn gc_condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>>;
    /// Forgets condemned keys (deleted, or referenced again).
    async fn gc_forget(&self, tenant: &str, keys: &[String]) -> Result<()>;
    /// Deletes the rows [`Catalog::record_manifest`] made for manifests and objects whose
    /// store keys GC is deleting: the manifests, their object links, the objects. Returns the
    /// rows deleted. (Called before the store deletes, so a failure leaves rows, not leaks.)
    async fn prune_references(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64>;
    /// How many manifests and objects the catalog has recorded for `tenant`.
    async fn recorded_references(&self, tenant: &str) -> Result<(u64, u64)>;

    /// Records a node's heartbeat and what it serves (upsert; `seen_ms` is the catalog's clock).
    async fn report_node(&self, status: &NodeStatus) -> Result<()>;
    /// Every node that ever reported, with the time since it was last heard from.
    async fn list_nodes(&self) -> Result<Vec<NodeStatus>>;
}

/// Opens a catalog from its URL: `sqlite:PATH` (embedded) or `postgres://…` /
/// `postgresql://…` (scale-out; `pool_size` connections at most).
pub async fn open_url(url: &str, pool_size: usize) -> Result<std::sync::Arc<dyn Catalog>> {
    if let Some(path) = url.strip_prefix("sqlite:") {
        return Ok(std::sync::Arc::new(SqliteCatalog::open(
            std::path::Path::new(path),
        )?));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(std::sync::Arc::new(
            PostgresCatalog::connect(url, pool_size).await?,
        ));
    }
    Err(CatalogError::backend(format!(
        "catalog {url:?}: use sqlite:PATH or postgres://user@host:port/db"
    )))
}

pub(crate) use strata_format::now_ms;

/// Where a catalog reads the time (milliseconds since the Unix epoch) for leases, retention
/// and GC grace. PostgreSQL reads its server's clock in SQL instead, so that nodes with
/// skewed clocks agree on who holds a lease; the embedded catalog reads this.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> u64;
}

/// The system clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        strata_format::now_ms()
    }
}

/// A clock that moves only when told to (tests): a lease expires, or a grace period ends, at
/// the test's command instead of after a sleep.
#[derive(Debug)]
pub struct ManualClock(std::sync::atomic::AtomicU64);

impl ManualClock {
    /// Starts at the system's current time.
    pub fn new() -> ManualClock {
        ManualClock(std::sync::atomic::AtomicU64::new(strata_format::now_ms()))
    }

    pub fn advance(&self, d: std::time::Duration) {
        self.0.fetch_add(
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::SeqCst,
        );
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}
