//! Origin protection under a realistic workload: what users choose a cache
//! by. Every system sits in front of the same origin and gets the same
//! request stream, in one run on one machine.
//!
//! Run: `cargo bench --bench workload` (as root it installs the Debian
//! packages `nginx varnish` when they are missing; a peer that cannot be
//! had is skipped, and the report says so). `WORKLOAD_SECS` (default 40),
//! `WORKLOAD_KEYS` (10,000), `WORKLOAD_CONNS` (32) and `WORKLOAD_ONLY`
//! (a comma-separated list of system names) change the run.
//!
//! - Popularity: Zipf, s = 1, over `WORKLOAD_KEYS` keys (key 0 the most
//!   popular), the same seeded stream for every system.
//! - The origin (its own process, this binary re-executed): 50 ms per call,
//!   at most 64 calls at once (a database pool), bodies of 2–20 KiB by key,
//!   `Cache-Control: public, max-age=5`: every entry lives 5 s. It counts
//!   its calls and when each began, and the most it was asked to run at once
//!   (queued on its pool included).
//! - The client: `WORKLOAD_CONNS` keep-alive connections, each sending its
//!   next request when the last is answered, for `WORKLOAD_SECS`.
//! - Systems: the tiercache layer (in the origin's process) and the
//!   release `tiercache-proxy` binary, each as `plain` (ttl 5 s, no jitter, no early
//!   refresh), `xfetch` (jitter 0.1, XFetch β = 1) and `swr` (the same, and
//!   stale-while-revalidate 30 s); nginx (`proxy_cache_lock`,
//!   `proxy_cache_use_stale updating`, `proxy_cache_background_update on`,
//!   `keepalive_requests` high, a worker per core); Varnish (its default
//!   grace of 10 s, thread pools sized for the box); the Rust peers of
//!   `benches/http.rs` (`benches/peers`, built on first use), each wrapping
//!   the same origin in its own process and caching for its 5 s lifetime.
//! - The fleet: three proxies sharing one Valkey (`swr`, each with a third
//!   of one instance's refresh budget, as a fleet should be sized), against
//!   three nginx each with its own cache, the client's connections spread
//!   over the three: origin calls.
//!
//! Per system: requests per second, client latency p50 / p90 / p99 / p99.9
//! / max, origin calls per second (mean, and the peak in any 100 ms),
//! the origin's peak demand (calls asked at once), the hit ratio (requests
//! not sent to the origin), failed requests, and against two floors
//! computed from the same request stream: the origin calls a perfect cache
//! would make (one per key per 5 s lifetime), and the requests that must
//! wait on the origin (a key's first request after its lifetime ended; with
//! stale answers, only its first request ever). A request "waited" when it
//! took 40 ms or more (the origin takes 50).
//!
//! Last measured (2 cores, shared machine, 2026-12-03, one run of 40 s per
//! system; nginx 1.22, Varnish 7.1 from Debian 12); "waited × floor" is
//! against the floor with stale answers for the SWR variants, nginx and
//! Varnish, without for the others:
//!
//! ```text
//! | system | req/s | p50 / p99 / p99.9 / max ms | origin calls/s (peak per 100 ms) | origin demand (cap 64) | origin calls × perfect cache | waited × floor |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | layer, plain ttl | 2,745 | 0.2 / 53.7 / 59.5 / 73 | 596 (64) | 32 | 1.00 | 1.01 |
//! | layer, jitter + XFetch | 2,833 | 0.2 / 54.6 / 64.3 / 79 | 609 (70) | 39 | 1.00 | 0.99 |
//! | layer, jitter + XFetch + SWR | **25,576** | 0.6 / **38.6 / 56.8 / 120** | 734 (124) | **64** | **0.55** | **1.02** |
//! | proxy, plain ttl | 2,742 | 0.2 / 53.4 / 59.5 / 70 | 595 (64) | 32 | 1.00 | 1.01 |
//! | proxy, jitter + XFetch | 2,862 | 0.2 / 53.7 / 59.8 / 84 | 611 (70) | 38 | 1.00 | 0.99 |
//! | proxy, jitter + XFetch + SWR | **21,281** | 0.6 / **51.4 / 57.0 / 103** | 707 (127) | **64** | **0.55** | **1.05** |
//! | nginx 1.22 (lock, `use_stale updating`, background update) | 2,740 | 0.2 / 64.5 / 113.6 / 556 | 567 (64) | 32 | 0.96 | 2.51 |
//! | Varnish 7.1 (grace 10 s) | 12,256 | 0.2 / 55.3 / 427.8 / 645 | 1,104 (236) | 807 | 0.97 | 1.11 |
//! | axum-response-cache 0.5 (lifespan 5 s) | 2,926 | 0.1 / 52.2 / 53.0 / 55 | 618 (64) | 32 | 1.00 | 1.00 |
//! | hitbox 0.2 (ttl 5 s, coalescing) | 2,806 | 0.2 / 52.5 / 54.1 / 57 | 604 (64) | 32 | 1.00 | 1.01 |
//! | tower-http-cache 0.6 (ttl 5 s) | 2,804 | 0.2 / 52.6 / 54.5 / 58 | 602 (64) | 32 | 1.00 | 1.01 |
//! | http-cache-tower-server 0.2 (the origin's max-age) | 2,350 | 1.5 / 56.3 / 59.9 / 66 | 560 (64) | 32 | 1.02 | 1.02 |
//! | 3 proxies on one Valkey (SWR, `max_refreshes` 10 each) | 19,197 | 0.7 / 52.2 / 55.3 / 78 | 666 (111) | 62 | 0.52 | 1.02 |
//! | 3 nginx, a cache each | 1,432 | 1.0 / 112.3 / 145.0 / 518 | 537 (64) | 32 | 1.35 | 2.78 |
//! ```
//!
//! Where XFetch pays, hot keys (`WORKLOAD_KEYS=300 WORKLOAD_SECS=20
//! WORKLOAD_ONLY=layer-plain,layer-xfetch`): requests that waited 1,785
//! (plain) vs 455 (jitter + XFetch), p99.9 50.7 vs 5.4 ms, origin calls
//! 1,200 vs 1,351, at ~55,000 req/s.
//!
//! The Rust peers' rows come from a third run
//! (`WORKLOAD_ONLY=axum-response-cache,hitbox,tower-http-cache,http-cache-tower-server`).
//! The fleet rows come from a second run (`WORKLOAD_ONLY=proxy-swr,fleet`),
//! in which one proxy (SWR) made 29,584 origin calls (0.53× the perfect
//! cache's) and the three proxies 26,682 (0.90× one proxy's; 0.52× their
//! perfect cache's). With 32 refresh slots each (the first run) the three
//! made 1.43× one proxy's calls and asked the origin for 109 at once.
//!
//! Up to here the proxy ran as a library inside this binary. Since then it
//! is the release `tiercache-proxy` binary (built into `target/bench-proxy`;
//! its policy in a config file, two runtime workers like the layer's
//! process). A fourth run, 2026-12-04 (`WORKLOAD_ONLY=proxy-plain,proxy-swr,fleet`):
//! proxy plain 2,764 req/s, calls 1.00×, waited 1.01×; proxy SWR 32,443
//! req/s, p99 / p99.9 / max 2.5 / 52.5 / 68.9 ms, demand 64, calls 0.53×,
//! waited 1.02×; three proxies on one Valkey 28,939 req/s, demand 62,
//! waited 1.02×, origin calls 0.91× one proxy's (27,167 vs 29,757); 3 nginx
//! 1,666 req/s, waited 2.96×.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use rand::{Rng, SeedableRng};

#[path = "support/procs.rs"]
mod procs;
#[path = "support/workload_origin.rs"]
mod workload_origin;

use procs::{Server, get_text, own_group, provision};
use tiercache_testkit::valkey::free_port;
use workload_origin::{LIFETIME, ORIGIN_CAP, origin_routes};

/// One instance's refresh budget (the engine's default).
const DEFAULT_MAX_REFRESHES: usize = tiercache::TieredCacheBuilder::DEFAULT_MAX_REFRESHES;
/// A request that took this long waited on the origin.
const WAITED: Duration = Duration::from_millis(40);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if let Ok(mode) = std::env::var("TIERCACHE_BENCH_SERVE") {
        serve(&mode);
        return;
    }
    let secs = env_or("WORKLOAD_SECS", 40) as u64;
    let keys = env_or("WORKLOAD_KEYS", 10_000);
    let conns = env_or("WORKLOAD_CONNS", 32);
    let only: Option<Vec<String>> = std::env::var("WORKLOAD_ONLY")
        .ok()
        .map(|v| v.split(',').map(str::to_owned).collect());
    let wanted = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let dir = tiercache_testkit::valkey::target_dir().join("bench-workload");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench folder");
    provision(&[("nginx", "nginx"), ("varnishd", "varnish")]);

    println!(
        "== workload: Zipf s=1 over {keys} keys, {conns} connections, {secs} s per system; \
         origin 50 ms, {ORIGIN_CAP} at once, bodies 2–20 KiB, lifetime 5 s"
    );
    println!(
        "{:<16} {:>8} {:>6} {:>6} {:>6} {:>7} {:>7} {:>8} {:>9} {:>7} {:>6} {:>6} {:>7} {:>8} {:>8}",
        "system",
        "req/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "max ms",
        "origin/s",
        "peak/100ms",
        "demand",
        "hit %",
        "failed",
        "×floor",
        "waited",
        "×floor"
    );
    let mut skipped = Vec::new();
    let mut single_proxy_calls = None;
    let wants_proxy = ["proxy-plain", "proxy-xfetch", "proxy-swr", "fleet"]
        .iter()
        .any(|n| wanted(n));
    let proxy_bin = wants_proxy.then(|| procs::build_proxy().expect("the release tiercache-proxy"));
    for variant in ["plain", "xfetch", "swr"] {
        let name = format!("layer-{variant}");
        if wanted(&name) {
            let layer = Server::spawn_self("layer", free_port(), &[("VARIANT", variant.into())]);
            let run = load(&[layer.addr], secs, keys, conns);
            report(&name, &run, &origin_stats(layer.addr), variant == "swr");
        }
        let name = format!("proxy-{variant}");
        if wanted(&name) {
            let origin = Server::spawn_self("origin", free_port(), &[]);
            let bin = proxy_bin.as_deref().expect("built above");
            let proxy = spawn_proxy(bin, &dir, variant, origin.addr, &[]);
            let run = load(&[proxy.addr], secs, keys, conns);
            let stats = origin_stats(origin.addr);
            if variant == "swr" {
                single_proxy_calls = Some(stats.calls());
            }
            report(&name, &run, &stats, variant == "swr");
        }
    }
    if wanted("nginx") {
        let origin = Server::spawn_self("origin", free_port(), &[]);
        match nginx(&dir.join("nginx"), origin.addr) {
            Ok(nginx) => {
                let run = load(&[nginx.addr], secs, keys, conns);
                report("nginx", &run, &origin_stats(origin.addr), true);
            }
            Err(e) => skipped.push(format!("nginx: {e}")),
        }
    }
    if wanted("varnish") {
        let origin = Server::spawn_self("origin", free_port(), &[]);
        match varnish(&dir.join("varnish"), origin.addr) {
            Ok(varnish) => {
                let run = load(&[varnish.addr], secs, keys, conns);
                report("varnish", &run, &origin_stats(origin.addr), true);
            }
            Err(e) => skipped.push(format!("varnish: {e}")),
        }
    }

    // The Rust peers, each in front of the same origin in its process (as
    // the layer is), caching for the origin's 5 s lifetime.
    const RUST_PEERS: [&str; 4] = [
        "axum-response-cache",
        "hitbox",
        "tower-http-cache",
        "http-cache-tower-server",
    ];
    if RUST_PEERS.iter().any(|p| wanted(p)) {
        match procs::build_peers() {
            Ok(bin) => {
                for name in RUST_PEERS.into_iter().filter(|p| wanted(p)) {
                    let port = free_port();
                    let mut cmd = Command::new(&bin);
                    cmd.arg(name)
                        .arg(port.to_string())
                        .arg("workload")
                        .stdout(Stdio::null());
                    let peer =
                        Server::wait(own_group(&mut cmd).spawn().expect("spawn a peer"), port);
                    let run = load(&[peer.addr], secs, keys, conns);
                    report(name, &run, &origin_stats(peer.addr), false);
                }
            }
            Err(e) => skipped.push(format!("the Rust peers: {e}")),
        }
    }

    if wanted("fleet") {
        println!("== fleet: three instances, the client's connections spread over them");
        let valkey = tiercache_testkit::ValkeyServer::start();
        let origin = Server::spawn_self("origin", free_port(), &[]);
        let bin = proxy_bin.as_deref().expect("built above");
        // One instance's refresh budget, shared out: the origin sees no
        // more refreshes than from one.
        let share = (DEFAULT_MAX_REFRESHES / 3).to_string();
        let flags = ["--valkey", &valkey.url(), "--max-refreshes", &share];
        let proxies: Vec<Server> = (0..3)
            .map(|_| spawn_proxy(bin, &dir, "swr", origin.addr, &flags))
            .collect();
        let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
        let run = load(&addrs, secs, keys, conns);
        let stats = origin_stats(origin.addr);
        report("3 proxies+Valkey", &run, &stats, true);
        if let Some(one) = single_proxy_calls {
            println!(
                "   origin calls, three proxies on one Valkey vs one proxy: {} vs {one} ({:.2}×)",
                stats.calls(),
                stats.calls() as f64 / one as f64
            );
        }
        drop(proxies);
        let origin = Server::spawn_self("origin", free_port(), &[]);
        let nginxes: Result<Vec<Server>, String> = (0..3)
            .map(|i| nginx(&dir.join(format!("nginx-{i}")), origin.addr))
            .collect();
        match nginxes {
            Ok(nginxes) => {
                let addrs: Vec<SocketAddr> = nginxes.iter().map(|n| n.addr).collect();
                let run = load(&addrs, secs, keys, conns);
                report("3 nginx", &run, &origin_stats(origin.addr), true);
            }
            Err(e) => skipped.push(format!("the nginx fleet: {e}")),
        }
    }
    for s in skipped {
        println!("skipped {s}");
    }
}

// ------------------------------------------------------------------ the load

/// Keys by Zipf (s = 1): the cumulative weights, sampled by binary search.
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(keys: usize) -> Self {
        let mut total = 0.0;
        Self(
            (1..=keys)
                .map(|rank| {
                    total += 1.0 / rank as f64;
                    total
                })
                .collect(),
        )
    }

    fn sample(&self, rng: &mut impl Rng) -> usize {
        let u = rng.random::<f64>() * self.0.last().copied().unwrap_or(0.0);
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

/// What the client saw.
#[derive(Default)]
struct Run {
    /// Per request: when it was sent (ms since the start), its key, and how
    /// long it took.
    requests: Vec<(u32, u32, Duration)>,
    failed: usize,
    elapsed: Duration,
}

/// `conns` connections (spread over `addrs`) sending requests back to back
/// for `secs` seconds; each connection's keys come from its own seeded
/// stream, so every system gets the same one.
fn load(addrs: &[SocketAddr], secs: u64, keys: usize, conns: usize) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let zipf = Arc::new(Zipf::new(keys));
    rt.block_on(async {
        let start = Instant::now();
        let until = start + Duration::from_secs(secs);
        let tasks: Vec<_> = (0..conns)
            .map(|i| {
                let addr = addrs[i % addrs.len()];
                let zipf = zipf.clone();
                tokio::spawn(connection(addr, zipf, i as u64, start, until))
            })
            .collect();
        let mut run = Run::default();
        for t in tasks {
            let part = t.await.unwrap();
            run.requests.extend(part.requests);
            run.failed += part.failed;
        }
        run.elapsed = start.elapsed();
        run
    })
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn connect(addr: SocketAddr) -> Option<Sender> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let (sender, conn) = hyper::client::conn::http1::handshake(io).await.ok()?;
    tokio::spawn(conn);
    Some(sender)
}

async fn connection(
    addr: SocketAddr,
    zipf: Arc<Zipf>,
    seed: u64,
    start: Instant,
    until: Instant,
) -> Run {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut run = Run::default();
    let mut sender: Option<Sender> = None;
    while Instant::now() < until {
        // A server may close a keep-alive connection (nginx after
        // `keepalive_requests`): reconnect, not a failure.
        let ready = match sender.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            sender = connect(addr).await;
            if sender.is_none() {
                run.failed += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        let key = zipf.sample(&mut rng);
        let req = http::Request::get(format!("/k/{key}"))
            .header("host", "bench.test")
            .body(Empty::new())
            .unwrap();
        let sent = Instant::now();
        let ok = match sender.as_mut().unwrap().send_request(req).await {
            Ok(res) => {
                let status = res.status();
                res.into_body().collect().await.is_ok() && status == http::StatusCode::OK
            }
            Err(_) => false,
        };
        if ok {
            let at = sent.duration_since(start).as_millis() as u32;
            run.requests.push((at, key as u32, sent.elapsed()));
        } else {
            run.failed += 1;
            sender = None;
        }
    }
    run
}

/// The floors, from the request stream: origin calls of a perfect cache
/// (one per key per lifetime), and requests that must wait on the origin
/// (those first requests; with stale answers, only each key's first ever).
fn floors(requests: &[(u32, u32, Duration)]) -> (usize, usize) {
    let mut by_time: Vec<(u32, u32)> = requests.iter().map(|r| (r.0, r.1)).collect();
    by_time.sort_unstable();
    let lifetime = LIFETIME.as_millis() as u32;
    let mut expiry: HashMap<u32, u32> = HashMap::new();
    let mut calls = 0;
    for (at, key) in by_time {
        match expiry.get(&key) {
            Some(&until) if at < until => {}
            _ => {
                calls += 1;
                expiry.insert(key, at + lifetime);
            }
        }
    }
    (calls, expiry.len())
}

/// The origin's record of one run.
struct OriginStats {
    /// When each call began, in ms since the Unix epoch.
    times: Vec<u64>,
    /// The most calls it was asked to run at once.
    demand: usize,
}

impl OriginStats {
    fn calls(&self) -> usize {
        self.times.len()
    }

    fn peak_per_100ms(&self) -> usize {
        let mut buckets: HashMap<u64, usize> = HashMap::new();
        for t in &self.times {
            *buckets.entry(t / 100).or_default() += 1;
        }
        buckets.values().copied().max().unwrap_or(0)
    }
}

fn origin_stats(addr: SocketAddr) -> OriginStats {
    let text = get_text(addr, "/_origin");
    let mut lines = text.lines();
    let demand = lines
        .next()
        .and_then(|l| l.strip_prefix("demand "))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let times = lines.filter_map(|l| l.parse().ok()).collect();
    OriginStats { times, demand }
}

fn report(name: &str, run: &Run, origin: &OriginStats, stale_answers: bool) {
    let mut latencies: Vec<Duration> = run.requests.iter().map(|r| r.2).collect();
    latencies.sort_unstable();
    let ms = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    let n = run.requests.len();
    let secs = run.elapsed.as_secs_f64();
    let (calls_floor, first_touches) = floors(&run.requests);
    let waits_floor = if stale_answers {
        first_touches
    } else {
        calls_floor
    };
    let waited = latencies.iter().filter(|d| **d >= WAITED).count();
    let calls = origin.calls();
    println!(
        "{name:<16} {:>8.0} {:>6.1} {:>6.1} {:>6.1} {:>7.1} {:>7.1} {:>8.0} {:>9} {:>7} {:>6.2} {:>6} {:>7.2} {:>8} {:>8.2}",
        n as f64 / secs,
        ms(0.5),
        ms(0.9),
        ms(0.99),
        ms(0.999),
        ms(1.0),
        calls as f64 / secs,
        origin.peak_per_100ms(),
        origin.demand,
        100.0 * (1.0 - calls as f64 / n.max(1) as f64),
        run.failed,
        calls as f64 / calls_floor.max(1) as f64,
        waited,
        waited as f64 / waits_floor.max(1) as f64,
    );
    println!(
        "{:<16} requests {n}, origin calls {calls} (perfect cache {calls_floor}), \
         waited {waited} (floor {waits_floor})",
        ""
    );
}

// ------------------------------------------------------------------ servers

/// A variant's jitter, XFetch β and stale-while-revalidate window.
fn knobs(variant: &str) -> (f64, f64, Duration) {
    match variant {
        "plain" => (0.0, 0.0, Duration::ZERO),
        "xfetch" => (0.1, 1.0, Duration::ZERO),
        _ => (0.1, 1.0, Duration::from_secs(30)),
    }
}

/// The tiercache policy of a variant: the origin's lifetime, and its knobs.
fn policy(variant: &str) -> tiercache::Policy {
    let (jitter, beta, swr) = knobs(variant);
    tiercache::Policy::ttl(LIFETIME)
        .override_origin(true)
        .jitter(jitter)
        .xfetch_beta(beta)
        .stale_while_revalidate(swr)
        .build()
        .expect("a valid policy")
}

/// The release `tiercache-proxy` in front of `origin`, as a user would set
/// it up for `variant`: a config file for the policy (the origin's
/// lifetime, overriding what the origin says, and the variant's knobs),
/// flags for the rest, and the two runtime workers the layer's process has.
fn spawn_proxy(
    bin: &Path,
    dir: &Path,
    variant: &str,
    origin: SocketAddr,
    flags: &[&str],
) -> Server {
    let (jitter, beta, swr) = knobs(variant);
    let port = free_port();
    let config = dir.join(format!("proxy-{port}.toml"));
    let toml = format!(
        "[defaults]\nttl = \"{}ms\"\noverride_origin = true\njitter = {jitter:.3}\n\
         xfetch_beta = {beta:.3}\nstale_while_revalidate = \"{}ms\"\n",
        LIFETIME.as_millis(),
        swr.as_millis(),
    );
    std::fs::write(&config, toml).expect("write the proxy's config");
    let config = config.to_str().expect("a UTF-8 path");
    let flags: Vec<&str> = ["--config", config]
        .into_iter()
        .chain(flags.iter().copied())
        .collect();
    procs::spawn_proxy(bin, origin, port, 2, &flags)
}

fn serve(mode: &str) {
    let port: u16 = std::env::var("PORT").unwrap().parse().unwrap();
    let variant = std::env::var("VARIANT").unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        match mode {
            "layer" => {
                let engine = tiercache::TieredCache::builder().build().unwrap();
                let cache = tiercache::ResponseCacheLayer::new(engine);
                let (work, record) = origin_routes();
                let app = work
                    .layer(cache.route(policy(&variant)).unwrap())
                    .merge(record);
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, app).await.unwrap();
            }
            _ => {
                let (work, record) = origin_routes();
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, work.merge(record)).await.unwrap();
            }
        }
    });
}

/// As its experts run it: a worker per core, the lock, stale answers while
/// one request updates.
fn nginx(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    procs::nginx(
        dir,
        origin,
        "auto",
        "keys_zone=c:64m max_size=1g inactive=10m",
        "proxy_cache_lock on; proxy_cache_lock_timeout 10s; \
         proxy_cache_use_stale updating error timeout; proxy_cache_background_update on;",
    )
}

/// Its default VCL: the origin's max-age, and a grace of 10 s in which a
/// stale object is answered while one fetch refreshes it. Thread pools for
/// two cores and a few hundred connections.
fn varnish(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    procs::varnish(
        dir,
        origin,
        "malloc,1g",
        &[
            "thread_pools=2",
            "thread_pool_min=100",
            "thread_pool_max=2000",
        ],
    )
}
