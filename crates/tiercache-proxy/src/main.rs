//! The `tiercache-proxy` command.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tiercache_proxy::units::{parse_duration, parse_size};
use tiercache_proxy::{Proxy, ProxyConfig};

/// A caching reverse proxy (tiercache) in front of one HTTP origin.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The origin: http://HOST:PORT.
    #[arg(long)]
    upstream: http::Uri,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Fresh lifetime of responses without explicit freshness (ms, s, m, h).
    /// Without it only responses whose origin declares freshness are stored.
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// Jitter fraction: each fill lives ttl ± ttl·jitter (0.0..=0.5).
    #[arg(long, default_value_t = 0.1)]
    jitter: f64,
    /// Largest body stored (bytes, KiB, MiB, GiB); larger ones stream through unstored.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    max_body: u64,
    /// L1 byte budget (bytes, KiB, MiB, GiB).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    l1_capacity: u64,
    /// Valkey as the shared L2: redis://[user:password@]host:port[/db], rediss:// for TLS.
    #[arg(long)]
    valkey: Option<String>,
    /// Serve an expired entry for this long while one background refresh runs.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    stale_while_revalidate: Duration,
    /// Serve an expired entry for this long when the origin fails (5xx, error, soft timeout).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    stale_if_error: Duration,
    /// Lifetime of 404 and 410 responses without explicit freshness (default 5s, at most --ttl).
    #[arg(long, value_parser = parse_duration)]
    negative_ttl: Option<Duration>,
    /// With a stale entry at hand, answer it once the origin has taken this long.
    #[arg(long, value_parser = parse_duration)]
    origin_soft_timeout: Option<Duration>,
    /// XFetch β: refresh hot keys early, probabilistically (0 disables).
    #[arg(long, default_value_t = 1.0)]
    xfetch_beta: f64,
    /// Drop request cookies (the origin never sees them) instead of bypassing the cache.
    #[arg(long)]
    ignore_cookies: bool,
    /// Key on this cookie (repeatable); the origin then sees only the keyed cookies.
    #[arg(long = "key-cookie", value_name = "NAME")]
    key_cookies: Vec<String>,
    /// Key on this request header and send it on (repeatable), e.g. x-forwarded-proto.
    #[arg(long = "key-header", value_name = "NAME")]
    key_headers: Vec<String>,
    /// Obey this targeted cache-control field (RFC 9213; repeatable, most specific first).
    #[arg(long = "target", value_name = "FIELD")]
    targets: Vec<String>,
    /// Longest a 4xx/5xx with explicit freshness is stored.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    max_error_ttl: Duration,
    /// Let a client's Cache-Control: no-cache / max-age=0 force a trip to the origin.
    #[arg(long)]
    honor_client_no_cache: bool,
    /// How long a request waits on another's origin load for the same key
    /// (in this process, or another instance's on the shared Valkey), and
    /// how long a fleet-wide fill lock lives if its owner dies.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lock_timeout: Duration,
    /// Admin address serving GET /stats and POST /invalidate?key=URL|tag=T|prefix=PATH.
    #[arg(long)]
    admin: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let mut config = ProxyConfig::new(args.upstream)
        .listen(args.listen)
        .jitter(args.jitter)
        .max_body(args.max_body);
    config.ttl = args.ttl;
    config.l1_capacity = args.l1_capacity;
    config.ignore_cookies = args.ignore_cookies;
    config.key_cookies = args.key_cookies;
    config.key_headers = args.key_headers;
    config.targets = args.targets;
    config.max_error_ttl = args.max_error_ttl;
    config.honor_client_no_cache = args.honor_client_no_cache;
    config.stale_while_revalidate = args.stale_while_revalidate;
    config.stale_if_error = args.stale_if_error;
    config.negative_ttl = args.negative_ttl;
    config.origin_soft_timeout = args.origin_soft_timeout;
    config.xfetch_beta = args.xfetch_beta;
    config.lock_timeout = args.lock_timeout;
    if let Some(url) = args.valkey {
        config = config.valkey(url);
    }
    if let Some(admin) = args.admin {
        config = config.admin(admin);
    }
    match Proxy::start(config).await {
        Ok(proxy) => {
            eprintln!(
                "tiercache-proxy listening on http://{}{}",
                proxy.addr(),
                proxy
                    .admin_addr()
                    .map(|a| format!(", admin on http://{a}"))
                    .unwrap_or_default()
            );
            proxy.wait().await;
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tiercache-proxy: {e}");
            ExitCode::from(2)
        }
    }
}
