//! What a GC pass reports.

use serde::{Deserialize, Serialize};

use crate::Error;

/// What one pass found and did.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct GcReport {
    pub dry_run: bool,
    pub tenants: u64,
    /// Checkpoints expired by retention (would be, in a dry run).
    pub checkpoints_expired: u64,
    pub checkpoints_purged: u64,
    pub live_manifests: u64,
    pub live_objects: u64,
    /// Bytes of live keys in the store.
    pub live_bytes: u64,
    pub stored_keys: u64,
    pub stored_bytes: u64,
    /// Unreferenced keys (older than the grace period) and their bytes: what GC will delete.
    pub unreferenced_keys: u64,
    pub unreferenced_bytes: u64,
    /// Keys condemned by this pass (deleted by a pass at least `grace` later).
    pub condemned: u64,
    pub deleted_keys: u64,
    /// Bytes of the deleted keys: as listed in a reconciliation pass; otherwise the data
    /// length of objects the catalog recorded (manifests and keys it never knew count 0).
    pub deleted_bytes: u64,
    pub duration_ms: u64,
    /// The pass stopped early (`stop_after`).
    pub stopped: bool,
    /// Volumes compacted and the live bytes rewritten for it.
    #[serde(default)]
    pub compactions: u64,
    #[serde(default)]
    pub compacted_bytes: u64,
    /// Catalog rows (manifests, their object links, objects) deleted with their store keys.
    #[serde(default)]
    pub pruned_rows: u64,
    /// Staged files of interrupted puts swept from local object directories.
    #[serde(default)]
    pub staged_removed: u64,
    /// The pass listed the store (a reconciliation pass): only then are `stored_keys`,
    /// `stored_bytes` and `live_bytes` counted, and keys unknown to the catalog found.
    #[serde(default)]
    pub reconciled: bool,
    /// Manifests read from the store to mark their objects: only those the catalog has no
    /// record of (none unless rows were lost: every manifest is recorded when it is written).
    #[serde(default)]
    pub manifests_read: u64,
    /// Catalog changes the mark looked at (rows of the change log: manifests that lost a
    /// reference or were recorded): what an ordinary pass costs. A reconciliation marks
    /// everything instead and counts `live_manifests` and `live_objects`.
    #[serde(default)]
    pub changes: u64,
    /// Workspaces retention looked at: those whose checkpoints changed or whose next expiry
    /// came (every workspace in a reconciliation).
    #[serde(default)]
    pub retention_looked: u64,
    /// Tenants whose part of the pass failed (their bucket refused, their store is down): the
    /// pass goes on with the other tenants, and the next pass tries these again.
    #[serde(default)]
    pub failed_tenants: Vec<TenantFailure>,
}

/// A tenant a GC pass could not finish, and why.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct TenantFailure {
    pub tenant: String,
    pub error: String,
}

impl GcReport {
    pub(super) fn tenant_failed(&mut self, tenant: &str, during: &str, e: &Error) {
        tracing::warn!(tenant, during, error = %e, "GC of a tenant failed; the pass goes on with the others");
        let error = format!("{during}: {e}");
        match self.failed_tenants.iter_mut().find(|f| f.tenant == tenant) {
            Some(f) => {
                f.error.push_str("; ");
                f.error.push_str(&error);
            }
            None => self.failed_tenants.push(TenantFailure {
                tenant: tenant.to_string(),
                error,
            }),
        }
    }
}
