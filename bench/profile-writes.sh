#!/usr/bin/env bash
# CPU profile of strata under 4 KiB random writes at QD32 (issue 17, seventh stop): a durable
# fork of a 1 GiB random template served by `strata ws attach`, fio's nbd engine against it,
# `perf record -F 999 -g` of the strata process meanwhile. Prints fio's IOPS, the CPU time the
# strata process used during fio's run (user + system, from /proc/PID/stat) per write, and the
# top of `perf report` by thread and symbol; leaves perf.data in $BENCH_PERF_DATA (default
# /tmp/strata-perf.data).
#   bench/profile-writes.sh                      # release build of this tree
#   STRATA_BIN=/path/to/strata bench/profile-writes.sh
#   BENCH_PERF=0 bench/profile-writes.sh         # IOPS and CPU per write only, no profiler
#   BENCH_PERF_GRAPH='--call-graph dwarf,16384' bench/profile-writes.sh   # whole Rust stacks
# Installs nothing: needs perf (unless BENCH_PERF=0), fio (with the nbd engine) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
use_perf=${BENCH_PERF:-1}
tools="fio python3"; [ "$use_perf" = 1 ] && tools="perf $tools"
for t in $tools; do
  command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 2; }
done
strata=$(strata_binary)
data=${BENCH_PERF_DATA:-/tmp/strata-perf.data}
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-prof.XXXXXX")
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
head -c $((1024 << 20)) /dev/urandom > "$work/base.raw"
export STRATA_DATA="$work/data"
"$strata" template build base --from-image "$work/base.raw" >/dev/null
"$strata" ws create w1 --template base --mode durable >/dev/null
"$strata" ws attach w1 --socket "$work/s.sock" > "$work/attach.out" &
pid=$!
for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
perf_pid=
if [ "$use_perf" = 1 ]; then
  perf record -q -F ${BENCH_PERF_FREQ:-999} ${BENCH_PERF_GRAPH:--g} -p "$pid" -o "$data" -- sleep 12 &
  perf_pid=$!
fi
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }   # utime + stime, clock ticks
cpu0=$(cpu)
fio --ioengine=nbd --uri="nbd+unix:///w1?socket=$work/s.sock" --name=w --rw=randwrite --bs=4k \
  --iodepth=32 --size=512M --runtime=10 --time_based --output-format=json > "$work/fio.json"
cpu1=$(cpu)
[ -n "$perf_pid" ] && wait "$perf_pid"
python3 - "$work/fio.json" "$cpu0" "$cpu1" "$(getconf CLK_TCK)" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
w = json.loads(t[t.index("{"):])["jobs"][0]["write"]
cpu_s = (float(sys.argv[3]) - float(sys.argv[2])) / float(sys.argv[4])
print("rand-write-4k-qd32 IOPS:", round(w["iops"]))
print(f"strata CPU during the run: {cpu_s:.2f} s, {cpu_s / w['total_ios'] * 1e6:.2f} us per write")
PY
[ "$use_perf" = 1 ] || exit 0
perf report -i "$data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -E "Samples|%" | head -25
