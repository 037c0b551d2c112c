//! `strata ws attach`: serve one workspace over NBD from this process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use strata_engine::Engine;
use strata_nbd::{Export, Exports, Server, ServerConfig};

use crate::Global;

pub async fn attach(
    e: &Arc<Engine>,
    g: &Global,
    ws: &str,
    socket: Option<PathBuf>,
    tcp: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let t = g.tenant.as_str();
    let vol = e.attach(t, ws).await?;
    let socket = match socket {
        Some(s) => s,
        None => {
            let run = g.data.join("run");
            std::fs::create_dir_all(&run)?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700))?;
            run.join(format!("{ws}.sock"))
        }
    };
    let exports = Exports::new();
    exports.insert(
        ws,
        Export {
            device: vol.clone(),
            description: format!("strata workspace {ws} ({})", vol.mode()),
            multi_conn: true,
        },
    );
    let server = Server::new(exports, ServerConfig::default());
    let unix = Server::bind_unix(&socket)?;
    let mut addrs = vec![format!("nbd+unix:///{ws}?socket={}", socket.display())];
    let tcp_task = match tcp {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "serving NBD beyond loopback: anyone who can reach it can read and write this disk");
            }
            let l = tokio::net::TcpListener::bind(addr).await?;
            addrs.push(format!("nbd://{}/{ws}", l.local_addr()?));
            Some(tokio::spawn(server.clone().serve_tcp(l)))
        }
        None => None,
    };
    let unix_task = tokio::spawn(server.serve_unix(unix));
    if g.json {
        println!(
            "{}",
            serde_json::json!({"workspace": ws, "exports": addrs, "mode": vol.mode()})
        );
    } else {
        for a in &addrs {
            println!("{a}");
        }
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    unix_task.abort();
    if let Some(t) = tcp_task {
        t.abort();
    }
    let _ = std::fs::remove_file(&socket);
    vol.flush().await?;
    let p = e.detach(t, ws).await?;
    if !g.json {
        eprintln!(
            "detached {ws}{}",
            p.map(|p| format!(": head v{}", p.version))
                .unwrap_or_default()
        );
    }
    Ok(())
}
