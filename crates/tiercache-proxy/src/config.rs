//! The proxy's settings: [`ProxyConfig`], what the command-line flags and
//! the config file fill in, and the policy it makes for the layer.

use std::net::SocketAddr;
use std::time::Duration;

use http::Uri;
use tiercache_core::{Policy, PolicyError};
use tiercache_http::ResponseCacheLayer;
use tiercache_valkey::ValkeyConfig;

use crate::{ProxyError, routes, valkey_error};

/// The proxy's settings (the command-line flags).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProxyConfig {
    /// Where requests go: `http://HOST:PORT`.
    pub upstream: Uri,
    /// Where the proxy listens.
    pub listen: SocketAddr,
    /// Where the admin endpoints listen (none when `None`).
    pub admin: Option<SocketAddr>,
    /// The bearer token `POST /invalidate` asks for (`Authorization:
    /// Bearer TOKEN`); without one only a client on this machine (a
    /// loopback address) may invalidate. From `TIERCACHE_ADMIN_TOKEN` or a
    /// config file's `admin_token`, never a flag: a command line is seen
    /// by every user of the machine.
    pub admin_token: Option<AdminToken>,
    /// The fresh lifetime of responses without explicit freshness; `None`
    /// (the default) stores only responses whose origin declares freshness.
    pub ttl: Option<Duration>,
    /// The symmetric jitter fraction.
    pub jitter: f64,
    /// Largest body stored; larger ones stream through.
    pub max_body: u64,
    /// The cache's byte budget: all of it for L1, or with Valkey fifteen
    /// sixteenths for L1 and one for the fills waiting to be written to L2.
    pub l1_capacity: u64,
    /// Most background refreshes running at once.
    pub max_refreshes: usize,
    /// The shared L2, as a `redis://` / `rediss://` URL (none: L1 only).
    pub valkey: Option<String>,
    /// How long one Valkey command may take before the request goes on
    /// without it (the origin, or no L2 write); also the fleet lock's.
    pub valkey_timeout: Duration,
    /// How long the upstream may take to start its answer (its head) before
    /// the proxy answers 504 itself (a failure: stale-if-error applies), and
    /// may then send nothing of its body before the body is cut (a failure
    /// too, never stored).
    pub origin_timeout: Duration,
    /// Most requests at the upstream at once (connections in use); a
    /// request waits for a slot at most the origin timeout, then is
    /// answered 503. `None` (the default): no cap.
    pub upstream_max_connections: Option<usize>,
    /// How long an idle connection to the upstream is kept (zero: none
    /// kept); keep it below the upstream's own keep-alive timeout.
    pub upstream_idle_timeout: Duration,
    /// How long a client may take to send a request's head, or leave a
    /// keep-alive connection idle between requests, before it is closed.
    pub client_timeout: Duration,
    /// Most client connections open at once (see
    /// [`DEFAULT_MAX_CONNECTIONS`](Self::DEFAULT_MAX_CONNECTIONS)).
    pub max_connections: usize,
    /// Most requests in flight at once: those not answered on the spot
    /// (waiting on the upstream, on Valkey, or on another request's load);
    /// past it a request is answered from L1 or 503 at once. An L1 hit holds
    /// a place only until it is handed over (see [`DEFAULT_MAX_REQUESTS_IN_FLIGHT`](Self::DEFAULT_MAX_REQUESTS_IN_FLIGHT)).
    pub max_requests_in_flight: usize,
    /// Stale-while-revalidate window.
    pub stale_while_revalidate: Duration,
    /// Stale-if-error window.
    pub stale_if_error: Duration,
    /// Lifetime of 404/410 without explicit freshness (default: the policy's).
    pub negative_ttl: Option<Duration>,
    /// With a stale entry at hand, answer it after the origin took this long.
    pub origin_soft_timeout: Option<Duration>,
    /// XFetch β (0 disables early refresh).
    pub xfetch_beta: f64,
    /// Drop request cookies (the origin never sees them) instead of bypassing.
    pub ignore_cookies: bool,
    /// Key on these cookies (the origin sees only them) instead of bypassing.
    pub key_cookies: Vec<String>,
    /// Request headers keyed on and sent on (e.g. `x-forwarded-proto`).
    pub key_headers: Vec<String>,
    /// Targeted cache-control fields obeyed (RFC 9213), most specific first.
    pub targets: Vec<String>,
    /// Longest a 4xx/5xx with explicit freshness is stored.
    pub max_error_ttl: Duration,
    /// Let a client's `no-cache` / `max-age=0` force a trip to the origin.
    pub honor_client_no_cache: bool,
    /// Longest wait on another request's origin load (here or on another
    /// instance), and the life of a fleet-wide fill lock whose owner died.
    pub lock_timeout: Duration,
    /// How long a key whose response may not be shared skips the single flight.
    pub hit_for_miss_ttl: Option<Duration>,
    /// How long an expired entry with a validator is kept for revalidation.
    pub keep_for_revalidation: Option<Duration>,
    /// Use the ttl even when the origin declares a lifetime.
    pub override_origin: bool,
    /// Tags every response is recorded under.
    pub tags: Vec<String>,
    /// Most `Vary` variants kept per URL.
    pub max_variants: Option<usize>,
    /// The authority (`host[:port]`) every request is keyed on and sent
    /// with, in place of its own `Host`.
    pub canonical_authority: Option<String>,
    /// Per-path rules, first match wins (the settings above are their
    /// defaults, and apply where none matches).
    pub routes: Vec<routes::Route>,
}

impl ProxyConfig {
    /// The default `origin_timeout`: 60 s, as nginx's `proxy_read_timeout`.
    pub const DEFAULT_ORIGIN_TIMEOUT: Duration = Duration::from_secs(60);

    /// The default `client_timeout`: 75 s, as nginx's `keepalive_timeout`,
    /// longer than the 60 s idle timeout of the load balancers usually in
    /// front (they must close an idle connection first, or a request sent
    /// on it as the proxy closes it fails).
    pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(75);

    /// The default `max_connections`: 10,000 client connections at once
    /// (nginx's `worker_connections` is 512 a worker by default, raised in
    /// most deployments); past it a new connection waits in the kernel's
    /// backlog until one closes, rather than each taking its buffers until
    /// file descriptors run out.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

    /// The default `max_requests_in_flight`: 10,000, so HTTP/2 (up to 128
    /// requests a connection) holds no more than HTTP/1.1 at its
    /// connections' bound. Each costs ~7 to ~51 KiB while it waits (the
    /// README's memory section): 10,000 of them up to ~500 MiB beside L1.
    pub const DEFAULT_MAX_REQUESTS_IN_FLIGHT: usize = 10_000;

    /// Defaults: listen on `127.0.0.1:8080`, explicit freshness only (no
    /// ttl), jitter 0.1, max body 8 MiB, L1 256 MiB.
    pub fn new(upstream: Uri) -> Self {
        Self {
            upstream,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: None,
            admin_token: None,
            ttl: None,
            jitter: Policy::DEFAULT_JITTER,
            max_body: ResponseCacheLayer::DEFAULT_MAX_BODY as u64,
            l1_capacity: tiercache_core::TieredCacheBuilder::DEFAULT_L1_CAPACITY,
            max_refreshes: tiercache_core::TieredCacheBuilder::DEFAULT_MAX_REFRESHES,
            valkey: None,
            valkey_timeout: ValkeyConfig::DEFAULT_COMMAND_TIMEOUT,
            origin_timeout: Self::DEFAULT_ORIGIN_TIMEOUT,
            upstream_max_connections: None,
            upstream_idle_timeout: crate::forward::Forward::DEFAULT_IDLE_TIMEOUT,
            client_timeout: Self::DEFAULT_CLIENT_TIMEOUT,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            max_requests_in_flight: Self::DEFAULT_MAX_REQUESTS_IN_FLIGHT,
            stale_while_revalidate: Duration::ZERO,
            stale_if_error: Duration::ZERO,
            negative_ttl: None,
            origin_soft_timeout: None,
            xfetch_beta: Policy::DEFAULT_XFETCH_BETA,
            ignore_cookies: false,
            key_cookies: Vec::new(),
            key_headers: Vec::new(),
            targets: Vec::new(),
            max_error_ttl: ResponseCacheLayer::DEFAULT_MAX_ERROR_TTL,
            honor_client_no_cache: false,
            lock_timeout: Policy::DEFAULT_LOCK_TIMEOUT,
            hit_for_miss_ttl: None,
            keep_for_revalidation: None,
            override_origin: false,
            tags: Vec::new(),
            max_variants: None,
            canonical_authority: None,
            routes: Vec::new(),
        }
    }

    /// Sets the listen address.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Sets the admin address.
    pub fn admin(mut self, addr: SocketAddr) -> Self {
        self.admin = Some(addr);
        self
    }

    /// Sets the token `POST /invalidate` on the admin address asks for
    /// (like `TIERCACHE_ADMIN_TOKEN`).
    pub fn admin_token(mut self, token: AdminToken) -> Self {
        self.admin_token = Some(token);
        self
    }

    /// Sets the ttl of responses without explicit freshness (like `--ttl`).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets the jitter fraction.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// The route policy these settings describe, validated: the error names
    /// the bad field and what it accepts.
    pub fn policy(&self) -> Result<Policy, PolicyError> {
        // Without --ttl the policy's ttl applies to nothing (only declared
        // lifetimes are stored); it just has to bound the negative ttl.
        let ttl = self
            .ttl
            .unwrap_or_else(|| Duration::from_secs(10).max(self.negative_ttl.unwrap_or_default()));
        let mut policy = Policy::ttl(ttl)
            .jitter(self.jitter)
            .stale_while_revalidate(self.stale_while_revalidate)
            .stale_if_error(self.stale_if_error)
            .xfetch_beta(self.xfetch_beta)
            .lock_timeout(self.lock_timeout);
        if let Some(ttl) = self.negative_ttl {
            policy = policy.negative_ttl(ttl);
        }
        if let Some(t) = self.origin_soft_timeout {
            policy = policy.origin_soft_timeout(t);
        }
        if let Some(t) = self.hit_for_miss_ttl {
            policy = policy.hit_for_miss_ttl(t);
        }
        if let Some(w) = self.keep_for_revalidation {
            policy = policy.keep_for_revalidation(w);
        }
        for tag in &self.tags {
            policy = policy.tag(tag.clone());
        }
        policy.override_origin(self.override_origin).build()
    }

    /// The Valkey settings (`--valkey`, `--valkey-timeout`), checked
    /// without connecting; `None` without Valkey.
    pub fn valkey_config(&self) -> Result<Option<ValkeyConfig>, ProxyError> {
        let Some(url) = &self.valkey else {
            // Checked all the same: a bad value is a mistake either way.
            ValkeyConfig::from_fred(Default::default())
                .command_timeout(self.valkey_timeout)
                .validate()
                .map_err(valkey_error)?;
            return Ok(None);
        };
        let config = ValkeyConfig::from_url(url)
            .map_err(valkey_error)?
            .command_timeout(self.valkey_timeout);
        config.validate().map_err(valkey_error)?;
        Ok(Some(config))
    }

    /// The settings of `new` that differ from these and that a reload does
    /// not apply (read once at start: addresses, the budget, Valkey, the
    /// upstream connections and timeouts), by their config-file names. A
    /// reload applies the rest (the routes and the defaults they are laid
    /// over, the admin token).
    ///
    /// ```
    /// # use tiercache_proxy::ProxyConfig;
    /// let running = ProxyConfig::new("http://127.0.0.1:3000".parse()?);
    /// let mut new = running.clone();
    /// new.l1_capacity /= 2;
    /// new.jitter = 0.2;
    /// assert_eq!(running.kept_until_restart(&new), ["l1_capacity"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn kept_until_restart(&self, new: &ProxyConfig) -> Vec<&'static str> {
        [
            ("upstream", self.upstream != new.upstream),
            ("listen", self.listen != new.listen),
            ("admin", self.admin != new.admin),
            ("l1_capacity", self.l1_capacity != new.l1_capacity),
            ("max_refreshes", self.max_refreshes != new.max_refreshes),
            ("valkey", self.valkey != new.valkey),
            ("valkey_timeout", self.valkey_timeout != new.valkey_timeout),
            ("origin_timeout", self.origin_timeout != new.origin_timeout),
            (
                "upstream_max_connections",
                self.upstream_max_connections != new.upstream_max_connections,
            ),
            (
                "upstream_idle_timeout",
                self.upstream_idle_timeout != new.upstream_idle_timeout,
            ),
            ("client_timeout", self.client_timeout != new.client_timeout),
            (
                "max_connections",
                self.max_connections != new.max_connections,
            ),
            (
                "max_requests_in_flight",
                self.max_requests_in_flight != new.max_requests_in_flight,
            ),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }

    /// Lays a cookie mode over this one (a route's, or the command line's
    /// over a file's): it replaces only what it names. Cookie keys turn
    /// ignoring off, ignoring drops the keys; both named at once are kept,
    /// for [`check`](Self::check) to refuse.
    pub fn set_cookie_mode(&mut self, ignore: Option<bool>, keys: Option<Vec<String>>) {
        match (ignore, keys) {
            (Some(true), Some(keys)) => {
                self.ignore_cookies = true;
                self.key_cookies = keys;
            }
            (ignore, keys) => {
                if let Some(keys) = keys {
                    self.ignore_cookies &= keys.is_empty();
                    self.key_cookies = keys;
                }
                if let Some(ignore) = ignore {
                    self.ignore_cookies = ignore;
                    if ignore {
                        self.key_cookies.clear();
                    }
                }
            }
        }
    }

    /// These settings with `settings` laid over them (a route's).
    pub fn with(&self, settings: &routes::Settings) -> ProxyConfig {
        let mut c = self.clone();
        let s = settings.clone();
        if s.ttl.is_some() {
            c.ttl = s.ttl;
        }
        c.jitter = s.jitter.unwrap_or(c.jitter);
        c.stale_while_revalidate = s.stale_while_revalidate.unwrap_or(c.stale_while_revalidate);
        c.stale_if_error = s.stale_if_error.unwrap_or(c.stale_if_error);
        c.negative_ttl = s.negative_ttl.or(c.negative_ttl);
        c.origin_soft_timeout = s.origin_soft_timeout.or(c.origin_soft_timeout);
        c.xfetch_beta = s.xfetch_beta.unwrap_or(c.xfetch_beta);
        c.lock_timeout = s.lock_timeout.unwrap_or(c.lock_timeout);
        c.hit_for_miss_ttl = s.hit_for_miss_ttl.or(c.hit_for_miss_ttl);
        c.keep_for_revalidation = s.keep_for_revalidation.or(c.keep_for_revalidation);
        c.override_origin = s.override_origin.unwrap_or(c.override_origin);
        c.tags = s.tags.unwrap_or(c.tags);
        c.set_cookie_mode(s.ignore_cookies, s.key_cookies);
        c.key_headers = s.key_headers.unwrap_or(c.key_headers);
        c.targets = s.targeted_fields.unwrap_or(c.targets);
        c.max_body = s.max_body.unwrap_or(c.max_body);
        c.max_error_ttl = s.max_error_ttl.unwrap_or(c.max_error_ttl);
        c.honor_client_no_cache = s.honor_client_no_cache.unwrap_or(c.honor_client_no_cache);
        c.max_variants = s.max_variants.or(c.max_variants);
        c.canonical_authority = s.canonical_authority.or(c.canonical_authority);
        c
    }

    /// Uses Valkey at `url` as the shared L2.
    pub fn valkey(mut self, url: impl Into<String>) -> Self {
        self.valkey = Some(url.into());
        self
    }

    /// Sets how long the upstream may take to start its answer, and to go
    /// quiet within its body (default 60 s).
    pub fn origin_timeout(mut self, timeout: Duration) -> Self {
        self.origin_timeout = timeout;
        self
    }

    /// Caps the requests at the upstream at once (like
    /// `--upstream-max-connections`).
    pub fn upstream_max_connections(mut self, n: usize) -> Self {
        self.upstream_max_connections = Some(n);
        self
    }

    /// Sets how long an idle upstream connection is kept (like
    /// `--upstream-idle-timeout`).
    pub fn upstream_idle_timeout(mut self, idle: Duration) -> Self {
        self.upstream_idle_timeout = idle;
        self
    }

    /// Sets how long a client may take to send a request's head, idle
    /// between keep-alive requests, or leave what is sent to it unread
    /// (default 75 s).
    pub fn client_timeout(mut self, timeout: Duration) -> Self {
        self.client_timeout = timeout;
        self
    }

    /// Sets the most client connections open at once (like
    /// `--max-connections`; default 10,000).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets the most requests in flight at once, an L1 hit held only until
    /// it is handed over (like `--max-requests-in-flight`; default 10,000).
    pub fn max_requests_in_flight(mut self, n: usize) -> Self {
        self.max_requests_in_flight = n;
        self
    }

    /// Sets how long one Valkey command may take (default 50 ms).
    pub fn valkey_timeout(mut self, timeout: Duration) -> Self {
        self.valkey_timeout = timeout;
        self
    }

    /// Sets the body cap.
    pub fn max_body(mut self, bytes: u64) -> Self {
        self.max_body = bytes;
        self
    }
}

/// The secret the admin address asks of `POST /invalidate`: printable
/// ASCII with no spaces, 16 characters or more. Its `Debug` never shows it.
///
/// ```
/// use tiercache_proxy::AdminToken;
///
/// let token = AdminToken::new("s3cret-s3cret-s3cret").unwrap();
/// assert!(token.matches(b"s3cret-s3cret-s3cret"));
/// assert!(!format!("{token:?}").contains("s3cret"));
/// assert!(AdminToken::new("short").unwrap_err().to_string().contains("16 characters"));
/// ```
#[derive(Clone)]
pub struct AdminToken(String);

impl AdminToken {
    /// The token, checked: what a bearer credential may carry here
    /// (visible ASCII, no spaces), long enough not to be guessed.
    pub fn new(token: impl Into<String>) -> Result<Self, ProxyError> {
        let token = token.into();
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ProxyError::Config(
                "the admin token (`TIERCACHE_ADMIN_TOKEN`, `admin_token` in a config file): 16 characters or more, printable ASCII, no spaces".into(),
            ));
        }
        Ok(Self(token))
    }

    /// Whether `given` is the token, in a time that does not tell how much
    /// of it matched.
    pub fn matches(&self, given: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        let differ = given
            .iter()
            .zip(ours)
            .fold(ours.len() ^ given.len(), |acc, (a, b)| {
                acc | usize::from(a ^ b)
            });
        differ == 0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(…)")
    }
}
