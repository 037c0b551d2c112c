#!/usr/bin/env bash
# 4 KiB random writes at QD1 through `strata serve` (embedded default: the local object
# directory) against `strata ws attach` on its own data directory, alternating, three pairs:
# whether a QD1 gap between the peer suite's `strata` and `strata-s3` servers follows the
# process or the store (issue 17, eighth stop). Prints IOPS and fio's p50 completion latency.
#   bench/qd1-stores.sh                        # release build of this tree
#   STRATA_BIN=/path/to/strata bench/qd1-stores.sh
# Installs nothing: needs fio (with the nbd engine) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
for t in fio python3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 2; }
done
strata=$(strata_binary)
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-qd1.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
head -c $((1024 << 20)) /dev/urandom > "$work/base.raw"
fiorun() {
  fio --ioengine=nbd --uri="$1" --name=w --rw=randwrite --bs=4k --iodepth=1 --size=1G \
    --runtime=10 --time_based --output-format=json 2>/dev/null | python3 -c '
import json, sys
t = sys.stdin.read(); w = json.loads(t[t.index("{"):])["jobs"][0]["write"]
p50 = w["clat_ns"]["percentile"]["50.000000"] / 1000
print("%s IOPS, p50 %.1f us" % (format(round(w["iops"]), ","), p50))'
}
STRATA_ADMIN_TOKEN=bench-admin "$strata" --data "$work/daemon" --json serve --listen 127.0.0.1:0 \
  --node-id n > "$work/serve.out" 2> "$work/serve.err" &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/serve.out" ] && break; sleep 0.1; done
url="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/serve.out")"
token=$(STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
cli() { STRATA_URL=$url STRATA_TOKEN=$token "$strata" --json "$@"; }
cli template build base --from-image "$work/base.raw" > /dev/null
for i in 1 2 3; do
  cli ws create "d$i" --template base --mode durable > /dev/null
  uri=$(cli ws attach "d$i" | python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])')
  echo "strata serve, local store, run $i: $(fiorun "$uri")"
  cli ws detach "d$i" > /dev/null; cli ws delete "d$i" > /dev/null
  export STRATA_DATA="$work/attach$i"
  "$strata" template build base --from-image "$work/base.raw" > /dev/null
  "$strata" ws create w --template base --mode durable > /dev/null
  "$strata" ws attach w --socket "$work/a$i.sock" > /dev/null 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$work/a$i.sock" ] && break; sleep 0.1; done
  echo "strata ws attach, run $i: $(fiorun "nbd+unix:///w?socket=$work/a$i.sock")"
  kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'
  unset STRATA_DATA; rm -rf "$work/attach$i"
done
