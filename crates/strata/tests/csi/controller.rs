//! The controller half of `csi_lifecycle_on_two_nodes`: volumes from a template, a snapshot
//! and another volume; snapshots listed, paged and deleted; every call repeated.

use std::collections::HashMap;
use std::path::Path;

use strata_csi::pb;
use tonic::Code;

use super::*;

/// Controller volumes and snapshots on node A.
pub(crate) async fn controller(a: &mut NodeUnder, api: &Api) {
    let cv = |name: &str, params: &[(&str, &str)], src: Option<pb::volume_content_source::Type>| {
        pb::CreateVolumeRequest {
            name: name.into(),
            volume_capabilities: vec![writer()],
            parameters: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            volume_content_source: src.map(|t| pb::VolumeContentSource { r#type: Some(t) }),
            ..Default::default()
        }
    };
    let caps = a
        .ctl
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap();
    assert_eq!(caps.get_ref().capabilities.len(), 5);

    // From a template; again; the same name from elsewhere; bad requests.
    let v1 = made(&mut a.ctl, cv("pvc-1", &[("template", "fs-7f3")], None)).await;
    assert_eq!(v1.volume_id, "pvc-1");
    assert_eq!(v1.capacity_bytes, 64 << 20);
    let again = made(&mut a.ctl, cv("pvc-1", &[("template", "fs-7f3")], None)).await;
    assert_eq!(again.volume_id, v1.volume_id);
    // Asked for more than the template holds: grown once made (its filesystem at its mount).
    let mut big = cv("pvc-big", &[("template", "fs-7f3")], None);
    big.capacity_range = Some(pb::CapacityRange {
        required_bytes: (96 << 20) + 1,
        limit_bytes: 0,
    });
    assert_eq!(
        made(&mut a.ctl, big.clone()).await.capacity_bytes,
        (96 << 20) + 4096
    );
    assert_eq!(
        made(&mut a.ctl, big).await.capacity_bytes,
        (96 << 20) + 4096
    );
    a.ctl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: "pvc-big".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    code(
        a.ctl.create_volume(cv("pvc-1", &[], None)).await,
        Code::AlreadyExists,
        "the same name, an empty disk",
    );
    code(
        a.ctl.create_volume(cv("", &[], None)).await,
        Code::InvalidArgument,
        "no name",
    );
    let mut r = cv("pvc-x", &[], None);
    r.volume_capabilities.clear();
    code(
        a.ctl.create_volume(r).await,
        Code::InvalidArgument,
        "no capabilities",
    );
    code(
        a.ctl
            .create_volume(cv("pvc-x", &[("colour", "red")], None))
            .await,
        Code::InvalidArgument,
        "an unknown parameter",
    );
    let mut r = cv("pvc-x", &[], None);
    r.capacity_range = Some(pb::CapacityRange {
        required_bytes: 10 << 20,
        limit_bytes: 1 << 20,
    });
    code(
        a.ctl.create_volume(r).await,
        Code::OutOfRange,
        "required over limit",
    );
    code(
        a.ctl
            .create_volume(cv("pvc-x", &[], from_snapshot("pvc-1@999")))
            .await,
        Code::NotFound,
        "a missing snapshot",
    );
    let vc = a
        .ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: "pvc-1".into(),
            volume_capabilities: vec![writer()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(vc.get_ref().confirmed.is_some());
    code(
        a.ctl
            .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: "pvc-none".into(),
                volume_capabilities: vec![writer()],
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "validate an unknown volume",
    );

    // Publish it, write, snapshot it while mounted (frozen), twice by name.
    let t1 = kubelet_target(a, "pvc-pod");
    a.node
        .node_publish_volume(publish_req("pvc-1", &t1, HashMap::new()))
        .await
        .unwrap();
    let files = write_files(Path::new(&t1), 8, 2);
    let snap_req = pb::CreateSnapshotRequest {
        source_volume_id: "pvc-1".into(),
        name: "snapshot-1".into(),
        ..Default::default()
    };
    let snap = snapped(&mut a.ctl, snap_req.clone()).await;
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, "pvc-1");
    let snap2 = snapped(&mut a.ctl, snap_req.clone()).await;
    assert_eq!(snap2.snapshot_id, snap.snapshot_id);
    // Written after the snapshot: not in it.
    std::fs::write(Path::new(&t1).join("later"), b"after the snapshot").unwrap();

    // From the snapshot and from the volume: identical files.
    let from_snap = made(
        &mut a.ctl,
        cv("pvc-2", &[], from_snapshot(snap.snapshot_id.clone())),
    )
    .await;
    let t2 = kubelet_target(a, "pvc2-pod");
    a.node
        .node_publish_volume(publish_req(&from_snap.volume_id, &t2, HashMap::new()))
        .await
        .unwrap();
    assert_eq!(hashes(Path::new(&t2), &files), files, "from the snapshot");
    assert!(!Path::new(&t2).join("later").exists());
    let clone = made(&mut a.ctl, cv("pvc-3", &[], from_volume("pvc-1"))).await;
    let t3 = kubelet_target(a, "pvc3-pod");
    let mut ro = publish_req(&clone.volume_id, &t3, HashMap::new());
    ro.readonly = true;
    a.node.node_publish_volume(ro).await.unwrap();
    assert_eq!(hashes(Path::new(&t3), &files), files, "the clone");
    assert!(
        Path::new(&t3).join("later").exists(),
        "a clone has the volume's current state"
    );
    assert!(
        std::fs::write(Path::new(&t3).join("x"), b"x").is_err(),
        "a read-only publish refuses writes"
    );

    expansion(a, &t2, &files).await;

    // Snapshots listed, paged, filtered; deleted (twice).
    let _s2 = a
        .ctl
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: "pvc-2".into(),
            name: "snapshot-2".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    code(
        a.ctl
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: "pvc-2".into(),
                name: "snapshot-1".into(),
                ..Default::default()
            })
            .await,
        Code::AlreadyExists,
        "a snapshot name of another volume",
    );
    let list = |max: i32, token: &str, source: &str| pb::ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.into(),
        source_volume_id: source.into(),
        ..Default::default()
    };
    let all = a
        .ctl
        .list_snapshots(list(0, "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.entries.len(), 2, "{all:?}");
    let page = a
        .ctl
        .list_snapshots(list(1, "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.entries.len(), 1);
    assert!(!page.next_token.is_empty());
    let rest = a
        .ctl
        .list_snapshots(list(1, &page.next_token, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.entries.len(), 1);
    assert!(rest.next_token.is_empty());
    let of1 = a
        .ctl
        .list_snapshots(list(0, "", "pvc-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(of1.entries.len(), 1);
    code(
        a.ctl.list_snapshots(list(0, "zzz", "")).await,
        Code::Aborted,
        "a bad token",
    );
    let del = pb::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    };
    a.ctl.delete_snapshot(del.clone()).await.unwrap();
    a.ctl.delete_snapshot(del).await.unwrap();
    let of1 = a
        .ctl
        .list_snapshots(list(0, "", "pvc-1"))
        .await
        .unwrap()
        .into_inner();
    assert!(of1.entries.is_empty(), "deleted: {of1:?}");
    // The volume made from it is its own: still there, still whole.
    assert_eq!(hashes(Path::new(&t2), &files), files);

    // Deleting a volume in use is refused; unpublished, it goes (twice).
    let dv = |id: &str| pb::DeleteVolumeRequest {
        volume_id: id.into(),
        ..Default::default()
    };
    code(
        a.ctl.delete_volume(dv("pvc-2")).await,
        Code::FailedPrecondition,
        "delete a published volume",
    );
    for (id, t) in [("pvc-1", &t1), ("pvc-2", &t2), ("pvc-3", &t3)] {
        a.node
            .node_unpublish_volume(unpublish_req(id, t))
            .await
            .unwrap();
        a.ctl.delete_volume(dv(id)).await.unwrap();
        a.ctl.delete_volume(dv(id)).await.unwrap();
    }
    a.ctl.delete_volume(dv("never/was")).await.unwrap();
    let left = workspaces(api).await;
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(records(a), 0);
}

/// pvc-2 (64 MiB, published at `t2`) expanded to 160 MiB: the controller grows the disk, the
/// node the filesystem (online where the kernel lets this process; else the node says why
/// and the next publish grows it); then it holds more than the old disk. Again changes
/// nothing; bad requests get the spec's codes.
async fn expansion(
    a: &mut NodeUnder,
    t2: &str,
    files: &std::collections::BTreeMap<String, String>,
) {
    const MIB: i64 = 1 << 20;
    let ex = |id: &str, required: i64, limit: i64| pb::ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        volume_capability: Some(writer()),
        ..Default::default()
    };
    let before = df_size(t2);
    for _ in 0..2 {
        let r = a
            .ctl
            .controller_expand_volume(ex("pvc-2", 160 * MIB, 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (r.capacity_bytes, r.node_expansion_required),
            (160 * MIB, true)
        );
    }
    code(
        a.ctl
            .controller_expand_volume(ex("pvc-2", 32 * MIB, 32 * MIB))
            .await,
        Code::OutOfRange,
        "expand to less than the disk has",
    );
    code(
        a.ctl
            .controller_expand_volume(ex("pvc-none", 160 * MIB, 0))
            .await,
        Code::NotFound,
        "expand an unknown volume",
    );
    let mut r = ex("pvc-2", 160 * MIB, 0);
    r.capacity_range = None;
    code(
        a.ctl.controller_expand_volume(r).await,
        Code::InvalidArgument,
        "expand without a capacity range",
    );
    let mut r = ex("pvc-2", 160 * MIB, 0);
    r.volume_capability = Some(pb::VolumeCapability {
        access_type: Some(pb::volume_capability::AccessType::Block(
            pb::volume_capability::BlockVolume {},
        )),
        ..writer()
    });
    code(
        a.ctl.controller_expand_volume(r).await,
        Code::InvalidArgument,
        "expand a block volume",
    );
    let ne = |id: &str, path: &str| pb::NodeExpandVolumeRequest {
        volume_id: id.into(),
        volume_path: path.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: 160 * MIB,
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    code(
        a.node.node_expand_volume(ne("pvc-2", "/elsewhere")).await,
        Code::NotFound,
        "node expand at a path it is not published at",
    );
    code(
        a.node.node_expand_volume(ne("pvc-none", t2)).await,
        Code::NotFound,
        "node expand of an unknown volume",
    );
    match a.node.node_expand_volume(ne("pvc-2", t2)).await {
        Ok(r) => assert_eq!(r.into_inner().capacity_bytes, 160 * MIB),
        Err(s) => {
            assert!(!can_resize_online(), "node expand: {s:?}");
            assert!(s.message().contains("CAP_SYS_RESOURCE"), "{s:?}");
            eprintln!(
                "SKIPPED: NodeExpandVolume growing a mounted ext4 online (this machine \
                 withholds CAP_SYS_RESOURCE; the guest test grows one online): checking the \
                 refusal and the growth at the next publish"
            );
            a.node
                .node_unpublish_volume(unpublish_req("pvc-2", t2))
                .await
                .unwrap();
            a.node
                .node_publish_volume(publish_req("pvc-2", t2, HashMap::new()))
                .await
                .unwrap();
            let r = a.node.node_expand_volume(ne("pvc-2", t2)).await.unwrap();
            assert_eq!(r.into_inner().capacity_bytes, 160 * MIB);
        }
    }
    let after = df_size(t2);
    assert!(
        after as i64 > before as i64 + 80 * MIB,
        "df says {after}, was {before}"
    );
    // More than the whole old disk, then every file as it was.
    {
        use std::io::Write;
        let mut f = std::fs::File::create(Path::new(t2).join("big")).unwrap();
        let chunk = vec![7u8; MIB as usize];
        for _ in 0..80 {
            f.write_all(&chunk).unwrap();
        }
        f.sync_all().unwrap();
    }
    std::fs::remove_file(Path::new(t2).join("big")).unwrap();
    assert_eq!(hashes(Path::new(t2), files), *files, "after the expansion");
}

/// A volume content source: the snapshot `id`.
fn from_snapshot(id: impl Into<String>) -> Option<pb::volume_content_source::Type> {
    Some(pb::volume_content_source::Type::Snapshot(
        pb::volume_content_source::SnapshotSource {
            snapshot_id: id.into(),
        },
    ))
}

/// A volume content source: the volume `id`.
fn from_volume(id: impl Into<String>) -> Option<pb::volume_content_source::Type> {
    Some(pb::volume_content_source::Type::Volume(
        pb::volume_content_source::VolumeSource {
            volume_id: id.into(),
        },
    ))
}

async fn made(ctl: &mut ControllerClient<Channel>, r: pb::CreateVolumeRequest) -> pb::Volume {
    ctl.create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

async fn snapped(
    ctl: &mut ControllerClient<Channel>,
    r: pb::CreateSnapshotRequest,
) -> pb::Snapshot {
    ctl.create_snapshot(r)
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap()
}
