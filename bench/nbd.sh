#!/usr/bin/env bash
# NBD data-path benchmark (issue 7, scenarios 1 and 2): strata vs qemu-nbd (qcow2 overlay on a
# raw base) vs nbdkit file+cow vs nbdkit memory (the protocol ceiling), all driven by the same
# client (fio's nbd engine over a unix socket) on the same base image, and fio on a copy of the
# raw file itself (the physical limit, no NBD); servers alternate, several repetitions.
# Scenario 2 (first writes into a fresh fork) also counts the bytes each server's process wrote
# to the host's storage (/proc/PID/io write_bytes) per byte the guest wrote.
#
#   bench/nbd.sh                 # full run (release build; ~15 min)
#   BENCH_SMOKE=1 bench/nbd.sh   # seconds-long check that the suite works (CI)
#   BENCH_ONLY='write' bench/nbd.sh   # only scenarios whose name matches the regex
#   BENCH_SERVERS='strata strata-s3 qemu-nbd raw' bench/nbd.sh   # which servers (default: all
#                                but strata-s3)
#
# Put-mode variants of strata on the embedded default, to compare in one run (servers
# alternate): strata-buffered (STRATA_DIRECT_PUTS=0: objects written through the page cache)
# and strata-noreadback (STRATA_PUT_READBACK=0: O_DIRECT puts, nothing read back). Every row
# says which store and put mode its server ran ("store", "puts").
# strata-base is strata run from another binary, BENCH_STRATA_BASE (an earlier build): the
# before of a code change, alternating with the after in one run.
#
# strata-s3 is strata with an S3 store: moto on loopback behind bench/latency_proxy.py
# (BENCH_S3_LATENCY_MS per request, default 20), the template built into moto first. It needs
# moto_server (BENCH_MOTO; .ci/run makes ~/.cache/strata-ci-venv).
#
# Installs nothing: it checks for its tools and says what is missing. Writes a Markdown table to
# stdout and machine-readable results to ${BENCH_OUT:-docs/bench/nbd-results.json}
# (a list of runs; the write-amplification runs have scenario "fork-first-writes").
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
. bench/lib.sh
strata=$(strata_binary)

work=$(mktemp -d "${TMPDIR:-/tmp}/strata-bench.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "preparing a ${size_mb} MiB base image" >&2
head -c $((size_mb << 20)) /dev/urandom > "$work/base.raw"
export STRATA_DATA="$work/strata-template"
"$strata" template build base --from-image "$work/base.raw" >/dev/null
# Each strata run gets its own data directory: the template's immutable objects hard-linked
# (no bytes written), the catalog copied. Its published versions are deleted with it, so a
# long run's disk use stays bounded (nothing here runs GC).
strata_data() {
  rm -rf "$work/strata-run"; cp -al "$work/strata-template" "$work/strata-run"
  for f in "$work/strata-template"/catalog.db*; do cp --remove-destination "$f" "$work/strata-run/"; done
  sync; export STRATA_DATA="$work/strata-run"
}

servers=(${BENCH_SERVERS:-strata qemu-nbd nbdkit-cow nbdkit-memory raw})
if [[ " ${servers[*]} " == *" strata-base "* ]] && [ ! -x "${BENCH_STRATA_BASE:-}" ]; then
  echo "strata-base needs BENCH_STRATA_BASE=/path/to/an/earlier/strata" >&2; exit 2
fi
# strata-s3: moto behind the latency proxy, and the same template built into it (no latency).
if [[ " ${servers[*]} " == *" strata-s3 "* ]]; then
  moto=${BENCH_MOTO:-$(command -v moto_server || echo "$HOME/.cache/strata-ci-venv/bin/moto_server")}
  [ -x "$moto" ] || { echo "missing moto_server for strata-s3 (python3 -m venv V && V/bin/pip install 'moto[s3]' flask flask-cors; then BENCH_MOTO=V/bin/moto_server)" >&2; exit 2; }
  start_moto "$work" "${BENCH_S3_LATENCY_MS:-20}"
  export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench
  s3_store() { echo "s3://bench/strata?endpoint=http://127.0.0.1:$1&region=us-east-1&allow_http=true"; }
  # One daemon for every strata-s3 run (the local verbs use the embedded default store);
  # each run gets a fresh workspace through its API.
  s3_data="$work/strata-s3"; mkdir -p "$s3_data"
  STRATA_ADMIN_TOKEN=bench-admin "$strata" --data "$s3_data" --json serve --listen 127.0.0.1:0 \
    --node-id s3 --store "$(s3_store "$pport")" > "$work/s3-serve.out" 2> "$work/s3-serve.err" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/s3-serve.out" ] && break; sleep 0.1; done
  s3_url="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/s3-serve.out")"
  s3_token=$(STRATA_URL=$s3_url STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
  s3cli() { STRATA_URL=$s3_url STRATA_TOKEN=$s3_token "$strata" --json "$@"; }
  s3cli template build base --from-image "$work/base.raw" >/dev/null
fi

# start_server NAME -> sets $uri; each run gets a fresh overlay / fresh fork.
n=0
start_server() {
  n=$((n + 1)); local sock="$work/$1.$n.sock"
  case "$1" in
    strata|strata-buffered|strata-noreadback|strata-base)
      strata_data
      "$strata" ws create "w$n" --template base --mode durable >/dev/null
      local bin=$strata; [ "$1" = strata-base ] && bin=$BENCH_STRATA_BASE
      env $(put_env "$1") "$bin" ws attach "w$n" --socket "$sock" > "$work/attach.$n" &
      pids+=($!); uri="nbd+unix:///w$n?socket=$sock" ;;
    strata-s3)  # a fresh workspace on the S3 daemon (its node cache holds the template)
      s3cli ws create "w$n" --template base --mode durable >/dev/null
      uri=$(s3cli ws attach "w$n" | python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])')
      return ;;
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
    raw)  # no server: fio on the file (reads: the base; writes: a fresh copy of it)
      if [ "$2" = write ]; then cp "$work/base.raw" "$work/raw.$n"; sync; raw="$work/raw.$n"
      else raw="$work/base.raw"; fi
      return ;;
  esac
  for _ in $(seq 1 100); do [ -S "$sock" ] && break; sleep 0.1; done
}
# The environment a strata variant runs with, and the store and put mode a server's rows report.
put_env() {
  case "$1" in
    strata-buffered) echo STRATA_DIRECT_PUTS=0 ;;
    strata-noreadback) echo STRATA_PUT_READBACK=0 ;;
    *) echo BENCH_VARIANT=default ;;
  esac
}
put_mode() {
  case "$1" in
    strata-buffered) echo buffered ;;
    strata-noreadback) echo direct ;;
    strata|strata-s3|strata-base)
      if [ "${STRATA_DIRECT_PUTS:-1}" = 0 ]; then echo buffered
      elif [ "${STRATA_PUT_READBACK:-1}" = 0 ]; then echo direct
      else echo direct+readback; fi ;;
    *) echo - ;;
  esac
}
store_of() {
  case "$1" in
    strata|strata-buffered|strata-noreadback|strata-base) echo local ;;
    strata-s3) echo s3 ;;
    raw) echo file ;;
    *) echo - ;;
  esac
}
write_bytes() { awk '/^write_bytes/ {print $2}' "/proc/$1/io"; }
stop_server() {
  if [ "$1" = raw ]; then rm -f "$work/raw.$n"; return; fi
  # Detach publishes what is left of the window; the deleted workspace's objects stay in moto.
  if [ "$1" = strata-s3 ]; then s3cli ws detach "w$n" >/dev/null; s3cli ws delete "w$n" >/dev/null; return; fi
  kill "${pids[-1]}" 2>/dev/null || true; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'
  case "$1" in strata|strata-buffered|strata-noreadback|strata-base) rm -rf "$work/strata-run" ;; esac
  # Each qemu-nbd run's overlay holds what it wrote (up to the span): a full run's 27 would
  # fill the disk.
  if [ "$1" = qemu-nbd ]; then rm -f "$work/ov.$n.qcow2"; fi
}
# run_fio SERVER fio-args...: the same job through NBD, or on the raw file for the raw peer.
run_fio() {
  local srv=$1; shift
  if [ "$srv" = raw ]; then
    local qd; qd=$(printf '%s\n' "$@" | sed -n 's/^--iodepth=//p')
    local eng=psync; [ "${qd:-1}" -gt 1 ] && eng=io_uring
    fio --ioengine=$eng --filename="$raw" "$@"
  else
    fio --ioengine=nbd --uri="$uri" "$@"
  fi
}

# name rw bs iodepth extra...
scenarios=(
  "rand-read-4k-qd1 randread 4k 1"
  "rand-read-4k-qd32 randread 4k 32"
  "rand-write-4k-qd1 randwrite 4k 1"
  "rand-write-4k-qd32 randwrite 4k 32"
  "seq-read-1m read 1m 4"
  "seq-write-1m write 1m 4"
  "write-flush-4k randwrite 4k 1 --fsync=1"
  "rand-read-written-4k-qd32 randread 4k 32"
  "seq-read-published-1m read 1m 4"
  "rand-read-published-4k-qd1 randread 4k 1"
  "rand-read-published-4k-qd32 randread 4k 32"
  "mixed-published-4k-qd32 randrw 4k 32 --rwmixread=70"
  "rand-read-rewritten-4k-qd32 randread 4k 32"
)
echo "[" > "$work/results.json"; first=1
for rep in $(seq 1 "$reps"); do
  for sc in "${scenarios[@]}"; do
    set -- $sc; name=$1; rw=$2; bs=$3; qd=$4; shift 4
    [[ "$name" =~ ${BENCH_ONLY:-.} ]] || continue
    # "-written-": reads of blocks the guest wrote just before (48 MiB, within strata's
    # upload window: its journal and the layers not yet published serve them, not the base).
    # "-published-": one pass over half the disk right after the guest wrote it, past the
    # window (strata's uploads have published most of it into objects by then): whether
    # reading what was just published comes from the page cache or the disk. The last window
    # may still be in the journal; in smoke mode all of it is (the span fits in the window).
    # The random "-published-" rows (reads, and 70/30 reads and writes) run for the runtime
    # over that half, starting right after the fill: a sandbox reading back what it installed.
    # "-rewritten-": a sandbox's session as a user tried it (issue 45): 1 MiB writes over 7/8
    # of the disk, random 4 KiB writes at QD32 over it for the runtime, then the row's reads.
    # BENCH_REWRITE_PASS=1: the random writes are one pass over the span instead (each block
    # once), so that servers that write faster do not do more work before the reads.
    span="$((size_mb / 2))M"; fill=0; rewrite=0; timing=(--runtime="$runtime" --time_based)
    rewrite_timing=("${timing[@]}"); [ "${BENCH_REWRITE_PASS:-0}" = 1 ] && rewrite_timing=()
    case "$name" in
      *-written-*) span=48M; fill=1 ;;
      seq-*-published-*) fill=1; timing=() ;;
      *-published-*) fill=1 ;;
      *-rewritten-*) span="$((size_mb * 7 / 8))M"; fill=1; rewrite=1 ;;
    esac
    for srv in "${servers[@]}"; do
      start_server "$srv" "$([ $fill = 1 ] && echo write || echo "$rw")"
      if [ $fill = 1 ]; then
        run_fio "$srv" --name=fill --rw=write --bs=1m --iodepth=4 --size="$span" \
            --output-format=json > "$work/fill.json" 2>"$work/fio.err" \
          || { echo "fio fill failed on $srv/$name:" >&2; cat "$work/fio.err" >&2; exit 1; }
      fi
      if [ $rewrite = 1 ]; then
        run_fio "$srv" --name=rewrite --rw=randwrite --bs=4k --iodepth=32 --size="$span" \
            ${rewrite_timing[@]+"${rewrite_timing[@]}"} --output-format=json > "$work/fill.json" 2>"$work/fio.err" \
          || { echo "fio rewrite failed on $srv/$name:" >&2; cat "$work/fio.err" >&2; exit 1; }
        # BENCH_REWRITE_SETTLE=S: S seconds between the writes and the reads (uploads catch up).
        sleep "${BENCH_REWRITE_SETTLE:-0}"
      fi
      # The write scenarios land on a fresh overlay/fork: first writes pay copy-on-write.
      run_fio "$srv" --name="$name" --rw="$rw" --bs="$bs" --iodepth="$qd" \
          --size="$span" ${timing[@]+"${timing[@]}"} --output-format=json "$@" \
          > "$work/fio.json" 2>"$work/fio.err" || { echo "fio failed on $srv/$name:" >&2; cat "$work/fio.err" >&2; exit 1; }
      stop_server "$srv"
      [ $first = 1 ] || echo "," >> "$work/results.json"; first=0
      python3 - "$work/fio.json" "$srv" "$name" "$rep" "$(store_of "$srv")" "$(put_mode "$srv")" >> "$work/results.json" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index("{"):])["jobs"][0]  # fio's nbd engine prints a line first
# A mixed row counts reads and writes together; its latencies are the reads'.
op = "read" if j["read"]["io_bytes"] > 0 else "write"
s = j[op]
iops, bw = s["iops"], s["bw_bytes"]
if op == "read" and j["write"]["io_bytes"] > 0:
    iops += j["write"]["iops"]; bw += j["write"]["bw_bytes"]
lat = s.get("clat_ns", {}).get("percentile", {})
print(json.dumps({"server": sys.argv[2], "scenario": sys.argv[3], "rep": int(sys.argv[4]),
    "store": sys.argv[5], "puts": sys.argv[6], "iops": iops, "bw_bytes": bw,
    "p50_us": lat.get("50.000000", 0) / 1000, "p99_us": lat.get("99.000000", 0) / 1000}))
PY
    done
  done
  # Scenario 2: first writes into a fresh fork, write amplification. Random 4 KiB writes, each
  # block once (fio's random map), spread over the whole disk, then one flush; the bytes the
  # server process sent to storage over the bytes written. strata's figure is split into its
  # journal (this host's disk) and the objects its background uploads wrote (the local object
  # directory here; a remote object store in a fleet).
  [[ "fork-first-writes" =~ ${BENCH_ONLY:-.} ]] || continue
  for srv in strata qemu-nbd nbdkit-cow; do
    start_server "$srv" write
    pid=${pids[-1]}; sleep 0.2   # the server process (strata ws attach, qemu-nbd, nbdkit)
    objects() { if [ "$srv" = strata ]; then du -sb "$STRATA_DATA/objects" | cut -f1; else echo 0; fi; }
    wb0=$(write_bytes "$pid"); ob0=$(objects)
    guest=$((size_mb / 16))
    fio --name=fork-first-writes --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=1 \
        --size="${size_mb}M" --io_size="${guest}M" --end_fsync=1 --output-format=json \
        > "$work/fio.json" 2>"$work/fio.err" || { echo "fio failed on $srv/fork-first-writes:" >&2; cat "$work/fio.err" >&2; exit 1; }
    wb1=$(write_bytes "$pid"); ob1=$(objects)
    stop_server "$srv"
    [ "$srv" = strata ] || { ob0=0; ob1=0; }
    [ $first = 1 ] || echo "," >> "$work/results.json"; first=0
    python3 - "$work/fio.json" "$srv" "$rep" "$((guest << 20))" "$((wb1 - wb0))" "$((ob1 - ob0))" >> "$work/results.json" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
s = json.loads(t[t.index("{"):])["jobs"][0]["write"]
guest, host, objects = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
lat = s.get("clat_ns", {}).get("percentile", {})
print(json.dumps({"server": sys.argv[2], "scenario": "fork-first-writes", "rep": int(sys.argv[3]),
    "iops": s["iops"], "bw_bytes": s["bw_bytes"],
    "p50_us": lat.get("50.000000", 0) / 1000, "p99_us": lat.get("99.000000", 0) / 1000,
    "guest_bytes": guest, "host_bytes": host, "object_bytes": objects,
    "write_amplification": host / guest, "local_write_amplification": (host - objects) / guest}))
PY
  done
done
echo "]" >> "$work/results.json"
mkdir -p "$(dirname "$out_json")"
cp "$work/results.json" "$out_json"
python3 - "$out_json" <<'PY'
import json, sys, statistics as st
rows = json.load(open(sys.argv[1]))
# The write-amplification rows have their own table (and may name servers the others lack).
wa = [r for r in rows if r["scenario"] == "fork-first-writes"]
rows = [r for r in rows if r["scenario"] != "fork-first-writes"]
servers = [s for s in ["strata", "strata-base", "strata-buffered", "strata-noreadback", "strata-s3", "qemu-nbd",
                       "nbdkit-cow", "nbdkit-memory", "raw"]
           if any(r["server"] == s for r in rows)]
def mode(s):
    r = next((r for r in rows if r["server"] == s), {})
    return f" [{r.get('store', '?')}, puts {r.get('puts', '?')}]" if s.startswith("strata") else ""

scen = []
for r in rows:
    if r["scenario"] not in scen: scen.append(r["scenario"])
def med(s, sc, k):
    v = [r[k] for r in rows if r["server"] == s and r["scenario"] == sc]
    return st.median(v) if v else 0
ratios = [(a, b) for a in ("strata", "strata-base", "strata-buffered", "strata-noreadback", "strata-s3")
          for b in ("qemu-nbd", "nbdkit-cow", "raw") if a in servers and b in servers]
ratios += [("strata", "strata-base")] if "strata" in servers and "strata-base" in servers else []
print("| scenario | " + " | ".join(f"{s}{mode(s)} IOPS (p50/p99 µs)" for s in servers)
      + "".join(f" | {a} ÷ {b}" for a, b in ratios) + " |")
print("|---|" + "---|" * (len(servers) + len(ratios)))
for sc in scen:
    cells = [f"{med(s, sc, 'iops'):,.0f} ({med(s, sc, 'p50_us'):.0f}/{med(s, sc, 'p99_us'):.0f})" for s in servers]
    rs = [(med(a, sc, "iops"), med(b, sc, "iops")) for a, b in ratios]
    print(f"| {sc} | " + " | ".join(cells) + "".join(f" | {x / y if y else 0:.2f}x" for x, y in rs) + " |")
if wa:
    print()
    print("| first writes into a fresh fork | IOPS | host bytes / guest bytes | of which local (not objects) |")
    print("|---|---|---|---|")
    for s in ["strata", "qemu-nbd", "nbdkit-cow"]:
        v = [r for r in wa if r["server"] == s]
        if v:
            print(f"| {s} | {st.median(r['iops'] for r in v):,.0f} | {st.median(r['write_amplification'] for r in v):.2f} | {st.median(r['local_write_amplification'] for r in v):.2f} |")
PY
