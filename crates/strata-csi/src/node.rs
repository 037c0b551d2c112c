//! The Node service. NodePublishVolume has the daemon mount the workspace's ext4 at a staging
//! directory (under the daemon's mount root), then binds that onto the kubelet's target;
//! NodeUnpublishVolume undoes it and, for an inline ephemeral volume, checkpoints or discards
//! the workspace per its `onUnpublish` attribute.
//!
//! Each publish is recorded (`STATE/HASH.json`) before it changes anything, with each step
//! as it completes, so that a publish that fails (or a plugin killed in the middle) is undone
//! exactly: what this publish created is removed, nothing else. The kubelet does not retry a
//! failed ephemeral publish, so a failure leaves nothing behind. Every call runs in a task of
//! its own under its volume's lock: a CO that gives up on a call does not cut it in half.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::pb::{self, volume_capability};
use crate::{invalid, required, workspace_of_id, Config};

mod host;
mod inline;

use inline::{Inline, OnUnpublish};

/// One published volume, as recorded on disk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Record {
    volume_id: String,
    workspace: String,
    target: String,
    staging: String,
    read_only: bool,
    /// An inline ephemeral volume (its workspace is this pod's; unpublish applies the policy).
    ephemeral: bool,
    on_unpublish: OnUnpublish,
    /// This publish created the workspace: undoing it deletes the workspace, but only if
    /// nobody else has attached it since (see `delete_at`).
    created: bool,
    /// Delete the workspace only while its lease epoch is still this one (every attach takes
    /// a new epoch): the epoch after this publish's create, or after its own mount. Once
    /// another pod has attached it, it is theirs, and it stays.
    #[serde(default)]
    delete_at: Option<u64>,
    /// A discarding unpublish: the epoch its umount left (deleted only while still that).
    #[serde(default)]
    discard_at: Option<u64>,
    /// The daemon mounted it for this publish (undoing it unmounts).
    mounted: bool,
    /// Bound onto the target: the publish is complete.
    published: bool,
}

#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

struct Inner {
    daemon: Daemon,
    node_id: String,
    state: PathBuf,
    staging: PathBuf,
    backend: String,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

fn key(volume_id: &str) -> String {
    blake3::hash(volume_id.as_bytes()).to_hex()[..32].to_string()
}

impl Node {
    pub fn new(daemon: Daemon, cfg: &Config) -> std::io::Result<Node> {
        std::fs::create_dir_all(&cfg.state_dir)?;
        std::fs::create_dir_all(&cfg.staging_dir)?;
        Ok(Node {
            inner: Arc::new(Inner {
                daemon,
                node_id: cfg.node_id.clone(),
                state: cfg.state_dir.clone(),
                staging: cfg.staging_dir.clone(),
                backend: cfg.backend.clone(),
                locks: Default::default(),
            }),
        })
    }

    /// After a restart (of this plugin or of the daemon): undoes publishes that did not
    /// complete, and binds each published target onto its live staging mount again (a daemon
    /// killed and restarted mounts a new filesystem there; the old bind shows a dead one).
    /// Runs now and then every 10 s.
    pub async fn reconcile(&self) {
        self.inner.reconcile_once().await;
        let inner = self.inner.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                inner.reconcile_once().await;
            }
        });
    }
}

impl Inner {
    fn lock(&self, volume_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 1024 {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        m.entry(volume_id.to_string()).or_default().clone()
    }

    fn record_path(&self, volume_id: &str) -> PathBuf {
        self.state.join(format!("{}.json", key(volume_id)))
    }

    fn load(&self, volume_id: &str) -> Option<Record> {
        let b = std::fs::read(self.record_path(volume_id)).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Writes the record durably (temporary file, fsync, rename, fsync of the directory).
    fn save(&self, r: &Record) -> Result<(), Status> {
        use std::io::Write;
        let p = self.record_path(&r.volume_id);
        let tmp = p.with_extension("tmp");
        let io = |e: std::io::Error| Status::internal(format!("recording the volume: {e}"));
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&serde_json::to_vec(r).expect("a record serializes"))
            .map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &p).map_err(io)?;
        std::fs::File::open(&self.state)
            .and_then(|d| d.sync_all())
            .map_err(io)
    }

    fn forget(&self, volume_id: &str) {
        let _ = std::fs::remove_file(self.record_path(volume_id));
        let _ = std::fs::File::open(&self.state).and_then(|d| d.sync_all());
    }

    async fn publish(&self, req: pb::NodePublishVolumeRequest) -> Result<(), Status> {
        let volume_id = required("volume_id", &req.volume_id)?.to_string();
        let target = host::check_target(required("target_path", &req.target_path)?)?;
        crate::controller::check_capability(
            req.volume_capability
                .as_ref()
                .ok_or_else(|| invalid("volume_capability is required"))?,
        )?;
        let ctx = &req.volume_context;
        let ephemeral = ctx.get("csi.storage.k8s.io/ephemeral").map(String::as_str) == Some("true");
        let (workspace, inline) = if ephemeral {
            let i = Inline::parse(ctx)?;
            (i.workspace.clone(), Some(i))
        } else {
            (workspace_of_id(&volume_id)?, None)
        };
        let lock = self.lock(&volume_id);
        let _one = lock.lock().await;
        let want = Record {
            volume_id: volume_id.clone(),
            workspace: workspace.clone(),
            target: target.clone(),
            staging: self
                .staging
                .join(key(&volume_id))
                .to_string_lossy()
                .into_owned(),
            // A reader-only access mode is published read-only whatever `readonly` says.
            read_only: req.readonly || reader_only(req.volume_capability.as_ref()),
            ephemeral,
            on_unpublish: inline
                .as_ref()
                .map(|i| i.on_unpublish)
                .unwrap_or(OnUnpublish::Keep),
            created: false,
            delete_at: None,
            discard_at: None,
            mounted: false,
            published: false,
        };
        if let Some(had) = self.load(&volume_id) {
            if had.target != want.target {
                return Err(Status::failed_precondition(format!(
                    "volume {volume_id:?} is published at {} already (one target per volume)",
                    had.target
                )));
            }
            let same = had.workspace == want.workspace
                && had.read_only == want.read_only
                && had.ephemeral == want.ephemeral
                && had.on_unpublish == want.on_unpublish;
            if !same {
                return Err(Status::already_exists(format!(
                    "volume {volume_id:?} is published at {} already with other attributes (workspace {:?}, read-only {})",
                    had.target, had.workspace, had.read_only
                )));
            }
            if had.published {
                // The same call again: make sure the bind is there.
                return self.rebind(&had).await;
            }
            // A publish that did not finish (this plugin was killed): undo, then start over.
            self.undo(had).await?;
        }
        let mut r = want;
        self.save(&r)?;
        match self.do_publish(&mut r, inline.as_ref()).await {
            Ok(()) => Ok(()),
            Err(e) => {
                if let Err(u) = self.undo(r).await {
                    tracing::error!(volume_id, error = %u, "undoing a failed publish failed");
                }
                Err(e)
            }
        }
    }

    async fn do_publish(&self, r: &mut Record, inline: Option<&Inline>) -> Result<(), Status> {
        let d = &self.daemon;
        if d.workspace(&r.workspace).await?.is_none() {
            let Some(i) = inline else {
                return Err(Status::not_found(format!("no volume {:?}", r.volume_id)));
            };
            let body = i.create_body().ok_or_else(|| {
                invalid(format!(
                    "workspace {:?} does not exist and the volume's attributes name no template or size to create it from",
                    r.workspace
                ))
            })?;
            // Recorded before the call: a plugin killed right after it still deletes it, if
            // nobody has attached it since (a new workspace's lease epoch is 0).
            r.created = true;
            r.delete_at = Some(0);
            if let Err(e) = self.save(r) {
                r.created = false; // the call was never sent
                return Err(e);
            }
            match d.create_workspace(body).await {
                Ok(_) => {}
                // Created meanwhile by someone else: not ours to delete.
                Err(f) if f.is_conflict() => {
                    r.created = false;
                    r.delete_at = None;
                    self.save(r)?;
                }
                Err(f) => return Err(f.into()),
            }
        }
        host::make_dir(Path::new(&r.staging))?;
        r.mounted = true;
        self.save(r)?;
        let m = d
            .mount(
                &r.workspace,
                json!({
                    "backend": self.backend,
                    "mkfs": "ext4",
                    "target": r.staging,
                    "read_only": r.read_only,
                }),
            )
            .await;
        if let Err(f) = m {
            // Mounted by another publish (another pod has this workspace): not ours.
            if f.is_conflict() {
                r.mounted = false;
                self.save(r)?;
            }
            return Err(f.into());
        }
        if r.created {
            // Our own attach took the next epoch: deleting stays ours until another's does.
            r.delete_at = self.lease_epoch(&r.workspace).await?;
            self.save(r)?;
        }
        host::bind(Path::new(&r.staging), Path::new(&r.target), r.read_only)?;
        if std::env::var_os("STRATA_CSI_FAULT").is_some_and(|f| f == "abort-before-published") {
            // Test-only: the plugin dies with every step done but the last record.
            std::process::abort();
        }
        r.published = true;
        self.save(r)
    }

    /// Whether the daemon has the workspace mounted for this record (at its staging
    /// directory): `Some(false)` when it is mounted for someone else (another pod's publish),
    /// `None` when it is not mounted.
    async fn mounted_here(&self, r: &Record) -> Result<Option<bool>, Status> {
        let mounts = self.daemon.mounts().await?;
        Ok(mounts
            .iter()
            .find(|m| m["workspace"].as_str() == Some(r.workspace.as_str()))
            .map(|m| m["target"].as_str() == Some(r.staging.as_str())))
    }

    /// Unmounts the workspace if it is mounted for this record; never another pod's mount.
    /// Returns whether the workspace is free of mounts now.
    async fn umount_ours(&self, r: &Record) -> Result<bool, Status> {
        match self.mounted_here(r).await? {
            None => Ok(true),
            Some(false) => Ok(false),
            Some(true) => match self.daemon.umount(&r.workspace).await {
                Ok(_) => Ok(true),
                Err(f) if f.is_not_found() => Ok(true),
                Err(f) => Err(f.into()),
            },
        }
    }

    async fn lease_epoch(&self, ws: &str) -> Result<Option<u64>, Status> {
        Ok(self
            .daemon
            .workspace(ws)
            .await?
            .and_then(|v| v["lease"]["epoch"].as_u64()))
    }

    /// Deletes the workspace if its lease epoch is still `at` (nobody attached it since) and
    /// nobody holds it (the catalog refuses a delete under a live lease). Otherwise someone
    /// else has it now: it stays.
    async fn delete_if_unchanged(&self, ws: &str, at: u64) -> Result<(), Status> {
        let Some(epoch) = self.lease_epoch(ws).await? else {
            return Ok(());
        };
        if epoch != at {
            tracing::info!(
                workspace = ws,
                "not deleting a workspace another pod has attached since"
            );
            return Ok(());
        }
        match self.daemon.delete_workspace(ws).await {
            Ok(()) => Ok(()),
            Err(f) if f.is_conflict() => {
                tracing::info!(workspace = ws, error = %f, "not deleting a workspace in use");
                Ok(())
            }
            Err(f) => Err(f.into()),
        }
    }

    /// Undoes what the record says was done, in reverse, then forgets it.
    async fn undo(&self, r: Record) -> Result<(), Status> {
        host::unbind(Path::new(&r.target))?;
        let free = if r.mounted {
            self.umount_ours(&r).await?
        } else {
            !matches!(self.mounted_here(&r).await?, Some(false))
        };
        let _ = std::fs::remove_dir(&r.staging);
        if let (true, true, Some(at)) = (r.created, free, r.delete_at) {
            self.delete_if_unchanged(&r.workspace, at).await?;
        }
        self.forget(&r.volume_id);
        Ok(())
    }

    async fn unpublish(&self, req: pb::NodeUnpublishVolumeRequest) -> Result<(), Status> {
        let volume_id = required("volume_id", &req.volume_id)?.to_string();
        let target = host::check_target(required("target_path", &req.target_path)?)?;
        let lock = self.lock(&volume_id);
        let _one = lock.lock().await;
        let Some(r) = self.load(&volume_id) else {
            // Unpublished already (or never published here): nothing of ours is left.
            if std::fs::metadata(&target).is_ok() && !host::is_mount_point(Path::new(&target)) {
                let _ = std::fs::remove_dir(&target);
            }
            return Ok(());
        };
        if r.target != target {
            // Nothing of this volume is published there.
            return Ok(());
        }
        if !r.published {
            return self.undo(r).await;
        }
        host::unbind(Path::new(&r.target))?;
        let _ = std::fs::remove_dir(&r.target);
        let d = &self.daemon;
        let mut r = r;
        let ours = self.mounted_here(&r).await? == Some(true);
        if ours && r.on_unpublish == OnUnpublish::Discard && r.discard_at.is_none() {
            // Read while this publish's attach still holds the lease: the epoch is ours.
            r.discard_at = self.lease_epoch(&r.workspace).await?;
            self.save(&r)?;
        }
        if ours && r.on_unpublish == OnUnpublish::Checkpoint {
            // Cut while mounted (the filesystem frozen across it): a workspace in ephemeral
            // mode publishes nothing at its detach, and the pod's work must outlive it.
            d.checkpoint(&r.workspace, None).await?;
        }
        // The unmount syncs the filesystem and detaches, which publishes the disk (the head
        // every other node resumes from).
        let free = self.umount_ours(&r).await?;
        let _ = std::fs::remove_dir(&r.staging);
        if r.on_unpublish == OnUnpublish::Discard && free {
            // Deleted only as this pod left it: a retry after another pod resumed and wrote
            // to it finds a newer head and leaves it.
            // Without an epoch read under our own mount (a retry after it was gone), it is
            // not known to be as this pod left it: it stays.
            if let Some(at) = r.discard_at {
                self.delete_if_unchanged(&r.workspace, at).await?;
            }
        }
        self.forget(&volume_id);
        Ok(())
    }

    /// Grows a volume published here: its disk (when the controller could not, the lease
    /// being held here), device and filesystem, through the daemon that mounts it. Idempotent:
    /// again, it finishes whatever is left. Returns the disk's size.
    async fn expand(&self, req: pb::NodeExpandVolumeRequest) -> Result<i64, Status> {
        let volume_id = required("volume_id", &req.volume_id)?;
        let path = required("volume_path", &req.volume_path)?;
        if let Some(c) = &req.volume_capability {
            crate::controller::check_capability(c)?;
        }
        let lock = self.lock(volume_id);
        let _one = lock.lock().await;
        let r = self
            .load(volume_id)
            .filter(|r| r.published && (r.target == path || r.staging == path))
            .ok_or_else(|| {
                Status::not_found(format!("volume {volume_id:?} is not published at {path}"))
            })?;
        let d = &self.daemon;
        let current = d
            .workspace(&r.workspace)
            .await?
            .and_then(|v| v["workspace"]["disk_size"].as_u64())
            .ok_or_else(|| Status::not_found(format!("no volume {volume_id:?}")))?;
        let want =
            crate::expanded_size(crate::capacity_range(req.capacity_range.as_ref())?, current)?;
        let got = d.resize(&r.workspace, want).await?;
        if r.read_only {
            return Ok(got["disk_size"].as_i64().unwrap_or(0));
        }
        // Only a filesystem this node's daemon has mounted can grow here.
        let disk = got["disk_size"].as_u64().unwrap_or(0);
        match (got["filesystem_size"].as_u64(), got["filesystem_pending"].as_str()) {
            (_, Some(why)) => Err(Status::internal(format!(
                "the disk grew to {disk} bytes, its filesystem did not: {why}"
            ))),
            (Some(_), None) => Ok(disk as i64),
            (None, None) => Err(Status::failed_precondition(format!(
                "workspace {:?} is not mounted by this node's daemon: its filesystem grows at its next mount",
                r.workspace
            ))),
        }
    }

    /// Binds a published target onto its staging mount again if it is not bound to it.
    async fn rebind(&self, r: &Record) -> Result<(), Status> {
        let (staging, target) = (PathBuf::from(&r.staging), PathBuf::from(&r.target));
        if !host::is_mount_point(&staging) {
            // The daemon has not mounted it (yet): mounting is its job, it resumes mounts.
            return Err(Status::unavailable(format!(
                "workspace {:?} is not mounted at {} yet",
                r.workspace, r.staging
            )));
        }
        if host::same_mount(&staging, &target) {
            return Ok(());
        }
        host::unbind(&target)?;
        host::bind(&staging, &target, r.read_only)
    }

    async fn reconcile_once(&self) {
        let Ok(entries) = std::fs::read_dir(&self.state) else {
            return;
        };
        for e in entries.flatten() {
            let Ok(b) = std::fs::read(e.path()) else {
                continue;
            };
            let Ok(r) = serde_json::from_slice::<Record>(&b) else {
                continue;
            };
            let lock = self.lock(&r.volume_id);
            let _one = lock.lock().await;
            let Some(r) = self.load(&r.volume_id) else {
                continue;
            };
            let id = r.volume_id.clone();
            let res = if r.published {
                self.rebind(&r).await
            } else {
                self.undo(r).await
            };
            if let Err(e) = res {
                tracing::warn!(volume_id = id, error = %e, "reconciling a published volume");
            }
        }
    }
}

fn reader_only(c: Option<&pb::VolumeCapability>) -> bool {
    use volume_capability::access_mode::Mode;
    c.and_then(|c| c.access_mode.as_ref())
        .is_some_and(|m| m.mode == Mode::SingleNodeReaderOnly as i32)
}

/// Runs a call in a task of its own: a CO that cancels the call does not cut it in half.
async fn own<T: Send + 'static>(
    f: impl std::future::Future<Output = Result<T, Status>> + Send + 'static,
) -> Result<T, Status> {
    tokio::spawn(f)
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("the call's task failed: {e}"))))
}

#[tonic::async_trait]
impl pb::node_server::Node for Node {
    async fn node_stage_volume(
        &self,
        _: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        Err(Status::unimplemented("STAGE_UNSTAGE_VOLUME is not offered"))
    }

    async fn node_unstage_volume(
        &self,
        _: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        Err(Status::unimplemented("STAGE_UNSTAGE_VOLUME is not offered"))
    }

    async fn node_publish_volume(
        &self,
        req: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = req.into_inner();
        own(async move { inner.publish(req).await }).await?;
        Ok(Response::new(pb::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = req.into_inner();
        own(async move { inner.unpublish(req).await }).await?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        let req = req.into_inner();
        let volume_id = required("volume_id", &req.volume_id)?;
        let path = required("volume_path", &req.volume_path)?;
        let r = self
            .inner
            .load(volume_id)
            .filter(|r| r.published && r.target == path)
            .ok_or_else(|| {
                Status::not_found(format!("volume {volume_id:?} is not published at {path}"))
            })?;
        let usage = host::usage(Path::new(&r.target))?;
        Ok(Response::new(pb::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: None,
        }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = req.into_inner();
        let capacity_bytes = own(async move { inner.expand(req).await }).await?;
        Ok(Response::new(pb::NodeExpandVolumeResponse {
            capacity_bytes,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        use pb::node_service_capability::{rpc::Type, Rpc, Type as T};
        let capabilities = [Type::GetVolumeStats, Type::ExpandVolume]
            .into_iter()
            .map(|t| pb::NodeServiceCapability {
                r#type: Some(T::Rpc(Rpc { r#type: t as i32 })),
            })
            .collect();
        Ok(Response::new(pb::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.inner.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
