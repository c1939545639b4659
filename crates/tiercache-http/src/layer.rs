//! [`ResponseCacheLayer`]: the HTTP builder, one per route policy, all sharing one engine.

use std::sync::Arc;

use tiercache_core::{Policy, PolicyError, TieredCache};
use tower::Layer;

use crate::service::ResponseCache;

/// Caches the responses of the service it wraps.
///
/// Build one from the engine, then derive a layer per route with
/// [`route`](Self::route); every derived layer shares the engine (one L1, one
/// single-flight map, one set of stats). A layer with no policy leaves the
/// service untouched.
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
#[derive(Debug, Clone)]
pub struct ResponseCacheLayer {
    pub(crate) engine: TieredCache,
    pub(crate) policy: Option<Arc<Policy>>,
    pub(crate) config: Arc<HttpConfig>,
}

#[derive(Debug, Clone)]
pub(crate) struct HttpConfig {
    pub(crate) max_body: usize,
    pub(crate) emit_headers: bool,
}

impl ResponseCacheLayer {
    /// Default largest body that is buffered and stored: 8 MiB.
    pub const DEFAULT_MAX_BODY: usize = 8 * 1024 * 1024;

    /// A layer on `engine` with no route policy yet.
    pub fn new(engine: TieredCache) -> Self {
        Self {
            engine,
            policy: None,
            config: Arc::new(HttpConfig {
                max_body: Self::DEFAULT_MAX_BODY,
                emit_headers: true,
            }),
        }
    }

    /// A layer for one route: the same engine and settings, with `policy`.
    /// The policy is validated here; the error names the bad field.
    pub fn route(&self, policy: Policy) -> Result<Self, PolicyError> {
        policy.validate()?;
        Ok(Self {
            policy: Some(Arc::new(policy)),
            ..self.clone()
        })
    }

    /// Largest body buffered and stored; a larger one (by `Content-Length`, or
    /// found while reading) streams through to the client untouched, unstored.
    pub fn max_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).max_body = bytes;
        self
    }

    /// Whether to add `x-cache`, `x-cache-tier`, `x-cache-hit-ratio` and
    /// `cache-status` to responses (default on). `age` is always set on hits.
    pub fn emit_headers(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).emit_headers = on;
        self
    }

    /// The shared engine.
    pub fn engine(&self) -> &TieredCache {
        &self.engine
    }
}

impl<S> Layer<S> for ResponseCacheLayer {
    type Service = ResponseCache<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ResponseCache::new(inner, self.clone())
    }
}
