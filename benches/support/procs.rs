//! Server processes for the benches over real sockets (`benches/http.rs`,
//! `benches/workload.rs`): spawned in their own process group, waited for,
//! measured (CPU), and killed on drop; and the tools they need.

#![allow(dead_code)] // each bench uses its own part

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process (and its children), stopped on drop.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
}

impl Server {
    /// This bench binary again, serving `mode` on `port` (the bench's
    /// `main` reads `TIERCACHE_BENCH_SERVE`, `PORT` and `env`).
    pub(crate) fn spawn_self(mode: &str, port: u16, env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env("TIERCACHE_BENCH_SERVE", mode)
            .env("PORT", port.to_string())
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::wait(
            own_group(&mut cmd).spawn().expect("spawn a bench server"),
            port,
        )
    }

    /// Waits until `port` accepts connections; a server that exits first
    /// (a refused flag or config: its reason is on the inherited stderr)
    /// fails the bench at once, not after the wait.
    pub(crate) fn wait(mut child: Child, port: u16) -> Self {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        for _ in 0..500 {
            if TcpStream::connect(addr).is_ok() {
                return Self { child, addr };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("a bench server exited before listening on {addr} ({status})");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("a bench server did not listen on {addr}");
    }

    /// `utime + stime` of the process and every descendant.
    pub(crate) fn cpu(&self) -> Duration {
        let tick = 100.0; // USER_HZ on Linux
        let mut total = 0u64;
        for pid in descendants(self.child.id()) {
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split(' ').collect();
                total += fields[12].parse::<u64>().unwrap() + fields[13].parse::<u64>().unwrap();
            }
        }
        Duration::from_secs_f64(total as f64 / tick)
    }

    /// Pins the process and every descendant's threads to `cpu` (with
    /// `taskset`), so a load generator pinned to another core never shares
    /// one with it; false when `taskset` is missing or refused.
    pub(crate) fn pin(&self, cpu: usize) -> bool {
        let cpu = cpu.to_string();
        descendants(self.child.id()).iter().all(|pid| {
            Command::new("taskset")
                .args(["-a", "-p", "-c", &cpu, &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Each server leads its own process group: the group goes at once,
        // workers and helpers started late included.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-9", "--", &group]).status();
        let _ = self.child.wait();
    }
}

fn descendants(root: u32) -> Vec<u32> {
    let mut parents: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            && let Some((_, rest)) = stat.rsplit_once(')')
            && let Some(ppid) = rest.split(' ').nth(2).and_then(|p| p.parse().ok())
        {
            parents.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        out.extend(parents.get(&out[i]).cloned().unwrap_or_default());
        i += 1;
    }
    out
}

pub(crate) fn own_group(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0)
}

pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// As root, installs what is missing from Debian (once; quietly): `wants`
/// is `(binary, package)` pairs.
pub(crate) fn provision(wants: &[(&str, &str)]) {
    let missing: Vec<&str> = wants
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if missing.is_empty() || !root {
        return;
    }
    println!("installing {missing:?} from Debian…");
    let started = Instant::now();
    let _ = Command::new("apt-get").args(["update", "-qq"]).status();
    let _ = Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status();
    println!("… done in {:.0} s", started.elapsed().as_secs_f64());
}

/// Builds `benches/peers` (its own workspace and lock file, so the peers'
/// dependency trees stay out of every test build); the binary's path.
pub(crate) fn build_peers() -> Result<PathBuf, String> {
    println!("building the Rust peers (benches/peers)…");
    let target = cargo_release("benches/peers/Cargo.toml", None, "bench-peers")?;
    Ok(target.join("release/bench-peer"))
}

/// Builds the release `tiercache-proxy` binary, the one users run (its
/// allocator and runtime included); its path.
pub(crate) fn build_proxy() -> Result<PathBuf, String> {
    println!("building the release tiercache-proxy…");
    let target = cargo_release("Cargo.toml", Some("tiercache-proxy"), "bench-proxy")?;
    Ok(target.join("release/tiercache-proxy"))
}

/// The release `tiercache-proxy` (`bin`) in front of `origin`, listening
/// on `port`, with `workers` runtime workers (`TOKIO_WORKER_THREADS`) and
/// `flags` after its `--upstream` and `--listen`.
pub(crate) fn spawn_proxy(
    bin: &Path,
    origin: SocketAddr,
    port: u16,
    workers: usize,
    flags: &[&str],
) -> Server {
    let mut cmd = Command::new(bin);
    cmd.arg("--upstream")
        .arg(format!("http://{origin}"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(flags)
        .env("TOKIO_WORKER_THREADS", workers.to_string())
        .stdout(Stdio::null());
    Server::wait(
        own_group(&mut cmd).spawn().expect("spawn tiercache-proxy"),
        port,
    )
}

/// `cargo build --release` of `manifest` (relative to the workspace root),
/// optionally one `package` of it, into a target folder of its own named
/// `folder`: the running `cargo bench` holds the workspace's own. Returns
/// that target folder.
fn cargo_release(manifest: &str, package: Option<&str>, folder: &str) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = tiercache_testkit::valkey::target_dir().join(folder);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--locked",
        "--quiet",
        "--manifest-path",
    ])
    .arg(root.join(manifest))
    .env("CARGO_TARGET_DIR", &target);
    if let Some(package) = package {
        cmd.args(["-p", package]);
    }
    let status = cmd.status().map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of {manifest} failed ({status})"));
    }
    Ok(target)
}

/// nginx caching in front of `origin`, its files in `dir`: `workers` is its
/// `worker_processes`, `zone` the `proxy_cache_path` parameters after the
/// path and levels, `cache` the cache directives of its one location.
/// Keep-alive both ways, with no limit on a client connection's requests
/// (its default closes one every 1,000).
pub(crate) fn nginx(
    dir: &Path,
    origin: SocketAddr,
    workers: &str,
    zone: &str,
    cache: &str,
) -> Result<Server, String> {
    let bin = which("nginx").ok_or("not installed (apt-get install nginx)")?;
    std::fs::create_dir_all(dir.join("cache")).map_err(|e| e.to_string())?;
    let port = tiercache_testkit::valkey::free_port();
    let d = dir.display();
    let conf = format!(
        "worker_processes {workers}; daemon off; user root; pid {d}/nginx.pid; error_log {d}/error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  proxy_cache_path {d}/cache levels=1:2 {zone};
  upstream origin {{ server {origin}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 10000000;
    location / {{
      proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\";
      proxy_cache c; {cache}
    }}
  }}
}}
"
    );
    std::fs::write(dir.join("nginx.conf"), conf).map_err(|e| e.to_string())?;
    let child = own_group(&mut Command::new(bin))
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    Ok(Server::wait(child, port))
}

/// Varnish in front of `origin` with its default VCL, its files in `dir`:
/// `storage` for `-s`, `params` each a `-p` parameter.
pub(crate) fn varnish(
    dir: &Path,
    origin: SocketAddr,
    storage: &str,
    params: &[&str],
) -> Result<Server, String> {
    let bin = which("varnishd").ok_or("not installed (apt-get install varnish)")?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let port = tiercache_testkit::valkey::free_port();
    let mut cmd = Command::new(bin);
    cmd.args(["-F", "-a", &format!("127.0.0.1:{port}")]).args([
        "-b",
        &origin.to_string(),
        "-s",
        storage,
    ]);
    for param in params {
        cmd.args(["-p", param]);
    }
    let child = own_group(cmd.arg("-n").arg(dir))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    Ok(Server::wait(child, port))
}

/// One `GET` on its own connection; the body as text.
pub(crate) fn get_text(addr: SocketAddr, path: &str) -> String {
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
