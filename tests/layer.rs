//! The layer on an axum app, driven in process with `oneshot`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use tiercache::{Policy, PolicyBuilder, ResponseCacheLayer, TieredCache};
use tiercache_testkit::{Counter, Gate, bounded, eventually};
use tower::ServiceExt;

const TTL: Duration = Duration::from_secs(30);

#[derive(Clone, Default)]
struct Origin {
    calls: Counter,
    gate: Option<Gate>,
}

fn cache() -> ResponseCacheLayer {
    ResponseCacheLayer::new(TieredCache::builder().sweep_interval(None).build().unwrap())
}

fn policy() -> PolicyBuilder {
    Policy::ttl(TTL)
}

/// An app whose `/r` route is cached with `layer` and answered by `respond`.
fn app<F>(layer: &ResponseCacheLayer, origin: Origin, respond: F) -> Router
where
    F: Fn(usize) -> Response<Body> + Clone + Send + Sync + 'static,
{
    let handler = move |State(o): State<Origin>| {
        let respond = respond.clone();
        async move {
            let n = o.calls.bump();
            if let Some(gate) = &o.gate {
                gate.passed().await;
            }
            respond(n)
        }
    };
    Router::new()
        .route(
            "/r",
            get(handler.clone()).layer(layer.route(policy()).unwrap()),
        )
        .route("/plain", get(handler))
        .with_state(origin)
}

fn body_of(n: usize) -> Response<Body> {
    Response::new(Body::from(format!("body {n}")))
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

fn get_req(uri: &str) -> Request<Body> {
    Request::get(uri)
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap()
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

#[tokio::test]
async fn miss_hit_and_bypass_carry_the_cache_headers() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), body_of);

    let (status, headers, body) = send(&app, get_req("/r")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "body 1"));
    assert_eq!(h(&headers, "x-cache"), "MISS");
    assert_eq!(h(&headers, "x-cache-tier"), "origin");
    assert_eq!(h(&headers, "x-cache-hit-ratio"), "0.0000");
    assert_eq!(h(&headers, "cache-status"), "tiercache; fwd=miss; stored");
    assert_eq!(h(&headers, "age"), "0");

    let (_, headers, body) = send(&app, get_req("/r")).await;
    assert_eq!(body, "body 1");
    assert_eq!(h(&headers, "x-cache"), "HIT");
    assert_eq!(h(&headers, "x-cache-tier"), "l1");
    assert_eq!(h(&headers, "x-cache-hit-ratio"), "0.5000");
    let status = h(&headers, "cache-status");
    assert!(status.starts_with("tiercache; hit; ttl="), "{status}");
    assert!(status.ends_with("; detail=l1"), "{status}");
    let ttl: u64 = status
        .split("ttl=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((26..=33).contains(&ttl), "ttl {ttl} outside 30 s ± 10 %");
    assert_eq!(h(&headers, "age"), "0");

    let req = Request::get("/r")
        .header("cookie", "session=alice")
        .body(Body::empty())
        .unwrap();
    let (_, headers, body) = send(&app, req).await;
    assert_eq!(body, "body 2", "a Cookie request reaches the origin");
    assert_eq!(h(&headers, "x-cache"), "BYPASS");
    assert_eq!(h(&headers, "x-cache-tier"), "origin");
    assert_eq!(
        h(&headers, "cache-status"),
        "tiercache; fwd=bypass; detail=cookie"
    );
    assert_eq!(origin.calls.get(), 2);
    let stats = layer.engine().stats();
    assert_eq!((stats.hits_l1, stats.misses, stats.origin_loads), (1, 1, 1));
    assert_eq!(stats.bypassed.get("cookie"), Some(&1));
}

#[tokio::test]
async fn unannotated_routes_are_untouched() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), body_of);
    for n in 1..=2 {
        let (_, headers, body) = send(&app, get_req("/plain")).await;
        assert_eq!(body, format!("body {n}"));
        assert!(headers.get("x-cache").is_none());
        assert!(headers.get("cache-status").is_none());
    }
    assert_eq!(layer.engine().stats().origin_loads, 0);
}

#[tokio::test]
async fn a_bad_route_policy_is_refused_with_the_field_named() {
    let err = cache().route(Policy::ttl(TTL).jitter(0.7)).unwrap_err();
    assert!(err.to_string().contains("`jitter`"), "{err}");
    let err = cache().route(Policy::ttl(Duration::ZERO)).unwrap_err();
    assert!(err.to_string().contains("`ttl`"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_misses_make_one_origin_call() {
    let layer = cache();
    let gate = Gate::new();
    let origin = Origin {
        gate: Some(gate.clone()),
        ..Origin::default()
    };
    let app = app(&layer, origin.clone(), body_of);
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_req("/r")).await })
        })
        .collect();
    // Every request but the leader is waiting on the flight before the origin answers.
    let engine = layer.engine().clone();
    eventually("999 followers", || engine.stats().coalesced == 999).await;
    gate.open();
    for t in tasks {
        let (status, _, body) = bounded("a coalesced request", t).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "body 1"));
    }
    assert_eq!(origin.calls.get(), 1);
    let stats = layer.engine().stats();
    assert_eq!(
        (stats.origin_loads, stats.coalesced, stats.misses),
        (1, 999, 1000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_leader_does_not_strand_its_followers() {
    let layer = cache();
    let gate = Gate::new();
    let origin = Origin {
        gate: Some(gate.clone()),
        ..Origin::default()
    };
    let app = app(&layer, origin.clone(), body_of);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, get_req("/r")).await })
    };
    origin.calls.reached(1).await;
    let followers: Vec<_> = (0..10)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_req("/r")).await })
        })
        .collect();
    let engine = layer.engine().clone();
    eventually("10 followers", || engine.stats().coalesced == 10).await;
    // The leader's client goes away mid-fill.
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    gate.open();
    for f in followers {
        let (_, _, body) = bounded("a follower", f).await.unwrap();
        assert_eq!(body, "body 1");
    }
    let (_, headers, body) = send(&app, get_req("/r")).await;
    assert_eq!((h(&headers, "x-cache"), body.as_str()), ("HIT", "body 1"));
    assert_eq!(origin.calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_panic_wakes_followers_with_an_error() {
    let layer = cache();
    let gate = Gate::new();
    let origin = Origin {
        gate: Some(gate.clone()),
        ..Origin::default()
    };
    let app = app(&layer, origin.clone(), |_| panic!("origin bug"));
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, get_req("/r")).await })
    };
    origin.calls.reached(1).await;
    let followers: Vec<_> = (0..5)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_req("/r")).await })
        })
        .collect();
    let engine = layer.engine().clone();
    eventually("5 followers", || engine.stats().coalesced == 5).await;
    gate.open();
    // The leader sees the panic as it would without the cache.
    assert!(bounded("the leader", leader).await.unwrap_err().is_panic());
    for f in followers {
        let (status, _, _) = bounded("a follower", f).await.unwrap();
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(origin.calls.get(), 1);
    assert_eq!(layer.engine().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_a_set_cookie_response_each_reach_the_origin() {
    let layer = cache();
    let gate = Gate::new();
    let origin = Origin {
        gate: Some(gate.clone()),
        ..Origin::default()
    };
    let app = app(&layer, origin.clone(), |n| {
        Response::builder()
            .header("set-cookie", format!("session=user{n}"))
            .body(Body::from(format!("private page {n}")))
            .unwrap()
    });
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, get_req("/r")).await })
    };
    origin.calls.reached(1).await;
    let followers: Vec<_> = (0..5)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_req("/r")).await })
        })
        .collect();
    let engine = layer.engine().clone();
    eventually("5 followers", || engine.stats().coalesced == 5).await;
    gate.open();
    let (_, headers, body) = leader.await.unwrap();
    assert_eq!(body, "private page 1");
    assert_eq!(h(&headers, "set-cookie"), "session=user1");
    assert_eq!(
        h(&headers, "cache-status"),
        "tiercache; fwd=miss; detail=set-cookie"
    );
    let mut seen = Vec::new();
    for f in followers {
        let (_, headers, body) = bounded("a follower", f).await.unwrap();
        assert_ne!(body, "private page 1", "a follower saw the leader's body");
        assert_ne!(h(&headers, "set-cookie"), "session=user1");
        seen.push(body);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "each follower got its own response");
    assert_eq!(origin.calls.get(), 6);
    // Hit-for-miss: the next request goes straight to the origin, unqueued.
    let (_, headers, _) = send(&app, get_req("/r")).await;
    assert_eq!(h(&headers, "x-cache"), "BYPASS");
    assert_eq!(
        h(&headers, "cache-status"),
        "tiercache; fwd=bypass; detail=hit-for-miss"
    );
    assert_eq!(origin.calls.get(), 7);
}

#[tokio::test(start_paused = true)]
async fn a_follower_gives_up_after_the_lock_timeout() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let gate = Gate::new();
    let origin = Origin {
        gate: Some(gate.clone()),
        ..Origin::default()
    };
    let calls = origin.calls.clone();
    let handler = move |State(o): State<Origin>| async move {
        let n = o.calls.bump();
        if n == 1 {
            // Only the leader's call hangs.
            o.gate.as_ref().unwrap().passed().await;
        }
        body_of(n)
    };
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(200)))
        .unwrap();
    let app = Router::new()
        .route("/r", get(handler).layer(route))
        .with_state(origin);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, get_req("/r")).await })
    };
    calls.reached(1).await;
    let started = tokio::time::Instant::now();
    let (_, headers, body) = send(&app, get_req("/r")).await;
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(body, "body 2", "the follower went to the origin itself");
    assert_eq!(h(&headers, "x-cache"), "MISS");
    let stats = layer.engine().stats();
    assert_eq!((stats.lock_timeouts, stats.coalesced), (1, 1));
    gate.open();
    let (_, _, body) = leader.await.unwrap();
    assert_eq!(body, "body 1");
}

#[tokio::test]
async fn head_then_get_returns_the_full_body() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), body_of);
    let head = Request::head("/r")
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let (status, headers, body) = send(&app, head).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, ""));
    assert_eq!(h(&headers, "x-cache"), "MISS");
    let (_, headers, body) = send(&app, get_req("/r")).await;
    assert_eq!(body, "body 1", "HEAD filled the GET entry with its body");
    assert_eq!(h(&headers, "x-cache"), "HIT");
    assert_eq!(h(&headers, "content-length"), "6");
    let head = Request::head("/r")
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let (_, headers, body) = send(&app, head).await;
    assert_eq!((h(&headers, "x-cache"), body.as_str()), ("HIT", ""));
    // A hit is framed from the stored body: a HEAD says what a GET would send.
    assert_eq!(h(&headers, "content-length"), "6");
    assert_eq!(origin.calls.get(), 1);
}

#[tokio::test]
async fn a_body_over_the_cap_streams_through_unstored() {
    const SIZE: usize = 20 * 1024 * 1024;
    let layer = cache();
    let origin = Origin::default();
    // Streamed in 64 KiB chunks with no Content-Length, so the cap is found while reading.
    let app = app(&layer, origin.clone(), |n| {
        let chunks = (0..SIZE / 65536)
            .map(move |i| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![(n + i) as u8; 65536])));
        Response::new(Body::from_stream(futures_stream(chunks)))
    });
    for n in 1..=2usize {
        let res = app.clone().oneshot(get_req("/r")).await.unwrap();
        // The first finds the body too large; the second skips the flight (hit-for-miss).
        let (x_cache, detail) = if n == 1 {
            ("MISS", "too-large")
        } else {
            ("BYPASS", "hit-for-miss")
        };
        assert_eq!(res.headers()["x-cache"], x_cache);
        let status = res.headers()["cache-status"].to_str().unwrap();
        assert!(status.ends_with(&format!("detail={detail}")), "{status}");
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(bytes.len(), SIZE);
        assert!(
            bytes
                .chunks(65536)
                .enumerate()
                .all(|(i, c)| c.iter().all(|&b| b == (n + i) as u8))
        );
    }
    assert_eq!(origin.calls.get(), 2);
    assert_eq!(layer.engine().l1_entry_count(), 0);
}

/// A body is copied into storage of its own frame by frame: each frame a
/// connection hands over (a slice of its read buffer) is let go before the
/// next is asked for, so the buffer is free for the next read and nothing
/// stored keeps it alive.
#[tokio::test]
async fn each_frame_read_from_the_origin_is_let_go_before_the_next() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};

    /// Marks when the bytes it owns are dropped.
    struct Tracked(Vec<u8>, Arc<AtomicBool>);
    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.store(true, SeqCst);
        }
    }
    const HALF: usize = 32 * 1024;
    for announced in [false, true] {
        let released = Arc::new(AtomicBool::new(false));
        // What `released` said when the second frame was asked for.
        let seen: Arc<Mutex<Option<bool>>> = Arc::default();
        let layer = cache();
        let (r, s) = (released.clone(), seen.clone());
        let app = app(&layer, Origin::default(), move |_| {
            let mut first = Some(bytes::Bytes::from_owner(Tracked(
                vec![b'a'; HALF],
                r.clone(),
            )));
            let (r, s) = (r.clone(), s.clone());
            let mut polls = 0;
            let chunks = std::iter::from_fn(move || {
                polls += 1;
                match polls {
                    1 => Some(Ok::<_, std::io::Error>(first.take()?.slice(..))),
                    2 => {
                        *s.lock().unwrap() = Some(r.load(SeqCst));
                        Some(Ok(bytes::Bytes::from(vec![b'b'; HALF])))
                    }
                    _ => None,
                }
            });
            let mut res = Response::new(Body::from_stream(futures_stream(chunks)));
            if announced {
                res.headers_mut()
                    .insert("content-length", (2 * HALF).to_string().parse().unwrap());
            }
            res
        });
        for x_cache in ["MISS", "HIT"] {
            let (status, headers, body) = send(&app, get_req("/r")).await;
            assert_eq!((status, h(&headers, "x-cache")), (StatusCode::OK, x_cache));
            assert_eq!(body, "a".repeat(HALF) + &"b".repeat(HALF));
        }
        assert_eq!(
            *seen.lock().unwrap(),
            Some(true),
            "Content-Length given: {announced}: the first frame was held while the second was read"
        );
    }
}

fn futures_stream<I>(iter: I) -> impl futures_core::Stream<Item = I::Item> + Send + 'static
where
    I: Iterator + Send + Unpin + 'static,
{
    struct Iter<I>(I);
    impl<I: Iterator + Unpin> futures_core::Stream for Iter<I> {
        type Item = I::Item;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<I::Item>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(iter)
}

type Respond = fn(usize) -> Response<Body>;

#[tokio::test]
async fn unshareable_and_error_responses_are_not_stored() {
    let cases: Vec<(&str, Respond)> = vec![
        ("private", |n| {
            Response::builder()
                .header("cache-control", "private")
                .body(Body::from(n.to_string()))
                .unwrap()
        }),
        ("no-store", |n| {
            Response::builder()
                .header("cache-control", "max-age=60, NO-STORE")
                .body(Body::from(n.to_string()))
                .unwrap()
        }),
        ("no-freshness", |n| {
            Response::builder()
                .status(503)
                .body(Body::from(n.to_string()))
                .unwrap()
        }),
        // A request can provoke a 400 on its own: never stored, whatever
        // its freshness says.
        ("status", |n| {
            Response::builder()
                .status(400)
                .header("cache-control", "max-age=60")
                .body(Body::from(n.to_string()))
                .unwrap()
        }),
        ("vary-star", |n| {
            Response::builder()
                .header("vary", "*")
                .body(Body::from(n.to_string()))
                .unwrap()
        }),
    ];
    for (reason, respond) in cases {
        let layer = cache();
        let origin = Origin::default();
        let app = app(&layer, origin.clone(), respond);
        let (_, headers, body) = send(&app, get_req("/r")).await;
        assert_eq!(body, "1");
        assert_eq!(
            h(&headers, "cache-status"),
            format!("tiercache; fwd=miss; detail={reason}")
        );
        let (_, _, body) = send(&app, get_req("/r")).await;
        assert_eq!(body, "2", "{reason} was stored");
        assert_eq!(layer.engine().l1_entry_count(), 0, "{reason}");
    }
}

#[tokio::test]
async fn vary_keeps_variants_apart() {
    let layer = cache();
    let origin = Origin::default();
    let app = Router::new()
        .route(
            "/r",
            get(|State(o): State<Origin>, headers: HeaderMap| async move {
                o.calls.bump();
                let lang = headers
                    .get("accept-language")
                    .map(|v| v.to_str().unwrap().to_owned());
                Response::builder()
                    .header("vary", "Accept-Language")
                    .body(Body::from(lang.unwrap_or_default()))
                    .unwrap()
            })
            .layer(layer.route(policy()).unwrap()),
        )
        .with_state(origin.clone());
    let lang = |l: &str| {
        Request::get("/r")
            .header("host", "shop.test")
            .header("accept-language", l)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, lang("en")).await.2, "en");
    assert_eq!(send(&app, lang("en")).await.2, "en");
    assert_eq!(
        send(&app, lang("fr")).await.2,
        "fr",
        "fr never gets the en variant"
    );
    assert_eq!(origin.calls.get(), 2);
}

#[tokio::test]
async fn the_query_and_host_are_part_of_the_key() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), body_of);
    assert_eq!(send(&app, get_req("/r?a=1")).await.2, "body 1");
    assert_eq!(send(&app, get_req("/r?a=2")).await.2, "body 2");
    let other = Request::get("/r?a=1")
        .header("host", "evil.test")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, other).await.2, "body 3");
    assert_eq!(send(&app, get_req("/r?a=1")).await.2, "body 1");
}

#[tokio::test]
async fn an_upstream_caches_own_fields_give_way_to_ours_on_a_hit() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), |n| {
        Response::builder()
            .header("cache-control", "max-age=60")
            .header("x-cache", "HIT from upstream")
            .header("cache-status", "upstream; hit")
            .header("x-kept", "yes")
            .body(Body::from(format!("body {n}")))
            .unwrap()
    });
    send(&app, get_req("/r")).await;
    for _ in 0..2 {
        let (_, headers, body) = send(&app, get_req("/r")).await;
        assert_eq!(body, "body 1");
        let all = |name: &str| -> Vec<&str> {
            headers
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect()
        };
        assert_eq!(all("x-cache"), ["HIT"]);
        assert_eq!(all("x-cache-tier"), ["l1"]);
        assert_eq!(all("cache-status").len(), 1);
        assert!(all("cache-status")[0].starts_with("tiercache; hit"));
        assert_eq!(all("x-kept"), ["yes"]);
    }
    assert_eq!(origin.calls.get(), 1);
}

/// RFC 9111 lets a shared cache store an origin failure that declares its
/// freshness (as Traffic Server, httpd and nginx do): capped by
/// `max_error_ttl`. Without freshness it is not stored.
#[tokio::test]
async fn a_5xx_with_explicit_freshness_is_stored_capped() {
    let layer = cache().max_error_ttl(Duration::from_secs(10));
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), |n| {
        Response::builder()
            .status(503)
            .header("cache-control", "max-age=3600")
            .body(Body::from(format!("down {n}")))
            .unwrap()
    });
    let (status, _, body) = send(&app, get_req("/r")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "down 1")
    );
    let (status, headers, body) = send(&app, get_req("/r")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "down 1")
    );
    assert_eq!(h(&headers, "x-cache"), "HIT");
    let ttl: u64 = h(&headers, "cache-status")
        .split("ttl=")
        .nth(1)
        .and_then(|t| t.split(';').next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    assert!(ttl <= 10, "kept {ttl} s");
}

/// A client's validators are answered against a response that is passed
/// through unstored, as against a stored one: 304, no body.
#[tokio::test]
async fn validators_are_answered_on_passed_responses() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), |n| {
        Response::builder()
            .header("cache-control", "private")
            .header("etag", "\"v1\"")
            .body(Body::from(format!("body {n}")))
            .unwrap()
    });
    let req = Request::get("/r")
        .header("host", "example.com")
        .header("if-none-match", "\"v0\", \"v1\"")
        .body(Body::empty())
        .unwrap();
    let (status, headers, body) = send(&app, req).await;
    assert_eq!((status, body.as_str()), (StatusCode::NOT_MODIFIED, ""));
    assert_eq!(h(&headers, "etag"), "\"v1\"");
    let req = Request::get("/r")
        .header("host", "example.com")
        .header("if-none-match", "\"v2\"")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = send(&app, req).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "body 2"));
}

/// One byte range is answered from the stored full response: the origin is
/// asked for the whole (never the range), then 206s are cut from the entry;
/// an unsatisfiable range is a 416; a malformed one is ignored (the whole
/// answers, from the cache: it bypassed it); several ranges, or another
/// unit, bypass.
#[tokio::test]
async fn single_ranges_are_cut_from_the_stored_response() {
    let layer = cache();
    let origin = Origin::default();
    let app = app(&layer, origin.clone(), |_| {
        Response::builder()
            .header("etag", "\"e\"")
            .body(Body::from("0123456789"))
            .unwrap()
    });
    let ranged = |range: &str, if_range: Option<&str>| {
        let mut b = Request::get("/r")
            .header("host", "shop.test")
            .header("range", range);
        if let Some(c) = if_range {
            b = b.header("if-range", c);
        }
        b.body(Body::empty()).unwrap()
    };
    let (status, headers, body) = send(&app, ranged("bytes=0-3", None)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::PARTIAL_CONTENT, "0123")
    );
    assert_eq!(h(&headers, "content-range"), "bytes 0-3/10");
    assert_eq!(h(&headers, "x-cache"), "MISS");
    let (status, headers, body) = send(&app, ranged("bytes=-2", Some("\"e\""))).await;
    assert_eq!((status, body.as_str()), (StatusCode::PARTIAL_CONTENT, "89"));
    assert_eq!(h(&headers, "x-cache"), "HIT");
    let (status, _, body) = send(&app, ranged("bytes=0-1", Some("\"other\""))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "0123456789"));
    let (status, headers, _) = send(&app, ranged("bytes=20-", None)).await;
    assert_eq!(status, StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(h(&headers, "content-range"), "bytes */10");
    assert_eq!(origin.calls.get(), 1, "the origin sent the whole once");
    for malformed in ["bytes=abc", "bytes=4-2", "bytes=-"] {
        let (status, headers, body) = send(&app, ranged(malformed, None)).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "0123456789"));
        assert_eq!(h(&headers, "x-cache"), "HIT", "{malformed}");
    }
    assert_eq!(origin.calls.get(), 1);
    for bypassed in [
        "bytes=0-1, 3-4",
        "items=0-1",
        "bytes=0-99999999999999999999",
    ] {
        let (_, headers, _) = send(&app, ranged(bypassed, None)).await;
        assert_eq!(h(&headers, "x-cache"), "BYPASS", "{bypassed}");
    }
}

/// The layer wraps any tower HTTP service: here a plain hyper service (no
/// axum), whose requests carry hyper's own `Incoming` body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_wraps_a_plain_hyper_service() {
    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tower::Layer;

    let calls = Counter::new();
    let service = tower::service_fn({
        let calls = calls.clone();
        move |_req: Request<Incoming>| {
            let n = calls.bump();
            async move {
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                    bytes::Bytes::from(format!("call {n}")),
                )))
            }
        }
    });
    let cached = cache().route(policy()).unwrap().layer(service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = hyper_util::service::TowerToHyperService::new(cached.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });
    let client =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http::<Body>();
    for expected in ["MISS", "HIT"] {
        let req = Request::get(format!("http://{addr}/r"))
            .body(Body::empty())
            .unwrap();
        let res = client.request(req).await.unwrap();
        assert_eq!(res.headers()["x-cache"], expected);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "call 1");
    }
}

/// Routers nested under different prefixes, each caching its own `/users`
/// with the same engine: axum strips the prefix before the layer sees the
/// request, and the layer keys on the URL the client asked for, so
/// `/v1/users` and `/v2/users` never share an entry (each nest's handler
/// still sees its own path), and a write under one prefix invalidates
/// that prefix's URL.
#[tokio::test]
async fn nested_routers_never_share_an_entry_under_the_stripped_path() {
    let layer = cache();
    let nest = |name: &'static str| {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(0usize));
        let writes = seen.clone();
        Router::new().route(
            "/users",
            get(move |uri: axum::http::Uri| {
                let seen = seen.clone();
                async move { format!("{name} {} v{}", uri.path(), seen.lock().unwrap()) }
            })
            .post(move || {
                let writes = writes.clone();
                async move {
                    *writes.lock().unwrap() += 1;
                    "ok"
                }
            })
            .layer(layer.route(policy()).unwrap()),
        )
    };
    let app = Router::new()
        .nest("/v1", nest("one"))
        .nest("/v2", nest("two"));
    assert_eq!(send(&app, get_req("/v1/users")).await.2, "one /users v0");
    let (_, headers, body) = send(&app, get_req("/v2/users")).await;
    assert_eq!(body, "two /users v0", "answered with another nest's entry");
    assert_eq!(headers["x-cache"], "MISS");
    assert_eq!(send(&app, get_req("/v1/users")).await.1["x-cache"], "HIT");
    // A write under /v2 invalidates /v2/users, and /v1's entry stays.
    let write = Request::post("/v2/users")
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, write).await.0, StatusCode::OK);
    assert_eq!(send(&app, get_req("/v2/users")).await.2, "two /users v1");
    let (_, headers, body) = send(&app, get_req("/v1/users")).await;
    assert_eq!(body, "one /users v0");
    assert_eq!(headers["x-cache"], "HIT");
}

/// Inside a nested router the handler gets the path axum routed by, and
/// the host as the cache keyed it (lower-cased): an HTTP/2 request names
/// its host only in the target (`:authority`), and a handler that builds
/// a redirect from an upper-case one would have it stored for everyone.
#[tokio::test]
async fn a_nested_handler_gets_the_host_as_it_was_keyed() {
    let layer = cache();
    let inner = Router::new().route(
        "/page",
        get(|uri: axum::http::Uri| async move { format!("{uri}") })
            .layer(layer.route(policy()).unwrap()),
    );
    let app = Router::new().nest("/app", inner);
    let req = Request::get("http://SHOP.test/app/page")
        .body(Body::empty())
        .unwrap();
    let (_, headers, body) = send(&app, req).await;
    assert_eq!(headers["x-cache"], "MISS");
    assert_eq!(body, "http://shop.test/page");
}

/// An endless body that says nothing of being a stream (NDJSON under a
/// route's ttl) goes on to its client as it comes (it held the client's
/// head, and the origin's connection after its client left, until
/// `max_body`, days at an event a second). It is read to be stored only
/// for the lifetime it would be stored for: past that, what comes streams
/// through unstored, and the origin's body goes when its client goes.
#[tokio::test(start_paused = true)]
async fn a_body_slower_than_its_lifetime_is_passed_on_not_stored() {
    struct Endless(
        #[allow(dead_code)] tokio::sync::oneshot::Sender<()>,
        tokio::time::Interval,
    );
    impl http_body::Body for Endless {
        type Data = axum::body::Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            match self.1.poll_tick(cx) {
                std::task::Poll::Pending => std::task::Poll::Pending,
                std::task::Poll::Ready(_) => {
                    let line = axum::body::Bytes::from_static(b"{}\n");
                    std::task::Poll::Ready(Some(Ok(http_body::Frame::data(line))))
                }
            }
        }
    }
    let (sender, dropped) = tokio::sync::oneshot::channel();
    let sender = std::sync::Arc::new(std::sync::Mutex::new(Some(sender)));
    let layer = cache();
    let ndjson = move || {
        let sender = sender.lock().unwrap().take().expect("one call");
        let every = tokio::time::interval(Duration::from_secs(1));
        let body = Body::new(Endless(sender, every));
        async move { ([("content-type", "application/x-ndjson")], body) }
    };
    let app = Router::new().route("/feed", get(ndjson).layer(layer.route(policy()).unwrap()));
    let started = tokio::time::Instant::now();
    let res = app.clone().oneshot(get_req("/feed")).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(res.headers()["x-cache"], "MISS");
    // Past the longest lifetime the route's jitter band may draw, lines
    // still come, one a second.
    let mut body = res.into_body();
    let mut lines = 0;
    while started.elapsed() <= TTL.mul_f64(1.5) + Duration::from_secs(2) {
        let came = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(came.chunks(3).all(|line| line == b"{}\n"), "{came:?}");
        lines += came.len() / 3;
    }
    assert!(lines as f64 >= TTL.as_secs_f64() * 1.5, "{lines} lines");
    assert_eq!(layer.engine().l1_entry_count(), 0, "nothing was stored");
    // The client goes: so does the origin's body, at once.
    drop(body);
    bounded("the origin's body dropped", dropped)
        .await
        .unwrap_err();
}

/// A body the test feeds: each `Ok` a frame, an `Err` a break, its end
/// when the feed goes.
struct Fed(tokio::sync::mpsc::UnboundedReceiver<std::io::Result<bytes::Bytes>>);

impl http_body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<std::io::Result<http_body::Frame<bytes::Bytes>>>> {
        self.0
            .poll_recv(cx)
            .map(|next| next.map(|next| next.map(http_body::Frame::data)))
    }
}

type Feed = tokio::sync::mpsc::UnboundedSender<std::io::Result<bytes::Bytes>>;

/// An app whose `/fed` route (cached by `route`) answers its calls with
/// `bodies`, in order, `max-age=60`; and the count of its calls.
fn fed_app(route: ResponseCacheLayer, bodies: Vec<Body>) -> (Router, Counter) {
    let calls = Counter::default();
    let bodies = std::sync::Arc::new(std::sync::Mutex::new(
        bodies
            .into_iter()
            .collect::<std::collections::VecDeque<_>>(),
    ));
    let counted = calls.clone();
    let handler = move || {
        counted.bump();
        let body = bodies.lock().unwrap().pop_front().expect("a body per call");
        async move { ([("cache-control", "max-age=60")], body) }
    };
    (
        Router::new().route("/fed", get(handler).layer(route)),
        calls,
    )
}

fn fed() -> (Feed, Body) {
    let (feed, fed) = tokio::sync::mpsc::unbounded_channel();
    (feed, Body::new(Fed(fed)))
}

async fn next_data(body: &mut Body) -> String {
    let frame = bounded("a frame", body.frame()).await.unwrap().unwrap();
    String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap()
}

/// Feeds `first` and asks `/fed`: the head, once the body went on (after
/// the hold, the clock paused), and the body past that first frame.
async fn first_of(app: &Router, feed: &Feed, first: &'static str) -> (HeaderMap, Body) {
    feed.send(Ok(first.into())).unwrap();
    let res = bounded("the head", app.clone().oneshot(get_req("/fed")))
        .await
        .unwrap();
    let (parts, mut body) = res.into_parts();
    assert_eq!(next_data(&mut body).await, first);
    (parts.headers, body)
}

/// A request for `/fed` that waits on the flight under way.
async fn follower(
    app: &Router,
    layer: &ResponseCacheLayer,
) -> tokio::task::JoinHandle<(StatusCode, HeaderMap, String)> {
    let app = app.clone();
    let request = tokio::spawn(async move { send(&app, get_req("/fed")).await });
    let engine = layer.engine().clone();
    eventually("a follower", || engine.stats().coalesced == 1).await;
    request
}

/// A body still coming a moment after its first bytes (a slow origin, a
/// large body) goes on to its client as it comes while it is read to be
/// stored: it reached it whole, once stored, up to the whole body's time
/// later. The requests waiting on the load get the stored entry.
#[tokio::test(start_paused = true)]
async fn a_body_still_coming_goes_on_as_it_comes_and_is_stored() {
    let layer = cache();
    let (feed, body) = fed();
    let (app, calls) = fed_app(layer.route(policy()).unwrap(), vec![body]);
    let started = tokio::time::Instant::now();
    let (headers, mut body) = first_of(&app, &feed, "first ").await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(h(&headers, "x-cache"), "MISS");
    let follower = follower(&app, &layer).await;
    feed.send(Ok("last".into())).unwrap();
    assert_eq!(next_data(&mut body).await, "last");
    drop(feed);
    assert!(bounded("the end", body.frame()).await.is_none());
    let (status, _, text) = bounded("the follower", follower).await.unwrap();
    assert_eq!((status, text.as_str()), (StatusCode::OK, "first last"));
    let (_, headers, text) = send(&app, get_req("/fed")).await;
    assert_eq!(
        (h(&headers, "x-cache"), text.as_str()),
        ("HIT", "first last")
    );
    assert_eq!(calls.get(), 1);
}

/// A body found over `max_body` once it goes on as it comes: the rest
/// follows it there untouched, nothing is stored, and the key is marked
/// (the next request passes).
#[tokio::test(start_paused = true)]
async fn a_body_going_on_as_it_comes_past_the_cap_streams_through_whole() {
    let layer = cache();
    let (feed, body) = fed();
    let route = layer.route(policy()).unwrap().max_body(10);
    let (app, calls) = fed_app(route, vec![body, Body::from("0123456789abc")]);
    let (_, mut body) = first_of(&app, &feed, "12345").await;
    feed.send(Ok("67890abc".into())).unwrap();
    assert_eq!(next_data(&mut body).await, "67890abc");
    feed.send(Ok("!".into())).unwrap();
    assert_eq!(next_data(&mut body).await, "!");
    drop(feed);
    assert!(bounded("the end", body.frame()).await.is_none());
    assert_eq!(layer.engine().l1_entry_count(), 0);
    let (_, headers, text) = send(&app, get_req("/fed")).await;
    assert_eq!(
        (h(&headers, "x-cache"), text.as_str()),
        ("BYPASS", "0123456789abc")
    );
    assert_eq!(calls.get(), 2);
}

/// A body that breaks off once it goes on as it comes reaches its client
/// cut (an error, never a clean end); the requests waiting on it get the
/// failure, not an origin call each.
#[tokio::test(start_paused = true)]
async fn a_body_going_on_as_it_comes_that_breaks_off_is_cut_for_its_client() {
    let layer = cache();
    let (feed, body) = fed();
    let (app, calls) = fed_app(layer.route(policy()).unwrap(), vec![body]);
    let (_, mut body) = first_of(&app, &feed, "first ").await;
    let follower = follower(&app, &layer).await;
    feed.send(Err(std::io::Error::other("reset"))).unwrap();
    let cut = bounded("the cut", body.frame()).await;
    assert!(matches!(cut, Some(Err(_))), "{cut:?}");
    let (status, _, _) = bounded("the follower", follower).await.unwrap();
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(calls.get(), 1);
    assert_eq!(layer.engine().l1_entry_count(), 0);
}

/// A client that goes while its body goes on as it comes leaves the read
/// to run on, as for any fill whose client left: the body is stored.
#[tokio::test(start_paused = true)]
async fn a_client_gone_while_its_body_goes_on_leaves_it_stored() {
    let layer = cache();
    let (feed, body) = fed();
    let (app, calls) = fed_app(layer.route(policy()).unwrap(), vec![body]);
    let (headers, body) = first_of(&app, &feed, "first ").await;
    assert_eq!(h(&headers, "x-cache"), "MISS");
    drop(body);
    feed.send(Ok("last".into())).unwrap();
    drop(feed);
    let engine = layer.engine().clone();
    eventually("stored", || engine.l1_entry_count() == 1).await;
    let (_, headers, text) = send(&app, get_req("/fed")).await;
    assert_eq!(
        (h(&headers, "x-cache"), text.as_str()),
        ("HIT", "first last")
    );
    assert_eq!(calls.get(), 1);
}

/// The read finds the body over `max_body` in the same turn as it sent
/// the response on (the next frame was there already): the request
/// answers with that response, whole, not with the read's own (empty,
/// its bytes gone to the first).
#[tokio::test(start_paused = true)]
async fn a_body_found_too_large_as_it_goes_on_reaches_its_client_whole() {
    /// `12345`, then nothing until 100 ms later, then (after one more
    /// poll) `67890abc` and `!` at once.
    struct Burst(u8, Option<std::pin::Pin<Box<tokio::time::Sleep>>>);
    impl http_body::Body for Burst {
        type Data = bytes::Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<std::io::Result<http_body::Frame<bytes::Bytes>>>> {
            use std::task::Poll;
            let data = |d: &'static str| Poll::Ready(Some(Ok(http_body::Frame::data(d.into()))));
            self.0 += 1;
            match self.0 {
                1 => data("12345"),
                2 => {
                    let sleep = self.1.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep(Duration::from_millis(100)))
                    });
                    if sleep.as_mut().poll(cx).is_pending() {
                        self.0 -= 1;
                        return Poll::Pending;
                    }
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                3 => data("67890abc"),
                4 => data("!"),
                _ => Poll::Ready(None),
            }
        }
    }
    let layer = cache();
    let route = layer.route(policy()).unwrap().max_body(10);
    let body = Body::new(Burst(0, None));
    let (app, calls) = fed_app(route, vec![body]);
    let (status, _, text) = bounded("the answer", send(&app, get_req("/fed"))).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "1234567890abc!"));
    assert_eq!(calls.get(), 1);
}

/// A read that stops without an end (the origin's body panicked while it
/// went on as it came) reaches its client as an error: a body cut short,
/// never a clean end.
#[tokio::test(start_paused = true)]
async fn a_read_cut_short_as_it_goes_on_is_an_error_for_its_client() {
    struct Panics(u8, tokio::sync::oneshot::Receiver<()>);
    impl http_body::Body for Panics {
        type Data = bytes::Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<std::io::Result<http_body::Frame<bytes::Bytes>>>> {
            if self.0 == 0 {
                self.0 = 1;
                let first = bytes::Bytes::from_static(b"first ");
                return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(first))));
            }
            if std::pin::Pin::new(&mut self.1).poll(cx).is_pending() {
                return std::task::Poll::Pending;
            }
            panic!("the origin's body panics midway");
        }
    }
    let layer = cache();
    let (panic_now, told) = tokio::sync::oneshot::channel();
    let (app, _) = fed_app(
        layer.route(policy()).unwrap(),
        vec![Body::new(Panics(0, told))],
    );
    let res = bounded("the head", app.clone().oneshot(get_req("/fed")))
        .await
        .unwrap();
    let mut body = res.into_body();
    assert_eq!(next_data(&mut body).await, "first ");
    panic_now.send(()).unwrap();
    let cut = bounded("the cut", body.frame()).await;
    assert!(matches!(cut, Some(Err(_))), "{cut:?}");
    assert_eq!(layer.engine().l1_entry_count(), 0);
}

/// A client that goes while its body goes on as it comes lets the read go
/// as any caller that left: with no `max_detached_fills` slot free (one,
/// held by another such read) and nobody waiting, it is cancelled, the
/// origin's body dropped (it ran on, uncapped, to the body's end before).
#[tokio::test(start_paused = true)]
async fn a_client_gone_with_no_detached_slot_cancels_the_read() {
    let engine = TieredCache::builder()
        .sweep_interval(None)
        .max_detached_fills(1)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let (feeds, bodies): (Vec<_>, Vec<_>) = (0..2).map(|_| fed()).unzip();
    let (app, _) = fed_app(layer.route(policy()).unwrap(), bodies);
    for (feed, path) in feeds.iter().zip(["/fed?a", "/fed?b"]) {
        feed.send(Ok("first ".into())).unwrap();
        let res = bounded("the head", app.clone().oneshot(get_req(path)))
            .await
            .unwrap();
        let mut body = res.into_body();
        assert_eq!(next_data(&mut body).await, "first ");
        drop(body);
    }
    // The first holds the one slot; the second is cancelled.
    bounded("the second origin body dropped", feeds[1].closed()).await;
    assert!(!feeds[0].is_closed());
    assert_eq!(layer.engine().stats().fills_cancelled, 1);
}

/// Five requests at once on a body that keeps coming for 1 s (a chunk
/// every 100 ms) under a flight's wait of 300 ms, and how many origin
/// calls they made; `stall` holds the body back 500 ms after its first
/// chunk (an origin gone quiet mid-body).
async fn five_on_a_slow_body(stall: bool) -> (usize, Vec<String>) {
    let layer = cache();
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(300)))
        .unwrap();
    let (feeds, bodies): (Vec<_>, Vec<_>) = (0..5).map(|_| fed()).unzip();
    let (app, calls) = fed_app(route, bodies);
    for feed in feeds {
        tokio::spawn(async move {
            for i in 0..10 {
                let gap = if stall && i == 1 { 500 } else { 100 };
                tokio::time::sleep(Duration::from_millis(gap)).await;
                if feed.send(Ok(format!("{i} ").into())).is_err() {
                    return;
                }
            }
        });
    }
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_req("/fed")).await })
        })
        .collect();
    let mut bodies = Vec::new();
    for request in requests {
        let (status, _, body) = bounded("an answer", request).await.unwrap();
        assert_eq!(status, StatusCode::OK);
        bodies.push(body);
    }
    (calls.get(), bodies)
}

/// A body that keeps coming is waited for past the flight's wait: its
/// head and each frame move the deadline of the requests waiting on it,
/// so they make no origin call of their own. Each took the flight over
/// at each deadline before: 1 + T / `lock_timeout` calls for a body
/// taking T (a black-box audit: a 2.5 s body at a 1 s wait, 3 calls).
/// A body gone quiet longer than the wait is still taken over.
#[tokio::test(start_paused = true)]
async fn a_body_that_keeps_coming_is_waited_for_past_the_lock_timeout() {
    let (calls, bodies) = five_on_a_slow_body(false).await;
    assert_eq!(calls, 1, "{bodies:?}");
    assert!(
        bodies.iter().all(|b| b == "0 1 2 3 4 5 6 7 8 9 "),
        "{bodies:?}"
    );
    let (calls, _) = five_on_a_slow_body(true).await;
    assert!(calls >= 2, "a stalled body is taken over: {calls} calls");
}
