//! Interoperability with real NBD clients: qemu-img, qemu-io, nbdinfo, nbdcopy, fio's nbd
//! engine, and a real ext4 through nbdfuse + a loop device.

mod common;

use std::time::Duration;

use common::*;
use strata_nbd::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_and_qemu_io() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("q", 64 << 20).await;
    let uri = rig.uri("q");
    let info = run(cmd("qemu-img", &["info", "--output=json", &uri])).await;
    assert!(info.contains("\"virtual-size\": 67108864"), "{info}");
    let out = run(cmd(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "write -P 0xcd 1536k 100k",
            "-c",
            "flush",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "read -P 0xcd 1536k 100k",
            "-c",
            "discard 256k 256k",
            "-c",
            "read -P 0 256k 256k",
            "-c",
            "write -z 4M 2M",
            "-c",
            "read -P 0 4M 2M",
            "-c",
            "write -P 0x11 777 5000",
            "-c",
            "read -P 0x11 777 5000",
            "-c",
            "aio_write -P 0x22 8M 64k",
            "-c",
            "aio_write -P 0x33 9M 64k",
            "-c",
            "aio_flush",
            "-c",
            "read -P 0x22 8M 64k",
            "-c",
            "read -P 0x33 9M 64k",
        ],
    ))
    .await;
    assert!(!out.contains("fail") && !out.contains("error"), "{out}");
    // qemu-img convert out of the export equals what the volume holds.
    let out_img = rig.path("q.raw");
    run(cmd(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &uri,
            out_img.to_str().unwrap(),
        ],
    ))
    .await;
    let got = std::fs::read(&out_img).unwrap();
    let v = rig.engine.volume(TENANT, "q").unwrap();
    assert!(got == v.read(0, 64 << 20).await.unwrap());
    assert!(got[8192..256 << 10].iter().all(|&b| b == 0xab));
    assert!(got[777..5777].iter().all(|&b| b == 0x11));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_and_nbdcopy_both_ways() {
    if !require(&["nbdinfo", "nbdcopy"]) {
        return;
    }
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("a", 32 << 20).await;
    rig.workspace("b", 32 << 20).await;
    let list = run(cmd(
        "nbdinfo",
        &[
            "--list",
            &format!("nbd+unix://?socket={}", rig.socket.display()),
        ],
    ))
    .await;
    assert!(
        list.contains("export=\"a\"") || list.contains("export=a") || list.contains("\"a\""),
        "{list}"
    );
    assert!(list.contains("b"), "{list}");
    assert_eq!(
        run(cmd("nbdinfo", &["--size", &rig.uri("a")])).await.trim(),
        (32u64 << 20).to_string()
    );
    let can = tokio::task::spawn_blocking({
        let u = rig.uri("a");
        move || {
            cmd("nbdinfo", &["--can", "multi-conn", &u])
                .status()
                .unwrap()
                .success()
        }
    })
    .await
    .unwrap();
    assert!(can, "multi-conn must be advertised");
    let full = run(cmd("nbdinfo", &["--json", &rig.uri("a")])).await;
    assert!(full.contains("base:allocation"), "{full}");
    // Copy a file in, then from one export to another, then out, and compare.
    let src = rig.path("src.raw");
    let mut data = vec![0u8; 32 << 20];
    for (i, chunk) in data.chunks_mut(1 << 20).enumerate() {
        if i % 3 != 0 {
            chunk.fill(i as u8 + 1);
        }
    }
    std::fs::write(&src, &data).unwrap();
    run(cmd("nbdcopy", &[src.to_str().unwrap(), &rig.uri("a")])).await;
    run(cmd("nbdcopy", &[&rig.uri("a"), &rig.uri("b")])).await;
    let dst = rig.path("dst.raw");
    run(cmd("nbdcopy", &[&rig.uri("b"), dst.to_str().unwrap()])).await;
    assert!(std::fs::read(&dst).unwrap() == data);
    // The map shows written chunks as data and never-written ones as holes.
    let map = run(cmd("nbdinfo", &["--map", &rig.uri("a")])).await;
    assert!(map.contains("data") && map.contains("hole"), "{map}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_nbd_engine_with_verification() {
    if !require(&["fio"]) {
        return;
    }
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("f", 64 << 20).await;
    let uri = rig.uri("f");
    let out = run(cmd(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--size=32M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            "--verify_fatal=1",
            "--fsync=64",
            "--output-format=terse",
        ],
    ))
    .await;
    assert!(!out.is_empty());
    let out = run(cmd(
        "fio",
        &[
            "--name=mixed",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bsrange=512-128k",
            "--size=32M",
            "--iodepth=8",
            "--numjobs=2",
            "--runtime=3",
            "--time_based",
            "--output-format=terse",
        ],
    ))
    .await;
    assert!(!out.is_empty());
}

/// A real ext4 on the export: nbdfuse exposes it as a file, a loop device mounts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_through_nbdfuse_and_a_loop_device() {
    if !require(&["nbdfuse", "losetup", "mkfs.ext4", "e2fsck", "fusermount3"]) {
        return;
    }
    if unsafe_geteuid() != 0 {
        assert!(std::env::var("CI").is_err(), "CI runs as root");
        eprintln!("skipping: needs root for losetup and mount");
        return;
    }
    let rig = Rig::new(ServerConfig::default()).await;
    rig.workspace("e", 128 << 20).await;
    let fuse_dir = rig.path("fuse");
    let mnt = rig.path("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let file = fuse_dir.join("disk");
    let script = format!(
        r#"set -eu
fuse={fuse}; mnt={mnt}; file={file}; uri='{uri}'
nbdfuse -P {pid} "$file" "$uri" & 
for i in $(seq 1 100); do [ -s {pid} ] && break; sleep 0.1; done
cleanup() {{ umount "$mnt" 2>/dev/null || true; [ -n "${{loop:-}}" ] && losetup -d "$loop" 2>/dev/null || true; fusermount3 -u "$fuse" 2>/dev/null || true; }}
trap cleanup EXIT
mkfs.ext4 -q -F "$file"
loop=$(losetup -f --show "$file")
mount "$loop" "$mnt"
mkdir -p "$mnt/work"
for i in $(seq 1 20); do head -c $((i * 10000)) /dev/urandom > "$mnt/work/f$i"; done
(cd "$mnt/work" && sha256sum f* > ../SUMS)
sync -f "$mnt/SUMS"
umount "$mnt"
e2fsck -f -n "$loop"
losetup -d "$loop"; loop=
"#,
        fuse = fuse_dir.display(),
        mnt = mnt.display(),
        file = file.display(),
        uri = rig.uri("e"),
        pid = rig.path("nbdfuse.pid").display(),
    );
    let mut c = cmd("bash", &["-c", &script]);
    c.env("PATH", std::env::var("PATH").unwrap_or_default());
    run(c).await;
    // Give nbdfuse a moment to disconnect, then detach (publishes) and attach again.
    tokio::time::sleep(Duration::from_millis(200)).await;
    rig.exports.remove("e");
    rig.engine.detach(TENANT, "e").await.unwrap();
    rig.export("e").await;
    let _ = std::fs::remove_file(rig.path("nbdfuse.pid"));
    let verify = format!(
        r#"set -eu
fuse={fuse}; mnt={mnt}; file={file}; uri='{uri}'
nbdfuse -P {pid} "$file" "$uri" &
for i in $(seq 1 100); do [ -s {pid} ] && break; sleep 0.1; done
cleanup() {{ umount "$mnt" 2>/dev/null || true; [ -n "${{loop:-}}" ] && losetup -d "$loop" 2>/dev/null || true; fusermount3 -u "$fuse" 2>/dev/null || true; }}
trap cleanup EXIT
loop=$(losetup -f --show -r "$file")
e2fsck -f -n "$loop"
mount -o ro "$loop" "$mnt"
(cd "$mnt/work" && sha256sum -c --quiet ../SUMS)
ls "$mnt/work" | wc -l
"#,
        fuse = fuse_dir.display(),
        mnt = mnt.display(),
        file = file.display(),
        uri = rig.uri("e"),
        pid = rig.path("nbdfuse.pid").display(),
    );
    let out = run(cmd("bash", &["-c", &verify])).await;
    assert_eq!(out.lines().last().map(str::trim), Some("20"), "{out}");
}

fn unsafe_geteuid() -> u32 {
    // Without libc: the effective uid is in /proc/self/status ("Uid: real effective ...").
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}
