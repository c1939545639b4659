//! Over real sockets: hit throughput and server CPU per request, and origin
//! protection in a cold stampede, for tiercache and what a user would pick
//! instead, in one run on one machine.
//!
//! Run: `cargo bench --bench http` (needs `wrk`, and `nginx` and `varnishd`
//! for those peers: as root it installs the Debian packages `wrk nginx
//! varnish` when they are missing; a peer that cannot be had is skipped,
//! and the report says so).
//!
//! Every server is its own process (this binary re-executed in a serve mode,
//! the release `tiercache-proxy`, `benches/peers`' binary, nginx or
//! varnishd), all on loopback. The same
//! origin (`benches/support/origin.rs`: axum, a 2 KiB body,
//! `Cache-Control: public, max-age=3600`) is behind every cache:
//!
//! - `limit`: the baseline every ratio is against: a bare axum handler
//!   answering the same bytes and the same fields as the layer's L1 hit from
//!   a prebuilt response cloned per request, the cheapest way axum can
//!   answer (the physical limit of a hit on this machine);
//! - `bare`: the origin itself (a handler building its two fields);
//! - `layer`: the same handler wrapped in the tiercache layer (L1 hits);
//! - `proxy`: the release `tiercache-proxy` binary in front of the origin
//!   (L1 hits);
//! - the Rust crates a user might pick instead, each wrapping the same
//!   handler in its own process: `axum-response-cache` 0.5, `hitbox` 0.2,
//!   `tower-http-cache` 0.6 and `http-cache-tower-server` 0.2, set up as
//!   `benches/peers/src/main.rs` says (its own workspace and lock file, built
//!   by this bench on its first run, a few minutes; if it cannot be built
//!   the peers are skipped and the report says so);
//! - `nginx`: `proxy_cache` with `proxy_cache_lock on`, one worker (like
//!   every other server here), `keepalive_requests` high (its default closes
//!   a client connection every 1,000 requests);
//! - `varnish`: `varnishd` with the default VCL, `-s malloc,256m`, two
//!   thread pools of at least 100 threads.
//!
//! Throughput: `wrk -t1 -c32 -d3s` per target, five alternating rounds
//! (A B C … A B C …), wrk pinned to the first core and every server to the
//! second (`taskset`; the report says when it could not pin); server CPU
//! per request is the server's `utime+stime` (all its processes) over the
//! requests wrk made. The report gives each target's median req/s and CPU
//! µs/request, and its ratios to `limit` in the same round: median
//! [min-max] over the rounds.
//!
//! Stampede: 1,000 connections are opened first, then each sends one GET for
//! the same cold URL at once; the origin takes 300 ms and counts calls.
//!
//! Instructions per hit, which the machine's load does not move:
//! `benches/support/http_instructions.sh` runs each server under callgrind
//! (2026-12-05, latest: limit 19,339, layer 20,016–20,099, 1.035–1.039×,
//! proxy 17,850, 0.923×, with a per-thread table in front of moka; proxy
//! 17,698, 0.914× the limit's 19,369 in its run, with its HTTP/2 watchdog
//! (bookkeeping on HTTP/2 only). Before,
//! 2026-12-04: limit 19,382, layer 21,087, 1.088×, proxy 18,703,
//! 0.965×, once axum records `OriginalUri` and the proxy answers without a
//! `Router`; before those, limit 18,941; layer 20,465–20,486, 1.08×, with a
//! hot entry's finished head and a hot target's key kept per thread;
//! proxy 20,776; axum-response-cache 21,842. Before: limit 18,901; layer
//! 21,746, 1.15×, later 21,658–21,678
//! against a limit of 18,942, 1.14×, its key in one exact allocation; proxy 21,549;
//! axum-response-cache 21,850; tower-http-cache 43,822; hitbox 46,007;
//! http-cache-tower-server 614,092).
//!
//! Latest run (2026-12-05, every Rust server built with `lto = "fat"` and
//! `codegen-units = 1`, the workspace's release profile and `benches/peers`'
//! now; limit 87,886 req/s, 11.2 µs), req/s × limit / CPU × limit, medians
//! of five rounds (one disturbed): layer 0.97 [0.85-1.66] / 1.04
//! [0.60-1.16]; proxy 0.94 / 1.06; axum-response-cache 0.90 / 1.12;
//! tower-http-cache 0.74 / 1.37; hitbox 0.62 / 1.63; http-cache-tower-server
//! 0.17 / 5.76; nginx 0.51 / 1.97; Varnish 0.39 / 2.59; the same origin
//! calls as below. The layer against the limit alone, ten pinned rounds of
//! each build (`benches/support/limit_vs_layer.sh`): 0.978 / 1.026 built so,
//! 0.910 / 1.098 with Cargo's default release profile. Instructions a hit
//! (LTO): limit 17,365, layer 17,744 (1.022×), proxy 17,822,
//! axum-response-cache 19,039.
//!
//! The run before (after the per-thread table in front of moka, Cargo's
//! default profile; limit 71,488 req/s, 13.8 µs), req/s × limit / CPU ×
//! limit, medians of five rounds: layer 0.94 [0.90-0.99] / 1.07 [1.02-1.10]; proxy 0.98 / 1.02;
//! axum-response-cache 0.98 / 1.03; tower-http-cache 0.70 / 1.44; hitbox
//! 0.61 / 1.66; http-cache-tower-server 0.20 / 5.13; nginx 0.58 / 1.75;
//! Varnish 0.44 / 2.29; the same origin calls as below.
//!
//! Earlier (2 cores, shared machine, 2026-12-03, two runs; nginx
//! 1.22, Varnish 7.1 from Debian 12), req/s × limit / CPU per request ×
//! limit (limit 93,043 / 104,920 req/s, 9.5 / 9.1 µs): bare origin 1.01 /
//! 1.03, 0.90 / 1.11; layer 1.01 / 1.08, 0.87 / 1.19; tiercache-proxy 0.94
//! / 1.15, 0.97 / 1.05; axum-response-cache 0.99 / 1.10, 0.86 / 1.19;
//! hitbox 0.62 / 1.73, 0.56 / 1.80; tower-http-cache 0.63 / 1.70, 0.60 /
//! 1.69; http-cache-tower-server 0.12 / 9.43, 0.10 / 10.28; nginx 0.78 /
//! 1.39, 0.71 / 1.46; Varnish 0.51 / 2.82, 0.50 / 2.76. 1,000 concurrent
//! cold requests, in both runs: one origin call each for layer, proxy,
//! hitbox, tower-http-cache, nginx and Varnish; 1,000 for
//! axum-response-cache and http-cache-tower-server (neither coalesces);
//! none failed. (Before the baseline was the prebuilt response, ratios were
//! against `bare`, and nginx closed each client connection every 1,000
//! requests.)
//!
//! A third run, 2026-12-04 (limit 86,676 req/s, 9.6 µs): layer 0.79 /
//! 1.18; proxy 0.97 / 1.12; axum-response-cache 1.08 / 1.08; hitbox 0.80 /
//! 1.49; tower-http-cache 0.77 / 1.52; http-cache-tower-server 0.15 / 8.17;
//! nginx 0.90 / 1.32; Varnish 0.55 / 2.74; the same origin calls. Up to
//! here the proxy ran inside this binary (glibc's malloc); a fourth run measured it so once more (limit 108,576 req/s,
//! 8.9 µs): bare 1.28 / 0.78; layer 1.12 / 0.91; proxy 1.09 / 0.93;
//! axum-response-cache 1.10 / 0.92; hitbox 0.76 / 1.34; tower-http-cache
//! 0.81 / 1.27; http-cache-tower-server 0.14 / 7.50; nginx 0.89 / 1.14;
//! Varnish 0.61 / 2.14.
//!
//! Since then `proxy` is the release `tiercache-proxy` binary as users run
//! it (its own process, on mimalloc), built by this bench into
//! `target/bench-proxy` and given one runtime worker
//! (`TOKIO_WORKER_THREADS=1`). A fifth run, 2026-12-04 (limit 130,230
//! req/s, 7.5 µs): bare 1.07 / 0.93; layer 0.91 / 1.09; proxy 0.85 / 1.18;
//! axum-response-cache 0.85 / 1.18; hitbox 0.63 / 1.60; tower-http-cache
//! 0.66 / 1.53; http-cache-tower-server 0.12 / 8.62; nginx 0.76 / 1.31;
//! Varnish 0.52 / 2.51; the same origin calls. The limit moves most between
//! runs on this shared machine (7.5-9.6 µs); the bare origin, with fewer
//! bytes to write, beat it in the last two.
//!
//! The first pinned run of five rounds, 2026-12-04 (limit 115,111 req/s,
//! 8.4 µs), ratio medians [min-max]: bare 1.08 [0.96-1.11] / 0.91
//! [0.89-0.99]; layer 0.95 [0.85-1.04] / 1.06 [0.97-1.18]; proxy 0.89
//! [0.71-0.98] / 1.14 [1.02-1.43]; axum-response-cache 0.93 [0.85-1.15] /
//! 1.04 [0.87-1.19]; hitbox 0.59 / 1.69; tower-http-cache 0.64 / 1.60;
//! http-cache-tower-server 0.11 / 9.12; nginx 0.76 [0.60-1.07] / 1.33
//! [0.93-1.70]; Varnish 0.45 / 2.22; the same origin calls. The second
//! (limit 135,726 req/s, 7.3 µs): bare 1.03 / 0.96; layer 0.84
//! [0.75-0.86] / 1.20 [1.17-1.33]; proxy 0.81 / 1.25; axum-response-cache
//! 0.86 / 1.15; hitbox 0.59 / 1.71; tower-http-cache 0.64 / 1.57;
//! http-cache-tower-server 0.10 / 9.97; nginx 0.70 / 1.44; Varnish 0.42 /
//! 2.37. The layer's own cost held still (9.0 and 9.1 µs a hit); the limit
//! moved (8.4 and 7.3 µs).
//!
//! After a hot key's digest came from a per-thread table (callgrind: 14,160
//! → 13,353 instructions a hit), two more pinned runs, 2026-12-04. Third
//! (limit 104,371 req/s, 9.4 µs; rounds disturbed, wide ranges): layer
//! 0.93 [0.83-1.66] / 1.08 [0.89-1.20]; proxy 0.92 / 1.09;
//! axum-response-cache 0.86 / 1.16; hitbox 0.59 / 1.72; tower-http-cache
//! 0.60 / 1.68; http-cache-tower-server 0.12 / 8.42; nginx 0.78 / 1.29;
//! Varnish 0.42 / 2.40. Fourth (limit 119,796 req/s, 8.0 µs): bare 1.04 /
//! 0.95; layer 0.89 [0.85-1.01] / 1.13 [1.02-1.20]; proxy 0.89 / 1.14;
//! axum-response-cache 0.93 [0.93-1.11] / 1.07 [0.90-1.09]; hitbox 0.66 /
//! 1.57; tower-http-cache 0.65 / 1.54; http-cache-tower-server 0.13 /
//! 8.10; nginx 0.84 / 1.24; Varnish 0.51 / 2.04. The same origin calls in
//! both.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "support/origin.rs"]
mod origin;
#[path = "support/procs.rs"]
mod procs;

use procs::{Server, get_text, own_group, which};
use tiercache_testkit::valkey::free_port;

/// The Rust peers, each served by `benches/peers` (`bench-peer NAME PORT`).
const RUST_PEERS: [&str; 4] = [
    "axum-response-cache",
    "hitbox",
    "tower-http-cache",
    "http-cache-tower-server",
];

fn main() {
    if let Ok(mode) = std::env::var("TIERCACHE_BENCH_SERVE") {
        serve(&mode);
        return;
    }
    let dir = tiercache_testkit::valkey::target_dir().join("bench-http");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench folder");
    procs::provision(&[("wrk", "wrk"), ("nginx", "nginx"), ("varnishd", "varnish")]);

    let origin = Server::spawn_self("origin", free_port(), &[]);
    let proxy = procs::build_proxy().expect("the release tiercache-proxy");
    let mut targets: Vec<(&str, Server)> = vec![
        ("limit", Server::spawn_self("limit", free_port(), &[])),
        ("bare", Server::spawn_self("origin", free_port(), &[])),
        ("layer", Server::spawn_self("layer", free_port(), &[])),
        // One runtime worker, like every other server here.
        (
            "proxy",
            procs::spawn_proxy(&proxy, origin.addr, free_port(), 1, &[]),
        ),
    ];
    let mut skipped = Vec::new();
    match procs::build_peers() {
        Ok(bin) => {
            for name in RUST_PEERS {
                targets.push((name, spawn_peer(&bin, name)));
            }
        }
        Err(e) => skipped.push(format!("the Rust peers: {e}")),
    }
    match nginx(&dir, origin.addr) {
        Ok(s) => targets.push(("nginx", s)),
        Err(e) => skipped.push(format!("nginx: {e}")),
    }
    match varnish(&dir, origin.addr) {
        Ok(s) => targets.push(("varnish", s)),
        Err(e) => skipped.push(format!("varnish: {e}")),
    }
    if which("wrk").is_none() {
        println!("wrk is missing (apt-get install wrk): no throughput figures");
        return;
    }

    // Warm every cache, then alternate.
    for (_, t) in &targets {
        for _ in 0..3 {
            get_text(t.addr, "/p/7");
        }
    }
    // wrk on the first core, every server on the second: without pinning
    // the scheduler moved them about, and the ratios moved by ±15 % between
    // runs.
    let pinned = which("taskset").is_some() && targets.iter().all(|(_, t)| t.pin(1));
    let mut results: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for _round in 0..ROUNDS {
        for (name, t) in &targets {
            if pinned {
                // Again each round: a server may have started threads since.
                t.pin(1);
            }
            let before = t.cpu();
            let (reqs, rps) = wrk(t.addr, "/p/7", pinned);
            let cpu = t.cpu() - before;
            results
                .entry(name)
                .or_default()
                .push((rps, cpu.as_secs_f64() * 1e6 / reqs as f64));
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let limit = &results["limit"];
    println!(
        "== hit throughput, 2 KiB body, wrk -t1 -c32 -d{WRK_SECS}s, {ROUNDS} alternating rounds, {}",
        if pinned {
            "wrk on cpu 0, servers on cpu 1"
        } else {
            "not pinned (taskset missing or refused)"
        }
    );
    println!("   each ratio is against the limit's figure in the same round: median [min-max]");
    println!(
        "{:<24} {:>10} {:>18} {:>11} {:>18}",
        "target", "req/s", "× limit", "CPU µs/req", "× limit"
    );
    for (name, _) in &targets {
        let rounds = &results[name];
        let mut rps: Vec<f64> = rounds.iter().map(|r| r.0).collect();
        let mut cpu: Vec<f64> = rounds.iter().map(|r| r.1).collect();
        let mut rps_ratio: Vec<f64> = rounds.iter().zip(limit).map(|(r, l)| r.0 / l.0).collect();
        let mut cpu_ratio: Vec<f64> = rounds.iter().zip(limit).map(|(r, l)| r.1 / l.1).collect();
        let spread = |v: &mut Vec<f64>| {
            let m = median(v);
            format!("{m:.2} [{:.2}-{:.2}]", v[0], v[v.len() - 1])
        };
        println!(
            "{name:<24} {:>10.0} {:>18} {:>11.1} {:>18}",
            median(&mut rps),
            spread(&mut rps_ratio),
            median(&mut cpu),
            spread(&mut cpu_ratio)
        );
    }

    println!("== origin calls for 1,000 concurrent cold requests (origin 300 ms)");
    for (i, (name, t)) in targets.iter().enumerate().skip(2) {
        let path = format!("/slow/{i}");
        let before = origin_calls(if in_process(name) {
            t.addr
        } else {
            origin.addr
        });
        let failed = stampede(t.addr, &path, 1000);
        let after = origin_calls(if in_process(name) {
            t.addr
        } else {
            origin.addr
        });
        println!(
            "{name:<24} {:>5} origin call(s), {failed} failed",
            after - before
        );
    }
    for s in skipped {
        println!("skipped {s}");
    }
}

// ------------------------------------------------------------------ servers

/// Whether the cache runs inside the origin's process (it counts its own
/// origin calls).
fn in_process(name: &str) -> bool {
    name == "layer" || RUST_PEERS.contains(&name)
}

/// A Rust peer, served by `benches/peers`' binary.
fn spawn_peer(bin: &Path, name: &str) -> Server {
    let port = free_port();
    let mut cmd = Command::new(bin);
    cmd.arg(name).arg(port.to_string()).stdout(Stdio::null());
    Server::wait(own_group(&mut cmd).spawn().expect("spawn a peer"), port)
}

fn serve(mode: &str) {
    let port: u16 = std::env::var("PORT").unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        match mode {
            "layer" => {
                let engine = tiercache::TieredCache::builder().build().unwrap();
                let cache = tiercache::ResponseCacheLayer::new(engine);
                let route = cache
                    .route(
                        tiercache::Policy::ttl(Duration::from_secs(3600))
                            .build()
                            .unwrap(),
                    )
                    .unwrap();
                let app = origin_app().layer(route);
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, app).await.unwrap();
            }
            "limit" => {
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, limit_app()).await.unwrap();
            }
            _ => {
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, origin_app()).await.unwrap();
            }
        }
    });
}

/// The limit: the cheapest way axum can answer what a cache hit answers, a
/// prebuilt response (the same bytes, and the same fields as the layer's
/// L1 hit) cloned per request.
fn limit_app() -> axum::Router {
    use axum::http::{HeaderMap, HeaderValue};
    let mut head = HeaderMap::new();
    for (name, value) in [
        ("cache-control", "public, max-age=3600"),
        ("content-type", "application/octet-stream"),
        ("age", "0"),
        ("x-cache", "HIT"),
        ("x-cache-tier", "l1"),
        ("x-cache-hit-ratio", "0.9999"),
        ("cache-status", "tiercache; hit; ttl=3599; detail=l1"),
        ("content-length", "2048"),
    ] {
        head.insert(name, HeaderValue::from_static(value));
    }
    let body = bytes::Bytes::from_static(origin::BODY);
    axum::Router::new().route(
        "/p/{id}",
        axum::routing::get(move || {
            let (head, body) = (head.clone(), body.clone());
            async move {
                let mut res = axum::response::Response::new(axum::body::Body::from(body));
                *res.headers_mut() = head;
                res
            }
        }),
    )
}

/// The whole origin: its cacheable routes and `/count`.
fn origin_app() -> axum::Router {
    let (cacheable, count) = origin::origin();
    cacheable.merge(count)
}

fn nginx(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    // One worker, like every other server here; the lock for the stampede.
    procs::nginx(
        &dir.join("nginx"),
        origin,
        "1",
        "keys_zone=c:10m max_size=256m",
        "proxy_cache_valid 200 1h; proxy_cache_lock on; proxy_cache_lock_timeout 10s;",
    )
}

fn varnish(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    procs::varnish(
        &dir.join("varnish"),
        origin,
        "malloc,256m",
        &["thread_pools=2", "thread_pool_min=100"],
    )
}

// ------------------------------------------------------------------ clients

/// Alternating rounds of the throughput test, and the seconds of each.
const ROUNDS: usize = 5;
const WRK_SECS: u64 = 3;

/// Requests made and req/s of `wrk -t1 -c32` on `path` (on the first core
/// when `pinned`).
fn wrk(addr: SocketAddr, path: &str, pinned: bool) -> (u64, f64) {
    let mut cmd = if pinned {
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "0", "wrk"]);
        cmd
    } else {
        Command::new("wrk")
    };
    let out = cmd
        .args(["-t1", "-c32", &format!("-d{WRK_SECS}s")])
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let reqs = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("wrk output: {text}"));
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("wrk output: {text}"));
    (reqs, rps)
}

/// The `/slow` calls an origin counted (a fresh query each time: a cache in
/// front that ignores `no-store` must not answer it).
fn origin_calls(addr: SocketAddr) -> usize {
    let fresh = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    get_text(addr, &format!("/count?at={fresh}"))
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Opens `n` connections, then sends one GET on each at once; returns how
/// many did not answer 200.
fn stampede(addr: SocketAddr, path: &str, n: usize) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            conns.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: bench.test\r\nConnection: close\r\n\r\n");
        let tasks: Vec<_> = conns
            .into_iter()
            .map(|mut c| {
                let request = request.clone();
                tokio::spawn(async move {
                    c.write_all(request.as_bytes()).await.ok()?;
                    let mut out = Vec::new();
                    let deadline = Duration::from_secs(30);
                    tokio::time::timeout(deadline, c.read_to_end(&mut out))
                        .await
                        .ok()?
                        .ok()?;
                    out.starts_with(b"HTTP/1.1 200").then_some(())
                })
            })
            .collect();
        let mut failed = 0;
        for t in tasks {
            if t.await.ok().flatten().is_none() {
                failed += 1;
            }
        }
        failed
    })
}

// ------------------------------------------------------------------ helpers
