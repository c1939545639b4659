//! [`Route`]: what one annotated route shares across its requests (the
//! engine, its policy, the layer's settings, its metrics), and the rules that
//! tell which stored entries answer a request.

use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, Response};
use tiercache_core::{CacheKey, Entry, Event, Policy, Select, TieredCache};

use crate::body::CacheBody;
use crate::cacheable::Reason;
use crate::config::HttpConfig;
use crate::headers::{self, Outcome};
use crate::key::{request_variant, variant_key, variant_matches};
use crate::metrics::{EngineMetrics, RouteMetrics};
use crate::reading::Reading;
use crate::request::Conditional;
use crate::variants::Variants;

/// The engine, the route's policy and the layer's settings.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) engine: TieredCache,
    pub(crate) variants: Variants,
    /// Bodies being read to be stored (see [`Reading`]).
    pub(crate) reading: Arc<Reading>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) config: Arc<HttpConfig>,
    pub(crate) metrics: Arc<RouteMetrics>,
    /// The engine's metrics, kept current by a task of theirs.
    pub(crate) engine_metrics: Arc<EngineMetrics>,
    /// GET and HEAD requests seen, and those a `Cookie` made bypass: when
    /// cookies cause most bypasses, a warning says so, once.
    pub(crate) cookies: CookieWatch,
}

impl Route {
    /// Puts the canonical authority, when one is set, in the request's
    /// `Host` (and its URI, when absolute): the key, the invalidations and
    /// the origin all see it, so what the origin writes fits every client.
    pub(crate) fn canonicalize(&self, parts: &mut http::request::Parts) {
        let Some(authority) = &self.config.canonical_authority else {
            return;
        };
        let value = http::HeaderValue::from_str(authority.as_str())
            .expect("an authority is a valid header value");
        parts.headers.insert(http::header::HOST, value);
        if parts.uri.authority().is_some() {
            let mut uri = parts.uri.clone().into_parts();
            uri.authority = Some(authority.clone());
            if let Ok(uri) = http::Uri::from_parts(uri) {
                parts.uri = uri;
            }
        }
    }
}

/// Watches a route for the newcomer's trap: one analytics cookie on every
/// request, a hit ratio of zero, and nothing saying why.
#[derive(Debug, Default)]
pub(crate) struct CookieWatch {
    seen: std::sync::atomic::AtomicU64,
    bypassed: std::sync::atomic::AtomicU64,
    warned: std::sync::atomic::AtomicBool,
}

impl CookieWatch {
    pub(crate) fn seen(&self) {
        self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts a cookie bypass; true the first time they are most of at
    /// least 20 requests (then the caller warns).
    fn bypassed(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let bypassed = self.bypassed.fetch_add(1, Relaxed) + 1;
        bypassed >= 20 && bypassed * 2 > self.seen.load(Relaxed) && !self.warned.swap(true, Relaxed)
    }
}

/// What the client asked beyond the resource: a HEAD, its own validators,
/// whether it sent credentials.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub(crate) head: bool,
    pub(crate) conditional: Conditional,
    pub(crate) credentialed: bool,
    /// One byte range to cut from the answer (GET only).
    pub(crate) range: Option<crate::range::RangeAsk>,
}

impl Route {
    pub(crate) fn bypass(&self, reason: Reason) {
        self.engine.record_bypass(reason.as_str());
        self.metrics.bypass(reason);
        if reason == Reason::Cookie && self.cookies.bypassed() {
            tracing::warn!(
                route = self.metrics.name(),
                "tiercache: most requests on this route carry a Cookie and bypass the cache \
                 (the safe default). If its responses do not depend on cookies, use \
                 `.ignore_cookies()` (proxy: --ignore-cookies), or key on the ones that \
                 matter with `.key_cookies([..])` (--key-cookie NAME)"
            );
        }
    }

    pub(crate) fn label(&self, headers: &mut HeaderMap, outcome: &Outcome) {
        outcome.trace();
        if self.config.emit_headers {
            headers::apply(headers, outcome, self.engine.hit_ratio());
        }
    }

    /// The response for `entry`: its stored head and body (or a 304 to a
    /// client whose validators match), labelled with `outcome`.
    pub(crate) fn entry_response<B>(
        &self,
        entry: &Entry,
        now: SystemTime,
        ask: &Ask,
        outcome: &Outcome,
    ) -> Response<CacheBody<B>> {
        outcome.trace();
        let label = self
            .config
            .emit_headers
            .then(|| (outcome, self.engine.hit_ratio()));
        let view = headers::view(entry, &self.config.targets);
        let not_modified = view.not_modified(&ask.conditional);
        let res = headers::from_entry(entry, &view, now, ask.head, not_modified, label);
        match &ask.range {
            Some(range) if !not_modified => range.answer(res, &entry.value().body),
            _ => res,
        }
    }

    /// Whether `entry` may answer a request with these headers: its `Vary`
    /// variant, and its content coding when it was not varied on it.
    pub(crate) fn fits(&self, entry: &Entry, request: &HeaderMap) -> bool {
        variant_matches(entry, request)
            && headers::view(entry, &self.config.targets).encoding_fits(request)
    }

    /// Whether `entry` must be revalidated before any reuse (`no-cache`).
    pub(crate) fn must_revalidate(&self, entry: &Entry) -> bool {
        headers::view(entry, &self.config.targets).revalidate
    }

    /// The key of this request's variant, when `latest` (the URL's latest
    /// response) is another variant whose `Vary` names say where to look.
    pub(crate) fn variant_key(
        &self,
        requested: &CacheKey,
        latest: &Entry,
        request: &HeaderMap,
    ) -> Option<CacheKey> {
        (!latest.variant().is_empty() && !variant_matches(latest, request))
            .then(|| variant_key(requested, &request_variant(latest, request)))
    }

    /// Per-route metrics for what the engine did that an answer does not show.
    pub(crate) fn observe(&self, event: Event) {
        match event {
            Event::LockWait(took) => self.metrics.lock_wait(took),
            Event::LockTimeout => self.metrics.lock_timeout(),
            _ => {}
        }
    }
}

/// A request's route and fields, owned: what selects an entry from L2 for
/// a request that may not reach the origin (`only-if-cached`).
#[derive(Debug)]
pub(crate) struct OwnedView {
    pub(crate) route: Arc<Route>,
    pub(crate) headers: HeaderMap,
}

impl Select for OwnedView {
    fn accepts(&self, entry: &Entry) -> bool {
        self.route.fits(entry, &self.headers)
    }

    fn variant_key(&self, requested: &CacheKey, latest: &Entry) -> Option<CacheKey> {
        self.route.variant_key(requested, latest, &self.headers)
    }

    fn must_revalidate(&self, entry: &Entry) -> bool {
        self.route.must_revalidate(entry)
    }
}

/// A request as the engine's first step sees it: which entries answer it.
#[derive(Debug)]
pub(crate) struct RequestView<'a> {
    pub(crate) route: &'a Route,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) reload: bool,
}

impl Select for RequestView<'_> {
    fn accepts(&self, entry: &Entry) -> bool {
        self.route.fits(entry, self.headers)
    }

    fn variant_key(&self, requested: &CacheKey, latest: &Entry) -> Option<CacheKey> {
        self.route.variant_key(requested, latest, self.headers)
    }

    fn must_revalidate(&self, entry: &Entry) -> bool {
        self.route.must_revalidate(entry)
    }

    fn reload(&self) -> bool {
        self.reload
    }

    fn observe(&self, event: Event) {
        self.route.observe(event);
    }
}
