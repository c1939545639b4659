//! `tiercache-proxy`: a caching reverse proxy built from the tiercache layer.
//!
//! ```text
//! tiercache-proxy --upstream http://127.0.0.1:9000 [--listen 127.0.0.1:8080] [--ttl 10s]
//!                 [--jitter 0.1] [--max-body 8MiB] [--admin 127.0.0.1:8081]
//!                 [--valkey redis://127.0.0.1:6379] [--valkey-timeout 50ms]
//!                 [--stale-while-revalidate 30s]
//!                 [--stale-if-error 5m] [--negative-ttl 5s] [--origin-soft-timeout 500ms]
//!                 [--xfetch-beta 1.0] [--ignore-cookies | --key-cookie NAME ...]
//!                 [--key-header NAME ...] [--target cdn-cache-control ...]
//!                 [--max-error-ttl 60s] [--honor-client-no-cache] [--lock-timeout 5s]
//! ```
//!
//! Every GET and HEAD goes through the layer with its safe defaults. Without
//! `--ttl` the proxy is a standards-following shared cache: it stores only
//! responses whose origin declares freshness (`max-age`, `s-maxage`,
//! `Expires`), never guessing a lifetime; with `--ttl` other storable
//! responses get that ttl, as on an annotated route. Successful unsafe
//! requests (POST, PUT, PATCH, DELETE) invalidate their target. The admin
//! address serves the live dashboard at `/` (see `tiercache_dashboard`),
//! `GET /stats`, `GET /metrics` (Prometheus text; see
//! `tiercache_http::metrics`) and `POST /invalidate?key=URL|tag=TAG|prefix=PATH`.
//! With `--valkey`, several proxies on one Valkey (standalone, or a cluster
//! through a `redis-cluster://` URL) behave as one cache: one origin load
//! per key across them, and invalidations that reach every proxy's L1. The same proxy runs in
//! process through [`Proxy::start`]:
//!
//! ```no_run
//! use tiercache_proxy::{Proxy, ProxyConfig};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = ProxyConfig::new("http://127.0.0.1:9000".parse()?);
//! let proxy = Proxy::start(config).await?;
//! println!("proxying on {}", proxy.addr());
//! # Ok(()) }
//! ```
//!
//! This crate has no features.

mod admin;
mod config;
mod config_check;
pub mod config_file;
mod connector;
pub mod forward;
pub mod give_back;
mod host;
mod in_flight;
mod l2_log;
mod own_answers;
mod prometheus;
pub mod read_ahead;
mod reload;
mod replayed;
pub mod routes;
mod serve;
mod silences;
pub mod units;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tiercache_core::TieredCache;
use tiercache_valkey::{ValkeyError, ValkeyTier};

pub use crate::config::{AdminToken, ProxyConfig};
use crate::forward::Forward;
pub use crate::reload::Reloader;
use crate::reload::route_table;

/// What a shutdown could not hand to Valkey before its drain ran out
/// (Valkey out of reach, or slow connections that used the drain up;
/// writes are fills, whose loss costs misses only). The other instances never hear of
/// these invalidations, so they may answer what they cover from L2 until
/// it expires: purge those URLs once Valkey is back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Undelivered {
    /// Invalidations that never landed in Valkey.
    pub invalidations: u64,
    /// Writes still queued for it (fills, lock releases).
    pub writes: u64,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    /// The accept loops (main and admin): they end after `stop`.
    serving: Vec<tokio::task::JoinHandle<()>>,
    /// The rest (the metrics' upkeep).
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: tokio::sync::watch::Sender<serve::Stop>,
    /// L2, for the writes still queued when the proxy stops.
    l2: Option<ValkeyTier>,
    /// What a reload swaps (the routes, the admin's layer and token), and
    /// what it builds them from.
    reloader: Reloader,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("admin", &self.admin)
            .field("engine", &self.reloader.engine)
            .field("table", &self.reloader.table)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for routes::Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("routes", &self.routes.len())
            .finish()
    }
}

impl Proxy {
    /// Binds the listen (and admin) addresses and starts serving.
    pub async fn start(config: ProxyConfig) -> Result<Self, ProxyError> {
        config.check()?;
        // The layer's `Vary` variant lists take a 32nd of L1's budget
        // beside it: carved out of the one budget the user gave, as the
        // write queue's share is below. (Small budgets keep it all; 0 is
        // refused by the build.)
        let l1_capacity = config.l1_capacity - config.l1_capacity / 32;
        let mut builder = TieredCache::builder()
            .l1_capacity(l1_capacity)
            .max_refreshes(config.max_refreshes);
        let mut l2_tier = None;
        if let Some(valkey) = config.valkey_config()? {
            // Fills waiting to be written to L2 are copies outside L1: a
            // sixteenth of the budget holds them and L1 the rest, so a flood
            // keeps the process near the one budget the user gave.
            // (Below 16 bytes L1 keeps it all; 0 is refused by the build.)
            let queue_bytes = config.l1_capacity / 16;
            builder = builder.l1_capacity(l1_capacity - queue_bytes);
            let queue_bytes = usize::try_from(queue_bytes.max(1)).unwrap_or(usize::MAX);
            let l2 = ValkeyTier::connect(valkey.write_queue_bytes(queue_bytes))
                .await
                .map_err(valkey_error)?;
            l2_tier = Some(l2.clone());
            builder = builder.l2(l2);
        }
        let engine = builder
            .build()
            .map_err(|e| ProxyError::Config(e.to_string()))?;
        // This proxy's own Prometheus registry: the layer takes its metric
        // handles from it (several proxies in one process stay apart).
        let recorder = prometheus::recorder();
        let prometheus = recorder.handle();
        let mut forward =
            Forward::with_idle_timeout(&config.upstream, config.upstream_idle_timeout)
                .map_err(ProxyError::Config)?
                .timeout(config.origin_timeout);
        if let Some(n) = config.upstream_max_connections {
            forward = forward.max_connections(n);
        }
        let forward = forward.counting_failures(&recorder);
        let recorder: SharedRecorder = Arc::new(recorder);
        let (table, layer) = route_table(&config, &engine, &forward, &recorder)?;
        let table = Arc::new(std::sync::RwLock::new(Arc::new(table)));
        // Served as it is: an axum `Router` around it cost ~2,700
        // instructions a request (its routing, boxing the body, and the
        // `OriginalUri` it records) for a table that routes by itself.
        let app = routes::Dispatch {
            table: table.clone(),
        };
        let app = in_flight::Bounded::new(app, config.max_requests_in_flight, &*recorder);

        let (listener, addr) = bind(config.listen).await?;
        let client_timeout = config.client_timeout;
        let (stop, stopped) = tokio::sync::watch::channel(serve::Stop::Running);
        let mut serving = vec![tokio::spawn(serve::serve(
            listener,
            app,
            client_timeout,
            config.max_connections,
            stopped.clone(),
        ))];
        let mut tasks = vec![prometheus::upkeep(prometheus.clone())];
        if let Some(l2) = &l2_tier {
            tasks.push(l2_log::tell(l2.clone()));
        }

        let admin_live = Arc::new(std::sync::RwLock::new(admin::AdminLive {
            layer,
            token: config.admin_token.clone(),
        }));
        let mut admin = None;
        if let Some(admin_addr) = config.admin {
            let (listener, bound) = bind(admin_addr).await?;
            admin = Some(bound);
            let router = admin::router(admin::Admin {
                prometheus,
                live: admin_live.clone(),
            });
            serving.push(tokio::spawn(serve::serve(
                listener,
                router,
                client_timeout,
                config.max_connections,
                stopped,
            )));
        }
        Ok(Self {
            addr,
            admin,
            serving,
            tasks,
            stop,
            l2: l2_tier,
            reloader: Reloader {
                reloading: Default::default(),
                table,
                admin_live,
                engine,
                forward,
                recorder,
                started: Arc::new(config),
            },
        })
    }

    /// Replaces the routes and the admin token with `config`'s (a reload:
    /// L1, L2 and the open connections are kept; the settings read once at
    /// start are not re-read). On an error what is in force stays. The names of
    /// `config`'s settings left unapplied until a restart (see
    /// [`ProxyConfig::kept_until_restart`]).
    pub fn reload(&self, config: &ProxyConfig) -> Result<Vec<&'static str>, ProxyError> {
        self.reloader().reload(config)
    }

    /// A handle that reloads the routes and the admin token from another
    /// task (on `SIGHUP`).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// The proxy's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin endpoint's bound address, if any.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// The engine behind the proxy.
    pub fn engine(&self) -> &TieredCache {
        &self.reloader.engine
    }

    /// Serves until the process is stopped.
    pub async fn wait(mut self) {
        for task in self.serving.drain(..) {
            let _ = task.await;
        }
    }

    /// Serves until `signal` completes, then [`shutdown`](Self::shutdown)s.
    pub async fn serve_until(
        self,
        signal: impl std::future::Future<Output = ()>,
        drain: Duration,
    ) -> Undelivered {
        signal.await;
        self.shutdown(drain).await
    }

    /// Stops gracefully, within `drain`: accepts no more connections, lets
    /// the requests in flight be answered (each connection closes after its
    /// own) for three quarters of it, closes the connections still open
    /// (a stream that never ends, a client that never finishes its head),
    /// then hands Valkey what it still has to hear: the queued writes, and
    /// the invalidations not landed yet (retried until they do). Past
    /// `drain` what is left is abandoned, and returned, so it can be said.
    pub async fn shutdown(mut self, drain: Duration) -> Undelivered {
        let now = tokio::time::Instant::now();
        let deadline = now + drain;
        self.stop.send_replace(serve::Stop::Draining);
        let mut open = Vec::new();
        for mut task in self.serving.drain(..) {
            // A task awaited to its end must not be awaited again.
            if tokio::time::timeout_at(now + drain * 3 / 4, &mut task)
                .await
                .is_err()
            {
                open.push(task);
            }
        }
        self.stop.send_replace(serve::Stop::Now);
        for task in open {
            let _ = tokio::time::timeout_at(deadline, task).await;
        }
        let unheard = |engine: &TieredCache| {
            let stats = engine.stats();
            stats.l2.write_queue > 0 || stats.invalidations.pending > 0
        };
        while unheard(&self.reloader.engine) && tokio::time::Instant::now() < deadline {
            // A full queue refuses the flush's marker: tried again.
            if let Some(l2) = &self.l2 {
                let _ = tokio::time::timeout_at(deadline, l2.flush()).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let stats = self.reloader.engine.stats();
        for task in self.tasks.drain(..) {
            task.abort();
        }
        Undelivered {
            invalidations: stats.invalidations.pending,
            writes: stats.l2.write_queue,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A Valkey setting's error, named as the user wrote it.
pub(crate) fn valkey_error(e: ValkeyError) -> ProxyError {
    match e {
        // Named as the user wrote it, not as the tier calls it.
        ValkeyError::Config {
            field: "command_timeout",
            allowed,
        } => ProxyError::Config(format!(
            "`--valkey-timeout` (`valkey_timeout` in a config file): {allowed}"
        )),
        e => ProxyError::Config(e.to_string()),
    }
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), ProxyError> {
    let bind_error = |source| ProxyError::Bind { addr, source };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// The proxy could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum ProxyError {
    /// A setting is invalid; the message names it.
    Config(String),
    /// An address could not be bound.
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

impl std::fmt::Display for ProxyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProxyError::Config(msg) => f.write_str(msg),
            ProxyError::Bind { addr, source } => write!(
                f,
                "cannot listen on {addr}: {source} (is another process using it? pick another with --listen/--admin)"
            ),
        }
    }
}

impl std::error::Error for ProxyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProxyError::Config(_) => None,
            ProxyError::Bind { source, .. } => Some(source),
        }
    }
}

/// This proxy's own metrics registry (several proxies in one process stay
/// apart), shared by its routes and the reloads.
type SharedRecorder = Arc<dyn metrics::Recorder + Send + Sync>;
