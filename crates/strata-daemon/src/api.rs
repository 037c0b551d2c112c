//! Response bodies that carry the engine's and the catalog's types. The request bodies, error
//! bodies and the enums they carry are `strata-api`'s (re-exported here).

use serde::{Deserialize, Serialize};
use strata_catalog::{Lease, Workspace};
use strata_engine::VolumeStats;

pub use strata_api::*;

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkspaceView {
    pub workspace: Workspace,
    pub lease: Lease,
    pub attached: bool,
    pub export: Option<String>,
    /// Present while attached on this node: includes the remote window.
    pub stats: Option<VolumeStats>,
}

/// A tenant's token as issued (shown once).
pub(crate) fn issued(info: strata_catalog::TokenInfo, token: String) -> TenantToken {
    TenantToken {
        tenant: info.tenant,
        token,
        id: info.id,
        scope: info.scope,
        expires_ms: info.expires_ms,
        label: info.label,
    }
}
