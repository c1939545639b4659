//! [`ResponseCache`]: the tower service. Its request path is: classify the
//! request, build its key, ask the engine (which owns the whole sequence:
//! L1, refreshes, single flight, L2, fleet lock, origin, stale-if-error,
//! storage), and frame the answer.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tiercache_core::{Begin, Served};
use tower::{Layer, Service};
use tracing::Instrument;

use crate::body::{BoxError, CacheBody};
use crate::cacheable::Reason;
use crate::future::ResponseFuture;
use crate::headers::Outcome;
use crate::invalidate::{invalidation_keys, is_safe};
use crate::layer::ResponseCacheLayer;
use crate::origin::HttpOrigin;
use crate::paths::Invalidate;
use crate::request::{asks_only_if_cached, drop_only_if_cached, prepare};
use crate::route::{Ask, OwnedView, RequestView, Route};
use crate::stored_only::{StoredOnly, stored_only};
use crate::write::write_through;

/// Caches the responses of `S`; built by [`ResponseCacheLayer`].
///
/// Never changes `S`'s error type. GET and HEAD are cached (HEAD is answered
/// from the GET entry, and a HEAD miss is loaded as a GET so it never stores an
/// empty body); everything else passes through labelled `BYPASS`, and a
/// successful unsafe request invalidates the URLs it names.
#[derive(Debug, Clone)]
pub struct ResponseCache<S> {
    inner: S,
    // One Arc: routers clone the service per request.
    route: Option<Arc<Route>>,
    /// What a successful write also invalidates (a [`PathLayer`]'s
    /// `on_write` for the request's path; empty otherwise, no allocation).
    ///
    /// [`PathLayer`]: crate::paths::PathLayer
    also: Vec<Invalidate>,
}

impl<S> ResponseCache<S> {
    /// Wraps `inner` with `layer`'s engine, policy and settings.
    pub fn new(inner: S, layer: ResponseCacheLayer) -> Self {
        Self {
            inner,
            route: layer.into_route(),
            also: Vec::new(),
        }
    }

    /// For one request of a [`PathLayer`](crate::paths::PathLayer): its
    /// rule's route, and what a write there also invalidates.
    pub(crate) fn for_request(inner: S, route: Arc<Route>, also: Vec<Invalidate>) -> Self {
        Self {
            inner,
            route: Some(route),
            also,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> ResponseCache<S> {
    fn take_ready(&mut self) -> S {
        take_ready(&mut self.inner)
    }
}

/// The service `poll_ready` readied; a clone stays for the next call
/// (tower's contract: only the readied service may be called).
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ResponseCache<S>
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
        let Some(route) = &self.route else {
            return ResponseFuture::inner(self.inner.call(req), None);
        };
        let route = route.clone();
        // Normally started at `layer()`; this covers a layer built outside
        // any runtime (one relaxed load per request once started).
        route.engine_metrics.keep_current(&route.engine);
        let (mut parts, body) = req.into_parts();
        key_on_original_uri(&mut parts);
        route.canonicalize(&mut parts);
        if !is_safe(&parts.method) {
            route.bypass(Reason::Method);
            let (keys, target) = invalidation_keys(&parts, &route.config);
            let future = self.inner.call(for_inner(Request::from_parts(parts, body)));
            let also = std::mem::take(&mut self.also);
            let write = write_through(route, future, keys, target, also);
            return ResponseFuture::boxed(Box::pin(write));
        }
        route.cookies.seen();
        // A GET with a body ("fat GET"), found by its framing headers or,
        // in process, by the body itself: the body is not keyed.
        let fat = body.size_hint().lower() > 0;
        let prepared = if fat {
            Err(Reason::RequestBody)
        } else {
            prepare(&mut parts, &route.config)
        };
        let prepared = match prepared {
            Ok(prepared) => prepared,
            // Nothing is stored for a request that skips the cache.
            Err(_)
                if (parts.method == http::Method::GET || parts.method == http::Method::HEAD)
                    && (asks_only_if_cached(&parts.headers) || stored_only(&parts).is_some()) =>
            {
                let head = parts.method == http::Method::HEAD;
                return ResponseFuture::ready(route.not_cached(head));
            }
            Err(reason) => {
                route.bypass(reason);
                tracing::debug!(outcome = "BYPASS", reason = reason.as_str(), "tiercache");
                let label = route
                    .config
                    .emit_headers
                    .then(|| (Outcome::Bypass(reason), route.engine.clone()));
                let req = for_inner(Request::from_parts(parts, body));
                return ResponseFuture::inner(self.inner.call(req), label);
            }
        };
        // A reload the route honours, and no origin: nothing stored may
        // answer without validation, and validating asks the origin.
        if prepared.reload && (prepared.only_if_cached || stored_only(&parts).is_some()) {
            return ResponseFuture::ready(route.not_cached(prepared.head));
        }
        let ask = Ask {
            head: prepared.head,
            conditional: prepared.conditional,
            credentialed: prepared.credentialed,
            range: prepared.range,
        };
        let view = RequestView {
            route: &route,
            headers: &parts.headers,
            reload: prepared.reload,
        };
        let begun = route.engine.begin(&prepared.key, &route.policy, &view);
        // One span per cached request: outcome, tier and the key's hash
        // (never the key or the body).
        let span = tracing::debug_span!(
            "tiercache",
            key = %prepared.key.hash(),
            outcome = tracing::field::Empty,
            tier = tracing::field::Empty,
        );
        let entered = span.enter();
        let miss = match begun {
            Begin::Hit(hit) => {
                match hit.answer.served {
                    Served::Hit => route.metrics.hit_l1(),
                    _ => route.metrics.stale(),
                }
                if hit.early_refresh {
                    route.metrics.early_refresh();
                }
                let now = hit.at;
                let outcome = match hit.answer.served {
                    Served::Stale(why) => Outcome::Stale {
                        tier: hit.answer.source,
                        ttl: crate::headers::stale_ttl(hit.answer.entry.times().fresh_until, now),
                        collapsed: false,
                        detail: why.as_str(),
                    },
                    _ => Outcome::Hit {
                        tier: hit.answer.source,
                        ttl: hit.remaining.as_secs(),
                        collapsed: false,
                    },
                };
                let response = route.entry_response(&hit.answer.entry, now, &ask, &outcome);
                if let Some(refresh) = hit.refresh {
                    if prepared.only_if_cached {
                        drop_only_if_cached(&mut parts.headers);
                    }
                    parts.extensions.remove::<StoredOnly>();
                    // Kept while the refresh runs (see below).
                    crate::own_head::own_head(&mut parts);
                    let origin = HttpOrigin {
                        route: route.clone(),
                        inner: self.take_ready(),
                        req: Request::from_parts(parts, body),
                        primary: prepared.key,
                        credentialed: ask.credentialed,
                        early: None,
                    };
                    refresh.spawn(origin);
                }
                return ResponseFuture::ready(response);
            }
            Begin::Miss(miss) => miss,
        };
        let mark = stored_only(&parts);
        if mark == Some(StoredOnly::L1) {
            // On the spot or not at all: L1 has just missed.
            return ResponseFuture::ready(route.not_cached(ask.head));
        }
        // Kept while the load runs, or while another's does: copied out
        // of the connection's read buffer, which it would pin.
        crate::own_head::own_head(&mut parts);
        if prepared.only_if_cached || mark.is_some() {
            // From storage alone: L2 (L1 has just missed), or a 504.
            let select = OwnedView {
                route: route.clone(),
                headers: std::mem::take(&mut parts.headers),
            };
            drop(entered);
            let future = async move {
                Ok(match miss.stored(select).await {
                    Some(answer) => route.answer(&answer, &ask),
                    None => route.not_cached(ask.head),
                })
            };
            return ResponseFuture::boxed(Box::pin(future.instrument(span)));
        }
        let hit_for_miss = miss.hit_for_miss();
        if hit_for_miss {
            route.metrics.bypass(Reason::HitForMiss);
            // Alone and unstored: the origin answers the range itself.
            if let Some(range) = &ask.range {
                range.restore(&mut parts.headers);
            }
        }
        // A body still coming after a while goes on to this request as it
        // is read to be stored, unless the request wants the entry itself.
        let (early, answered_early) =
            if ask.head || ask.range.is_some() || !ask.conditional.is_empty() {
                (None, None)
            } else {
                let (early, answered) = tokio::sync::oneshot::channel();
                (Some(early), Some(answered))
            };
        let origin = HttpOrigin {
            route: route.clone(),
            inner: self.take_ready(),
            req: Request::from_parts(parts, body),
            primary: prepared.key,
            credentialed: ask.credentialed,
            early,
        };
        drop(entered);
        // Boxed out here: made inside the block below, the load's future
        // took room in the block's own as well (rustc keeps a temporary's
        // place), ~11 KiB more for every request in flight.
        let mut run = Box::pin(miss.run(origin));
        let future = async move {
            let Some(mut answered_early) = answered_early else {
                return route.respond(run.await, &ask);
            };
            let mut res = tokio::select! {
                biased;
                fetched = &mut run => match answered_early.try_recv() {
                    // Sent early, then the fetch ended (what it passed on
                    // went to the early response): that one answers.
                    Ok((res, _)) => res,
                    Err(_) => return route.respond(fetched, &ask),
                },
                Ok((res, whole)) = &mut answered_early => {
                    // The fetch runs on by itself, to store the body, once
                    // the client has all of it (HTTP/1 stops reading at
                    // its `Content-Length`). A client gone before lets it
                    // go as any caller that left (it runs on while
                    // `max_detached_fills` allows, or while others wait).
                    let fetch = async move {
                        tokio::select! {
                            _ = &mut run => {}
                            told = whole => {
                                if told.is_ok() {
                                    let _ = run.await;
                                }
                            }
                        }
                    };
                    tokio::spawn(fetch.in_current_span());
                    res
                }
            };
            route.answered_early(&mut res, hit_for_miss);
            Ok(res)
        };
        ResponseFuture::boxed(Box::pin(future.instrument(span)))
    }
}

/// Applying the base layer (`ResponseCacheLayer::new(engine)`, no policy)
/// fails loudly when the app is built: it would cache nothing. A route's
/// layer (`cache.route(policy)?`) is what wraps a service.
///
/// ```should_panic
/// use axum::{Router, routing::get};
/// use tiercache_core::TieredCache;
/// use tiercache_http::ResponseCacheLayer;
///
/// # #[tokio::main] async fn main() {
/// let cache = ResponseCacheLayer::new(TieredCache::builder().build().unwrap());
/// // Panics: "ResponseCacheLayer::new(engine) has no policy …"
/// let _app: Router = Router::new().route("/", get(|| async { "x" }).layer(cache));
/// # }
/// ```
impl<S> Layer<S> for ResponseCacheLayer {
    type Service = ResponseCache<S>;

    fn layer(&self, inner: S) -> Self::Service {
        assert!(
            self.route.is_some(),
            "tiercache: ResponseCacheLayer::new(engine) has no policy, so as a layer it would \
             cache nothing; apply a route's layer instead: `.layer(cache.route(Policy::ttl(..))?)`"
        );
        ResponseCache::new(inner, self.clone())
    }
}

/// The URI the inner service routed the request by, when the cache keys
/// on another (see [`key_on_original_uri`]).
#[derive(Debug, Clone)]
pub(crate) struct InnerUri(pub(crate) http::Uri);

/// Puts the URI the client sent in `parts` when an outer axum router
/// changed it: inside a nested router (`Router::nest("/v1", ..)`) a request
/// for `/v1/users` arrives as `/users`, and keyed on that, `/v1/users` and
/// `/v2/users` would share one entry (and a write to one would invalidate
/// the other's key). The key, the invalidations and `Location` are all
/// about the URL the client asked for; the inner service gets back the
/// URI it routes by ([`for_inner`]).
// On every L1 hit: inlined into the application's crate too.
#[inline]
fn key_on_original_uri(parts: &mut http::request::Parts) {
    let Some(axum::extract::OriginalUri(original)) = parts.extensions.get() else {
        return;
    };
    // Most often a clone of the URI itself: the same bytes, found without
    // comparing them.
    let same_bytes = std::ptr::eq(original.path(), parts.uri.path())
        && match (original.query(), parts.uri.query()) {
            (Some(a), Some(b)) => std::ptr::eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        }
        && original.authority() == parts.uri.authority()
        && original.scheme() == parts.uri.scheme();
    if same_bytes || *original == parts.uri {
        return;
    }
    let inner = std::mem::replace(&mut parts.uri, original.clone());
    parts.extensions.insert(InnerUri(inner));
}

/// `req` with the URI its inner service routes by (see [`key_on_original_uri`]).
pub(crate) fn for_inner<B>(mut req: Request<B>) -> Request<B> {
    if let Some(InnerUri(mut uri)) = req.extensions_mut().remove() {
        // The host as keyed (`prepare` lower-cases it), the path as routed.
        if let (Some(keyed), Some(inner)) = (req.uri().authority(), uri.authority())
            && keyed.as_str() != inner.as_str()
        {
            let mut parts = uri.clone().into_parts();
            parts.authority = Some(keyed.clone());
            if let Ok(lowered) = http::Uri::from_parts(parts) {
                uri = lowered;
            }
        }
        *req.uri_mut() = uri;
    }
    req
}
