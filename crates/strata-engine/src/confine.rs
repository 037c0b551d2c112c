//! Host tools run on what a tenant wrote (`mkfs.ext4 -d` over its unpacked archive, `qemu-img`
//! on its image, `e2fsck` and `resize2fs` on its filesystem) run confined: a parser of hostile
//! input gets none of the daemon's privileges it does not need (so it cannot mount, unmount,
//! load modules, change ownership, trace or signal other processes), and is bounded in memory,
//! CPU time, open files, output and wall time.
//!
//! In the child, before `exec` (each step only where the daemon has what it takes away):
//! - the capability bounding set cut to what the tool needs: root's capabilities after `exec`
//!   are the bounding set, so the tool runs with those and no others (file access by owner,
//!   as uid 0, is unchanged); the process's own sets lowered to the same, the inheritable and
//!   ambient sets cleared;
//! - `no_new_privs`, so no set-uid or file capability gives any back;
//! - limits (only ever lowered): address space, CPU seconds, open files, no core dumps.
//!
//! No mount namespace of its own: without CAP_SYS_ADMIN the tool can change no mount, and a
//! namespace copied from the daemon's would hold every other tenant's mounts for as long as
//! the tool runs (their unmounts then found their filesystems still in use).
//!
//! The caller bounds the wall time ([`run`] kills the tool past its timeout).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// What a confined tool may keep of root's capabilities.
#[derive(Clone, Copy, Debug, Default)]
pub struct Keep {
    /// Read files and search directories whatever their modes (`mkfs.ext4 -d` over a tenant's
    /// tree, whose modes the tenant chose).
    pub read_any: bool,
    /// Grow a mounted ext4 (`resize2fs` online: the kernel asks for CAP_SYS_RESOURCE).
    pub sys_resource: bool,
}

/// Limits of a confined tool.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub address_space: u64,
    pub cpu_seconds: u64,
    pub open_files: u64,
    pub wall: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            address_space: 4 << 30,
            cpu_seconds: 1800,
            open_files: 1024,
            wall: Duration::from_secs(1800),
        }
    }
}

/// Sets `cmd` up to run confined (see the module docs).
pub fn confine(cmd: &mut Command, keep: Keep, limits: Limits) {
    use std::os::unix::process::CommandExt;
    #[allow(unsafe_code)]
    // SAFETY: the closure runs in the forked child before exec and only makes system calls
    // through rustix (no allocation, no locks); errors are returned, never panicked on.
    unsafe {
        cmd.pre_exec(move || in_child(keep, limits));
    }
}

/// What the child does before `exec`. Only system calls: no allocation.
fn in_child(keep: Keep, limits: Limits) -> std::io::Result<()> {
    use rustix::process::{setrlimit, Resource, Rlimit};
    use rustix::thread::CapabilitySet;
    let caps = rustix::thread::capabilities(None)?;
    let mut kept = CapabilitySet::empty();
    if keep.read_any {
        kept |= CapabilitySet::DAC_READ_SEARCH;
    }
    if keep.sys_resource {
        kept |= CapabilitySet::SYS_RESOURCE;
    }
    if caps.effective.contains(CapabilitySet::SETPCAP) {
        for bit in 0..64u32 {
            let cap = CapabilitySet::from_bits_retain(1u64 << bit);
            if kept.contains(cap) {
                continue;
            }
            match rustix::thread::remove_capability_from_bounding_set(cap) {
                // Past the kernel's last capability.
                Ok(()) | Err(rustix::io::Errno::INVAL) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    // Nothing passes exec through the inheritable or ambient sets either (a runtime may have
    // set them), and what this process keeps is at most `kept` (lowering needs no privilege).
    match rustix::thread::clear_ambient_capability_set() {
        // A kernel without ambient capabilities: nothing to clear.
        Ok(()) | Err(rustix::io::Errno::INVAL) => {}
        Err(e) => return Err(e.into()),
    }
    rustix::thread::set_capabilities(
        None,
        rustix::thread::CapabilitySets {
            effective: caps.effective & kept,
            permitted: caps.permitted & kept,
            inheritable: CapabilitySet::empty(),
        },
    )?;
    rustix::thread::set_no_new_privs(true)?;
    // Limits are only ever lowered (raising one needs a capability the tool no longer has).
    let lower = |r: Resource, n: u64| {
        let old = rustix::process::getrlimit(r);
        let max = old.maximum.map_or(n, |m| m.min(n));
        setrlimit(
            r,
            Rlimit {
                current: Some(old.current.map_or(max, |c| c.min(max))),
                maximum: Some(max),
            },
        )
    };
    lower(Resource::As, limits.address_space)?;
    lower(Resource::Cpu, limits.cpu_seconds)?;
    lower(Resource::Nofile, limits.open_files)?;
    lower(Resource::Core, 0)?;
    Ok(())
}

/// Runs `cmd` confined and waits for it, killing it past `limits.wall`: its output (which the
/// caller checks), or an error if it could not start or ran out of time.
pub fn run(cmd: &mut Command, keep: Keep, limits: Limits) -> std::io::Result<Output> {
    use std::io::Read;
    use std::process::Stdio;
    confine(cmd, keep, limits);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // The pipes are drained by threads, so a chatty tool never blocks on a full pipe; what a
    // tool says past [`MAX_OUTPUT`] is read and dropped (the answer is then refused), so a
    // hostile input cannot make a tool fill the daemon's memory through its output.
    let drain = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut over = false;
            if let Some(p) = p {
                let mut p = p.take(MAX_OUTPUT + 1);
                let _ = p.read_to_end(&mut buf);
                over = buf.len() as u64 > MAX_OUTPUT;
                let _ = std::io::copy(&mut p.into_inner(), &mut std::io::sink());
            }
            (buf, over)
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if started.elapsed() > limits.wall {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("killed after {:?}", limits.wall),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, over) = out.join().unwrap_or_default();
    let (mut stderr, _) = err.join().unwrap_or_default();
    stderr.truncate(MAX_OUTPUT as usize);
    if over {
        return Err(std::io::Error::other(format!(
            "its output passed {MAX_OUTPUT} bytes"
        )));
    }
    Ok(Output {
        status,
        stdout,
        stderr,
    })
}

/// The most of a confined tool's output kept (the rest is read and dropped).
pub const MAX_OUTPUT: u64 = 16 << 20;

/// [`run`] for an async caller (a `tokio` command, killed when dropped): confined, waited for
/// at most `limits.wall`, its output bounded like [`run`]'s.
pub async fn run_async(
    cmd: &mut tokio::process::Command,
    keep: Keep,
    limits: Limits,
) -> std::io::Result<Output> {
    use std::process::Stdio;
    use tokio::io::AsyncReadExt;
    confine(cmd.as_std_mut(), keep, limits);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    async fn drain(p: Option<impl tokio::io::AsyncRead + Unpin>) -> (Vec<u8>, bool) {
        let mut buf = Vec::new();
        let Some(p) = p else { return (buf, false) };
        let mut p = p.take(MAX_OUTPUT + 1);
        let _ = p.read_to_end(&mut buf).await;
        let over = buf.len() as u64 > MAX_OUTPUT;
        let _ = tokio::io::copy(&mut p.into_inner(), &mut tokio::io::sink()).await;
        (buf, over)
    }
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let all = async {
        let ((stdout, over), (mut stderr, _), status) =
            tokio::join!(drain(out), drain(err), child.wait());
        stderr.truncate(MAX_OUTPUT as usize);
        if over {
            return Err(std::io::Error::other(format!(
                "its output passed {MAX_OUTPUT} bytes"
            )));
        }
        Ok(Output {
            status: status?,
            stdout,
            stderr,
        })
    };
    match tokio::time::timeout(limits.wall, all).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("killed after {:?}", limits.wall),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, keep: Keep, limits: Limits) -> String {
        let out = run(Command::new("sh").arg("-c").arg(script), keep, limits).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    /// Issue 41, item 7: host tools read tenant filesystems with the daemon's privileges and no
    /// bound. Confined, a tool keeps only the capabilities named, sees a mount namespace of its
    /// own, and its limits hold.
    #[test]
    fn a_confined_tool_has_what_it_was_given_and_nothing_more() {
        if !is_root() {
            assert!(std::env::var("CI").is_err(), "CI runs as root");
            eprintln!("skipping: the capability checks need root");
            return;
        }
        let status = sh(
            "grep -E '^Cap(Eff|Bnd)|^NoNewPrivs' /proc/self/status; readlink /proc/self/ns/mnt; ulimit -v; ulimit -n",
            Keep {
                read_any: true,
                ..Keep::default()
            },
            Limits {
                address_space: 1 << 30,
                open_files: 64,
                ..Limits::default()
            },
        );
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        // CAP_DAC_READ_SEARCH is bit 2.
        assert_eq!(field("CapEff:"), "0000000000000004", "{status}");
        assert_eq!(field("CapBnd:"), "0000000000000004", "{status}");
        assert_eq!(field("NoNewPrivs:"), "1", "{status}");
        // The daemon's own mount namespace: no copy of every tenant's mounts held by a tool.
        let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
        assert!(
            status.lines().any(|l| l == ours.to_string_lossy()),
            "the daemon's mount namespace: {status}"
        );
        let lines: Vec<&str> = status.lines().collect();
        assert_eq!(lines[lines.len() - 2], (1u64 << 30 >> 10).to_string());
        assert_eq!(lines[lines.len() - 1], "64");
        // A tool cannot mount anything (no CAP_SYS_ADMIN).
        let d = tempfile::tempdir().unwrap();
        let p = d.path().display().to_string();
        let out = run(
            Command::new("mount").args(["-t", "tmpfs", "x", &p]),
            Keep::default(),
            Limits::default(),
        )
        .unwrap();
        assert!(!out.status.success(), "a confined tool mounted");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(&p), "a confined tool mounted");
    }

    #[test]
    fn a_tool_past_its_wall_time_is_killed() {
        let t = Instant::now();
        let e = run(
            Command::new("sleep").arg("30"),
            Keep::default(),
            Limits {
                wall: Duration::from_millis(300),
                ..Limits::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
