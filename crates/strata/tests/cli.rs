//! The `strata` binary end to end on the embedded default.

use std::process::Command;

fn strata(data: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--data")
        .arg(data)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_runs() {
    let d = tempfile::tempdir().unwrap();
    let (code, out, err) = strata(d.path(), &["demo", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("the agent learned something worth keeping"),
        "{out}"
    );
}

#[test]
fn lifecycle_through_the_cli() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    let (c, _, e) = strata(&data, &["ws", "create", "w", "--size", "1MiB"]);
    assert_eq!(c, 0, "{e}");
    let f = d.path().join("payload");
    std::fs::write(&f, vec![7u8; 8192]).unwrap();
    let (c, _, e) = strata(
        &data,
        &["ws", "write", "w", f.to_str().unwrap(), "--offset", "4096"],
    );
    assert_eq!(c, 0, "{e}");
    let (c, out, e) = strata(
        &data,
        &["--json", "ws", "checkpoint", "w", "--label", "first"],
    );
    assert_eq!(c, 0, "{e}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let version = v["version"].as_u64().unwrap();
    let (c, _, e) = strata(&data, &["ws", "fork", &format!("w@{version}"), "w2"]);
    assert_eq!(c, 0, "{e}");
    let out_img = d.path().join("w2.raw");
    let (c, _, e) = strata(&data, &["ws", "export", "w2", out_img.to_str().unwrap()]);
    assert_eq!(c, 0, "{e}");
    let img = std::fs::read(&out_img).unwrap();
    assert!(img[4096..12288].iter().all(|&b| b == 7) && img[..4096].iter().all(|&b| b == 0));
    let (c, out, _) = strata(&data, &["--json", "ws", "log", "w"]);
    assert_eq!(c, 0);
    assert!(out.contains("\"first\""));
    // Errors: hostile names and missing things exit 2 with a message that says what is wrong.
    let (c, _, e) = strata(&data, &["ws", "create", "../evil", "--size", "1MiB"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("workspace name"), "{e}");
    let (c, _, e) = strata(&data, &["ws", "show", "missing"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("not found"), "{e}");
}

/// Writes 4 KiB of 0x5a at 64 KiB of export `w` on `sock` and flushes it.
fn write_and_flush(rt: &tokio::runtime::Runtime, sock: &std::path::Path) {
    rt.block_on(async {
        let mut c = strata_nbd::client::Client::connect_unix(sock, "w")
            .await
            .unwrap();
        c.write(65536, &[0x5a; 4096], false).await.unwrap();
        c.flush().await.unwrap();
    });
}

/// Without a daemon, a verb is the same request to the same router, run in the CLI's process:
/// a `ws detach` after a foreground `ws attach` was killed (-9) with acknowledged, flushed
/// writes in its journal replays that journal and publishes it (the daemon's detach does the
/// same for a workspace it holds local state for but does not serve).
#[test]
fn a_local_detach_publishes_what_a_killed_attach_left() {
    use std::io::BufRead;
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    let (c, _, e) = strata(&data, &["ws", "create", "w", "--size", "1MiB"]);
    assert_eq!(c, 0, "{e}");
    // Nothing attached, no local state: refused as a daemon refuses it.
    let (c, _, e) = strata(&data, &["ws", "detach", "w"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("not attached"), "{e}");
    let sock = d.path().join("w.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--data")
        .arg(&data)
        .args(["ws", "attach", "w", "--socket"])
        .arg(&sock)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("nbd+unix:///w?socket="), "{line}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    write_and_flush(&rt, &sock);
    // Another CLI process on the same data directory shares this node's id, so the lease
    // cannot keep it off the attached workspace: its lock does. Such a checkpoint used to
    // attach the same journal, detach it, remove it, and fail the running export's next
    // FLUSH with EIO.
    let (c, _, e) = strata(&data, &["ws", "checkpoint", "w"]);
    assert_eq!(c, 2, "{e}");
    assert!(e.contains("attached by another process"), "{e}");
    write_and_flush(&rt, &sock);
    child.kill().unwrap();
    child.wait().unwrap();
    let (c, out, e) = strata(&data, &["--json", "ws", "detach", "w"]);
    assert_eq!(c, 0, "{e}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "published", "{out}");
    // Published: the object store's copy (not the journal) has the write.
    let img = d.path().join("w.raw");
    let (c, _, e) = strata(&data, &["ws", "export", "w", img.to_str().unwrap()]);
    assert_eq!(c, 0, "{e}");
    let img = std::fs::read(&img).unwrap();
    assert!(img[65536..69632].iter().all(|&b| b == 0x5a));
    // Verbs that need a long-lived daemon say so (exit 2), instead of holding a mount or a
    // freeze for the length of one command.
    for args in [
        &["ws", "freeze", "w"][..],
        &["ws", "mount", "w"],
        &["ws", "mounts"],
    ] {
        let (c, _, e) = strata(&data, args);
        assert_eq!(c, 2, "{args:?}: {e}");
        assert!(e.contains("STRATA_URL"), "{e}");
    }
}
