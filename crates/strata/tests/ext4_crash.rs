//! ext4 on top of a daemon under a nemesis: a real ext4 (nbdfuse + loop) is written file by
//! file, each file fsync'd and then logged, while one operation hits the daemon at a random
//! moment: SIGKILL; a checkpoint of the mounted file system, forked and checked; freeze and thaw;
//! a GC pass with compaction. After a kill, e2fsck may replay the journal and fix the free-space
//! summary (which ext4 never journals) and nothing else; after the other operations and a clean
//! unmount it must find nothing at all. A checkpoint taken mid-write is crash-consistent: its
//! fork gets the same allowance, and holds every file fsync'd before it was requested. Then a
//! second e2fsck finds each file system clean and every file whose fsync returned is intact.
//! Cycles continue on the same file system.
//!
//! `STRATA_EXT4_KILL_CYCLES` (default 6 in CI; the first cycle kills, later ones pick).

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_survives_kill_9_of_the_daemon_mid_write() {
    if !can_mount() {
        return;
    }
    let cycles: u64 = std::env::var("STRATA_EXT4_KILL_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let d = tempfile::tempdir().unwrap();
    let script = format!(
        r#"set -u
cd {dir}
B={bin}
mkdir -p fuse mnt
start() {{
  rm -f serve.out
  STRATA_ADMIN_TOKEN=adm $B --data data --json serve --listen 127.0.0.1:0 --lease-ttl 2s --gc-grace 2s --compact-below 0.9 >serve.out 2>>serve.err &
  echo $! >daemon.pid
  for i in $(seq 100); do [ -s serve.out ] && break; sleep 0.1; done
  URL=http://$(head -1 serve.out | sed 's/.*"listening":"\([^"]*\)".*/\1/')
}}
fuse() {{
  rm -f nf.pid
  nbdfuse -P nf.pid fuse/disk "$EXP" 2>/dev/null &
  for i in $(seq 100); do [ -s nf.pid ] && break; sleep 0.1; done
}}
unfuse() {{
  kill $(cat nf.pid) 2>/dev/null; sleep 0.3; fusermount3 -u fuse 2>/dev/null || true
}}
# Stops the writer and whatever it is running (a `head` or `sync` left behind keeps the mount busy).
stopw() {{
  kill -- -$W 2>/dev/null; wait $W 2>/dev/null
  # A `sync` in uninterruptible sleep ends only when its I/O does.
  for i in $(seq 100); do kill -0 -- -$W 2>/dev/null || break; sleep 0.1; done
}}
api() {{ curl -sf -X POST -H "Authorization: Bearer $1" -H 'Content-Type: application/json' -d "$3" $URL$2; }}
# fsck DEV WHAT: after an unclean stop only journal replay, orphan cleanup and free-space
# summary counts may be fixed; then the file system must be clean.
fsck() {{
  timeout 120 e2fsck -fy $1 >fsck.out 2>&1; rc=$?
  if [ $rc -gt 1 ]; then echo "$2: e2fsck exit $rc"; cat fsck.out; return 1; fi
  if grep -vE '^(e2fsck|Pass [1-5]|/dev/loop|Free (blocks|inodes) count wrong|Fix\? yes|Clearing orphaned|Truncating orphaned|Padding at end|$|\s)' fsck.out | grep -v 'recovering journal' | grep -q .; then
    echo "$2: unexpected e2fsck findings"; cat fsck.out; return 1
  fi
  timeout 120 e2fsck -fn $1 >fsck2.out 2>&1 || {{ echo "$2: not clean after repair"; cat fsck2.out; return 1; }}
}}
# intact LIST: every file in LIST is in mnt with its hash
intact() {{
  bad=0; while read f h; do [ "$(sha256sum <mnt/$f 2>/dev/null | cut -c1-16)" = "$h" ] || {{ echo "lost or changed: $f"; bad=$((bad+1)); }}; done <$1
  [ $bad -eq 0 ]
}}
start
TOK=$(curl -sf -X POST -H "Authorization: Bearer adm" -H 'Content-Type: application/json' -d '{{"name":"t"}}' $URL/v1/tenants | sed 's/.*"token":"\([^"]*\)".*/\1/')
curl -sf -X POST -H "Authorization: Bearer $TOK" -H 'Content-Type: application/json' -d '{{"name":"fs","size":134217728}}' $URL/v1/workspaces >/dev/null
EXP=$(curl -sf -X POST -H "Authorization: Bearer $TOK" -H 'Content-Type: application/json' -d '{{}}' $URL/v1/workspaces/fs/attach | sed 's/.*"export":"\([^"]*\)".*/\1/')
fuse
mkfs.ext4 -q -F fuse/disk
: >synced.txt
n=0
for cycle in $(seq 1 {cycles}); do
  loop=$(losetup -f --show fuse/disk) || {{ echo "cycle $cycle: the disk is gone"; tail -30 serve.err; exit 1; }}
  mount $loop mnt
  # The writer runs in a process group of its own, so stopping it stops what it is running.
  set -m
  ( while true; do n=$((n+1)); f=c$cycle-$n; head -c $(( (RANDOM % 64 + 1) * 4096 )) /dev/urandom >mnt/$f && sync mnt/$f && echo "$f $(sha256sum <mnt/$f | cut -c1-16)" >>synced.txt || break; done ) 2>/dev/null &
  W=$!
  set +m
  sleep 0.$(( RANDOM % 9 + 1 ))
  # The first cycle always kills; later ones pick.
  op=$(( cycle == 1 ? 0 : RANDOM % 4 ))
  echo "cycle $cycle: op $op" >>serve.err
  case $op in
  0) what=kill
     kill -9 $(cat daemon.pid)
     sleep 0.3; stopw
     timeout 20 umount -l mnt; timeout 20 losetup -d $loop; unfuse
     start; fuse ;;
  1) what=checkpoint
     cp synced.txt before-cp.txt
     V=$(api $TOK /v1/workspaces/fs/checkpoint '{{}}' | sed 's/.*"version":\([0-9]*\).*/\1/')
     sleep 0.2; stopw
     umount mnt; losetup -d $loop
     # The fork of a checkpoint of a mounted file system is crash-consistent.
     api $TOK /v1/workspaces/fs/fork "{{\"name\":\"k$cycle\",\"version\":$V}}" >/dev/null || {{ echo "fork failed"; exit 1; }}
     KEXP=$(api $TOK /v1/workspaces/k$cycle/attach '{{}}' | sed 's/.*"export":"\([^"]*\)".*/\1/')
     mkdir -p fusek; rm -f nk.pid; nbdfuse -P nk.pid fusek/disk "$KEXP" 2>/dev/null &
     for i in $(seq 100); do [ -s nk.pid ] && break; sleep 0.1; done
     kl=$(losetup -f --show fusek/disk)
     fsck $kl "cycle $cycle fork of v$V" || exit 1
     mount -o ro $kl mnt; intact before-cp.txt || {{ echo "cycle $cycle: the checkpoint lacks files fsync'd before it"; exit 1; }}
     umount mnt; losetup -d $kl; kill $(cat nk.pid); sleep 0.3; fusermount3 -u fusek 2>/dev/null || true
     api $TOK /v1/workspaces/k$cycle/detach '{{}}' >/dev/null
     echo "cycle $cycle: checkpoint v$V holds the $(wc -l <before-cp.txt) files fsync'd before it" ;;
  2) what=freeze
     api $TOK /v1/workspaces/fs/freeze '{{}}' >/dev/null; sleep 0.$(( RANDOM % 5 + 1 ))
     api $TOK /v1/workspaces/fs/thaw '{{}}' >/dev/null
     sleep 0.2; stopw
     umount mnt || {{ echo "cycle $cycle: mount busy"; fuser -vm mnt; exit 1; }}; losetup -d $loop ;;
  3) what=gc
     api adm /v1/gc '{{}}' >/dev/null || {{ echo "gc failed"; exit 1; }}
     stopw
     umount mnt; losetup -d $loop ;;
  esac
  loop=$(losetup -f --show fuse/disk)
  if [ $op -eq 0 ]; then
    fsck $loop "cycle $cycle" || exit 1
  else
    # After a clean unmount nothing at all may need fixing.
    timeout 120 e2fsck -fn $loop >fsck2.out 2>&1 || {{ echo "cycle $cycle ($what): not clean"; cat fsck2.out; exit 1; }}
  fi
  mount -o ro $loop mnt
  intact synced.txt || exit 1
  umount mnt; losetup -d $loop
  echo "cycle $cycle ($what): $(wc -l <synced.txt) fsync'd files intact, e2fsck clean"
done
unfuse
kill -0 $(cat daemon.pid) || {{ echo "the daemon died"; tail -30 serve.err; exit 1; }}
kill $(cat daemon.pid)
exit 0
"#,
        dir = d.path().display(),
        bin = env!("CARGO_BIN_EXE_strata"),
        cycles = cycles
    );
    let (ok, out, err) = bash(script).await;
    eprintln!("{out}");
    assert!(ok, "{out}\n{err}");
    assert!(out.contains(&format!("cycle {cycles} (")), "{out}");
}
