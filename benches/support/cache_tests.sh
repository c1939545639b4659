#!/bin/bash
# Runs the HTTP cache test suite behind cache-tests.fyi (Mark Nottingham's,
# RFC 9111) against a release tiercache-proxy and scores it beside the
# published results of nginx, Varnish, Squid and Apache Traffic Server for
# the same tests (the suite's own scoring, `determineTestResult`).
#
# usage: CACHE_TESTS_DIR=/path/to/cache-tests benches/support/cache_tests.sh [proxy flags...]
#   e.g. benches/support/cache_tests.sh --target CDN-Cache-Control
# CACHE_TESTS_DIR is a checkout of github.com/http-tests/cache-tests
# (cloned there when missing; measured at its commit b55b8bd); its
# dependencies are installed with npm when missing. Needs node >= 20, npm,
# git, and `cargo build --release -p tiercache-proxy` first (PROXY_BIN=path
# runs another build). Ports 18800-18802, loopback only. Writes the
# proxy's results to $OUT (default /tmp/cache-tests-tiercache.json) and its
# failures beside them (.failures.json).
set -euo pipefail
for tool in node npm git; do
  command -v "$tool" > /dev/null || { echo "$tool is missing (apt-get install nodejs npm git)" >&2; exit 2; }
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SUITE=${CACHE_TESTS_DIR:-/tmp/cache-tests}
OUT=${OUT:-/tmp/cache-tests-tiercache.json}
[ -d "$SUITE/.git" ] || git clone -q https://github.com/http-tests/cache-tests.git "$SUITE"
[ -d "$SUITE/node_modules" ] || (cd "$SUITE" && npm i --omit=dev --no-audit --no-fund > /dev/null)
DIR=$(mktemp -d)
trap 'kill $PROXY $SERVER 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
# The suite's origin listens on every interface: this one on loopback only.
cat > "$DIR/server.mjs" <<MJS
import net from 'net'
const listen = net.Server.prototype.listen
net.Server.prototype.listen = function (...args) {
  if (args.length === 1 && ['number', 'string'].includes(typeof args[0])) {
    return listen.call(this, Number(args[0]), '127.0.0.1')
  }
  return listen.apply(this, args)
}
await import('$SUITE/test-engine/server/server.mjs')
MJS
npm_package_config_protocol=http npm_config_port=18800 npm_config_pidfile="$DIR/server.pid" \
  node "$DIR/server.mjs" > "$DIR/server.log" 2>&1 & SERVER=$!
"${PROXY_BIN:-$ROOT/target/release/tiercache-proxy}" --upstream http://127.0.0.1:18800 \
  --listen 127.0.0.1:18801 --admin 127.0.0.1:18802 "$@" > "$DIR/proxy.log" 2>&1 & PROXY=$!
sleep 2
(cd "$SUITE" && npm run --silent cli --base=http://127.0.0.1:18801) > "$OUT"
cat > "$DIR/score.mjs" <<MJS
import fs from 'fs'
import suites from '$SUITE/tests/index.mjs'
import { determineTestResult, resultTypes } from '$SUITE/test-engine/lib/results.mjs'
const mine = JSON.parse(fs.readFileSync('$OUT'))
const peers = ['nginx', 'varnish', 'squid', 'trafficserver']
const results = { tiercache: mine }
for (const p of peers) results[p] = JSON.parse(fs.readFileSync('$SUITE/results/' + p + '.json'))
const tests = suites.flatMap(s => s.tests).filter(t => t.id in mine)
const named = r => Object.keys(resultTypes).find(k => resultTypes[k] === r)
const verdict = (res, id) => named(determineTestResult(suites, id, res))
const bucket = { pass: 'pass', yes: 'pass', fail: 'fail', optional_fail: 'fail', no: 'fail' }
console.log('kind      system         pass  fail  not scored (a dependency or the setup failed)')
for (const kind of ['required', 'optimal', 'check']) {
  const ofKind = tests.filter(t => (t.kind || 'required') === kind)
  for (const [system, res] of Object.entries(results)) {
    const n = { pass: 0, fail: 0, other: 0 }
    for (const t of ofKind) n[bucket[verdict(res, t.id)] || 'other']++
    console.log(kind.padEnd(10), system.padEnd(14), String(n.pass).padStart(4), String(n.fail).padStart(5), String(n.other).padStart(5), 'of', ofKind.length)
  }
}
const failures = tests
  .filter(t => !['pass', 'yes'].includes(verdict(mine, t.id)))
  .map(t => ({ id: t.id, kind: t.kind || 'required', name: t.name, result: verdict(mine, t.id), detail: mine[t.id], peers: Object.fromEntries(peers.map(p => [p, verdict(results[p], t.id)])) }))
fs.writeFileSync('$OUT'.replace(/\.json$/, '') + '.failures.json', JSON.stringify(failures, null, 2))
console.log('\nrequired tests tiercache does not pass:')
for (const f of failures.filter(f => f.kind === 'required')) console.log(' ', f.id, '(' + f.result + ')', JSON.stringify(f.peers))
MJS
node "$DIR/score.mjs"
