//! [`ResponseCacheLayer`]: the HTTP builder, one per route policy, all sharing one engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::HeaderName;

use tiercache_core::{IntoPolicy, Policy, PolicyError, Queued, TieredCache};

use crate::config::{Cookies, HttpConfig};
use crate::metrics::{EngineMetrics, RouteMetrics, Sink};
use crate::paths::PathLayer;
use crate::reading::Reading;
use crate::route::Route;
use crate::variants::Variants;

/// Caches the responses of the service it wraps.
///
/// Build one from the engine, then derive a layer per route with
/// [`route`](Self::route); every derived layer shares the engine (one L1, one
/// single-flight map, one set of stats). The base layer itself has no
/// policy: applied as a layer it panics when the app is built, rather than
/// silently cache nothing.
///
/// Settings have two scopes, and each setter says which by where it is
/// called: on the base, before the first [`route`](Self::route), it is the
/// default of every route derived afterwards; on a route's layer
/// (`cache.route(policy)?.max_body(..)`), it is that route's alone. A base
/// setter called after routes were derived from that value panics (it
/// could not reach them); a clone of the base is a new base.
///
/// ```should_panic
/// # use std::time::Duration;
/// # use tiercache_core::{Policy, TieredCache};
/// # use tiercache_http::ResponseCacheLayer;
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
/// let products = cache.route(Policy::ttl(Duration::from_secs(30)))?;
/// // Panics: `products` copied the settings already; this would not reach it.
/// let cache = cache.max_body(64 * 1024);
/// # let _ = (products, cache);
/// # Ok(()) }
/// ```
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, routing::get};
/// use tiercache_core::{Policy, TieredCache};
/// use tiercache_http::ResponseCacheLayer;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
/// let app: Router = Router::new().route(
///     "/products/{id}",
///     get(|| async { "product" })
///         .layer(cache.route(Policy::ttl(Duration::from_secs(30)).jitter(0.1))?),
/// );
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ResponseCacheLayer {
    pub(crate) engine: TieredCache,
    pub(crate) variants: Variants,
    /// Bodies being read to be stored, one bound per engine.
    pub(crate) reading: Arc<Reading>,
    /// The route's policy and metrics; none on the unannotated layer.
    pub(crate) route: Option<(Arc<Policy>, Arc<RouteMetrics>)>,
    pub(crate) config: Arc<HttpConfig>,
    pub(crate) engine_metrics: Arc<EngineMetrics>,
    /// Where routes derived from here register their metrics.
    sink: Sink,
    /// Set once a route (or a [`PathLayer`]) was derived from this value:
    /// a base setter after that would not reach them, so it panics. Not
    /// shared by clones: a clone is a new base.
    derived: AtomicBool,
}

impl Clone for ResponseCacheLayer {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            variants: self.variants.clone(),
            reading: self.reading.clone(),
            route: self.route.clone(),
            config: self.config.clone(),
            engine_metrics: self.engine_metrics.clone(),
            sink: self.sink.clone(),
            derived: AtomicBool::new(false),
        }
    }
}

impl ResponseCacheLayer {
    /// Default largest body that is buffered and stored: 8 MiB.
    pub const DEFAULT_MAX_BODY: usize = 8 * 1024 * 1024;
    /// Default cap on the lifetime of a stored 4xx/5xx with explicit freshness.
    pub const DEFAULT_MAX_ERROR_TTL: Duration = Duration::from_secs(60);
    /// Default cap on the `Vary` variants kept per URL.
    pub const DEFAULT_MAX_VARIANTS: usize = 32;

    /// A layer on `engine` with no route policy yet.
    pub fn new(engine: TieredCache) -> Self {
        Self {
            // One per engine, however many layers are built on it.
            variants: Variants::clone(
                &engine.shared_state(|| Variants::for_l1(engine.l1_capacity())),
            ),
            reading: engine.shared_state(|| Reading::for_l1(engine.l1_capacity())),
            engine,
            route: None,
            config: Arc::new(HttpConfig::default()),
            engine_metrics: Arc::new(EngineMetrics::default()),
            sink: Sink::default(),
            derived: AtomicBool::new(false),
        }
    }

    /// A layer for one route: the same engine and settings, with `policy`.
    /// The policy is validated here; the error names the bad field. Its
    /// metrics carry `route="default"`; see [`route_named`](Self::route_named).
    pub fn route(&self, policy: impl IntoPolicy) -> Result<Self, PolicyError> {
        self.route_named("default", policy)
    }

    /// Like [`route`](Self::route), with `name` as the `route` label of its
    /// metrics (see [`crate::metrics`]); routes may share a name.
    pub fn route_named(&self, name: &str, policy: impl IntoPolicy) -> Result<Self, PolicyError> {
        let policy = policy.into_policy()?;
        self.derived.store(true, Ordering::Relaxed);
        Ok(Self {
            route: Some((
                Arc::new(policy),
                Arc::new(RouteMetrics::new(name, self.sink.clone())),
            )),
            ..self.clone()
        })
    }

    /// One layer for a whole `Router`, with a policy per path glob, paths
    /// left out, and writes that invalidate wherever they are routed; see
    /// [`PathLayer`]. Its rules take this layer's settings.
    pub fn paths(&self) -> PathLayer {
        self.derived.store(true, Ordering::Relaxed);
        PathLayer::new(self.clone())
    }

    /// The shared state of a route's services; none without a policy.
    pub(crate) fn into_route(self) -> Option<Arc<Route>> {
        let (policy, metrics) = self.route?;
        self.engine_metrics.keep_current(&self.engine);
        Some(Arc::new(Route {
            engine_metrics: self.engine_metrics,
            engine: self.engine,
            variants: self.variants,
            reading: self.reading,
            policy,
            config: self.config,
            metrics,
            cookies: Default::default(),
        }))
    }

    /// Refuses a base setter once routes were derived from this value.
    fn settable(&self, setter: &str) {
        assert!(
            self.route.is_some() || !self.derived.load(Ordering::Relaxed),
            "tiercache: ResponseCacheLayer::{setter} was called on the base layer after \
             route()/paths() derived layers from it; they copied its settings then, so this \
             would not reach them. Call {setter} before the first route(), or on the route: \
             `cache.route(policy)?.{setter}(..)`"
        );
    }

    /// Sets the engine's metrics (hit ratio, L1 bytes, expired, evicted, L2
    /// errors and breaker, …) from its counters, now. There is no need to
    /// call it before a scrape: once the layer wraps a service inside a Tokio
    /// runtime, a task of its own does this every second while the layer or
    /// its services live (the per-route request metrics are live anyway).
    ///
    /// Like every metric here they go to the recorder given with
    /// [`metrics_recorder`](Self::metrics_recorder), or to the one in force
    /// when this is called.
    pub fn publish_metrics(&self) {
        self.engine_metrics.publish_from(&self.engine);
    }

    /// Records this layer's metrics, and those of the routes derived from it
    /// afterwards, into `recorder` rather than the recorder in force when
    /// each series is first used (the global one, usually). For a registry
    /// of your own, or several caches in one process kept apart.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Duration;
    /// # use tiercache_core::{Policy, TieredCache};
    /// # use tiercache_http::ResponseCacheLayer;
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    /// let scrape = recorder.handle();
    /// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?)
    ///     .metrics_recorder(Arc::new(recorder));
    /// let products = cache.route_named("products", Policy::ttl(Duration::from_secs(30)))?;
    /// // …serve; then `scrape.render()` is the Prometheus text.
    /// # let _ = (products, scrape);
    /// # Ok(()) }
    /// ```
    pub fn metrics_recorder(mut self, recorder: Arc<dyn metrics::Recorder + Send + Sync>) -> Self {
        self.settable("metrics_recorder");
        self.sink = Sink::own(recorder);
        self.engine_metrics = Arc::new(EngineMetrics::new(self.sink.clone()));
        if let Some((_, metrics)) = &mut self.route {
            *metrics = Arc::new(RouteMetrics::new(metrics.name(), self.sink.clone()));
        }
        self
    }

    /// Largest body buffered and stored; a larger one (by `Content-Length`, or
    /// found while reading) streams through to the client untouched, unstored.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.settable("max_body");
        Arc::make_mut(&mut self.config).max_body = bytes;
        self
    }

    /// Whether to add `x-cache`, `x-cache-tier`, `x-cache-hit-ratio` and
    /// `cache-status` to responses (default on). `age` is always set on hits.
    pub fn emit_headers(mut self, on: bool) -> Self {
        self.settable("emit_headers");
        Arc::make_mut(&mut self.config).emit_headers = on;
        self
    }

    /// Lets requests with `Cookie` use the cache by dropping their cookies:
    /// the origin never sees them and the key ignores them. For routes whose
    /// responses do not depend on cookies (assets, public pages).
    pub fn ignore_cookies(mut self) -> Self {
        self.settable("ignore_cookies");
        Arc::make_mut(&mut self.config).cookies = Cookies::Ignore;
        self
    }

    /// Lets requests with `Cookie` use the cache, keyed on the values of the
    /// cookies `names` (as fingerprints); the origin is sent only those
    /// cookies, so nothing unkeyed can shape the response.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tiercache_core::{Policy, TieredCache};
    /// # use tiercache_http::ResponseCacheLayer;
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
    /// let by_language = cache.route(Policy::ttl(Duration::from_secs(60)))?.key_cookies(["lang"]);
    /// # Ok(()) }
    /// ```
    pub fn key_cookies<I, N>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = N>,
        N: Into<String>,
    {
        self.settable("key_cookies");
        Arc::make_mut(&mut self.config).cookies =
            Cookies::Key(names.into_iter().map(Into::into).collect());
        self
    }

    /// Keys on request header `name` and sends it on. Any header can be keyed;
    /// for those in [`UNKEYED`](crate::request::UNKEYED) (which are otherwise
    /// removed) this is how a route that needs, say, `X-Forwarded-Proto` from
    /// its load balancer gets it safely.
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.settable("key_header");
        let config = Arc::make_mut(&mut self.config);
        if !config.keyed_headers.contains(&name) {
            config.keyed_headers.push(name);
        }
        self
    }

    /// Targeted cache-control fields (RFC 9213) this cache obeys, most
    /// specific first, e.g. `tiercache-cache-control`, `cdn-cache-control`.
    /// The first one present stands in for `Cache-Control` when deciding
    /// whether and how long to store; none by default.
    pub fn targeted_fields(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.settable("targeted_fields");
        Arc::make_mut(&mut self.config).targets = names.into_iter().collect();
        self
    }

    /// Longest a 4xx/5xx with explicit freshness is stored (default 60 s);
    /// errors without explicit freshness are never stored (404/410 excepted:
    /// they get the policy's negative ttl).
    pub fn max_error_ttl(mut self, ttl: Duration) -> Self {
        self.settable("max_error_ttl");
        Arc::make_mut(&mut self.config).max_error_ttl = ttl;
        self
    }

    /// Stores only responses whose origin declares freshness (`max-age`,
    /// `s-maxage`, `Expires`): a standards-following shared cache with no
    /// heuristic lifetimes. The policy's ttl then applies to nothing.
    pub fn explicit_freshness_only(mut self) -> Self {
        self.settable("explicit_freshness_only");
        Arc::make_mut(&mut self.config).heuristic = false;
        self
    }

    /// Whether a client's `Cache-Control: no-cache` / `max-age=0` /
    /// `Pragma: no-cache` makes the cache go to the origin (default off: a
    /// client must not be able to push load onto the origin).
    pub fn honor_client_no_cache(mut self, on: bool) -> Self {
        self.settable("honor_client_no_cache");
        Arc::make_mut(&mut self.config).honor_client_no_cache = on;
        self
    }

    /// Most `Vary` variants kept per URL (default 32; at least 1, 0 is taken
    /// as 1); past it, new variants are served by the origin, not stored.
    pub fn max_variants(mut self, n: usize) -> Self {
        self.settable("max_variants");
        Arc::make_mut(&mut self.config).max_variants = n.max(1);
        self
    }

    /// Keys every request on `authority` (`shop.example`, or with a port)
    /// instead of its own `Host`, and sends it to the origin with that
    /// `Host`: for an app that answers on several names or ports, and for a
    /// fleet whose instances are reached on different ports, which would
    /// otherwise keep separate entries (the key holds the authority, port
    /// included). Invalidations are keyed on it too.
    ///
    /// # Panics
    /// When `authority` is not a valid URI authority.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tiercache_core::{Policy, TieredCache};
    /// # use tiercache_http::ResponseCacheLayer;
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?)
    ///     .canonical_authority("shop.example");
    /// let products = cache.route(Policy::ttl(Duration::from_secs(30)))?;
    /// # let _ = products;
    /// # Ok(()) }
    /// ```
    pub fn canonical_authority(mut self, authority: &str) -> Self {
        self.settable("canonical_authority");
        let parsed = authority
            .parse::<http::uri::Authority>()
            .unwrap_or_else(|e| {
                panic!("tiercache: canonical_authority({authority:?}) is not a URI authority: {e}")
            });
        Arc::make_mut(&mut self.config).canonical_authority = Some(parsed);
        self
    }

    /// The shared engine.
    pub fn engine(&self) -> &TieredCache {
        &self.engine
    }

    /// Removes the cached responses of `uri` from every tier and every
    /// instance, as a successful unsafe request on it would: the URL's
    /// entry and its `Vary` variants (by their exact keys and the URL's
    /// family tag, so the variants other instances stored go too), without
    /// scanning any L1. Copies keyed on a client's credentials or cookies
    /// are not reached (use [`invalidate_path_prefix`](Self::invalidate_path_prefix)).
    /// A `uri` without scheme and host names the path on every host: that
    /// is a prefix invalidation (see [`url_pattern`](crate::key::url_pattern)).
    ///
    /// `Err(Queued)`: this instance's L1 is clean, the shared tier was not
    /// reached in time, and the invalidation is retried until it lands.
    pub async fn invalidate_url(&self, uri: &http::Uri) -> Result<(), Queued> {
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return self
                .engine
                .invalidate_prefix(crate::key::url_pattern(uri))
                .await;
        };
        let authority = self
            .config
            .canonical_authority
            .as_ref()
            .unwrap_or(authority);
        let key = crate::key::uri_key(
            scheme,
            authority.as_str().as_bytes(),
            uri.path(),
            uri.query(),
        )
        .finish();
        let mut known = self.variants.take(&key);
        let tag = crate::key::family_tag(&key);
        known.push(key);
        self.engine.invalidate_tag_and_keys(tag, &known).await
    }

    /// Removes every cached response whose path starts with `uri`'s path
    /// (of its host when `uri` is absolute), from every tier and instance.
    pub async fn invalidate_path_prefix(&self, uri: &http::Uri) -> Result<(), Queued> {
        self.engine
            .invalidate_prefix(crate::key::path_prefix_pattern(uri))
            .await
    }

    /// Removes every response recorded under `tag` (a route's
    /// [`Policy::tag`](tiercache_core::PolicyBuilder::tag) or a `Surrogate-Key`
    /// the origin sent).
    pub async fn invalidate_tag(&self, tag: impl Into<bytes::Bytes>) -> Result<(), Queued> {
        self.engine.invalidate_tag(tag).await
    }
}
