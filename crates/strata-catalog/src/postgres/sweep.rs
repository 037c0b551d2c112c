//! GC's bookkeeping in PostgreSQL: condemned keys (the two-phase sweep) and the pruning of
//! recorded references.

use strata_format::Hash;

use super::sql::*;
use super::PostgresCatalog;
use crate::*;

impl PostgresCatalog {
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
}
