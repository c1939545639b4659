//! [`PathLayer`]: the cache applied once, over a whole `Router`, with a
//! policy per path glob (the proxy's `[[route]]` rules, for the layer).
//!
//! Layered per route (`get(h).layer(cache.route(..)?)`), a write invalidates
//! only when its handler sits under the same `.layer()`; a `POST` routed
//! elsewhere invalidates nothing. Over the whole router, every write passes
//! through the cache, wherever it is routed: a successful unsafe request
//! invalidates its target (and the same-origin `Location` /
//! `Content-Location` it answers with) on any path that is not excluded,
//! plus whatever [`on_write`](PathLayer::on_write) names for its path.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tiercache_core::{IntoPolicy, Policy, PolicyError};
use tower::{Layer, Service};

use crate::body::{BoxError, CacheBody};
use crate::future::ResponseFuture;
use crate::invalidate::is_safe;
use crate::layer::ResponseCacheLayer;
use crate::route::Route;
use crate::service::{ResponseCache, take_ready};

/// A path glob: `*` matches any run of characters (`/` included), `?` one
/// character; everything else matches itself. The whole path must match.
///
/// ```
/// use tiercache_http::paths::Glob;
///
/// assert!(Glob::new("/static/*").matches("/static/css/site.css"));
/// assert!(!Glob::new("/static/*").matches("/api/static/x"));
/// assert!(Glob::new("/item/?").matches("/item/7"));
/// assert!(Glob::new("/products").matches("/products"));
/// assert!(!Glob::new("/products").matches("/products/7"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob(String);

impl Glob {
    /// A glob from its text.
    pub fn new(pattern: impl Into<String>) -> Self {
        Self(pattern.into())
    }

    /// The glob as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `path` matches the whole glob. Linear in the path for each
    /// `*` (the usual wildcard walk: on a mismatch, the last `*` takes one
    /// more character), so no pattern can make it blow up.
    pub fn matches(&self, path: &str) -> bool {
        let (p, s) = (self.0.as_bytes(), path.as_bytes());
        let (mut pi, mut si) = (0, 0);
        // Where the last `*` was, and where in `s` it stopped matching.
        let mut star: Option<(usize, usize)> = None;
        while si < s.len() {
            match p.get(pi) {
                Some(b'*') => {
                    star = Some((pi, si));
                    pi += 1;
                }
                Some(&c) if c == b'?' || c == s[si] => {
                    pi += 1;
                    si += 1;
                }
                _ => match star {
                    Some((at, from)) => {
                        pi = at + 1;
                        si = from + 1;
                        star = Some((at, from + 1));
                    }
                    None => return false,
                },
            }
        }
        p[pi..].iter().all(|&c| c == b'*')
    }
}

/// What a successful write under a path makes stale, beyond its own URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalidate {
    /// Every response recorded under this tag (a route's
    /// [`tag`](tiercache_core::PolicyBuilder::tag), or a `Surrogate-Key`
    /// the origin sent).
    Tag(Bytes),
    /// Every response whose path starts with this, on the write's host.
    PathPrefix(String),
}

impl Invalidate {
    /// [`Invalidate::Tag`].
    pub fn tag(tag: impl Into<Bytes>) -> Self {
        Self::Tag(tag.into())
    }

    /// [`Invalidate::PathPrefix`].
    pub fn path_prefix(prefix: impl Into<String>) -> Self {
        Self::PathPrefix(prefix.into())
    }
}

#[derive(Debug, Clone)]
enum Rule {
    /// Cached under this route's layer (policy and settings).
    Cache(ResponseCacheLayer),
    /// Untouched: no cache, no cache fields, no invalidation.
    Exclude,
}

/// One cache layer for a whole router: the first rule whose glob matches a
/// request's path decides (cached under its policy, or excluded); a path
/// no rule matches is not cached, but writes to it still invalidate.
/// Each cached rule's metrics carry its glob as the `route` label.
///
/// Built from [`ResponseCacheLayer::paths`]; the rules take the base
/// layer's settings, or a route layer's own with
/// [`route_layer`](Self::route_layer).
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, routing::{get, post}};
/// use tiercache_core::{Policy, TieredCache};
/// use tiercache_http::ResponseCacheLayer;
/// use tiercache_http::paths::Invalidate;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
/// let app: Router = Router::new()
///     .route("/products", get(|| async { "the list" }))
///     .route("/products/{id}", get(|| async { "one" }).post(|| async { "saved" }))
///     .route("/metrics", get(|| async { "live" }))
///     .layer(
///         cache
///             .paths()
///             .exclude("/metrics")
///             .route("/products/*", Policy::ttl(Duration::from_secs(60)))?
///             .route("/products", Policy::ttl(Duration::from_secs(30)).tag("product-lists"))?
///             // POST /products/7 drops /products/7 (always) and every list page.
///             .on_write("/products/*", [Invalidate::tag("product-lists")]),
///     );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PathLayer {
    base: ResponseCacheLayer,
    rules: Vec<(Glob, Rule)>,
    writes: Vec<(Glob, Invalidate)>,
}

impl PathLayer {
    pub(crate) fn new(base: ResponseCacheLayer) -> Self {
        Self {
            base,
            rules: Vec::new(),
            writes: Vec::new(),
        }
    }

    /// Caches the paths `glob` matches under `policy`, with the base layer's
    /// settings; the policy is validated here. Rules are tried in the order
    /// given; the first match wins.
    pub fn route(mut self, glob: &str, policy: impl IntoPolicy) -> Result<Self, PolicyError> {
        let layer = self.base.route_named(glob, policy)?;
        self.rules.push((Glob::new(glob), Rule::Cache(layer)));
        Ok(self)
    }

    /// Caches the paths `glob` matches under a route's layer, with that
    /// layer's policy, settings and metrics name:
    /// `.route_layer("/assets/*", cache.route_named("assets", policy)?.ignore_cookies())`.
    ///
    /// # Panics
    /// When `layer` has no policy (the base layer): it would cache nothing.
    pub fn route_layer(mut self, glob: &str, layer: ResponseCacheLayer) -> Self {
        assert!(
            layer.route.is_some(),
            "tiercache: PathLayer::route_layer(\"{glob}\", ..) was given a layer without a \
             policy; pass a route's layer: `cache.route(Policy::ttl(..))?`"
        );
        self.rules.push((Glob::new(glob), Rule::Cache(layer)));
        self
    }

    /// Leaves the paths `glob` matches untouched: not cached, no cache
    /// fields, no invalidation (`/metrics`, health checks, streams).
    pub fn exclude(mut self, glob: &str) -> Self {
        self.rules.push((Glob::new(glob), Rule::Exclude));
        self
    }

    /// A successful write (POST, PUT, PATCH, DELETE, …) on a path `glob`
    /// matches also invalidates `what`, everywhere (every tier, every
    /// instance): the collection pages an item's write makes stale. Every
    /// matching `on_write` applies, not only the first.
    pub fn on_write(mut self, glob: &str, what: impl IntoIterator<Item = Invalidate>) -> Self {
        let glob = Glob::new(glob);
        self.writes
            .extend(what.into_iter().map(|what| (glob.clone(), what)));
        self
    }
}

/// The rules, resolved once per service.
#[derive(Debug)]
struct Table {
    rules: Vec<(Glob, Option<Arc<Route>>)>,
    /// For writes on paths no rule matches.
    other: Arc<Route>,
    writes: Vec<(Glob, Invalidate)>,
}

impl<S> Layer<S> for PathLayer {
    type Service = PathCache<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let rules = self
            .rules
            .iter()
            .map(|(glob, rule)| {
                let route = match rule {
                    Rule::Cache(layer) => layer.clone().into_route(),
                    Rule::Exclude => None,
                };
                (glob.clone(), route)
            })
            .collect();
        // Its policy never applies: only writes reach it.
        let other = self
            .base
            .route_named("other", Policy::ttl(std::time::Duration::from_secs(1)))
            .ok()
            .and_then(ResponseCacheLayer::into_route)
            .expect("a one-second ttl is a valid policy");
        PathCache {
            inner,
            table: Arc::new(Table {
                rules,
                other,
                writes: self.writes.clone(),
            }),
        }
    }
}

/// The service [`PathLayer`] builds: dispatches each request to its rule.
#[derive(Debug, Clone)]
pub struct PathCache<S> {
    inner: S,
    table: Arc<Table>,
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for PathCache<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<CacheBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let path = req.uri().path();
        let rule = self.table.rules.iter().find(|(glob, _)| glob.matches(path));
        let write = !is_safe(req.method());
        let route = match rule {
            Some((_, None)) => None,
            Some((_, Some(route))) => Some(route.clone()),
            None if write => Some(self.table.other.clone()),
            None => None,
        };
        let Some(route) = route else {
            return ResponseFuture::inner(self.inner.call(req), None);
        };
        // Empty (no allocation) for a read.
        let also = (self.table.writes.iter())
            .filter(|(glob, _)| write && glob.matches(path))
            .map(|(_, what)| what.clone())
            .collect();
        ResponseCache::for_request(take_ready(&mut self.inner), route, also).call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::Glob;

    #[test]
    fn globs_match_whole_paths() {
        let cases = [
            ("/static/*", "/static/", true),
            ("/static/*", "/static", false),
            ("/a/*/c", "/a/b/x/c", true),
            ("/a/*/c", "/a/b/x/d", false),
            ("*.css", "/x/y.css", true),
            ("*.css", "/x/y.cssx", false),
            ("/*", "/", true),
            ("*", "", true),
            ("", "", true),
            ("", "/", false),
            ("/p?", "/p7", true),
            ("/p?", "/p", false),
            ("/**x", "/abx", true),
        ];
        for (glob, path, want) in cases {
            assert_eq!(Glob::new(glob).matches(path), want, "{glob} vs {path}");
        }
    }

    #[test]
    fn a_pathological_glob_stays_fast() {
        let glob = Glob::new(format!("{}b", "*a".repeat(30)));
        let path = "a".repeat(10_000);
        // Backtracking recursion would never finish this.
        assert!(!glob.matches(&path));
    }
}
