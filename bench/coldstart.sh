#!/usr/bin/env bash
# Cold start from object storage (issue 7, scenario 3) and daemon memory per attached workspace
# (scenario 6), against a real S3-protocol server (moto) on loopback behind a proxy that adds a
# fixed latency to every request (20 ms by default, like S3 in-region).
#
# Node A builds an ext4 template from a source tree (crate sources from the cargo registry) into
# the bucket. Node B, with an empty data directory and cache and the same catalog, then creates
# a workspace from it, attaches it, reads a first block, and runs a realistic workload: ext4 is
# mounted read-only through nbdfuse + a loop device, then `find` and `grep -r` run over the tree.
# It counts B's object GETs and bytes fetched against the bytes the workload read from the disk
# (the loop device's counters), cold and then warm (same node, page cache dropped); a fresh node
# per repetition (BENCH_REPS, 3), medians reported; each repetition also runs a node with
# read-ahead off (--readahead-units 0) for comparison.
#
#   bench/coldstart.sh                 # full
#   BENCH_SMOKE=1 bench/coldstart.sh   # seconds-long check that it works (CI)
#
# Installs nothing; needs root for the loop device and the mount (without root the workload part
# is skipped and said so). Results: ${BENCH_OUT:-docs/bench/coldstart-results.json}.
set -euo pipefail
shopt -s inherit_errexit   # a failure inside $(…) stops the run too
cd "$(dirname "$0")/.."

smoke=${BENCH_SMOKE:-0}
delay_ms=${BENCH_S3_LATENCY_MS:-20}; tree_mb=${BENCH_TREE_MB:-160}; n_ws=${BENCH_WS:-32}
reps=${BENCH_REPS:-3}
if [ "$smoke" = 1 ]; then tree_mb=8; n_ws=4; reps=1; fi
out_json=${BENCH_OUT:-docs/bench/coldstart-results.json}
moto=${BENCH_MOTO:-$(command -v moto_server || echo "$HOME/.cache/strata-ci-venv/bin/moto_server")}

for t in curl python3 qemu-io nbdfuse losetup mount mkfs.ext4 fusermount3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t (apt-get install curl python3 qemu-utils nbdfuse fuse3 e2fsprogs mount)" >&2; exit 2; }
done
[ -x "$moto" ] || { echo "missing moto_server (python3 -m venv V && V/bin/pip install 'moto[s3]' flask flask-cors; then BENCH_MOTO=V/bin/moto_server)" >&2; exit 2; }
. bench/lib.sh
strata=$(realpath "$(strata_binary)")
root=0; [ "$(id -u)" = 0 ] && root=1

work=$(mktemp -d "${TMPDIR:-/tmp}/strata-coldstart.XXXXXX")
pids=(); loop=""
cleanup() {
  umount "$work/mnt" 2>/dev/null || true
  [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null || true
  fusermount3 -u "$work/fuse" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
now_ms() { date +%s%3N; }
# metric URL NAME: one sample of the daemon's /metrics (which wants the admin or scrape token).
# A missing sample stops the run: read as 0, it made every GET count 0 once /metrics needed a token.
metric() {
  local v
  v=$(curl -sf -H "Authorization: Bearer $STRATA_ADMIN_TOKEN" "$1/metrics" | awk -v m="$2" '$1 == m {print $2}')
  [ -n "$v" ] || { echo "no sample $2 at $1/metrics" >&2; exit 1; }
  echo "$v"
}
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

# The object store: moto, and the latency proxy in front of it.
start_moto "$work" "$delay_ms"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench STRATA_ADMIN_TOKEN=bench-admin
store() { echo "s3://bench/strata?endpoint=http://127.0.0.1:$1&region=us-east-1&allow_http=true"; }

# serve NODE STORE-PORT: starts a daemon; sets $url and $pid.
serve() {
  local node=$1 port=$2; shift 2
  "$strata" --data "$work/$node" --json serve --listen 127.0.0.1:0 --node-id "$node" \
    --catalog "sqlite:$work/catalog.db" --store "$(store "$port")" "$@" > "$work/$node.out" 2> "$work/$node.err" &
  pid=$!; pids+=($pid)
  for _ in $(seq 1 100); do [ -s "$work/$node.out" ] && break; sleep 0.1; done
  url="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/$node.out")"
}
cli() { STRATA_URL=$url STRATA_TOKEN=$tenant_token "$strata" --json "$@"; }

# A source tree: whole crate directories from the cargo registry, in name order, up to tree_mb.
mkdir -p "$work/tree"
reg=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/ 2>/dev/null | head -1 || true)
if [ -n "$reg" ]; then
  total=0
  for d in "$reg"*/; do
    [ $total -ge $((tree_mb << 20)) ] && break
    b=$(du -sb "$d" | cut -f1); [ "$b" -gt $((tree_mb << 18)) ] && continue  # none over 1/4
    cp -r "$d" "$work/tree/"; total=$((total + b))
  done
else
  cp -r crates docs "$work/tree/"
fi
tree_bytes=$(du -sb "$work/tree" | cut -f1); tree_files=$(find "$work/tree" -type f | wc -l)
echo "source tree: $tree_files files, $((tree_bytes >> 20)) MiB" >&2

# Node A builds the template straight into moto (no latency: this is not what is measured).
serve a "$mport"; a_pid=$pid
tenant_token=$(STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
disk_mb=$(( (tree_bytes >> 20) * 2 + 64 ))
cli template build src --from-dir "$work/tree" --size "${disk_mb}MiB" > "$work/template.json"
kill "$a_pid"; wait "$a_pid" 2>/dev/null || true

# Node B (one fresh node per repetition): cold, every request to the store delayed.
cold_start() {  # REP: prints "create_ms attach_ms first_read_ms first_read_gets"
  t0=$(now_ms); cli ws create "w$1" --template src > /dev/null; t1=$(now_ms)
  cli ws attach "w$1" > "$work/attach.json"; t2=$(now_ms)
  export_uri=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["export"])' "$work/attach.json")
  g0=$(metric "$b_url" strata_object_gets_total)
  t3=$(now_ms); qemu-io -f raw -r -c 'read 0 4k' "$export_uri" > /dev/null; t4=$(now_ms)
  g1=$(metric "$b_url" strata_object_gets_total)
  qemu-io -f raw -r -c 'read 0 4k' "$export_uri" > /dev/null; t5=$(now_ms)
  # The first read minus qemu-io's own start-up (the warm repeat).
  echo "$((t1 - t0)) $((t2 - t1)) $(( (t4 - t3) - (t5 - t4) )) $((g1 - g0))"
}

workload() {  # PASS: mount ro, find + grep -r, unmount; prints "ms read_bytes gets fetched"
  sync; echo 3 > /proc/sys/vm/drop_caches
  mkdir -p "$work/fuse" "$work/mnt"
  nbdfuse -P "$work/nbdfuse.pid" "$work/fuse/disk" "$export_uri" &
  for _ in $(seq 1 100); do [ -s "$work/nbdfuse.pid" ] && break; sleep 0.1; done
  loop=$(losetup -r -f --show "$work/fuse/disk")
  mount -o ro,noload "$loop" "$work/mnt"
  local dev; dev=$(basename "$loop")
  local r0 g0 f0 t0 t1 r1 g1 f1
  r0=$(awk '{print $3}' "/sys/block/$dev/stat"); g0=$(metric "$b_url" strata_object_gets_total)
  f0=$(metric "$b_url" strata_object_fetched_bytes_total); t0=$(now_ms)
  find "$work/mnt" -type f | wc -l > "$work/found"
  grep -r -l -F 'unsafe' "$work/mnt" | wc -l > "$work/grepped" || true
  t1=$(now_ms); r1=$(awk '{print $3}' "/sys/block/$dev/stat")
  g1=$(metric "$b_url" strata_object_gets_total); f1=$(metric "$b_url" strata_object_fetched_bytes_total)
  umount "$work/mnt"; losetup -d "$loop"; loop=""; fusermount3 -u "$work/fuse"
  rm -f "$work/nbdfuse.pid"
  echo "$((t1 - t0)) $(( (r1 - r0) * 512 )) $((g1 - g0)) $((f1 - f0))"
}
echo "[" > "$work/runs.json"
first=1
for rep in $(seq 1 "$reps"); do
 # Read-ahead on (the default, 8 units) and off, alternating, each on a fresh node.
 for ra in 8 0; do
  serve "b$rep-ra$ra" "$pport" --readahead-units "$ra"; b_pid=$pid; b_url=$url
  cold_start "$rep-ra$ra" > "$work/start.txt"   # not in a subshell: it sets export_uri
  read -r create_ms attach_ms first_ms first_gets < "$work/start.txt"
  echo "create $create_ms ms, attach $attach_ms ms, first 4 KiB read ~$first_ms ms ($first_gets GETs)" >&2
  cold="" warm=""
  if [ $root = 1 ]; then
    cold=$(workload); warm=$(workload)
    echo "workload cold: $cold; warm: $warm (ms, bytes read, GETs, bytes fetched)" >&2
  else
    echo "not root: the mount workload is skipped" >&2
  fi
  kill "$b_pid"; wait "$b_pid" 2>/dev/null || true
  [ $first = 1 ] || echo "," >> "$work/runs.json"; first=0
  python3 - "$create_ms" "$attach_ms" "$first_ms" "$first_gets" "$cold" "$warm" "$ra" >> "$work/runs.json" <<'PY'
import json, sys
def w(s):
    if not s: return None
    ms, read, gets, fetched = map(int, s.split())
    return {"ms": ms, "bytes_read": read, "gets": gets, "bytes_fetched": fetched,
            "fetched_over_read": fetched / read if read else None, "four_kib_misses": read // 4096}
c, a, f, g = map(int, sys.argv[1:5])
print(json.dumps({"readahead_units": int(sys.argv[7]), "create_ms": c, "attach_ms": a,
                  "first_read_ms": f, "first_read_gets": g,
                  "cold": w(sys.argv[5]), "warm": w(sys.argv[6])}))
PY
 done
done
echo "]" >> "$work/runs.json"

# Scenario 6: daemon memory per attached workspace (each written 1 MiB and read 1 MiB), on a
# fresh node.
serve m "$pport"; b_pid=$pid
sleep 1; rss0=$(rss_kib "$b_pid")
for i in $(seq 1 "$n_ws"); do
  cli ws create "m$i" --template src > /dev/null
  u=$(cli ws attach "m$i" | python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])')
  qemu-io -f raw -c 'write -P 7 1M 1M' -c 'read 0 1M' -c flush "$u" > /dev/null
done
sleep 1; rss1=$(rss_kib "$b_pid")
echo "daemon RSS: $rss0 KiB idle, $rss1 KiB with $n_ws attached" >&2
kill "$b_pid"; wait "$b_pid" 2>/dev/null || true
for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=()
proxy_requests=$(awk '/requests/ {print $2}' "$work/proxy.err")

mkdir -p "$(dirname "$out_json")"
python3 - "$out_json" "$work/runs.json" "$work/template.json" <<PY
import json, statistics as st, sys
all_runs = json.load(open(sys.argv[2]))
runs = [r for r in all_runs if r["readahead_units"] > 0]
off = [r for r in all_runs if r["readahead_units"] == 0]
def med(get, runs=runs):
    v = [get(r) for r in runs]
    v = [x for x in v if x is not None]
    return st.median(v) if v else None
def med_w(k, runs=runs):
    if not runs or runs[0][k] is None: return None
    return {f: med(lambda r: r[k][f], runs) for f in runs[0][k]}
json.dump({"latency_ms": $delay_ms, "tree_files": $tree_files, "tree_bytes": $tree_bytes,
    "template": json.load(open(sys.argv[3])), "reps": len(runs), "runs": all_runs,
    "readahead_units": runs[0]["readahead_units"], "cold_no_readahead": med_w("cold", off),
    "create_ms": med(lambda r: r["create_ms"]), "attach_ms": med(lambda r: r["attach_ms"]),
    "first_read_ms": med(lambda r: r["first_read_ms"]),
    "first_read_gets": med(lambda r: r["first_read_gets"]),
    "cold": med_w("cold"), "warm": med_w("warm"), "proxy_requests": int("${proxy_requests:-0}"),
    "daemon_rss_idle_kib": $rss0, "daemon_rss_attached_kib": $rss1, "attached": $n_ws,
    "rss_per_workspace_kib": ($rss1 - $rss0) / $n_ws}, open(sys.argv[1], "w"), indent=1)
PY
echo "results: $out_json" >&2
