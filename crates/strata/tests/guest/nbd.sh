#!/bin/sh
# Runs inside the guest (Debian's kernel, the host's userspace over 9p, chrooted): the daemon
# here drives the guest kernel's nbd.ko over netlink. Phase 1: mount over kernel NBD with 4
# connections, fsync'd files, fio verify across a daemon kill -9 and restart, umount and
# remount, an online grow of disk, device and ext4, device reuse; then files fsync'd and writes in flight when the host kills QEMU.
# Phase 2 (the next boot, same data disk): the restarted daemon remounts from its record,
# every fsync'd file is intact, the exported disk checks clean. Lines "STEP …" and "FAIL …"
# go to the serial console, which the host test reads.
set -u
phase=$1
W=/tmp/work
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp
export STRATA_URL=http://127.0.0.1:7420 STRATA_TOKEN=admin-secret
S=$W/strata
REUSE=${STRATA_GUEST_REUSE:-20}
fail() { echo "FAIL $*"; dmesg | tail -20; exit 1; }
step() { echo "STEP $*"; }

mkdir -p /tmp/data /tmp/mr/acme/box
mount -t ext4 /dev/vda /tmp/data || fail "mounting the data disk"

start() {
  STRATA_ADMIN_TOKEN=admin-secret "$S" --data /tmp/data/strata serve --listen 127.0.0.1:7420 \
    --mount-root /tmp/mr --nbd-timeout 10s >>"$W/daemon-$phase.log" 2>&1 &
  DPID=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:7420/v1/health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  fail "daemon did not come up"
}
conns() { "$S" --tenant acme --json ws mounts | sed -n 's/.*"connections": *\([0-9]*\).*/\1/p' | head -1; }
nbd_dev() { "$S" --tenant acme --json ws mounts | sed -n 's/.*"device": *"\/dev\/\(nbd[0-9]*\)".*/\1/p' | head -1; }

if [ "$phase" = 1 ]; then
  start
  tok=$("$S" --json tenant create acme | sed -n 's/.*"token": *"\([^"]*\)".*/\1/p')
  [ -n "$tok" ] || fail "tenant create"
  echo "$tok" >/tmp/data/acme-token
  export STRATA_TOKEN=$tok
  "$S" --tenant acme ws create box --size 256MiB >/dev/null || fail "ws create"
  "$S" --tenant acme ws mount box /tmp/mr/acme/box --backend nbd --mkfs ext4 >/dev/null || fail "ws mount"
  dev=$(nbd_dev)
  [ -n "$dev" ] || fail "no nbd device in ws mounts"
  [ -e /sys/block/$dev/pid ] || fail "$dev is not connected"
  q=$(conns)
  [ "$q" = 4 ] || fail "$dev has $q connections served, not 4"
  step "mounted $dev with $q connections, backend $(cat /sys/block/$dev/backend)"

  T=/tmp/mr/acme/box
  mkdir -p $T/a
  for i in 1 2 3 4 5 6 7 8; do
    dd if=/dev/urandom of=$T/a/f$i bs=64k count=$((i * 3)) conv=fsync status=none || fail "writing a/f$i"
  done
  sync -f $T/a
  (cd $T/a && sha256sum f*) >$W/sums-a
  step "8 files fsync'd"

  # fio with verification, across a daemon kill -9 and restart: no I/O error may reach it.
  fio --name=v --directory=$T --size=12M --bs=4k --rw=randwrite --ioengine=psync --fsync=16 \
      --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --output=$W/fio.out >/dev/null 2>&1 &
  FIO=$!
  sleep 6
  kill -9 $DPID; wait $DPID 2>/dev/null
  step "daemon killed with -9 during fio"
  start
  for _ in $(seq 1 100); do [ "$(conns)" = 4 ] && break; sleep 0.2; done
  [ "$(conns)" = 4 ] || fail "the restarted daemon serves $(conns) connections of $dev, not 4"
  step "daemon restarted, 4 connections swapped into $dev"
  wait $FIO || { cat $W/fio.out; fail "fio failed across the restart"; }
  grep -q "err= 0" $W/fio.out || { cat $W/fio.out; fail "fio reported errors"; }
  dmesg | grep -i -E "I/O error|EXT4-fs error|Buffer I/O" && fail "the kernel saw I/O errors"
  [ "$(nbd_dev)" = "$dev" ] || fail "the restarted daemon does not serve $dev"
  step "fio verify passed across the restart, no I/O error, same device"

  # A clean stop while fsync'd writes go on: the device is parked, not disconnected.
  (for i in $(seq 1 12); do
     dd if=/dev/urandom of=$T/c$i bs=64k count=8 conv=fsync status=none || echo "FAIL dd c$i across a clean restart"
   done) &
  DD=$!
  sleep 2
  kill -TERM $DPID; wait $DPID
  step "daemon stopped cleanly during fsync'd writes"
  start
  wait $DD
  dmesg | grep -i -E "I/O error|EXT4-fs error|Buffer I/O" && fail "the kernel saw I/O errors across the clean restart"
  [ "$(nbd_dev)" = "$dev" ] || fail "the restarted daemon does not serve $dev"
  step "clean restart: writes went on, no I/O error"

  "$S" --tenant acme ws umount box >/dev/null || fail "ws umount"
  [ -e /sys/block/$dev/pid ] && fail "$dev still connected after umount"
  "$S" --tenant acme ws mount box $T --backend nbd >/dev/null || fail "ws mount again"
  (cd $T/a && sha256sum -c --quiet $W/sums-a) || fail "files differ after umount and mount"
  step "umount, mount: files intact"

  # Grown while mounted and written to: the kernel's device learns its size (RECONFIGURE), the
  # ext4 grows online (df sees it; the phase-2 e2fsck checks it), the files stay.
  dev=$(nbd_dev)
  (for i in $(seq 1 6); do
     dd if=/dev/urandom of=$T/r$i bs=64k count=8 conv=fsync status=none || echo "FAIL dd r$i during the resize"
   done) &
  DD=$!
  "$S" --tenant acme --json ws resize box 512MiB >$W/resize.out 2>&1 || { cat $W/resize.out; fail "ws resize"; }
  wait $DD
  [ "$(cat /sys/block/$dev/size)" = $((512 * 2048)) ] || fail "$dev has $(cat /sys/block/$dev/size) sectors after the resize"
  grep -q '"filesystem_size": *536870912' $W/resize.out || { cat $W/resize.out; fail "the filesystem did not grow"; }
  sz=$(df -B1 --output=size $T | tail -1)
  [ "$sz" -gt $((450 * 1048576)) ] || fail "df says $sz bytes after the resize"
  (cd $T/a && sha256sum -c --quiet $W/sums-a) || fail "files differ after the resize"
  dmesg | grep -i -E "I/O error|EXT4-fs error|Buffer I/O" && fail "the kernel saw I/O errors across the resize"
  step "grown to 512 MiB while mounted: device and ext4 online, df says $sz bytes"

  # A checkpoint and a live fork of the mounted workspace (each freezes the filesystem over
  # the kernel device), the fork mounted read-only on a second device at once (ext4 mounts
  # a read-only device only if its journal is clean: the freeze made it so): the same files.
  "$S" --tenant acme ws checkpoint box --label over-nbd >/dev/null || fail "checkpoint of the nbd mount"
  "$S" --tenant acme ws fork box box2 >/dev/null || fail "live fork of the nbd mount"
  mkdir -p /tmp/mr/acme/box2
  "$S" --tenant acme ws mount box2 /tmp/mr/acme/box2 --backend nbd --read-only >/dev/null || fail "mounting the fork read-only"
  touch /tmp/mr/acme/box2/x 2>/dev/null && fail "a read-only mount took a write"
  dev2=$("$S" --tenant acme --json ws mounts | grep -o '"/dev/nbd[0-9]*"' | tr -d '"' | grep -v "/dev/$dev$" | head -1)
  [ -n "$dev2" ] || fail "the fork is not on a second device"
  (cd /tmp/mr/acme/box2/a && sha256sum -c --quiet $W/sums-a) || fail "the fork's files differ"
  "$S" --tenant acme ws umount box2 >/dev/null || fail "ws umount box2"
  "$S" --tenant acme ws umount box >/dev/null || fail "ws umount 2"
  step "checkpoint and live fork over nbd, the fork read-only on $dev2: files identical, writes refused"

  before=$(ls -d /sys/block/nbd* | wc -l)
  i=0
  while [ $i -lt "$REUSE" ]; do
    "$S" --tenant acme ws mount box $T --backend nbd >/dev/null || fail "reuse mount $i"
    [ -f $T/a/f1 ] || fail "reuse $i: files missing"
    "$S" --tenant acme ws umount box >/dev/null || fail "reuse umount $i"
    i=$((i + 1))
  done
  after=$(ls -d /sys/block/nbd* | wc -l)
  busy=$(ls /sys/block/nbd*/pid 2>/dev/null | wc -l)
  [ "$before" = "$after" ] || fail "devices grew from $before to $after"
  [ "$busy" = 0 ] || fail "$busy devices left connected"
  step "devices reused $REUSE times, $after devices, none left connected"

  "$S" --tenant acme ws mount box $T --backend nbd >/dev/null || fail "last mount"
  mkdir -p $T/b
  for i in 1 2 3 4; do
    dd if=/dev/urandom of=$T/b/g$i bs=64k count=$((i * 5)) conv=fsync status=none || fail "writing b/g$i"
  done
  sync -f $T/b
  (cd $T/b && sha256sum g*) >$W/sums-b
  sync
  # Writes nobody waits for, in flight when the power goes.
  (while :; do dd if=/dev/urandom of=$T/b/unsynced bs=64k count=16 status=none; done) &
  sleep 2
  step "KILL-ME"
  sleep 600
fi

if [ "$phase" = 2 ]; then
  export STRATA_TOKEN=$(cat /tmp/data/acme-token)
  start
  T=/tmp/mr/acme/box
  for _ in $(seq 1 100); do [ -n "$(nbd_dev)" ] && break; sleep 0.2; done
  dev=$(nbd_dev)
  [ -n "$dev" ] || fail "the restarted daemon did not remount the workspace"
  step "remounted on $dev after the power cut"
  (cd $T/b && sha256sum -c --quiet $W/sums-b) || fail "fsync'd files lost or changed after the power cut"
  (cd $T/a && sha256sum -c --quiet $W/sums-a) || fail "older files lost after the power cut"
  step "every fsync'd file intact"
  "$S" --tenant acme ws umount box >/dev/null || fail "final umount"
  uri=$("$S" --tenant acme ws attach box) || fail "ws attach"
  qemu-img convert -f raw -O raw "$uri" /tmp/data/box.raw || fail "reading the disk over NBD"
  "$S" --tenant acme ws detach box >/dev/null || fail "ws detach"
  e2fsck -fn /tmp/data/box.raw >$W/fsck.out 2>&1 || { cat $W/fsck.out; fail "e2fsck found errors"; }
  step "e2fsck -fn clean on the exported disk"
fi
step "DONE $phase"
