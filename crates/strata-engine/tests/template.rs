//! Templates from a real directory and from raw and qcow2 images, restored on another node and
//! checked with e2fsck and by comparing every file's bytes.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use strata_engine::{Mode, Source};

fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn make_tree(root: &Path) {
    std::fs::create_dir_all(root.join("src/deep/er")).unwrap();
    for i in 0..50u32 {
        let body: Vec<u8> = (0..(i * 997 + 13))
            .map(|j| (j.wrapping_mul(31) ^ i) as u8)
            .collect();
        std::fs::write(root.join(format!("src/file{i}.bin")), body).unwrap();
    }
    std::fs::write(
        root.join("src/deep/er/notes.txt"),
        "agents were here\n".repeat(1000),
    )
    .unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("src/deep/er/notes.txt", root.join("link")).unwrap();
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Extracts the image's files with debugfs (no mount, no root) and compares them to `src`.
fn assert_same_files(img: &Path, src: &Path, scratch: &Path) {
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(img));
    let out = scratch.join("rdump");
    std::fs::create_dir_all(&out).unwrap();
    run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("rdump / {}", out.display()))
        .arg(img));
    let sum = |dir: &Path| {
        run(Command::new("sh").arg("-c").arg(format!(
        "cd {} && find . -path ./lost+found -prune -o -type f -print | LC_ALL=C sort | xargs -d '\\n' sha256sum",
        dir.display()
    )))
    };
    assert_eq!(sum(&out), sum(src));
    assert_eq!(
        std::fs::read_link(out.join("link")).unwrap(),
        std::path::PathBuf::from("src/deep/er/notes.txt")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_from_directory_restores_on_another_node() {
    if !(have("mkfs.ext4") && have("debugfs") && have("e2fsck")) {
        panic!("e2fsprogs (mkfs.ext4, debugfs, e2fsck) is required; .ci/run installs it");
    }
    let c = Cluster::new().await;
    let tree = c.path("tree");
    make_tree(&tree);
    let a = c.node("a");
    let t = a
        .build_template_from_dir(TENANT, "base", &tree, Some(64 << 20), &|_, _| {})
        .await
        .unwrap();
    assert_eq!(t.disk_size, 64 << 20);
    assert!(
        t.stored_bytes < 16 << 20,
        "zero blocks must store nothing (stored {})",
        t.stored_bytes
    );
    a.create_workspace(
        TENANT,
        "w",
        Source::Template("base".into()),
        Mode::Durable,
        None,
    )
    .await
    .unwrap();
    // Another node with nothing local restores the workspace from the catalog and store alone.
    let b = c.node("b");
    let img = c.path("w.raw");
    b.export(TENANT, "w", None, &img).await.unwrap();
    assert_same_files(&img, &tree, &c.path("check1"));
    mounted_files_match(&img, &tree, &c.path("mnt"));

    // Same content again: a new build writes fresh (salted) keys, never re-uploading a key
    // that garbage collection might be deleting; one new object per non-empty chunk and one
    // manifest, no more.
    let objs_before = count_objects(&c.path("objects"));
    let t = a
        .build_template_from_image(TENANT, "again", &img, &|_, _| {})
        .await
        .unwrap();
    let m = c.store.get_manifest(TENANT, &t.manifest).await.unwrap();
    assert_eq!(
        count_objects(&c.path("objects")),
        objs_before + m.objects.len() + 1,
        "a rebuild stores its chunks once, under new keys"
    );

    // A qcow2 image of the same disk imports to the same bytes.
    if have("qemu-img") {
        let q = c.path("w.qcow2");
        run(Command::new("qemu-img")
            .args(["convert", "-O", "qcow2"])
            .arg(&img)
            .arg(&q));
        let tq = a
            .build_template_from_image(TENANT, "fromq", &q, &|_, _| {})
            .await
            .unwrap();
        let t2 = a.catalog().get_template(TENANT, "again").await.unwrap();
        let (mq, m2) = (
            c.store.get_manifest(TENANT, &tq.manifest).await.unwrap(),
            c.store.get_manifest(TENANT, &t2.manifest).await.unwrap(),
        );
        assert_eq!(mq.extents, m2.extents, "qcow2 and raw: the same layout");
        a.create_workspace(
            TENANT,
            "fromq",
            Source::Template("fromq".into()),
            Mode::Durable,
            None,
        )
        .await
        .unwrap();
        let out = c.path("fromq.raw");
        a.export(TENANT, "fromq", None, &out).await.unwrap();
        assert!(
            std::fs::read(&out).unwrap() == std::fs::read(&img).unwrap(),
            "qcow2 and raw of the same disk import to the same bytes"
        );
    }

    // Bad inputs: a missing directory, a duplicate name, a hostile name.
    assert!(a
        .build_template_from_dir(TENANT, "nope", &c.path("missing"), None, &|_, _| {})
        .await
        .is_err());
    assert!(a
        .build_template_from_dir(TENANT, "base", &tree, None, &|_, _| {})
        .await
        .is_err());
    assert!(a
        .build_template_from_dir(TENANT, "../x", &tree, None, &|_, _| {})
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_writes_on_a_template_survive_restore() {
    let c = Cluster::new().await;
    let tree = c.path("tree");
    make_tree(&tree);
    let a = c.node("a");
    a.build_template_from_dir(TENANT, "base", &tree, None, &|_, _| {})
        .await
        .unwrap();
    a.create_workspace(
        TENANT,
        "w",
        Source::Template("base".into()),
        Mode::Durable,
        None,
    )
    .await
    .unwrap();
    let v = a.attach(TENANT, "w").await.unwrap();
    // Overwrite part of the disk after the superblock, checkpoint, fork, compare.
    let before = v.read(0, v.size()).await.unwrap();
    v.write(40 << 20, &vec![0x5a; 1 << 20], false)
        .await
        .unwrap();
    let p = a
        .checkpoint(TENANT, "w", Some("edited".into()))
        .await
        .unwrap();
    assert!(p.bytes_uploaded >= 1 << 20);
    a.fork(TENANT, "w", Some(p.version), "w2", None)
        .await
        .unwrap();
    let out = c.path("w2.raw");
    c.node("b").export(TENANT, "w2", None, &out).await.unwrap();
    let img = std::fs::read(&out).unwrap();
    assert!(img[..40 << 20] == before[..40 << 20]);
    assert!(img[40 << 20..41 << 20].iter().all(|&b| b == 0x5a));
    assert!(img[41 << 20..] == before[41 << 20..]);
}

/// As root: loop-mount the restored image read-only and compare every file through the kernel's
/// ext4 driver too.
fn mounted_files_match(img: &Path, src: &Path, mnt: &Path) {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false);
    if !root || !have("mount") {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs as root and must mount"
        );
        return;
    }
    std::fs::create_dir_all(mnt).unwrap();
    let script = format!(
        r#"set -e
mount -o loop,ro {img} {mnt}
trap 'umount {mnt}' EXIT
a=$(cd {mnt} && find . -path ./lost+found -prune -o -type f -exec sha256sum {{}} + | LC_ALL=C sort -k2)
b=$(cd {src} && find . -type f -exec sha256sum {{}} + | LC_ALL=C sort -k2)
[ "$a" = "$b" ]
readlink {mnt}/link"#,
        img = img.display(),
        mnt = mnt.display(),
        src = src.display()
    );
    let out = run(Command::new("bash").arg("-c").arg(script));
    assert_eq!(out.trim(), "src/deep/er/notes.txt");
}

fn count_objects(dir: &Path) -> usize {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("find {} -type f | wc -l", dir.display()))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A tar archive of `entries` (path, type, link target, body) built by hand, so it can hold what
/// no honest tar tool would write.
fn hostile_tar(path: &Path, entries: &[(&str, tar::EntryType, &str, &[u8])]) {
    let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (name, kind, link, body) in entries {
        let mut h = tar::Header::new_old();
        // Write the name bytes raw: `set_path` refuses `..` and absolute paths.
        let n = name.as_bytes();
        h.as_old_mut().name[..n.len()].copy_from_slice(n);
        h.set_entry_type(*kind);
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        if !link.is_empty() {
            let l = link.as_bytes();
            h.as_old_mut().linkname[..l.len()].copy_from_slice(l);
        }
        h.set_cksum();
        b.append(&h, *body).unwrap();
    }
    b.finish().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_are_unpacked_as_hostile_input() {
    use strata_engine::template::ImportLimits;
    use tar::EntryType as T;
    let c = Cluster::new().await;
    let a = c.node("a");
    let limits = ImportLimits {
        max_bytes: 1 << 20,
        max_entries: 100,
        max_disk: 1 << 30,
    };
    let outside = c.path("outside");
    std::fs::create_dir_all(&outside).unwrap();
    type Entry<'a> = (&'a str, T, String, &'a [u8]);
    let cases: Vec<(&str, Vec<Entry>)> = vec![
        (
            "dotdot",
            vec![("../escape", T::Regular, String::new(), b"x")],
        ),
        (
            "absolute",
            vec![("/tmp/strata-escape", T::Regular, String::new(), b"x")],
        ),
        (
            "through-symlink",
            vec![
                ("d", T::Symlink, outside.display().to_string(), b""),
                ("d/planted", T::Regular, String::new(), b"x"),
            ],
        ),
        (
            "hardlink-out",
            vec![("h", T::Link, "/etc/hostname".into(), b"")],
        ),
        ("device", vec![("null", T::Char, String::new(), b"")]),
        ("fifo", vec![("pipe", T::Fifo, String::new(), b"")]),
        (
            "too-big",
            vec![("big", T::Regular, String::new(), &[7u8; 2 << 20])],
        ),
    ];
    for (name, entries) in &cases {
        let tarball = c.path(&format!("{name}.tar"));
        let e: Vec<_> = entries
            .iter()
            .map(|(p, k, l, b)| (*p, *k, l.as_str(), *b))
            .collect();
        hostile_tar(&tarball, &e);
        let r = a
            .build_template_from_archive(TENANT, name, &tarball, Some(16 << 20), limits, &|_, _| {})
            .await;
        let e = r.expect_err("a hostile archive was accepted");
        eprintln!("{name}: refused: {e}");
    }
    assert!(!outside.join("planted").exists(), "nothing lands outside");
    assert!(!Path::new("/tmp/strata-escape").exists());
    // An honest archive of a real tree builds the same files as the directory would.
    let tree = c.path("tree");
    make_tree(&tree);
    let tarball = c.path("tree.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&tarball).unwrap());
        b.follow_symlinks(false);
        b.append_dir_all(".", &tree).unwrap();
        b.finish().unwrap();
    }
    let limits = ImportLimits {
        max_bytes: 64 << 20,
        max_entries: 10_000,
        max_disk: 1 << 30,
    };
    a.build_template_from_archive(TENANT, "tree", &tarball, Some(64 << 20), limits, &|_, _| {})
        .await
        .unwrap();
    a.create_workspace(
        TENANT,
        "t",
        Source::Template("tree".into()),
        Mode::Durable,
        None,
    )
    .await
    .unwrap();
    let img = c.path("t.raw");
    a.export(TENANT, "t", None, &img).await.unwrap();
    assert_same_files(&img, &tree, &c.path("check-tar"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qcow2_image_naming_a_backing_file_is_refused() {
    if !have("qemu-img") {
        panic!("qemu-img is required; .ci/run installs it");
    }
    let c = Cluster::new().await;
    let a = c.node("a");
    // The backing file stands for a host file the image's author wants read (a catalog, a
    // device, another tenant's journal).
    let secret = c.path("secret.raw");
    std::fs::write(&secret, vec![0x5e; 1 << 20]).unwrap();
    let q = c.path("overlay.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&secret)
        .arg(&q));
    let r = a
        .build_template_from_image(TENANT, "sneaky", &q, &|_, _| {})
        .await;
    let err = r
        .expect_err("an image with a backing file is refused")
        .to_string();
    assert!(err.contains("backing"), "{err}");
    // Declared raw, a qcow2 file is imported as the bytes it is, never interpreted.
    let t = a
        .build_template_from_image_as(
            TENANT,
            "asraw",
            &q,
            strata_engine::template::ImageFormat::Raw,
            strata_engine::template::ImportLimits::operator(),
            &|_, _| {},
        )
        .await
        .unwrap();
    assert_eq!(
        t.disk_size,
        std::fs::metadata(&q).unwrap().len().div_ceil(4096) * 4096
    );
    // An external data file (the image's clusters in a file its author names) is refused
    // from the header alone, before qemu-img opens anything.
    let df = c.path("df.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o"])
        .arg(format!("data_file={}", secret.display()))
        .arg(&df)
        .arg("1M"));
    let err = a
        .build_template_from_image(TENANT, "datafile", &df, &|_, _| {})
        .await
        .expect_err("an image with an external data file is refused")
        .to_string();
    assert!(err.contains("external data file"), "{err}");
    // A tiny file describing an enormous disk is refused before anything is converted.
    let huge = c.path("huge.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-f", "qcow2"])
        .arg(&huge)
        .arg("8T"));
    let limits = strata_engine::template::ImportLimits {
        max_disk: 1 << 30,
        ..strata_engine::template::ImportLimits::operator()
    };
    let r = a
        .build_template_from_image_as(
            TENANT,
            "huge",
            &huge,
            strata_engine::template::ImageFormat::Qcow2,
            limits,
            &|_, _| {},
        )
        .await;
    assert!(r.is_err(), "an 8 TiB virtual disk is over the limit");
}
