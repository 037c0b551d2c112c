#!/usr/bin/env bash
# Local disk use of the embedded default (issue 17): bytes on the host's disk per byte the guest
# holds live, split into journal (spare segments apart), local object directory, node cache and
# catalog; after a fill, after overwrites, and after GC passes (with compaction) have run.
#
#   bench/space.sh                  # 1 GiB live (release build; ~3 min)
#   BENCH_SMOKE=1 bench/space.sh    # 64 MiB, seconds (CI)
#   BENCH_LIVE_MB=4096 bench/space.sh
#
# One daemon (`strata serve`, file: store, SQLite catalog: the embedded default) with a short GC
# grace (BENCH_GC_GRACE seconds, default 30; a publish slower than half of it starts again) so a
# pass can delete what an earlier one found unreferenced within the run; compaction at the
# default threshold (0.5); retention as the daemon's defaults unless STRATA_KEEP_AUTO or
# STRATA_KEEP_CHECKPOINTS say otherwise (background publishes are automatic versions: none is
# kept besides the head unless STRATA_KEEP_AUTO asks). The guest is fio's nbd engine:
# sequential 1 MiB writes over the live span, then random overwrites of that span (4 KiB, then
# 64 KiB, each BENCH_OVERWRITES times the span, default 1), each phase ending with a flush.
# Installs nothing. Prints a Markdown table; JSON to ${BENCH_OUT:-docs/bench/space-results.json}.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=${BENCH_SMOKE:-0}
live_mb=${BENCH_LIVE_MB:-1024}; over=${BENCH_OVERWRITES:-1}; grace=${BENCH_GC_GRACE:-30}
if [ "$smoke" = 1 ]; then live_mb=64; grace=${BENCH_GC_GRACE:-2}; fi
out_json=${BENCH_OUT:-docs/bench/space-results.json}
for t in fio curl python3; do
  command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 2; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 2; }
. bench/lib.sh
strata=$(strata_binary)

work=$(mktemp -d "${TMPDIR:-/tmp}/strata-space.XXXXXX")
pid=
cleanup() { [ -z "$pid" ] || kill "$pid" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

data="$work/data"
STRATA_ADMIN_TOKEN=bench-admin "$strata" --data "$data" --json serve --listen 127.0.0.1:0 \
  --node-id space --gc-grace "${grace}s" --gc-interval off > "$work/serve.out" 2> "$work/serve.err" &
pid=$!
for _ in $(seq 1 100); do [ -s "$work/serve.out" ] && break; sleep 0.1; done
url="http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$work/serve.out")"
token=$(STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json tenant create bench |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
cli() { STRATA_URL=$url STRATA_TOKEN=$token "$strata" --json "$@"; }
admin() { STRATA_URL=$url STRATA_TOKEN=bench-admin "$strata" --json "$@"; }

cli ws create w --size "$((live_mb * 2))MiB" --mode durable >/dev/null
uri=$(cli ws attach w | python3 -c 'import json,sys; print(json.load(sys.stdin)["export"])')

# Waits until the workspace's remote window is empty (everything acknowledged is published).
drained() {
  for _ in $(seq 1 600); do
    w=$(cli ws show w | python3 -c 'import json,sys; print((json.load(sys.stdin).get("stats") or {}).get("window_bytes", -1))')
    [ "$w" = 0 ] && return 0
    sleep 0.5
  done
  echo "the remote window never drained" >&2; return 1
}
gc_pass() { admin gc > "$work/gc.$1.json"; cat "$work/gc.$1.json" >> "$work/gc.all"; echo >> "$work/gc.all"; }

echo "[" > "$work/rows.json"; first=1
measure() {  # PHASE
  local j="$data/volumes/bench/w/journal"
  spare=$(find "$j" -name '*.free' -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}')
  journal=$(du -sb "$j" | cut -f1)
  objects=$(du -sb "$data/objects" | cut -f1)
  cache=$(du -sb "$data/cache" 2>/dev/null | cut -f1 || echo 0)
  catalog=$(cat "$data"/catalog.db* | wc -c)
  [ $first = 1 ] || echo "," >> "$work/rows.json"; first=0
  touch "$work/gc.all"
  python3 - "$1" "$((live_mb << 20))" "$journal" "$spare" "$objects" "${cache:-0}" "$catalog" "$work/gc.all" >> "$work/rows.json" <<'PY'
import json, sys
phase = sys.argv[1]
live, journal, spare, objects, cache, catalog = map(int, sys.argv[2:8])
total = journal + objects + cache + catalog
# The GC passes since the last row: what they compacted, expired and deleted.
dec, text, gc, i = json.JSONDecoder(), open(sys.argv[8]).read(), [], 0
while text[i:].strip():
    i += len(text[i:]) - len(text[i:].lstrip())
    g, i = dec.raw_decode(text, i)
    gc.append(g)
keys = ("compactions", "compacted_bytes", "checkpoints_expired", "checkpoints_purged", "deleted_bytes")
print(json.dumps({"phase": phase, "live_bytes": live, "journal_bytes": journal,
    "spare_bytes": spare, "object_bytes": objects, "cache_bytes": cache,
    "catalog_bytes": catalog, "total_bytes": total,
    "ratio_without_spares": (total - spare) / live,
    "gc": {k: sum(g.get(k, 0) for g in gc) for k in keys},
    "versions_live": gc[-1]["live_manifests"] if gc else None}))
PY
  : > "$work/gc.all"
}
fio_run() {  # NAME fio-args...
  local name=$1; shift
  fio --name="$name" --ioengine=nbd --uri="$uri" --size="${live_mb}M" --end_fsync=1 \
    --output-format=json "$@" > "$work/fio.json" 2> "$work/fio.err" ||
    { echo "fio failed ($name):" >&2; cat "$work/fio.err" >&2; exit 1; }
}

fio_run fill --rw=write --bs=1m --iodepth=4
drained; measure "after a 1 MiB sequential fill"
# Five GC passes a grace apart: an expired version is purged by one pass, what it held stays
# referenced for a grace period after that (a fork or rollback may have just read it), is
# condemned by a later pass and deleted by one a grace later still.
settle() {
  for i in 1 2 3 4 5; do
    [ "$i" = 1 ] || sleep $((grace + 1))
    gc_pass "$1.$i"
  done
}
settle fill; measure "fill, after GC"
for bs in 4k 64k; do
  fio_run "over-$bs" --rw=randwrite --bs="$bs" --iodepth=32 --io_size="$((live_mb * over))M" --norandommap
  drained; measure "after ${over}x random $bs overwrites"
  settle "$bs"; measure "$bs overwrites, after GC"
done
echo "]" >> "$work/rows.json"
mkdir -p "$(dirname "$out_json")"
cp "$work/rows.json" "$out_json"
python3 - "$out_json" "$live_mb" "${STRATA_KEEP_CHECKPOINTS:-16}" "${STRATA_KEEP_AUTO:-0}" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
mib = lambda b: f"{b / 2**20:,.0f}"
print(f"live span: {sys.argv[2]} MiB; retention: keep {sys.argv[3]} unlabelled versions users made, {sys.argv[4]} automatic ones")
print("| phase | journal (spares) MiB | objects MiB | cache MiB | catalog MiB | total MiB | (total − spares) ÷ live | GC since: compacted MiB, versions expired, MiB deleted; live manifests |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    g = r["gc"]
    gcs = (f"{mib(g['compacted_bytes'])}, {g['checkpoints_expired']}, {mib(g['deleted_bytes'])}; {r['versions_live']}"
           if r["versions_live"] is not None else "")
    print(f"| {r['phase']} | {mib(r['journal_bytes'])} ({mib(r['spare_bytes'])}) | {mib(r['object_bytes'])} | "
          f"{mib(r['cache_bytes'])} | {r['catalog_bytes'] / 2**20:.1f} | {mib(r['total_bytes'])} | "
          f"**{r['ratio_without_spares']:.2f}x** | {gcs} |")
PY
