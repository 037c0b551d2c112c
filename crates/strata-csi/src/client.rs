//! A gRPC channel to a CSI socket (what the kubelet and the sidecars dial), for tests and
//! probes: `pb::node_client::NodeClient::new(client::connect(path).await?)`.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects to the CSI driver listening on the unix socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    // The URI is required by the API and ignored: every connection dials the socket.
    Endpoint::from_static("http://csi.local")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}
