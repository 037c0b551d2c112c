//! The node's strata daemon, over its HTTP API: the daemon owns every volume and mount on
//! the node; the CSI services only translate. Each daemon error becomes the gRPC code the
//! CSI spec names for it (see [`Failure::status`]).

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// A daemon reply that is not a success, or no reply.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// HTTP status; `None` when the daemon did not answer.
    pub status: Option<StatusCode>,
    /// The daemon's error kind (`not_found`, `conflict`, `invalid`, ...).
    pub kind: String,
    pub message: String,
}

impl Failure {
    pub fn is_not_found(&self) -> bool {
        self.status == Some(StatusCode::NOT_FOUND)
    }

    pub fn is_conflict(&self) -> bool {
        self.status == Some(StatusCode::CONFLICT)
    }

    /// The gRPC status a CSI caller gets for this failure.
    pub fn status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self.status {
            None => Code::Unavailable,
            Some(s) => match s.as_u16() {
                400 | 413 | 422 => Code::InvalidArgument,
                401 => Code::Unauthenticated,
                403 => Code::PermissionDenied,
                404 => Code::NotFound,
                409 => Code::FailedPrecondition,
                503 => Code::Unavailable,
                507 => Code::ResourceExhausted,
                _ => Code::Internal,
            },
        };
        tonic::Status::new(code, format!("strata: {}", self.message))
    }
}

impl From<Failure> for tonic::Status {
    fn from(f: Failure) -> Self {
        f.status()
    }
}

/// A reply, or `None` for a 404.
fn found(r: Result<Value, Failure>) -> Result<Option<Value>, Failure> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(f) if f.is_not_found() => Ok(None),
        Err(f) => Err(f),
    }
}

/// A client of one daemon with one tenant's token.
#[derive(Clone)]
pub struct Daemon {
    http: reqwest::Client,
    url: String,
    token: String,
}

/// Workspace names go into URL paths: they are validated first (`strata_format::name`), so
/// they never hold `/`, `?`, `#` or `%`.
fn ws_path(name: &str, tail: &str) -> String {
    format!("/v1/workspaces/{name}{tail}")
}

impl Daemon {
    pub fn new(url: &str, token: &str) -> Daemon {
        Daemon {
            http: Self::builder().build().expect("an HTTP client"),
            url: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
        }
    }

    /// A client of an `https://` daemon whose certificate chains to one of the CA certificates
    /// in `ca_pem` (and to nothing else).
    pub fn with_ca(url: &str, token: &str, ca_pem: &[u8]) -> anyhow::Result<Daemon> {
        let certs = reqwest::Certificate::from_pem_bundle(ca_pem)
            .map_err(|e| anyhow::anyhow!("the CA certificate: {e}"))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "the CA certificate file holds no certificate"
        );
        Ok(Daemon {
            http: Self::builder().tls_certs_only(certs).build()?,
            url: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
        })
    }

    fn builder() -> reqwest::ClientBuilder {
        // A mount of a large template, or a checkpoint of a busy disk, can take minutes; a
        // daemon that stops answering altogether is given up on after 10.
        reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .connect_timeout(Duration::from_secs(5))
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, Failure> {
        let mut r = self.http.request(method, format!("{}{path}", self.url));
        if !self.token.is_empty() {
            r = r.bearer_auth(&self.token);
        }
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.map_err(|e| Failure {
            status: None,
            kind: "unreachable".into(),
            message: format!("cannot reach the daemon at {}: {e}", self.url),
        })?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| Failure {
            status: None,
            kind: "unreachable".into(),
            message: format!("the daemon's reply broke off: {e}"),
        })?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(v);
        }
        Err(Failure {
            status: Some(status),
            kind: v["error"]["kind"].as_str().unwrap_or("error").to_string(),
            message: v["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("HTTP {status}: {text}")),
        })
    }

    pub async fn health(&self) -> Result<Value, Failure> {
        self.call(Method::GET, "/v1/health", None).await
    }

    /// The workspace's view, or `None` if it does not exist.
    pub async fn workspace(&self, name: &str) -> Result<Option<Value>, Failure> {
        found(self.call(Method::GET, &ws_path(name, ""), None).await)
    }

    pub async fn workspaces(&self) -> Result<Vec<Value>, Failure> {
        let v = self.call(Method::GET, "/v1/workspaces", None).await?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    /// Creates a workspace (`body` as `POST /v1/workspaces` takes it).
    pub async fn create_workspace(&self, body: Value) -> Result<Value, Failure> {
        self.call(Method::POST, "/v1/workspaces", Some(body)).await
    }

    /// Forks `src`'s current state into a new workspace (`body`: `name`, `mode`).
    pub async fn fork(&self, src: &str, body: Value) -> Result<Value, Failure> {
        self.call(Method::POST, &ws_path(src, "/fork"), Some(body))
            .await
    }

    /// Deletes a workspace; one that is already gone is not an error.
    pub async fn delete_workspace(&self, name: &str) -> Result<(), Failure> {
        found(self.call(Method::DELETE, &ws_path(name, ""), None).await).map(drop)
    }

    pub async fn mount(&self, name: &str, body: Value) -> Result<Value, Failure> {
        self.call(Method::POST, &ws_path(name, "/mount"), Some(body))
            .await
    }

    /// Unmounts and detaches (the detach publishes what the disk holds).
    pub async fn umount(&self, name: &str) -> Result<Value, Failure> {
        self.call(Method::DELETE, &ws_path(name, "/mount"), None)
            .await
    }

    pub async fn mounts(&self) -> Result<Vec<Value>, Failure> {
        let v = self.call(Method::GET, "/v1/mounts", None).await?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    pub async fn checkpoint(&self, name: &str, label: Option<&str>) -> Result<Value, Failure> {
        self.call(
            Method::POST,
            &ws_path(name, "/checkpoint"),
            // A snapshot must be restorable on any node: published before it is reported.
            Some(json!({ "label": label, "wait": true })),
        )
        .await
    }

    /// Grows a workspace's disk to `size` bytes (mounted on this node: its device and
    /// filesystem too). Returns the daemon's `Resized`.
    pub async fn resize(&self, name: &str, size: u64) -> Result<Value, Failure> {
        self.call(
            Method::POST,
            &ws_path(name, "/resize"),
            Some(json!({ "size": size })),
        )
        .await
    }

    /// Lets retention expire a labelled checkpoint (its label is dropped; the head stays).
    pub async fn release_checkpoint(&self, name: &str, version: u64) -> Result<Value, Failure> {
        self.call(
            Method::DELETE,
            &ws_path(name, &format!("/checkpoints/{version}")),
            None,
        )
        .await
    }

    /// The workspace's checkpoints, oldest first.
    pub async fn log(&self, name: &str) -> Result<Vec<Value>, Failure> {
        let v = self.call(Method::GET, &ws_path(name, "/log"), None).await?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    pub async fn template(&self, name: &str) -> Result<Option<Value>, Failure> {
        found(
            self.call(Method::GET, &format!("/v1/templates/{name}"), None)
                .await,
        )
    }
}
