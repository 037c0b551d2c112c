//! vhost-user-blk in a real guest: the host runs this build's daemon; QEMU (TCG, guest memory
//! from a shared memfd, as vhost-user needs) boots Debian's kernel with a `vhost-user-blk-pci`
//! disk on the workspace's socket, and the guest's virtio-blk driver talks to strata directly.
//! `tests/guest/vhost.sh` says what the guest checks.
//!
//! 1. The guest makes ext4 on the disk and writes fsync'd files; the host checkpoints the
//!    workspace while the guest runs; the guest writes more fsync'd files.
//! 2. QEMU is killed (the guest's power cut), then the daemon (`kill -9`), and the daemon is
//!    restarted on the same data directory: it serves the workspace over vhost-user again, on
//!    the same socket. The checkpoint is forked into a second workspace, attached the same way.
//! 3. A second guest with both disks finds every fsync'd file on the first, exactly the
//!    pre-checkpoint files on the second, and e2fsck clean on both.
//! 4. While that guest writes fsync'd files, the daemon is killed with -9 and restarted: QEMU
//!    reconnects (`reconnect-ms`) and the writes go on, no I/O error, every file intact.

mod common;
#[path = "guest/kit.rs"]
mod kit;

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use kit::{initramfs, ready, Guest};

fn vhost_disk(id: &str, socket: &str, slot: u32) -> Vec<String> {
    vec![
        "-chardev".into(),
        // QEMU reconnects to a restarted backend (and waits for it at boot).
        format!("socket,id={id},path={socket},reconnect-ms=250"),
        "-device".into(),
        format!("vhost-user-blk-pci,chardev={id},num-queues=2,addr=0x{slot:x}"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_user_disk_survives_power_cut_and_daemon_kill_and_restores_a_live_checkpoint() {
    let Some(kit) = ready("vhost-user guest test") else {
        return;
    };
    let (root, work, _keep) = kit::workdir();
    std::fs::write(work.join("vhost.sh"), include_str!("guest/vhost.sh")).unwrap();
    let data = root.join("data");
    let modules = [
        "virtio_pci",
        "virtio_blk",
        "9pnet_virtio",
        "9p",
        "ext4",
        "crc32c_generic",
    ];
    let initrd = initramfs(&kit, &root, &modules, "vhost.sh");
    // vhost-user needs guest memory the backend can map: a shared memfd as big as -m.
    let memory = [
        "-object".to_string(),
        "memory-backend-memfd,id=mem,size=1536M,share=on".into(),
        "-machine".into(),
        "memory-backend=mem".into(),
    ];
    let started = Instant::now();

    let d = common::serve(&data, &[]);
    let api = common::tenant(&d.url, "vm-tenant").await;
    let (s, v) = api
        .post("/v1/workspaces", json!({"name": "vm", "size": 1u64 << 30}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, a) = api
        .post(
            "/v1/workspaces/vm/attach",
            json!({"protocol": "vhost-user"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{a}");
    assert_eq!(a["protocol"], "vhost-user");
    let socket = a["socket"].as_str().unwrap().to_string();
    // One front-end at a time: NBD on the same workspace is refused while vhost-user serves it.
    let (s, v) = api.post("/v1/workspaces/vm/attach", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");

    let mut args = memory.to_vec();
    args.extend(vhost_disk("vu0", &socket, 5));
    let mut g = Guest::boot(&kit, &initrd, &work, &args, 1);
    g.expect("STEP mounted", Duration::from_secs(300));
    g.expect("STEP pre-checkpoint files", Duration::from_secs(240));
    let (s, cp) = api
        .post("/v1/workspaces/vm/checkpoint", json!({"label": "live"}))
        .await;
    assert_eq!(s, StatusCode::OK, "{cp}");
    let version = cp["version"].as_u64().unwrap();
    std::fs::write(work.join("checkpointed"), b"").unwrap();
    g.expect("STEP checkpoint taken", Duration::from_secs(60));
    g.expect("STEP KILL-ME", Duration::from_secs(240));
    // The guest's power cut, then the daemon's.
    g.child.kill().unwrap();
    let _ = g.child.wait();
    drop(g);
    d.signal("KILL");
    drop(d);
    eprintln!(
        "phase 1 done in {:?}; QEMU and the daemon killed",
        started.elapsed()
    );

    let d = common::serve(&data, &[]);
    let api = common::Api::new(&d.url, &api.token);
    let (s, w) = api.get("/v1/workspaces/vm").await;
    assert_eq!(s, StatusCode::OK, "{w}");
    assert_eq!(
        w["attached"], true,
        "restart serves the workspace again: {w}"
    );
    assert_eq!(w["export"].as_str(), Some(socket.as_str()), "{w}");
    let (s, v) = api
        .post(
            "/v1/workspaces/vm/fork",
            json!({"name": "restored", "version": version}),
        )
        .await;
    assert!(s.is_success(), "{s} {v}");
    let (s, b) = api
        .post(
            "/v1/workspaces/restored/attach",
            json!({"protocol": "vhost-user", "queues": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let mut args = memory.to_vec();
    args.extend(vhost_disk("vu0", &socket, 5));
    args.extend(vhost_disk("vu1", b["socket"].as_str().unwrap(), 6));
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.replace("chardev=vu1,num-queues=2", "chardev=vu1,num-queues=1"))
        .collect();
    let mut g = Guest::boot(&kit, &initrd, &work, &args, 2);
    g.expect("STEP remounted", Duration::from_secs(300));
    g.expect("STEP every fsync'd file intact", Duration::from_secs(120));
    g.expect("STEP e2fsck -fn clean", Duration::from_secs(300));
    g.expect("STEP checkpoint restored", Duration::from_secs(120));
    g.expect("STEP restored e2fsck clean", Duration::from_secs(300));
    // The daemon killed and restarted under the guest's fsync'd writes.
    g.expect("STEP writer started", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(1500));
    d.signal("KILL");
    drop(d);
    let d = common::serve(&data, &[]);
    let api = common::Api::new(&d.url, &api.token);
    std::fs::write(work.join("restarted"), b"").unwrap();
    eprintln!("daemon killed and restarted under the guest's writes");
    g.expect("STEP writes went on", Duration::from_secs(300));
    g.expect("STEP DONE 2", Duration::from_secs(60));
    drop(g);
    // Detach with the VMM gone: the export stops and the final publish runs.
    let (s, v) = api.post("/v1/workspaces/vm/detach", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        !std::path::Path::new(&socket).exists(),
        "socket removed at detach"
    );
    eprintln!("vhost-user guest test done in {:?}", started.elapsed());
}
