//! Per-path rules: the first route whose glob matches a request's path
//! decides how it is cached (its own policy and safety options), or that it
//! passes through untouched; the defaults apply where none matches.

use std::convert::Infallible;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tiercache_http::CacheBody;
use tower::Service;
use tower::util::BoxCloneSyncService;

use crate::forward::UpstreamBody;
use crate::own_answers::own_answer;

pub use tiercache_http::paths::Glob;

/// The settings a route (or the file's `[defaults]`) may set; each left
/// `None` keeps what applies around it.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Settings {
    /// Fresh lifetime of responses without explicit freshness.
    pub ttl: Option<Duration>,
    /// Symmetric jitter fraction.
    pub jitter: Option<f64>,
    /// Stale-while-revalidate window.
    pub stale_while_revalidate: Option<Duration>,
    /// Stale-if-error window.
    pub stale_if_error: Option<Duration>,
    /// Lifetime of 404/410 without explicit freshness.
    pub negative_ttl: Option<Duration>,
    /// Answer a stale entry once the origin has taken this long.
    pub origin_soft_timeout: Option<Duration>,
    /// XFetch β.
    pub xfetch_beta: Option<f64>,
    /// Longest wait on another request's load.
    pub lock_timeout: Option<Duration>,
    /// How long an uncacheable key skips the single flight.
    pub hit_for_miss_ttl: Option<Duration>,
    /// How long an expired entry with a validator is kept for revalidation.
    pub keep_for_revalidation: Option<Duration>,
    /// Use the route's ttl even over the origin's.
    pub override_origin: Option<bool>,
    /// Tags every response of the route is recorded under.
    pub tags: Option<Vec<String>>,
    /// Drop request cookies instead of bypassing.
    pub ignore_cookies: Option<bool>,
    /// Key on these cookies instead of bypassing.
    pub key_cookies: Option<Vec<String>>,
    /// Request headers keyed on and sent on.
    pub key_headers: Option<Vec<String>>,
    /// Targeted cache-control fields obeyed (RFC 9213).
    pub targeted_fields: Option<Vec<String>>,
    /// Largest body stored.
    pub max_body: Option<u64>,
    /// Longest a 4xx/5xx with explicit freshness is stored.
    pub max_error_ttl: Option<Duration>,
    /// Let a client's `no-cache` force a trip to the origin.
    pub honor_client_no_cache: Option<bool>,
    /// Most `Vary` variants kept per URL.
    pub max_variants: Option<usize>,
    /// The authority requests are keyed on and sent with.
    pub canonical_authority: Option<String>,
}

/// One `[[route]]`: a path glob, whether it is cached, and its settings.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Route {
    /// Which paths it covers.
    pub path: Glob,
    /// `false`: requests pass through untouched (no cache, no cache fields).
    pub cache: bool,
    /// What it sets over the defaults.
    pub settings: Settings,
}

impl Route {
    /// A cached route over `path` with `settings`.
    pub fn new(path: &str, settings: Settings) -> Self {
        Self {
            path: Glob::new(path),
            cache: true,
            settings,
        }
    }

    /// A route over `path` that passes through untouched.
    pub fn pass(path: &str) -> Self {
        Self {
            path: Glob::new(path),
            cache: false,
            settings: Settings::default(),
        }
    }
}

/// One route's service: the cache over the upstream, or the upstream alone.
pub(crate) type RouteService =
    BoxCloneSyncService<Request<Body>, Response<CacheBody<UpstreamBody>>, Infallible>;

/// The routes in force, swapped whole on a reload.
#[derive(Clone)]
pub(crate) struct Table {
    /// Each rule's glob as written, the same lower-cased (matched against
    /// the path as resolved, see [`resolved_path`]), and its service.
    pub(crate) routes: Vec<(Glob, Glob, RouteService)>,
    pub(crate) default: RouteService,
    /// The upstream alone (no cache), for a request that came back to this
    /// proxy (it answers 508 at once, where through the cache the request
    /// would wait on its own load for the lock timeout), and for one whose
    /// path picks one rule as sent and another as resolved.
    pub(crate) looped: RouteService,
    pub(crate) forward: crate::forward::Forward,
}

/// Sends each request to the first route whose glob matches its path.
#[derive(Clone)]
pub(crate) struct Dispatch {
    pub(crate) table: Arc<RwLock<Arc<Table>>>,
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<CacheBody<UpstreamBody>>;
    type Error = Infallible;
    type Future = <RouteService as Service<Request<Body>>>::Future;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        crate::forward::drop_connection_options(req.headers_mut());
        if let Some(why) = crate::host::host_problem(&req) {
            let head = req.method() == http::Method::HEAD;
            let text = format!("tiercache-proxy: {why}\n");
            let answer = own_answer(http::StatusCode::BAD_REQUEST, text, head);
            return Box::pin(async move { Ok(answer.map(CacheBody::stream)) });
        }
        let table = self.table.read().unwrap_or_else(|e| e.into_inner()).clone();
        if table.forward.came_back(req.headers()) {
            return table.looped.clone().call(req);
        }
        // The rule the path picks as sent and as an upstream resolves it:
        // when they differ, which one the upstream serves is not knowable,
        // so neither caches it (as sent alone, `/api/%63art/items` escaped
        // a `cache = false` rule for `/api/cart/*`; as resolved alone,
        // `/api/cart/x/..%2f..%2fitems`, which most upstreams serve as the
        // cart, landed in a cached rule).
        let path = req.uri().path();
        let resolved = resolved_path(path);
        let routes = &table.routes;
        let as_sent = routes.iter().position(|(glob, _, _)| glob.matches(path));
        let as_resolved = routes
            .iter()
            .position(|(_, folded, _)| folded.matches(&resolved));
        let mut service = match (as_sent, as_resolved) {
            (Some(i), Some(j)) if i == j => routes[i].2.clone(),
            (None, None) => table.default.clone(),
            _ => table.looped.clone(),
        };
        service.call(req)
    }
}

/// The path as an upstream most likely resolves it, for choosing a rule
/// (never keyed or sent on): percent-encodings decoded, `\` read as `/`,
/// each segment's `;` parameters dropped (as Java servers do), `.` and
/// `..` segments resolved, repeated slashes merged, and letters
/// lower-cased (the globs are too).
pub(crate) fn resolved_path(path: &str) -> std::borrow::Cow<'_, str> {
    let plain = |b: &u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'~');
    let bytes = path.as_bytes();
    // Most paths hold nothing to resolve: no copy.
    if !bytes
        .windows(2)
        .any(|w| w[0] == b'/' && matches!(w[1], b'/' | b'.'))
        && bytes.iter().all(|b| plain(b) || matches!(b, b'/' | b'.'))
    {
        return std::borrow::Cow::Borrowed(path);
    }
    let hex = |b: u8| (b as char).to_digit(16);
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match (
            b,
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                i += 3;
                continue;
            }
            _ => decoded.push(b),
        }
        i += 1;
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    // Whether the last segment names a directory (`/a/`, `/a/.`, `/a/b/..`
    // are all `/a/`, RFC 3986 §5.2.4): its slash stays.
    let mut directory = false;
    for segment in decoded.split(|&b| b == b'/' || b == b'\\') {
        let segment = segment.split(|&b| b == b';').next().unwrap_or_default();
        directory = matches!(segment, b"" | b"." | b"..");
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut resolved = Vec::with_capacity(decoded.len() + 1);
    for segment in &segments {
        resolved.push(b'/');
        resolved.extend_from_slice(segment);
    }
    if segments.is_empty() || directory {
        resolved.push(b'/');
    }
    resolved.make_ascii_lowercase();
    std::borrow::Cow::Owned(String::from_utf8_lossy(&resolved).into_owned())
}

#[cfg(test)]
mod tests {
    use super::resolved_path;

    #[test]
    fn a_path_is_resolved_as_an_upstream_would() {
        for (sent, resolved) in [
            ("/api/cart/items", "/api/cart/items"),
            ("/api/%63art/items", "/api/cart/items"),
            ("/api%2Fcart/items", "/api/cart/items"),
            ("/api//cart/./items", "/api/cart/items"),
            ("/api/x/../cart/items", "/api/cart/items"),
            ("/../../api/cart/items", "/api/cart/items"),
            ("/api\\cart\\items", "/api/cart/items"),
            ("/api%5Ccart", "/api/cart"),
            ("/api/cart/.", "/api/cart/"),
            ("/api/cart/x/..", "/api/cart/"),
            ("/api/cart/;", "/api/cart/"),
            ("/api/cart/x/..%2f..%2fitems", "/api/items"),
            ("/api/cart;jsessionid=1/items;x", "/api/cart/items"),
            ("/API/Cart/Items", "/api/cart/items"),
            ("/static/", "/static/"),
            ("/static//", "/static/"),
            ("/", "/"),
            ("/..", "/"),
        ] {
            assert_eq!(resolved_path(sent), resolved, "{sent}");
        }
        assert!(matches!(
            resolved_path("/static/site.v2.css"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
