#![allow(dead_code)]
//! Test scaffolding: an engine on the embedded backends, workspaces exported over a unix socket
//! by an in-process NBD server.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use strata_catalog::{Catalog, SqliteCatalog};
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, Mode, Source};
use strata_nbd::{Export, Exports, Server, ServerConfig};
use strata_store::Store;

pub const TENANT: &str = "acme";

pub struct Rig {
    pub dir: tempfile::TempDir,
    pub engine: Arc<Engine>,
    pub exports: Arc<Exports>,
    pub socket: PathBuf,
}

impl Rig {
    pub async fn new(cfg: ServerConfig) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let catalog: Arc<dyn Catalog> =
            Arc::new(SqliteCatalog::open(&dir.path().join("catalog.db")).unwrap());
        catalog.create_tenant(TENANT).await.unwrap();
        let store = Store::open(&format!("file:{}", dir.path().join("objects").display())).unwrap();
        let mut ecfg = EngineConfig::new(dir.path().join("node"));
        ecfg.node_id = Some("n1".into());
        ecfg.upload_interval = Duration::from_secs(3600);
        ecfg.cache_unsafe = false;
        let engine = Engine::open_with(ecfg, catalog, store, Arc::new(RealFs)).unwrap();
        let exports = Exports::new();
        let socket = dir.path().join("nbd.sock");
        let listener = Server::bind_unix(&socket).unwrap();
        tokio::spawn(Server::new(exports.clone(), cfg).serve_unix(listener));
        Rig {
            dir,
            engine,
            exports,
            socket,
        }
    }

    /// Creates an empty durable workspace of `size` bytes and exports it under its name.
    pub async fn workspace(&self, name: &str, size: u64) {
        self.engine
            .create_workspace(TENANT, name, Source::Empty { size }, Mode::Durable, None)
            .await
            .unwrap();
        self.export(name).await;
    }

    pub async fn export(&self, name: &str) {
        let v = self.engine.attach(TENANT, name).await.unwrap();
        self.exports.insert(
            name,
            Export {
                device: v,
                description: format!("strata workspace {name}"),
                multi_conn: true,
            },
        );
    }

    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
}

/// Runs a command off the async runtime (the server runs on it), asserting success.
pub async fn run(mut cmd: Command) -> String {
    let out: Output = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "command failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn cmd(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Interop tests need real clients; CI installs them. Outside CI a missing tool skips the test.
pub fn require(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !have(t)).collect();
    if missing.is_empty() {
        return true;
    }
    assert!(std::env::var("CI").is_err(), "CI must install {missing:?}");
    eprintln!("skipping: {missing:?} not installed");
    false
}
