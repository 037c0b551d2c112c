//! The Kubernetes CSI v1 driver: Identity ([`identity`]), Node ([`node`]) and Controller
//! ([`controller`]) services over a unix socket, each a translation onto the node's strata
//! daemon ([`daemon`]), which stays the one owner of volumes and mounts on the node.
//!
//! Volumes are workspaces. A persistent volume's id is its workspace's name; an inline
//! ephemeral volume's workspace is named by the pod's attributes (`workspace`, default
//! `{pod.namespace}.{pod.name}`), never by the kubelet's volume id, so a pod that comes back
//! (on any node) resumes the same workspace. A snapshot is a labelled checkpoint; its id is
//! `WORKSPACE@VERSION`.

pub mod client;
pub mod controller;
pub mod daemon;
pub mod identity;
pub mod node;

pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("csi.v1");
}

use std::path::{Path, PathBuf};

use tonic::Status;

/// The driver's name (the CSIDriver object's `metadata.name`).
pub const DRIVER_NAME: &str = "csi.strata.dev";

/// The largest string field this driver takes (the spec's general limit is 128 bytes for
/// most fields; ids and paths are allowed more, within reason).
const MAX_FIELD: usize = 4096;

/// What `strata csi` serves.
#[derive(Clone, Debug)]
pub struct Config {
    /// The daemon's API address (`http://127.0.0.1:7300`).
    pub daemon_url: String,
    /// The token of the tenant whose workspaces this driver serves.
    pub token: String,
    /// This node's id (NodeGetInfo).
    pub node_id: String,
    /// Serve the Node service.
    pub node: bool,
    /// Serve the Controller service.
    pub controller: bool,
    /// Where the node keeps one record per published volume (survives restarts).
    pub state_dir: PathBuf,
    /// Where the daemon mounts a published volume's filesystem before it is bound onto the
    /// kubelet's target: a directory under the daemon's `--mount-root`, inside this tenant's
    /// own root (`ROOT/TENANT/...`).
    pub staging_dir: PathBuf,
    /// The mount backend the daemon uses (`fuse` or `nbd`).
    pub backend: String,
    /// With an `https://` daemon: the CA certificates (PEM) its certificate is checked against,
    /// instead of the system's roots.
    pub ca_cert: Option<PathBuf>,
}

/// `INVALID_ARGUMENT` with a message.
pub(crate) fn invalid(m: impl Into<String>) -> Status {
    Status::invalid_argument(m.into())
}

pub(crate) use strata_format::now_ms;

/// A request's capacity range as (required_bytes, limit_bytes), (0, 0) without one;
/// `OUT_OF_RANGE` if negative, crossed, or asking for more than 1 PiB.
pub(crate) fn capacity_range(r: Option<&pb::CapacityRange>) -> Result<(u64, u64), Status> {
    let Some(r) = r else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Status::out_of_range("capacity_range is negative"));
    }
    let (required, limit) = (r.required_bytes as u64, r.limit_bytes as u64);
    if limit > 0 && required > limit {
        return Err(Status::out_of_range("required_bytes is over limit_bytes"));
    }
    if required > 1 << 50 {
        return Err(Status::out_of_range("a disk is at most 1 PiB"));
    }
    Ok((required, limit))
}

/// The disk size an expansion to a checked `(required, limit)` asks for: `required` rounded up
/// to whole blocks, never below `current` (a disk does not shrink), within `limit`
/// (`OUT_OF_RANGE` if not).
pub(crate) fn expanded_size((required, limit): (u64, u64), current: u64) -> Result<u64, Status> {
    const BLOCK: u64 = 4096;
    let mut want = required.div_ceil(BLOCK).saturating_mul(BLOCK).max(current);
    if limit > 0 && want > limit {
        want = limit / BLOCK * BLOCK;
    }
    if want < required || want < current {
        return Err(Status::out_of_range(format!(
            "the disk has {current} bytes: it cannot be within {required}..{limit} bytes (a disk never shrinks)"
        )));
    }
    Ok(want)
}

/// A required string field: present, not absurdly long.
pub(crate) fn required<'a>(what: &str, v: &'a str) -> Result<&'a str, Status> {
    if v.is_empty() {
        return Err(invalid(format!("{what} is required")));
    }
    if v.len() > MAX_FIELD {
        return Err(invalid(format!("{what} is longer than {MAX_FIELD} bytes")));
    }
    Ok(v)
}

/// The workspace behind a CO-chosen name: the name itself when it is a valid workspace name
/// without dots (a provisioner's `pvc-UUID` is), otherwise `csi-` and a hash of it, so any
/// name maps to one workspace, always the same, and never to an inline one.
pub fn workspace_for_name(name: &str) -> String {
    // No dots: inline workspaces are `NAMESPACE.…`, and a volume name must not land on one.
    if !name.contains('.') && strata_format::name::validate("workspace name", name).is_ok() {
        name.to_string()
    } else {
        format!("csi-{}", &blake3::hash(name.as_bytes()).to_hex()[..40])
    }
}

/// A volume id the CO hands back: it must be a workspace name (this driver issued it).
pub(crate) fn workspace_of_id(volume_id: &str) -> Result<String, Status> {
    required("volume_id", volume_id)?;
    strata_format::name::validate("workspace name", volume_id).map_err(|_| {
        Status::not_found(format!(
            "no volume {volume_id:?} (not an id this driver issued)"
        ))
    })?;
    Ok(volume_id.to_string())
}

/// A snapshot id is `WORKSPACE@VERSION`.
pub(crate) fn parse_snapshot_id(id: &str) -> Option<(String, u64)> {
    let (ws, v) = id.rsplit_once('@')?;
    strata_format::name::validate("workspace name", ws).ok()?;
    let v: u64 = v.parse().ok()?;
    Some((ws.to_string(), v))
}

/// The checkpoint label that marks a CSI snapshot and carries its name (idempotency by name).
pub(crate) fn snapshot_label(name: &str) -> String {
    format!("{SNAPSHOT_LABEL}{name}")
}

const SNAPSHOT_LABEL: &str = "csi-snapshot:";

/// Whether a checkpoint (as the daemon's log lists it) is a CSI snapshot.
pub(crate) fn is_snapshot(checkpoint: &serde_json::Value) -> bool {
    checkpoint["label"]
        .as_str()
        .is_some_and(|l| l.starts_with(SNAPSHOT_LABEL))
}

/// Serves the configured services on `endpoint` (`unix:///csi/csi.sock` or a path) until
/// `stop` resolves; `ready` is called once it listens. A stale socket file from an earlier run
/// is replaced.
pub async fn serve(
    endpoint: &str,
    cfg: Config,
    ready: impl FnOnce(),
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let path = socket_path(endpoint)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let daemon = match &cfg.ca_cert {
        None => daemon::Daemon::new(&cfg.daemon_url, &cfg.token),
        Some(p) => {
            let pem = std::fs::read(p)
                .map_err(|e| anyhow::anyhow!("reading the CA certificate {}: {e}", p.display()))?;
            daemon::Daemon::with_ca(&cfg.daemon_url, &cfg.token, &pem)?
        }
    };
    let mut router =
        tonic::transport::Server::builder().add_service(pb::identity_server::IdentityServer::new(
            identity::Identity::new(daemon.clone(), cfg.controller),
        ));
    if cfg.node {
        let n = node::Node::new(daemon.clone(), &cfg)?;
        n.reconcile().await;
        router = router.add_service(pb::node_server::NodeServer::new(n));
    }
    if cfg.controller {
        router = router.add_service(pb::controller_server::ControllerServer::new(
            controller::Controller::new(daemon.clone()),
        ));
    }
    // Listening only now: a CO that reaches the socket finds every publish a restart
    // interrupted undone (or bound again) by `reconcile`.
    let listener = tokio::net::UnixListener::bind(&path)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    ready();
    router.serve_with_incoming_shutdown(incoming, stop).await?;
    Ok(())
}

fn socket_path(endpoint: &str) -> Result<PathBuf, std::io::Error> {
    let p = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if p.is_empty() || !Path::new(p).is_absolute() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("endpoint {endpoint:?}: expected unix:///ABSOLUTE/PATH"),
        ));
    }
    Ok(PathBuf::from(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_one_workspace_each() {
        assert_eq!(
            workspace_for_name("pvc-0f7c1c7e-1111-2222-3333-444455556666"),
            "pvc-0f7c1c7e-1111-2222-3333-444455556666"
        );
        let odd = workspace_for_name("ns/claim with spaces");
        assert!(odd.starts_with("csi-") && odd.len() == 44);
        assert_eq!(odd, workspace_for_name("ns/claim with spaces"));
        assert_ne!(odd, workspace_for_name("ns/claim with spaces2"));
        assert!(strata_format::name::validate("w", &odd).is_ok());
        assert!(workspace_for_name("agents.run-7").starts_with("csi-"));
        let long = "x".repeat(64);
        assert!(workspace_for_name(&long).starts_with("csi-"));
    }

    #[test]
    fn snapshot_ids_parse_strictly() {
        assert_eq!(parse_snapshot_id("w@3"), Some(("w".into(), 3)));
        assert_eq!(parse_snapshot_id("w@x"), None);
        assert_eq!(parse_snapshot_id("../w@3"), None);
        assert_eq!(parse_snapshot_id("w"), None);
        assert!(workspace_of_id("a/b").is_err());
        assert!(workspace_of_id("").is_err());
    }

    #[test]
    fn endpoints_are_absolute_unix_paths() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(socket_path("unix://relative.sock").is_err());
        assert!(socket_path("").is_err());
    }
}
