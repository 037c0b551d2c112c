//! Multi-connection durability across kill -9: several NBD connections write disjoint ranges to
//! a `strata ws attach` process, one of them flushes, the process is killed with SIGKILL (while
//! more writes are in flight), restarted, and every write acknowledged before the flush must be
//! there; every other block holds either its old or its new content, never anything else.
//! Also: a final publish that hangs is stopped by a second signal, keeping the journal.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_nbd::client::Client;

mod common;
use common::{block, lossyfs_bin, Found, Ledger};

const BLOCKS: u64 = 4096; // 16 MiB disk
const CONNS: u64 = 4;

fn strata(data: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.arg("--data").arg(data);
    c
}

/// `ws create w` (16 MiB) in `data`.
fn create(data: &Path) {
    let out = strata(data)
        .args(["ws", "create", "w", "--size", "16MiB"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ws attach w` in the foreground, once it serves `sock`.
fn attach(data: &Path, sock: &Path, stderr: Stdio) -> Child {
    let mut child = strata(data)
        .args(["ws", "attach", "w", "--socket"])
        .arg(sock)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("nbd+unix:///w?socket="), "{line}");
    child
}

fn start(data: &Path, sock: &Path) -> Child {
    attach(data, sock, Stdio::inherit())
}

/// Sends every write at once on `conn`, then reads their replies: each must succeed.
async fn write_pipelined(conn: &mut Client<tokio::net::UnixStream>, writes: &[(u64, u64)]) {
    use strata_nbd::proto::{encode_request, Request, CMD_WRITE, SIMPLE_REPLY_MAGIC};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut wire = vec![];
    for (k, &(lba, tag)) in writes.iter().enumerate() {
        wire.extend(encode_request(&Request {
            flags: 0,
            kind: CMD_WRITE,
            cookie: k as u64,
            offset: lba * 4096,
            length: 4096,
        }));
        wire.extend(block(tag, lba));
    }
    let s = conn.stream();
    s.write_all(&wire).await.unwrap();
    for _ in writes {
        let mut r = [0u8; 16];
        s.read_exact(&mut r).await.unwrap();
        assert_eq!(&r[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[4..8], &[0, 0, 0, 0], "a pipelined write failed");
    }
}

fn cycles() -> u64 {
    std::env::var("STRATA_KILL_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

#[test]
fn flushed_writes_on_any_connection_survive_kill_9() {
    let d = tempfile::tempdir().unwrap();
    let data: PathBuf = d.path().join("data");
    let sock = d.path().join("w.sock");
    create(&data);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut ledger = Ledger::new(BLOCKS);
    let mut checked = 0u64;
    for cycle in 1..=cycles() {
        let mut child = start(&data, &sock);
        let mut rng = SmallRng::seed_from_u64(cycle);
        rt.block_on(async {
            // Verify what the previous cycle promised.
            let mut c = Client::connect_unix(&sock, "w").await.unwrap();
            for lba in 0..BLOCKS {
                let b = c.read(lba * 4096, 4096).await.unwrap();
                let found = ledger.observe(lba, &b);
                assert_eq!(found, Found::Ok, "cycle {cycle}: block {lba}");
                checked += 1;
            }
            // Each connection owns a quarter of the disk.
            let mut conns = vec![];
            for _ in 0..CONNS {
                conns.push(Client::connect_unix(&sock, "w").await.unwrap());
            }
            let mut acked: Vec<(u64, u64)> = vec![];
            let mut tasks = vec![];
            for (i, mut conn) in conns.into_iter().enumerate() {
                // Odd connections pipeline theirs (all sent, then the replies read: the server
                // hands the writes to the volume together, one journal write for a group), on
                // distinct blocks, since writes in flight together land in no set order.
                let pipelined = i % 2 == 1;
                let mut seen = std::collections::HashSet::new();
                let writes: Vec<(u64, u64)> = (0..50)
                    .map(|k| {
                        let lba = loop {
                            let lba =
                                i as u64 * BLOCKS / CONNS + rng.random_range(0..BLOCKS / CONNS);
                            if !pipelined || seen.insert(lba) {
                                break lba;
                            }
                        };
                        (lba, cycle * 1000 + i as u64 * 100 + k)
                    })
                    .collect();
                tasks.push(tokio::spawn(async move {
                    if pipelined {
                        write_pipelined(&mut conn, &writes).await;
                    } else {
                        for &(lba, tag) in &writes {
                            conn.write(lba * 4096, &block(tag, lba), false)
                                .await
                                .unwrap();
                        }
                    }
                    (conn, writes)
                }));
            }
            let mut conns = vec![];
            for t in tasks {
                let (conn, w) = t.await.unwrap();
                acked.extend(w);
                conns.push(conn);
            }
            // Flush on one connection: covers the writes completed on all of them.
            conns[0].flush().await.unwrap();
            for &(lba, tag) in &acked {
                ledger.flushed(lba, tag);
            }
            // More writes, unflushed, racing the kill.
            let mut racing = vec![];
            for (i, mut conn) in conns.into_iter().enumerate() {
                let writes: Vec<(u64, u64)> = (0..30)
                    .map(|k| {
                        (
                            i as u64 * BLOCKS / CONNS + rng.random_range(0..BLOCKS / CONNS),
                            cycle * 1000 + 500 + i as u64 * 50 + k,
                        )
                    })
                    .collect();
                for &(lba, tag) in &writes {
                    ledger.written(lba, tag);
                }
                racing.push(tokio::spawn(async move {
                    for &(lba, tag) in &writes {
                        if conn
                            .write(lba * 4096, &block(tag, lba), false)
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }));
            }
            tokio::time::sleep(std::time::Duration::from_millis(rng.random_range(0..20))).await;
            child.kill().unwrap();
            child.wait().unwrap();
            for r in racing {
                let _ = r.await;
            }
        });
    }
    eprintln!(
        "kill -9 cycles: {}, blocks checked: {checked}, lost flushed writes: 0",
        cycles()
    );
}

/// `ws attach` in the foreground, told to stop while its final publish hangs (its object
/// directory is on a FUSE mount whose server is stopped with SIGSTOP): a second signal stops
/// the publish and the process exits with an error naming the journal (before, it waited for
/// ever); the next attach replays the journal and the flushed writes are there.
#[test]
fn a_second_signal_stops_a_final_publish_that_hangs() {
    if !(common::is_root() && common::have("fusermount3")) {
        assert!(std::env::var("CI").is_err(), "CI runs as root with fuse3");
        eprintln!("skipping: needs root and fusermount3");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let data: PathBuf = d.path().join("data");
    let sock = d.path().join("w.sock");
    create(&data);
    // The object directory moves onto a FUSE passthrough (strata-lossyfs; everything here is
    // synced through it before the stall, so nothing is lost by it).
    let (backing, mnt) = (d.path().join("backing"), d.path().join("mnt"));
    std::fs::rename(data.join("objects"), &backing).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let fuse = Command::new(lossyfs_bin())
        .arg(&backing)
        .arg(&mnt)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let fuse = Fuse(fuse, mnt.clone());
    let mounted = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        std::fs::read_to_string("/proc/mounts")
            .unwrap_or_default()
            .contains(&format!(" {} fuse", mnt.display()))
    });
    assert!(mounted, "strata-lossyfs did not mount");
    std::os::unix::fs::symlink(&mnt, data.join("objects")).unwrap();
    let fuse_pid = fuse.0.id().to_string();
    let signal = |sig: &str, pid: &str| {
        assert!(Command::new("kill")
            .args([sig, pid])
            .status()
            .unwrap()
            .success());
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut child = attach(&data, &sock, Stdio::piped());
    rt.block_on(async {
        let mut c = Client::connect_unix(&sock, "w").await.unwrap();
        for lba in 0..64u64 {
            c.write(lba * 4096, &block(7, lba), false).await.unwrap();
        }
        c.flush().await.unwrap();
    });
    signal("-STOP", &fuse_pid); // every request to the object directory now waits
    let pid = child.id().to_string();
    signal("-TERM", &pid);
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the final publish waits on the stalled store"
    );
    signal("-TERM", &pid);
    let status = (0..150).find_map(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        child.try_wait().unwrap()
    });
    let mut err = String::new();
    if status.is_some() {
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    }
    signal("-CONT", &fuse_pid);
    let status = status.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("ws attach did not exit after a second signal")
    });
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("stopped before its final publish completed: every flushed write is in the local journal"),
        "{err}"
    );
    let _ = std::fs::remove_file(&sock);
    let mut child = start(&data, &sock);
    rt.block_on(async {
        let mut c = Client::connect_unix(&sock, "w").await.unwrap();
        for lba in 0..64u64 {
            let b = c.read(lba * 4096, 4096).await.unwrap();
            assert_eq!(b, block(7, lba), "block {lba}");
        }
    });
    let _ = child.kill();
    let _ = child.wait();
}

/// The FUSE server: resumed, unmounted and killed however the test ends (a stopped server
/// left behind would hang whatever waits on its mount or its output).
struct Fuse(Child, PathBuf);

impl Drop for Fuse {
    fn drop(&mut self) {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-CONT", &pid]).status();
        let _ = Command::new("fusermount3").arg("-u").arg(&self.1).status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
