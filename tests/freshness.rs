//! Freshness layers through the layer, on the engine's mock clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tiercache::core::MockClock;
use tiercache::http::{NothingStored, StoredOnly};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::http::BreaksOff;
use tiercache_testkit::{Counter, Gate, bounded, eventually};
use tower::{Layer, Service, ServiceExt};

/// What the origin does next.
#[derive(Clone)]
enum Mode {
    Ok(&'static [(&'static str, &'static str)]),
    Status(u16),
    /// This status, with these fields.
    StatusWith(u16, &'static [(&'static str, &'static str)]),
    Fail,
    Held(Gate),
    /// A 200 with these fields, conditional requests or not.
    Always(&'static [(&'static str, &'static str)]),
    /// Answers a conditional request with a 304 carrying these fields (an
    /// unconditional one with a 200, `ETag: "v1"`).
    NotModified(&'static [(&'static str, &'static str)]),
    /// A 416, fresh for a minute, to a request with `Range`; else a 200
    /// that sets a cookie (so the key is not stored: hit-for-miss).
    Ranged,
    /// A 200 whose body breaks off after a few bytes (a reset or a stalled
    /// upstream cut by its timeout).
    BrokenBody,
    /// As `BrokenBody`, the break 300 ms after the first bytes (long
    /// enough for a body read to be stored to go on to its client).
    SlowBrokenBody,
    /// The resource changed: a conditional request gets a 304 naming the
    /// new version (`ETag: "v2"`, as a server of a load balancer that has
    /// it may answer), an unconditional one that version, fresh a minute.
    Changed,
    /// A 304 to every request: naming `ETag: "v2"` to a conditional one,
    /// no validator to one without.
    OnlyNotModified,
    /// Waits for the gate, then answers with this status.
    HeldStatus(Gate, u16),
    /// Waits for the gate, then answers as `BrokenBody` does.
    HeldBroken(Gate),
    /// Waits for the gate, then answers a 200 that sets a cookie (its
    /// waiters may not share it).
    HeldSetCookie(Gate),
}

#[derive(Clone)]
struct Origin {
    calls: Counter,
    mode: Arc<Mutex<Mode>>,
    seen: Arc<Mutex<Vec<HeaderMap>>>,
    /// Calls that carried [`StoredOnly`].
    marked: Counter,
}

impl Origin {
    fn new() -> Self {
        Self {
            calls: Counter::new(),
            mode: Arc::new(Mutex::new(Mode::Ok(&[]))),
            seen: Arc::default(),
            marked: Counter::new(),
        }
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// A tower service answering "body N" (N = call count) per the mode.
    fn service(
        &self,
    ) -> impl Service<Request<Body>, Response = Response<Body>, Error = std::io::Error, Future: Send>
    + Clone
    + Send
    + 'static {
        let origin = self.clone();
        tower::service_fn(move |req: Request<Body>| {
            let origin = origin.clone();
            async move {
                let n = origin.calls.bump();
                origin.seen.lock().unwrap().push(req.headers().clone());
                if req.extensions().get::<StoredOnly>().is_some() {
                    origin.marked.bump();
                }
                let mode = origin.mode.lock().unwrap().clone();
                let etag = "\"v1\"";
                match mode {
                    Mode::Fail => Err(std::io::Error::other("connection refused")),
                    Mode::Status(code) => Ok(Response::builder()
                        .status(code)
                        .body(Body::from(format!("status {code}")))
                        .unwrap()),
                    Mode::StatusWith(code, headers) => {
                        let mut b = Response::builder().status(code);
                        for (k, v) in headers {
                            b = b.header(*k, *v);
                        }
                        Ok(b.body(Body::from(format!("status {code}"))).unwrap())
                    }
                    Mode::Always(headers) => {
                        let mut b = Response::builder();
                        for (k, v) in headers {
                            b = b.header(*k, *v);
                        }
                        Ok(b.body(Body::from(format!("body {n}"))).unwrap())
                    }
                    Mode::BrokenBody => Ok(Response::new(Body::new(BreaksOff::default()))),
                    Mode::SlowBrokenBody => Ok(Response::new(Body::new(BreaksOff::after(
                        std::time::Duration::from_millis(300),
                    )))),
                    Mode::Ranged if req.headers().contains_key("range") => Ok(Response::builder()
                        .status(416)
                        .header("cache-control", "max-age=60")
                        .header("content-range", "bytes */7")
                        .body(Body::empty())
                        .unwrap()),
                    Mode::Ranged => Ok(Response::builder()
                        .header("set-cookie", "s=1")
                        .body(Body::from(format!("body {n}")))
                        .unwrap()),
                    Mode::NotModified(headers) => {
                        if !req.headers().contains_key("if-none-match") {
                            return Ok(Response::builder()
                                .header("etag", etag)
                                .body(Body::from(format!("body {n}")))
                                .unwrap());
                        }
                        let mut b = Response::builder().status(304);
                        for (k, v) in headers {
                            b = b.header(*k, *v);
                        }
                        Ok(b.body(Body::empty()).unwrap())
                    }
                    Mode::Changed => {
                        let conditional = req.headers().contains_key("if-none-match");
                        Ok(Response::builder()
                            .status(if conditional { 304 } else { 200 })
                            .header("etag", "\"v2\"")
                            .header("cache-control", "max-age=60")
                            .body(if conditional {
                                Body::empty()
                            } else {
                                Body::from(format!("body {n}"))
                            })
                            .unwrap())
                    }
                    Mode::OnlyNotModified => {
                        let mut b = Response::builder().status(304);
                        if req.headers().contains_key("if-none-match") {
                            b = b.header("etag", "\"v2\"");
                        }
                        Ok(b.body(Body::empty()).unwrap())
                    }
                    Mode::Held(gate) => {
                        gate.passed().await;
                        Ok(Response::new(Body::from(format!("body {n}"))))
                    }
                    Mode::HeldSetCookie(gate) => {
                        gate.passed().await;
                        Ok(Response::builder()
                            .header("set-cookie", "s=1")
                            .body(Body::from(format!("body {n}")))
                            .unwrap())
                    }
                    Mode::HeldBroken(gate) => {
                        gate.passed().await;
                        Ok(Response::new(Body::new(BreaksOff::default())))
                    }
                    Mode::HeldStatus(gate, code) => {
                        gate.passed().await;
                        Ok(Response::builder()
                            .status(code)
                            .body(Body::from(format!("status {code}")))
                            .unwrap())
                    }
                    Mode::Ok(headers) => {
                        if req
                            .headers()
                            .get("if-none-match")
                            .is_some_and(|v| v == etag)
                        {
                            return Ok(Response::builder()
                                .status(304)
                                .header("etag", etag)
                                .body(Body::empty())
                                .unwrap());
                        }
                        let mut b = Response::builder().header("etag", etag);
                        for (k, v) in headers {
                            b = b.header(*k, *v);
                        }
                        Ok(b.body(Body::from(format!("body {n}"))).unwrap())
                    }
                }
            }
        })
    }
}

/// A minute's ttl (no jitter) that overrides what the origin declares.
fn overriding_a_minute() -> Policy {
    Policy::ttl(secs(60))
        .jitter(0.0)
        .override_origin(true)
        .build()
        .unwrap()
}

/// A 1 s ttl (no jitter) and a minute of stale-if-error.
fn stale_if_error_a_minute() -> Policy {
    Policy::ttl(secs(1))
        .jitter(0.0)
        .stale_if_error(secs(60))
        .build()
        .unwrap()
}

struct Harness {
    clock: MockClock,
    engine: TieredCache,
    origin: Origin,
    layer: ResponseCacheLayer,
}

impl Harness {
    fn new(policy: Policy) -> Self {
        let clock = MockClock::new();
        let engine = TieredCache::builder()
            .clock(clock.clone())
            .sweep_interval(None)
            .rng_seed(5)
            .build()
            .unwrap();
        let layer = ResponseCacheLayer::new(engine.clone())
            .route(policy)
            .unwrap();
        Self {
            clock,
            engine,
            origin: Origin::new(),
            layer,
        }
    }

    async fn get(&self, path: &str) -> (StatusCode, HeaderMap, String) {
        self.get_with(path, &[]).await
    }

    async fn get_with(
        &self,
        path: &str,
        fields: &[(&str, &str)],
    ) -> (StatusCode, HeaderMap, String) {
        let svc = self.layer.layer(self.origin.service());
        let mut req = Request::get(path).header("host", "t");
        for (name, value) in fields {
            req = req.header(*name, *value);
        }
        let req = req.body(Body::empty()).unwrap();
        let res = match svc.oneshot(req).await {
            Ok(res) => res,
            Err(e) => return (StatusCode::BAD_GATEWAY, HeaderMap::new(), e.to_string()),
        };
        let (parts, body) = res.into_parts();
        let body = match body.collect().await {
            Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
            Err(e) => format!("body error: {e}"),
        };
        (parts.status, parts.headers, body)
    }

    /// `method path` with `fields`, marked [`StoredOnly`]: its status,
    /// whether the cache marked it [`NothingStored`], its body.
    async fn stored_only(
        &self,
        mark: StoredOnly,
        method: Method,
        path: &str,
        fields: &[(&str, &str)],
    ) -> (StatusCode, bool, String) {
        let svc = self.layer.layer(self.origin.service());
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "t");
        for (name, value) in fields {
            req = req.header(*name, *value);
        }
        let mut req = req.body(Body::empty()).unwrap();
        req.extensions_mut().insert(mark);
        let res = svc.oneshot(req).await.expect("the cache answers");
        let (status, nothing) = (
            res.status(),
            res.extensions().get::<NothingStored>().is_some(),
        );
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, nothing, String::from_utf8_lossy(&body).into_owned())
    }

    fn advance(&self, ms: u64) {
        self.clock.advance(Duration::from_millis(ms));
    }
}

fn x_cache(h: &HeaderMap) -> &str {
    h.get("x-cache").map(|v| v.to_str().unwrap()).unwrap_or("")
}

fn status_of(h: &HeaderMap) -> &str {
    h.get("cache-status")
        .map(|v| v.to_str().unwrap())
        .unwrap_or("")
}

/// `/p` stored for a second (with a 30 s stale-while-revalidate window
/// when `swr`), then stale.
async fn stale_p(swr: bool) -> Harness {
    let mut policy = Policy::ttl(secs(1)).jitter(0.0);
    if swr {
        policy = policy.stale_while_revalidate(secs(30));
    }
    let t = Harness::new(policy.build().unwrap());
    t.get("/p").await;
    t.advance(1500);
    t
}

/// The cache key of a GET of `path` as `Harness::get` sends it.
fn key_of(path: &str) -> tiercache::core::CacheKey {
    let req = Request::get(path).header("host", "t").body(()).unwrap();
    tiercache::http::key::request_key(&req.into_parts().0)
}

/// What a client gets for a body that broke off before its end.
const BROKE_OFF: &str = "the origin's answer broke off before its end\n";

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_while_revalidate_answers_at_once_and_refreshes_exactly_once() {
    let t = Harness::new(a_second_then_30s_stale());
    let (_, h, body) = t.get("/r").await;
    assert_eq!((x_cache(&h), body.as_str()), ("MISS", "body 1"));
    t.advance(1400);
    let gate = Gate::new();
    t.origin.set(Mode::Held(gate.clone()));
    // 20 concurrent requests while the refresh is held at the origin: every
    // one answers stale without waiting for it.
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let t = &t;
            async move { t.get("/r").await }
        })
        .collect();
    for (_, h, body) in futures_join(tasks).await {
        assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
        // Answered from the cache, not forwarded (RFC 9211: a hit; a
        // negative ttl says it is stale): the refresh is not this request's.
        assert_eq!(status_of(&h), "tiercache; hit; ttl=-1; detail=l1");
    }
    t.origin.calls.reached(2).await;
    gate.open();
    let engine = t.engine.clone();
    eventually("the refresh to finish", || engine.in_flight() == 0).await;
    assert_eq!(t.origin.calls.get(), 2, "exactly one refresh");
    let (_, h, body) = t.get("/r").await;
    assert_eq!((x_cache(&h), body.as_str()), ("HIT", "body 2"));
    assert_eq!(t.engine.stats().stale_served, 20);
}

/// Fresh for a second, then stale while revalidated for 30 s.
fn a_second_then_30s_stale() -> Policy {
    Policy::ttl(secs(1))
        .jitter(0.0)
        .stale_while_revalidate(secs(30))
        .build()
        .unwrap()
}

/// Five requests for `path` at once, the origin held by `gate` until its
/// calls reach `calls` (the first of them loads, the others wait on it).
async fn five_at_once(
    t: &Harness,
    path: &str,
    gate: &Gate,
    calls: usize,
) -> Vec<(StatusCode, HeaderMap, String)> {
    let requests = futures_join((0..5).map(|_| t.get(path)).collect());
    let opener = async {
        t.origin.calls.reached(calls).await;
        gate.open();
    };
    tokio::join!(requests, opener).0
}

async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let mut pinned: Vec<_> = futs.into_iter().map(Box::pin).collect();
    // Poll all concurrently: a small join_all without a new dependency.
    let mut done: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if done[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => done[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.extend(done.into_iter().map(Option::unwrap));
    out
}

/// A refresh answered with what may no longer be stored or shared
/// (`private`, `Set-Cookie`) outdates the entry it refreshed: the entry is
/// dropped, not served stale for the rest of its window with a refresh on
/// every request (found by a black-box audit: 5 requests, 5 refreshes).
#[tokio::test]
async fn a_refresh_answered_private_drops_the_stale_entry() {
    for fields in [
        &[("cache-control", "private")][..],
        &[("set-cookie", "session=1")][..],
    ] {
        let t = Harness::new(
            Policy::ttl(secs(1))
                .jitter(0.0)
                .stale_while_revalidate(secs(30))
                .build()
                .unwrap(),
        );
        t.get("/p").await;
        t.advance(1500);
        t.origin.set(Mode::Always(fields));
        let (_, h, body) = t.get("/p").await;
        assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
        let engine = t.engine.clone();
        eventually("the refresh", || engine.in_flight() == 0).await;
        for n in 3..6 {
            let (_, h, body) = t.get("/p").await;
            assert_ne!(x_cache(&h), "STALE", "{fields:?}");
            assert_eq!(body, format!("body {n}"), "{fields:?}");
        }
        assert_eq!(t.origin.calls.get(), 5);
    }
}

/// A refresh that fails, by its status or by a body that breaks off
/// midway, leaves the entry to be served stale for the rest of its window:
/// a broken body is the origin failing, not an answer that outdates it.
#[tokio::test]
async fn a_failed_refresh_keeps_the_stale_entry_until_the_window_ends() {
    for mode in [Mode::Status(503), Mode::BrokenBody] {
        let t = Harness::new(
            Policy::ttl(secs(1))
                .jitter(0.0)
                .stale_while_revalidate(secs(10))
                .build()
                .unwrap(),
        );
        t.get("/r").await;
        t.advance(1500);
        t.origin.set(mode.clone());
        for _ in 0..3 {
            let (_, h, body) = t.get("/r").await;
            assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
            let engine = t.engine.clone();
            eventually("the refresh", || engine.in_flight() == 0).await;
        }
        t.advance(10_000);
        let (status, _, body) = t.get("/r").await;
        match mode {
            Mode::Status(_) => assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "past the window the error shows"
            ),
            _ => assert_eq!(
                (status, body.as_str()),
                (StatusCode::BAD_GATEWAY, BROKE_OFF),
                "past the window the error shows"
            ),
        }
    }
}

/// A refresh that failed is not started again by every stale hit: the
/// stale entry answers on, and the origin is asked again a second later
/// (a black-box audit: 24 refreshes a second of one key under 8 clients,
/// each starting as the last failed).
#[tokio::test]
async fn a_failed_refresh_is_retried_a_second_later_not_at_every_stale_hit() {
    let t = stale_p(true).await;
    t.origin.set(Mode::Status(503));
    for _ in 0..5 {
        let (_, h, body) = t.get("/p").await;
        assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
        let engine = t.engine.clone();
        eventually("the refresh", || engine.in_flight() == 0).await;
    }
    assert_eq!(t.origin.calls.get(), 2, "the fill and one refresh");
    t.advance(1100);
    t.origin.set(Mode::Ok(&[]));
    let (_, h, _) = t.get("/p").await;
    assert_eq!(x_cache(&h), "STALE");
    let engine = t.engine.clone();
    eventually("the refresh", || engine.in_flight() == 0).await;
    // Revalidated (a 304 for its `ETag`): fresh again.
    let (_, h, body) = t.get("/p").await;
    assert_eq!((x_cache(&h), body.as_str()), ("HIT", "body 1"));
    assert_eq!(t.origin.calls.get(), 3);
}

/// An error stored with explicit freshness (RFC 9111 lets a shared cache
/// store it) is never served stale, so `max_error_ttl` bounds it: a 500
/// declaring 600 s, capped at 60 s, was answered stale while revalidating
/// past that, and stood in for the origin's next failure.
#[tokio::test]
async fn a_stored_error_is_never_served_stale() {
    let t = Harness::new(
        Policy::ttl(secs(60))
            .jitter(0.0)
            .stale_while_revalidate(secs(60))
            .stale_if_error(secs(300))
            .build()
            .unwrap(),
    );
    t.origin
        .set(Mode::StatusWith(500, &[("cache-control", "max-age=600")]));
    let (status, _, _) = t.get("/r").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (_, h, _) = t.get("/r").await;
    assert_eq!(x_cache(&h), "HIT");
    t.advance(61_000);
    t.origin.set(Mode::Status(502));
    let (status, h, _) = t.get("/r").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{h:?}");
    assert_ne!(x_cache(&h), "STALE");
    assert_eq!(t.origin.calls.get(), 2);
}

/// Nor after a 304 renewed it: an error kept for its validators, renewed
/// by a 304 that gives no freshness but a stale-while-revalidate window,
/// was answered stale in it.
#[tokio::test]
async fn a_stored_error_renewed_by_a_304_is_not_served_stale() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    let stored = &[("cache-control", "max-age=1"), ("etag", "\"v1\"")];
    t.origin.set(Mode::StatusWith(500, stored));
    t.get("/r").await;
    t.advance(1500);
    let renewal = &[("cache-control", "stale-while-revalidate=60")];
    t.origin.set(Mode::NotModified(renewal));
    let (status, _, _) = t.get("/r").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(t.origin.calls.get(), 2, "revalidated");
    t.advance(1000);
    let (_, h, _) = t.get("/r").await;
    assert_ne!(x_cache(&h), "STALE");
    assert_eq!(t.origin.calls.get(), 3, "revalidated again");
}

/// A body that breaks off midway says nothing about the resource: the key
/// is not remembered as uncacheable (hit-for-miss), so the requests that
/// follow still share one origin call.
#[tokio::test]
async fn a_broken_body_does_not_mark_the_key_uncacheable() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    t.origin.set(Mode::BrokenBody);
    let (status, h, body) = t.get("/b").await;
    // Read whole before any of it was sent: a clean 502, where the
    // origin's head with a body that breaks reached a client over HTTP/1
    // as nothing at all (an empty reply, which clients retry blindly).
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_GATEWAY, BROKE_OFF)
    );
    assert_eq!(status_of(&h), "tiercache; fwd=miss; detail=body-failed");
    let gate = Gate::new();
    t.origin.set(Mode::Held(gate.clone()));
    // Five requests at once while the origin is held: one loads, four wait
    // on it (hit-for-miss would send each to the origin).
    for (_, _, body) in five_at_once(&t, "/b", &gate, 2).await {
        assert_eq!(body, "body 2");
    }
    assert_eq!(t.origin.calls.get(), 2, "one origin call for the five");
}

#[tokio::test]
async fn stale_if_error_covers_each_error_kind() {
    for mode in [
        Mode::Status(500),
        Mode::Status(502),
        Mode::Status(503),
        Mode::Status(504),
        Mode::Fail,
        Mode::BrokenBody,
        // The stale entry answers it: what is read is not sent on early.
        Mode::SlowBrokenBody,
    ] {
        let t = Harness::new(stale_if_error_a_minute());
        t.get("/r").await;
        t.advance(2000);
        t.origin.set(mode);
        let (status, h, body) = t.get("/r").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "body 1"));
        assert_eq!(x_cache(&h), "STALE");
        assert_eq!(status_of(&h), "tiercache; fwd=stale; detail=origin-error");
        // For a second the stale copy answers without asking the origin.
        let calls = t.origin.calls.get();
        let (_, h, body) = t.get("/r").await;
        assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
        assert_eq!(t.origin.calls.get(), calls, "asked again at once");
        // A 404 is an answer, not an error: it is not papered over.
        t.advance(1000);
        t.origin.set(Mode::Status(404));
        let (status, _, _) = t.get("/r").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn stale_if_error_is_refused_under_must_revalidate() {
    for directive in ["must-revalidate", "proxy-revalidate"] {
        let t = Harness::new(
            Policy::ttl(secs(1))
                .jitter(0.0)
                .stale_if_error(secs(60))
                .stale_while_revalidate(secs(60))
                .build()
                .unwrap(),
        );
        let headers: &'static [(&str, &str)] = match directive {
            "must-revalidate" => &[("cache-control", "must-revalidate")],
            _ => &[("cache-control", "proxy-revalidate")],
        };
        t.origin.set(Mode::Ok(headers));
        t.get("/r").await;
        t.advance(2000);
        t.origin.set(Mode::Status(503));
        let (status, h, _) = t.get("/r").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{directive}");
        assert_eq!(x_cache(&h), "MISS");
    }
}

/// `/r` stored, then past its 1 s ttl inside a minute of stale-if-error,
/// with a 300 ms soft timeout (and the default 5 s `lock_timeout`); the
/// origin now holds every call until the gate opens.
async fn stale_with_a_held_origin() -> (Harness, Gate) {
    let t = Harness::new(
        Policy::ttl(secs(1))
            .jitter(0.0)
            .stale_if_error(secs(60))
            .origin_soft_timeout(Duration::from_millis(300))
            .lock_timeout(secs(5))
            .build()
            .unwrap(),
    );
    t.get("/r").await;
    t.advance(2000);
    let gate = Gate::new();
    t.origin.set(Mode::Held(gate.clone()));
    (t, gate)
}

#[tokio::test(start_paused = true)]
async fn a_slow_origin_past_the_soft_timeout_answers_stale() {
    let (t, gate) = stale_with_a_held_origin().await;
    let started = tokio::time::Instant::now();
    let (_, h, body) = t.get("/r").await;
    assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
    assert_eq!(status_of(&h), "tiercache; fwd=stale; detail=origin-timeout");
    assert!(started.elapsed() >= Duration::from_millis(300));
    gate.open();
    let engine = t.engine.clone();
    bounded(
        "the background fill",
        eventually("the fill", || engine.in_flight() == 0),
    )
    .await;
    let (_, h, body) = t.get("/r").await;
    assert_eq!(
        (x_cache(&h), body.as_str()),
        ("HIT", "body 2"),
        "the fill finished and stored"
    );
}

/// Every request waiting on the slow load gets the stale answer at the soft
/// timeout, not only the one that leads it: the others used to wait the
/// whole `lock_timeout`.
#[tokio::test(start_paused = true)]
async fn every_waiter_on_a_slow_origin_answers_stale_at_the_soft_timeout() {
    let (t, gate) = stale_with_a_held_origin().await;
    let started = tokio::time::Instant::now();
    let timed = || async {
        let (_, h, body) = t.get("/r").await;
        (x_cache(&h).to_owned(), body, started.elapsed())
    };
    let answers = tokio::join!(timed(), timed(), timed());
    for (x_cache, body, took) in [answers.0, answers.1, answers.2] {
        assert_eq!((x_cache.as_str(), body.as_str()), ("STALE", "body 1"));
        assert_eq!(
            took,
            Duration::from_millis(300),
            "answered at the soft timeout"
        );
    }
    assert_eq!(t.engine.stats().coalesced, 2, "the waiters shared the load");
    assert_eq!(t.engine.stats().stale_served, 3);
    assert_eq!(t.origin.seen.lock().unwrap().len(), 2, "one origin call");
    gate.open();
}

/// A waiter whose leader's answer may not be shared loads on its own; when
/// that load fails, its stale copy still stands in (stale-if-error), as it
/// does for the leader.
#[tokio::test(start_paused = true)]
async fn a_waiter_loading_on_its_own_keeps_stale_if_error() {
    let t = Harness::new(stale_if_error_a_minute());
    t.get("/r").await;
    t.advance(2000);
    let gate = Gate::new();
    t.origin.set(Mode::HeldSetCookie(gate.clone()));
    let (leader, follower, ()) = tokio::join!(t.get("/r"), t.get("/r"), async {
        // The leader's call started, the other request waits on it.
        while t.origin.calls.get() < 2 || t.engine.stats().coalesced < 1 {
            tokio::task::yield_now().await;
        }
        // The follower's own call, after the leader's, fails.
        t.origin.set(Mode::Status(503));
        gate.open();
    });
    assert_eq!((leader.0, leader.2.as_str()), (StatusCode::OK, "body 2"));
    assert_eq!(
        (follower.0, x_cache(&follower.1), follower.2.as_str()),
        (StatusCode::OK, "STALE", "body 1"),
        "the waiter's own failed load was answered as it came"
    );
    assert_eq!(t.origin.seen.lock().unwrap().len(), 3);
}

/// A request that arrives after an invalidation, while a load of the key
/// fails, gets the failure, not the stale copy the invalidation removed
/// (the request leading the load came before it and may still stand that
/// copy in).
#[tokio::test(start_paused = true)]
async fn a_request_after_an_invalidation_is_not_answered_with_the_removed_copy() {
    let t = Harness::new(stale_if_error_a_minute());
    let gate = Gate::new();
    let (leader, after) =
        invalidated_while_it_fails(&t, Mode::HeldStatus(gate.clone(), 503), &gate).await;
    assert_eq!((x_cache(&leader.1), leader.2.as_str()), ("STALE", "body 1"));
    assert_eq!(
        (after.0, after.2.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "status 503"),
        "answered with the copy its invalidation removed"
    );
}

/// The same when the load fails with nothing to share (its answer broke
/// off): the request without a copy of its own gets the failure, not an
/// origin call of its own.
#[tokio::test(start_paused = true)]
async fn a_request_after_an_invalidation_gets_a_failed_loads_failure_without_a_call() {
    let t = Harness::new(stale_if_error_a_minute());
    let gate = Gate::new();
    let (leader, after) =
        invalidated_while_it_fails(&t, Mode::HeldBroken(gate.clone()), &gate).await;
    assert_eq!((x_cache(&leader.1), leader.2.as_str()), ("STALE", "body 1"));
    assert_eq!(after.0, StatusCode::BAD_GATEWAY);
    assert_eq!(
        t.origin.calls.get(),
        2,
        "the fill, then the failed load alone"
    );
}

/// `/r` stored, then stale: a load of it fails through `failing` (held by
/// `gate`); a request that comes after an invalidation of `/r` waits on
/// that load. The leader's answer and that request's.
async fn invalidated_while_it_fails(
    t: &Harness,
    failing: Mode,
    gate: &Gate,
) -> (
    (StatusCode, HeaderMap, String),
    (StatusCode, HeaderMap, String),
) {
    t.get("/r").await;
    t.advance(2000);
    t.origin.set(failing);
    let uri: axum::http::Uri = "http://t/r".parse().unwrap();
    let (leader, after, ()) = tokio::join!(
        t.get("/r"),
        async {
            while t.origin.calls.get() < 2 {
                tokio::task::yield_now().await;
            }
            t.layer.invalidate_url(&uri).await.unwrap();
            t.get("/r").await
        },
        async {
            while t.engine.stats().coalesced < 1 {
                tokio::task::yield_now().await;
            }
            gate.open();
        }
    );
    (leader, after)
}

#[tokio::test]
async fn a_304_renews_the_entry_without_a_body() {
    let t = Harness::new(a_second_then_30s_stale());
    t.get("/r").await;
    t.advance(1500);
    let (_, h, _) = t.get("/r").await;
    assert_eq!(x_cache(&h), "STALE");
    let engine = t.engine.clone();
    eventually("the revalidation", || engine.in_flight() == 0).await;
    let seen = t.origin.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1]["if-none-match"], "\"v1\"",
        "the refresh was conditional"
    );
    let (_, h, body) = t.get("/r").await;
    assert_eq!(
        (x_cache(&h), body.as_str()),
        ("HIT", "body 1"),
        "renewed, same body"
    );
    assert_eq!(h["age"], "0", "the renewal counts as a fresh answer");
}

/// A 304 is merged into the stored head, and the result is judged like any
/// response: a 304 that sets a cookie, or says `private`, `no-store` or
/// `Vary: *`, answers its own request (cookie included) but is never stored
/// or shared (a black-box audit saw Alice's `Set-Cookie` served to Bob from
/// L2), whether the revalidation is the request's own or a refresh.
#[tokio::test]
async fn a_304_that_may_not_be_shared_is_not_stored() {
    const FIELDS: [&[(&str, &str)]; 4] = [
        &[("set-cookie", "session=alice")],
        &[("cache-control", "private, max-age=60")],
        &[("cache-control", "no-store")],
        &[("vary", "*")],
    ];
    for swr in [false, true] {
        for fields in FIELDS {
            let t = stale_p(swr).await;
            t.origin.set(Mode::NotModified(fields));
            let (status, h, body) = t.get("/p").await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "body 1"));
            if !swr {
                let (name, value) = fields[0];
                assert_eq!(h[name], value, "the 304's own request gets its fields");
            }
            let engine = t.engine.clone();
            eventually("the revalidation", || engine.in_flight() == 0).await;
            assert!(
                !t.engine.l1_contains(&key_of("/p")),
                "{fields:?} swr={swr}: the entry is dropped"
            );
            // Another user, once the origin answers plainly again.
            t.origin.set(Mode::Ok(&[]));
            let (_, h, _) = t.get("/p").await;
            assert!(h.get("set-cookie").is_none(), "{fields:?} swr={swr}: {h:?}");
            let cc = h.get("cache-control").map(|v| v.to_str().unwrap());
            assert!(
                !cc.is_some_and(|v| v.contains("private") || v.contains("no-store")),
                "{fields:?} swr={swr}: {h:?}"
            );
            assert_ne!(h.get("vary").map(|v| v.as_bytes()), Some(&b"*"[..]));
        }
    }
}

/// A 304 whose validator is not the stored response's does not renew it
/// (RFC 9111 §4.3.4: no stored response is selected): the old body is never
/// served under the new validator. The entry is dropped and the request is
/// sent again without validators, once, so the client (or the background
/// refresh) gets the current version and stores it. Origins behind a load
/// balancer whose servers differ in `Last-Modified` answer so; this was a
/// 502 to the client.
#[tokio::test]
async fn a_304_with_another_validator_is_asked_again_without_validators() {
    for swr in [false, true] {
        let t = stale_p(swr).await;
        t.origin.set(Mode::Changed);
        let (status, h, body) = t.get("/p").await;
        if swr {
            assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
        } else {
            assert_eq!(
                (status, body.as_str()),
                (StatusCode::OK, "body 3"),
                "the current version, asked for again: {h:?}"
            );
            assert_eq!(h["etag"], "\"v2\"", "its own validator");
        }
        let engine = t.engine.clone();
        eventually("the revalidation", || engine.in_flight() == 0).await;
        let seen = t.origin.seen.lock().unwrap().clone();
        assert_eq!(
            seen.len(),
            3,
            "swr={swr}: one revalidation, one plain request"
        );
        assert_eq!(seen[1]["if-none-match"], "\"v1\"", "swr={swr}");
        assert!(
            !seen[2].contains_key("if-none-match") && !seen[2].contains_key("if-modified-since"),
            "swr={swr}: asked again without validators: {:?}",
            seen[2]
        );
        let (status, h, body) = t.get("/p").await;
        assert_eq!(
            (status, x_cache(&h), body.as_str()),
            (StatusCode::OK, "HIT", "body 3"),
            "swr={swr}: the current version stored, never the old body: {h:?}"
        );
        assert_eq!(h["etag"], "\"v2\"", "swr={swr}");
        assert_eq!(t.origin.calls.get(), 3, "swr={swr}");
    }
}

/// An origin that answers the request asked again without validators
/// with a 304 too (with no validator, which would select any stored
/// response) renews nothing: a 502, the outdated entry dropped, never the
/// old body the first 304 said was outdated.
#[tokio::test]
async fn a_304_to_the_request_asked_again_is_a_502() {
    let t = stale_p(false).await;
    t.origin.set(Mode::OnlyNotModified);
    let (status, h, body) = t.get("/p").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{h:?} {body}");
    assert_eq!(t.origin.calls.get(), 3);
    assert!(!t.engine.l1_contains(&key_of("/p")));
}

/// A 304 to a load without validators (the client's are taken off, and
/// none is added without a stored response) answers nothing (RFC 9110
/// §15.4.5): the request gets a 502, and so do the requests waiting on
/// it. Each went to the origin alone and passed its bare 304 on to a
/// client that had asked for none (a black-box audit: 21 origin calls for
/// 20 clients of an origin that answers 304 to everything).
#[tokio::test]
async fn a_304_to_a_load_without_validators_is_a_502_for_every_request_waiting() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    let gate = Gate::new();
    t.origin.set(Mode::HeldStatus(gate.clone(), 304));
    for (status, h, body) in five_at_once(&t, "/n", &gate, 1).await {
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{h:?} {body}");
    }
    assert_eq!(t.origin.calls.get(), 1, "one origin call for the five");
    assert!(!t.engine.l1_contains(&key_of("/n")));
}

/// A stored response without validators, refreshed: the refresh is
/// asked without validators, so the origin's 304 answers nothing and
/// renews nothing (a review finding: it renewed the entry, and an origin
/// that answers 304 to everything kept it fresh for good).
#[tokio::test]
async fn a_304_to_a_refresh_without_validators_renews_nothing() {
    let t = Harness::new(a_second_then_30s_stale());
    t.origin.set(Mode::Always(&[]));
    t.get("/r").await;
    t.advance(1500);
    t.origin.set(Mode::OnlyNotModified);
    let (_, h, body) = t.get("/r").await;
    assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"));
    let engine = t.engine.clone();
    eventually("the refresh", || engine.in_flight() == 0).await;
    assert_eq!(t.origin.calls.get(), 2);
    let (_, h, body) = t.get("/r").await;
    assert_eq!((x_cache(&h), body.as_str()), ("STALE", "body 1"), "renewed");
}

/// A request for a key that is not stored goes to the origin with its
/// `Range`; the origin's 416 answers that request only. Stored under the
/// URL's key, an anonymous `Range: bytes=999999999-` would have answered
/// every client's plain GET with a 416 (a review finding).
#[tokio::test]
async fn a_416_to_a_range_is_never_stored() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    t.origin.set(Mode::Ranged);
    t.get("/f").await;
    let (status, _, _) = t.get_with("/f", &[("range", "bytes=999999999-")]).await;
    assert_eq!(status, StatusCode::RANGE_NOT_SATISFIABLE);
    t.origin.set(Mode::Ok(&[]));
    let (status, h, _) = t.get("/f").await;
    assert_eq!(status, StatusCode::OK, "{h:?}");
}

#[tokio::test]
async fn negative_entries_expire_at_the_negative_ttl() {
    let t = Harness::new(
        Policy::ttl(secs(60))
            .jitter(0.0)
            .negative_ttl(secs(1))
            .build()
            .unwrap(),
    );
    t.origin.set(Mode::Status(404));
    let (status, h, _) = t.get("/gone").await;
    assert_eq!((status, x_cache(&h)), (StatusCode::NOT_FOUND, "MISS"));
    t.advance(999);
    assert_eq!(x_cache(&t.get("/gone").await.1), "HIT");
    t.advance(1);
    assert_eq!(x_cache(&t.get("/gone").await.1), "MISS");
    assert_eq!(t.origin.calls.get(), 2);
}

#[tokio::test]
async fn an_origin_max_age_wins_over_the_route_ttl() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    t.origin.set(Mode::Ok(&[("cache-control", "max-age=1")]));
    t.get("/r").await;
    t.advance(999);
    assert_eq!(x_cache(&t.get("/r").await.1), "HIT");
    t.advance(1);
    assert_eq!(x_cache(&t.get("/r").await.1), "MISS");
    // A route may override the origin.
    let t = Harness::new(overriding_a_minute());
    t.origin.set(Mode::Ok(&[("cache-control", "max-age=1")]));
    t.get("/r").await;
    t.advance(30_000);
    assert_eq!(x_cache(&t.get("/r").await.1), "HIT");
}

#[tokio::test]
async fn age_counts_from_the_origins_answer() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    t.origin
        .set(Mode::Ok(&[("cache-control", "max-age=100"), ("age", "30")]));
    t.get("/r").await;
    t.advance(5000);
    let (_, h, _) = t.get("/r").await;
    assert_eq!(h["age"], "35");
    let status = status_of(&h);
    assert_eq!(status, "tiercache; hit; ttl=65; detail=l1");
}

/// The route's lifetime counts from the origin's answer too: a response
/// without freshness of its own that has spent part of it (its `Age`, as
/// a cache before this one says) lives only the rest, and one older than
/// the lifetime is stale on arrival, never stored (RFC 9111 §4.2).
#[tokio::test]
async fn the_routes_lifetime_counts_from_the_origins_answer_too() {
    let t = Harness::new(
        Policy::ttl(secs(60))
            .jitter(0.0)
            .negative_ttl(secs(10))
            .build()
            .unwrap(),
    );
    t.origin.set(Mode::Always(&[("age", "30")]));
    t.get("/r").await;
    t.advance(29_999);
    assert_eq!(x_cache(&t.get("/r").await.1), "HIT");
    t.advance(1);
    assert_eq!(
        x_cache(&t.get("/r").await.1),
        "MISS",
        "60 s since its answer"
    );

    t.origin.set(Mode::Always(&[("age", "100")]));
    let (status, h, _) = t.get("/old").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(status_of(&h), "tiercache; fwd=miss; detail=not-fresh");
    assert_eq!(x_cache(&t.get("/old").await.1), "MISS", "stored stale");
    let calls = t.origin.calls.get();
    // A 404 too, under the negative lifetime.
    t.origin.set(Mode::StatusWith(404, &[("age", "10")]));
    t.get("/gone").await;
    assert_eq!(x_cache(&t.get("/gone").await.1), "MISS");
    assert_eq!(t.origin.calls.get(), calls + 2);

    // Past the shortest lifetime the jitter band may draw (30 s of 60 ±
    // 50 %): stale on arrival, not stored dead.
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.5).build().unwrap());
    t.origin.set(Mode::Always(&[("age", "40")]));
    let (_, h, _) = t.get("/r").await;
    assert_eq!(status_of(&h), "tiercache; fwd=miss; detail=not-fresh");

    // A route that overrides what the origin declared counts from this
    // answer, as it always did: a CDN's `Age` does not keep it from
    // storing.
    let t = Harness::new(overriding_a_minute());
    t.origin.set(Mode::Always(&[
        ("cache-control", "max-age=86400"),
        ("age", "3600"),
    ]));
    t.get("/r").await;
    t.advance(59_000);
    assert_eq!(x_cache(&t.get("/r").await.1), "HIT");
}

/// An expired entry with a validator is kept for a while (never answered)
/// and revalidated: the origin is asked with `If-None-Match`, and its 304
/// renews the entry without a body. Without a stale window configured.
#[tokio::test]
async fn an_expired_entry_with_a_validator_is_revalidated_not_refetched() {
    use axum::Router;
    use axum::routing::get;
    let clock = MockClock::new();
    let engine = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let route = layer
        .route(Policy::ttl(Duration::from_secs(10)).jitter(0.0))
        .unwrap();
    let asked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let app = Router::new().route(
        "/doc",
        get({
            let asked = asked.clone();
            move |headers: HeaderMap| {
                let asked = asked.clone();
                async move {
                    let inm = headers
                        .get("if-none-match")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    asked.lock().unwrap().push(inm.clone());
                    if inm == "\"v1\"" {
                        return (
                            StatusCode::NOT_MODIFIED,
                            [("etag", "\"v1\"")],
                            String::new(),
                        );
                    }
                    (
                        StatusCode::OK,
                        [("etag", "\"v1\"")],
                        "the document".to_owned(),
                    )
                }
            }
        })
        .layer(route),
    );
    let get_doc = || {
        axum::http::Request::get("/doc")
            .header("host", "shop.test")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let body = |res: axum::response::Response| async move {
        let status = res.status();
        let bytes = http_body_util::BodyExt::collect(res.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    let first = app.clone().oneshot(get_doc()).await.unwrap();
    assert_eq!(
        body(first).await,
        (StatusCode::OK, "the document".to_owned())
    );
    clock.advance(Duration::from_secs(30));
    let again = app.clone().oneshot(get_doc()).await.unwrap();
    assert_eq!(
        body(again).await,
        (StatusCode::OK, "the document".to_owned())
    );
    assert_eq!(
        *asked.lock().unwrap(),
        vec![String::new(), "\"v1\"".to_owned()],
        "the second call is conditional"
    );
    // Renewed: fresh again, from the cache.
    let third = app.clone().oneshot(get_doc()).await.unwrap();
    assert_eq!(third.headers()["x-cache"], "HIT");
    assert_eq!(asked.lock().unwrap().len(), 2);
}

/// A flight is keyed by URL, so a request the stale entry does not fit
/// (gzip, stored without a `Vary` to say so) may wait on the load of one it
/// fits. When the origin fails, the stale entry stands in for the requests
/// it fits only: the other gets its own answer, never a body it cannot
/// decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_stand_in_answers_only_the_requests_it_fits() {
    let t = Arc::new(Harness::new(
        Policy::ttl(secs(1))
            .jitter(0.0)
            .stale_if_error(secs(60))
            .build()
            .unwrap(),
    ));
    t.origin.set(Mode::Always(&[("content-encoding", "gzip")]));
    let gzip: &[(&str, &str)] = &[("accept-encoding", "gzip")];
    let (_, h, _) = t.get_with("/z", gzip).await;
    assert_eq!(x_cache(&h), "MISS");
    t.advance(1500);
    let gate = Gate::new();
    t.origin.set(Mode::HeldStatus(gate.clone(), 500));
    let zipped = tokio::spawn({
        let t = t.clone();
        async move { t.get_with("/z", gzip).await }
    });
    bounded("the revalidation at the origin", t.origin.calls.reached(2)).await;
    let plain = tokio::spawn({
        let t = t.clone();
        async move { t.get("/z").await }
    });
    eventually("the plain request waits on the load", || {
        t.engine.stats().coalesced == 1
    })
    .await;
    gate.open();
    let (status, h, _) = bounded("the gzip request", zipped).await.unwrap();
    assert_eq!(status, StatusCode::OK, "stale-if-error: {h:?}");
    assert_eq!(h.get("content-encoding").unwrap(), "gzip");
    let (status, h, body) = bounded("the plain request", plain).await.unwrap();
    assert_eq!(
        h.get("content-encoding"),
        None,
        "a request without gzip got the gzip stand-in"
    );
    assert_eq!((status.as_u16(), body.as_str()), (500, "status 500"));
    assert_eq!(
        t.origin.calls.get(),
        2,
        "the failure, which any client may see, answers it: no call of its own"
    );
}

/// A 304 that leaves no freshness keeps the entry for its validators, under
/// the stale rules its head states: `must-revalidate` forbids stale answers
/// also then (the route's stale-if-error window applied to it, and an
/// outage answered the old body).
#[tokio::test]
async fn a_304_without_freshness_keeps_must_revalidate() {
    let t = Harness::new(stale_if_error_a_minute());
    t.origin.set(Mode::NotModified(&[(
        "cache-control",
        "max-age=0, must-revalidate",
    )]));
    // Stored with `ETag: "v1"` and the route's ttl; then revalidated.
    let (_, h, _) = t.get("/m").await;
    assert_eq!(x_cache(&h), "MISS");
    t.advance(1500);
    let (status, _, body) = t.get("/m").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "body 1"));
    t.advance(1000);
    t.origin.set(Mode::Status(503));
    let (status, h, _) = t.get("/m").await;
    assert_eq!(
        (status, x_cache(&h)),
        (StatusCode::SERVICE_UNAVAILABLE, "MISS"),
        "served stale under must-revalidate: {h:?}"
    );
}

/// A stale entry answers an `only-if-cached` request within its
/// stale-while-revalidate window, and the refresh it starts goes to the
/// origin without that directive (a cache upstream would answer it 504).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_only_if_cached_answer_refreshes_without_the_directive() {
    let t = stale_p(true).await;
    let asked = [("cache-control", "max-stale=5, only-if-cached")];
    let (status, h, body) = t.get_with("/p", &asked).await;
    assert_eq!(
        (status, x_cache(&h), body.as_str()),
        (StatusCode::OK, "STALE", "body 1")
    );
    t.origin.calls.reached(2).await;
    let engine = t.engine.clone();
    eventually("the refresh to finish", || engine.in_flight() == 0).await;
    let seen = t.origin.seen.lock().unwrap().clone();
    assert_eq!(
        seen[1].get("cache-control").map(|v| v.to_str().unwrap()),
        Some("max-stale=5"),
        "the refresh's request"
    );
    let (status, _, _) = t
        .get_with("/cold", &[("cache-control", "only-if-cached")])
        .await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(t.origin.calls.get(), 2);
}

/// A request marked [`StoredOnly`] (what the proxy does at its bound on
/// requests in flight) is answered as `only-if-cached` asks, the field
/// never sent: a stale entry within its window answers and its refresh
/// reaches the origin unmarked; nothing stored, or a GET the cache
/// bypasses, is the cache's own 504, marked [`NothingStored`], the origin
/// never asked; a write passes on still marked, for the service behind to
/// refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_marked_stored_only_never_reaches_the_origin_from_the_cache() {
    let t = stale_p(true).await;
    let (status, nothing, body) = t.stored_only(StoredOnly::L1, Method::GET, "/p", &[]).await;
    assert_eq!(
        (status, nothing, body.as_str()),
        (StatusCode::OK, false, "body 1")
    );
    t.origin.calls.reached(2).await;
    let engine = t.engine.clone();
    eventually("the refresh to finish", || engine.in_flight() == 0).await;
    assert_eq!(t.origin.marked.get(), 0, "the refresh went marked");
    for mark in [StoredOnly::Anywhere, StoredOnly::L1] {
        for (path, fields) in [("/cold", &[][..]), ("/p", &[("cookie", "session=1")][..])] {
            let (status, nothing, _) = t.stored_only(mark, Method::GET, path, fields).await;
            let asked = format!("{mark:?} {path} {fields:?}");
            assert_eq!(
                (status, nothing),
                (StatusCode::GATEWAY_TIMEOUT, true),
                "{asked}"
            );
            let (status, nothing, body) = t.stored_only(mark, Method::HEAD, path, fields).await;
            assert_eq!(
                (status, nothing, body.as_str()),
                (StatusCode::GATEWAY_TIMEOUT, true, ""),
                "HEAD {asked}"
            );
        }
    }
    assert_eq!(t.origin.calls.get(), 2, "the origin was asked");
    let (status, nothing, _) = t
        .stored_only(StoredOnly::Anywhere, Method::POST, "/p", &[])
        .await;
    assert_eq!((status, nothing), (StatusCode::OK, false));
    assert_eq!(t.origin.marked.get(), 1, "the write went unmarked");
}

/// A response stored without a `Date` is dated when the cache received it
/// (RFC 9110 §6.6.1: a cache with a clock MUST add one). Before, each hit
/// went out without one (hyper then dated it with the time of sending), so
/// over HTTP its `Date` moved with every hit while its `Age` grew.
#[tokio::test]
async fn a_response_stored_without_a_date_is_dated_when_it_was_received() {
    let t = Harness::new(Policy::ttl(secs(60)).jitter(0.0).build().unwrap());
    t.origin.set(Mode::Always(&[]));
    let received = t.engine.now();
    let (_, miss, _) = t.get("/r").await;
    let date = tiercache::http::freshness::format_http_date(received);
    assert_eq!(miss.get("date").map(|d| d.to_str().unwrap()), Some(&*date));
    t.advance(5_000);
    let (_, hit, _) = t.get("/r").await;
    assert_eq!(x_cache(&hit), "HIT");
    assert_eq!(hit.get("date").map(|d| d.to_str().unwrap()), Some(&*date));
    assert_eq!(hit["age"], "5");
    // The origin's own `Date` stays as it sent it.
    const DATED: &[(&str, &str)] = &[("date", "Sun, 06 Nov 1994 08:49:37 GMT")];
    t.origin.set(Mode::Always(DATED));
    let (_, miss, _) = t.get("/dated").await;
    assert_eq!(miss["date"], DATED[0].1);
    assert_eq!(t.get("/dated").await.1["date"], DATED[0].1);
}
