#!/usr/bin/env bash
# What one GC pass costs against the versions a tenant retains (issue 46): a daemon on an S3
# store (moto on loopback behind bench/latency_proxy.py adding BENCH_S3_LATENCY_MS per request,
# default 20), BENCH_WS workspaces (default 10), each written and checkpointed until the tenant
# retains each count of BENCH_GC_VERSIONS (default "20 200 1220" in total); then two GC passes
# after no change at all, then one reconciliation pass (`gc --reconcile`, which lists the store;
# a binary without it shows "-"). Prints, per count, each measured pass's time (its own report)
# and the store requests it made (counted by the proxy), as a Markdown table.
#
#   bench/gc-pass.sh                       # release build of this tree
#   STRATA_BIN=/path/to/strata bench/gc-pass.sh
#   BENCH_GC_VERSIONS="20 100" bench/gc-pass.sh
# Installs nothing: needs moto_server (BENCH_MOTO), qemu-io, curl and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
moto=${BENCH_MOTO:-$(command -v moto_server || echo "$HOME/.cache/strata-ci-venv/bin/moto_server")}
for t in qemu-io curl python3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 2; }
done
[ -x "$moto" ] || { echo "missing moto_server (BENCH_MOTO)" >&2; exit 2; }
strata=$(strata_binary)
n_ws=${BENCH_WS:-10}
counts=${BENCH_GC_VERSIONS:-20 200 1220}
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-gc.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
start_moto "$work" "${BENCH_S3_LATENCY_MS:-20}"
proxy_pid=${pids[-1]}
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench
STRATA_ADMIN_TOKEN=bench-admin "$strata" --data "$work/data" --json serve --listen 127.0.0.1:0 \
  --node-id gc --gc-interval off --gc-grace 1h --keep-checkpoints 100000 --run-dir "$work/run" \
  --store "s3://bench/strata?endpoint=http://127.0.0.1:$pport&region=us-east-1&allow_http=true" \
  > "$work/serve.out" 2> "$work/serve.err" &
pids+=($!)
for _ in $(seq 1 100); do [ -s "$work/serve.out" ] && break; sleep 0.1; done
url="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/serve.out")"
token=$(STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
cli() { STRATA_URL=$url STRATA_TOKEN=$token "$strata" --json "$@"; }
admin() { STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json "$@"; }
requests() {   # the proxy's count so far
  local before; before=$(grep -c '^requests' "$work/proxy.out" || true)
  kill -USR1 "$proxy_pid"
  for _ in $(seq 1 50); do [ "$(grep -c '^requests' "$work/proxy.out" || true)" -gt "$before" ] && break; sleep 0.05; done
  grep '^requests' "$work/proxy.out" | tail -1 | cut -d' ' -f2
}
exports=()
for i in $(seq 1 "$n_ws"); do
  cli ws create "w$i" --size 64MiB >/dev/null
  exports+=("$(cli ws attach "w$i" | python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])')")
done
made=$n_ws   # each workspace's version 1
has_reconcile=0; "$strata" gc --help | grep -q -- --reconcile && has_reconcile=1
echo "| retained versions | workspaces | GC pass after no change | store requests | manifests read | reconciliation pass | its store requests |"
echo "|---|---|---|---|---|---|---|"
for want in $counts; do
  while [ "$made" -lt "$want" ]; do
    i=$(( made % n_ws + 1 ))
    qemu-io -f raw -c "write -P $(( made % 250 + 1 )) $(( (made * 4096) % (60 << 20) )) 4k" -c flush \
      "${exports[$((i - 1))]}" > /dev/null
    cli ws checkpoint "w$i" > /dev/null
    made=$((made + 1))
  done
  admin gc > /dev/null   # whatever the checkpoints left to settle
  r0=$(requests)
  admin gc > "$work/gc.json"
  r1=$(requests)
  rec_ms=-; rec_req=-
  if [ $has_reconcile = 1 ]; then
    admin gc --reconcile > "$work/rec.json"
    r2=$(requests)
    rec_ms="$(python3 -c 'import json,sys; print("{:,} ms".format(json.load(open(sys.argv[1]))["duration_ms"]))' "$work/rec.json")"
    rec_req=$((r2 - r1))
  fi
  python3 - "$work/gc.json" "$want" "$n_ws" "$((r1 - r0))" "$rec_ms" "$rec_req" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {sys.argv[3]} | {r['duration_ms']:,} ms | {sys.argv[4]} | {r.get('manifests_read', '-')} | {sys.argv[5]} | {sys.argv[6]} |")
PY
done
