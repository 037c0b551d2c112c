#!/usr/bin/env bash
# Live forks through the daemon's API (issue 43), as a user makes them: a running workspace
# (16 GiB) with DIRTY MiB of unpublished 4 KiB random writes and a writer still writing
# (fio, 500 IOPS), then BENCH_FORKS (8) forks one after another, each timed by curl
# (`time_total`, the whole HTTP call). Then every fork is written on its own (16 MiB at its own
# offset, fio with crc32c verify headers), checkpointed (`--wait`: published), detached, and
# restored on a second daemon sharing the catalog and the store, where fio reads it back and
# verifies every block. The first daemon is started with uploads held back (1 h, no byte
# bound) so that the dirty data is unpublished when the forks are taken.
#
#   BENCH_DIRTY_MIB="0 1024" bench/live-forks-api.sh     (default; BENCH_SMOKE=1: "0 16", 2 forks)
#   STRATA_BIN=/path/to/strata   an earlier build to compare (default: a release build here)
#   BENCH_OUT=FILE               JSON results (default docs/bench/live-forks-api.json)
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=${BENCH_SMOKE:-0}
dirty_list=${BENCH_DIRTY_MIB:-0 1024}
forks=${BENCH_FORKS:-8}
if [ "$smoke" = 1 ]; then dirty_list="0 16"; forks=2; fi
out_json=${BENCH_OUT:-docs/bench/live-forks-api.json}
for t in fio curl python3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 2; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 2; }
. bench/lib.sh
strata=$(strata_binary)

work=$(mktemp -d "${TMPDIR:-/tmp}/strata-liveforks.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# start_daemon NAME [FLAGS...]: a daemon on the shared catalog and store; sets url_NAME.
start_daemon() {
  local name=$1; shift
  mkdir -p "$work/$name"
  STRATA_ADMIN_TOKEN=bench-admin "$strata" --data "$work/$name" --json serve --listen 127.0.0.1:0 \
    --node-id "$name" --catalog "sqlite:$work/catalog.db" --store "file:$work/objects" "$@" \
    > "$work/$name.out" 2> "$work/$name.err" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/$name.out" ] && break; sleep 0.1; done
  local u
  u="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/$name.out")"
  printf -v "url_$name" '%s' "$u"
}
start_daemon a --upload-interval 1h --upload-max-bytes 1TiB
start_daemon b
token=$(STRATA_URL=$url_a STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
on() { local u=$1; shift; STRATA_URL=$u STRATA_TOKEN=$token "$strata" --json "$@"; }
export_of() { python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])'; }

results="$work/results.jsonl"
for dirty in $dirty_list; do
  src="src$dirty"
  on "$url_a" ws create "$src" --size 16GiB --mode durable >/dev/null
  uri=$(on "$url_a" ws attach "$src" | export_of)
  if [ "$dirty" -gt 0 ]; then
    echo "writing $dirty MiB of 4 KiB random writes into $src" >&2
    fio --name=dirty --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=32 \
      --size=16g --io_size="${dirty}m" --randrepeat=0 --end_fsync=1 --output-format=terse \
      > /dev/null 2> "$work/fio.err" || { cat "$work/fio.err" >&2; exit 1; }
  fi
  # A writer still writing while the forks are taken.
  fio --name=busy --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=1 --size=16g \
    --rate_iops=500 --time_based --runtime=3600 --output-format=terse > /dev/null 2>&1 &
  busy=$!; pids+=($busy); sleep 1
  times=()
  for i in $(seq 1 "$forks"); do
    t=$(curl -s -o "$work/fork.out" -w '%{http_code} %{time_total}' -X POST \
      -H "Authorization: Bearer $token" -H 'content-type: application/json' \
      -d "{\"name\":\"$src-f$i\"}" "$url_a/v1/workspaces/$src/fork")
    [ "${t%% *}" = 200 ] || [ "${t%% *}" = 201 ] || { echo "fork $i: $t $(cat "$work/fork.out")" >&2; exit 1; }
    times+=("${t##* }")
  done
  kill "$busy" 2>/dev/null || true
  # Each fork written on its own, checkpointed, detached, restored on b and verified.
  verified=0
  for i in $(seq 1 "$forks"); do
    f="$src-f$i"
    job=(--name="$f" --ioengine=nbd --rw=write --bs=64k --offset=$((i * 64))m --size=16m
         --verify=crc32c --randseed="$i")
    furi=$(on "$url_a" ws attach "$f" | export_of)
    fio "${job[@]}" --uri="$furi" --do_verify=0 --end_fsync=1 --output-format=terse > /dev/null 2> "$work/fio.err" ||
      { cat "$work/fio.err" >&2; exit 1; }
    on "$url_a" ws checkpoint "$f" --wait > /dev/null
    on "$url_a" ws detach "$f" > /dev/null
    buri=$(on "$url_b" ws attach "$f" | export_of)
    fio "${job[@]}" --uri="$buri" --verify_only --verify_fatal=1 --output-format=terse > /dev/null 2> "$work/fio.err" ||
      { echo "fork $f did not verify on the second daemon" >&2; cat "$work/fio.err" >&2; exit 1; }
    on "$url_b" ws detach "$f" > /dev/null
    verified=$((verified + 1))
  done
  on "$url_a" ws detach "$src" > /dev/null
  python3 - "$dirty" "$verified" "${times[@]}" >> "$results" <<'EOF'
import json, sys
dirty, verified, t = int(sys.argv[1]), int(sys.argv[2]), [float(x) * 1000 for x in sys.argv[3:]]
s = sorted(t)
print(json.dumps({"dirty_mib": dirty, "forks": len(t), "fork_ms": [round(x, 2) for x in t],
                  "p50_ms": round(s[len(s) // 2], 2), "max_ms": round(s[-1], 2),
                  "restored_and_verified": verified}))
EOF
  tail -1 "$results" >&2
done
python3 - "$results" "$out_json" "$("$strata" --version 2>/dev/null || echo strata)" "$(fio --version)" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump({"live_forks_api": rows, "strata": sys.argv[3], "fio": sys.argv[4]}, open(sys.argv[2], "w"), indent=1)
base = rows[0]["p50_ms"]
for r in rows:
    print(f"{r['dirty_mib']:>6} MiB dirty: {r['forks']} forks, p50 {r['p50_ms']} ms, max {r['max_ms']} ms "
          f"({r['p50_ms'] / base:.2f}x the first row), {r['restored_and_verified']} restored on a second daemon and verified")
print(f"results: {sys.argv[2]}")
EOF
