//! [`ResponseCache`]: the tower service.

use std::collections::VecDeque;
use std::panic::resume_unwind;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tiercache_core::{
    CacheKey, Entry, Fill, FlightError, FlightResult, Join, Leader, Lookup, Policy, Source,
    TieredCache, Waited,
};
use tower::{Service, ServiceExt};

use crate::body::{BoxError, CacheBody};
use crate::cacheable::{Reason, content_length, request_cacheable, response_storable};
use crate::future::ResponseFuture;
use crate::headers::{self, Outcome};
use crate::key::{request_key, variant_for, variant_matches};
use crate::layer::{HttpConfig, ResponseCacheLayer};

/// Caches the responses of `S`; built by [`ResponseCacheLayer`].
///
/// Never changes `S`'s error type. GET and HEAD are cached (HEAD is answered
/// from the GET entry, and a HEAD miss is loaded as a GET so it never stores an
/// empty body); everything else passes through labelled `BYPASS`.
#[derive(Debug, Clone)]
pub struct ResponseCache<S> {
    inner: S,
    // One Arc: routers clone the service per request.
    ctx: Option<Arc<Ctx>>,
}

impl<S> ResponseCache<S> {
    /// Wraps `inner` with `layer`'s engine, policy and settings.
    pub fn new(inner: S, layer: ResponseCacheLayer) -> Self {
        let ctx = layer.policy.map(|policy| {
            Arc::new(Ctx {
                engine: layer.engine,
                policy,
                config: layer.config,
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
    policy: Arc<Policy>,
    config: Arc<HttpConfig>,
}

impl Ctx {
    fn label(&self, headers: &mut http::HeaderMap, outcome: &Outcome) {
        if self.config.emit_headers {
            headers::apply(headers, outcome, self.engine.hit_ratio());
        }
    }

    fn entry_response<B>(
        &self,
        entry: &Entry,
        now: std::time::SystemTime,
        head: bool,
        outcome: &Outcome,
    ) -> Response<CacheBody<B>> {
        let label = self
            .config
            .emit_headers
            .then(|| (outcome, self.engine.hit_ratio()));
        headers::from_entry(entry, now, head, label)
    }
}

/// What a load produced.
enum Loaded<B> {
    /// Stored; answer from the entry.
    Stored(Entry),
    /// Not stored; the origin's response, body streaming.
    Passed(Response<CacheBody<B>>, Reason),
}

/// What the leader's fill produced.
enum Filled<B> {
    Entry(Entry, Source),
    Passed(Response<CacheBody<B>>, Reason),
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ResponseCache<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Send + 'static,
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
        let engine = &ctx.engine;
        let (parts, body) = req.into_parts();
        if let Err(reason) = request_cacheable(&parts) {
            engine.record_bypass(reason.as_str());
            let label = ctx
                .config
                .emit_headers
                .then(|| (Outcome::Bypass(reason), engine.clone()));
            return ResponseFuture::inner(self.inner.call(Request::from_parts(parts, body)), label);
        }
        let key = request_key(&parts);
        let head = parts.method == Method::HEAD;
        let now = engine.now();
        if let Lookup::Fresh { entry, remaining } =
            engine.lookup_at(&key, now, |e| variant_matches(e, &parts.headers))
        {
            let outcome = Outcome::Hit {
                tier: Source::L1,
                ttl: remaining.as_secs(),
                collapsed: false,
            };
            return ResponseFuture::ready(ctx.entry_response(&entry, now, head, &outcome));
        }
        // The ready service goes with the request; a clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let req = Request::from_parts(parts, body);
        ResponseFuture::boxed(Box::pin(miss(ctx.clone(), inner, req, key, head)))
    }
}

async fn miss<S, ReqB, ResB>(
    ctx: Arc<Ctx>,
    inner: S,
    req: Request<ReqB>,
    key: CacheKey,
    head: bool,
) -> Result<Response<CacheBody<ResB>>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    if ctx.engine.is_uncacheable(&key) {
        ctx.engine.record_bypass(Reason::HitForMiss.as_str());
        let loaded = load(&ctx, inner, as_get(req), &key).await?;
        return Ok(respond_loaded(
            &ctx,
            loaded,
            head,
            false,
            Some(Reason::HitForMiss),
        ));
    }
    match ctx.engine.join(&key) {
        Join::Leader(leader) => {
            let task_ctx = ctx.clone();
            // Detached: if this request is dropped (client gone), the fill still
            // completes, stores, and wakes the followers.
            let task = tokio::spawn(fill(task_ctx, inner, as_get(req), key, leader));
            let filled = match task.await {
                Ok(filled) => filled?,
                Err(e) if e.is_panic() => resume_unwind(e.into_panic()),
                Err(_) => return Ok(error_response(&ctx, StatusCode::SERVICE_UNAVAILABLE)),
            };
            Ok(match filled {
                Filled::Entry(entry, source) => respond_entry(&ctx, &entry, source, head, false),
                Filled::Passed(res, reason) => {
                    respond_loaded(&ctx, Loaded::Passed(res, reason), head, false, None)
                }
            })
        }
        Join::Follower(follower) => {
            let waited = ctx.engine.wait(follower, &ctx.policy).await;
            match waited {
                Waited::Done(FlightResult::Shared(entry, source))
                    if variant_matches(&entry, req.headers()) =>
                {
                    Ok(respond_entry(&ctx, &entry, source, head, true))
                }
                Waited::Done(FlightResult::Failed(FlightError::Panicked)) => {
                    ctx.engine.record_served(Source::Origin);
                    Ok(error_response(&ctx, StatusCode::INTERNAL_SERVER_ERROR))
                }
                // Released (not shareable), another variant, a timeout or an
                // abandoned load: this request goes to the origin itself.
                _ => {
                    let loaded = load(&ctx, inner, as_get(req), &key).await?;
                    Ok(respond_loaded(&ctx, loaded, head, true, None))
                }
            }
        }
    }
}

/// The leader's fill: L2 first, then the origin; completes the flight.
async fn fill<S, ReqB, ResB>(
    ctx: Arc<Ctx>,
    inner: S,
    req: Request<ReqB>,
    key: CacheKey,
    leader: Leader,
) -> Result<Filled<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    // A copy: the request body need not be `Sync` to be held across the read.
    let request_headers = req.headers().clone();
    if let Some(entry) = ctx
        .engine
        .lookup_l2(&key, |e| variant_matches(e, &request_headers))
        .await
    {
        leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
        return Ok(Filled::Entry(entry, Source::L2));
    }
    match load(&ctx, inner, req, &key).await {
        Ok(Loaded::Stored(entry)) => {
            leader.complete(FlightResult::Shared(entry.clone(), Source::Origin));
            Ok(Filled::Entry(entry, Source::Origin))
        }
        Ok(Loaded::Passed(res, reason)) => {
            leader.complete(FlightResult::Released);
            Ok(Filled::Passed(res, reason))
        }
        Err(e) => {
            leader.complete(FlightResult::Released);
            Err(e)
        }
    }
}

/// Calls the origin and stores the response if it may be shared; a response
/// that may not marks the key uncacheable for a while (hit-for-miss).
async fn load<S, ReqB, ResB>(
    ctx: &Ctx,
    inner: S,
    req: Request<ReqB>,
    key: &CacheKey,
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
            ctx.engine.record_origin_load(started.elapsed());
            return Err(e);
        }
    };
    let (parts, body) = res.into_parts();
    let pass = |parts, body: CacheBody<ResB>, reason: Reason| {
        ctx.engine.record_origin_load(started.elapsed());
        ctx.engine.mark_uncacheable(key, &ctx.policy);
        Ok(Loaded::Passed(Response::from_parts(parts, body), reason))
    };
    if let Err(reason) = response_storable(&parts) {
        return pass(parts, CacheBody::stream(body), reason);
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
    ctx.engine.record_origin_load(took);
    let body = concat(frames, total);
    let variant = variant_for(&parts.headers, &request_headers);
    let value = headers::to_value(parts.status, &parts.headers, body);
    let fill = Fill::new(value).variant(variant).origin_latency(took);
    Ok(Loaded::Stored(ctx.engine.store(key, fill, &ctx.policy)))
}

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
    head: bool,
    collapsed: bool,
) -> Response<CacheBody<B>> {
    ctx.engine.record_served(source);
    let now = ctx.engine.now();
    let outcome = match source {
        Source::Origin => Outcome::Miss {
            stored: !collapsed,
            reason: None,
            collapsed,
        },
        tier => Outcome::Hit {
            tier,
            ttl: headers::ttl_left(entry, now),
            collapsed,
        },
    };
    ctx.entry_response(entry, now, head, &outcome)
}

fn respond_loaded<B>(
    ctx: &Ctx,
    loaded: Loaded<B>,
    head: bool,
    collapsed: bool,
    bypass: Option<Reason>,
) -> Response<CacheBody<B>> {
    match loaded {
        Loaded::Stored(entry) => respond_entry(ctx, &entry, Source::Origin, head, false),
        Loaded::Passed(mut res, reason) => {
            if head {
                *res.body_mut() = CacheBody::empty();
            }
            let outcome = match bypass {
                Some(reason) => Outcome::Bypass(reason),
                None => {
                    ctx.engine.record_served(Source::Origin);
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
