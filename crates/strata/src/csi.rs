//! `strata csi`: the Kubernetes CSI driver (crate `strata-csi`) in front of this node's daemon.

use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub struct CsiArgs {
    /// The socket the kubelet and the sidecars dial.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Serve the Node service (with neither flag, both are served).
    #[arg(long)]
    node: bool,
    /// Serve the Controller service.
    #[arg(long)]
    controller: bool,
    /// The node's strata daemon.
    #[arg(long, env = "STRATA_URL", default_value = "http://127.0.0.1:7420")]
    daemon_url: String,
    /// With an https:// daemon: its CA certificates (PEM), trusted instead of the system's.
    #[arg(long, env = "STRATA_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// The token of the tenant this driver serves.
    #[arg(long, env = "STRATA_TOKEN", hide_env_values = true, default_value = "")]
    token: String,
    /// This node's id (NodeGetInfo); Kubernetes passes the node's name.
    #[arg(long, env = "KUBE_NODE_NAME")]
    node_id: Option<String>,
    /// One record per published volume, kept across restarts.
    #[arg(long, default_value = "/var/lib/strata-csi")]
    state_dir: PathBuf,
    /// Where the daemon mounts published filesystems before they are bound onto the
    /// kubelet's targets: under the daemon's --mount-root, in this tenant's directory
    /// (ROOT/TENANT/csi). Needed with the Node service.
    #[arg(long)]
    staging_dir: Option<PathBuf>,
    /// How the daemon mounts: fuse or nbd.
    #[arg(long, default_value = "fuse")]
    backend: String,
}

pub async fn run(a: CsiArgs) -> anyhow::Result<()> {
    let both = !a.node && !a.controller;
    let node = a.node || both;
    let node_id = match a.node_id {
        Some(n) => n,
        None => std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default(),
    };
    if node && node_id.is_empty() {
        anyhow::bail!("--node-id (or KUBE_NODE_NAME) is needed for the Node service");
    }
    let staging_dir = match (node, a.staging_dir) {
        (true, None) => anyhow::bail!("--staging-dir is needed for the Node service"),
        (_, s) => s.unwrap_or_default(),
    };
    if !matches!(a.backend.as_str(), "fuse" | "nbd") {
        anyhow::bail!("--backend {:?}: expected fuse or nbd", a.backend);
    }
    let cfg = strata_csi::Config {
        daemon_url: a.daemon_url,
        token: a.token,
        node_id,
        node,
        controller: a.controller || both,
        state_dir: a.state_dir,
        staging_dir,
        backend: a.backend,
        ca_cert: a.ca_cert,
    };
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let endpoint = a.endpoint.clone();
    // One JSON line on stdout once the socket listens (what a supervisor or a test waits for).
    let ready = move || {
        tracing::info!(endpoint, "serving CSI");
        println!(
            "{}",
            serde_json::json!({ "csi": endpoint, "driver": strata_csi::DRIVER_NAME })
        );
    };
    strata_csi::serve(&a.endpoint, cfg, ready, stop)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
}
