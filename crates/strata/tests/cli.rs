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
