#!/bin/bash
# A burst of requests in flight through a release tiercache-proxy, then
# quiet: prints the proxy's RSS at start, at the burst's peak, and every
# 5 s after every request was answered (what the process gives back).
#
# usage: benches/support/burst_proxy.sh N same|unique [SECONDS_AFTER]
#   e.g. benches/support/burst_proxy.sh 9000 same
# N connections each send one GET (`same`: all for one key, waiting on one
# load; `unique`: a key each, each loading over an upstream connection of
# its own) to an origin that answers after SLOW seconds (default 6).
# PROXY_BIN=path runs another build. Needs python3, and N + 100 open files
# (`ulimit -n`; 2N + 100 with `unique`: the proxy's upstream connections
# too). Ports 18191-18193.
set -euo pipefail
N=$1; MODE=$2; AFTER=${3:-30}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=$(mktemp -d)
trap 'kill $PROXY $ORIGIN 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
cat > "$DIR/burst.py" <<'PY'
import asyncio, sys, time
n, mode, tag = int(sys.argv[1]), sys.argv[2], time.time_ns()
async def one(i):
    r, w = await asyncio.open_connection("127.0.0.1", 18192)
    path = f"/same-{tag}" if mode == "same" else f"/u-{tag}-{i}"
    w.write(f"GET {path} HTTP/1.1\r\nhost: burst\r\n\r\n".encode())
    await w.drain()
    ok = (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    w.close()
    return ok
async def main():
    answers = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    print(f"{sum(a is True for a in answers)} of {n} answered 200")
asyncio.run(main())
PY
python3 "$ROOT/benches/support/slow_origin.py" & ORIGIN=$!
"${PROXY_BIN:-$ROOT/target/release/tiercache-proxy}" --upstream http://127.0.0.1:18191 \
  --listen 127.0.0.1:18192 --admin 127.0.0.1:18193 --l1-capacity 32MiB --ttl 10m \
  > "$DIR/proxy.log" 2>&1 & PROXY=$!
sleep 1
mib() { awk '/^VmRSS/ {printf "%.1f MiB", $2 / 1024}' "/proc/$PROXY/status"; }
echo "start: $(mib)"
python3 "$DIR/burst.py" "$N" "$MODE" & CLIENT=$!
PEAK=0
while kill -0 $CLIENT 2> /dev/null; do
  KIB=$(awk '/^VmRSS/ {print $2}' "/proc/$PROXY/status")
  [ "$KIB" -gt "$PEAK" ] && PEAK=$KIB
  sleep 0.5
done
wait $CLIENT
echo "peak: $(awk -v k="$PEAK" 'BEGIN {printf "%.1f MiB", k / 1024}')"
for ((t = 5; t <= AFTER; t += 5)); do
  sleep 5
  echo "${t} s after: $(mib), $(ls "/proc/$PROXY/fd" | wc -l) files open"
done
