//! The CSI driver (`strata csi`) driven through its unix socket by a real gRPC client, in
//! front of real daemons (FUSE + loop + ext4 mounts, shared PostgreSQL catalog and S3 store):
//! an inline ephemeral workspace is published, written, unpublished with a checkpoint and
//! published again on a second node with its files; controller volumes come from a template,
//! a snapshot and another volume with identical files; every call is repeated (idempotent)
//! and bad requests get the spec's codes; a failed publish leaves nothing behind; a daemon
//! killed under a published volume is bound again.

mod common;
#[path = "csi/controller.rs"]
mod controller;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use strata_csi::pb;
use strata_csi::pb::controller_client::ControllerClient;
use strata_csi::pb::identity_client::IdentityClient;
use strata_csi::pb::node_client::NodeClient;
use tonic::transport::Channel;
use tonic::Code;

fn can_host_mount() -> bool {
    let tools = ["losetup", "mkfs.ext4", "e2fsck", "fsfreeze", "fusermount3"];
    let ok = is_root() && tools.iter().all(|t| have(t)) && Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs as root with fuse, loop devices and e2fsprogs"
        );
        eprintln!("SKIPPED: the CSI tests need root, /dev/fuse, loop devices and {tools:?}");
    }
    ok
}

/// A running `strata csi`; killed when dropped.
struct Csi {
    child: Child,
    sock: PathBuf,
}

impl Drop for Csi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One node: a daemon with its mount root, and the CSI driver in front of it.
struct NodeUnder {
    daemon: Daemon,
    _csi: Csi,
    dir: PathBuf,
    node: NodeClient<Channel>,
    ctl: ControllerClient<Channel>,
    id: IdentityClient<Channel>,
}

fn start_csi(dir: &Path, url: &str, token: &str, node_id: &str) -> Csi {
    start_csi_env(dir, url, token, node_id, &[])
}

fn start_csi_env(dir: &Path, url: &str, token: &str, node_id: &str, env: &[(&str, &str)]) -> Csi {
    let sock = dir.join("csi.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["csi", "--endpoint"])
        .arg(format!("unix://{}", sock.display()))
        .args(["--daemon-url", url, "--node-id", node_id])
        .arg("--state-dir")
        .arg(dir.join("csi-state"))
        .arg("--staging-dir")
        .arg(dir.join("root/kube/csi"))
        .env("STRATA_TOKEN", token)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    // Printed once it listens, after undoing or rebinding what a restart interrupted.
    assert!(line.contains("csi.strata.dev"), "{line:?}");
    Csi { child, sock }
}

async fn node_under(sh: &Shared, dir: &Path, id: &str, token: Option<&str>) -> (NodeUnder, String) {
    std::fs::create_dir_all(dir.join("root")).unwrap();
    let root = dir.join("root");
    let daemon = sh.node(
        &dir.join("data"),
        id,
        &["--mount-root", root.to_str().unwrap()],
    );
    let token = match token {
        Some(t) => t.to_string(),
        None => tenant(&daemon.url, "kube").await.token,
    };
    std::fs::create_dir_all(root.join("kube")).unwrap();
    let csi = start_csi(dir, &daemon.url, &token, id);
    let ch = strata_csi::client::connect(&csi.sock).await.unwrap();
    (
        NodeUnder {
            daemon,
            _csi: csi,
            dir: dir.to_path_buf(),
            node: NodeClient::new(ch.clone()),
            ctl: ControllerClient::new(ch.clone()),
            id: IdentityClient::new(ch),
        },
        token,
    )
}

fn mount_cap(mode: pb::volume_capability::access_mode::Mode) -> pb::VolumeCapability {
    use pb::volume_capability::*;
    pb::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

fn writer() -> pb::VolumeCapability {
    mount_cap(pb::volume_capability::access_mode::Mode::SingleNodeWriter)
}

fn pod_ctx(extra: &[(&str, &str)]) -> HashMap<String, String> {
    let mut m: HashMap<String, String> = [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.namespace", "agents"),
        ("csi.storage.k8s.io/pod.name", "run-7"),
        ("csi.storage.k8s.io/pod.uid", "0f7c1c7e"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for (k, v) in extra {
        m.insert(k.to_string(), v.to_string());
    }
    m
}

/// The kubelet's target for a pod's volume (its parent exists, the target does not).
fn kubelet_target(n: &NodeUnder, pod: &str) -> String {
    let parent = n
        .dir
        .join(format!("kubelet/pods/{pod}/volumes/kubernetes.io~csi/work"));
    std::fs::create_dir_all(&parent).unwrap();
    parent.join("mount").to_string_lossy().into_owned()
}

fn publish_req(
    volume_id: &str,
    target: &str,
    ctx: HashMap<String, String>,
) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.into(),
        volume_capability: Some(writer()),
        volume_context: ctx,
        ..Default::default()
    }
}

fn unpublish_req(volume_id: &str, target: &str) -> pb::NodeUnpublishVolumeRequest {
    pb::NodeUnpublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.into(),
    }
}

#[track_caller]
fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>, want: Code, what: &str) {
    match r {
        Ok(v) => panic!("{what}: expected {want:?}, got {v:?}"),
        Err(s) => assert_eq!(s.code(), want, "{what}: {}", s.message()),
    }
}

async fn workspaces(api: &Api) -> Vec<String> {
    let (_, v) = api.get("/v1/workspaces").await;
    v.as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap().to_string())
        .collect()
}

fn records(n: &NodeUnder) -> usize {
    std::fs::read_dir(n.dir.join("csi-state"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_lifecycle_on_two_nodes() {
    if !can_host_mount() {
        return;
    }
    let Some(sh) = shared("csi").await else {
        eprintln!(
            "SKIPPED: the CSI test needs STRATA_TEST_PG and STRATA_TEST_S3_ENDPOINT (two nodes)"
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // Mounts a failed run leaves (its daemons die with them up) go with the test.
    let _cleanup = Cleanup(tmp.path().to_path_buf());
    let (mut a, token) = node_under(&sh, &tmp.path().join("a"), "node-a", None).await;
    let api = a.daemon.api(&token);

    // Identity.
    let info =
        a.id.get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .unwrap();
    assert_eq!(info.get_ref().name, "csi.strata.dev");
    let probe = a.id.probe(pb::ProbeRequest {}).await.unwrap();
    assert_eq!(probe.get_ref().ready, Some(true));
    let caps =
        a.id.get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
            .await
            .unwrap();
    assert_eq!(
        caps.get_ref().capabilities.len(),
        2,
        "the controller service, online volume expansion"
    );
    let ni = a
        .node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap();
    assert_eq!(ni.get_ref().node_id, "node-a");

    // A template with a file in it.
    let src = tmp.path().join("tpl");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/motd"), b"from the template\n").unwrap();
    let (s, v) = api.template_from_dir("fs-7f3", &src, 64 << 20).await;
    assert!(s.is_success(), "{v}");

    // Bad publishes: the spec's codes, and nothing left behind.
    let t0 = kubelet_target(&a, "bad");
    let good = || publish_req("csi-vol-bad", &t0, pod_ctx(&[("template", "fs-7f3")]));
    let with = |f: &dyn Fn(&mut pb::NodePublishVolumeRequest)| {
        let mut r = good();
        f(&mut r);
        r
    };
    let attrs = |kv: &[(&str, &str)]| publish_req("csi-vol-bad", &t0, pod_ctx(kv));
    let bad = [
        (
            "no volume id",
            Code::InvalidArgument,
            with(&|r| r.volume_id.clear()),
        ),
        (
            "no target",
            Code::InvalidArgument,
            with(&|r| r.target_path.clear()),
        ),
        (
            "relative target",
            Code::InvalidArgument,
            with(&|r| r.target_path = "relative/mount".into()),
        ),
        (
            "no capability",
            Code::InvalidArgument,
            with(&|r| r.volume_capability = None),
        ),
        (
            "block access",
            Code::InvalidArgument,
            with(&|r| {
                r.volume_capability = Some(pb::VolumeCapability {
                    access_mode: writer().access_mode,
                    access_type: Some(pb::volume_capability::AccessType::Block(Default::default())),
                })
            }),
        ),
        (
            "multi-node writer",
            Code::InvalidArgument,
            with(&|r| {
                r.volume_capability = Some(mount_cap(
                    pb::volume_capability::access_mode::Mode::MultiNodeMultiWriter,
                ))
            }),
        ),
        (
            "misspelt attribute",
            Code::InvalidArgument,
            attrs(&[("tempalte", "fs-7f3")]),
        ),
        (
            "a path as workspace",
            Code::InvalidArgument,
            attrs(&[("workspace", "../../etc")]),
        ),
        ("nothing to create from", Code::InvalidArgument, attrs(&[])),
        (
            "a missing template",
            Code::NotFound,
            attrs(&[("template", "no-such-template")]),
        ),
    ];
    for (what, want, r) in bad {
        code(a.node.node_publish_volume(r).await, want, what);
    }
    assert!(
        workspaces(&api).await.is_empty(),
        "a failed publish creates nothing"
    );
    assert_eq!(records(&a), 0, "a failed publish records nothing");
    assert!(!is_mount_point(&t0));

    // Publish an inline workspace, write, publish again (idempotent), conflicting publish.
    let target = kubelet_target(&a, "pod-1");
    let ctx = pod_ctx(&[("template", "fs-7f3"), ("workspace", "ws-{pod.name}")]);
    let req = publish_req("csi-vol-1", &target, ctx.clone());
    a.node.node_publish_volume(req.clone()).await.unwrap();
    assert!(is_mount_point(&target), "the target is a mount");
    assert_eq!(
        std::fs::read(Path::new(&target).join("etc/motd")).unwrap(),
        b"from the template\n"
    );
    let files = write_files(Path::new(&target), 12, 1);
    a.node.node_publish_volume(req.clone()).await.unwrap();
    let other = kubelet_target(&a, "pod-1b");
    code(
        a.node
            .node_publish_volume(publish_req("csi-vol-1", &other, ctx.clone()))
            .await,
        Code::FailedPrecondition,
        "the same volume at another target",
    );
    // Another pod naming the same workspace while it is in use: refused, and this
    // failure takes nothing of the first pod's away.
    code(
        a.node
            .node_publish_volume(publish_req("csi-vol-2", &other, ctx.clone()))
            .await,
        Code::FailedPrecondition,
        "a workspace in use by another pod",
    );
    assert!(is_mount_point(&target));
    assert_eq!(hashes(Path::new(&target), &files), files);

    let stats = a
        .node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: "csi-vol-1".into(),
            volume_path: target.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(stats.get_ref().usage[0].total > 32 << 20, "{stats:?}");
    code(
        a.node
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: "csi-vol-9".into(),
                volume_path: target.clone(),
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "stats of a volume not here",
    );

    // The daemon killed under the published volume: it mounts again at restart and the
    // driver binds the target onto the new mount.
    let dev = |p: &str| std::os::unix::fs::MetadataExt::dev(&std::fs::metadata(p).unwrap());
    let before = dev(&target);
    a.daemon.signal("KILL");
    let _ = a.daemon.child.wait();
    let root = a.dir.join("root");
    let listen = a.daemon.url.trim_start_matches("http://").to_string();
    a.daemon = sh.node(
        &a.dir.join("data"),
        "node-a",
        &["--mount-root", root.to_str().unwrap(), "--listen", &listen],
    );
    let mut back = false;
    for _ in 0..60 {
        // A new filesystem at the target (the old one's cache would still read).
        if dev(&target) != before && hashes(Path::new(&target), &files) == files {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        back,
        "the target shows the workspace again after the daemon's restart"
    );
    let mut files = files;
    files.extend(write_files(Path::new(&target), 2, 3));
    let api = a.daemon.api(&token);

    // Unpublish: checkpointed, detached, the target gone; again is fine.
    a.node
        .node_unpublish_volume(unpublish_req("csi-vol-1", &target))
        .await
        .unwrap();
    assert!(
        !Path::new(&target).exists(),
        "the target directory is removed"
    );
    a.node
        .node_unpublish_volume(unpublish_req("csi-vol-1", &target))
        .await
        .unwrap();
    assert_eq!(records(&a), 0);
    let (_, v) = api.get("/v1/workspaces/agents.ws-run-7").await;
    assert_eq!(v["attached"], false, "{v}");

    // The same pod on another node: its files are there. Discarded at its end.
    let (mut b, _) = node_under(&sh, &tmp.path().join("b"), "node-b", Some(&token)).await;
    let tb = kubelet_target(&b, "pod-1-again");
    let ctx_b = pod_ctx(&[
        ("template", "fs-7f3"),
        ("workspace", "ws-{pod.name}"),
        ("onUnpublish", "discard"),
    ]);
    b.node
        .node_publish_volume(publish_req("csi-vol-7", &tb, ctx_b))
        .await
        .unwrap();
    assert_eq!(hashes(Path::new(&tb), &files), files, "resumed on node B");
    b.node
        .node_unpublish_volume(unpublish_req("csi-vol-7", &tb))
        .await
        .unwrap();
    assert!(
        !workspaces(&api)
            .await
            .contains(&"agents.ws-run-7".to_string()),
        "discarded"
    );

    controller::controller(&mut a, &api).await;
    drop(b);
}

/// One node on the embedded catalog and a local store, with tenant `kube`. Its fields drop in
/// order: the daemon, then the mounts a failed run left, then the directory.
struct OneNode {
    daemon: Daemon,
    api: Api,
    _cleanup: Cleanup,
    tmp: tempfile::TempDir,
}

async fn one_node() -> OneNode {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir_all(root.join("kube")).unwrap();
    let daemon = serve(
        &tmp.path().join("data"),
        &["--mount-root", root.to_str().unwrap()],
    );
    let api = tenant(&daemon.url, "kube").await;
    OneNode {
        daemon,
        api,
        _cleanup: Cleanup(tmp.path().to_path_buf()),
        tmp,
    }
}

/// The CSI community's conformance suite against the driver on one node, when a `csi-sanity`
/// binary is named by `STRATA_CSI_SANITY` (docs/CSI.md says how it was built here: it is Go,
/// and nothing may be downloaded at test time, so CI cannot build it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_sanity_conformance() {
    let Some(bin) = std::env::var_os("STRATA_CSI_SANITY").filter(|b| !b.is_empty()) else {
        eprintln!(
            "SKIPPED: csi-sanity conformance (set STRATA_CSI_SANITY to a csi-sanity binary; see docs/CSI.md)"
        );
        return;
    };
    if !can_host_mount() {
        return;
    }
    let one = one_node().await;
    let (dir, daemon, api) = (one.tmp.path(), &one.daemon, &one.api);
    let csi = start_csi(dir, &daemon.url, &api.token, "node-a");
    let out = Command::new(bin)
        .arg(format!("--csi.endpoint=unix://{}", csi.sock.display()))
        .arg(format!(
            "--csi.mountdir={}",
            dir.join("sanity-mount").display()
        ))
        .arg(format!(
            "--csi.stagingdir={}",
            dir.join("sanity-staging").display()
        ))
        .arg("--csi.testvolumesize=268435456")
        .arg("--ginkgo.v")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "csi-sanity failed (its output is above)"
    );
}

/// The plugin killed in the middle of a publish (every step done but the record that says so,
/// `STRATA_CSI_FAULT`): at its next start it undoes the publish from its record, so the
/// workspace it created, the daemon's mount and the target's bind are all gone.
/// A plugin on node-a that aborts each publish before recording it as published.
fn start_faulty(dir: &Path, url: &str, token: &str) -> Csi {
    start_csi_env(
        dir,
        url,
        token,
        "node-a",
        &[("STRATA_CSI_FAULT", "abort-before-published")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_mid_publish_undoes_it_at_start() {
    if !can_host_mount() {
        return;
    }
    let one = one_node().await;
    let (dir, daemon, api) = (one.tmp.path(), &one.daemon, &one.api);
    let mut faulty = start_faulty(dir, &daemon.url, &api.token);
    let ch = strata_csi::client::connect(&faulty.sock).await.unwrap();
    let mut node = NodeClient::new(ch);
    let parent = dir.join("kubelet/pods/p/volumes/kubernetes.io~csi/work");
    std::fs::create_dir_all(&parent).unwrap();
    let target = parent.join("mount").to_string_lossy().into_owned();
    let r = node
        .node_publish_volume(publish_req(
            "csi-vol-k",
            &target,
            pod_ctx(&[("size", "64Mi")]),
        ))
        .await;
    assert!(r.is_err(), "the plugin died during the call");
    let _ = faulty.child.wait();
    assert!(is_mount_point(&target), "killed after the bind");
    assert_eq!(workspaces(api).await, ["agents.run-7"]);
    drop(faulty);

    let csi = start_csi(dir, &daemon.url, &api.token, "node-a");
    let ch = strata_csi::client::connect(&csi.sock).await.unwrap();
    let mut node = NodeClient::new(ch);
    assert!(!is_mount_point(&target), "the bind is undone at start");
    assert!(
        workspaces(api).await.is_empty(),
        "the workspace it created is deleted"
    );
    let (_, mounts) = api.get("/v1/mounts").await;
    assert_eq!(
        mounts,
        serde_json::json!([]),
        "the daemon's mount is undone"
    );
    assert_eq!(
        std::fs::read_dir(dir.join("csi-state")).unwrap().count(),
        0,
        "no record is left"
    );
    // The kubelet's retry then publishes it whole.
    node.node_publish_volume(publish_req(
        "csi-vol-k",
        &target,
        pod_ctx(&[("size", "64Mi")]),
    ))
    .await
    .unwrap();
    assert!(is_mount_point(&target));
    node.node_unpublish_volume(unpublish_req("csi-vol-k", &target))
        .await
        .unwrap();
    drop(csi);

    // Killed again, and before it is back another pod attaches the workspace it created:
    // the late undo must leave that workspace (it is theirs now), not delete it.
    let mut faulty = start_faulty(dir, &daemon.url, &api.token);
    let mut node = NodeClient::new(strata_csi::client::connect(&faulty.sock).await.unwrap());
    let ctx = pod_ctx(&[("size", "64Mi"), ("workspace", "other")]);
    let r = node
        .node_publish_volume(publish_req("csi-vol-y", &target, ctx))
        .await;
    assert!(r.is_err());
    let _ = faulty.child.wait();
    drop(faulty);
    std::process::Command::new("umount")
        .args(["-l", &target])
        .status()
        .unwrap();
    let (s, v) = api.delete("/v1/workspaces/agents.other/mount").await;
    assert!(s.is_success(), "{v}");
    let (s, v) = api
        .post("/v1/workspaces/agents.other/attach", serde_json::json!({}))
        .await;
    assert!(s.is_success(), "{v}");
    let (s, v) = api
        .post("/v1/workspaces/agents.other/detach", serde_json::json!({}))
        .await;
    assert!(s.is_success(), "{v}");
    let csi = start_csi(dir, &daemon.url, &api.token, "node-a");
    assert_eq!(
        workspaces(api).await,
        ["agents.other", "agents.run-7"],
        "a workspace another attach has used since is not deleted by a late undo (and run-7 was checkpointed, kept)"
    );
    assert_eq!(std::fs::read_dir(dir.join("csi-state")).unwrap().count(), 0);

    // An ephemeral-mode workspace with the default onUnpublish keeps the pod's work (its
    // detach publishes nothing; the unpublish's checkpoint does).
    let mut node = NodeClient::new(strata_csi::client::connect(&csi.sock).await.unwrap());
    let ctx = pod_ctx(&[
        ("size", "64Mi"),
        ("workspace", "eph"),
        ("mode", "ephemeral"),
    ]);
    node.node_publish_volume(publish_req("csi-vol-e", &target, ctx.clone()))
        .await
        .unwrap();
    let files = write_files(Path::new(&target), 3, 9);
    node.node_unpublish_volume(unpublish_req("csi-vol-e", &target))
        .await
        .unwrap();
    node.node_publish_volume(publish_req("csi-vol-e2", &target, ctx))
        .await
        .unwrap();
    assert_eq!(hashes(Path::new(&target), &files), files, "kept");
    node.node_unpublish_volume(unpublish_req("csi-vol-e2", &target))
        .await
        .unwrap();
}
