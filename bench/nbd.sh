#!/usr/bin/env bash
# NBD data-path benchmark: strata vs qemu-nbd (qcow2 overlay on a raw base) vs nbdkit file+cow
# vs nbdkit memory (the protocol ceiling), all driven by the same client (fio's nbd engine over
# a unix socket) on the same base image, alternating servers, several repetitions.
#
#   bench/nbd.sh                 # full run (release build; ~15 min)
#   BENCH_SMOKE=1 bench/nbd.sh   # seconds-long check that the suite works (CI)
#   BENCH_ONLY='write' bench/nbd.sh   # only scenarios whose name matches the regex
#
# Installs nothing: it checks for its tools and says what is missing. Writes a Markdown table to
# stdout and machine-readable results to ${BENCH_OUT:-docs/bench/nbd-results.json}.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=${BENCH_SMOKE:-0}
size_mb=${BENCH_SIZE_MB:-1024}; runtime=${BENCH_RUNTIME:-10}; reps=${BENCH_REPS:-3}
if [ "$smoke" = 1 ]; then size_mb=64; runtime=1; reps=1; fi
out_json=${BENCH_OUT:-docs/bench/nbd-results.json}

for t in fio qemu-img qemu-nbd nbdkit python3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t (apt-get install fio qemu-utils nbdkit python3)" >&2; exit 2; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 2; }
if [ -n "${STRATA_BIN:-}" ]; then strata=$STRATA_BIN
else cargo build --release -q -p strata; strata=target/release/strata; fi

work=$(mktemp -d "${TMPDIR:-/tmp}/strata-bench.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "preparing a ${size_mb} MiB base image" >&2
head -c $((size_mb << 20)) /dev/urandom > "$work/base.raw"
export STRATA_DATA="$work/strata-data"
"$strata" template build base --from-image "$work/base.raw" >/dev/null

# start_server NAME -> sets $uri; each run gets a fresh overlay / fresh fork.
n=0
start_server() {
  n=$((n + 1)); local sock="$work/$1.$n.sock"
  case "$1" in
    strata)
      "$strata" ws create "w$n" --template base --mode durable >/dev/null
      "$strata" ws attach "w$n" --socket "$sock" > "$work/attach.$n" &
      pids+=($!); uri="nbd+unix:///w$n?socket=$sock" ;;
    qemu-nbd)
      qemu-img create -q -f qcow2 -b "$work/base.raw" -F raw "$work/ov.$n.qcow2"
      qemu-nbd -t -f qcow2 -k "$sock" -x x --cache=writeback --shared=8 "$work/ov.$n.qcow2" &
      pids+=($!); uri="nbd+unix:///x?socket=$sock" ;;
    nbdkit-cow)
      nbdkit -f -U "$sock" --filter=cow file "$work/base.raw" &
      pids+=($!); uri="nbd+unix:///?socket=$sock" ;;
    nbdkit-memory)
      nbdkit -f -U "$sock" memory "${size_mb}M" &
      pids+=($!); uri="nbd+unix:///?socket=$sock" ;;
  esac
  for _ in $(seq 1 100); do [ -S "$sock" ] && break; sleep 0.1; done
}
stop_server() { kill "${pids[-1]}" 2>/dev/null || true; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'; }

# name rw bs iodepth extra...
scenarios=(
  "rand-read-4k-qd1 randread 4k 1"
  "rand-read-4k-qd32 randread 4k 32"
  "rand-write-4k-qd1 randwrite 4k 1"
  "rand-write-4k-qd32 randwrite 4k 32"
  "seq-read-1m read 1m 4"
  "seq-write-1m write 1m 4"
  "write-flush-4k randwrite 4k 1 --fsync=1"
)
servers=(strata qemu-nbd nbdkit-cow nbdkit-memory)
echo "[" > "$work/results.json"; first=1
for rep in $(seq 1 "$reps"); do
  for sc in "${scenarios[@]}"; do
    set -- $sc; name=$1; rw=$2; bs=$3; qd=$4; shift 4
    [[ "$name" =~ ${BENCH_ONLY:-.} ]] || continue
    for srv in "${servers[@]}"; do
      start_server "$srv"
      # The write scenarios land on a fresh overlay/fork: first writes pay copy-on-write.
      fio --name="$name" --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$qd" \
          --size="$((size_mb / 2))M" --runtime="$runtime" --time_based --output-format=json "$@" \
          > "$work/fio.json" 2>"$work/fio.err" || { echo "fio failed on $srv/$name:" >&2; cat "$work/fio.err" >&2; exit 1; }
      stop_server
      [ $first = 1 ] || echo "," >> "$work/results.json"; first=0
      python3 - "$work/fio.json" "$srv" "$name" "$rep" >> "$work/results.json" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index("{"):])["jobs"][0]  # fio's nbd engine prints a line first
op = "read" if j["read"]["io_bytes"] > 0 else "write"
s = j[op]
lat = s.get("clat_ns", {}).get("percentile", {})
print(json.dumps({"server": sys.argv[2], "scenario": sys.argv[3], "rep": int(sys.argv[4]),
    "iops": s["iops"], "bw_bytes": s["bw_bytes"],
    "p50_us": lat.get("50.000000", 0) / 1000, "p99_us": lat.get("99.000000", 0) / 1000}))
PY
    done
  done
done
echo "]" >> "$work/results.json"
mkdir -p "$(dirname "$out_json")"
cp "$work/results.json" "$out_json"
python3 - "$out_json" <<'PY'
import json, sys, statistics as st
rows = json.load(open(sys.argv[1]))
servers = ["strata", "qemu-nbd", "nbdkit-cow", "nbdkit-memory"]
scen = []
for r in rows:
    if r["scenario"] not in scen: scen.append(r["scenario"])
def med(s, sc, k):
    v = [r[k] for r in rows if r["server"] == s and r["scenario"] == sc]
    return st.median(v) if v else 0
print("| scenario | " + " | ".join(f"{s} IOPS (p50/p99 µs)" for s in servers) + " | strata ÷ qemu-nbd | strata ÷ nbdkit-cow |")
print("|---|" + "---|" * (len(servers) + 2))
for sc in scen:
    cells = [f"{med(s, sc, 'iops'):,.0f} ({med(s, sc, 'p50_us'):.0f}/{med(s, sc, 'p99_us'):.0f})" for s in servers]
    q = med("qemu-nbd", sc, "iops"); c = med("nbdkit-cow", sc, "iops"); m = med("strata", sc, "iops")
    print(f"| {sc} | " + " | ".join(cells) + f" | {m / q if q else 0:.2f}x | {m / c if c else 0:.2f}x |")
PY
