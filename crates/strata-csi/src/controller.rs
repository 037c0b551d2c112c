//! The Controller service: volumes are workspaces, created from a template, an empty disk, a
//! snapshot (a fork of that checkpoint) or another volume (a fork of its current state, cut
//! with its filesystem frozen if it is mounted); a snapshot is a labelled checkpoint, kept
//! until it is deleted. Every call is idempotent by name: the same request again returns the
//! same volume or snapshot; the same name with another source is `ALREADY_EXISTS`.

use std::collections::HashMap;

use serde_json::{json, Value};
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::pb::{self, controller_service_capability, volume_capability, volume_content_source};
use crate::{
    invalid, is_snapshot, parse_snapshot_id, required, snapshot_label, workspace_for_name,
};

/// The size of a volume whose request names none (1 GiB).
const DEFAULT_SIZE: u64 = 1 << 30;
const BLOCK: u64 = 4096;

pub struct Controller {
    daemon: Daemon,
}

impl Controller {
    pub fn new(daemon: Daemon) -> Controller {
        Controller { daemon }
    }
}

/// Single-node access only (the workspace's lease admits one writer, on one node).
pub(crate) fn check_access_mode(c: &pb::VolumeCapability) -> Result<(), Status> {
    use volume_capability::access_mode::Mode;
    let mode = c
        .access_mode
        .as_ref()
        .ok_or_else(|| invalid("volume_capability.access_mode is required"))?
        .mode;
    match Mode::try_from(mode) {
        Ok(Mode::SingleNodeWriter | Mode::SingleNodeReaderOnly | Mode::SingleNodeSingleWriter) => {
            Ok(())
        }
        Ok(m) => Err(invalid(format!(
            "access mode {}: a strata volume is used on one node at a time",
            m.as_str_name()
        ))),
        Err(_) => Err(invalid(format!("access mode {mode} is unknown"))),
    }
}

/// Why these capabilities cannot be offered, if they cannot.
fn unsupported(caps: &[pb::VolumeCapability]) -> Option<String> {
    if caps.is_empty() {
        return Some("volume_capabilities is required".into());
    }
    caps.iter()
        .find_map(|c| check_capability(c).err())
        .map(|e| e.message().to_string())
}

/// A mounted filesystem (ext4, the only one) in a single-node access mode; block access is
/// not offered.
pub(crate) fn check_capability(c: &pb::VolumeCapability) -> Result<(), Status> {
    match &c.access_type {
        Some(volume_capability::AccessType::Mount(m))
            if m.fs_type.is_empty() || m.fs_type == "ext4" => {}
        Some(volume_capability::AccessType::Mount(m)) => {
            return Err(invalid(format!(
                "fs_type {:?}: only ext4 is offered",
                m.fs_type
            )))
        }
        Some(volume_capability::AccessType::Block(_)) => {
            return Err(invalid("block access is not offered (mount access only)"))
        }
        None => return Err(invalid("volume_capability.access_type is required")),
    }
    check_access_mode(c)
}

/// How a workspace's `source` reads when it was made as asked (idempotency by name).
enum Origin {
    Is(String),
    /// A fork of the volume's current state: `ws:SRC@` and whichever version was cut.
    Under(String),
}

impl Origin {
    fn matches(&self, source: &str) -> bool {
        match self {
            Origin::Is(s) => source == s,
            Origin::Under(p) => source.starts_with(p.as_str()),
        }
    }
}

fn u64_of(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn timestamp(ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

impl Controller {
    async fn create_volume(
        &self,
        req: pb::CreateVolumeRequest,
    ) -> Result<pb::CreateVolumeResponse, Status> {
        let name = required("name", &req.name)?;
        if let Some(why) = unsupported(&req.volume_capabilities) {
            return Err(invalid(why));
        }
        let (required_bytes, limit) = crate::capacity_range(req.capacity_range.as_ref())?;
        let mut template = None;
        let mut mode = None;
        for (k, v) in &req.parameters {
            match k.as_str() {
                "template" => template = Some(v.clone()),
                "mode" => mode = Some(v.clone()),
                k if k.starts_with("csi.storage.k8s.io/") => {}
                k => {
                    return Err(invalid(format!(
                        "unknown parameter {k:?} (known: template, mode)"
                    )))
                }
            }
        }
        let ws = workspace_for_name(name);
        let source = req
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.clone());
        // What the workspace is made from (created, or forked from a volume), how its `source`
        // field reads once it is, and its disk size.
        let (fork_of, mut body, origin, size) = match &source {
            Some(volume_content_source::Type::Snapshot(s)) => {
                let (src, v) = parse_snapshot_id(&s.snapshot_id)
                    .ok_or_else(|| Status::not_found(format!("no snapshot {:?}", s.snapshot_id)))?;
                self.snapshot(&src, v)
                    .await?
                    .ok_or_else(|| Status::not_found(format!("no snapshot {:?}", s.snapshot_id)))?;
                let want = format!("ws:{src}@{v}");
                // The snapshot's own size is known once the volume is made (checked then).
                (
                    None,
                    json!({ "name": ws, "from": format!("{src}@{v}") }),
                    Origin::Is(want),
                    0,
                )
            }
            Some(volume_content_source::Type::Volume(s)) => {
                let src = crate::workspace_of_id(&s.volume_id)?;
                let size = self.disk_size(&src).await?;
                // Forked through the fork call, which cuts the current state (with the
                // filesystem frozen if it is mounted here), not the last checkpoint.
                let prefix = format!("ws:{src}@");
                (
                    Some(src),
                    json!({ "name": ws }),
                    Origin::Under(prefix),
                    size,
                )
            }
            None => match &template {
                Some(t) => {
                    let want = format!("template:{t}");
                    strata_format::name::validate("template name", t)
                        .map_err(|e| invalid(format!("template {t:?}: {e}")))?;
                    let tpl = self
                        .daemon
                        .template(t)
                        .await?
                        .ok_or_else(|| Status::not_found(format!("no template {t:?}")))?;
                    (
                        None,
                        json!({ "name": ws, "template": t }),
                        Origin::Is(want),
                        u64_of(&tpl, "disk_size"),
                    )
                }
                None => {
                    let size = if required_bytes > 0 {
                        required_bytes.div_ceil(BLOCK) * BLOCK
                    } else if limit > 0 {
                        limit.min(DEFAULT_SIZE) / BLOCK * BLOCK
                    } else {
                        DEFAULT_SIZE
                    };
                    if size == 0 {
                        return Err(Status::out_of_range("limit_bytes is under one block"));
                    }
                    (
                        None,
                        json!({ "name": ws, "size": size }),
                        Origin::Is("empty".into()),
                        size,
                    )
                }
            },
        };
        if source.is_some() && template.is_some() {
            return Err(invalid(
                "a volume from a snapshot or a volume takes no template",
            ));
        }
        if let Some(m) = &mode {
            body["mode"] = json!(m);
        }
        // A source smaller than asked for is grown once made; one larger than the limit is
        // out of range (a disk never shrinks).
        let in_range = |size: u64| limit == 0 || size <= limit;
        if !in_range(size) {
            return Err(Status::out_of_range(format!(
                "the volume's disk would be {size} bytes, over the limit of {limit} (a disk never shrinks)"
            )));
        }
        let made = match &fork_of {
            Some(src) => self.daemon.fork(src, body).await,
            None => self.daemon.create_workspace(body).await,
        };
        let w = match made {
            Ok(w) => {
                if !in_range(u64_of(&w, "disk_size")) {
                    // From a snapshot larger than the limit: undone, nothing left behind.
                    self.daemon.delete_workspace(&ws).await?;
                    return Err(Status::out_of_range(format!(
                        "the snapshot's disk is {} bytes, over the limit of {limit} (a disk never shrinks)",
                        w["disk_size"]
                    )));
                }
                w
            }
            Err(f) if f.is_conflict() => {
                // The same name again: the same volume if it was made from the same source.
                let v =
                    self.daemon.workspace(&ws).await?.ok_or_else(|| {
                        Status::aborted("the volume vanished while being created")
                    })?;
                let w = v["workspace"].clone();
                if !origin.matches(w["source"].as_str().unwrap_or("")) {
                    return Err(Status::already_exists(format!(
                        "volume {name:?} exists with another source ({})",
                        w["source"]
                    )));
                }
                // An empty disk is made at its size; only a volume made from a smaller
                // source may still be short of it (the grow below finishes it).
                let size = u64_of(&w, "disk_size");
                let sourced = source.is_some() || template.is_some();
                if sourced && !in_range(size) && matches!(&origin, Origin::Is(_)) {
                    // Made from a source larger than the limit (a call that stopped before
                    // undoing it, or one asking another limit): not this volume either.
                    return Err(Status::out_of_range(format!(
                        "volume {name:?} is {size} bytes, over the limit of {limit}"
                    )));
                }
                if !in_range(size) || (!sourced && size < required_bytes) {
                    return Err(Status::already_exists(format!(
                        "volume {name:?} exists with another size ({} bytes)",
                        w["disk_size"]
                    )));
                }
                w
            }
            Err(f) => return Err(f.into()),
        };
        let mut size = u64_of(&w, "disk_size");
        if size < required_bytes {
            // Made (now, or by an earlier attempt that stopped here) from a smaller source.
            let want = crate::expanded_size((required_bytes, limit), size)?;
            size = u64_of(&self.daemon.resize(&ws, want).await?, "disk_size");
        }
        Ok(pb::CreateVolumeResponse {
            volume: Some(pb::Volume {
                capacity_bytes: size as i64,
                volume_id: ws,
                volume_context: HashMap::new(),
                content_source: req.volume_content_source.clone(),
                accessible_topology: vec![],
            }),
        })
    }

    /// Grows the volume's disk. Attached on no node, or on the node of this controller's
    /// daemon, it grows here; attached on another node (its lease is held there), the node's
    /// NodeExpandVolume grows it, disk and filesystem, where it is mounted. Either way the
    /// node is asked to grow the filesystem.
    async fn expand_volume(
        &self,
        req: pb::ControllerExpandVolumeRequest,
    ) -> Result<pb::ControllerExpandVolumeResponse, Status> {
        let ws = crate::workspace_of_id(required("volume_id", &req.volume_id)?)?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| invalid("capacity_range is required"))?;
        if let Some(c) = &req.volume_capability {
            check_capability(c)?;
        }
        let want = crate::expanded_size(
            crate::capacity_range(Some(range))?,
            self.disk_size(&ws).await?,
        )?;
        let capacity = match self.daemon.resize(&ws, want).await {
            Ok(r) => u64_of(&r, "disk_size"),
            Err(f) if f.is_conflict() && self.attached_elsewhere(&ws).await? => want,
            Err(f) => return Err(f.into()),
        };
        Ok(pb::ControllerExpandVolumeResponse {
            capacity_bytes: capacity as i64,
            node_expansion_required: true,
        })
    }

    /// Whether another node holds the volume's lease (attached there, not by this daemon).
    async fn attached_elsewhere(&self, ws: &str) -> Result<bool, Status> {
        let v = self
            .daemon
            .workspace(ws)
            .await?
            .ok_or_else(|| Status::not_found(format!("no volume {ws:?}")))?;
        let held = v["lease"]["holder"].is_string()
            && v["lease"]["expires_ms"].as_u64().unwrap_or(0) > crate::now_ms();
        Ok(held && v["attached"] != true)
    }

    /// The disk size of an existing volume (`NOT_FOUND` if there is none).
    async fn disk_size(&self, ws: &str) -> Result<u64, Status> {
        let v = self
            .daemon
            .workspace(ws)
            .await?
            .ok_or_else(|| Status::not_found(format!("no volume {ws:?}")))?;
        Ok(u64_of(&v["workspace"], "disk_size"))
    }

    /// The checkpoint `version` of `ws` if it is a CSI snapshot.
    async fn snapshot(&self, ws: &str, version: u64) -> Result<Option<Value>, Status> {
        let log = match self.daemon.log(ws).await {
            Ok(l) => l,
            Err(f) if f.is_not_found() => return Ok(None),
            Err(f) => return Err(f.into()),
        };
        Ok(log
            .into_iter()
            .find(|c| u64_of(c, "version") == version && is_snapshot(c)))
    }

    /// Every CSI snapshot of the tenant: (workspace, its disk size, checkpoint).
    async fn all_snapshots(&self) -> Result<Vec<(String, u64, Value)>, Status> {
        let mut out = Vec::new();
        for w in self.daemon.workspaces().await? {
            let name = w["name"].as_str().unwrap_or_default().to_string();
            let size = u64_of(&w, "disk_size");
            let log = match self.daemon.log(&name).await {
                Ok(l) => l,
                Err(f) if f.is_not_found() => continue, // deleted meanwhile
                Err(f) => return Err(f.into()),
            };
            out.extend(
                log.into_iter()
                    .filter(is_snapshot)
                    .map(|c| (name.clone(), size, c)),
            );
        }
        Ok(out)
    }

    fn snapshot_of(ws: &str, size: u64, c: &Value) -> pb::Snapshot {
        pb::Snapshot {
            size_bytes: size as i64,
            snapshot_id: format!("{ws}@{}", u64_of(c, "version")),
            source_volume_id: ws.to_string(),
            creation_time: Some(timestamp(u64_of(c, "created_ms"))),
            ready_to_use: true,
            group_snapshot_id: String::new(),
        }
    }

    async fn create_snapshot(
        &self,
        req: pb::CreateSnapshotRequest,
    ) -> Result<pb::CreateSnapshotResponse, Status> {
        let name = required("name", &req.name)?;
        let src = crate::workspace_of_id(required("source_volume_id", &req.source_volume_id)?)?;
        let label = snapshot_label(name);
        strata_format::name::validate_label(&label)
            .map_err(|e| invalid(format!("snapshot name {name:?}: {e}")))?;
        if let Some(k) = req
            .parameters
            .keys()
            .find(|k| !k.starts_with("csi.storage.k8s.io/"))
        {
            return Err(invalid(format!("unknown parameter {k:?}")));
        }
        // The same name again: the snapshot it made, if it was of the same volume.
        for (ws, size, c) in self.all_snapshots().await? {
            if c["label"].as_str() == Some(&label) {
                if ws != src {
                    return Err(Status::already_exists(format!(
                        "snapshot {name:?} is of volume {ws:?}, not {src:?}"
                    )));
                }
                return Ok(pb::CreateSnapshotResponse {
                    snapshot: Some(Self::snapshot_of(&ws, size, &c)),
                });
            }
        }
        let size = self.disk_size(&src).await?;
        let p = self.daemon.checkpoint(&src, Some(&label)).await?;
        let version = u64_of(&p, "version");
        let c = self
            .snapshot(&src, version)
            .await?
            .unwrap_or_else(|| json!({ "version": version, "created_ms": 0 }));
        Ok(pb::CreateSnapshotResponse {
            snapshot: Some(Self::snapshot_of(&src, size, &c)),
        })
    }

    async fn list_snapshots(
        &self,
        req: pb::ListSnapshotsRequest,
    ) -> Result<pb::ListSnapshotsResponse, Status> {
        if req.max_entries < 0 {
            return Err(invalid("max_entries is negative"));
        }
        let start: usize = if req.starting_token.is_empty() {
            0
        } else {
            req.starting_token.parse().map_err(|_| {
                Status::aborted(format!(
                    "starting_token {:?} is not one of ours",
                    req.starting_token
                ))
            })?
        };
        let mut all: Vec<pb::Snapshot> = self
            .all_snapshots()
            .await?
            .iter()
            .map(|(ws, size, c)| Self::snapshot_of(ws, *size, c))
            .filter(|s| req.snapshot_id.is_empty() || s.snapshot_id == req.snapshot_id)
            .filter(|s| {
                req.source_volume_id.is_empty() || s.source_volume_id == req.source_volume_id
            })
            .collect();
        all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        if start > all.len() {
            return Err(Status::aborted(format!(
                "starting_token {start} is past the end ({} snapshots)",
                all.len()
            )));
        }
        let n = if req.max_entries == 0 {
            all.len()
        } else {
            req.max_entries as usize
        };
        let end = (start + n).min(all.len());
        let next_token = if end < all.len() {
            end.to_string()
        } else {
            String::new()
        };
        Ok(pb::ListSnapshotsResponse {
            entries: all[start..end]
                .iter()
                .cloned()
                .map(|s| pb::list_snapshots_response::Entry { snapshot: Some(s) })
                .collect(),
            next_token,
        })
    }
}

fn unimplemented<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!("{what} is not offered")))
}

#[tonic::async_trait]
impl pb::controller_server::Controller for Controller {
    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        Ok(Response::new(
            Controller::create_volume(self, req.into_inner()).await?,
        ))
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let id = required("volume_id", &req.get_ref().volume_id)?;
        // An id that is no workspace name was never ours: deleted already, as far as the CO
        // is concerned.
        if strata_format::name::validate("workspace name", id).is_ok() {
            self.daemon.delete_workspace(id).await?;
        }
        Ok(Response::new(pb::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        unimplemented("PUBLISH_UNPUBLISH_VOLUME")
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("PUBLISH_UNPUBLISH_VOLUME")
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = req.into_inner();
        let ws = crate::workspace_of_id(&req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        if self.daemon.workspace(&ws).await?.is_none() {
            return Err(Status::not_found(format!("no volume {ws:?}")));
        }
        let why = unsupported(&req.volume_capabilities);
        Ok(Response::new(pb::ValidateVolumeCapabilitiesResponse {
            confirmed: why.is_none().then(|| {
                pb::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context.clone(),
                    volume_capabilities: req.volume_capabilities.clone(),
                    parameters: req.parameters.clone(),
                    mutable_parameters: req.mutable_parameters.clone(),
                }
            }),
            message: why.unwrap_or_default(),
        }))
    }

    async fn list_volumes(
        &self,
        _: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        unimplemented("LIST_VOLUMES")
    }

    async fn get_capacity(
        &self,
        _: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        unimplemented("GET_CAPACITY")
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::{rpc::Type, Rpc, Type as T};
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::CreateDeleteSnapshot,
            Type::ListSnapshots,
            Type::CloneVolume,
            Type::ExpandVolume,
        ]
        .into_iter()
        .map(|t| pb::ControllerServiceCapability {
            r#type: Some(T::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect();
        Ok(Response::new(pb::ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::CreateSnapshotResponse>, Status> {
        Ok(Response::new(
            Controller::create_snapshot(self, req.into_inner()).await?,
        ))
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let id = required("snapshot_id", &req.get_ref().snapshot_id)?;
        let Some((ws, v)) = parse_snapshot_id(id) else {
            return Ok(Response::new(pb::DeleteSnapshotResponse {}));
        };
        if self.snapshot(&ws, v).await?.is_some() {
            let mut r = self.daemon.release_checkpoint(&ws, v).await;
            if matches!(&r, Err(f) if f.is_conflict()) {
                // It is the volume's head (nothing was written since): a new checkpoint
                // becomes the head, and the snapshot can go.
                self.daemon.checkpoint(&ws, None).await?;
                r = self.daemon.release_checkpoint(&ws, v).await;
            }
            match r {
                Ok(_) => {}
                Err(f) if f.is_not_found() => {}
                Err(f) => return Err(f.into()),
            }
        }
        Ok(Response::new(pb::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        Ok(Response::new(
            Controller::list_snapshots(self, req.into_inner()).await?,
        ))
    }

    async fn get_snapshot(
        &self,
        _: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        unimplemented("GET_SNAPSHOT")
    }

    async fn controller_expand_volume(
        &self,
        req: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        Ok(Response::new(
            Controller::expand_volume(self, req.into_inner()).await?,
        ))
    }

    async fn controller_get_volume(
        &self,
        _: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        unimplemented("GET_VOLUME")
    }

    async fn controller_modify_volume(
        &self,
        _: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        unimplemented("MODIFY_VOLUME")
    }
}
