#!/bin/bash
# The layer's L1 hit against the limit (a prebuilt response cloned per
# request), in wall clock: the two halves of `cargo bench --bench http`
# that issue 17's goal is about, alone, so more rounds fit in a minute.
# Each round starts each server pinned to cpu 1, warms it, and runs
# `wrk -t1 -c32 -d3s` pinned to cpu 0; CPU per request is the server's
# utime+stime (100 Hz ticks) over the requests. Prints each round, then
# the layer's ratios to the limit of the same round: median [min-max].
#
# usage: benches/support/limit_vs_layer.sh [ROUNDS] [HTTP_BENCH_BINARY...]
#   several binaries (e.g. two builds) alternate within each round.
# Needs wrk, and first: cargo bench --bench http --no-run
# Ports 18300-18309.
set -euo pipefail
ROUNDS=${1:-10}; shift $(( $# >= 1 ? 1 : 0 ))
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BINS=("$@")
[ ${#BINS[@]} -eq 0 ] && BINS=("$(ls -t "$ROOT"/target/release/deps/http-* | grep -v '\.d$' | head -1)")
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  i=0; k=0
  for bin in "${BINS[@]}"; do
    k=$((k + 1))
    for mode in limit layer; do
      port=$((18300 + i)); i=$((i + 1))
      TIERCACHE_BENCH_SERVE=$mode PORT=$port taskset -c 1 "$bin" > /dev/null 2>&1 &
      pid=$!
      for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
      curl -s -o /dev/null "http://127.0.0.1:$port/p/7"
      taskset -c 0 wrk -t1 -c32 -d1s "http://127.0.0.1:$port/p/7" > /dev/null
      t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
      reqs=$(taskset -c 0 wrk -t1 -c32 -d3s "http://127.0.0.1:$port/p/7" | awk '/requests in/ {print $1}')
      t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
      kill "$pid"; wait "$pid" 2>/dev/null || true
      # Tagged by position: two builds may share a file name.
      [ -n "$reqs" ] || { echo "round $r: $(basename "$bin") $mode answered nothing" >&2; continue; }
      echo "$r $k:$(basename "$bin") $mode $reqs $((t1 - t0))" | tee -a "$OUT"
    done
  done
done
python3 - "$OUT" <<'PY'
import statistics as st, sys
from collections import defaultdict
rounds = defaultdict(dict)
for line in open(sys.argv[1]):
    r, bin_, mode, reqs, ticks = line.split()
    rounds[(bin_, r)][mode] = (int(reqs) / 3, int(ticks) * 10000 / int(reqs))
by_bin = defaultdict(lambda: ([], []))
for (bin_, _), m in rounds.items():
    if "limit" not in m or "layer" not in m:
        continue
    by_bin[bin_][0].append(m["layer"][0] / m["limit"][0])
    by_bin[bin_][1].append(m["layer"][1] / m["limit"][1])
for bin_, (rps, cpu) in by_bin.items():
    print(f"{bin_}: layer / limit, {len(rps)} rounds: req/s {st.median(rps):.3f} "
          f"[{min(rps):.2f}-{max(rps):.2f}], CPU a request {st.median(cpu):.3f} "
          f"[{min(cpu):.2f}-{max(cpu):.2f}]")
PY
