//! SQLite: retention and garbage-collection state (expired checkpoints, references, condemned
//! keys, pruning). The `Catalog` impl in `sqlite.rs` delegates here.

use super::*;

pub(super) async fn expire_checkpoints(
    cat: &SqliteCatalog,
    tenant: &str,
    workspace: &str,
    versions: &[u64],
) -> Result<u64> {
    let (t, n, versions) = (tenant.to_string(), workspace.to_string(), versions.to_vec());
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(be)?;
        let ws = get_ws(&tx, &t, &n)?;
        let now = clock.now_ms() as i64;
        let mut k = 0;
        for v in versions.into_iter().filter(|&v| v != ws.head_version) {
            k += tx
                .execute(
                    "UPDATE checkpoints SET expired_ms = ?4 WHERE tenant = ?1 AND workspace = ?2 AND version = ?3 AND expired_ms IS NULL",
                    params![t, n, v as i64, now],
                )
                .map_err(be)? as u64;
        }
        tx.commit().map_err(be)?;
        Ok(k)
    })
    .await
}

pub(super) async fn gc_references(
    cat: &SqliteCatalog,
    tenant: &str,
    grace_ms: u64,
) -> Result<Vec<Hash>> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let since = clock.now_ms() as i64 - grace_ms as i64;
        let mut s = c
            .prepare(
                "SELECT head_manifest FROM workspaces WHERE tenant = ?1
                 UNION SELECT manifest FROM checkpoints WHERE tenant = ?1 AND (expired_ms IS NULL OR expired_ms >= ?2)
                 UNION SELECT manifest FROM templates WHERE tenant = ?1",
            )
            .map_err(be)?;
        let rows = s
            .query_map(params![t, since], |r| hash(r.get(0)?))
            .map_err(be)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
    })
    .await
}

pub(super) async fn gc_mark(cat: &SqliteCatalog, tenant: &str, grace_ms: u64) -> Result<GcMark> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let since = clock.now_ms() as i64 - grace_ms as i64;
        let mut s = c.prepare_cached(crate::GC_MARK_SQL).map_err(be)?;
        // Rows are recorded by the same clock (`record_manifest`).
        let mut rows = s.query(params![t, since, since]).map_err(be)?;
        let mut mark = GcMark::default();
        while let Some(r) = rows.next().map_err(be)? {
            let (kind, id, n): (i64, String, i64) = (
                r.get(0).map_err(be)?,
                r.get(1).map_err(be)?,
                r.get(2).map_err(be)?,
            );
            mark.take_row(kind, hash(id).map_err(be)?, n);
        }
        Ok(mark)
    })
    .await
}

pub(super) async fn purge_expired_checkpoints(
    cat: &SqliteCatalog,
    tenant: &str,
    grace_ms: u64,
) -> Result<u64> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let before = clock.now_ms() as i64 - grace_ms as i64;
        Ok(c.execute(
            "DELETE FROM checkpoints WHERE tenant = ?1 AND expired_ms IS NOT NULL AND expired_ms < ?2",
            params![t, before],
        )
        .map_err(be)? as u64)
    })
    .await
}

pub(super) async fn gc_condemn(cat: &SqliteCatalog, tenant: &str, keys: &[String]) -> Result<()> {
    let (t, keys) = (tenant.to_string(), keys.to_vec());
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let tx = c.transaction().map_err(be)?;
        let now = clock.now_ms() as i64;
        {
            let mut s = tx
                .prepare_cached("INSERT OR IGNORE INTO gc_condemned (tenant, key, condemned_ms) VALUES (?1, ?2, ?3)")
                .map_err(be)?;
            for k in &keys {
                s.execute(params![t, k, now]).map_err(be)?;
            }
        }
        tx.commit().map_err(be)
    })
    .await
}

pub(super) async fn gc_condemned(cat: &SqliteCatalog, tenant: &str) -> Result<Vec<(String, u64)>> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        let now = clock.now_ms() as i64;
        let mut s = c
            .prepare("SELECT key, condemned_ms FROM gc_condemned WHERE tenant = ?1 ORDER BY key")
            .map_err(be)?;
        let rows = s
            .query_map(params![t], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    (now - r.get::<_, i64>(1)?).max(0) as u64,
                ))
            })
            .map_err(be)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
    })
    .await
}

pub(super) async fn prune_references(
    cat: &SqliteCatalog,
    tenant: &str,
    manifests: &[Hash],
    objects: &[Hash],
) -> Result<u64> {
    let t = tenant.to_string();
    let (ms, os): (Vec<String>, Vec<String>) = (
        manifests.iter().map(|h| h.to_hex()).collect(),
        objects.iter().map(|h| h.to_hex()).collect(),
    );
    cat.run(move |c| {
        let tx = c.transaction().map_err(be)?;
        let mut n = 0usize;
        {
            let mut links = tx
                .prepare_cached("DELETE FROM manifest_objects WHERE tenant = ?1 AND manifest = ?2")
                .map_err(be)?;
            let mut man = tx
                .prepare_cached("DELETE FROM manifests WHERE tenant = ?1 AND id = ?2")
                .map_err(be)?;
            let mut obj = tx
                .prepare_cached("DELETE FROM objects WHERE tenant = ?1 AND id = ?2")
                .map_err(be)?;
            for m in &ms {
                n += links.execute(params![t, m]).map_err(be)?;
                n += man.execute(params![t, m]).map_err(be)?;
            }
            for o in &os {
                n += obj.execute(params![t, o]).map_err(be)?;
            }
        }
        tx.commit().map_err(be)?;
        Ok(n as u64)
    })
    .await
}

pub(super) async fn recorded_references(cat: &SqliteCatalog, tenant: &str) -> Result<(u64, u64)> {
    let t = tenant.to_string();
    cat.run(move |c| {
        let count = |table: &str| -> Result<u64> {
            c.query_row(
                &format!("SELECT COUNT(*) FROM {table} WHERE tenant = ?1"),
                params![t],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n as u64)
            .map_err(be)
        };
        Ok((count("manifests")?, count("objects")?))
    })
    .await
}

pub(super) async fn gc_forget(cat: &SqliteCatalog, tenant: &str, keys: &[String]) -> Result<()> {
    let (t, keys) = (tenant.to_string(), keys.to_vec());
    cat.run(move |c| {
        let tx = c.transaction().map_err(be)?;
        {
            let mut s = tx
                .prepare_cached("DELETE FROM gc_condemned WHERE tenant = ?1 AND key = ?2")
                .map_err(be)?;
            for k in &keys {
                s.execute(params![t, k]).map_err(be)?;
            }
        }
        tx.commit().map_err(be)
    })
    .await
}

/// Stale manifests judged per statement.
const STALE_CHUNK: usize = 500;

pub(super) async fn gc_changes(
    cat: &SqliteCatalog,
    tenant: &str,
    grace_ms: u64,
    after_seq: i64,
    limit: usize,
) -> Result<GcChanges> {
    let t = tenant.to_string();
    let clock = cat.clock.clone();
    cat.run(move |c| {
        // One read transaction: the log, the judgements and the stale objects in one snapshot.
        let tx = c.transaction().map_err(be)?;
        // Rows are recorded by the same clock (`record_manifest`).
        let stale_before = clock.now_ms() as i64 - grace_ms as i64;
        let mut rows = vec![];
        {
            let mut s = tx.prepare_cached(&crate::gc_changes_sql()).map_err(be)?;
            let mut q = s.query(params![t, limit as i64, after_seq]).map_err(be)?;
            while let Some(r) = q.next().map_err(be)? {
                rows.push((
                    r.get::<_, i64>(0).map_err(be)?,
                    hash(r.get(1).map_err(be)?).map_err(be)?,
                    r.get::<_, Option<i64>>(2).map_err(be)?,
                    r.get::<_, i64>(3).map_err(be)? == 1,
                ));
            }
        }
        let (mut out, stale) = GcChanges::judge(rows, stale_before, after_seq, limit);
        let mut objects = vec![];
        // The stale manifests in chunks, each one statement (a JSON array of ids: SQLite has
        // no array parameters).
        for chunk in out.stale_manifests.chunks(STALE_CHUNK) {
            let ids = serde_json::to_string(&chunk.iter().map(|m| m.to_hex()).collect::<Vec<_>>())
                .map_err(|e| CatalogError::from_source("encoding ids", false, e))?;
            let mut s = tx
                .prepare_cached(&crate::gc_stale_objects_sql(
                    "IN (SELECT value FROM json_each(?2))",
                ))
                .map_err(be)?;
            let mut q = s.query(params![t, ids]).map_err(be)?;
            while let Some(r) = q.next().map_err(be)? {
                objects.push((
                    hash(r.get(0).map_err(be)?).map_err(be)?,
                    hash(r.get(1).map_err(be)?).map_err(be)?,
                    r.get::<_, i64>(2).map_err(be)?.max(0) as u64,
                    r.get::<_, i64>(3).map_err(be)?,
                ));
            }
        }
        out.take_objects(stale, objects, stale_before);
        // Once per pass (its first batch): the query walks the whole log.
        if after_seq == 0 {
            let mut s = tx.prepare_cached(&crate::gc_unrecorded_sql()).map_err(be)?;
            let mut q = s.query(params![t]).map_err(be)?;
            while let Some(r) = q.next().map_err(be)? {
                out.unrecorded
                    .push(hash(r.get(0).map_err(be)?).map_err(be)?);
            }
        }
        tx.commit().map_err(be)?;
        Ok(out)
    })
    .await
}

pub(super) async fn gc_settle(cat: &SqliteCatalog, tenant: &str, seqs: &[i64]) -> Result<()> {
    let (t, seqs) = (tenant.to_string(), seqs.to_vec());
    cat.run(move |c| {
        let tx = c.transaction().map_err(be)?;
        {
            let mut s = tx
                .prepare_cached("DELETE FROM gc_log WHERE tenant = ?1 AND seq = ?2")
                .map_err(be)?;
            for q in &seqs {
                s.execute(params![t, q]).map_err(be)?;
            }
        }
        tx.commit().map_err(be)
    })
    .await
}

pub(super) async fn gc_live(
    cat: &SqliteCatalog,
    tenant: &str,
    manifests: &[Hash],
    objects: &[Hash],
) -> Result<GcLive> {
    let (t, ms, os) = (tenant.to_string(), manifests.to_vec(), objects.to_vec());
    cat.run(move |c| {
        let tx = c.transaction().map_err(be)?;
        let mut out = GcLive::default();
        {
            let mut man = tx
                .prepare_cached(&format!("SELECT {}", crate::referenced_sql("?2")))
                .map_err(be)?;
            let mut obj = tx
                .prepare_cached(&format!(
                    "SELECT {}, (SELECT data_len FROM objects WHERE tenant = ?1 AND id = ?2)",
                    crate::object_live_sql("?2")
                ))
                .map_err(be)?;
            for m in ms {
                if man
                    .query_row(params![t, m.to_hex()], |r| r.get::<_, bool>(0))
                    .map_err(be)?
                {
                    out.manifests.push(m);
                }
            }
            for o in os {
                let (live, len) = obj
                    .query_row(params![t, o.to_hex()], |r| {
                        Ok((r.get::<_, bool>(0)?, r.get::<_, Option<i64>>(1)?))
                    })
                    .map_err(be)?;
                match (live, len) {
                    (true, _) => out.objects.push(o),
                    (false, Some(len)) => out.dead_objects.push((o, len.max(0) as u64)),
                    (false, None) => {}
                }
            }
        }
        tx.commit().map_err(be)?;
        Ok(out)
    })
    .await
}

pub(super) async fn retention_due(
    cat: &SqliteCatalog,
    tenant: &str,
    now_ms: u64,
    all: bool,
) -> Result<Vec<RetentionDue>> {
    let t = tenant.to_string();
    cat.run(move |c| {
        // The partial index named: without statistics the planner would walk the tenant's every
        // workspace by the primary key.
        let sql = if all {
            "SELECT name, head_version, retain_gen FROM workspaces WHERE tenant = ?1 ORDER BY name"
        } else {
            "SELECT name, head_version, retain_gen FROM workspaces INDEXED BY workspaces_retain_changed
             WHERE tenant = ?1 AND retain_gen <> retain_seen
             UNION SELECT name, head_version, retain_gen FROM workspaces WHERE tenant = ?1 AND retain_next_ms <= ?2
             ORDER BY name"
        };
        let mut s = c.prepare_cached(sql).map_err(be)?;
        let map = |r: &rusqlite::Row| {
            Ok(RetentionDue {
                workspace: r.get(0)?,
                head_version: r.get::<_, i64>(1)? as u64,
                generation: r.get::<_, i64>(2)? as u64,
            })
        };
        let rows = if all {
            s.query_map(params![t], map)
        } else {
            s.query_map(params![t, now_ms.min(i64::MAX as u64 - 1) as i64], map)
        }
        .map_err(be)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)
    })
    .await
}

pub(super) async fn retention_done(
    cat: &SqliteCatalog,
    tenant: &str,
    workspace: &str,
    seen: u64,
    next_ms: u64,
) -> Result<bool> {
    let (t, n) = (tenant.to_string(), workspace.to_string());
    cat.run(move |c| {
        Ok(c.execute(
            "UPDATE workspaces SET retain_seen = ?3, retain_next_ms = ?4
             WHERE tenant = ?1 AND name = ?2 AND retain_gen = ?3",
            params![t, n, seen as i64, next_ms.min(i64::MAX as u64) as i64],
        )
        .map_err(be)?
            == 1)
    })
    .await
}

pub(super) async fn compaction_candidates(
    cat: &SqliteCatalog,
    tenant: &str,
    idle_before_ms: u64,
    all: bool,
) -> Result<Vec<(String, Hash)>> {
    let t = tenant.to_string();
    cat.run(move |c| {
        let tx = c
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(be)?;
        if all {
            tx.execute(
                "UPDATE workspaces SET compact_check = 1 WHERE tenant = ?1",
                params![t],
            )
            .map_err(be)?;
        }
        tx.execute(crate::COMPACTION_SETTLE_SQL, params![t])
            .map_err(be)?;
        let out = {
            let sql = crate::COMPACTION_CANDIDATES_SQL
                .replace("{from}", "workspaces w INDEXED BY workspaces_compact_check");
            let mut s = tx.prepare_cached(&sql).map_err(be)?;
            let rows = s
                .query_map(
                    params![t, idle_before_ms.min(i64::MAX as u64) as i64],
                    |r| Ok((r.get::<_, String>(0)?, hash(r.get(1)?)?)),
                )
                .map_err(be)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(be)?
        };
        tx.commit().map_err(be)?;
        Ok(out)
    })
    .await
}

pub(super) async fn compaction_judged(
    cat: &SqliteCatalog,
    tenant: &str,
    workspace: &str,
    manifest: Hash,
) -> Result<()> {
    let (t, n) = (tenant.to_string(), workspace.to_string());
    cat.run(move |c| {
        c.execute(
            "UPDATE workspaces SET compact_judged = ?3, compact_check = 0
             WHERE tenant = ?1 AND name = ?2 AND head_manifest = ?3",
            params![t, n, manifest.to_hex()],
        )
        .map_err(be)?;
        Ok(())
    })
    .await
}
