#!/usr/bin/env bash
# The peer benchmark suite (issue 7): one command runs every scenario against strata and its
# peers on the same files in the same run, and writes one result file plus SVG plots.
#
#   bench/run.sh                     # full run: about 30 min on 2 cores; writes docs/bench/
#   BENCH_SMOKE=1 bench/run.sh       # minutes: checks every scenario still runs (CI); writes to
#                                    # a temporary directory unless BENCH_DIR is set
#   BENCH_SCENARIOS="engine coldstart" bench/run.sh   # a subset (default: all); the other
#                                    # parts of an existing results.json are kept
#
# Scenarios and where they live:
#   nbd        1. protocol and data path (fio over NBD vs qemu-nbd+qcow2, nbdkit cow, nbdkit
#                 memory, raw file) and 2. first writes into a fresh fork with write
#                 amplification: bench/nbd.sh
#   coldstart  3. cold start from S3 with injected latency (moto on loopback) and 6. daemon RSS
#                 per attached workspace: bench/coldstart.sh
#              (with strata-s3: strata on moto behind the latency proxy)
#   space      local disk use of the embedded default per live byte: bench/space.sh
#   gc         one GC pass after no change against the versions retained, and a
#              reconciliation pass (moto + latency): bench/gc-pass.sh (a Markdown table); the
#              same at 100 to 100,000 versions on a simulated store and the fleet simulation
#              (PostgreSQL when STRATA_TEST_PG is set): crates/strata-engine/benches/{gcpass,fleet}.rs
#   engine     4. fork/checkpoint/restore scaling, 5. shared cache across 8 forks and
#                 6. memory per extent: crates/strata-engine/benches/scale.rs; 7. checkpoints
#                 of a live workspace against dirty data: crates/strata-engine/benches/live.rs
#
# Installs nothing: it checks its tools first and lists what is missing. Knobs of the parts:
# BENCH_REPS, BENCH_RUNTIME, BENCH_SIZE_MB (nbd), BENCH_S3_LATENCY_MS, BENCH_TREE_MB, BENCH_WS,
# BENCH_MOTO (coldstart), STRATA_BIN (a prebuilt strata binary).
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=${BENCH_SMOKE:-0}
scenarios=${BENCH_SCENARIOS:-engine nbd coldstart space gc}
if [ "$smoke" = 1 ]; then out=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/strata-bench-smoke.XXXXXX")}
else out=${BENCH_DIR:-docs/bench}; fi
moto=${BENCH_MOTO:-$(command -v moto_server || echo "$HOME/.cache/strata-ci-venv/bin/moto_server")}

missing=()
for t in cargo fio qemu-img qemu-nbd qemu-io nbdkit nbdfuse fusermount3 losetup mount mkfs.ext4 curl python3; do
  command -v "$t" >/dev/null || missing+=("$t")
done
[[ " $scenarios " == *" coldstart "* || " $scenarios " == *" nbd "* || " $scenarios " == *" gc "* ]] && [ ! -x "$moto" ] && missing+=("moto_server (BENCH_MOTO)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing: ${missing[*]}" >&2
  echo "Debian: apt-get install fio qemu-utils nbdkit nbdfuse fuse3 e2fsprogs curl python3;" >&2
  echo "moto: python3 -m venv V && V/bin/pip install 'moto[s3]' flask flask-cors; BENCH_MOTO=V/bin/moto_server" >&2
  exit 2
fi
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 2; }
if [ -z "${STRATA_BIN:-}" ]; then
  cargo build --release -q -p strata; STRATA_BIN=target/release/strata
fi
export STRATA_BIN BENCH_SMOKE=$smoke BENCH_MOTO=$moto
tmp=$(mktemp -d "${TMPDIR:-/tmp}/strata-run.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)

for s in $scenarios; do
  echo "== $s" >&2
  case $s in
    engine)
      if [ "$smoke" = 1 ]; then
        BENCH_JSON="$tmp/engine.json" cargo test -q -p strata-engine --bench scale
        BENCH_JSON="$tmp/live.json" cargo test -q -p strata-engine --bench live
      else
        BENCH_JSON="$tmp/engine.json" cargo bench -q -p strata-engine --bench scale
        BENCH_JSON="$tmp/live.json" cargo bench -q -p strata-engine --bench live
      fi ;;
    nbd) BENCH_SERVERS=${BENCH_SERVERS:-strata strata-s3 qemu-nbd nbdkit-cow nbdkit-memory raw} \
           BENCH_OUT="$tmp/nbd.json" bench/nbd.sh | tee "$tmp/nbd.md" ;;
    space) BENCH_OUT="$tmp/space.json" bench/space.sh | tee "$tmp/space.md" ;;
    gc) if [ "$smoke" = 1 ]; then BENCH_WS=2 BENCH_GC_VERSIONS="4 8" bench/gc-pass.sh | tee "$tmp/gc.md"
          cargo test -q -p strata-engine --bench gcpass; cargo test -q -p strata-engine --bench fleet
        else bench/gc-pass.sh | tee "$tmp/gc.md"
          BENCH_JSON="$out/gcpass.json" cargo bench -q -p strata-engine --bench gcpass | tee "$tmp/gcpass.md"
          BENCH_JSON="$out/fleet.json" cargo bench -q -p strata-engine --bench fleet | tee "$tmp/fleet.md"
          cp "$tmp/gcpass.md" "$out/gcpass.md"; cp "$tmp/fleet.md" "$out/fleet.md"; fi
        cp "$tmp/gc.md" "$out/gc-pass.md" ;;
    coldstart) BENCH_OUT="$tmp/coldstart.json" bench/coldstart.sh ;;
    *) echo "unknown scenario $s (engine, nbd, coldstart, space, gc)" >&2; exit 2 ;;
  esac
done

python3 - "$tmp" "$out/results.json" "$started" "$smoke" <<'PY'
import json, os, platform, subprocess, sys
tmp, dest, started, smoke = sys.argv[1:5]
def load(n):
    p = os.path.join(tmp, n)
    return json.load(open(p)) if os.path.exists(p) else None
def ver(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
    except Exception:
        return None
mem = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
# A subset run (BENCH_SCENARIOS) keeps the other parts of an earlier result file.
try:
    res = json.load(open(dest))
except Exception:
    res = {}
parts = {k: load(f"{k}.json") for k in ("nbd", "coldstart", "engine", "space")}
if parts["engine"] is not None and load("live.json") is not None:
    parts["engine"].update(load("live.json"))
res.update({k: v for k, v in parts.items() if v is not None})
res.update({"started": started, "smoke": smoke == "1",
       "command": ("BENCH_SMOKE=1 " if smoke == "1" else "") + "bench/run.sh",
       "machine": {"cpus": os.cpu_count(), "mem_gib": round(mem / 2**20, 1),
                   "kernel": platform.release(), "fio": ver(["fio", "--version"]),
                   "qemu-nbd": ver(["qemu-nbd", "--version"]), "nbdkit": ver(["nbdkit", "--version"])}})
res.setdefault("runs", {}).update({k: started for k, v in parts.items() if v is not None})
json.dump(res, open(dest, "w"), indent=1)
print(dest)
PY
python3 bench/plot.py "$out/results.json" "$out" >&2
echo "results and plots: $out" >&2
