//! The HTTP API's wire types: request bodies, error bodies and the enums they carry, shared by
//! the daemon (which derives its OpenAPI document from them), the CLI, the tests and the fuzzer.
//! This crate depends on nothing of the engine, catalog or store, so a client or a fuzz target
//! builds without them.
//!
//! Requests refuse unknown fields, so a typo is an error rather than a silent default.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A workspace's durability mode (see docs/DURABILITY.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// FLUSH returns at once; nothing is promised.
    Ephemeral,
    /// FLUSH returns when the local journal is fsync'd; uploads run in the background.
    #[default]
    Durable,
    /// FLUSH returns when the data is committed in the object store.
    Sync,
}

impl Mode {
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Ephemeral => "ephemeral",
            Mode::Durable => "durable",
            Mode::Sync => "sync",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ephemeral" => Ok(Mode::Ephemeral),
            "durable" => Ok(Mode::Durable),
            "sync" => Ok(Mode::Sync),
            _ => Err(format!(
                "unknown mode {s:?}: use ephemeral, durable or sync"
            )),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    pub name: String,
    /// The named store (from the nodes' configuration, `[stores.NAME]`) its data goes to: its
    /// own bucket and credentials. Absent: the default store. Fixed for the tenant's life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// Encrypt its objects, manifests and relay files at rest under a data key of its own,
    /// wrapped by the nodes' master key (`master_key_file`); fixed for the tenant's life.
    #[serde(default)]
    pub encrypted: bool,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantToken {
    pub tenant: String,
    /// Shown once; strata stores only its hash.
    pub token: String,
    /// What listings show and revocation names: the first 16 hex digits of its hash.
    pub id: String,
    /// Absent: the tenant's full rights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// `POST /v1/templates`: a template from the operator's import directory. Content a tenant has
/// goes in a `PUT /v1/templates/{name}` body instead; host paths are never accepted.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplate {
    pub name: String,
    /// A path relative to `IMPORT/{tenant}/` (the daemon's `--import-dir`): a directory (made
    /// into ext4) or a raw or qcow2 image.
    #[serde(default)]
    pub import: Option<String>,
    /// Disk size in bytes for a directory (derived when absent).
    #[serde(default)]
    pub size: Option<u64>,
    /// No longer accepted (a host path chosen by a tenant); kept to say so clearly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(ignore)]
    pub from_dir: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(ignore)]
    pub from_image: Option<serde_json::Value>,
}

/// `PUT /v1/templates/{name}?format=…`: what the body holds.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UploadTemplate {
    /// `tar` (a directory tree, made into ext4), `raw` or `qcow2` (a disk image).
    pub format: String,
    /// Disk size in bytes for `tar` (derived when absent).
    #[serde(default)]
    pub size: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWorkspace {
    pub name: String,
    #[serde(default)]
    pub template: Option<String>,
    /// `WS` or `WS@VERSION`.
    #[serde(default)]
    pub from: Option<String>,
    /// An empty disk of this many bytes.
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub mode: Option<Mode>,
    /// Seconds until an ephemeral workspace is deleted.
    #[serde(default)]
    pub ttl_secs: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Attached {
    pub workspace: String,
    /// NBD: the export's URI (`nbd+unix:///WS?socket=…`). vhost-user: the socket path.
    pub export: String,
    pub socket: String,
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default)]
    pub read_only: bool,
}

/// How an attached workspace is served on this node: one front-end at a time.
#[derive(Debug, Serialize, Deserialize, Default, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// NBD on a unix socket (qemu, nbd-client, libnbd; many connections).
    #[default]
    Nbd,
    /// vhost-user-blk on a unix socket: one VMM (QEMU, Cloud Hypervisor, Firecracker) at a time.
    VhostUser,
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Protocol::Nbd => "NBD",
            Protocol::VhostUser => "vhost-user",
        })
    }
}

/// `POST /v1/workspaces/{name}/attach` (the body is optional: NBD, read-write).
#[derive(Debug, Serialize, Deserialize, Default, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    #[serde(default)]
    pub protocol: Protocol,
    /// Serve the workspace read-only (every change refused by the front-end).
    #[serde(default)]
    pub read_only: bool,
    /// vhost-user: virtqueues offered (1..=8, default 2); a VMM may use fewer.
    #[serde(default)]
    pub queues: Option<u16>,
}

#[derive(Debug, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    #[serde(default)]
    pub label: Option<String>,
    /// Retention keeps this checkpoint at least this long (a labelled checkpoint without it is
    /// kept until deleted; with it, it expires after).
    #[serde(default)]
    pub keep_secs: Option<u64>,
    /// Of a mounted workspace: skip freezing its filesystem around the cut (the checkpoint
    /// is then crash-consistent, not application-consistent).
    #[serde(default)]
    pub no_freeze: bool,
    /// Return only once the checkpoint is published (in the object store: any node can serve
    /// it). Without it the reply comes once the cut is durable on this node (`state: local`).
    #[serde(default)]
    pub wait: bool,
}

/// `POST /v1/gc`: one garbage-collection pass now.
#[derive(Debug, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Report what would be expired and deleted, change nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Also list the store, to find keys the catalog does not know (a reconciliation pass;
    /// the node's periodic passes do it once a day).
    #[serde(default)]
    pub reconcile: bool,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The new workspace's name.
    pub name: String,
    #[serde(default)]
    pub version: Option<u64>,
    #[serde(default)]
    pub mode: Option<Mode>,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    pub version: u64,
    /// Return only once the rollback is published. Without it, a rollback to a version still
    /// local on this node returns as soon as it is durable here (`state: local`); a sync-mode
    /// workspace always waits.
    #[serde(default)]
    pub wait: bool,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable kind: not_found, invalid, conflict, unauthorized, forbidden,
    /// too_large, busy, unavailable, no_space, not_implemented, internal.
    pub kind: String,
    pub message: String,
    /// Whether retrying the same request may succeed.
    pub retryable: bool,
}

/// `POST /v1/relay`: a new relay stream.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateStream {
    pub name: String,
    /// Answer a PUT only once the object store holds the file (default: once on local disk).
    #[serde(default)]
    pub sync: bool,
}

/// A token that can only add files to one relay stream (hand it to a sandbox).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StreamToken {
    pub stream: String,
    pub sync: bool,
    pub token: String,
}
