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
//! `benches/peers`' binary, nginx or varnishd), all on loopback. The same
//! origin (`benches/support/origin.rs`: axum, a 2 KiB body,
//! `Cache-Control: public, max-age=3600`) is behind every cache:
//!
//! - `bare`: the origin itself, the limit on this machine;
//! - `layer`: the same handler wrapped in the tiercache layer (L1 hits);
//! - `proxy`: `tiercache-proxy` in front of the origin (L1 hits);
//! - the Rust crates a user might pick instead, each wrapping the same
//!   handler in its own process: `axum-response-cache` 0.5, `hitbox` 0.2,
//!   `tower-http-cache` 0.6 and `http-cache-tower-server` 0.2, set up as
//!   `benches/peers/src/main.rs` says (its own workspace and lock file, built
//!   by this bench on its first run, a few minutes; if it cannot be built
//!   the peers are skipped and the report says so);
//! - `nginx`: `proxy_cache` with `proxy_cache_lock on`, one worker;
//! - `varnish`: `varnishd` with the default VCL, `-s malloc,256m`.
//!
//! Throughput: `wrk -t1 -c32 -d4s` per target, three alternating rounds
//! (A B C … A B C …); server CPU per request is the server's `utime+stime`
//! (all its processes) over the requests wrk made. The report gives each
//! target's median req/s and CPU µs/request and their ratios to `bare`.
//!
//! Stampede: 1,000 connections are opened first, then each sends one GET for
//! the same cold URL at once; the origin takes 300 ms and counts calls.
//!
//! Last measured (2 cores, shared machine, 2026-12-03; nginx 1.22, Varnish
//! 7.1 from Debian 12), req/s × bare / CPU per request × bare, four runs
//! (bare 90,134 / 80,179 / 92,313 / 78,163 req/s, 11.0 / 12.3 / 10.6 / 12.6
//! µs): layer 0.85 / 1.17, 0.83 / 1.22, 0.84 / 1.20, 0.87 / 1.16;
//! tiercache-proxy 0.83 / 1.21, 0.84 / 1.18, 0.73 / 1.39, 0.89 / 1.13;
//! axum-response-cache 0.81 / 1.20, 0.88 / 1.13, 0.76 / 1.32, 0.96 / 1.04;
//! hitbox 0.55 / 1.81, 0.64 / 1.57, 0.50 / 1.99, 0.58 / 1.73;
//! tower-http-cache 0.64 / 1.55, 0.63 / 1.58, 0.62 / 1.64, 0.65 / 1.53;
//! http-cache-tower-server 0.13 / 8.01, 0.14 / 6.96, 0.13 / 7.99, 0.15 /
//! 6.94; nginx 0.57 / 1.75, 0.65 / 1.54, 0.59 / 1.70, 0.59 / 1.70; Varnish
//! 0.51 / 2.48, 0.56 / 2.29, 0.50 / 2.52, 0.54 / 2.38. 1,000 concurrent
//! cold requests, in every run: one origin call each for layer, proxy,
//! hitbox, tower-http-cache, nginx and Varnish; 1,000 for
//! axum-response-cache and http-cache-tower-server (neither coalesces);
//! none failed.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "support/origin.rs"]
mod origin;
#[path = "support/procs.rs"]
mod procs;

use procs::{Server, own_group, which};

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
    let mut targets: Vec<(&str, Server)> = vec![
        ("bare", Server::spawn_self("origin", free_port(), &[])),
        ("layer", Server::spawn_self("layer", free_port(), &[])),
        (
            "proxy",
            Server::spawn_self(
                "proxy",
                free_port(),
                &[("UPSTREAM", origin.addr.to_string())],
            ),
        ),
    ];
    let mut skipped = Vec::new();
    match build_peers() {
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
            get(t.addr, "/p/7");
        }
    }
    let mut results: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for _round in 0..3 {
        for (name, t) in &targets {
            let before = t.cpu();
            let (reqs, rps) = wrk(t.addr, "/p/7");
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
    let mut bare_rps: Vec<f64> = results["bare"].iter().map(|r| r.0).collect();
    let mut bare_cpu: Vec<f64> = results["bare"].iter().map(|r| r.1).collect();
    let (bare_rps, bare_cpu) = (median(&mut bare_rps), median(&mut bare_cpu));
    println!("== hit throughput, 2 KiB body, wrk -t1 -c32 -d4s, median of 3 alternating rounds");
    println!(
        "{:<24} {:>10} {:>8} {:>14} {:>8}",
        "target", "req/s", "× bare", "CPU µs/req", "× bare"
    );
    for (name, _) in &targets {
        let mut rps: Vec<f64> = results[name].iter().map(|r| r.0).collect();
        let mut cpu: Vec<f64> = results[name].iter().map(|r| r.1).collect();
        let (rps, cpu) = (median(&mut rps), median(&mut cpu));
        println!(
            "{name:<24} {rps:>10.0} {:>8.2} {cpu:>14.1} {:>8.2}",
            rps / bare_rps,
            cpu / bare_cpu
        );
    }

    println!("== origin calls for 1,000 concurrent cold requests (origin 300 ms)");
    for (i, (name, t)) in targets.iter().enumerate().skip(1) {
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
            "proxy" => {
                let upstream = std::env::var("UPSTREAM").unwrap();
                let config = tiercache_proxy::ProxyConfig::new(
                    format!("http://{upstream}").parse().unwrap(),
                )
                .listen(addr);
                let proxy = tiercache_proxy::Proxy::start(config).await.unwrap();
                proxy.wait().await;
            }
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
            _ => {
                let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
                axum::serve(listener, origin_app()).await.unwrap();
            }
        }
    });
}

/// The whole origin: its cacheable routes and `/count`.
fn origin_app() -> axum::Router {
    let (cacheable, count) = origin::origin();
    cacheable.merge(count)
}

fn nginx(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    let bin = which("nginx").ok_or("not installed (apt-get install nginx)")?;
    let dir = dir.join("nginx");
    std::fs::create_dir_all(dir.join("cache")).map_err(|e| e.to_string())?;
    let port = free_port();
    let d = dir.display();
    let conf = format!(
        "worker_processes 1; daemon off; user root; pid {d}/nginx.pid; error_log {d}/error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  proxy_cache_path {d}/cache levels=1:2 keys_zone=c:10m max_size=256m;
  upstream origin {{ server {origin}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\";
      proxy_cache c; proxy_cache_valid 200 1h; proxy_cache_lock on; proxy_cache_lock_timeout 10s;
    }}
  }}
}}
"
    );
    std::fs::write(dir.join("nginx.conf"), conf).map_err(|e| e.to_string())?;
    let child = own_group(&mut Command::new(bin))
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    Ok(Server::wait(child, port))
}

fn varnish(dir: &Path, origin: SocketAddr) -> Result<Server, String> {
    let bin = which("varnishd").ok_or("not installed (apt-get install varnish)")?;
    let dir = dir.join("varnish");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let port = free_port();
    let child = own_group(&mut Command::new(bin))
        .args([
            "-F",
            "-a",
            &format!("127.0.0.1:{port}"),
            "-b",
            &origin.to_string(),
        ])
        .args(["-s", "malloc,256m", "-n"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    Ok(Server::wait(child, port))
}

// ------------------------------------------------------------------ clients

fn wrk(addr: SocketAddr, path: &str) -> (u64, f64) {
    let out = Command::new("wrk")
        .args(["-t1", "-c32", "-d4s"])
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

/// One GET; the body as text.
fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: bench.test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// The `/slow` calls an origin counted (a fresh query each time: a cache in
/// front that ignores `no-store` must not answer it).
fn origin_calls(addr: SocketAddr) -> usize {
    let fresh = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    get(addr, &format!("/count?at={fresh}"))
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Builds `benches/peers` (its own workspace and lock file, so the peers'
/// dependency trees stay out of every test build); the binary's path.
fn build_peers() -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = tiercache_testkit::valkey::target_dir().join("bench-peers");
    println!("building the Rust peers (benches/peers)…");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--locked",
            "--quiet",
            "--manifest-path",
        ])
        .arg(root.join("benches/peers/Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of benches/peers failed ({status})"));
    }
    Ok(target.join("release/bench-peer"))
}
