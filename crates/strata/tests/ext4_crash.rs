//! ext4 on top of a crashing daemon: a real ext4 (nbdfuse + loop) is written file by file, each
//! file fsync'd and then logged, while `strata serve` is killed with SIGKILL at a random moment;
//! after the restart e2fsck may replay the journal and fix the free-space summary (which ext4
//! never journals) and nothing else, a second e2fsck finds the file system clean, and every file
//! whose fsync returned is intact. Cycles continue on the same file system.
//!
//! `STRATA_EXT4_KILL_CYCLES` (default 3 in CI).

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
        .unwrap_or(3);
    let d = tempfile::tempdir().unwrap();
    let script = format!(
        r#"set -u
cd {dir}
B={bin}
mkdir -p fuse mnt
start() {{
  rm -f serve.out
  STRATA_ADMIN_TOKEN=adm $B --data data --json serve --listen 127.0.0.1:0 --lease-ttl 2s >serve.out 2>>serve.err &
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
start
TOK=$(curl -sf -X POST -H "Authorization: Bearer adm" -H 'Content-Type: application/json' -d '{{"name":"t"}}' $URL/v1/tenants | sed 's/.*"token":"\([^"]*\)".*/\1/')
curl -sf -X POST -H "Authorization: Bearer $TOK" -H 'Content-Type: application/json' -d '{{"name":"fs","size":134217728}}' $URL/v1/workspaces >/dev/null
EXP=$(curl -sf -X POST -H "Authorization: Bearer $TOK" -H 'Content-Type: application/json' -d '{{}}' $URL/v1/workspaces/fs/attach | sed 's/.*"export":"\([^"]*\)".*/\1/')
fuse
mkfs.ext4 -q -F fuse/disk
: >synced.txt
n=0
for cycle in $(seq 1 {cycles}); do
  loop=$(losetup -f --show fuse/disk)
  mount $loop mnt
  ( while true; do n=$((n+1)); f=c$cycle-$n; head -c $(( (RANDOM % 64 + 1) * 4096 )) /dev/urandom >mnt/$f && sync mnt/$f && echo "$f $(sha256sum <mnt/$f | cut -c1-16)" >>synced.txt || break; done ) 2>/dev/null &
  W=$!
  sleep 0.$(( RANDOM % 9 + 1 ))
  kill -9 $(cat daemon.pid)
  sleep 0.3; kill $W 2>/dev/null; wait $W 2>/dev/null
  timeout 20 umount -l mnt; timeout 20 losetup -d $loop; unfuse
  start; fuse
  loop=$(losetup -f --show fuse/disk)
  timeout 120 e2fsck -fy $loop >fsck.out 2>&1; rc=$?
  if [ $rc -gt 1 ]; then echo "cycle $cycle: e2fsck exit $rc"; cat fsck.out; exit 1; fi
  # Allowed after an unclean stop: journal replay, orphan cleanup, free-space summary counts.
  if grep -vE '^(e2fsck|Pass [1-5]|/dev/loop|Free (blocks|inodes) count wrong|Fix\? yes|Clearing orphaned|Truncating orphaned|Padding at end|$|\s)' fsck.out | grep -v 'recovering journal' | grep -q .; then
    echo "cycle $cycle: unexpected e2fsck findings"; cat fsck.out; exit 1
  fi
  timeout 120 e2fsck -fn $loop >fsck2.out 2>&1 || {{ echo "cycle $cycle: not clean after repair"; cat fsck2.out; exit 1; }}
  mount -o ro $loop mnt
  bad=0; while read f h; do [ "$(sha256sum <mnt/$f 2>/dev/null | cut -c1-16)" = "$h" ] || {{ echo "lost or changed: $f"; bad=$((bad+1)); }}; done <synced.txt
  umount mnt; losetup -d $loop
  echo "cycle $cycle: $(wc -l <synced.txt) fsync'd files intact, e2fsck rc $rc"
  [ $bad -eq 0 ] || exit 1
done
unfuse
kill $(cat daemon.pid)
"#,
        dir = d.path().display(),
        bin = env!("CARGO_BIN_EXE_strata"),
        cycles = cycles
    );
    let (ok, out, err) = bash(script).await;
    eprintln!("{out}");
    assert!(ok, "{out}\n{err}");
    assert!(out.contains(&format!("cycle {cycles}:")), "{out}");
}
