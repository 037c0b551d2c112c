#!/bin/sh
# Runs inside the guest (chroot of the host's root over 9p), see tests/guest_vhost.rs.
# Phase 1: /dev/vda is a workspace served over vhost-user-blk by the host's daemon. ext4 on it,
#   files written and fsync'd (their md5 listed in the work directory), a checkpoint taken by
#   the host while the guest runs, more fsync'd files, then the host kills QEMU (power cut).
# Phase 2 (after the host killed the daemon with -9 and restarted it): /dev/vda is the same
#   workspace, /dev/vdb a workspace forked from the checkpoint. Every fsync'd file is on vda;
#   vdb holds exactly what was fsync'd before the checkpoint; both e2fsck clean. Then the guest
#   writes fsync'd files while the host kills the daemon with -9 and restarts it: QEMU
#   reconnects, every write completes without an I/O error, every file is intact.
set -u
W=/tmp/work
step() { echo "STEP $*"; }
fail() { echo "FAIL $*"; exit 1; }

write_files() { # prefix count list
  i=1
  while [ "$i" -le "$2" ]; do
    f=/tmp/mnt-a/$1$i
    dd if=/dev/urandom of="$f" bs=64k count=$((4 + i)) conv=fsync 2>/dev/null || fail "write $f"
    sync /tmp/mnt-a || fail "fsync of the directory"
    echo "$1$i $(md5sum < "$f" | cut -d' ' -f1)" >> "$W/$3"
    i=$((i + 1))
  done
}

check_files() { # dir list
  n=0
  while read -r name sum; do
    [ -f "$1/$name" ] || fail "$name missing from $1"
    [ "$(md5sum < "$1/$name" | cut -d' ' -f1)" = "$sum" ] || fail "$name differs in $1"
    n=$((n + 1))
  done < "$W/$2"
  echo "$n"
}

case "$1" in
1)
  [ -b /dev/vda ] || fail "no vhost-user disk"
  step "disk $(cat /sys/block/vda/size) sectors, serial $(cat /sys/block/vda/serial 2>/dev/null), blocks $(cat /sys/block/vda/queue/logical_block_size)/$(cat /sys/block/vda/queue/physical_block_size)"
  [ "$(cat /sys/block/vda/queue/physical_block_size)" = 4096 ] || fail "physical block size"
  [ "$(ls /sys/block/vda/mq | wc -l)" = 2 ] || fail "the guest does not use both queues"
  [ "$(cat /sys/block/vda/queue/write_cache)" = "write back" ] || fail "write cache not write back: FLUSH not offered"
  mkfs.ext4 -q -F /dev/vda || fail mkfs
  mkdir -p /tmp/mnt-a
  mount /dev/vda /tmp/mnt-a || { dmesg | tail -20; dumpe2fs -h /dev/vda 2>&1 | head -5; fail mount; }
  step mounted
  : > "$W/pre.list"; : > "$W/post.list"
  write_files pre 8 pre.list
  step "pre-checkpoint files"
  t=0
  while [ ! -e "$W/checkpointed" ]; do
    sleep 0.2; t=$((t + 1)); [ "$t" -lt 1500 ] || fail "no checkpoint from the host"
  done
  step "checkpoint taken"
  write_files post 8 post.list
  # Unsynced data after the last fsync: not owed after the power cut.
  dd if=/dev/urandom of=/tmp/mnt-a/unsynced bs=64k count=32 2>/dev/null
  step KILL-ME
  sleep 600
  ;;
2)
  mkdir -p /tmp/mnt-a /tmp/mnt-b
  mount /dev/vda /tmp/mnt-a || fail "mount vda after the power cut and daemon restart"
  step remounted
  n=$(check_files /tmp/mnt-a pre.list) || exit 1
  m=$(check_files /tmp/mnt-a post.list) || exit 1
  step "every fsync'd file intact ($n + $m)"
  umount /tmp/mnt-a || fail umount
  e2fsck -fn /dev/vda > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck vda"; }
  step "e2fsck -fn clean"
  mount /dev/vdb /tmp/mnt-b || fail "mount the restored checkpoint"
  n=$(check_files /tmp/mnt-b pre.list) || exit 1
  for f in /tmp/mnt-b/post*; do [ -e "$f" ] && fail "$f was written after the checkpoint"; done
  step "checkpoint restored ($n files, nothing after it)"
  dd if=/dev/urandom of=/tmp/mnt-b/new bs=64k count=16 conv=fsync 2>/dev/null || fail "write to the fork"
  umount /tmp/mnt-b || fail "umount vdb"
  e2fsck -fn /dev/vdb > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck vdb"; }
  step "restored e2fsck clean"
  # Writes go on while the host kills the daemon with -9 and restarts it: QEMU reconnects
  # (reconnect-ms) and the guest's requests wait, then complete; no I/O error, nothing lost.
  mount /dev/vda /tmp/mnt-a || fail "mount vda again"
  : > "$W/restart.list"
  step "writer started"
  i=1
  while [ ! -e "$W/restarted" ] || [ "$i" -le 40 ]; do
    f=/tmp/mnt-a/r$i
    dd if=/dev/urandom of="$f" bs=64k count=2 conv=fsync 2>/dev/null || fail "write $f through the restart"
    sync /tmp/mnt-a || fail "fsync through the restart"
    echo "r$i $(md5sum < "$f" | cut -d' ' -f1)" >> "$W/restart.list"
    i=$((i + 1))
    [ "$i" -lt 3000 ] || fail "the host never restarted the daemon"
  done
  n=$(check_files /tmp/mnt-a restart.list) || exit 1
  umount /tmp/mnt-a || fail "umount after the restart"
  e2fsck -fn /dev/vda > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck vda after the restart"; }
  dmesg | grep -i "i/o error" && fail "I/O errors in the guest"
  step "writes went on through a daemon kill -9 and restart ($n files), e2fsck clean"
  step "DONE 2"
  ;;
esac
