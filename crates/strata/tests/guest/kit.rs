//! The guest kit shared by the real-kernel tests (`guest_nbd.rs`, `guest_vhost.rs`): Debian's
//! kernel and modules from `.ci/guest-kit.sh` (`STRATA_GUEST_KIT`, default
//! `/var/cache/strata-guest`), a busybox initramfs whose init mounts the host's root read-only
//! and a work directory over 9p and runs a phase of a script in a chroot of the host's root,
//! and a QEMU (TCG) guest whose console lines are read for `STEP`/`FAIL`/`EXIT` markers.
//! Without the kit, QEMU or root a test says SKIPPED, and fails under `STRATA_REQUIRE_GUEST=1`.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct Kit {
    kernel: PathBuf,
    modules: PathBuf,
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn kit() -> Option<Kit> {
    let dir = PathBuf::from(
        std::env::var("STRATA_GUEST_KIT").unwrap_or_else(|_| "/var/cache/strata-guest".into()),
    );
    let kernel = std::fs::read_dir(dir.join("root/boot"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })?;
    let version = kernel
        .file_name()?
        .to_string_lossy()
        .strip_prefix("vmlinuz-")?
        .to_string();
    let modules = dir.join("root/lib/modules").join(version);
    modules
        .join("modules.dep")
        .exists()
        .then_some(Kit { kernel, modules })
}

/// A test's directory (with `work/` for the guest's 9p share), and what keeps it: the
/// directory is removed when that is dropped, unless STRATA_GUEST_KEEP=1 keeps it (logs,
/// initramfs, disks) for a look after.
pub fn workdir() -> (PathBuf, PathBuf, Option<tempfile::TempDir>) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let keep = if std::env::var("STRATA_GUEST_KEEP").is_ok() {
        let _ = tmp.keep();
        None
    } else {
        Some(tmp)
    };
    eprintln!("guest work directory: {}", root.display());
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    (root, work, keep)
}

pub fn ready(what: &str) -> Option<Kit> {
    let missing: Vec<&str> = [
        "qemu-system-x86_64",
        "busybox",
        "mkfs.ext4",
        "fio",
        "qemu-img",
    ]
    .into_iter()
    .filter(|t| !have(t))
    .collect();
    let kit = kit();
    let root = is_root();
    if missing.is_empty() && kit.is_some() && root {
        return kit;
    }
    let why = format!("{what} needs root, the guest kit (.ci/guest-kit.sh) and {missing:?}");
    assert!(
        std::env::var("STRATA_REQUIRE_GUEST").as_deref() != Ok("1"),
        "STRATA_REQUIRE_GUEST=1 but: {why}"
    );
    eprintln!("SKIPPED: {why}");
    None
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The modules to load, dependencies first, as paths relative to the module directory.
fn closure(modules: &Path, wanted: &[&str]) -> Vec<String> {
    let dep = std::fs::read_to_string(modules.join("modules.dep")).unwrap();
    let deps: std::collections::HashMap<String, Vec<String>> = dep
        .lines()
        .filter_map(|l| {
            let (m, d) = l.split_once(':')?;
            Some((
                m.to_string(),
                d.split_whitespace().map(str::to_string).collect(),
            ))
        })
        .collect();
    let by_name = |n: &str| {
        deps.keys()
            .find(|k| {
                Path::new(k)
                    .file_stem()
                    .is_some_and(|s| s.to_string_lossy() == n)
            })
            .cloned()
            .unwrap_or_else(|| panic!("module {n} not in modules.dep"))
    };
    fn visit(
        m: &str,
        deps: &std::collections::HashMap<String, Vec<String>>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if !seen.insert(m.to_string()) {
            return;
        }
        for d in deps.get(m).into_iter().flatten() {
            visit(d, deps, seen, out);
        }
        out.push(m.to_string());
    }
    let (mut seen, mut out) = (BTreeSet::new(), vec![]);
    for w in wanted {
        visit(&by_name(w), &deps, &mut seen, &mut out);
    }
    out
}

/// A gzip'd newc initramfs: busybox, the modules, and an init that loads them, mounts the
/// host's root (read-only) and the work directory over 9p, and runs the phase's script in a
/// chroot of the host's root.
pub fn initramfs(kit: &Kit, dir: &Path, modules: &[&str], script: &str) -> PathBuf {
    let ir = dir.join("initramfs");
    for d in ["bin", "lib/modules", "proc", "sys", "dev", "host"] {
        std::fs::create_dir_all(ir.join(d)).unwrap();
    }
    let busybox = String::from_utf8(
        Command::new("sh")
            .args(["-c", "command -v busybox"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    std::fs::copy(busybox.trim(), ir.join("bin/busybox")).unwrap();
    let mods = closure(&kit.modules, modules);
    let mut load = String::new();
    for m in &mods {
        let name = Path::new(m)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        std::fs::copy(kit.modules.join(m), ir.join("lib/modules").join(&name)).unwrap();
        load.push_str(&format!(
            "insmod /lib/modules/{name} || echo \"FAIL insmod {name}\"\n"
        ));
    }
    let init = format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
{load}
phase=$(sed -n 's/.*strata.phase=\([0-9]*\).*/\1/p' /proc/cmdline)
export STRATA_GUEST_REUSE=$(sed -n 's/.*strata.reuse=\([0-9]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,ro host /host || echo "FAIL 9p host"
mount -t tmpfs -o size=512m tmp /host/tmp
mkdir -p /host/tmp/work
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 work /host/tmp/work || echo "FAIL 9p work"
mount -o bind /dev /host/dev; mount -t proc proc /host/proc; mount -t sysfs sys /host/sys
ip link set lo up
chroot /host /bin/sh /tmp/work/{script} $phase
echo "EXIT $?"
poweroff -f
"#
    );
    std::fs::write(ir.join("init"), init).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(ir.join("init"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.join("initrd.gz");
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd {} && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 > {}",
            ir.display(),
            out.display()
        ))
        .status()
        .unwrap()
        .success();
    assert!(ok, "building the initramfs");
    out
}

/// Mount/umount cycles of the device-reuse check (CI: a few; `STRATA_GUEST_REUSE=100`).
pub fn reuse() -> u32 {
    std::env::var("STRATA_GUEST_REUSE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

pub struct Guest {
    pub child: Child,
    booted: Instant,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Guest {
    /// Boots with `args` added (drives, memory backends).
    pub fn boot(kit: &Kit, initrd: &Path, work: &Path, args: &[String], phase: u32) -> Guest {
        let mut child = Command::new("qemu-system-x86_64")
            .args([
                "-machine",
                "q35,accel=tcg",
                "-cpu",
                "max",
                "-m",
                "1536",
                "-smp",
                "2",
            ])
            .args(["-nographic", "-no-reboot", "-kernel"])
            .arg(&kit.kernel)
            .arg("-initrd")
            .arg(initrd)
            .arg("-append")
            .arg(format!(
                "console=ttyS0 quiet panic=-1 strata.phase={phase} strata.reuse={}",
                reuse()
            ))
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=host,readonly=on,security_model=none")
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=work,security_model=none",
                work.display()
            ))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("qemu-system-x86_64");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).split(b'\n').map_while(Result::ok) {
                let _ = tx.send(String::from_utf8_lossy(&l).trim_end().to_string());
            }
        });
        Guest {
            child,
            booted: Instant::now(),
            lines,
            log: vec![],
        }
    }

    /// Waits for a line starting with `want`; panics on a FAIL line, an early exit or timeout.
    pub fn expect(&mut self, want: &str, within: Duration) {
        let end = Instant::now() + within;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.log.push(l.clone());
                    // A marker may follow a progress line's carriage returns on the console.
                    let Some(at) = ["STEP ", "FAIL", "EXIT "]
                        .iter()
                        .filter_map(|m| l.find(m))
                        .min()
                    else {
                        continue;
                    };
                    let l = &l[at..];
                    eprintln!("guest {:>6.1}s: {l}", self.booted.elapsed().as_secs_f64());
                    if l.starts_with("FAIL") || l.starts_with("EXIT") {
                        panic!("guest failed before {want:?}:\n{}", self.tail());
                    }
                    if l.starts_with(want) {
                        return;
                    }
                }
                Err(_) => panic!("guest: no {want:?} within {within:?}:\n{}", self.tail()),
            }
        }
    }

    fn tail(&self) -> String {
        let n = self.log.len().saturating_sub(60);
        self.log[n..].join("\n")
    }
}
