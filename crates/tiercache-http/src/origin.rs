//! [`HttpOrigin`]: the wrapped service as the engine's [`Origin`]. It calls
//! the service and turns its response into data the engine acts on: store
//! it (with the lifetime the HTTP rules give), share it with the waiting
//! requests without storing it (an origin error any client may see), or pass
//! it to this request alone, its body streaming.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{DATE, ETAG, HeaderValue, LAST_MODIFIED};
use http::{HeaderMap, Method, Request, Response, StatusCode, response};
use http_body::Body;
use tiercache_core::{
    CacheKey, Entry, Event, Fill, Freshness, Lifetime, Loaded, Origin, Progress, Select, Value,
};
use tower::{Service, ServiceExt};

use crate::body::{BoxError, CacheBody};
use crate::cache_control::targeted;
use crate::cacheable::{
    Reason, is_origin_error, response_shareable, response_storable, status_heuristic,
};
use crate::freshness::OriginFreshness;
use crate::headers;
use crate::key::{family_of, variant_for, variant_key};
use crate::route::Route;

mod read_whole;
mod renew;
mod tags;
mod tee;

pub use tags::SURROGATE_KEY;
use tags::tags_for;
pub(crate) use tee::Early;

/// A response the origin gave this request alone, and why it was not stored.
pub(crate) type Passed<B> = (Response<CacheBody<B>>, Reason);

/// One request's way to the origin: the wrapped service and the request.
pub(crate) struct HttpOrigin<S, ReqB, ResB> {
    pub(crate) route: Arc<Route>,
    pub(crate) inner: S,
    pub(crate) req: Request<ReqB>,
    /// The URL's key (variant keys derive from it; hit-for-miss marks it).
    pub(crate) primary: CacheKey,
    pub(crate) credentialed: bool,
    /// Where a body read to be stored goes on early (see [`tee`]).
    pub(crate) early: Option<Early<ResB>>,
}

impl<S, ReqB, ResB> Select for HttpOrigin<S, ReqB, ResB> {
    fn accepts(&self, entry: &Entry) -> bool {
        self.route.fits(entry, self.req.headers())
    }

    fn variant_key(&self, requested: &CacheKey, latest: &Entry) -> Option<CacheKey> {
        self.route
            .variant_key(requested, latest, self.req.headers())
    }

    fn must_revalidate(&self, entry: &Entry) -> bool {
        self.route.must_revalidate(entry)
    }

    fn observe(&self, event: Event) {
        self.route.observe(event);
    }
}

impl<S, ReqB, ResB> Origin for HttpOrigin<S, ReqB, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Passed<ResB>;
    type Error = S::Error;

    async fn load(self, stale: Option<Entry>) -> Result<Loaded<Passed<ResB>>, S::Error> {
        self.load_with(stale, Progress::none()).await
    }

    /// The origin's head, and each frame of a body read to be stored, are
    /// its progress: the requests waiting on this load wait on while it
    /// comes (see [`Progress`]).
    async fn load_with(
        self,
        stale: Option<Entry>,
        progress: Progress,
    ) -> Result<Loaded<Passed<ResB>>, S::Error> {
        let HttpOrigin {
            route,
            inner,
            req,
            primary,
            credentialed,
            early,
        } = self;
        let req = as_get(req);
        let load = |req: &Request<ReqB>| Load {
            route: &route,
            primary: &primary,
            credentialed,
            request_headers: req.headers().clone(),
            started: tokio::time::Instant::now(),
            progress: progress.clone(),
        };
        let Some(stale) = stale else {
            let load = load(&req);
            let res = load.call(inner, req).await?;
            return Ok(load.answer(res, None, early).await);
        };
        // What asks again, unconditionally, should the origin's 304 name
        // another version than the stale one (see `renew::asked_again`).
        let again = renew::asked_again(&req).map(|again| (inner.clone(), again));
        let req = renew::with_validators(req, &stale);
        let first = load(&req);
        let res = first.call(inner, req).await?;
        if let Some((inner, req)) = again
            && res.status() == StatusCode::NOT_MODIFIED
            && !renew::selects(res.headers(), stale.value())
        {
            // Let go first: the 304's body may hold the upstream
            // connection (the proxy's slot) the request asked again needs.
            drop(res);
            // One load, timed whole (one sample, as the engine's δ).
            let load = Load {
                started: first.started,
                ..load(&req)
            };
            let res = load.call(inner, req).await?;
            // A 304 to a request without validators renews nothing.
            if res.status() == StatusCode::NOT_MODIFIED {
                load.drop_outdated(&stale).await;
                return Ok(load.unasked_not_modified(false));
            }
            let loaded = load.answer(res, Some(&stale), None).await;
            // The current version stored replaces the outdated one (an
            // invalidation now would count that fill overtaken); an
            // origin failure leaves it to stale-if-error.
            if let Loaded::Share { failed: false, .. } | Loaded::Pass { failed: false, .. } =
                &loaded
            {
                first.drop_outdated(&stale).await;
            }
            return Ok(loaded);
        }
        // A stale entry at hand may answer in the load's place (past the
        // soft timeout, or for a body that breaks off: stale-if-error), so
        // what is read is not sent on before it is whole.
        Ok(first.answer(res, Some(&stale), None).await)
    }
}

/// What one origin call needs to judge its answer.
struct Load<'a> {
    route: &'a Route,
    primary: &'a CacheKey,
    credentialed: bool,
    request_headers: HeaderMap,
    started: tokio::time::Instant,
    /// Told of each sign of life from the origin.
    progress: Progress,
}

impl Load<'_> {
    /// Sends `req` to `inner` (an error counts the origin's time).
    async fn call<S, ReqB, ResB>(
        &self,
        inner: S,
        req: Request<ReqB>,
    ) -> Result<Response<ResB>, S::Error>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
    {
        let res = inner.oneshot(crate::service::for_inner(req)).await;
        match &res {
            Ok(_) => self.progress.made(),
            Err(_) => self.route.metrics.origin(self.started.elapsed()),
        }
        res
    }

    /// Turns the origin's response into what the engine does with it: a 304
    /// to a revalidation renews `revalidating`; a response that may be
    /// shared is stored, with the lifetime the origin declares (unless the
    /// route overrides it), the route's ttl, or the negative ttl for
    /// 404/410; an origin error any client may see is shared with the
    /// waiting requests; anything else is this request's alone, and marks
    /// the key uncacheable for a while (hit-for-miss) when the reason is the
    /// resource's.
    async fn answer<ResB>(
        self,
        res: Response<ResB>,
        revalidating: Option<&Entry>,
        early: Option<Early<ResB>>,
    ) -> Loaded<Passed<ResB>>
    where
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        let route = self.route;
        let (mut parts, body) = res.into_parts();
        // RFC 9110 §6.6.1: a cache with a clock dates a response that came
        // without a `Date` when it received it, stored or passed on (else
        // each hit went out dated when it was sent, while its `Age` grew).
        // (Not a 304: one renewing a stored response keeps its `Date`,
        // the origin's clock, which its `Expires` counts from.)
        if parts.status != StatusCode::NOT_MODIFIED && !parts.headers.contains_key(DATE) {
            let received = crate::freshness::format_http_date(route.engine.now());
            if let Ok(date) = HeaderValue::from_str(&received) {
                parts.headers.insert(DATE, date);
            }
        }
        if parts.status == StatusCode::NOT_MODIFIED {
            return match revalidating {
                Some(stale) => self.renewed(parts, stale).await,
                None => self.unasked_not_modified(true),
            };
        }
        // A live stream has no end to read to (to store it, or share it
        // with the requests waiting): it goes to its client as it comes,
        // and those waiting are released to open their own.
        if crate::cacheable::is_live_stream(&parts.headers) {
            return self.pass(parts, CacheBody::stream(body), Reason::Stream);
        }
        let cache_control = targeted(&parts.headers, &route.config.targets);
        // An origin failure with a stale entry at hand that may stand in
        // for it (stale-if-error): the stale entry answers, nothing is
        // stored. The failure is still handed to the instances waiting on
        // this load (they may have no stale copy) only if any client may
        // see it; else they each load their own.
        if is_origin_error(parts.status)
            && revalidating.is_some_and(|stale| {
                matches!(
                    stale.freshness(route.engine.now()),
                    Freshness::Stale | Freshness::StaleIfError
                )
            })
        {
            let shareable = response_shareable(
                parts.status,
                &parts.headers,
                &cache_control,
                self.credentialed,
            );
            drop(cache_control);
            if !shareable {
                return self.pass(parts, CacheBody::stream(body), Reason::Status);
            }
            return self.share(parts, body, Reason::Status).await;
        }
        let safe = response_storable(
            parts.status,
            &parts.headers,
            &cache_control,
            self.credentialed,
        );
        let shareable = response_shareable(
            parts.status,
            &parts.headers,
            &cache_control,
            self.credentialed,
        );
        let checked = safe.and_then(|()| fill_for(route, &cache_control, parts.status));
        drop(cache_control);
        let plan = match checked {
            Ok(plan) => plan,
            Err(reason) if shareable => return self.share(parts, body, reason).await,
            Err(reason) => return self.pass(parts, CacheBody::stream(body), reason),
        };
        if headers::coding_refused(&self.request_headers, &parts.headers) {
            return self.pass(parts, CacheBody::stream(body), Reason::Encoding);
        }
        let variant = variant_for(&parts.headers, &self.request_headers);
        let varied = (!variant.is_empty()).then(|| variant_key(self.primary, &variant));
        if let Some(key) = &varied
            && !route
                .variants
                .admit(self.primary, key, route.config.max_variants, |k| {
                    route.engine.l1_contains(k)
                })
        {
            return self.pass(parts, CacheBody::stream(body), Reason::VaryLimit);
        }
        // A body slower than it would stay usable (fresh, or stale while
        // revalidated) is not worth the wait (an endless one held its
        // client's head and the origin's connection up to `max_body`):
        // past that, what came goes on with the rest, unstored.
        let fresh = match plan.lifetime {
            Lifetime::Declared(left) => left,
            Lifetime::Route => route.policy.band().1,
            Lifetime::Negative => route.policy.negative(),
        };
        let stale = (plan.origin.stale_while_revalidate)
            .unwrap_or_default()
            .max(route.policy.swr_window());
        let worth = fresh.saturating_sub(plan.spent).saturating_add(stale);
        let within = tokio::time::Instant::now().checked_add(worth);
        let body = match self.read(&parts, body, within, early).await {
            Ok(read) => read,
            Err((body, reason)) => return self.pass(parts, body, reason),
        };
        let took = self.started.elapsed();
        route.metrics.origin(took);
        let family = family_of(self.primary, varied.is_some());
        let tags = tags_for(route, &parts.headers, family.as_ref());
        let value = headers::to_value(parts.status, &parts.headers, body);
        // δ (the origin's time, for XFetch) is measured by the engine.
        let validator =
            parts.headers.contains_key(ETAG) || parts.headers.contains_key(LAST_MODIFIED);
        let mut fill = plan
            .fill(value)
            .variant(variant)
            .tags(tags)
            .validator(validator);
        // Stored as the URL's latest response under the primary key (whose
        // `Vary` names lead to the rest), and a variant under its own key.
        fill = fill.store_under(self.primary.clone());
        if let Some(key) = varied {
            fill = fill.store_under(key);
        }
        Loaded::Store(fill)
    }

    /// An origin error any client may see: read it whole and share it with
    /// the requests waiting on this load (they would otherwise each call
    /// the failing origin); too large to hold, it is this request's alone.
    async fn share<ResB>(
        self,
        parts: response::Parts,
        body: ResB,
        reason: Reason,
    ) -> Loaded<Passed<ResB>>
    where
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        match self.read(&parts, body, None, None).await {
            Ok(body) => {
                let took = self.started.elapsed();
                self.route.metrics.origin(took);
                self.route.metrics.not_stored(reason);
                let value = headers::to_value(parts.status, &parts.headers, body);
                Loaded::Share {
                    value,
                    failed: is_origin_error(parts.status),
                }
            }
            // A body that broke off says so, as does one without room to
            // be read (of the moment); too large keeps why it was read.
            Err((body, why @ (Reason::BodyFailed | Reason::Busy))) => self.pass(parts, body, why),
            Err((body, _)) => self.pass(parts, body, reason),
        }
    }

    fn pass<ResB>(
        &self,
        parts: response::Parts,
        body: CacheBody<ResB>,
        reason: Reason,
    ) -> Loaded<Passed<ResB>> {
        self.route.metrics.origin(self.started.elapsed());
        self.route.metrics.not_stored(reason);
        let uncacheable =
            reason.marks_key() && (parts.status.is_success() || parts.status.is_redirection());
        // A body that broke off is the origin failing, whatever its status.
        let failed = is_origin_error(parts.status) || reason == Reason::BodyFailed;
        let output = if reason == Reason::BodyFailed {
            // It broke off while it was read whole, before any of it was
            // sent: a clean 502 (RFC 9110 §15.6.3). The origin's head with
            // a body that breaks reached an HTTP/1 client as nothing at
            // all, an empty reply, which clients retry blindly.
            let mut res = Response::new(CacheBody::full(Bytes::from_static(
                b"the origin's answer broke off before its end\n",
            )));
            *res.status_mut() = StatusCode::BAD_GATEWAY;
            res
        } else {
            Response::from_parts(parts, body)
        };
        match reason {
            // No room to read it whole now: nothing about the resource.
            Reason::Busy => {
                return Loaded::Busy {
                    output: (output, reason),
                    failed,
                };
            }
            // The origin failing: its waiters get the failure, not a call each.
            Reason::BodyFailed => {
                return Loaded::Failed {
                    output: (output, reason),
                };
            }
            _ => {}
        }
        Loaded::Pass {
            output: (output, reason),
            failed,
            uncacheable,
        }
    }
}

/// How a response is stored: its lifetime and what the origin said.
#[derive(Clone, Copy)]
struct Plan {
    lifetime: Lifetime,
    origin: OriginFreshness,
    /// What of a route lifetime the response spent already (its `Age`).
    spent: std::time::Duration,
    /// A 4xx/5xx: never served stale, so never past `max_error_ttl`.
    error: bool,
}

impl Plan {
    fn fill(self, value: Value) -> Fill {
        Fill::new(value)
            .lifetime(self.lifetime)
            .stale_windows(
                self.origin.stale_while_revalidate,
                self.origin.stale_if_error,
            )
            .no_stale(self.origin.no_stale || self.error)
            .initial_age(self.origin.age)
            .spent(self.spent)
    }
}

/// How a response with these headers (`Cache-Control` already the targeted
/// field, if any) is stored, or why it is not: the origin's lifetime (unless
/// the route overrides it; for errors always, capped at `max_error_ttl`),
/// the negative ttl for 404/410, the route's ttl for the heuristically
/// cacheable statuses (unless only explicit freshness is stored).
fn fill_for(route: &Route, headers: &HeaderMap, status: StatusCode) -> Result<Plan, Reason> {
    let origin = OriginFreshness::parse(headers, route.engine.now());
    let error = status.is_client_error() || status.is_server_error();
    let heuristic = route.config.heuristic;
    let lifetime = match origin.remaining() {
        Some(left) if error || !route.policy.overrides_origin() => {
            if left.is_zero() {
                return Err(Reason::NotFresh);
            }
            if error {
                Lifetime::Declared(left.min(route.config.max_error_ttl))
            } else {
                Lifetime::Declared(left)
            }
        }
        _ if heuristic && matches!(status.as_u16(), 404 | 410) => Lifetime::Negative,
        _ if heuristic && status_heuristic(status) => Lifetime::Route,
        Some(_) if !error => Lifetime::Route,
        _ => return Err(Reason::NoFreshness),
    };
    // A lifetime the route gives a response without freshness of its own
    // counts from the origin's answer too (RFC 9111 §4.2): the engine keeps
    // what its `Age` left, and one past the shortest the route may draw
    // is stale on arrival. A route that overrides what the origin declared
    // counts from this answer, as it always did.
    let heuristic_lifetime = match lifetime {
        Lifetime::Route if origin.lifetime.is_none() => Some(route.policy.fresh_ttl()),
        Lifetime::Negative if origin.lifetime.is_none() => Some(route.policy.negative()),
        _ => None,
    };
    let spent = match heuristic_lifetime {
        Some(ttl) => {
            // The band's floor, for the negative ttl as for the ttl.
            let (floor, _) = route.policy.band();
            let floor = ttl.mul_f64(floor.as_secs_f64() / route.policy.fresh_ttl().as_secs_f64());
            if origin.age >= floor {
                return Err(Reason::NotFresh);
            }
            origin.age
        }
        None => std::time::Duration::ZERO,
    };
    Ok(Plan {
        lifetime,
        origin,
        spent,
        error,
    })
}

/// A HEAD is loaded as a GET so the entry it fills has the body.
fn as_get<B>(req: Request<B>) -> Request<B> {
    let (mut parts, body) = req.into_parts();
    if parts.method == Method::HEAD {
        parts.method = Method::GET;
    }
    Request::from_parts(parts, body)
}

#[cfg(test)]
mod tests;
