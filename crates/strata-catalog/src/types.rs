use serde::{Deserialize, Serialize};
use strata_format::Hash;

/// A workspace's durability mode: the API's own type (`strata-api`), stored as its name.
pub use strata_api::Mode;

/// Why a head version exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointKind {
    /// Version 1 of a workspace created from a template.
    Create,
    /// Version 1 of a workspace forked from another's checkpoint.
    Fork,
    /// Published by the background uploader or a sync-mode flush.
    Auto,
    /// Asked for by a user (usually labelled).
    Checkpoint,
    /// A new version pointing at an older version's manifest.
    Rollback,
    /// Published when a workspace was detached.
    Detach,
    /// The same data, rewritten out of sparse objects (compaction).
    Compact,
    /// Everything acknowledged so far, on a larger disk.
    Resize,
    /// Version 1 of a fork of a live workspace: the source's published base, while the fork's
    /// data since then is in its journal on the node that forked it (hard links to the
    /// source's journal), until the fork's first publish. Only that node can attach it.
    LiveFork,
}

impl CheckpointKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            CheckpointKind::Create => "create",
            CheckpointKind::Fork => "fork",
            CheckpointKind::Auto => "auto",
            CheckpointKind::Checkpoint => "checkpoint",
            CheckpointKind::Rollback => "rollback",
            CheckpointKind::Detach => "detach",
            CheckpointKind::Compact => "compact",
            CheckpointKind::Resize => "resize",
            CheckpointKind::LiveFork => "livefork",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "create" => CheckpointKind::Create,
            "fork" => CheckpointKind::Fork,
            "auto" => CheckpointKind::Auto,
            "checkpoint" => CheckpointKind::Checkpoint,
            "rollback" => CheckpointKind::Rollback,
            "detach" => CheckpointKind::Detach,
            "compact" => CheckpointKind::Compact,
            "resize" => CheckpointKind::Resize,
            "livefork" => CheckpointKind::LiveFork,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Template {
    pub tenant: String,
    pub name: String,
    /// The manifest's content hash (BLAKE3, 64 hex digits).
    #[schema(value_type = String)]
    pub manifest: Hash,
    pub disk_size: u64,
    pub stored_bytes: u64,
    pub created_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewWorkspace {
    pub tenant: String,
    pub name: String,
    pub mode: Mode,
    pub disk_size: u64,
    pub manifest: Hash,
    /// Where it came from: `template:NAME` or `ws:NAME@VERSION`.
    pub source: String,
    pub kind: CheckpointKind,
    pub ttl_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Workspace {
    pub tenant: String,
    pub name: String,
    pub mode: Mode,
    pub disk_size: u64,
    pub head_version: u64,
    /// The head's manifest (BLAKE3, 64 hex digits).
    #[schema(value_type = String)]
    pub head_manifest: Hash,
    /// Where it came from: `template:NAME`, `ws:NAME@VERSION` or `empty`.
    pub source: String,
    pub created_ms: u64,
    pub ttl_ms: Option<u64>,
}

/// What a head move records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewCheckpoint {
    pub manifest: Hash,
    /// The manifest's disk size: the workspace's size from this version on (never smaller
    /// than the current one: a disk grows, it does not shrink).
    pub disk_size: u64,
    pub label: Option<String>,
    pub kind: CheckpointKind,
    /// Bytes uploaded to publish this version.
    pub bytes: u64,
    /// Journal sequence number of the cut: every write at or below it is in `manifest`.
    pub cut_seq: u64,
    /// Identity of the local journal that produced it (restart on the same node uses it).
    pub journal_id: Option<String>,
    /// Retention: keep at least until then (labelled checkpoints expire only by this).
    pub keep_until_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Checkpoint {
    pub workspace: String,
    pub version: u64,
    #[schema(value_type = String)]
    pub manifest: Hash,
    pub label: Option<String>,
    pub kind: CheckpointKind,
    pub created_ms: u64,
    pub bytes: u64,
    pub cut_seq: u64,
    pub journal_id: Option<String>,
    pub epoch: u64,
    /// Retention: kept at least until then; a labelled checkpoint without it is kept forever.
    #[serde(default)]
    pub keep_until_ms: Option<u64>,
}

/// Proof of holding a workspace's lease at one epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    pub node: String,
    pub epoch: u64,
    pub expires_ms: u64,
}

/// One held lease to extend, in a node's batch ([`crate::Catalog::renew_leases`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRenewal {
    pub tenant: String,
    pub workspace: String,
    pub lease: LeaseGrant,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Lease {
    pub holder: Option<String>,
    pub epoch: u64,
    pub expires_ms: u64,
}

/// What a node reports about itself (heartbeat) for the `nodes` view.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    /// The node's API address, if it serves one.
    pub url: Option<String>,
    /// When the catalog last heard from it (the catalog's clock; set by the backend).
    #[serde(default)]
    pub seen_ms: u64,
    /// How long ago that was, by the catalog's clock at the time of listing.
    #[serde(default)]
    pub seen_ago_ms: u64,
    pub attached: Vec<AttachedStatus>,
}

/// One workspace a node serves, as of its last report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedStatus {
    pub tenant: String,
    pub workspace: String,
    pub mode: Mode,
    pub epoch: u64,
    pub head_version: u64,
    /// Bytes acknowledged locally but not yet in a published head (lost if the node is lost).
    pub remote_window_bytes: u64,
    /// Age of the oldest write in that window.
    pub remote_window_age_ms: u64,
}

/// A relay stream: a named, append-only set of files a sandbox pushes off the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStream {
    pub tenant: String,
    pub name: String,
    /// `true`: a PUT is answered only after the object store holds the file.
    pub sync: bool,
    pub created_ms: u64,
}

/// A token to record. The catalog keeps its hash, never the token.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NewToken {
    pub tenant: String,
    /// BLAKE3 of the token, hex.
    pub hash: String,
    /// `None`: the tenant's full rights; else a scope such as `read` or `relay:STREAM`.
    pub scope: Option<String>,
    /// Refused from this instant on (milliseconds since the epoch).
    pub expires_ms: Option<u64>,
    pub label: Option<String>,
}

/// Who a token speaks for and what is known of it. `id` is the first 16 hex digits of its
/// hash: what listings show and what revocation names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenInfo {
    pub id: String,
    pub tenant: String,
    /// `None`: the tenant's full rights; else a scope such as `read` or `relay:STREAM`.
    pub scope: Option<String>,
    pub created_ms: u64,
    pub expires_ms: Option<u64>,
    pub revoked_ms: Option<u64>,
    pub label: Option<String>,
}

/// The public id of a token hash.
pub fn token_id(hash: &str) -> String {
    hash.chars().take(16).collect()
}

/// A tenant as the catalog knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantInfo {
    pub name: String,
    pub created_ms: u64,
    /// Set while the tenant is being deleted: its tokens no longer work and its workspaces
    /// cannot be attached.
    pub deleting_ms: Option<u64>,
    pub quotas: Quotas,
    /// The named store its data is placed in (its own bucket and credentials, configured on
    /// every node); absent: the default store. Fixed when the tenant is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// Its objects, manifests and relay files are encrypted under a data key of its own
    /// (wrapped by the nodes' master key, kept in the catalog only).
    #[serde(default)]
    pub encrypted: bool,
}

/// Where a tenant's data goes and how it is sealed (see `Catalog::tenant_placement`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantPlacement {
    pub store: Option<String>,
    pub data_key: Option<String>,
    /// The tenant row's creation time: tells a tenant from a later one of the same name.
    pub created_ms: u64,
}

/// A tenant's limits, set by the admin; an absent field is no limit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Workspaces it may have (checked when one is created or forked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspaces: Option<u64>,
    /// The sum of its workspaces' disk sizes, bytes (checked at create, fork and resize).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// Its workspaces attached at once on one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_per_node: Option<u64>,
    /// Journal bytes its attached workspaces hold on one node's disk: a write past it gets
    /// ENOSPC (that write only, for that tenant only) until uploads free room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_journal_bytes: Option<u64>,
    /// Live bytes of its data in the object store (deduplicated, as usage counts them): while
    /// past it, creates, forks, checkpoints, template builds and relay files are refused.
    /// Guest writes, and the publishes that make them durable, never are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_bytes: Option<u64>,
    /// Relay bytes waiting on one node for upload: a relay PUT that would pass it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_bytes: Option<u64>,
}

impl Quotas {
    /// The stored form (`NULL` for no limits).
    pub fn to_column(&self) -> Option<String> {
        (self != &Quotas::default()).then(|| serde_json::to_string(self).expect("plain struct"))
    }
    /// From the stored form; a row written by a newer version with limits this one does not
    /// know is read with the ones it knows.
    pub fn from_column(s: Option<&str>) -> Quotas {
        #[derive(Deserialize)]
        struct Lenient {
            workspaces: Option<u64>,
            disk_bytes: Option<u64>,
            attached_per_node: Option<u64>,
            local_journal_bytes: Option<u64>,
            live_bytes: Option<u64>,
            relay_bytes: Option<u64>,
        }
        s.and_then(|s| serde_json::from_str::<Lenient>(s).ok())
            .map(|l| Quotas {
                workspaces: l.workspaces,
                disk_bytes: l.disk_bytes,
                attached_per_node: l.attached_per_node,
                local_journal_bytes: l.local_journal_bytes,
                live_bytes: l.live_bytes,
                relay_bytes: l.relay_bytes,
            })
            .unwrap_or_default()
    }
}

/// What a tenant's live data takes in the object store, from the catalog's reference graph
/// (workspace heads, checkpoints retention keeps, templates → manifests → objects), never by
/// listing the bucket. Bytes are the objects' data bytes (before their frame tables).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StoreUsage {
    /// Distinct live objects of the tenant: a block shared by forks counts once.
    pub live_objects: u64,
    pub live_bytes: u64,
    /// Per workspace: what its head and retained checkpoints reference (shared objects count
    /// in each workspace that references them).
    pub workspaces: Vec<WorkspaceStoreUsage>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkspaceStoreUsage {
    pub workspace: String,
    pub live_objects: u64,
    pub live_bytes: u64,
}

/// A tenant's metered storage: live bytes integrated over time, for billing. Each reading
/// adds the previous reading's live bytes times the time since it (catalog clock), so any
/// node may meter at any moment and no interval is counted twice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Meter {
    /// Live bytes at the last reading.
    pub live_bytes: u64,
    /// Byte-seconds since metering began.
    pub byte_seconds: f64,
    pub since_ms: u64,
    pub last_ms: u64,
}

impl GcMark {
    /// Takes one row of `GC_MARK_SQL`: its kind (0 to 3), id and third column.
    pub(crate) fn take_row(&mut self, kind: i64, id: Hash, n: i64) {
        match kind {
            0 => {
                self.manifests.push(id);
                if n != 1 {
                    self.unrecorded.push(id);
                }
            }
            1 => self.objects.push(id),
            2 => self.stale_manifests.push(id),
            _ => self.stale_objects.push((id, n.max(0) as u64)),
        }
    }
}

/// What a GC pass marks live from the catalog alone ([`crate::Catalog::gc_mark`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcMark {
    /// Every manifest the tenant references (heads, checkpoints, expired ones within the grace
    /// period, templates).
    pub manifests: Vec<Hash>,
    /// Those of them the catalog has no record of: their objects are not in `objects`.
    pub unrecorded: Vec<Hash>,
    /// The distinct objects the recorded manifests reference.
    pub objects: Vec<Hash>,
    /// Recorded manifests nothing above references, recorded more than the grace period ago:
    /// what an incremental sweep condemns (no listing of the store needed).
    pub stale_manifests: Vec<Hash>,
    /// Recorded objects no recorded, referenced manifest links, recorded more than the grace
    /// period ago, with their data length. (An unrecorded manifest may still reference one:
    /// the caller filters by what it read.)
    pub stale_objects: Vec<(Hash, u64)>,
}

/// The incremental mark ([`crate::Catalog::gc_changes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcChanges {
    /// Log rows read.
    pub looked: u64,
    /// The read had as many rows as its limit: more may follow `last_seq`.
    pub more: bool,
    /// The highest sequence number read (the next read starts after it), or the `after` asked.
    pub last_seq: i64,
    /// Log rows settled by this look: to be removed once the stale ones are condemned. Rows
    /// of manifests that are unreferenced but not stale yet (or whose unreferenced objects are
    /// not all stale yet), and one row per referenced manifest without a record, are left for
    /// the next look.
    pub settled: Vec<i64>,
    /// Every referenced manifest the catalog has no record of that the log names, whatever
    /// the limit (their objects are the caller's to read from the store and keep).
    pub unrecorded: Vec<Hash>,
    /// Unreferenced manifests recorded more than the grace period ago.
    pub stale_manifests: Vec<Hash>,
    /// Their objects recorded more than the grace period ago that no referenced manifest
    /// links, each once, with its data length.
    pub stale_objects: Vec<(Hash, u64)>,
}

/// A workspace retention should look at ([`crate::Catalog::retention_due`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetentionDue {
    pub workspace: String,
    pub head_version: u64,
    /// Its checkpoints' generation: given back to [`crate::Catalog::retention_done`].
    pub generation: u64,
}

impl GcChanges {
    /// Judges the log rows [`crate::gc_changes_sql`] returned (`(seq, manifest, recorded at,
    /// referenced)`, `limit` asked for, after `after`): a referenced manifest with a record
    /// settles its rows; one without keeps one row (the caller lists those separately); an
    /// unreferenced one without a record settles (its key, if any, is a reconciliation's to
    /// find); an unreferenced one recorded before `stale_before` is stale, its rows returned
    /// apart (they settle once its objects are judged: [`GcChanges::take_objects`]); one
    /// recorded since stays.
    pub(crate) fn judge(
        rows: Vec<(i64, Hash, Option<i64>, bool)>,
        stale_before: i64,
        after: i64,
        limit: usize,
    ) -> (GcChanges, std::collections::HashMap<Hash, Vec<i64>>) {
        let mut out = GcChanges {
            looked: rows.len() as u64,
            more: rows.len() >= limit,
            last_seq: rows.iter().map(|r| r.0).max().unwrap_or(after),
            ..Default::default()
        };
        let mut stale: std::collections::HashMap<Hash, Vec<i64>> = Default::default();
        let mut seen = std::collections::HashSet::new();
        for (seq, m, recorded, referenced) in rows {
            let first = seen.insert(m);
            match (referenced, recorded) {
                (true, Some(_)) | (false, None) => out.settled.push(seq),
                // One row stays to look at it again; its duplicates go.
                (true, None) if first => {}
                (true, None) => out.settled.push(seq),
                (false, Some(at)) if at < stale_before => {
                    if first {
                        out.stale_manifests.push(m);
                    }
                    stale.entry(m).or_default().push(seq);
                }
                (false, Some(_)) => {}
            }
        }
        (out, stale)
    }

    /// Takes the unreferenced objects of the stale manifests (`(manifest, object, data_len,
    /// recorded at)`): those recorded before `stale_before` are stale; a manifest with one
    /// recorded since is not stale yet: it keeps its rows, to be judged again (its objects
    /// too) by a later look.
    pub(crate) fn take_objects(
        &mut self,
        mut stale: std::collections::HashMap<Hash, Vec<i64>>,
        objects: Vec<(Hash, Hash, u64, i64)>,
        stale_before: i64,
    ) {
        let mut young = std::collections::HashSet::new();
        let mut old = vec![];
        for (m, o, len, at) in objects {
            if at >= stale_before {
                young.insert(m);
            } else {
                old.push((m, o, len));
            }
        }
        // A manifest with a young object is left whole for a later look: neither it nor its
        // objects are condemned now (its links must stay until the young object is judged).
        let mut seen = std::collections::HashSet::new();
        for (m, o, len) in old {
            if !young.contains(&m) && seen.insert(o) {
                self.stale_objects.push((o, len));
            }
        }
        self.stale_manifests.retain(|m| !young.contains(m));
        stale.retain(|m, _| !young.contains(m));
        self.settled.extend(stale.into_values().flatten());
    }
}

/// The re-mark of condemned keys ([`crate::Catalog::gc_live`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcLive {
    /// The manifests asked about that are referenced now.
    pub manifests: Vec<Hash>,
    /// The objects asked about that a referenced manifest links now.
    pub objects: Vec<Hash>,
    /// The others the catalog has a record of, with their data length.
    pub dead_objects: Vec<(Hash, u64)>,
}
