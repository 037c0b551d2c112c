//! The nemesis's nodes (a daemon that can be killed and started again) and its NBD reads.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use strata_nbd::client::Client;

use crate::common::*;
use crate::model::BLOCKS;

/// A node: its daemon (None while killed) and how to start it again.
pub(crate) struct Node {
    pub(crate) daemon: Option<Daemon>,
    pub(crate) data: PathBuf,
    pub(crate) args: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) url: String,
}

impl Node {
    pub(crate) fn start(data: &Path, args: Vec<String>, env: Vec<(String, String)>) -> Node {
        let mut n = Node {
            daemon: None,
            data: data.to_path_buf(),
            args,
            env,
            url: String::new(),
        };
        n.restart();
        n
    }
    pub(crate) fn restart(&mut self) {
        let args: Vec<&str> = self.args.iter().map(|s| s.as_str()).collect();
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let d = serve_node(&self.data, &args, &env);
        self.url = d.url.clone();
        self.daemon = Some(d);
    }
    pub(crate) fn api(&self, token: &str) -> Api {
        Api::with_timeout(&self.url, token, Duration::from_secs(30))
    }
}

/// `serve_env` with the binary chosen by `STRATA_NEMESIS_BIN` (the mutation check).
pub(crate) fn serve_node(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
    match std::env::var("STRATA_NEMESIS_BIN") {
        Ok(bin) if !bin.is_empty() => serve_bin(Path::new(&bin), data, extra, env),
        _ => serve_env(data, extra, env),
    }
}

/// Attaches `ws` through `api` until it works (a lease may still be held elsewhere) and returns
/// its socket.
pub(crate) async fn attach(api: &Api, ws: &str, within: Duration) -> Option<String> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        let (s, v) = api
            .post(&format!("/v1/workspaces/{ws}/attach"), json!({}))
            .await;
        if s == StatusCode::OK {
            return v["socket"].as_str().map(String::from);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Reads every block of `ws` at `sock` (after a FLUSH on that connection, so whatever is read
/// is also durable); None if the workspace cannot be reached.
pub(crate) async fn read_all(sock: &str, ws: &str, flush: bool) -> Option<Vec<u64>> {
    let mut c = tokio::time::timeout(
        Duration::from_secs(10),
        Client::connect_unix(Path::new(sock), ws),
    )
    .await
    .ok()?
    .ok()?;
    if flush {
        c.flush().await.ok()?;
    }
    let mut out = Vec::with_capacity(BLOCKS as usize);
    for b in 0..BLOCKS {
        let data = c.read(b * 4096, 4096).await.ok()?;
        out.push(tag_of(&data, b).unwrap_or(u64::MAX));
    }
    let _ = c.disconnect().await;
    Some(out)
}
