#![allow(dead_code)]
//! Scaffolding for tests of the real `strata` binary: daemons, an HTTP API client, shared
//! scale-out backends (PostgreSQL + S3) and ext4 through nbdfuse + a loop device.

pub mod faultproxy;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use reqwest::StatusCode;
use serde_json::{json, Value};

pub const ADMIN: &str = "admin-secret";

/// A running `strata serve`; killed with SIGKILL when dropped.
pub struct Daemon {
    pub child: Child,
    pub url: String,
    pub node: String,
    /// `--relay-listen`'s address, when given.
    pub relay_url: Option<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }
    pub fn api(&self, token: &str) -> Api {
        Api::new(&self.url, token)
    }
}

pub fn serve(data: &Path, extra: &[&str]) -> Daemon {
    serve_env(data, extra, &[])
}

/// Starts a daemon on a free port with a 2 s lease TTL; `extra` flags and `env` are added.
pub fn serve_env(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
    serve_bin(Path::new(env!("CARGO_BIN_EXE_strata")), data, extra, env)
}

/// [`serve_env`] with another `strata` binary (a mutation check runs an altered build).
pub fn serve_bin(bin: &Path, data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
    serve_to(bin, data, extra, env, Stdio::inherit())
}

/// [`serve_env`] with the daemon's log (stderr) written to `log`.
#[allow(dead_code)]
pub fn serve_logged(data: &Path, env: &[(&str, &str)], log: &Path) -> Daemon {
    let f = std::fs::File::create(log).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_strata"));
    serve_to(bin, data, &[], env, Stdio::from(f))
}

fn serve_to(
    bin: &Path,
    data: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
    stderr: Stdio,
) -> Daemon {
    let mut child = Command::new(bin)
        .arg("--data")
        .arg(data)
        .args(["--json", "serve", "--lease-ttl", "2s"])
        // A fresh port unless the caller names one (a restart at the same address).
        .args(if extra.contains(&"--listen") {
            &[][..]
        } else {
            &["--listen", "127.0.0.1:0"][..]
        })
        .args(extra)
        .env("STRATA_ADMIN_TOKEN", ADMIN)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let url = v["url"].as_str().unwrap().to_string();
    let scheme = &url[..url.find("://").unwrap()];
    Daemon {
        child,
        relay_url: v["relay_listening"]
            .as_str()
            .map(|a| format!("{scheme}://{a}")),
        url,
        node: v["node"].as_str().unwrap_or("").to_string(),
    }
}

pub struct Api {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
}

impl Api {
    pub fn new(url: &str, token: &str) -> Api {
        Api::with_timeout(url, token, std::time::Duration::from_secs(120))
    }
    /// A client of `url` through `http` (one that trusts a test CA, say).
    pub fn with_http(http: reqwest::Client, url: &str, token: &str) -> Api {
        Api {
            http,
            url: url.into(),
            token: token.into(),
        }
    }
    /// A client whose every request gives up after `t`.
    pub fn with_timeout(url: &str, token: &str, t: std::time::Duration) -> Api {
        Api {
            http: reqwest::Client::builder().timeout(t).build().unwrap(),
            url: url.into(),
            token: token.into(),
        }
    }
    /// One request. A request that gets no answer (the daemon is gone, paused, or too slow)
    /// reads as status 599 with the error as its body, for the caller's assertion to report.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let no_answer = |e: reqwest::Error| {
            (
                StatusCode::from_u16(599).unwrap(),
                Value::String(e.to_string()),
            )
        };
        let resp = match r.send().await {
            Ok(r) => r,
            Err(e) => return no_answer(e),
        };
        let status = resp.status();
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => return no_answer(e),
        };
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
    /// A POST that may find the daemon gone (crash tests): None instead of a panic.
    pub async fn try_post(&self, p: &str, b: Value) -> Option<StatusCode> {
        self.http
            .post(format!("{}{p}", self.url))
            .bearer_auth(&self.token)
            .json(&b)
            .send()
            .await
            .ok()
            .map(|r| r.status())
    }
    pub async fn get(&self, p: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, p, None).await
    }
    pub async fn post(&self, p: &str, b: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, p, Some(b)).await
    }
    pub async fn delete(&self, p: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::DELETE, p, None).await
    }
    /// A PUT whose body is `bytes` (template uploads).
    pub async fn put_bytes(&self, p: &str, bytes: Vec<u8>) -> (StatusCode, Value) {
        self.put_body(p, bytes).await
    }

    /// A PUT of any body (a stream sends it chunked).
    pub async fn put_body(&self, p: &str, body: impl Into<reqwest::Body>) -> (StatusCode, Value) {
        let resp = self
            .http
            .put(format!("{}{p}", self.url))
            .bearer_auth(&self.token)
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
    /// Builds template `name` from the directory `dir` the way the CLI does: a tar archive of
    /// it sent as the request body.
    pub async fn template_from_dir(
        &self,
        name: &str,
        dir: &Path,
        size: u64,
    ) -> (StatusCode, Value) {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all(".", dir).unwrap();
        let bytes = b.into_inner().unwrap();
        self.put_bytes(
            &format!("/v1/templates/{name}?format=tar&size={size}"),
            bytes,
        )
        .await
    }
}

/// Creates a tenant through `url`'s admin API and returns an API handle with its token.
pub async fn tenant(url: &str, name: &str) -> Api {
    let admin = Api::new(url, ADMIN);
    let (s, v) = admin.post("/v1/tenants", json!({"name": name})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    Api::new(url, v["token"].as_str().unwrap())
}

pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The `strata-lossyfs` test tool (its own package, so `cargo install` of the CLI installs
/// `strata` alone): the binary beside this test's target directory, which `cargo test
/// --workspace` builds (the package has integration tests of its own, so cargo builds its
/// binary). Missing, the test fails, saying how to build it.
pub fn lossyfs_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test> -> target/<profile>/strata-lossyfs
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("strata-lossyfs"))
        .expect("a test binary lives in <target>/<profile>/deps");
    assert!(
        bin.is_file(),
        "{} is not built: run `cargo build -p strata-lossyfs` (or `cargo test --workspace`, \
         which builds it) before this test",
        bin.display()
    );
    bin
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Whether ext4-through-nbdfuse tests can run here (root, nbdfuse, loop devices); on CI they
/// must.
pub fn can_mount() -> bool {
    let ok = is_root()
        && ["nbdfuse", "losetup", "mkfs.ext4", "e2fsck", "fusermount3"]
            .iter()
            .all(|t| have(t));
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs as root with nbdfuse installed"
        );
        eprintln!("skipping: needs root, nbdfuse and a loop device");
    }
    ok
}

/// A bash script that exposes NBD export `uri` as `$file` through nbdfuse under `dir`, runs
/// `body` (which may set `loop` to a loop device) and cleans up whatever happens.
pub fn mount_script(dir: &Path, uri: &str, tag: &str, body: &str) -> String {
    let fuse = dir.join(format!("fuse-{tag}"));
    let mnt = dir.join(format!("mnt-{tag}"));
    std::fs::create_dir_all(&fuse).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let pid = dir.join(format!("{tag}.pid"));
    let _ = std::fs::remove_file(&pid);
    format!(
        r#"set -eu
fuse={fuse}; mnt={mnt}; file={fuse}/disk
nbdfuse -P {pid} "$file" '{uri}' &
for i in $(seq 1 100); do [ -s {pid} ] && break; sleep 0.1; done
cleanup() {{ umount "$mnt" 2>/dev/null || true; [ -n "${{loop:-}}" ] && losetup -d "$loop" 2>/dev/null || true; fusermount3 -u "$fuse" 2>/dev/null || true; }}
trap cleanup EXIT
{body}
"#,
        fuse = fuse.display(),
        mnt = mnt.display(),
        pid = pid.display(),
    )
}

/// Runs a bash script off the async runtime; returns (success, stdout, stderr).
pub async fn bash(script: String) -> (bool, String, String) {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash").arg("-c").arg(script).output().unwrap()
    })
    .await
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The shared backends of a scale-out cluster: a fresh database on the PostgreSQL server named
/// by `STRATA_TEST_PG` and a fresh bucket on the S3-protocol server at
/// `STRATA_TEST_S3_ENDPOINT`. None (skip) when either is unset, unless `STRATA_REQUIRE_PG=1`.
pub struct Shared {
    pub catalog: String,
    pub store: String,
}

pub const S3_ENV: &[(&str, &str)] = &[
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
];

/// Creates `bucket` on the S3-protocol server at `endpoint`.
pub fn create_bucket(endpoint: &str, bucket: &str) {
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
        .arg(format!("{endpoint}/{bucket}"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with('2'),
        "cannot create bucket {bucket}"
    );
}

pub async fn shared(tag: &str) -> Option<Shared> {
    let pg = std::env::var("STRATA_TEST_PG")
        .ok()
        .filter(|s| !s.is_empty());
    let s3 = std::env::var("STRATA_TEST_S3_ENDPOINT")
        .ok()
        .filter(|s| !s.is_empty());
    let (Some(pg), Some(s3)) = (pg, s3) else {
        assert!(
            std::env::var("STRATA_REQUIRE_PG").as_deref() != Ok("1"),
            "STRATA_REQUIRE_PG=1 but STRATA_TEST_PG or STRATA_TEST_S3_ENDPOINT is unset"
        );
        eprintln!("skipping: needs STRATA_TEST_PG and STRATA_TEST_S3_ENDPOINT");
        return None;
    };
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000;
    let name = format!("{tag}{}x{n}", std::process::id());
    let catalog = strata_catalog::create_database(&pg, &format!("strata_{name}"))
        .await
        .unwrap();
    let bucket = format!("scale-{name}").replace('_', "-");
    create_bucket(&s3, &bucket);
    Some(Shared {
        catalog,
        store: format!("s3://{bucket}/strata?endpoint={s3}&region=us-east-1&allow_http=true"),
    })
}

impl Shared {
    /// A node of this cluster: its own data directory and node id, the shared backends.
    pub fn node(&self, data: &Path, id: &str, extra: &[&str]) -> Daemon {
        let mut args = vec![
            "--catalog",
            &self.catalog,
            "--store",
            &self.store,
            "--node-id",
            id,
        ];
        args.extend_from_slice(extra);
        serve_env(data, &args, S3_ENV)
    }
}

/// A block whose contents say what it is: (tag, lba) repeated; tag 0 is an all-zero block.
pub fn block(tag: u64, lba: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    while b.len() < 4096 {
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(&lba.to_le_bytes());
    }
    b
}

/// The tag of a block written by [`block`] at `lba`, 0 for zeros, None for anything else.
pub fn tag_of(b: &[u8], lba: u64) -> Option<u64> {
    if b.iter().all(|&x| x == 0) {
        return Some(0);
    }
    let tag = u64::from_le_bytes(b[..8].try_into().ok()?);
    (b == block(tag, lba).as_slice()).then_some(tag)
}

/// What reading a block after a crash found, against the [`Ledger`].
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    Ok,
    /// Neither zeros nor a whole block written by [`block`].
    Torn,
    /// An older write than the one a completed FLUSH covered.
    Lost {
        has: u64,
        flushed: u64,
    },
}

/// Per-block promises of a crash test: the tag a completed FLUSH covered, and the tags written
/// after it, any one of which may have survived.
pub struct Ledger {
    durable: Vec<u64>,
    maybe: Vec<Vec<u64>>,
}

impl Ledger {
    pub fn new(blocks: u64) -> Ledger {
        Ledger {
            durable: vec![0; blocks as usize],
            maybe: vec![vec![]; blocks as usize],
        }
    }

    /// Checks block `lba` (its 4 KiB `b`) as read after a crash; what was found becomes the
    /// baseline of the next cycle.
    pub fn observe(&mut self, lba: u64, b: &[u8]) -> Found {
        let i = lba as usize;
        let found = match tag_of(b, lba) {
            None => Found::Torn,
            Some(got) if got != self.durable[i] && !self.maybe[i].contains(&got) => {
                let lost = Found::Lost {
                    has: got,
                    flushed: self.durable[i],
                };
                self.durable[i] = got;
                lost
            }
            Some(got) => {
                self.durable[i] = got;
                Found::Ok
            }
        };
        self.maybe[i].clear();
        found
    }

    /// A completed FLUSH covered `tag` at `lba`.
    pub fn flushed(&mut self, lba: u64, tag: u64) {
        self.durable[lba as usize] = tag;
        self.maybe[lba as usize].clear();
    }

    /// `tag` was written at `lba` without a FLUSH after it (yet).
    pub fn written(&mut self, lba: u64, tag: u64) {
        self.maybe[lba as usize].push(tag);
    }
}

/// Clears every mount and loop device under a test's directory when the test ends, passed or
/// failed (a failed test's daemon dies with its mounts up). Declared after the tempdir, so it
/// runs first.
pub struct Cleanup(pub std::path::PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let d = self.0.to_string_lossy().into_owned();
        let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> = mi
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&d))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = std::process::Command::new("umount")
                .args(["-l", p])
                .status();
        }
        for e in std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
                if b.contains(&d) {
                    let dev = format!("/dev/{}", e.file_name().to_string_lossy());
                    let _ = std::process::Command::new("losetup")
                        .args(["-d", &dev])
                        .status();
                }
            }
        }
    }
}

/// Writes `n` files of assorted sizes under `dir`, each fsync'd (and the directory), and
/// returns their contents' hashes.
pub fn write_files(dir: &Path, n: usize, seed: u64) -> std::collections::BTreeMap<String, String> {
    use std::io::Write;
    std::fs::create_dir_all(dir).unwrap();
    let mut out = std::collections::BTreeMap::new();
    let mut x = seed | 1;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % (2 << 20)) as usize + 1;
        let mut data = vec![0u8; len];
        for (j, b) in data.iter_mut().enumerate() {
            *b = (x.wrapping_add(j as u64 * 0x9E37_79B9)).to_le_bytes()[j % 8];
        }
        let name = format!("f{seed}-{i}");
        let mut f = std::fs::File::create(dir.join(&name)).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        out.insert(name, blake3::hash(&data).to_hex().to_string());
    }
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
    out
}

pub fn hashes(
    dir: &Path,
    names: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    names
        .keys()
        .map(|n| {
            let h = std::fs::read(dir.join(n))
                .map(|d| blake3::hash(&d).to_hex().to_string())
                .unwrap_or_else(|e| format!("unreadable: {e}"));
            (n.clone(), h)
        })
        .collect()
}

/// Whether `p` is a mount point (as mountinfo spells it).
pub fn is_mount_point(p: impl AsRef<Path>) -> bool {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let p = p.as_ref().to_string_lossy();
    mi.lines().any(|l| l.split(' ').nth(4) == Some(p.as_ref()))
}

/// Bytes `df` reports for the filesystem at `dir`.
pub fn df_size(dir: impl AsRef<Path>) -> u64 {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=size"])
        .arg(dir.as_ref())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1).unwrap().trim().parse().unwrap()
}

/// Whether this process may grow a mounted ext4 (the kernel asks for CAP_SYS_RESOURCE).
pub fn can_resize_online() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .unwrap_or(0);
    eff & (1 << 24) != 0
}
