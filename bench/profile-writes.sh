#!/usr/bin/env bash
# CPU profile of strata under 4 KiB random writes at QD32 (issue 17, seventh stop): a durable
# fork of a 1 GiB random template served by `strata ws attach`, fio's nbd engine against it,
# `perf record -F 999 -g` of the strata process meanwhile. Prints fio's IOPS and the top of
# `perf report` by thread and symbol; leaves perf.data in $BENCH_PERF_DATA (default
# /tmp/strata-perf.data).
#   bench/profile-writes.sh                      # release build of this tree
#   STRATA_BIN=/path/to/strata bench/profile-writes.sh
# Installs nothing: needs perf, fio (with the nbd engine) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
for t in perf fio python3; do
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
perf record -q -F 999 -g -p "$pid" -o "$data" -- sleep 12 &
perf_pid=$!
fio --ioengine=nbd --uri="nbd+unix:///w1?socket=$work/s.sock" --name=w --rw=randwrite --bs=4k \
  --iodepth=32 --size=512M --runtime=10 --time_based --output-format=json > "$work/fio.json"
wait "$perf_pid"
python3 - "$work/fio.json" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
print("rand-write-4k-qd32 IOPS:", round(json.loads(t[t.index("{"):])["jobs"][0]["write"]["iops"]))
PY
perf report -i "$data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -E "Samples|%" | head -25
