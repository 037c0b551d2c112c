# Helpers the bench scripts share (sourced; they run from the repository's root).

# The strata binary to measure: $STRATA_BIN, or a release build of this tree.
strata_binary() {
  if [ -n "${STRATA_BIN:-}" ]; then echo "$STRATA_BIN"
  else cargo build --release -q -p strata && echo target/release/strata; fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_moto DIR DELAY_MS: moto_server ($moto) on loopback with a bucket "bench", and
# bench/latency_proxy.py in front of it adding DELAY_MS per request; logs in DIR. Sets $mport
# (moto itself) and $pport (the proxy); appends both processes to $pids.
start_moto() {
  local dir=$1 delay=$2
  mport=$(free_port)
  "$moto" -H 127.0.0.1 -p "$mport" > "$dir/moto.log" 2>&1 & pids+=($!)
  for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$mport" && break; sleep 0.2; done
  curl -sf -X PUT "http://127.0.0.1:$mport/bench" -o /dev/null
  python3 bench/latency_proxy.py 0 "127.0.0.1:$mport" "$delay" > "$dir/proxy.out" 2> "$dir/proxy.err" & pids+=($!)
  for _ in $(seq 1 50); do grep -q ready "$dir/proxy.out" 2>/dev/null && break; sleep 0.1; done
  pport=$(awk '/ready/ {print $2}' "$dir/proxy.out")
}
