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
  # TLS offered beside plain connections, for the catalog's sslmode tests: a throwaway CA and
  # a server certificate that names localhost only (so verify-full to 127.0.0.1 must fail).
  tls="$dir/tls"; mkdir -p "$tls"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj /CN=strata-test-ca -keyout "$tls/ca.key" -out "$tls/ca.pem" >/dev/null 2>&1
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$tls/server.key" -out "$tls/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=DNS:localhost\n' >"$tls/ext"
  openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial \
    -days 30 -extfile "$tls/ext" -out "$tls/server.pem" >/dev/null 2>&1
  chmod 600 "$tls/server.key"
  [ "$(id -u)" -eq 0 ] && chown -R postgres: "$tls" && chmod 755 "$tls" && chmod 644 "$tls/ca.pem"
  as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=on -c max_connections=200 -c ssl=on -c ssl_cert_file=$tls/server.pem -c ssl_key_file=$tls/server.key" start >/dev/null
  echo "export STRATA_TEST_PG=postgres://postgres@127.0.0.1:$port/postgres"
  echo "export STRATA_TEST_PG_CA=$tls/ca.pem"
  ;;
stop)
  as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
  ;;
esac
