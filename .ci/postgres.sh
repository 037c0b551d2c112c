#!/usr/bin/env bash
# Starts a throwaway PostgreSQL server (Debian's `postgresql` package) on loopback for the tests
# and prints its admin URL. Usage: eval "$(.ci/postgres.sh start DIR)"; .ci/postgres.sh stop DIR
set -euo pipefail
cmd=${1:?start|stop}; dir=${2:?data directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$bin/initdb" ] || { echo "postgresql is not installed (apt-get install postgresql)" >&2; exit 1; }
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case "$cmd" in
start)
  mkdir -p "$dir"
  [ "$(id -u)" -eq 0 ] && chown postgres: "$dir"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  as_pg "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1
  as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=on -c max_connections=200" start >/dev/null
  echo "export STRATA_TEST_PG=postgres://postgres@127.0.0.1:$port/postgres"
  ;;
stop)
  as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
  ;;
esac
