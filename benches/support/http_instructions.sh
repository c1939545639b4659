#!/bin/bash
# Instructions per L1 hit over HTTP, counted by callgrind in each server's
# process (user space only: the kernel's share is not counted), for the
# targets of `cargo bench --bench http`. Unlike req/s on this shared
# machine, the counts do not move between runs, so they rank the servers'
# CPU cost per hit without noise.
#
# Each target runs twice under callgrind, answering N1 and then N2 hits of
# /p/7 on one keep-alive connection (after one request that fills its
# cache); the difference of the two totals over N2 - N1 leaves out start-up
# and shut-down.
#
# CACHE_SIM=1 adds callgrind's cache and branch simulation (a model: 32 KiB
# L1s) and prints, per hit, the instructions and the instruction-cache
# and data-cache read misses too.
#
# usage: benches/support/http_instructions.sh [N1 N2] [TARGET...]
#   targets: limit bare layer proxy axum-response-cache hitbox
#            tower-http-cache http-cache-tower-server (default: all)
# Needs valgrind (apt-get install valgrind), and first:
#   cargo bench --bench http --no-run
#   cargo build --release -p tiercache-proxy
#   CARGO_TARGET_DIR=target/bench-peers cargo build --release --locked \
#     --manifest-path benches/peers/Cargo.toml
# BENCH_TARGET_DIR=target/other reads the HTTP bench's binary from another
# target directory (another build of it, e.g. another profile).
# Ports 18191-18192.
set -euo pipefail
N1=${1:-1000}; N2=${2:-4000}; shift $(( $# >= 2 ? 2 : $# ))
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(limit bare layer proxy axum-response-cache hitbox tower-http-cache http-cache-tower-server)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HTTP_BIN=$(ls -t "$ROOT"/${BENCH_TARGET_DIR:-target}/release/deps/http-* | grep -v '\.d$' | head -1)
PEER_BIN=$ROOT/target/bench-peers/release/bench-peer
PROXY_BIN=$ROOT/target/release/tiercache-proxy
ORIGIN_PORT=18191; PORT=18192
DIR=$(mktemp -d)
ORIGIN=
trap '[ -n "$ORIGIN" ] && kill $ORIGIN 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT

# N keep-alive GETs of /p/7, each checked for a 200 and the whole body.
client() {
  python3 - "$1" "$2" <<'PY'
import http.client, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
for _ in range(600):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/p/7"); r = conn.getresponse(); r.read()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit(f"nothing listens on {port}")
for _ in range(n):
    conn.request("GET", "/p/7")
    r = conn.getresponse()
    body = r.read()
    assert r.status == 200 and len(body) == 2048, (r.status, len(body))
PY
}

# The callgrind total of TARGET answering N hits.
total() {
  local target=$1 n=$2 out=$DIR/$1.$2.out
  local cmd mode=$target
  [ "$target" = bare ] && mode=origin
  # The environment is set here, not with `env` under valgrind: valgrind
  # would count `env` and let the server it execs run uncounted.
  export TIERCACHE_BENCH_SERVE=$mode PORT TOKIO_WORKER_THREADS=1
  # Set, so the proxy does not start itself again with it (valgrind does
  # not follow an exec: the proxy would run uncounted).
  export MIMALLOC_PURGE_DELAY=0
  case $target in
    limit|bare|layer) cmd=("$HTTP_BIN") ;;
    proxy) cmd=("$PROXY_BIN" --upstream "http://127.0.0.1:$ORIGIN_PORT" --listen "127.0.0.1:$PORT") ;;
    *) cmd=("$PEER_BIN" "$target" "$PORT") ;;
  esac
  if (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null; then
    echo "port $PORT is taken: stop what listens there" >&2; exit 1
  fi
  local sim=()
  [ -n "${CACHE_SIM:-}" ] && sim=(--cache-sim=yes --branch-sim=yes)
  valgrind --tool=callgrind "${sim[@]}" --separate-threads=yes --callgrind-out-file="$out" "${cmd[@]}" >/dev/null 2>&1 &
  local pid=$!
  client $PORT "$n"
  # SIGTERM: a background job of a script ignores SIGINT.
  kill -TERM $pid; wait $pid 2>/dev/null || true
  # One file per thread (without that, a process ended by a signal was
  # found to dump its main thread's counts only); their sums: Ir, and with
  # the simulation I1mr and D1mr (the events' 1st, 4th and 5th fields).
  cat "$out"-* | awk '/^totals:/ {ir += $2; i1 += $5; d1 += $6}
    END {printf "%.0f %.0f %.0f\n", ir, i1, d1}'
}

if printf '%s\n' "${TARGETS[@]}" | grep -qx proxy; then
  TIERCACHE_BENCH_SERVE=origin PORT=$ORIGIN_PORT "$HTTP_BIN" >/dev/null 2>&1 & ORIGIN=$!
fi
echo "instructions per hit over HTTP (callgrind, server process, $N1 vs $N2 hits of /p/7)"
for t in "${TARGETS[@]}"; do
  read -r a ai ad < <(total "$t" "$N1"); read -r b bi bd < <(total "$t" "$N2")
  per() { echo $(( ($2 - $1) / (N2 - N1) )); }
  if [ -n "${CACHE_SIM:-}" ]; then
    echo "$t $(per "$a" "$b") I1mr $(per "$ai" "$bi") D1mr $(per "$ad" "$bd")"
  else
    echo "$t $(per "$a" "$b")"
  fi
done
