//! SQLite schema, row mapping, opening and the helpers the catalog's queries share.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};
use strata_format::Hash;

use super::worker::{Lane, Worker};
use super::SqliteCatalog;
use crate::*;

/// Schema migrations; `PRAGMA user_version` records how many have been applied.
pub(super) const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE tenants (id TEXT PRIMARY KEY, created_ms INTEGER NOT NULL);
CREATE TABLE templates (
    tenant TEXT NOT NULL, name TEXT NOT NULL, manifest TEXT NOT NULL,
    disk_size INTEGER NOT NULL, stored_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, name));
CREATE TABLE workspaces (
    tenant TEXT NOT NULL, name TEXT NOT NULL, mode TEXT NOT NULL, disk_size INTEGER NOT NULL,
    head_version INTEGER NOT NULL, head_manifest TEXT NOT NULL, source TEXT NOT NULL,
    created_ms INTEGER NOT NULL, ttl_ms INTEGER,
    PRIMARY KEY (tenant, name));
CREATE TABLE checkpoints (
    tenant TEXT NOT NULL, workspace TEXT NOT NULL, version INTEGER NOT NULL,
    manifest TEXT NOT NULL, label TEXT, kind TEXT NOT NULL, created_ms INTEGER NOT NULL,
    bytes INTEGER NOT NULL, cut_seq INTEGER NOT NULL, journal_id TEXT, epoch INTEGER NOT NULL,
    PRIMARY KEY (tenant, workspace, version));
CREATE TABLE leases (
    tenant TEXT NOT NULL, workspace TEXT NOT NULL, holder TEXT, epoch INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, workspace));
CREATE TABLE manifests (tenant TEXT NOT NULL, id TEXT NOT NULL, created_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, id));
CREATE TABLE manifest_objects (tenant TEXT NOT NULL, manifest TEXT NOT NULL, object TEXT NOT NULL,
    PRIMARY KEY (tenant, manifest, object));
CREATE TABLE objects (tenant TEXT NOT NULL, id TEXT NOT NULL, data_len INTEGER NOT NULL,
    created_ms INTEGER NOT NULL, PRIMARY KEY (tenant, id));
"#,
    r#"
CREATE TABLE tokens (hash TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_ms INTEGER NOT NULL);
"#,
    r#"
CREATE TABLE nodes (id TEXT PRIMARY KEY, url TEXT, seen_ms INTEGER NOT NULL, attached TEXT NOT NULL);
"#,
    r#"
ALTER TABLE tokens ADD COLUMN scope TEXT;
CREATE TABLE relay_streams (tenant TEXT NOT NULL, name TEXT NOT NULL, sync INTEGER NOT NULL,
    created_ms INTEGER NOT NULL, PRIMARY KEY (tenant, name));
"#,
    r#"
ALTER TABLE checkpoints ADD COLUMN keep_until_ms INTEGER;
ALTER TABLE checkpoints ADD COLUMN expired_ms INTEGER;
CREATE TABLE gc_condemned (tenant TEXT NOT NULL, key TEXT NOT NULL, condemned_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, key));
"#,
    r#"
ALTER TABLE tokens ADD COLUMN id TEXT;
ALTER TABLE tokens ADD COLUMN expires_ms INTEGER;
ALTER TABLE tokens ADD COLUMN revoked_ms INTEGER;
ALTER TABLE tokens ADD COLUMN label TEXT;
UPDATE tokens SET id = substr(hash, 1, 16);
CREATE INDEX tokens_tenant_id ON tokens (tenant, id);
ALTER TABLE tenants ADD COLUMN deleting_ms INTEGER;
ALTER TABLE tenants ADD COLUMN quotas TEXT;
CREATE TABLE usage_meter (tenant TEXT PRIMARY KEY, live_bytes INTEGER NOT NULL,
    byte_seconds REAL NOT NULL, since_ms INTEGER NOT NULL, last_ms INTEGER NOT NULL);
"#,
    // The store a tenant is placed in (a name from the nodes' configuration; NULL: the
    // default store). Set when the tenant is created, never changed.
    // and its data key wrapped by a node's master key (an encrypted tenant; `shredded` once
    // its deletion has destroyed it).
    r#"
ALTER TABLE tenants ADD COLUMN store TEXT;
ALTER TABLE tenants ADD COLUMN data_key TEXT;
"#,
    // GC whose cost follows change: the change log (manifests that lost a reference, were
    // recorded, or were referenced without a record), written by triggers in the
    // transactions that make the change; the indexes that judge a manifest or object in one
    // probe; retention's per-workspace generation (bumped when a checkpoint is added,
    // labelled or kept) and the time it should look again. The log starts with every
    // recorded manifest and every referenced one without a record, so the first incremental
    // passes judge what was there before.
    r#"
CREATE TABLE gc_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, manifest TEXT NOT NULL);
CREATE INDEX gc_log_tenant ON gc_log (tenant, seq);
CREATE INDEX workspaces_manifest ON workspaces (tenant, head_manifest);
CREATE INDEX checkpoints_manifest ON checkpoints (tenant, manifest);
CREATE INDEX templates_manifest ON templates (tenant, manifest);
CREATE INDEX manifest_objects_object ON manifest_objects (tenant, object);
CREATE INDEX checkpoints_expired ON checkpoints (tenant, expired_ms) WHERE expired_ms IS NOT NULL;
ALTER TABLE workspaces ADD COLUMN retain_gen INTEGER NOT NULL DEFAULT 1;
ALTER TABLE workspaces ADD COLUMN retain_seen INTEGER NOT NULL DEFAULT 0;
ALTER TABLE workspaces ADD COLUMN retain_next_ms INTEGER NOT NULL DEFAULT 0;
CREATE INDEX workspaces_retain_changed ON workspaces (tenant) WHERE retain_gen <> retain_seen;
CREATE INDEX workspaces_retain_next ON workspaces (tenant, retain_next_ms);
CREATE TRIGGER gc_ws_insert AFTER INSERT ON workspaces BEGIN
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.head_manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.head_manifest);
END;
CREATE TRIGGER gc_ws_head AFTER UPDATE OF head_manifest ON workspaces
    WHEN OLD.head_manifest <> NEW.head_manifest BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.head_manifest);
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.head_manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.head_manifest);
END;
CREATE TRIGGER gc_ws_delete AFTER DELETE ON workspaces BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.head_manifest);
END;
CREATE TRIGGER gc_cp_insert AFTER INSERT ON checkpoints BEGIN
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.manifest);
    UPDATE workspaces SET retain_gen = retain_gen + 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
END;
CREATE TRIGGER gc_cp_manifest AFTER UPDATE OF manifest ON checkpoints
    WHEN OLD.manifest <> NEW.manifest BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.manifest);
END;
CREATE TRIGGER gc_cp_kept AFTER UPDATE OF label, keep_until_ms ON checkpoints BEGIN
    UPDATE workspaces SET retain_gen = retain_gen + 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
END;
CREATE TRIGGER gc_cp_delete AFTER DELETE ON checkpoints BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
END;
CREATE TRIGGER gc_tpl_insert AFTER INSERT ON templates BEGIN
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.manifest);
END;
CREATE TRIGGER gc_tpl_manifest AFTER UPDATE OF manifest ON templates
    WHEN OLD.manifest <> NEW.manifest BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
    INSERT INTO gc_log (tenant, manifest) SELECT NEW.tenant, NEW.manifest
        WHERE NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = NEW.tenant AND id = NEW.manifest);
END;
CREATE TRIGGER gc_tpl_delete AFTER DELETE ON templates BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
END;
CREATE TRIGGER gc_man_insert AFTER INSERT ON manifests BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (NEW.tenant, NEW.id);
END;
INSERT INTO gc_log (tenant, manifest) SELECT tenant, id FROM manifests;
INSERT INTO gc_log (tenant, manifest) SELECT r.tenant, r.manifest FROM (
    SELECT tenant, head_manifest AS manifest FROM workspaces
    UNION SELECT tenant, manifest FROM checkpoints
    UNION SELECT tenant, manifest FROM templates) r
    WHERE NOT EXISTS (SELECT 1 FROM manifests m WHERE m.tenant = r.tenant AND m.id = r.manifest);
"#, // The head GC last judged dense enough not to compact (a detached workspace is judged again
    // only once its head moves), and the index of those not judged at their head.
    r#"
ALTER TABLE workspaces ADD COLUMN compact_judged TEXT;
ALTER TABLE workspaces ADD COLUMN compact_check INTEGER NOT NULL DEFAULT 1;
CREATE INDEX workspaces_compact_check ON workspaces (tenant) WHERE compact_check = 1;
CREATE TRIGGER gc_lease_released AFTER UPDATE OF holder ON leases
    WHEN OLD.holder IS NOT NULL AND NEW.holder IS NULL BEGIN
    UPDATE workspaces SET compact_check = 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
END;
"#,
];

/// A row written by a node of an older version has no id: it is derived the same way.
pub(super) const TOKEN_COLS: &str =
    "coalesce(k.id, substr(k.hash, 1, 16)), k.tenant, k.scope, k.created_ms, k.expires_ms, k.revoked_ms, k.label";

pub(super) fn token_row(r: &rusqlite::Row) -> rusqlite::Result<TokenInfo> {
    Ok(TokenInfo {
        id: r.get(0)?,
        tenant: r.get(1)?,
        scope: r.get(2)?,
        created_ms: r.get::<_, i64>(3)? as u64,
        expires_ms: r.get::<_, Option<i64>>(4)?.map(|v| v as u64),
        revoked_ms: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
        label: r.get(6)?,
    })
}

/// A tenant that may gain rows: it exists (`NotFound`) and is not being deleted (`InUse`).
/// Every insert of a tenant's data checks this in its transaction, so a request admitted
/// before a deletion's mark adds nothing after it.
pub(super) fn live_tenant(c: &Connection, t: &str) -> Result<TenantInfo> {
    let info = tenant_row(c, t)?;
    if info.deleting_ms.is_some() {
        return Err(deleting(t));
    }
    Ok(info)
}

/// A tenant's row, or `NotFound`.
pub(super) fn tenant_row(c: &Connection, t: &str) -> Result<TenantInfo> {
    c.query_row(
        "SELECT id, created_ms, deleting_ms, quotas, store, data_key IS NOT NULL FROM tenants WHERE id = ?1",
        params![t],
        |r| {
            Ok(TenantInfo {
                name: r.get(0)?,
                created_ms: r.get::<_, i64>(1)? as u64,
                deleting_ms: r.get::<_, Option<i64>>(2)?.map(|v| v as u64),
                quotas: Quotas::from_column(r.get::<_, Option<String>>(3)?.as_deref()),
                store: r.get(4)?,
                encrypted: r.get(5)?,
            })
        },
    )
    .optional()
    .map_err(be)?
    .ok_or(CatalogError::NotFound {
        what: "tenant",
        name: t.into(),
    })
}

pub(super) fn be(e: rusqlite::Error) -> CatalogError {
    CatalogError::from_source("sqlite", sqlite_retryable(&e), e)
}

/// Whether a SQLite error may pass on a retry: a busy or locked database (another process
/// holds it past the busy timeout). Syntax errors, constraints, a read-only or corrupt file
/// and I/O errors recur.
pub(crate) fn sqlite_retryable(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode as C;
    matches!(
        e.sqlite_error_code(),
        Some(C::DatabaseBusy | C::DatabaseLocked)
    )
}

pub(super) fn hash(s: String) -> rusqlite::Result<Hash> {
    s.parse().map_err(|e: strata_format::Error| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

pub(super) fn ws_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Workspace> {
    Ok(Workspace {
        tenant: r.get(0)?,
        name: r.get(1)?,
        mode: r.get::<_, String>(2)?.parse().unwrap_or_default(),
        disk_size: r.get::<_, i64>(3)? as u64,
        head_version: r.get::<_, i64>(4)? as u64,
        head_manifest: hash(r.get(5)?)?,
        source: r.get(6)?,
        created_ms: r.get::<_, i64>(7)? as u64,
        ttl_ms: r.get::<_, Option<i64>>(8)?.map(|v| v as u64),
    })
}

pub(super) const WS_COLS: &str =
    "tenant, name, mode, disk_size, head_version, head_manifest, source, created_ms, ttl_ms";
pub(super) const CP_COLS: &str =
    "workspace, version, manifest, label, kind, created_ms, bytes, cut_seq, journal_id, epoch, keep_until_ms";

pub(super) fn cp_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Checkpoint> {
    Ok(Checkpoint {
        workspace: r.get(0)?,
        version: r.get::<_, i64>(1)? as u64,
        manifest: hash(r.get(2)?)?,
        label: r.get(3)?,
        kind: CheckpointKind::parse(&r.get::<_, String>(4)?).unwrap_or(CheckpointKind::Auto),
        created_ms: r.get::<_, i64>(5)? as u64,
        bytes: r.get::<_, i64>(6)? as u64,
        cut_seq: r.get::<_, i64>(7)? as u64,
        journal_id: r.get(8)?,
        epoch: r.get::<_, i64>(9)? as u64,
        keep_until_ms: r.get::<_, Option<i64>>(10)?.map(|v| v as u64),
    })
}

pub(super) fn tpl_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Template> {
    Ok(Template {
        tenant: r.get(0)?,
        name: r.get(1)?,
        manifest: hash(r.get(2)?)?,
        disk_size: r.get::<_, i64>(3)? as u64,
        stored_bytes: r.get::<_, i64>(4)? as u64,
        created_ms: r.get::<_, i64>(5)? as u64,
    })
}

pub(super) fn lease_of(c: &Connection, tenant: &str, ws: &str) -> rusqlite::Result<Lease> {
    Ok(c.query_row(
        "SELECT holder, epoch, expires_ms FROM leases WHERE tenant = ?1 AND workspace = ?2",
        params![tenant, ws],
        |r| {
            Ok(Lease {
                holder: r.get(0)?,
                epoch: r.get::<_, i64>(1)? as u64,
                expires_ms: r.get::<_, i64>(2)? as u64,
            })
        },
    )
    .optional()?
    .unwrap_or(Lease {
        holder: None,
        epoch: 0,
        expires_ms: 0,
    }))
}

/// Extends one lease: the outer error is the database's, the inner one `Fenced`.
pub(super) fn renew_one(
    c: &Connection,
    tenant: &str,
    ws: &str,
    lease: &LeaseGrant,
    expires_ms: u64,
) -> Result<Result<()>> {
    let k = c
        .execute(
            "UPDATE leases SET expires_ms = ?5 WHERE tenant = ?1 AND workspace = ?2 AND holder = ?3 AND epoch = ?4",
            params![tenant, ws, lease.node, lease.epoch as i64, expires_ms as i64],
        )
        .map_err(be)?;
    if k == 0 {
        let l = lease_of(c, tenant, ws).map_err(be)?;
        return Ok(Err(CatalogError::Fenced {
            held: lease.epoch,
            current: l.epoch,
            holder: l.holder,
        }));
    }
    Ok(Ok(()))
}

pub(super) fn get_ws(c: &Connection, tenant: &str, name: &str) -> Result<Workspace> {
    c.query_row(
        &format!("SELECT {WS_COLS} FROM workspaces WHERE tenant = ?1 AND name = ?2"),
        params![tenant, name],
        ws_row,
    )
    .optional()
    .map_err(be)?
    .ok_or_else(|| CatalogError::NotFound {
        what: "workspace",
        name: name.into(),
    })
}

impl SqliteCatalog {
    pub fn open(path: &Path) -> Result<SqliteCatalog> {
        SqliteCatalog::open_with_clock(path, std::sync::Arc::new(SystemClock))
    }

    /// [`SqliteCatalog::open`] with time from `clock` (tests move a [`ManualClock`] instead of
    /// sleeping through lease TTLs and grace periods).
    pub fn open_with_clock(path: &Path, clock: std::sync::Arc<dyn Clock>) -> Result<SqliteCatalog> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                let retry = crate::io_retryable(&e);
                CatalogError::from_source(&format!("creating {}", parent.display()), retry, e)
            })?;
        }
        let mut conn = Connection::open(path).map_err(be)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(be)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(be)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(be)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(be)?;
        let applied: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(be)?;
        if applied as usize > MIGRATIONS.len() {
            return Err(CatalogError::backend(format!(
                "catalog schema version {applied} is newer than this strata ({})",
                MIGRATIONS.len()
            )));
        }
        for (i, m) in MIGRATIONS.iter().enumerate().skip(applied as usize) {
            let tx = conn.transaction().map_err(be)?;
            tx.execute_batch(m).map_err(be)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)
                .map_err(be)?;
            tx.commit().map_err(be)?;
        }
        let worker = Worker::start(conn)
            .map_err(|e| CatalogError::from_source("starting the catalog thread", false, e))?;
        Ok(SqliteCatalog { worker, clock })
    }

    /// Runs `f` on the connection in the catalog's thread, in order.
    pub(super) async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        self.worker.run(Lane::Normal, f).await
    }

    /// Like [`Self::run`], ahead of every call not yet started: lease renewals.
    pub(super) async fn run_urgent<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        self.worker.run(Lane::Urgent, f).await
    }
}

/// A constraint violation is `AlreadyExists` for `what` named `name`; anything else a backend error.
pub(super) fn exists_or_backend<'a>(
    what: &'static str,
    name: &'a str,
) -> impl FnOnce(rusqlite::Error) -> CatalogError + 'a {
    move |e| match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if f.code == rusqlite::ErrorCode::ConstraintViolation =>
        {
            CatalogError::AlreadyExists {
                what,
                name: name.into(),
            }
        }
        _ => be(e),
    }
}

pub(super) fn stream_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RelayStream> {
    Ok(RelayStream {
        tenant: r.get(0)?,
        name: r.get(1)?,
        sync: r.get::<_, i64>(2)? != 0,
        created_ms: r.get::<_, i64>(3)? as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A syntax error recurs; a database another connection holds locked may pass.
    #[test]
    fn sqlite_errors_say_whether_a_retry_can_help() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let a = Connection::open(&path).unwrap();
        let e = be(a.execute("SELEC 1", []).unwrap_err());
        assert!(!e.is_retryable(), "{e}");
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
        a.execute_batch("CREATE TABLE t (x INTEGER); BEGIN EXCLUSIVE; INSERT INTO t VALUES (1);")
            .unwrap();
        let b = Connection::open(&path).unwrap();
        b.busy_timeout(std::time::Duration::ZERO).unwrap();
        let e = be(b.execute("INSERT INTO t VALUES (2)", []).unwrap_err());
        assert!(e.is_retryable(), "{e}");
    }

    /// A catalog made before token ids (schema 5) opens with its tokens working, each with
    /// the id its hash gives.
    #[tokio::test]
    async fn tokens_of_an_older_catalog_get_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        {
            let c = Connection::open(&path).unwrap();
            for m in &MIGRATIONS[..5] {
                c.execute_batch(m).unwrap();
            }
            c.pragma_update(None, "user_version", 5).unwrap();
            c.execute_batch(
                "INSERT INTO tenants VALUES ('old', 1);
                 INSERT INTO tokens (hash, tenant, created_ms) VALUES ('00112233445566778899aabb', 'old', 2);
                 INSERT INTO tokens (hash, tenant, created_ms, scope) VALUES ('ffeeddccbbaa99887766', 'old', 3, 'relay:wal');",
            )
            .unwrap();
        }
        let cat = SqliteCatalog::open(&path).unwrap();
        let i = cat
            .token_info("00112233445566778899aabb")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (i.id.as_str(), i.scope, i.revoked_ms),
            ("0011223344556677", None, None)
        );
        assert_eq!(cat.list_tokens("old").await.unwrap().len(), 2);
        let r = cat.revoke_token("old", "ffeeddccbbaa9988").await.unwrap();
        assert!(r.revoked_ms.is_some());
        assert!(cat.get_tenant("old").await.unwrap().deleting_ms.is_none());
    }
}
