//! [`ResponseCache`]: the tower service.

use std::collections::VecDeque;
use std::panic::resume_unwind;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use http::header::{
    ETAG, HeaderName, HeaderValue, IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE,
    IF_UNMODIFIED_SINCE, LAST_MODIFIED,
};
use http::{HeaderMap, Method, Request, Response, StatusCode, request, response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tiercache_core::{
    CacheKey, Entry, Fill, FleetJoin, FleetLock, FlightError, FlightResult, Freshness, Join,
    Leader, Lifetime, Lookup, Policy, Source, TieredCache, Waited,
};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::body::{BoxError, CacheBody};
use crate::cache_control::targeted;
use crate::cacheable::{Reason, content_length, response_storable, status_heuristic};
use crate::freshness::OriginFreshness;
use crate::future::ResponseFuture;
use crate::headers::{self, Outcome, strip_hop_by_hop};
use crate::invalidate::{invalidation_keys, is_safe, location_keys};
use crate::key::{family_tag, request_variant, variant_for, variant_key, variant_matches};
use crate::layer::{HttpConfig, ResponseCacheLayer};
use crate::metrics::RouteMetrics;
use crate::request::{Conditional, prepare};
use crate::variants::Variants;

/// Caches the responses of `S`; built by [`ResponseCacheLayer`].
///
/// Never changes `S`'s error type. GET and HEAD are cached (HEAD is answered
/// from the GET entry, and a HEAD miss is loaded as a GET so it never stores an
/// empty body); everything else passes through labelled `BYPASS`. Background
/// refreshes (stale-while-revalidate, XFetch) send a copy of the request's
/// head with an empty body, hence `ReqB: Default`.
#[derive(Debug, Clone)]
pub struct ResponseCache<S> {
    inner: S,
    // One Arc: routers clone the service per request.
    ctx: Option<Arc<Ctx>>,
}

impl<S> ResponseCache<S> {
    /// Wraps `inner` with `layer`'s engine, policy and settings.
    pub fn new(inner: S, layer: ResponseCacheLayer) -> Self {
        let ctx = layer.route.map(|(policy, metrics)| {
            Arc::new(Ctx {
                engine: layer.engine,
                variants: layer.variants,
                policy,
                config: layer.config,
                metrics,
            })
        });
        Self { inner, ctx }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// The engine, the route's policy and the layer's settings.
#[derive(Debug)]
struct Ctx {
    engine: TieredCache,
    variants: Variants,
    policy: Arc<Policy>,
    config: Arc<HttpConfig>,
    metrics: Arc<RouteMetrics>,
}

impl Ctx {
    /// Counts an answer after an L1 miss, in the engine and the route.
    fn served(&self, source: Source) {
        self.engine.record_served(source);
        self.metrics.served(source);
    }

    fn stale_served(&self) {
        self.engine.record_stale_served();
        self.metrics.stale();
    }

    fn bypass(&self, reason: Reason) {
        self.engine.record_bypass(reason.as_str());
        self.metrics.bypass(reason);
    }

    fn origin_load(&self, took: std::time::Duration) {
        self.engine.record_origin_load(took);
        self.metrics.origin(took);
    }

    fn label(&self, headers: &mut HeaderMap, outcome: &Outcome) {
        outcome.trace();
        if self.config.emit_headers {
            headers::apply(headers, outcome, self.engine.hit_ratio());
        }
    }

    fn entry_response<B>(
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
        headers::from_entry(entry, &view, now, ask.head, not_modified, label)
    }

    /// Whether `entry` may answer a request with these headers: its `Vary`
    /// variant, and its content coding when it was not varied on it.
    fn fits(&self, entry: &Entry, request: &HeaderMap) -> bool {
        variant_matches(entry, request)
            && headers::view(entry, &self.config.targets).encoding_fits(request)
    }

    /// Whether `entry` must be revalidated before any reuse (`no-cache`).
    fn must_revalidate(&self, entry: &Entry) -> bool {
        headers::view(entry, &self.config.targets).revalidate
    }

    /// Whether `entry` may stand in for a failed or slow origin.
    fn stale_usable(&self, entry: &Entry) -> bool {
        matches!(
            entry.freshness(self.engine.now()),
            Freshness::Stale | Freshness::StaleIfError
        )
    }
}

/// What the client asked beyond the resource: a HEAD, its own validators,
/// whether it sent credentials.
#[derive(Debug, Clone)]
struct Ask {
    head: bool,
    conditional: Conditional,
    credentialed: bool,
}

/// What a load produced.
enum Loaded<B> {
    /// Stored (or renewed by a 304); answer from the entry.
    Stored(Entry),
    /// Not stored; the origin's response, body streaming.
    Passed(Response<CacheBody<B>>, Reason),
}

/// What a fill (the leader's task) produced.
enum Filled<B> {
    /// A shareable entry from L2 or the origin.
    Entry(Entry, Source),
    /// The origin failed and this stale entry answers instead (stale-if-error).
    Stale(Entry),
    /// The origin's response, not stored.
    Passed(Response<CacheBody<B>>, Reason),
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ResponseCache<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + Default + Send + 'static,
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
        let Some(ctx) = &self.ctx else {
            return ResponseFuture::inner(self.inner.call(req), None);
        };
        let ctx = ctx.clone();
        let engine = &ctx.engine;
        let (mut parts, body) = req.into_parts();
        if !is_safe(&parts.method) {
            ctx.bypass(Reason::Method);
            let (keys, target) = invalidation_keys(&parts, &ctx.config);
            let future = self.inner.call(Request::from_parts(parts, body));
            return ResponseFuture::boxed(Box::pin(write_through(ctx, future, keys, target)));
        }
        // A GET with a body ("fat GET"), found by its framing headers or,
        // in process, by the body itself: the body is not keyed.
        let fat = body.size_hint().lower() > 0;
        let prepared = if fat {
            Err(Reason::RequestBody)
        } else {
            prepare(&mut parts, &ctx.config)
        };
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(reason) => {
                ctx.bypass(reason);
                tracing::debug!(outcome = "BYPASS", reason = reason.as_str(), "tiercache");
                let label = ctx
                    .config
                    .emit_headers
                    .then(|| (Outcome::Bypass(reason), engine.clone()));
                let req = Request::from_parts(parts, body);
                return ResponseFuture::inner(self.inner.call(req), label);
            }
        };
        let primary = prepared.key;
        let mut key = primary.clone();
        let ask = Ask {
            head: prepared.head,
            conditional: prepared.conditional,
            credentialed: prepared.credentialed,
        };
        let now = engine.now();
        let lookup = if prepared.reload {
            Lookup::Miss {
                fallback: engine.peek(&key).filter(|e| ctx.fits(e, &parts.headers)),
            }
        } else {
            let mut lookup =
                engine.lookup_at(&key, now, &ctx.policy, |e| ctx.fits(e, &parts.headers));
            // The URL's latest response is another variant: its `Vary` names
            // say which variant key this request's answer is under.
            if matches!(lookup, Lookup::Miss { fallback: None })
                && let Some(latest) = engine.peek(&primary)
                && !latest.variant().is_empty()
                && !variant_matches(&latest, &parts.headers)
            {
                key = variant_key(&primary, &request_variant(&latest, &parts.headers));
                lookup = engine.lookup_at(&key, now, &ctx.policy, |e| ctx.fits(e, &parts.headers));
            }
            lookup
        };
        if matches!(lookup, Lookup::Fresh { .. }) {
            ctx.metrics.hit_l1();
        }
        // One span per cached request: outcome, tier and the key's hash
        // (never the key or the body).
        let span = tracing::debug_span!(
            "tiercache",
            key = %primary.hash(),
            outcome = tracing::field::Empty,
            tier = tracing::field::Empty,
        );
        let entered = span.enter();
        let keys = Keys {
            primary,
            flight: key,
        };
        let (fallback, revalidate) = match lookup {
            Lookup::Fresh { entry, .. } if ctx.must_revalidate(&entry) => (Some(entry), true),
            Lookup::Fresh {
                entry,
                remaining,
                refresh,
            } => {
                if refresh {
                    ctx.metrics.early_refresh();
                    self.refresh_in_background(&ctx, &parts, &keys, &entry, &ask);
                }
                let outcome = Outcome::Hit {
                    tier: Source::L1,
                    ttl: remaining.as_secs(),
                    collapsed: false,
                };
                return ResponseFuture::ready(ctx.entry_response(&entry, now, &ask, &outcome));
            }
            Lookup::Stale { entry } => {
                ctx.stale_served();
                self.refresh_in_background(&ctx, &parts, &keys, &entry, &ask);
                let outcome = Outcome::Stale { detail: None };
                return ResponseFuture::ready(ctx.entry_response(&entry, now, &ask, &outcome));
            }
            Lookup::Miss { fallback } => (fallback, prepared.reload),
        };
        let inner = self.take_ready();
        let req = Request::from_parts(parts, body);
        let miss = Miss {
            keys,
            ask,
            fallback,
            revalidate,
        };
        drop(entered);
        ResponseFuture::boxed(Box::pin(miss.run(ctx, inner, req).instrument(span)))
    }
}

/// An unsafe request passes through; when it succeeds (2xx, 3xx) the target
/// URI and any same-origin `Location` / `Content-Location` are invalidated in
/// L1 and L2 before the response is returned (RFC 9111 §4.4).
async fn write_through<F, ResB, E>(
    ctx: Arc<Ctx>,
    future: F,
    mut keys: Vec<CacheKey>,
    request: crate::invalidate::Target,
) -> Result<Response<CacheBody<ResB>>, E>
where
    F: std::future::Future<Output = Result<Response<ResB>, E>>,
{
    let res = future.await?;
    if res.status().is_success() || res.status().is_redirection() {
        keys.extend(location_keys(res.headers(), &request));
        // One message per URL: its key and the variants this instance knows,
        // with its family tag, under which the shared tier recorded the
        // variants other instances stored.
        for key in keys {
            let mut known = ctx.variants.take(&key);
            let tag = family_tag(&key);
            known.push(key);
            ctx.engine.invalidate_tag_and_keys(tag, &known).await;
        }
    }
    let mut res = res.map(CacheBody::stream);
    ctx.label(res.headers_mut(), &Outcome::Bypass(Reason::Method));
    Ok(res)
}

impl<S: Clone> ResponseCache<S> {
    /// The service `poll_ready` readied; a clone stays for the next call.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }

    /// Starts one background refresh of `stale` (nothing when a load for the
    /// key is already running). It revalidates with the entry's validators,
    /// reads L2 first, and goes through the single flight.
    fn refresh_in_background<ReqB, ResB>(
        &mut self,
        ctx: &Arc<Ctx>,
        parts: &request::Parts,
        keys: &Keys,
        stale: &Entry,
        ask: &Ask,
    ) where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Default + Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let Some(leader) = ctx.engine.try_lead(&keys.flight) else {
            return;
        };
        let mut head = parts.clone();
        head.method = Method::GET;
        let req = Request::from_parts(head, ReqB::default());
        let inner = self.take_ready();
        let task = fill(
            ctx.clone(),
            inner,
            req,
            keys.clone(),
            leader,
            Some(stale.clone()),
            false,
            ask.credentialed,
        );
        tokio::spawn(async move {
            let _ = task.await;
        });
    }
}

/// The keys of one request: its URL's primary key (the latest response,
/// hit-for-miss marks, variant tracking) and the key it loads under (the
/// primary, or the variant key when the URL's `Vary` names are known).
#[derive(Debug, Clone)]
struct Keys {
    primary: CacheKey,
    flight: CacheKey,
}

/// A request that missed L1 (or must revalidate its entry).
struct Miss {
    keys: Keys,
    ask: Ask,
    /// An entry to revalidate, or to answer with when the origin fails.
    fallback: Option<Entry>,
    /// Go to the origin (with `fallback`'s validators) without reading L2.
    revalidate: bool,
}

impl Miss {
    async fn run<S, ReqB, ResB>(
        self,
        ctx: Arc<Ctx>,
        inner: S,
        req: Request<ReqB>,
    ) -> Result<Response<CacheBody<ResB>>, S::Error>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let Miss {
            keys,
            ask,
            fallback,
            revalidate,
        } = self;
        if ctx.engine.is_uncacheable(&keys.primary) {
            ctx.bypass(Reason::HitForMiss);
            let loaded = load(&ctx, inner, as_get(req), &keys, None, ask.credentialed).await?;
            return Ok(respond_loaded(
                &ctx,
                loaded,
                &ask,
                false,
                Some(Reason::HitForMiss),
            ));
        }
        match ctx.engine.join(&keys.flight) {
            Join::Leader(leader) => {
                // Detached: if this request is dropped (client gone), the fill still
                // completes, stores, and wakes the followers.
                let mut task = tokio::spawn(fill(
                    ctx.clone(),
                    inner,
                    as_get(req),
                    keys,
                    leader,
                    fallback.clone(),
                    revalidate,
                    ask.credentialed,
                ));
                let usable = fallback.filter(|e| ctx.stale_usable(e));
                let joined = match (&usable, ctx.policy.soft_timeout()) {
                    (Some(stale), Some(soft)) => {
                        match tokio::time::timeout(soft, &mut task).await {
                            Ok(joined) => joined,
                            // The origin is slow and a stale answer is at hand:
                            // give it now; the fill goes on in the background.
                            Err(_) => {
                                return Ok(respond_stale(&ctx, stale, &ask, "origin-timeout"));
                            }
                        }
                    }
                    _ => task.await,
                };
                let filled = match joined {
                    Ok(filled) => filled?,
                    Err(e) if e.is_panic() => resume_unwind(e.into_panic()),
                    Err(_) => return Ok(error_response(&ctx, StatusCode::SERVICE_UNAVAILABLE)),
                };
                Ok(match filled {
                    Filled::Entry(entry, source) => {
                        respond_entry(&ctx, &entry, source, &ask, false)
                    }
                    Filled::Stale(entry) => respond_stale(&ctx, &entry, &ask, "origin-error"),
                    Filled::Passed(res, reason) => {
                        respond_loaded(&ctx, Loaded::Passed(res, reason), &ask, false, None)
                    }
                })
            }
            Join::Follower(follower) => {
                let started = tokio::time::Instant::now();
                let waited = ctx.engine.wait(follower, &ctx.policy).await;
                ctx.metrics.lock_wait(started.elapsed());
                if matches!(waited, Waited::TimedOut) {
                    ctx.metrics.lock_timeout();
                }
                match waited {
                    Waited::Done(FlightResult::Shared(entry, source))
                        if ctx.fits(&entry, req.headers()) =>
                    {
                        Ok(respond_entry(&ctx, &entry, source, &ask, true))
                    }
                    Waited::Done(FlightResult::Failed(FlightError::Panicked)) => {
                        ctx.served(Source::Origin);
                        Ok(error_response(&ctx, StatusCode::INTERNAL_SERVER_ERROR))
                    }
                    // Released (not shareable), another variant, a timeout or an
                    // abandoned load: this request goes to the origin itself.
                    _ => {
                        let loaded =
                            load(&ctx, inner, as_get(req), &keys, None, ask.credentialed).await?;
                        Ok(respond_loaded(&ctx, loaded, &ask, true, None))
                    }
                }
            }
        }
    }
}

/// The leader's fill: L2 first (unless `revalidate`), then the origin
/// (revalidating `stale` when given, and falling back to it when the origin
/// fails); completes the flight.
#[allow(clippy::too_many_arguments)]
async fn fill<S, ReqB, ResB>(
    ctx: Arc<Ctx>,
    inner: S,
    req: Request<ReqB>,
    keys: Keys,
    leader: Leader,
    mut stale: Option<Entry>,
    revalidate: bool,
    credentialed: bool,
) -> Result<Filled<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    // A copy: the request body need not be `Sync` to be held across the read.
    let request_headers = req.headers().clone();
    if !revalidate && let Some(entry) = read_l2(&ctx, &keys, &request_headers).await {
        if !ctx.must_revalidate(&entry) {
            leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
            return Ok(Filled::Entry(entry, Source::L2));
        }
        stale = Some(entry);
    }
    // One load per key across the fleet: take the shared lock, or wait for
    // the instance that holds it and answer with what it stored.
    let lock = if revalidate {
        FleetLock::local()
    } else {
        let fits = |e: &Entry| ctx.fits(e, &request_headers) && !ctx.must_revalidate(e);
        match ctx.engine.lead_fleet(&keys.flight, &ctx.policy, fits).await {
            FleetJoin::Filled(entry) => {
                leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
                return Ok(Filled::Entry(entry, Source::L2));
            }
            FleetJoin::Lead(lock) => lock,
        }
    };
    let req = match &stale {
        Some(stale) => with_validators(req, stale),
        None => req,
    };
    let usable_on_error = |stale: &Option<Entry>| stale.clone().filter(|e| ctx.stale_usable(e));
    let loaded = load(&ctx, inner, req, &keys, stale.as_ref(), credentialed).await;
    // After the store was queued: the waiting instances read it.
    lock.release(matches!(loaded, Ok(Loaded::Stored(_))));
    match loaded {
        Ok(Loaded::Stored(entry)) => {
            leader.complete(FlightResult::Shared(entry.clone(), Source::Origin));
            Ok(Filled::Entry(entry, Source::Origin))
        }
        Ok(Loaded::Passed(res, reason)) => match usable_on_error(&stale) {
            Some(stale) if is_origin_error(res.status()) => {
                leader.complete(FlightResult::Shared(stale.clone(), Source::L1));
                Ok(Filled::Stale(stale))
            }
            _ => {
                leader.complete(FlightResult::Released);
                Ok(Filled::Passed(res, reason))
            }
        },
        Err(e) => match usable_on_error(&stale) {
            Some(stale) => {
                leader.complete(FlightResult::Shared(stale.clone(), Source::L1));
                Ok(Filled::Stale(stale))
            }
            None => {
                leader.complete(FlightResult::Released);
                Err(e)
            }
        },
    }
}

/// The L2 entry that may answer a request: under its variant key when known;
/// else under the primary key, and when that is another variant, under the
/// variant key its `Vary` names give. (The primary is promoted to L1 either
/// way, so the next request finds the names there.)
async fn read_l2(ctx: &Ctx, keys: &Keys, request: &HeaderMap) -> Option<Entry> {
    if keys.flight != keys.primary {
        return ctx
            .engine
            .lookup_l2(&keys.flight, |e| ctx.fits(e, request))
            .await;
    }
    let latest = ctx.engine.lookup_l2(&keys.primary, |_| true).await?;
    if ctx.fits(&latest, request) {
        return Some(latest);
    }
    if latest.variant().is_empty() || variant_matches(&latest, request) {
        return None;
    }
    let key = variant_key(&keys.primary, &request_variant(&latest, request));
    ctx.engine.lookup_l2(&key, |e| ctx.fits(e, request)).await
}

/// 500, 502, 503, 504: the statuses stale-if-error answers for (RFC 5861 §4).
fn is_origin_error(status: StatusCode) -> bool {
    matches!(status.as_u16(), 500 | 502 | 503 | 504)
}

/// The request with the client's conditionals replaced by the stale entry's
/// validators, so a 304 can renew it without a body.
fn with_validators<B>(req: Request<B>, stale: &Entry) -> Request<B> {
    let (mut parts, body) = req.into_parts();
    for name in [
        IF_NONE_MATCH,
        IF_MODIFIED_SINCE,
        IF_MATCH,
        IF_UNMODIFIED_SINCE,
        IF_RANGE,
    ] {
        parts.headers.remove(name);
    }
    let stored = |name: &HeaderName| {
        stale
            .value()
            .headers
            .iter()
            .find(|(n, _)| n.as_ref() == name.as_str().as_bytes())
            .and_then(|(_, v)| HeaderValue::from_maybe_shared(v.clone()).ok())
    };
    if let Some(etag) = stored(&ETAG) {
        parts.headers.insert(IF_NONE_MATCH, etag);
    }
    if let Some(modified) = stored(&LAST_MODIFIED) {
        parts.headers.insert(IF_MODIFIED_SINCE, modified);
    }
    Request::from_parts(parts, body)
}

/// Calls the origin and stores the response if it may be shared, with the
/// lifetime the origin declares (unless the route overrides it), the route's
/// ttl, or the negative ttl for 404/410. A 304 to a revalidation renews
/// `revalidating`. A response that may not be shared marks the key
/// uncacheable for a while (hit-for-miss).
async fn load<S, ReqB, ResB>(
    ctx: &Ctx,
    inner: S,
    req: Request<ReqB>,
    keys: &Keys,
    revalidating: Option<&Entry>,
    credentialed: bool,
) -> Result<Loaded<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let request_headers = req.headers().clone();
    let started = tokio::time::Instant::now();
    let result = inner.oneshot(req).await;
    let res = match result {
        Ok(res) => res,
        Err(e) => {
            ctx.origin_load(started.elapsed());
            return Err(e);
        }
    };
    let (parts, body) = res.into_parts();
    if parts.status == StatusCode::NOT_MODIFIED
        && let Some(stale) = revalidating
    {
        let took = started.elapsed();
        ctx.origin_load(took);
        return Ok(Loaded::Stored(renew(ctx, stale, &parts.headers, took)));
    }
    let pass = |parts: response::Parts, body: CacheBody<ResB>, reason: Reason| {
        ctx.origin_load(started.elapsed());
        ctx.metrics.not_stored(reason);
        if reason.marks_key() && (parts.status.is_success() || parts.status.is_redirection()) {
            ctx.engine.mark_uncacheable(&keys.primary, &ctx.policy);
        }
        Ok(Loaded::Passed(Response::from_parts(parts, body), reason))
    };
    let cache_control = targeted(&parts.headers, &ctx.config.targets);
    let checked = response_storable(parts.status, &parts.headers, &cache_control, credentialed)
        .and_then(|()| fill_for(ctx, &cache_control, parts.status));
    drop(cache_control);
    let plan = match checked {
        Ok(plan) => plan,
        Err(reason) => return pass(parts, CacheBody::stream(body), reason),
    };
    let variant = variant_for(&parts.headers, &request_headers);
    let varied = (!variant.is_empty()).then(|| variant_key(&keys.primary, &variant));
    if let Some(key) = &varied
        && !ctx
            .variants
            .admit(&keys.primary, key, ctx.config.max_variants)
    {
        return pass(parts, CacheBody::stream(body), Reason::VaryLimit);
    }
    let max = ctx.config.max_body;
    if content_length(&parts.headers).is_some_and(|len| len > max as u64) {
        return pass(parts, CacheBody::stream(body), Reason::TooLarge);
    }
    let mut body = Box::pin(body);
    let mut frames: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                let Some(data) = frame.data_ref() else {
                    // Trailers cannot be stored: replay what was read, untouched.
                    frames.push_back(frame);
                    return pass(
                        parts,
                        CacheBody::replay(frames, None, Some(body)),
                        Reason::Body,
                    );
                };
                total += data.len();
                frames.push_back(frame);
                if total > max {
                    return pass(
                        parts,
                        CacheBody::replay(frames, None, Some(body)),
                        Reason::TooLarge,
                    );
                }
            }
            Err(e) => {
                return pass(
                    parts,
                    CacheBody::replay(frames, Some(e.into()), None),
                    Reason::Body,
                );
            }
        }
    }
    let took = started.elapsed();
    ctx.origin_load(took);
    let body = concat(frames, total);
    let tags = tags_for(ctx, &parts.headers, varied.as_ref().map(|_| &keys.primary));
    let value = headers::to_value(parts.status, &parts.headers, body);
    let fill = plan
        .fill(value)
        .variant(variant)
        .origin_latency(took)
        .tags(tags);
    // A variant is stored under its own key, and as the URL's latest
    // response under the primary key (whose `Vary` names lead to the rest).
    if let Some(key) = &varied {
        ctx.engine.store(key, fill.clone(), &ctx.policy);
    }
    Ok(Loaded::Stored(ctx.engine.store(
        &keys.primary,
        fill,
        &ctx.policy,
    )))
}

/// How a response is stored: its lifetime and what the origin said.
#[derive(Clone, Copy)]
struct Plan {
    lifetime: Lifetime,
    origin: OriginFreshness,
}

impl Plan {
    fn fill(self, value: tiercache_core::Value) -> Fill {
        Fill::new(value)
            .lifetime(self.lifetime)
            .stale_windows(
                self.origin.stale_while_revalidate,
                self.origin.stale_if_error,
            )
            .no_stale(self.origin.no_stale)
            .initial_age(self.origin.age)
    }
}

/// How a response with these headers (`Cache-Control` already the targeted
/// field, if any) is stored, or why it is not: the origin's lifetime (unless
/// the route overrides it; for errors always, capped at `max_error_ttl`),
/// the negative ttl for 404/410, the route's ttl for the heuristically
/// cacheable statuses (unless only explicit freshness is stored).
fn fill_for(ctx: &Ctx, headers: &HeaderMap, status: StatusCode) -> Result<Plan, Reason> {
    let origin = OriginFreshness::parse(headers, ctx.engine.now());
    let error = status.is_client_error() || status.is_server_error();
    let heuristic = ctx.config.heuristic;
    let lifetime = match origin.remaining() {
        Some(left) if error || !ctx.policy.overrides_origin() => {
            if left.is_zero() {
                return Err(Reason::NotFresh);
            }
            if error {
                Lifetime::Declared(left.min(ctx.config.max_error_ttl))
            } else {
                Lifetime::Declared(left)
            }
        }
        _ if heuristic && matches!(status.as_u16(), 404 | 410) => Lifetime::Negative,
        _ if heuristic && status_heuristic(status) => Lifetime::Route,
        Some(_) if !error => Lifetime::Route,
        _ => return Err(Reason::NoFreshness),
    };
    Ok(Plan { lifetime, origin })
}

/// A 304 renews `stale`: its headers updated from the 304's (RFC 9111
/// §4.3.4; framing fields kept), its body unchanged, a new lifetime drawn.
fn renew(ctx: &Ctx, stale: &Entry, not_modified: &HeaderMap, took: std::time::Duration) -> Entry {
    let old = stale.value();
    let mut merged = HeaderMap::with_capacity(old.headers.len());
    for (n, v) in &old.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n),
            HeaderValue::from_maybe_shared(v.clone()),
        ) {
            merged.append(n, v);
        }
    }
    let mut update = not_modified.clone();
    strip_hop_by_hop(&mut update);
    for framing in [http::header::CONTENT_LENGTH, http::header::CONTENT_ENCODING] {
        update.remove(framing);
    }
    for name in update.keys() {
        merged.remove(name);
    }
    for (n, v) in update.iter() {
        merged.append(n.clone(), v.clone());
    }
    let status = StatusCode::from_u16(old.status).unwrap_or(StatusCode::OK);
    let value = headers::to_value(status, &merged, old.body.clone());
    let fill = match fill_for(ctx, &targeted(&merged, &ctx.config.targets), status) {
        Ok(plan) => plan.fill(value),
        Err(_) => {
            Fill::new(value).lifetime(Lifetime::Declared(std::time::Duration::from_millis(1)))
        }
    };
    // Renewed where it was stored (its primary or its variant key).
    let key = CacheKey::from_full(stale.key().clone());
    let tags = tags_for(ctx, &merged, None);
    let fill = fill
        .variant(stale.variant().clone())
        .origin_latency(took)
        .tags(tags);
    ctx.engine.store(&key, fill, &ctx.policy)
}

/// The tags a response is recorded under: the route's, those its
/// `Surrogate-Key` header lists (space separated), and for a `Vary`ing URL
/// its family tag.
fn tags_for(ctx: &Ctx, headers: &HeaderMap, family: Option<&CacheKey>) -> Vec<Bytes> {
    let mut tags: Vec<Bytes> = ctx.policy.tags().to_vec();
    for value in headers.get_all(SURROGATE_KEY) {
        for tag in value.as_bytes().split(|b| b.is_ascii_whitespace()) {
            if !tag.is_empty() && tags.len() < MAX_TAGS {
                tags.push(Bytes::copy_from_slice(tag));
            }
        }
    }
    tags.extend(family.map(family_tag));
    tags.sort_unstable();
    tags.dedup();
    tags
}

/// The response header naming an entry's tags (surrogate keys).
pub const SURROGATE_KEY: HeaderName = HeaderName::from_static("surrogate-key");
/// Most tags one response is recorded under (each costs a write to L2).
const MAX_TAGS: usize = 32;

fn concat(frames: VecDeque<Frame<Bytes>>, total: usize) -> Bytes {
    let mut data = frames.into_iter().filter_map(|f| f.into_data().ok());
    match (data.next(), data.next()) {
        (None, _) => Bytes::new(),
        (Some(only), None) => only,
        (Some(first), Some(second)) => {
            let mut buf = BytesMut::with_capacity(total);
            buf.extend_from_slice(&first);
            buf.extend_from_slice(&second);
            data.for_each(|d| buf.extend_from_slice(&d));
            buf.freeze()
        }
    }
}

/// A HEAD is loaded as a GET so the entry it fills has the body.
fn as_get<B>(req: Request<B>) -> Request<B> {
    let (mut parts, body) = req.into_parts();
    if parts.method == Method::HEAD {
        parts.method = Method::GET;
    }
    Request::from_parts(parts, body)
}

fn respond_entry<B>(
    ctx: &Ctx,
    entry: &Entry,
    source: Source,
    ask: &Ask,
    collapsed: bool,
) -> Response<CacheBody<B>> {
    let now = ctx.engine.now();
    let outcome = match (source, entry.freshness(now)) {
        // A follower handed the leader's stale-if-error answer.
        (_, Freshness::Stale | Freshness::StaleIfError | Freshness::Dead) => {
            return respond_stale(ctx, entry, ask, "origin-error");
        }
        (Source::Origin, _) => Outcome::Miss {
            stored: !collapsed,
            reason: None,
            collapsed,
        },
        (tier, _) => Outcome::Hit {
            tier,
            ttl: headers::ttl_left(entry, now),
            collapsed,
        },
    };
    ctx.served(source);
    ctx.entry_response(entry, now, ask, &outcome)
}

fn respond_stale<B>(
    ctx: &Ctx,
    entry: &Entry,
    ask: &Ask,
    detail: &'static str,
) -> Response<CacheBody<B>> {
    ctx.stale_served();
    let outcome = Outcome::Stale {
        detail: Some(detail),
    };
    ctx.entry_response(entry, ctx.engine.now(), ask, &outcome)
}

fn respond_loaded<B>(
    ctx: &Ctx,
    loaded: Loaded<B>,
    ask: &Ask,
    collapsed: bool,
    bypass: Option<Reason>,
) -> Response<CacheBody<B>> {
    match loaded {
        Loaded::Stored(entry) => respond_entry(ctx, &entry, Source::Origin, ask, false),
        Loaded::Passed(mut res, reason) => {
            if ask.head {
                *res.body_mut() = CacheBody::empty();
            }
            let outcome = match bypass {
                Some(reason) => Outcome::Bypass(reason),
                None => {
                    ctx.served(Source::Origin);
                    Outcome::Miss {
                        stored: false,
                        reason: Some(reason),
                        collapsed,
                    }
                }
            };
            ctx.label(res.headers_mut(), &outcome);
            res
        }
    }
}

fn error_response<B>(ctx: &Ctx, status: StatusCode) -> Response<CacheBody<B>> {
    let mut res = Response::new(CacheBody::full(Bytes::from_static(
        b"the origin failed while loading this resource\n",
    )));
    *res.status_mut() = status;
    let outcome = Outcome::Miss {
        stored: false,
        reason: None,
        collapsed: true,
    };
    ctx.label(res.headers_mut(), &outcome);
    res
}
