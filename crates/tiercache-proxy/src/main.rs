//! The `tiercache-proxy` command.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use tiercache_proxy::units::{parse_duration, parse_size};
use tiercache_proxy::{Proxy, ProxyConfig, config_file};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// mimalloc, not glibc's malloc. Flooded with unique 1 KiB URLs at the
/// default 256 MiB budget (release build, from a cold start), the proxy's
/// RSS grew 1.16x the budget under glibc (freed memory stays resident in
/// its arenas as entries churn) and 0.99x under mimalloc; with 64 KiB bodies
/// glibc's per-thread arenas held 1.21-1.30x (`tests/memory.rs`: 0.96-1.11x
/// now). jemalloc did as well at 256 MiB but needs `make` to build.
/// Built with `no_thp`: mimalloc otherwise advises transparent huge pages
/// for its arenas, and a 2 MiB page stays resident while any block in it
/// lives (a cold 32 MiB flood held 1.43-1.53x the budget, 1.20-1.22x without).
/// Now that bodies of 16 KiB and more sit in page mappings of their own,
/// glibc's malloc held to one arena (`MALLOC_ARENA_MAX=1`) keeps the least
/// slack of all (a cold 32 MiB flood of 16 / 64 KiB bodies: 1.11x / 1.17x,
/// mimalloc 1.18-1.21x / 1.24-1.30x) but serialises allocation across
/// cores: build with `--no-default-features` and set the variable for it.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A caching reverse proxy (tiercache) in front of one HTTP origin.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The origin: http://HOST:PORT (or `upstream` in the config file).
    #[arg(long)]
    upstream: Option<http::Uri>,
    /// A TOML config file: the same settings, `[defaults]` and per-path
    /// `[[route]]` rules; flags given on the command line override it.
    /// `SIGHUP` reloads its routes and the admin token.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Validate the config file (and flags) and exit.
    #[arg(long)]
    check_config: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Fresh lifetime of responses without explicit freshness (ms, s, m, h, d).
    /// Without it only responses whose origin declares freshness are stored.
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// Jitter fraction: each fill lives ttl ± ttl·jitter (0.0..=0.5).
    #[arg(long, default_value_t = 0.1)]
    jitter: f64,
    /// Largest body stored (bytes, KiB, MiB, GiB); larger ones stream through unstored.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    max_body: u64,
    /// The cache's byte budget (bytes, KiB, MiB, GiB): L1's, less a
    /// sixteenth for the fills waiting to be written to Valkey when it is on.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    l1_capacity: u64,
    /// Most background refreshes (stale-while-revalidate, XFetch) at once;
    /// keep it below the upstream's own concurrency.
    #[arg(long, default_value_t = tiercache_core::TieredCacheBuilder::DEFAULT_MAX_REFRESHES)]
    max_refreshes: usize,
    /// Valkey as the shared L2: redis://[user:password@]host:port[/db], rediss:// for TLS.
    #[arg(long)]
    valkey: Option<String>,
    /// How long one Valkey command may take before the request goes on
    /// without it (to the origin, or without its L2 write); also the fleet
    /// lock's. Valkey slow holds a miss about twice this at most (its L2
    /// read, then its fleet lock attempt), an L1 hit not at all (but while
    /// its subscription is lost, when an L1 hit reads Valkey: until the
    /// breaker opens); a miss already waiting on another instance's fill
    /// lock, about 0.5 s more (its re-checks must fail that long)
    /// [default: 50ms]
    #[arg(long, value_parser = parse_duration)]
    valkey_timeout: Option<Duration>,
    /// How long the upstream may take to start its answer before the proxy
    /// answers 504 itself (stale-if-error applies), and may then go quiet
    /// within its body before the body is cut [default: 60s]
    #[arg(long, value_parser = parse_duration)]
    origin_timeout: Option<Duration>,
    /// Most requests at the upstream at once (so connections in use),
    /// background refreshes included; a request waits for a slot at most
    /// the origin timeout, then is answered 503 [default: no cap]
    #[arg(long, value_name = "N")]
    upstream_max_connections: Option<usize>,
    /// How long an idle connection to the upstream is kept for the next
    /// request (0: none kept); an upstream's own `Keep-Alive: timeout=N`
    /// (Node, Apache) is honoured, for others keep it below theirs
    /// (gunicorn 2s, uvicorn 5s) [default: 60s]
    #[arg(long, value_parser = parse_duration)]
    upstream_idle_timeout: Option<Duration>,
    /// How long a client may take to send a request's head, leave a
    /// keep-alive connection idle, or leave a response unread, before it is
    /// closed; keep it above the
    /// idle timeout of a load balancer in front [default: 75s]
    #[arg(long, value_parser = parse_duration)]
    client_timeout: Option<Duration>,
    /// Most client connections open at once; past it a new one waits in the
    /// kernel's backlog until one closes [default: 10000]
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Most requests in flight at once (waiting on the upstream, Valkey or
    /// another's load; an L1 hit only until handed over); past it a request is
    /// answered from L1 or 503 at once, with Retry-After: 1 [default: 10000]
    #[arg(long, value_name = "N")]
    max_requests_in_flight: Option<usize>,
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
    /// Key every request on this host[:port] (and send it as Host), for a
    /// site reached by several names or ports, or a fleet on different ports.
    #[arg(long, value_name = "HOST[:PORT]")]
    canonical_authority: Option<String>,
    /// How long a request waits on another's origin load for the same key
    /// (in this process, or another instance's on the shared Valkey), and
    /// how long a fleet-wide fill lock lives if its owner dies; from the
    /// upstream's head or its body's last bytes (four times this from the
    /// start at most), in this process and across the fleet.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lock_timeout: Duration,
    /// Admin address serving GET /stats and POST /invalidate?key=URL|tag=T|prefix=PATH
    /// (the latter for loopback clients only, unless TIERCACHE_ADMIN_TOKEN
    /// sets the bearer token it asks for).
    #[arg(long)]
    admin: Option<SocketAddr>,
}

/// The settings: the config file's, with the flags given on the command
/// line laid over them (a flag left at its default does not override).
fn settings(args: &Args, matches: &ArgMatches) -> Result<ProxyConfig, String> {
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let (mut config, has_upstream) = match &args.config {
        Some(path) => {
            let file = config_file::load(path).map_err(|e| e.to_string())?;
            (file.config, file.has_upstream)
        }
        None => (
            ProxyConfig::new(http::Uri::from_static("http://127.0.0.1:80")),
            false,
        ),
    };
    match (&args.upstream, has_upstream) {
        (Some(upstream), _) => config.upstream = upstream.clone(),
        (None, true) => {}
        (None, false) => {
            return Err(
                "give the origin with --upstream http://HOST:PORT (or `upstream` in --config)"
                    .into(),
            );
        }
    }
    let file = args.config.is_some();
    // Without a file, every flag applies (its default included).
    let set = |id: &str| !file || given(id);
    if set("listen") {
        config.listen = args.listen;
    }
    if set("ttl") && (args.ttl.is_some() || !file) {
        config.ttl = args.ttl;
    }
    if set("jitter") {
        config.jitter = args.jitter;
    }
    if set("max_body") {
        config.max_body = args.max_body;
    }
    if set("l1_capacity") {
        config.l1_capacity = args.l1_capacity;
    }
    if set("max_refreshes") {
        config.max_refreshes = args.max_refreshes;
    }
    // One cookie mode: a flag replaces the file's, whichever it names.
    config.set_cookie_mode(
        set("ignore_cookies").then_some(args.ignore_cookies),
        set("key_cookies").then(|| args.key_cookies.clone()),
    );
    if set("key_headers") {
        config.key_headers = args.key_headers.clone();
    }
    if set("targets") {
        config.targets = args.targets.clone();
    }
    if set("max_error_ttl") {
        config.max_error_ttl = args.max_error_ttl;
    }
    if set("honor_client_no_cache") {
        config.honor_client_no_cache = args.honor_client_no_cache;
    }
    if set("canonical_authority") {
        config.canonical_authority = args.canonical_authority.clone();
    }
    if set("stale_while_revalidate") {
        config.stale_while_revalidate = args.stale_while_revalidate;
    }
    if set("stale_if_error") {
        config.stale_if_error = args.stale_if_error;
    }
    if set("negative_ttl") && (args.negative_ttl.is_some() || !file) {
        config.negative_ttl = args.negative_ttl;
    }
    if set("origin_soft_timeout") && (args.origin_soft_timeout.is_some() || !file) {
        config.origin_soft_timeout = args.origin_soft_timeout;
    }
    if set("xfetch_beta") {
        config.xfetch_beta = args.xfetch_beta;
    }
    if set("lock_timeout") {
        config.lock_timeout = args.lock_timeout;
    }
    if let Some(url) = &args.valkey {
        config.valkey = Some(url.clone());
    }
    if let Some(timeout) = args.valkey_timeout {
        config.valkey_timeout = timeout;
    }
    if let Some(timeout) = args.client_timeout {
        config.client_timeout = timeout;
    }
    if let Some(n) = args.max_connections {
        config.max_connections = n;
    }
    if let Some(n) = args.max_requests_in_flight {
        config.max_requests_in_flight = n;
    }
    if let Some(timeout) = args.origin_timeout {
        config.origin_timeout = timeout;
    }
    if let Some(n) = args.upstream_max_connections {
        config.upstream_max_connections = Some(n);
    }
    if let Some(idle) = args.upstream_idle_timeout {
        config.upstream_idle_timeout = idle;
    }
    if let Some(admin) = args.admin {
        config.admin = Some(admin);
    }
    // From the environment, never a flag (a command line is seen by every
    // user of the machine); over the config file's.
    if let Some(token) = std::env::var_os("TIERCACHE_ADMIN_TOKEN") {
        let token = token
            .into_string()
            .map_err(|_| "`TIERCACHE_ADMIN_TOKEN`: not valid UTF-8".to_owned())?;
        config.admin_token =
            Some(tiercache_proxy::AdminToken::new(token).map_err(|e| e.to_string())?);
    }
    config.check().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Said at start, and on a reload, when the admin address is not a
/// loopback one and no token is set.
const LOOPBACK_ONLY: &str = "tiercache-proxy: POST /invalidate on the admin address answers loopback clients only; set TIERCACHE_ADMIN_TOKEN to let others invalidate with it";

fn main() -> ExitCode {
    #[cfg(all(feature = "mimalloc", unix))]
    let restart_failed = match tiercache_proxy::give_back::purge_promptly() {
        Some(e) => {
            eprintln!(
                "tiercache-proxy: could not start again with {}=0 ({e}): freed memory goes \
                 back to the system a second late",
                tiercache_proxy::give_back::PURGE_DELAY
            );
            true
        }
        None => false,
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    // mimalloc keeps what a burst freed until each thread allocates again:
    // see `give_back`.
    #[cfg(feature = "mimalloc")]
    runtime.on_thread_park(tiercache_proxy::give_back::on_thread_park);
    match runtime.build() {
        Ok(runtime) => runtime.block_on(async {
            // std's `exec` set SIGPIPE back to its default for the program
            // it failed to start: ignored again, as Rust's start had it.
            #[cfg(all(feature = "mimalloc", unix))]
            if restart_failed && let Err(e) = tiercache_proxy::give_back::ignore_sigpipe() {
                eprintln!("tiercache-proxy: cannot ignore SIGPIPE: {e}");
            }
            run().await
        }),
        Err(e) => {
            eprintln!("tiercache-proxy: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> ExitCode {
    #[cfg(feature = "mimalloc")]
    tokio::spawn(tiercache_proxy::give_back::watch());
    let matches = Args::command().get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    let config = match settings(&args, &matches) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tiercache-proxy: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        eprintln!(
            "tiercache-proxy: the configuration is valid ({} route{})",
            config.routes.len(),
            if config.routes.len() == 1 { "" } else { "s" }
        );
        return ExitCode::SUCCESS;
    }
    // Before the port opens: a signal that comes as it does must find its
    // handler, not the default (which ends the process).
    let signals = Signals::install();
    let config_has_no_token = config.admin_token.is_none();
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
            if proxy.admin_addr().is_some_and(|a| !a.ip().is_loopback()) && config_has_no_token {
                eprintln!("{LOOPBACK_ONLY}");
            }
            let Signals {
                terminate,
                interrupt,
                hangup,
            } = signals;
            if args.config.is_some() {
                reload_on_sighup(hangup, args, matches, proxy.reloader());
            } else {
                nothing_to_reload_on_sighup(hangup);
            }
            let left = proxy
                .serve_until(terminated(terminate, interrupt), DRAIN)
                .await;
            if left.invalidations > 0 {
                eprintln!(
                    "tiercache-proxy: {} invalidations never reached Valkey (out of reach for the whole drain): other instances may answer what they cover from L2 until it expires; purge those URLs once Valkey is back",
                    left.invalidations
                );
            }
            eprintln!("tiercache-proxy: stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tiercache-proxy: {e}");
            ExitCode::from(2)
        }
    }
}

/// How long a stop waits for the requests in flight (and for Valkey to hear
/// what is queued for it) before the process exits anyway.
const DRAIN: Duration = Duration::from_secs(20);

/// The signals the proxy handles, each `None` where no handler could be
/// installed (its default stays).
struct Signals {
    terminate: Option<Signal>,
    interrupt: Option<Signal>,
    hangup: Option<Signal>,
}

impl Signals {
    fn install() -> Self {
        Self {
            terminate: signal(SignalKind::terminate()).ok(),
            interrupt: signal(SignalKind::interrupt()).ok(),
            hangup: signal(SignalKind::hangup()).ok(),
        }
    }
}

/// Completes on `SIGTERM` (a rolling update, `systemctl stop`) or `SIGINT`;
/// a second one while draining ends the process at once.
async fn terminated(term: Option<Signal>, int: Option<Signal>) {
    let (Some(mut term), Some(mut int)) = (term, int) else {
        // No handler: the signal's default (the process ends) stays.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    eprintln!("tiercache-proxy: stopping, draining for up to {DRAIN:?} (again to stop at once)");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("tiercache-proxy: stopped without draining");
        std::process::exit(1);
    });
}

/// Without a config file `SIGHUP` has nothing to reload: said, and no more
/// (its default would end the process).
fn nothing_to_reload_on_sighup(hangups: Option<Signal>) {
    let Some(mut hangups) = hangups else {
        return;
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            eprintln!("tiercache-proxy: SIGHUP: nothing to reload (no --config file)");
        }
    });
}

/// On `SIGHUP`, reads the config file again and replaces the routes and
/// the admin token (L1, L2 and the connections stay); a bad file keeps
/// what is in force.
fn reload_on_sighup(
    hangups: Option<Signal>,
    args: Args,
    matches: ArgMatches,
    reloader: tiercache_proxy::Reloader,
) {
    let Some(mut hangups) = hangups else {
        return;
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            match settings(&args, &matches).and_then(|c| {
                let kept = reloader.reload(&c).map_err(|e| e.to_string())?;
                if c.admin.is_some_and(|a| !a.ip().is_loopback()) && c.admin_token.is_none() {
                    eprintln!("{LOOPBACK_ONLY}");
                }
                Ok((c.routes.len(), kept))
            }) {
                Ok((n, kept)) if kept.is_empty() => {
                    eprintln!("tiercache-proxy: reloaded, {n} routes")
                }
                Ok((n, kept)) => eprintln!(
                    "tiercache-proxy: reloaded, {n} routes; changed but read only at start, \
                     in force after a restart: {}",
                    kept.join(", ")
                ),
                Err(e) => eprintln!(
                    "tiercache-proxy: reload refused, the routes and admin token in force stay: {e}"
                ),
            }
        }
    });
}
