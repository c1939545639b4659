#!/bin/bash
# Floods a release tiercache-proxy from a cold start with a unique URL per
# request (1 KiB bodies from nginx) and prints its RSS growth against the
# budget: the issue 17 measurement, from the outside.
#
# usage: benches/support/flood_proxy.sh BUDGET SECONDS [redis://VALKEY]
#   e.g. benches/support/flood_proxy.sh 256MiB 25
# BODY_BYTES=65536 (or 60, ...) changes the body size (default 1024);
# BODY_SIZES="16384 20000 ..." serves the sizes listed instead, the one
# at (a URL's last digit) modulo the list's length (a list of ten or five
# weighs each size alike);
# PROXY_BIN=path runs another build of the proxy; CONNECTIONS=4 sets wrk's
# connections (default 16); VARY=1 has nginx answer `Vary: Accept-Encoding`
# (each URL then has its own tag in the proxy's tag index); TAGS=20 has
# every response name that many tags of its own in `Surrogate-Key` (~40
# bytes each, made from its URL); SETTLE=5 reads
# RSS again after 5 more seconds idle (the allocator's purge, spares).
# Needs nginx and wrk (apt-get install nginx wrk) and
# `cargo build --release -p tiercache-proxy` first. Ports 18181-18183.
set -euo pipefail
for tool in nginx wrk; do
  command -v "$tool" > /dev/null || { echo "$tool is missing: apt-get install nginx wrk" >&2; exit 2; }
done
BUDGET=$1; SECS=$2; VALKEY=${3:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=$(mktemp -d)
trap 'kill $PROXY $NGINX 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
# nginx's `return` refuses long strings, so the body is a file.
chmod 755 "$DIR"; mkdir "$DIR/www"  # nginx workers read it as another user
head -c "${BODY_BYTES:-1024}" /dev/zero | tr '\0' x > "$DIR/www/body"
SIZED=""
TAGGED=""
if [ -n "${TAGS:-}" ]; then
  TAGGED="add_header Surrogate-Key \""
  for ((t = 1; t <= TAGS; t++)); do TAGGED+=$(printf 'tag-%02d-of-the-response-named-%s ' "$t" '$uri'); done
  TAGGED="${TAGGED% }\";"
fi
if [ -n "${BODY_SIZES:-}" ]; then
  SIZED="location ~ ^/u/.*(\\d)\$ { root $DIR/www; default_type text/plain; try_files /body\$1 =404; ${VARY:+add_header Vary Accept-Encoding;} $TAGGED }"
  read -ra SIZES <<< "$BODY_SIZES"
  [ ${#SIZES[@]} -gt 0 ] || { echo "BODY_SIZES lists no size" >&2; exit 2; }
  for d in 0 1 2 3 4 5 6 7 8 9; do
    head -c "${SIZES[$((d % ${#SIZES[@]}))]}" /dev/zero | tr '\0' x > "$DIR/www/body$d"
  done
fi
cat > "$DIR/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $DIR/nginx.pid;
error_log $DIR/error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $DIR/body;
  proxy_temp_path $DIR/proxy;
  fastcgi_temp_path $DIR/fcgi;
  uwsgi_temp_path $DIR/uwsgi;
  scgi_temp_path $DIR/scgi;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:18181;
    location / { root $DIR/www; default_type text/plain; try_files /body =404; ${VARY:+add_header Vary Accept-Encoding;} $TAGGED }
    $SIZED
  }
}
CONF
cat > "$DIR/unique.lua" <<'LUA'
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format("GET", "/u/" .. counter)
end
LUA
nginx -c "$DIR/nginx.conf" & NGINX=$!
ARGS=(--upstream http://127.0.0.1:18181 --listen 127.0.0.1:18182 --admin 127.0.0.1:18183
      --l1-capacity "$BUDGET" --ttl 10m)
[ -n "$VALKEY" ] && ARGS+=(--valkey "$VALKEY")
"${PROXY_BIN:-$ROOT/target/release/tiercache-proxy}" "${ARGS[@]}" > "$DIR/proxy.log" 2>&1 & PROXY=$!
sleep 1
# VmRSS, then its anonymous part (the heap, stacks) and its file-backed part
# (the binary's pages, faulted in as code paths first run), in KiB.
rss() { awk '/^(VmRSS|RssAnon|RssFile):/ {printf "%s ", $2}' "/proc/$PROXY/status"; }
BEFORE=$(rss)
wrk -t1 -c"${CONNECTIONS:-16}" -d"${SECS}s" -s "$DIR/unique.lua" http://127.0.0.1:18182 | grep -E "requests in|Non-2xx" || true
sleep 1
AFTER=$(rss)
curl -s http://127.0.0.1:18183/metrics | grep -E "^tiercache_l1_(bytes|entries)|^tiercache_l2_write_drops" || true
report() {
python3 - "$BEFORE" "$1" "$BUDGET" "$2" <<'PY'
import re, sys
budget = sys.argv[3]
before, after = (list(map(int, v)) for v in map(str.split, sys.argv[1:3]))
n, unit = re.fullmatch(r"(\d+)(KiB|MiB|GiB)?", budget).groups()
budget_kib = int(n) * {"KiB": 1, "MiB": 1024, "GiB": 1024 * 1024, None: 1 / 1024}[unit]
grown, anon, file = (a - b for a, b in zip(after, before))
print(f"{sys.argv[4]}RSS grew {grown / 1024:.1f} MiB for a {budget} budget ({grown / budget_kib:.2f}x): "
      f"anonymous {anon / 1024:.1f} MiB ({anon / budget_kib:.2f}x), "
      f"file-backed {file / 1024:.1f} MiB")
PY
}
report "$AFTER" ""
if [ -n "${SETTLE:-}" ]; then
  sleep "$SETTLE"
  report "$(rss)" "after $((SETTLE + 1)) s idle: "
fi
