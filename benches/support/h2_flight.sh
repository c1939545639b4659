#!/bin/bash
# Many HTTP/2 streams waiting at once through a release tiercache-proxy:
# prints h2load's tally, the proxy's RSS at start and at its peak (VmHWM),
# and its in-flight metrics.
#
# usage: benches/support/h2_flight.sh CONNECTIONS STREAMS [proxy flags...]
#   e.g. benches/support/h2_flight.sh 600 128
#        benches/support/h2_flight.sh 600 128 --max-requests-in-flight 1000
# CONNECTIONS × STREAMS GETs of one key (waiting on one load) to an origin
# that answers after SLOW seconds (default 6; SLOW=0: all but the first are
# L1 hits). PROXY_BIN=path runs another build. Needs python3 and `h2load`
# (`apt-get install nghttp2-client`). Ports 18191-18193.
set -euo pipefail
C=$1; M=$2; shift 2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${PROXY_BIN:-$ROOT/target/release/tiercache-proxy}
DIR=$(mktemp -d)
trap 'kill $PROXY $ORIGIN 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
python3 "$ROOT/benches/support/slow_origin.py" & ORIGIN=$!
"$BIN" --upstream http://127.0.0.1:18191 --listen 127.0.0.1:18192 --admin 127.0.0.1:18193 \
  --l1-capacity 32MiB --ttl 10m "$@" > "$DIR/proxy.log" 2>&1 & PROXY=$!
sleep 1
kib() { awk "/^$1/ {print \$2}" "/proc/$PROXY/status"; }
START=$(kib VmRSS)
h2load -n $((C*M)) -c $C -m $M "http://127.0.0.1:18192/same-$(date +%s%N)" > "$DIR/h2load.out" 2>&1 || true
grep -E "^requests:|^status codes:|finished in" "$DIR/h2load.out"
echo "start $((START/1024)) MiB, peak $(( $(kib VmHWM) / 1024 )) MiB, peak growth $(( ($(kib VmHWM) - START) / 1024 )) MiB"
curl -s http://127.0.0.1:18193/metrics | grep -E "^tiercache_requests_(shed_total|in_flight)" || true
