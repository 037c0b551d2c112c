//! GC's bookkeeping in PostgreSQL: the marks (full and from the change log), condemned keys
//! (the two-phase sweep), the re-mark, retention and compaction bookkeeping, and the pruning
//! of recorded references.

use strata_format::Hash;

use super::sql::*;
use super::PostgresCatalog;
use crate::*;

impl PostgresCatalog {
    /// Every manifest the tenant references (see the trait's `gc_references`).
    pub(super) async fn references(&self, tenant: &str, grace_ms: u64) -> Result<Vec<Hash>> {
        let c = self.conn().await?;
        c.query(
            &format!(
                "SELECT head_manifest FROM workspaces WHERE tenant = $1
                 UNION SELECT manifest FROM checkpoints WHERE tenant = $1 AND (expired_ms IS NULL OR expired_ms >= ({SERVER_NOW}) - $2)
                 UNION SELECT manifest FROM templates WHERE tenant = $1"
            ),
            &[&tenant, &(grace_ms as i64)],
        )
        .await
        .map_err(be)?
        .iter()
        .map(|r| hash(r.get(0)))
        .collect()
    }

    /// A reconciliation's full mark (see the trait's `gc_mark`).
    pub(super) async fn full_mark(&self, tenant: &str, grace_ms: u64) -> Result<GcMark> {
        let c = self.conn().await?;
        // Expiry is on the server's clock; records carry the recording node's (`record_manifest`).
        let sql = crate::GC_MARK_SQL
            .replace("?1", "$1")
            .replace("?2", &format!("({SERVER_NOW}) - $2"))
            .replace("?3", "$3");
        let stale_before = now_ms() as i64 - grace_ms as i64;
        let mut mark = GcMark::default();
        for r in c
            .query(&sql, &[&tenant, &(grace_ms as i64), &stale_before])
            .await
            .map_err(be)?
        {
            // The third column is a BIGINT (the union with `data_len`).
            let (kind, id, n): (i32, &str, i64) = (r.get(0), r.get(1), r.get(2));
            mark.take_row(kind.into(), hash(id)?, n);
        }
        Ok(mark)
    }

    pub(super) async fn condemn(&self, tenant: &str, keys: &[String]) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &format!(
                "INSERT INTO gc_condemned (tenant, key, condemned_ms)
                 SELECT $1, k, ({SERVER_NOW}) FROM unnest($2::TEXT[]) AS u(k)
                 ON CONFLICT DO NOTHING"
            ),
            &[&tenant, &keys],
        )
        .await
        .map_err(be)?;
        Ok(())
    }

    pub(super) async fn condemned(&self, tenant: &str) -> Result<Vec<(String, u64)>> {
        let c = self.conn().await?;
        Ok(c
            .query(
                &format!(
                    "SELECT key, GREATEST(({SERVER_NOW}) - condemned_ms, 0) FROM gc_condemned WHERE tenant = $1 ORDER BY key"
                ),
                &[&tenant],
            )
            .await
            .map_err(be)?
            .iter()
            .map(|r| (r.get(0), u(r, 1)))
            .collect())
    }

    /// The rows of manifests and objects whose keys GC deletes (see the trait).
    pub(super) async fn prune(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<u64> {
        let hex = |hs: &[Hash]| hs.iter().map(|h| h.to_hex()).collect::<Vec<String>>();
        let (ms, os) = (hex(manifests), hex(objects));
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        let mut n = 0;
        for (sql, ids) in [
            (
                "DELETE FROM manifest_objects WHERE tenant = $1 AND manifest = ANY($2)",
                &ms,
            ),
            (
                "DELETE FROM manifests WHERE tenant = $1 AND id = ANY($2)",
                &ms,
            ),
            (
                "DELETE FROM objects WHERE tenant = $1 AND id = ANY($2)",
                &os,
            ),
        ] {
            n += tx.execute(sql, &[&tenant, ids]).await.map_err(be)?;
        }
        tx.commit().await.map_err(be)?;
        Ok(n)
    }

    pub(super) async fn recorded(&self, tenant: &str) -> Result<(u64, u64)> {
        let c = self.conn().await?;
        let r = c
            .query_one(
                "SELECT (SELECT COUNT(*) FROM manifests WHERE tenant = $1), (SELECT COUNT(*) FROM objects WHERE tenant = $1)",
                &[&tenant],
            )
            .await
            .map_err(be)?;
        Ok((u(&r, 0), u(&r, 1)))
    }

    pub(super) async fn forget(&self, tenant: &str, keys: &[String]) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            "DELETE FROM gc_condemned WHERE tenant = $1 AND key = ANY($2)",
            &[&tenant, &keys],
        )
        .await
        .map_err(be)?;
        Ok(())
    }

    /// The incremental mark (see the trait): the log's rows and their judgement in one
    /// statement, then the stale manifests' objects in a second, then the unrecorded
    /// references (a reference made between them only keeps more; a reference lost is judged
    /// by a later look; the sweep re-marks before it deletes).
    pub(super) async fn changes(
        &self,
        tenant: &str,
        grace_ms: u64,
        after_seq: i64,
        limit: usize,
    ) -> Result<GcChanges> {
        let c = self.conn().await?;
        // Records carry the recording node's clock (`record_manifest`).
        let stale_before = now_ms() as i64 - grace_ms as i64;
        let rows = c
            .query(
                &dollars(&crate::gc_changes_sql()),
                &[&tenant, &(limit as i64), &after_seq],
            )
            .await
            .map_err(be)?;
        let mut judged = vec![];
        for r in &rows {
            let referenced: i32 = r.get(3);
            judged.push((
                r.get::<_, i64>(0),
                hash(r.get(1))?,
                r.get::<_, Option<i64>>(2),
                referenced == 1,
            ));
        }
        let (mut out, stale) = GcChanges::judge(judged, stale_before, after_seq, limit);
        let mut objects = vec![];
        for chunk in out.stale_manifests.chunks(500) {
            let ms: Vec<String> = chunk.iter().map(|h| h.to_hex()).collect();
            for r in c
                .query(
                    &dollars(&crate::gc_stale_objects_sql("= ANY(?2)")),
                    &[&tenant, &ms],
                )
                .await
                .map_err(be)?
            {
                objects.push((
                    hash(r.get(0))?,
                    hash(r.get(1))?,
                    r.get::<_, i64>(2).max(0) as u64,
                    r.get::<_, i64>(3),
                ));
            }
        }
        out.take_objects(stale, objects, stale_before);
        // Once per pass (its first batch): the query walks the whole log.
        if after_seq == 0 {
            for r in c
                .query(&dollars(&crate::gc_unrecorded_sql()), &[&tenant])
                .await
                .map_err(be)?
            {
                out.unrecorded.push(hash(r.get(0))?);
            }
        }
        Ok(out)
    }

    pub(super) async fn settle(&self, tenant: &str, seqs: &[i64]) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            "DELETE FROM gc_log WHERE tenant = $1 AND seq = ANY($2)",
            &[&tenant, &seqs],
        )
        .await
        .map_err(be)?;
        Ok(())
    }

    pub(super) async fn live(
        &self,
        tenant: &str,
        manifests: &[Hash],
        objects: &[Hash],
    ) -> Result<GcLive> {
        let hex = |hs: &[Hash]| hs.iter().map(|h| h.to_hex()).collect::<Vec<String>>();
        let (ms, os) = (hex(manifests), hex(objects));
        let c = self.conn().await?;
        let mut out = GcLive::default();
        // In chunks: judging an object walks its links to a referenced one, and a statement
        // must end well inside the catalog's statement timeout.
        for ms in ms.chunks(1000) {
            let sql = dollars(&format!(
                "SELECT u.k FROM unnest(?2::TEXT[]) AS u(k) WHERE {}",
                crate::referenced_sql("u.k")
            ));
            for r in c.query(&sql, &[&tenant, &ms]).await.map_err(be)? {
                out.manifests.push(hash(r.get(0))?);
            }
        }
        for os in os.chunks(500) {
            let sql = dollars(&format!(
                "SELECT u.k, {}, o.data_len FROM unnest(?2::TEXT[]) AS u(k) \
                 LEFT JOIN objects o ON o.tenant = ?1 AND o.id = u.k",
                crate::object_live_sql("u.k")
            ));
            for r in c.query(&sql, &[&tenant, &os]).await.map_err(be)? {
                let id = hash(r.get(0))?;
                match (r.get::<_, bool>(1), r.get::<_, Option<i64>>(2)) {
                    (true, _) => out.objects.push(id),
                    (false, Some(len)) => out.dead_objects.push((id, len.max(0) as u64)),
                    (false, None) => {}
                }
            }
        }
        Ok(out)
    }

    pub(super) async fn due_for_retention(
        &self,
        tenant: &str,
        now_ms: u64,
        all: bool,
    ) -> Result<Vec<RetentionDue>> {
        let mut c = self.conn().await?;
        let cols = "name, head_version, retain_gen";
        let tx = c.transaction().await.map_err(be)?;
        let rows = if all {
            tx.query(
                &format!("SELECT {cols} FROM workspaces WHERE tenant = $1 ORDER BY name"),
                &[&tenant],
            )
            .await
        } else {
            // The partial and range indexes, whatever the statistics say: right after a bulk
            // change (the first pass over a tenant, say) they describe rows that have since
            // been settled, and a sequential scan would walk every workspace.
            tx.batch_execute("SET LOCAL enable_seqscan = off")
                .await
                .map_err(be)?;
            tx.query(
                &format!(
                    "SELECT {cols} FROM workspaces WHERE tenant = $1 AND retain_gen <> retain_seen
                     UNION SELECT {cols} FROM workspaces WHERE tenant = $1 AND retain_next_ms <= $2
                     ORDER BY name"
                ),
                &[&tenant, &(now_ms.min(i64::MAX as u64 - 1) as i64)],
            )
            .await
        }
        .map_err(be)?;
        tx.commit().await.map_err(be)?;
        Ok(rows
            .iter()
            .map(|r| RetentionDue {
                workspace: r.get(0),
                head_version: u(r, 1),
                generation: u(r, 2),
            })
            .collect())
    }

    pub(super) async fn retention_seen(
        &self,
        tenant: &str,
        workspace: &str,
        seen: u64,
        next_ms: u64,
    ) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                "UPDATE workspaces SET retain_seen = $3, retain_next_ms = $4
                 WHERE tenant = $1 AND name = $2 AND retain_gen = $3",
                &[
                    &tenant,
                    &workspace,
                    &(seen as i64),
                    &(next_ms.min(i64::MAX as u64) as i64),
                ],
            )
            .await
            .map_err(be)?;
        Ok(n == 1)
    }

    pub(super) async fn candidates(
        &self,
        tenant: &str,
        idle_before_ms: u64,
        all: bool,
    ) -> Result<Vec<(String, Hash)>> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(be)?;
        if all {
            tx.execute(
                "UPDATE workspaces SET compact_check = 1 WHERE tenant = $1",
                &[&tenant],
            )
            .await
            .map_err(be)?;
        } else {
            // The partial index, whatever stale statistics say (see `due_for_retention`).
            tx.batch_execute("SET LOCAL enable_seqscan = off")
                .await
                .map_err(be)?;
        }
        tx.execute(&dollars(crate::COMPACTION_SETTLE_SQL), &[&tenant])
            .await
            .map_err(be)?;
        let out = tx
            .query(
                &dollars(&crate::COMPACTION_CANDIDATES_SQL.replace("{from}", "workspaces w")),
                &[&tenant, &(idle_before_ms.min(i64::MAX as u64) as i64)],
            )
            .await
            .map_err(be)?
            .iter()
            .map(|r| Ok((r.get(0), hash(r.get(1))?)))
            .collect::<Result<Vec<_>>>()?;
        tx.commit().await.map_err(be)?;
        Ok(out)
    }

    pub(super) async fn judged(&self, tenant: &str, workspace: &str, manifest: Hash) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            "UPDATE workspaces SET compact_judged = $3, compact_check = 0
             WHERE tenant = $1 AND name = $2 AND head_manifest = $3",
            &[&tenant, &workspace, &manifest.to_hex()],
        )
        .await
        .map_err(be)?;
        Ok(())
    }
}

/// The shared SQL's `?N` placeholders as PostgreSQL's `$N`.
fn dollars(sql: &str) -> String {
    let mut out = sql.to_string();
    for n in (1..=9).rev() {
        out = out.replace(&format!("?{n}"), &format!("${n}"));
    }
    out
}
