//! PostgreSQL schema, row mapping, connection setup and the helpers the catalog's queries share.

use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod};
use strata_format::Hash;
use tokio_postgres::error::SqlState;
use tokio_postgres::Row;

use super::PostgresCatalog;
use crate::*;

/// Schema migrations, applied in order under an advisory lock; `strata_schema.version` records
/// how many ran.
pub(super) const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE tenants (id TEXT PRIMARY KEY, created_ms BIGINT NOT NULL);
CREATE TABLE tokens (hash TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(id),
    created_ms BIGINT NOT NULL);
CREATE TABLE templates (
    tenant TEXT NOT NULL, name TEXT NOT NULL, manifest TEXT NOT NULL,
    disk_size BIGINT NOT NULL, stored_bytes BIGINT NOT NULL, created_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, name));
CREATE TABLE workspaces (
    tenant TEXT NOT NULL, name TEXT NOT NULL, mode TEXT NOT NULL, disk_size BIGINT NOT NULL,
    head_version BIGINT NOT NULL, head_manifest TEXT NOT NULL, source TEXT NOT NULL,
    created_ms BIGINT NOT NULL, ttl_ms BIGINT,
    PRIMARY KEY (tenant, name));
CREATE TABLE checkpoints (
    tenant TEXT NOT NULL, workspace TEXT NOT NULL, version BIGINT NOT NULL,
    manifest TEXT NOT NULL, label TEXT, kind TEXT NOT NULL, created_ms BIGINT NOT NULL,
    bytes BIGINT NOT NULL, cut_seq BIGINT NOT NULL, journal_id TEXT, epoch BIGINT NOT NULL,
    PRIMARY KEY (tenant, workspace, version));
CREATE TABLE leases (
    tenant TEXT NOT NULL, workspace TEXT NOT NULL, holder TEXT, epoch BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, workspace));
CREATE TABLE manifests (tenant TEXT NOT NULL, id TEXT NOT NULL, created_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, id));
CREATE TABLE manifest_objects (tenant TEXT NOT NULL, manifest TEXT NOT NULL, object TEXT NOT NULL,
    PRIMARY KEY (tenant, manifest, object));
CREATE TABLE objects (tenant TEXT NOT NULL, id TEXT NOT NULL, data_len BIGINT NOT NULL,
    created_ms BIGINT NOT NULL, PRIMARY KEY (tenant, id));
CREATE TABLE nodes (id TEXT PRIMARY KEY, url TEXT, seen_ms BIGINT NOT NULL,
    attached TEXT NOT NULL);
"#,
    r#"
ALTER TABLE tokens ADD COLUMN scope TEXT;
CREATE TABLE relay_streams (tenant TEXT NOT NULL, name TEXT NOT NULL, sync BOOLEAN NOT NULL,
    created_ms BIGINT NOT NULL, PRIMARY KEY (tenant, name));
"#,
    r#"
ALTER TABLE checkpoints ADD COLUMN keep_until_ms BIGINT;
ALTER TABLE checkpoints ADD COLUMN expired_ms BIGINT;
CREATE TABLE gc_condemned (tenant TEXT NOT NULL, key TEXT NOT NULL, condemned_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, key));
"#,
    r#"
ALTER TABLE tokens ADD COLUMN id TEXT;
ALTER TABLE tokens ADD COLUMN expires_ms BIGINT;
ALTER TABLE tokens ADD COLUMN revoked_ms BIGINT;
ALTER TABLE tokens ADD COLUMN label TEXT;
UPDATE tokens SET id = substr(hash, 1, 16);
CREATE INDEX tokens_tenant_id ON tokens (tenant, id);
ALTER TABLE tenants ADD COLUMN deleting_ms BIGINT;
ALTER TABLE tenants ADD COLUMN quotas TEXT;
CREATE TABLE usage_meter (tenant TEXT PRIMARY KEY, live_bytes BIGINT NOT NULL,
    byte_seconds DOUBLE PRECISION NOT NULL, since_ms BIGINT NOT NULL, last_ms BIGINT NOT NULL);
"#,
    // The store a tenant is placed in (a name from the nodes' configuration; NULL: the
    // default store). Set when the tenant is created, never changed.
    // and its data key wrapped by a node's master key (an encrypted tenant; `shredded` once
    // its deletion has destroyed it).
    r#"
ALTER TABLE tenants ADD COLUMN store TEXT;
ALTER TABLE tenants ADD COLUMN data_key TEXT;
"#,
    // GC whose cost follows change (see the SQLite twin): the change log written by triggers,
    // the indexes that judge a manifest or object in one probe, retention's generation.
    r#"
CREATE TABLE gc_log (seq BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, manifest TEXT NOT NULL);
CREATE INDEX gc_log_tenant ON gc_log (tenant, seq);
CREATE INDEX workspaces_manifest ON workspaces (tenant, head_manifest);
CREATE INDEX checkpoints_manifest ON checkpoints (tenant, manifest);
CREATE INDEX templates_manifest ON templates (tenant, manifest);
CREATE INDEX manifest_objects_object ON manifest_objects (tenant, object);
CREATE INDEX checkpoints_expired ON checkpoints (tenant, expired_ms) WHERE expired_ms IS NOT NULL;
ALTER TABLE workspaces ADD COLUMN retain_gen BIGINT NOT NULL DEFAULT 1;
ALTER TABLE workspaces ADD COLUMN retain_seen BIGINT NOT NULL DEFAULT 0;
ALTER TABLE workspaces ADD COLUMN retain_next_ms BIGINT NOT NULL DEFAULT 0;
CREATE INDEX workspaces_retain_changed ON workspaces (tenant) WHERE retain_gen <> retain_seen;
CREATE INDEX workspaces_retain_next ON workspaces (tenant, retain_next_ms);
CREATE FUNCTION strata_gc_gained(t TEXT, m TEXT) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM manifests WHERE tenant = t AND id = m) THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (t, m);
    END IF;
END $$;
CREATE FUNCTION strata_gc_workspaces() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM strata_gc_gained(NEW.tenant, NEW.head_manifest);
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.head_manifest);
    ELSIF OLD.head_manifest <> NEW.head_manifest THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.head_manifest);
        PERFORM strata_gc_gained(NEW.tenant, NEW.head_manifest);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER gc_workspaces AFTER INSERT OR DELETE OR UPDATE OF head_manifest ON workspaces
    FOR EACH ROW EXECUTE FUNCTION strata_gc_workspaces();
CREATE FUNCTION strata_gc_checkpoints() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM strata_gc_gained(NEW.tenant, NEW.manifest);
        UPDATE workspaces SET retain_gen = retain_gen + 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
    ELSE
        IF OLD.manifest <> NEW.manifest THEN
            INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
            PERFORM strata_gc_gained(NEW.tenant, NEW.manifest);
        END IF;
        IF OLD.label IS DISTINCT FROM NEW.label OR OLD.keep_until_ms IS DISTINCT FROM NEW.keep_until_ms THEN
            UPDATE workspaces SET retain_gen = retain_gen + 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
        END IF;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER gc_checkpoints AFTER INSERT OR DELETE OR UPDATE OF manifest, label, keep_until_ms
    ON checkpoints FOR EACH ROW EXECUTE FUNCTION strata_gc_checkpoints();
CREATE FUNCTION strata_gc_templates() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM strata_gc_gained(NEW.tenant, NEW.manifest);
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
    ELSIF OLD.manifest <> NEW.manifest THEN
        INSERT INTO gc_log (tenant, manifest) VALUES (OLD.tenant, OLD.manifest);
        PERFORM strata_gc_gained(NEW.tenant, NEW.manifest);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER gc_templates AFTER INSERT OR DELETE OR UPDATE OF manifest ON templates
    FOR EACH ROW EXECUTE FUNCTION strata_gc_templates();
CREATE FUNCTION strata_gc_manifests() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO gc_log (tenant, manifest) VALUES (NEW.tenant, NEW.id);
    RETURN NULL;
END $$;
CREATE TRIGGER gc_manifests AFTER INSERT ON manifests
    FOR EACH ROW EXECUTE FUNCTION strata_gc_manifests();
INSERT INTO gc_log (tenant, manifest) SELECT tenant, id FROM manifests;
INSERT INTO gc_log (tenant, manifest) SELECT r.tenant, r.manifest FROM (
    SELECT tenant, head_manifest AS manifest FROM workspaces
    UNION SELECT tenant, manifest FROM checkpoints
    UNION SELECT tenant, manifest FROM templates) r
    WHERE NOT EXISTS (SELECT 1 FROM manifests m WHERE m.tenant = r.tenant AND m.id = r.manifest);
"#,
    r#"
ALTER TABLE workspaces ADD COLUMN compact_judged TEXT;
ALTER TABLE workspaces ADD COLUMN compact_check INTEGER NOT NULL DEFAULT 1;
CREATE INDEX workspaces_compact_check ON workspaces (tenant) WHERE compact_check = 1;
CREATE FUNCTION strata_gc_leases() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.holder IS NOT NULL AND NEW.holder IS NULL THEN
        UPDATE workspaces SET compact_check = 1 WHERE tenant = NEW.tenant AND name = NEW.workspace;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER gc_leases AFTER UPDATE OF holder ON leases
    FOR EACH ROW EXECUTE FUNCTION strata_gc_leases();
"#,
];

/// A row written by a node of an older version has no id: it is derived the same way.
pub(super) const TOKEN_COLS: &str =
    "coalesce(k.id, substr(k.hash, 1, 16)), k.tenant, k.scope, k.created_ms, k.expires_ms, k.revoked_ms, k.label";

pub(super) fn token_row(r: &Row) -> TokenInfo {
    TokenInfo {
        id: r.get(0),
        tenant: r.get(1),
        scope: r.get(2),
        created_ms: r.get::<_, i64>(3) as u64,
        expires_ms: r.get::<_, Option<i64>>(4).map(|v| v as u64),
        revoked_ms: r.get::<_, Option<i64>>(5).map(|v| v as u64),
        label: r.get(6),
    }
}

/// A tenant that may gain rows (see the SQLite twin), its row locked `FOR SHARE` (or as
/// `lock` says) against a deletion's mark.
pub(super) async fn live_tenant(c: &impl GenericClient, t: &str, lock: &str) -> Result<TenantInfo> {
    let info = tenant_row(c, t, lock).await?;
    if info.deleting_ms.is_some() {
        return Err(deleting(t));
    }
    Ok(info)
}

/// A tenant's row (`lock`: "", " FOR SHARE" or " FOR UPDATE"), or `NotFound`.
pub(super) async fn tenant_row(c: &impl GenericClient, t: &str, lock: &str) -> Result<TenantInfo> {
    c.query_opt(
        &format!(
            "SELECT id, created_ms, deleting_ms, quotas, store, data_key IS NOT NULL FROM tenants WHERE id = $1{lock}"
        ),
        &[&t],
    )
    .await
    .map_err(be)?
    .map(|r| TenantInfo {
        name: r.get(0),
        created_ms: r.get::<_, i64>(1) as u64,
        deleting_ms: r.get::<_, Option<i64>>(2).map(|v| v as u64),
        quotas: Quotas::from_column(r.get::<_, Option<String>>(3).as_deref()),
        store: r.get(4),
        encrypted: r.get(5),
    })
    .ok_or(CatalogError::NotFound {
        what: "tenant",
        name: t.into(),
    })
}

/// The server's clock in milliseconds since the epoch.
pub(super) const SERVER_NOW: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT";

pub(super) const WS_COLS: &str =
    "tenant, name, mode, disk_size, head_version, head_manifest, source, created_ms, ttl_ms";
pub(super) const CP_COLS: &str =
    "workspace, version, manifest, label, kind, created_ms, bytes, cut_seq, journal_id, epoch, keep_until_ms";
pub(super) const TPL_COLS: &str = "tenant, name, manifest, disk_size, stored_bytes, created_ms";

pub(super) fn be(e: tokio_postgres::Error) -> CatalogError {
    let retryable = pg_retryable(&e);
    match e.as_db_error() {
        Some(d) => {
            let context = format!("postgres ({})", d.code().code());
            CatalogError::from_source(&context, retryable, e)
        }
        None => CatalogError::from_source("postgres", retryable, e),
    }
}

/// Whether a PostgreSQL error may pass on a retry, by SQLSTATE class: connection exceptions
/// (08), transaction rollbacks such as serialization failures and deadlocks (40),
/// insufficient resources (53), operator intervention such as a shutdown (57P01–57P03), a
/// lock not available (55P03) and the timeouts this catalog sets itself: a statement timeout
/// (57014) and an idle-in-transaction timeout (25P03). Syntax errors (42), data exceptions (22), constraint
/// violations (23) and the rest are the same every time. An error without a SQLSTATE is the
/// connection's (closed, I/O, timeout): retryable.
pub fn pg_retryable(e: &tokio_postgres::Error) -> bool {
    let Some(code) = e.code() else {
        return true;
    };
    let c = code.code();
    c.starts_with("08")
        || c.starts_with("40")
        || c.starts_with("53")
        || matches!(c, "57P01" | "57P02" | "57P03" | "55P03" | "57014" | "25P03")
}

pub(super) fn pool_err(e: deadpool_postgres::PoolError) -> CatalogError {
    use deadpool_postgres::PoolError as P;
    let retryable = match &e {
        P::Timeout(_) => true,
        P::Backend(b) => pg_retryable(b),
        _ => false,
    };
    CatalogError::from_source("postgres pool", retryable, e)
}

/// A unique-key violation is `AlreadyExists` for `what` named `name`; anything else a backend error.
pub(super) fn exists_or_backend<'a>(
    what: &'static str,
    name: &'a str,
) -> impl FnOnce(tokio_postgres::Error) -> CatalogError + 'a {
    move |e| {
        if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
            CatalogError::AlreadyExists {
                what,
                name: name.into(),
            }
        } else {
            be(e)
        }
    }
}

pub(super) fn hash(s: &str) -> Result<Hash> {
    s.parse()
        .map_err(|e| CatalogError::from_source(&format!("corrupt hash {s:?} in catalog"), false, e))
}

pub(super) fn u(r: &Row, i: usize) -> u64 {
    r.get::<_, i64>(i) as u64
}

pub(super) fn ws_row(r: &Row) -> Result<Workspace> {
    Ok(Workspace {
        tenant: r.get(0),
        name: r.get(1),
        mode: r.get::<_, String>(2).parse().unwrap_or_default(),
        disk_size: u(r, 3),
        head_version: u(r, 4),
        head_manifest: hash(r.get(5))?,
        source: r.get(6),
        created_ms: u(r, 7),
        ttl_ms: r.get::<_, Option<i64>>(8).map(|v| v as u64),
    })
}

pub(super) fn cp_row(r: &Row) -> Result<Checkpoint> {
    Ok(Checkpoint {
        workspace: r.get(0),
        version: u(r, 1),
        manifest: hash(r.get(2))?,
        label: r.get(3),
        kind: CheckpointKind::parse(r.get(4)).unwrap_or(CheckpointKind::Auto),
        created_ms: u(r, 5),
        bytes: u(r, 6),
        cut_seq: u(r, 7),
        journal_id: r.get(8),
        epoch: u(r, 9),
        keep_until_ms: r.get::<_, Option<i64>>(10).map(|v| v as u64),
    })
}

pub(super) fn tpl_row(r: &Row) -> Result<Template> {
    Ok(Template {
        tenant: r.get(0),
        name: r.get(1),
        manifest: hash(r.get(2))?,
        disk_size: u(r, 3),
        stored_bytes: u(r, 4),
        created_ms: u(r, 5),
    })
}

pub(super) async fn server_now(c: &impl GenericClient) -> Result<u64> {
    Ok(c.query_one(SERVER_NOW, &[])
        .await
        .map_err(be)?
        .get::<_, i64>(0) as u64)
}

/// Reads the workspace, locking its row until the transaction ends when `lock` is set.
pub(super) async fn get_ws(
    c: &impl GenericClient,
    tenant: &str,
    name: &str,
    lock: bool,
) -> Result<Workspace> {
    let q = format!(
        "SELECT {WS_COLS} FROM workspaces WHERE tenant = $1 AND name = $2{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    match c.query_opt(&q, &[&tenant, &name]).await.map_err(be)? {
        Some(r) => ws_row(&r),
        None => Err(CatalogError::NotFound {
            what: "workspace",
            name: name.into(),
        }),
    }
}

pub(super) async fn lease_of(c: &impl GenericClient, tenant: &str, ws: &str) -> Result<Lease> {
    Ok(c.query_opt(
        "SELECT holder, epoch, expires_ms FROM leases WHERE tenant = $1 AND workspace = $2",
        &[&tenant, &ws],
    )
    .await
    .map_err(be)?
    .map(|r| Lease {
        holder: r.get(0),
        epoch: u(&r, 1),
        expires_ms: u(&r, 2),
    })
    .unwrap_or(Lease {
        holder: None,
        epoch: 0,
        expires_ms: 0,
    }))
}

impl PostgresCatalog {
    /// Connects to `postgres://user[:password]@host[:port]/dbname[?options]` (or the key=value
    /// form) and applies any pending migrations. `pool_size` bounds the open connections.
    pub async fn connect(url: &str, pool_size: usize) -> Result<PostgresCatalog> {
        let (mut cfg, tls) = super::tls::config(url)?;
        // A node paused or cut off inside a transaction (SIGSTOP, a partition) must not hold
        // its row locks until it wakes up: the server ends such a transaction after a few
        // seconds, so another node can take the workspace over; and no statement waits on a
        // lock or runs unboundedly. Every transaction here is a handful of short statements.
        let ours = "-c idle_in_transaction_session_timeout=5000 -c lock_timeout=10000 -c statement_timeout=30000";
        let opts = match cfg.get_options() {
            Some(o) if !o.is_empty() => format!("{ours} {o}"),
            _ => ours.to_string(),
        };
        cfg.options(&opts);
        let mgr = Manager::from_config(
            cfg,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(mgr)
            .max_size(pool_size.max(1))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(std::time::Duration::from_secs(10)))
            .wait_timeout(Some(std::time::Duration::from_secs(30)))
            .build()
            .map_err(|e| CatalogError::from_source("postgres pool", false, e))?;
        let cat = PostgresCatalog { pool };
        cat.migrate().await?;
        Ok(cat)
    }

    pub(super) async fn migrate(&self) -> Result<()> {
        let mut c = self.pool.get().await.map_err(pool_err)?;
        let tx = c.transaction().await.map_err(be)?;
        // Nodes starting together take turns; the lock ends with the transaction.
        tx.execute("SELECT pg_advisory_xact_lock(7365726174610001)", &[])
            .await
            .map_err(be)?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS strata_schema (version INTEGER NOT NULL)")
            .await
            .map_err(be)?;
        let v: i32 = match tx
            .query_opt("SELECT version FROM strata_schema", &[])
            .await
            .map_err(be)?
        {
            Some(r) => r.get(0),
            None => {
                tx.execute("INSERT INTO strata_schema (version) VALUES (0)", &[])
                    .await
                    .map_err(be)?;
                0
            }
        };
        if v as usize > MIGRATIONS.len() {
            return Err(CatalogError::backend(format!(
                "catalog schema version {v} is newer than this build ({}); upgrade strata",
                MIGRATIONS.len()
            )));
        }
        for m in &MIGRATIONS[v as usize..] {
            tx.batch_execute(m).await.map_err(be)?;
        }
        tx.execute(
            "UPDATE strata_schema SET version = $1",
            &[&(MIGRATIONS.len() as i32)],
        )
        .await
        .map_err(be)?;
        tx.commit().await.map_err(be)
    }

    /// Whether this node's connections to the catalog are encrypted (what the server says of
    /// one of them), for the startup log and the tests.
    pub async fn encrypted(&self) -> Result<bool> {
        let c = self.conn().await?;
        let r = c
            .query_opt(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .map_err(be)?;
        Ok(r.is_some_and(|r| r.get::<_, bool>(0)))
    }

    pub(super) async fn conn(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(pool_err)
    }
}

/// Creates an empty database next to the one `admin_url` names and returns its URL (tests and
/// throwaway clusters). `name` must be a plain identifier.
pub async fn create_database(admin_url: &str, name: &str) -> Result<String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(CatalogError::backend(format!("bad database name {name:?}")));
    }
    let (cfg, tls) = super::tls::config(admin_url)?;
    let (client, conn) = cfg.connect(tls).await.map_err(be)?;
    let task = tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .map_err(be)?;
    drop(client);
    let _ = task.await;
    let (base, query) = match admin_url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (admin_url, String::new()),
    };
    let Some(cut) = base
        .rfind('/')
        .filter(|&i| i > base.find("//").map_or(0, |j| j + 1))
    else {
        return Ok(format!("{base}/{name}{query}"));
    };
    Ok(format!("{}/{name}{query}", &base[..cut]))
}

pub(super) fn stream_row(r: &Row) -> RelayStream {
    RelayStream {
        tenant: r.get(0),
        name: r.get(1),
        sync: r.get(2),
        created_ms: u(r, 3),
    }
}
