//! `strata demo`: the lifecycle on a throwaway data directory, explained as it runs.
//!
//! The "sandbox" is played by debugfs: it edits a copy of the disk (adds a file to the ext4
//! filesystem) and the demo writes every changed block over NBD, through the daemon's export of
//! the workspace, exactly the blocks a guest would have written, then FLUSHes.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use strata_catalog::SqliteCatalog;
use strata_engine::fs::RealFs;
use strata_engine::{Engine, EngineConfig, Mode, Source};
use strata_store::Store;

const TENANT: &str = "demo";

fn sh(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .map_err(|e| anyhow::anyhow!("running {cmd:?}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn step(json: bool, t: Instant, what: &str) {
    if !json {
        println!("[{:>7.1} ms] {what}", t.elapsed().as_secs_f64() * 1000.0);
    }
}

pub async fn run(json: bool) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("strata-demo-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let res = run_in(&root, json).await;
    let _ = std::fs::remove_dir_all(&root);
    res
}

async fn run_in(root: &Path, json: bool) -> anyhow::Result<()> {
    let t = Instant::now();
    let src = root.join("project");
    std::fs::create_dir_all(src.join("src"))?;
    std::fs::write(src.join("README.md"), "# a sandbox project\n")?;
    std::fs::write(
        src.join("src/main.py"),
        "print('hello from the template')\n",
    )?;
    let a = Engine::open_embedded(EngineConfig::new(root.join("node-a"))).await?;
    a.ensure_tenant(TENANT).await?;
    step(
        json,
        t,
        &format!(
            "node A up: embedded catalog + object directory in {}",
            root.join("node-a").display()
        ),
    );

    let tpl = a
        .build_template_from_dir(TENANT, "python-base", &src, Some(64 << 20), &|_, _| {})
        .await?;
    step(
        json,
        t,
        &format!(
            "template python-base built with mkfs.ext4 -d: 64 MiB disk, {} KiB stored",
            tpl.stored_bytes >> 10
        ),
    );

    a.create_workspace(
        TENANT,
        "agent-1",
        Source::Template("python-base".into()),
        Mode::Durable,
        None,
    )
    .await?;
    let daemon = strata_daemon::Daemon::new(a.clone(), Default::default())?;
    let att = daemon
        .attach(TENANT, "agent-1")
        .await
        .map_err(anyhow::Error::msg)?;
    let mut nbd =
        strata_nbd::client::Client::connect_unix(Path::new(&att.socket), "agent-1").await?;
    step(
        json,
        t,
        &format!(
            "workspace agent-1 created (durable), exported at {}",
            att.export
        ),
    );

    // The "sandbox" adds a file to the filesystem; we write the blocks it changed.
    let before = root.join("before.img");
    let after = root.join("after.img");
    a.export(TENANT, "agent-1", None, &before).await?;
    std::fs::copy(&before, &after)?;
    let notes = root.join("notes.txt");
    std::fs::write(&notes, "the agent learned something worth keeping\n")?;
    sh(Command::new("debugfs")
        .arg("-w")
        .arg("-R")
        .arg(format!("write {} notes.txt", notes.display()))
        .arg(&after))?;
    let (b0, b1) = (std::fs::read(&before)?, std::fs::read(&after)?);
    let mut changed = 0;
    for (i, (x, y)) in b0.chunks(4096).zip(b1.chunks(4096)).enumerate() {
        if x != y {
            nbd.write(i as u64 * 4096, y, false).await?;
            changed += 1;
        }
    }
    nbd.flush().await?;
    nbd.disconnect().await?;
    step(
        json,
        t,
        &format!(
            "sandbox wrote notes.txt over NBD: {changed} blocks, FLUSH returned (journal fsync'd)"
        ),
    );

    let cp = a
        .checkpoint(TENANT, "agent-1", Some("learned".into()))
        .await?;
    step(
        json,
        t,
        &format!(
            "checkpoint v{}: {} KiB uploaded, writes stalled {:?}",
            cp.version,
            cp.bytes_uploaded >> 10,
            cp.stall
        ),
    );

    let f0 = Instant::now();
    a.fork(TENANT, "agent-1", Some(cp.version), "agent-2", None)
        .await?;
    step(
        json,
        t,
        &format!(
            "fork agent-2 from agent-1@v{} in {:?} (no data copied)",
            cp.version,
            f0.elapsed()
        ),
    );

    // Node B: another data directory sharing only the catalog and the object store.
    let catalog = Arc::new(SqliteCatalog::open(&root.join("node-a/catalog.db"))?);
    let store = Store::open(&format!("file:{}", root.join("node-a/objects").display()))?;
    let mut cfg = EngineConfig::new(root.join("node-b"));
    cfg.node_id = Some("node-b".into());
    let b = Engine::open_with(cfg, catalog, store, Arc::new(RealFs))?;
    let r0 = Instant::now();
    let vb = b.attach(TENANT, "agent-2").await?;
    let restored = root.join("restored.img");
    let img = vb.read(0, vb.size()).await?;
    std::fs::write(&restored, &img)?;
    b.detach(TENANT, "agent-2").await?;
    let cat = sh(Command::new("debugfs")
        .arg("-R")
        .arg("cat /notes.txt")
        .arg(&restored))?;
    sh(Command::new("e2fsck").args(["-f", "-n"]).arg(&restored))?;
    step(
        json,
        t,
        &format!(
            "node B restored agent-2 from its head in {:?}; e2fsck clean; /notes.txt says: {}",
            r0.elapsed(),
            cat.trim()
        ),
    );
    daemon.shutdown().await;

    if json {
        println!(
            "{}",
            serde_json::json!({"ok": true, "elapsed_ms": t.elapsed().as_millis() as u64, "notes": cat.trim()})
        );
    } else {
        println!("\nWhat each mode promises (docs/DURABILITY.md says how each row is tested):");
        println!("  mode       FLUSH returns when          kill -9   power loss   host lost");
        println!("  ephemeral  immediately                 -         -            -");
        println!("  durable    local journal fsync'd       kept      kept         up to last upload (window measured)");
        println!("  sync       committed in object store   kept      kept         kept");
    }
    Ok(())
}
