#!/bin/bash
# Wall time of local CLI verbs (no daemon) for two strata binaries, alternating, 30 runs each:
#   bench/cli_local.sh OLD_BIN NEW_BIN
# (Issue 18: every verb now goes through the daemon's router run in process.)
set -euo pipefail
old=$1 new=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
declare -A bin=([old]=$old [new]=$new)
for b in old new; do "${bin[$b]}" --data "$dir/$b" ws create w --size 64MiB >/dev/null; done
for verb in "ws list" "ws show w" "ws log w" "ws checkpoint w"; do
  declare -A t=([old]=0 [new]=0)
  for _ in $(seq 30); do
    for b in old new; do
      s=$(date +%s%N)
      # shellcheck disable=SC2086
      "${bin[$b]}" --data "$dir/$b" $verb >/dev/null
      t[$b]=$((t[$b] + $(date +%s%N) - s))
    done
  done
  awk -v v="$verb" -v o="${t[old]}" -v n="${t[new]}" \
    'BEGIN { printf "%-16s old %6.1f ms  new %6.1f ms  (%.2fx)\n", v, o/30e6, n/30e6, n/o }'
done
