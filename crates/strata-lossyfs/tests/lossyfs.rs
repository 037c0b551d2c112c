//! The lossy file system's own behaviour (the daemon's power-loss campaign that uses it is
//! `crates/strata/tests/power_loss.rs`). Building this test also makes `cargo test` build the
//! `strata-lossyfs` binary, which that campaign runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

struct Lossy {
    child: Child,
    mnt: PathBuf,
}

impl Lossy {
    fn mount(dir: &Path) -> Lossy {
        let (backing, mnt) = (dir.join("backing"), dir.join("mnt"));
        std::fs::create_dir_all(&backing).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata-lossyfs"))
            .arg(&backing)
            .arg(&mnt)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        for _ in 0..100 {
            let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
            if mounts.contains(&format!(" {} fuse", mnt.display())) {
                return Lossy { child, mnt };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("strata-lossyfs did not mount");
    }
}

impl Drop for Lossy {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.mnt)
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lossy file system keeps a file unlinked (or renamed over) while open readable through
/// its handle, as a local file system does: the journal unlinks a retired segment that a read
/// still holds instead of recycling it, and that read must still get its bytes.
#[test]
fn lossyfs_keeps_files_unlinked_while_open_readable() {
    use std::io::{Read, Seek, SeekFrom, Write};
    if !(is_root() && have("fusermount3")) {
        assert!(std::env::var("CI").is_err(), "CI runs as root with fuse3");
        eprintln!("skipping: needs root and fusermount3");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let fs = Lossy::mount(d.path());
    let (a, b) = (fs.mnt.join("a"), fs.mnt.join("b"));
    std::fs::write(&a, b"segment a").unwrap();
    std::fs::write(&b, b"segment b").unwrap();
    let mut fa = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&a)
        .unwrap();
    let mut fb = std::fs::File::open(&b).unwrap();
    std::fs::remove_file(&a).unwrap();
    std::fs::write(fs.mnt.join("c"), b"new c").unwrap();
    std::fs::rename(fs.mnt.join("c"), &b).unwrap(); // over an open file
    let mut s = String::new();
    fa.read_to_string(&mut s).unwrap();
    assert_eq!(s, "segment a");
    fa.write_all(b"!").unwrap();
    fa.sync_all().unwrap();
    fa.seek(SeekFrom::Start(0)).unwrap();
    s.clear();
    fa.read_to_string(&mut s).unwrap();
    assert_eq!(s, "segment a!");
    s.clear();
    fb.read_to_string(&mut s).unwrap();
    assert_eq!(s, "segment b");
    assert!(!a.exists());
    assert_eq!(std::fs::read(&b).unwrap(), b"new c");
    let names: Vec<_> = std::fs::read_dir(&fs.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["b"], "hidden files are never listed");
    drop((fa, fb));
    // The last release deletes what was hidden.
    let hidden = d.path().join("backing/.lossyfs-hidden");
    let left = || std::fs::read_dir(&hidden).map_or(0, |r| r.count());
    for _ in 0..100 {
        if left() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20)); // the kernel releases asynchronously
    }
    assert_eq!(left(), 0, "released files are deleted from BACKING");
}

/// SIGUSR1 drops exactly what was not fsync'd: a synced file keeps its bytes, an un-synced
/// write to it and an un-synced file's data are gone.
#[test]
fn power_loss_drops_what_was_not_synced() {
    use std::io::Write;
    if !(is_root() && have("fusermount3")) {
        assert!(std::env::var("CI").is_err(), "CI runs as root with fuse3");
        eprintln!("skipping: needs root and fusermount3");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let fs = Lossy::mount(d.path());
    let (kept, lost) = (fs.mnt.join("kept"), fs.mnt.join("lost"));
    let mut f = std::fs::File::create(&kept).unwrap();
    f.write_all(b"synced").unwrap();
    f.sync_all().unwrap();
    f.write_all(b" and not").unwrap();
    let mut g = std::fs::File::create(&lost).unwrap();
    g.write_all(b"never synced").unwrap();
    assert_eq!(std::fs::read(&kept).unwrap(), b"synced and not");
    assert!(Command::new("kill")
        .args(["-USR1", &fs.child.id().to_string()])
        .status()
        .unwrap()
        .success());
    // The signal is handled at the file system's next request.
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = std::fs::read(&kept).unwrap();
        if seen == b"synced" {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(seen, b"synced", "the un-synced append is dropped");
    assert_eq!(
        std::fs::read(&lost).unwrap(),
        b"",
        "un-synced data is dropped"
    );
    drop((f, g));
}
