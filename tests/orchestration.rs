//! The engine owns the fill: its guarantees, through the layer and the
//! programmatic API, on a real Valkey where L2 is on (issue 14).
//!
//! - an invalidation that arrives while a fill is in flight wins (by URL,
//!   key, tag, prefix; locally or from another instance);
//! - XFetch refreshes early with Valkey on (a refresh takes only a newer L2 copy);
//! - a failing origin is called once for all the requests waiting on it;
//! - waiters wait until the flight's deadline, and a stalled leader is taken
//!   over by one request at a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tiercache::core::{CacheKey, MockClock};
use tiercache::http::key::request_key;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Commit, LoadError, Policy, PolicyBuilder, ResponseCacheLayer, TieredCache, Value};
use tiercache_testkit::http::{BreaksOff, HOST, header, send};
use tiercache_testkit::{Counter, Gate, ValkeyServer, bounded, eventually};

/// An origin whose data has a version: a GET reads it first, then waits on
/// the gate (a slow answer built from data read before it); a POST bumps it.
#[derive(Clone, Default)]
struct World {
    calls: Counter,
    gate: Gate,
    version: Arc<AtomicUsize>,
    /// Only the first call waits on the gate (default: every call does).
    only_first_gated: Arc<std::sync::atomic::AtomicBool>,
}

fn app(world: &World, route: ResponseCacheLayer) -> Router {
    Router::new()
        .route(
            "/v",
            get(|State(w): State<World>| async move {
                let version = w.version.load(SeqCst);
                let n = w.calls.bump();
                if n == 1 || !w.only_first_gated.load(SeqCst) {
                    w.gate.passed().await;
                }
                ([("surrogate-key", "item")], format!("v{version}"))
            })
            .post(|State(w): State<World>| async move {
                w.version.fetch_add(1, SeqCst);
                "ok"
            }),
        )
        .route(
            "/fail",
            get(|State(w): State<World>| async move {
                let n = w.calls.bump();
                w.gate.passed().await;
                (StatusCode::SERVICE_UNAVAILABLE, format!("down {n}"))
            }),
        )
        .route(
            "/broken",
            get(|State(w): State<World>| async move {
                w.calls.bump();
                w.gate.passed().await;
                (
                    [("cache-control", "max-age=60")],
                    axum::body::Body::new(BreaksOff::default()),
                )
            }),
        )
        .layer(route)
        .with_state(world.clone())
}

fn engine() -> TieredCache {
    TieredCache::builder().sweep_interval(None).build().unwrap()
}

/// An engine on `server`. The command timeout is generous: these tests are
/// about the fleet's behaviour, not Valkey's speed under a loaded CI box
/// (at 50 ms, a slow moment fails open and calls the origin again).
async fn engine_on(server: &ValkeyServer) -> (TieredCache, ValkeyTier) {
    let config = ValkeyConfig::from_url(&server.url())
        .unwrap()
        .command_timeout(Duration::from_secs(1));
    let tier = ValkeyTier::connect(config).await.unwrap();
    let engine = TieredCache::builder()
        .l2(tier.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    (engine, tier)
}

fn policy() -> PolicyBuilder {
    Policy::ttl(Duration::from_secs(60)).tag("items")
}

fn key_of(path: &str) -> CacheKey {
    let req = axum::http::Request::get(path)
        .header("host", HOST)
        .body(())
        .unwrap();
    request_key(&req.into_parts().0)
}

/// How a test invalidates `/v` while its fill is in flight.
#[derive(Debug, Clone, Copy)]
enum Invalidate {
    UnsafeMethod,
    Key,
    Tag,
    Url,
    PathPrefix,
}

async fn invalidate(how: Invalidate, app: &Router, layer: &ResponseCacheLayer) {
    let uri: axum::http::Uri = format!("http://{HOST}/v").parse().unwrap();
    match how {
        Invalidate::UnsafeMethod => {
            let (status, _, _) = send(app, "POST", "/v").await;
            assert_eq!(status, StatusCode::OK);
        }
        Invalidate::Key => layer.engine().invalidate(&key_of("/v")).await.unwrap(),
        Invalidate::Tag => layer.invalidate_tag("items").await.unwrap(),
        Invalidate::Url => layer.invalidate_url(&uri).await.unwrap(),
        Invalidate::PathPrefix => layer.invalidate_path_prefix(&uri).await.unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_during_a_fill_wins_through_the_layer() {
    for how in [
        Invalidate::UnsafeMethod,
        Invalidate::Key,
        Invalidate::Tag,
        Invalidate::Url,
        Invalidate::PathPrefix,
    ] {
        let world = World::default();
        let layer = ResponseCacheLayer::new(engine());
        let app = app(&world, layer.route(policy()).unwrap());
        // The fill reads version 0, then waits.
        let fill = tokio::spawn({
            let app = app.clone();
            async move { send(&app, "GET", "/v").await }
        });
        world.calls.reached(1).await;
        invalidate(how, &app, &layer).await;
        if !matches!(how, Invalidate::UnsafeMethod) {
            world.version.fetch_add(1, SeqCst);
        }
        world.gate.open();
        let (_, _, body) = bounded("the fill", fill).await.unwrap();
        assert_eq!(body, "v0", "{how:?}: the fill still answers its request");
        let (_, headers, body) = send(&app, "GET", "/v").await;
        assert_eq!(
            (header(&headers, "x-cache"), body.as_str()),
            ("MISS", "v1"),
            "{how:?}: the fill the invalidation overtook was stored"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_from_another_instance_during_a_fill_wins_in_l1_and_l2() {
    let server = ValkeyServer::start();
    let world = World::default();
    let (a_engine, a_tier) = engine_on(&server).await;
    let (b_engine, _b_tier) = engine_on(&server).await;
    server.subscribed("tc:inv", 2).await;
    let a_layer = ResponseCacheLayer::new(a_engine.clone());
    let b_layer = ResponseCacheLayer::new(b_engine.clone());
    let a = app(&world, a_layer.route(policy()).unwrap());
    let b = app(&world, b_layer.route(policy()).unwrap());

    let fill = tokio::spawn({
        let a = a.clone();
        async move { send(&a, "GET", "/v").await }
    });
    world.calls.reached(1).await;
    // The write lands on the other instance; its message reaches A.
    let (status, _, _) = send(&b, "POST", "/v").await;
    assert_eq!(status, StatusCode::OK);
    eventually("A heard B's invalidation", || {
        a_engine.stats().l2.invalidations_received >= 1
    })
    .await;
    world.gate.open();
    assert_eq!(bounded("the fill", fill).await.unwrap().2, "v0");
    a_tier.flush().await;
    for (name, app) in [("A", &a), ("B", &b)] {
        let (_, headers, body) = send(app, "GET", "/v").await;
        assert_eq!(
            body, "v1",
            "{name} answered the overtaken fill ({headers:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_during_get_or_load_wins() {
    let server = ValkeyServer::start();
    let (cache, tier) = engine_on(&server).await;
    let policy = policy().build().unwrap();
    let key = CacheKey::new("report");
    let (started, gate) = (Counter::new(), Gate::new());
    let load = tokio::spawn({
        let (cache, policy, key, started, gate) = (
            cache.clone(),
            policy.clone(),
            key.clone(),
            started.clone(),
            gate.clone(),
        );
        async move {
            cache
                .get_or_load(&key, &policy, move || async move {
                    started.bump();
                    gate.passed().await;
                    Ok::<_, ()>(Value::from_body("old"))
                })
                .await
        }
    });
    started.reached(1).await;
    cache.invalidate(&key).await.unwrap();
    gate.open();
    assert_eq!(load.await.unwrap().unwrap().body, "old");
    tier.flush().await;
    assert!(
        cache.get(&key).await.is_none(),
        "the overtaken load was stored"
    );
    let (fresh, _) = engine_on(&server).await;
    assert!(
        fresh.get(&key).await.is_none(),
        "the overtaken load reached L2"
    );
}

/// The origin answered; the invalidation comes before the store: it still wins.
#[tokio::test]
async fn an_invalidation_between_the_answer_and_the_store_wins() {
    let cache = engine();
    let policy = policy().build().unwrap();
    let key = CacheKey::new("k");
    let value = cache
        .get_or_load(&key, &policy, {
            let (cache, key) = (cache.clone(), key.clone());
            move || async move {
                let answer = Value::from_body("old");
                cache.invalidate(&key).await.unwrap();
                Ok::<_, ()>(answer)
            }
        })
        .await;
    assert_eq!(value.unwrap().body, "old");
    assert!(!cache.exists(&key).await);
}

/// Read your writes: a request that arrives after an invalidation and joins
/// a fill it overtook does not get that fill's answer (the client wrote,
/// then read the old version); it loads again. A request that joined
/// before the invalidation still shares the fill's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_after_an_invalidation_never_gets_the_fill_it_overtook() {
    let world = World::default();
    world.only_first_gated.store(true, SeqCst);
    let layer = ResponseCacheLayer::new(engine());
    let app = app(&world, layer.route(policy()).unwrap());
    let get = |app: &Router| {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "GET", "/v").await })
    };
    let leader = get(&app);
    world.calls.reached(1).await;
    let before = get(&app);
    eventually("a request joined the fill", || {
        layer.engine().stats().coalesced == 1
    })
    .await;
    let (status, _, _) = send(&app, "POST", "/v").await;
    assert_eq!(status, StatusCode::OK);
    let after = get(&app);
    eventually("a request joined the fill after the write", || {
        layer.engine().stats().coalesced == 2
    })
    .await;
    world.gate.open();
    for (name, request, want) in [("leader", leader, "v0"), ("before", before, "v0")] {
        let (_, headers, body) = bounded(name, request).await.unwrap();
        assert_eq!(body, want, "{name}: {headers:?}");
    }
    let (_, headers, body) = bounded("after", after).await.unwrap();
    assert_eq!(
        body, "v1",
        "answered with the fill its write overtook: {headers:?}"
    );
    assert_eq!(world.calls.get(), 2);
}

/// A fill an invalidation overtook, slower than `lock_timeout`: its answer
/// (not stored) does not answer the flight that took it over, whose
/// requests came after the invalidation.
#[tokio::test(start_paused = true)]
async fn an_overtaken_fill_never_answers_the_flight_that_took_it_over() {
    let (calls, version) = (Counter::new(), Arc::new(AtomicUsize::new(0)));
    let layer = ResponseCacheLayer::new(engine());
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(200)))
        .unwrap();
    let app = Router::new().route(
        "/slow",
        get({
            let (calls, version) = (calls.clone(), version.clone());
            move || {
                let (calls, version) = (calls.clone(), version.clone());
                async move {
                    let read = version.load(SeqCst);
                    let slow = calls.bump() == 1;
                    let took = if slow { 300 } else { 100 };
                    tokio::time::sleep(Duration::from_millis(took)).await;
                    format!("v{read}")
                }
            }
        })
        .layer(route),
    );
    let get = |app: &Router| {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "GET", "/slow").await })
    };
    let first = get(&app); // t = 0: reads v0, answers at 300 ms
    tokio::time::sleep(Duration::from_millis(50)).await;
    version.store(1, SeqCst);
    let key = key_of("/slow");
    layer.engine().invalidate(&key).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let taker = get(&app); // t = 250: takes the flight over, reads v1 until 350
    tokio::time::sleep(Duration::from_millis(10)).await;
    let joiner = get(&app); // t = 260: joins the taker's flight
    assert_eq!(bounded("first", first).await.unwrap().2, "v0");
    for (name, request) in [("taker", taker), ("joiner", joiner)] {
        let (_, headers, body) = bounded(name, request).await.unwrap();
        assert_eq!(body, "v1", "{name} got the overtaken fill: {headers:?}");
    }
    assert_eq!(calls.get(), 2);
}
/// A write whose client goes away while its invalidations are sent still
/// invalidates everything it names (here its URL and its `Location`): the
/// second used to be left out, in this instance's L1 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_client_goes_away_still_invalidates_all_it_names() {
    let (l2, open) = tiercache::core::MemoryTier::holding_invalidations(Arc::new(MockClock::new()));
    let engine = TieredCache::builder()
        .l2(l2)
        .sweep_interval(None)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine.clone());
    let version = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/a",
            get(|| async { "a" }).post({
                let version = version.clone();
                move || async move {
                    version.fetch_add(1, SeqCst);
                    (StatusCode::CREATED, [("location", "/b")], "created")
                }
            }),
        )
        .route(
            "/b",
            get({
                let version = version.clone();
                move || async move { format!("b{}", version.load(SeqCst)) }
            }),
        )
        .layer(layer.route(policy()).unwrap());
    for path in ["/a", "/b", "/b"] {
        send(&app, "GET", path).await;
    }
    assert_eq!(header(&send(&app, "GET", "/b").await.1, "x-cache"), "HIT");
    let post = tokio::time::timeout(Duration::from_millis(200), send(&app, "POST", "/a")).await;
    assert!(
        post.is_err(),
        "the shared tier held the write's invalidations"
    );
    open.send_replace(true);
    eventually("the write's invalidations landed", || {
        let done = engine.stats().invalidations;
        done.pending == 0 && done.landed >= 2
    })
    .await;
    let (_, headers, body) = send(&app, "GET", "/b").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("MISS", "b1"),
        "the Location's copy outlived the write"
    );
}

/// With Valkey on, an XFetch refresh reads L2 first and finds the very entry
/// it refreshes: it must go on to the origin, not stop there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfetch_refreshes_early_with_valkey_on() {
    let server = ValkeyServer::start();
    let clock = MockClock::new();
    let tier = ValkeyTier::connect(ValkeyConfig::from_url(&server.url()).unwrap())
        .await
        .unwrap();
    let engine = TieredCache::builder()
        .clock(clock.clone())
        .l2(tier.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine.clone());
    let route = layer
        .route(
            Policy::ttl(Duration::from_secs(60))
                .jitter(0.0)
                .xfetch_beta(1.0),
        )
        .unwrap();
    let calls = Counter::new();
    // The origin takes 1,000 s on the engine's clock (δ): close to expiry,
    // XFetch fires on practically every hit.
    let app = Router::new().route(
        "/x",
        get({
            let (clock, calls) = (clock.clone(), calls.clone());
            move || {
                let n = calls.bump();
                clock.advance(Duration::from_secs(1000));
                async move { format!("v{n}") }
            }
        })
        .layer(route),
    );
    assert_eq!(send(&app, "GET", "/x").await.2, "v1");
    tier.flush().await;
    let left = engine.ttl(&key_of("/x")).await.expect("stored");
    clock.advance(left - Duration::from_millis(1));
    let (_, headers, body) = send(&app, "GET", "/x").await;
    assert_eq!((header(&headers, "x-cache"), body.as_str()), ("HIT", "v1"));
    calls.reached(2).await;
    eventually("the refresh landed", || engine.in_flight() == 0).await;
    let (_, headers, body) = send(&app, "GET", "/x").await;
    assert_eq!((header(&headers, "x-cache"), body.as_str()), ("HIT", "v2"));
    // (The refreshed entry's δ is 1,000 s too: XFetch may fire again.)
    assert_eq!(engine.stats().misses, 1, "no client waited on the refresh");
}

/// `n` GETs of `path` at once, spread over `instances` in turn (each an
/// app and its engine): once all but one wait on the first, the gate
/// opens; their answers, in order.
async fn gated_requests(
    world: &World,
    instances: &[(Router, TieredCache)],
    path: &'static str,
    n: usize,
) -> Vec<(StatusCode, axum::http::HeaderMap, String)> {
    let requests: Vec<_> = (0..n)
        .map(|i| {
            let app = instances[i % instances.len()].0.clone();
            tokio::spawn(async move { send(&app, "GET", path).await })
        })
        .collect();
    eventually("all but one waiting", || {
        let waiting: u64 = instances.iter().map(|(_, e)| e.stats().coalesced).sum();
        waiting == n as u64 - 1
    })
    .await;
    world.gate.open();
    let mut answers = Vec::new();
    for r in requests {
        answers.push(bounded("a request", r).await.unwrap());
    }
    answers
}

/// An instance of the test app on `engine`.
fn instance(world: &World, engine: &TieredCache) -> (Router, TieredCache) {
    let route = ResponseCacheLayer::new(engine.clone())
        .route(policy())
        .unwrap();
    (app(world, route), engine.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_origin_is_called_once_for_its_waiters_then_again() {
    let world = World::default();
    let one = instance(&world, &engine());
    for (status, _, body) in gated_requests(&world, std::slice::from_ref(&one), "/fail", 50).await {
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "down 1")
        );
    }
    let app = one.0;
    assert_eq!(world.calls.get(), 1);
    // Nothing was stored: the next request tries the origin again.
    let (status, headers, body) = send(&app, "GET", "/fail").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "down 2")
    );
    assert_eq!(header(&headers, "x-cache"), "MISS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_origin_is_called_once_across_the_fleet() {
    let server = ValkeyServer::start();
    let world = World::default();
    let (a_engine, _a) = engine_on(&server).await;
    let (b_engine, _b) = engine_on(&server).await;
    server.subscribed("tc:inv", 2).await;
    let fleet = [instance(&world, &a_engine), instance(&world, &b_engine)];
    let answers = gated_requests(&world, &fleet, "/fail", 40).await;
    let odd: Vec<_> = answers
        .iter()
        .enumerate()
        .filter(|(_, (_, _, body))| body != "down 1")
        .map(|(i, (status, headers, body))| {
            let via = if i % 2 == 0 { "A" } else { "B" };
            (
                via,
                *status,
                body,
                header(headers, "cache-status").to_owned(),
            )
        })
        .collect();
    assert!(
        odd.is_empty() && world.calls.get() == 1,
        "{} calls; odd answers {odd:?}\nA: {:?}\nB: {:?}",
        world.calls.get(),
        a_engine.stats(),
        b_engine.stats()
    );
}

/// A body that breaks off midway is the origin failing, as a refused
/// connection is: its waiters get the failure, not an origin call each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_breaks_off_is_loaded_once_for_its_waiters() {
    let world = World::default();
    let one = instance(&world, &engine());
    for (status, _, _) in gated_requests(&world, std::slice::from_ref(&one), "/broken", 20).await {
        assert_eq!(status, StatusCode::BAD_GATEWAY);
    }
    let app = one.0;
    assert_eq!(world.calls.get(), 1, "one origin call for the twenty");
    // Nothing was stored, nor the key marked: the next request tries again.
    let (status, headers, _) = send(&app, "GET", "/broken").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        header(&headers, "cache-status"),
        "tiercache; fwd=miss; detail=body-failed"
    );
    assert_eq!(world.calls.get(), 2);
}

/// The same across a fleet: the instance whose load broke off tells the
/// others waiting on its lock, which answer with the failure too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_breaks_off_is_loaded_once_across_the_fleet() {
    let server = ValkeyServer::start();
    let world = World::default();
    let (a_engine, _a) = engine_on(&server).await;
    let (b_engine, _b) = engine_on(&server).await;
    let fleet = [instance(&world, &a_engine), instance(&world, &b_engine)];
    for (status, _, _) in gated_requests(&world, &fleet, "/broken", 20).await {
        assert_eq!(status, StatusCode::BAD_GATEWAY);
    }
    assert_eq!(world.calls.get(), 1, "one origin call across the fleet");
}

/// What one `get_or_load` got: its result, or its task's panic.
type LoadResult = Result<Result<Value, LoadError<String>>, tokio::task::JoinError>;

/// Twenty `get_or_load`s of one key, alternating between two instances on
/// one Valkey, each loading through `load` once all but one wait and the
/// gate opens; what each got, and the origin's calls.
async fn twenty_loads_across_a_fleet(
    load: fn() -> Result<Value, String>,
) -> (Vec<LoadResult>, usize) {
    let server = ValkeyServer::start();
    let (a, _a) = engine_on(&server).await;
    let (b, _b) = engine_on(&server).await;
    server.subscribed("tc:inv", 2).await;
    let policy = policy().build().unwrap();
    let key = CacheKey::new("k");
    let (calls, gate) = (Counter::new(), Gate::new());
    let loads: Vec<_> = (0..20)
        .map(|i| {
            let cache = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (policy, key, calls, gate) =
                (policy.clone(), key.clone(), calls.clone(), gate.clone());
            tokio::spawn(async move {
                cache
                    .get_or_load(&key, &policy, move || async move {
                        calls.bump();
                        gate.passed().await;
                        load()
                    })
                    .await
            })
        })
        .collect();
    eventually("19 waiting across the fleet", || {
        a.stats().coalesced + b.stats().coalesced == 19
    })
    .await;
    gate.open();
    let mut results = Vec::new();
    for l in loads {
        results.push(bounded("a load", l).await);
    }
    (results, calls.get())
}

/// A loader's error, across a fleet: one call, whichever instance made it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_loader_is_called_once_across_the_fleet() {
    let (results, calls) = twenty_loads_across_a_fleet(|| Err("database down".into())).await;
    let mut own = 0;
    for result in results {
        match result.unwrap() {
            Err(LoadError::Loader(e)) if e == "database down" => own += 1,
            Err(LoadError::Failed) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((calls, own), (1, 1));
}

/// A loader that panics fails its fleet's waiters too: the instances
/// waiting on its lock do not each call the origin that panicked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_loader_is_called_once_across_the_fleet() {
    let (results, calls) = twenty_loads_across_a_fleet(|| panic!("loader bug")).await;
    for result in results {
        match result {
            Ok(Err(LoadError::Failed | LoadError::Panicked)) | Err(_) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(calls, 1, "one call across the fleet");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_loader_is_called_once_for_its_waiters() {
    let cache = engine();
    let policy = policy().build().unwrap();
    let key = CacheKey::new("k");
    let (calls, gate) = (Counter::new(), Gate::new());
    let loads: Vec<_> = (0..20)
        .map(|_| {
            let (cache, policy, key, calls, gate) = (
                cache.clone(),
                policy.clone(),
                key.clone(),
                calls.clone(),
                gate.clone(),
            );
            tokio::spawn(async move {
                cache
                    .get_or_load(&key, &policy, move || async move {
                        calls.bump();
                        gate.passed().await;
                        Err::<Value, String>("database down".into())
                    })
                    .await
            })
        })
        .collect();
    eventually("19 waiting", || cache.stats().coalesced == 19).await;
    gate.open();
    let mut own = 0;
    for l in loads {
        match l.await.unwrap() {
            Err(LoadError::Loader(e)) if e == "database down" => own += 1,
            Err(LoadError::Failed) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((calls.get(), own), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_if_error_answers_every_waiter_of_a_failing_load() {
    let clock = MockClock::new();
    let engine = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine.clone());
    let route = layer
        .route(
            Policy::ttl(Duration::from_secs(10))
                .jitter(0.0)
                .stale_if_error(Duration::from_secs(300)),
        )
        .unwrap();
    let (calls, gate) = (Counter::new(), Gate::new());
    let app = Router::new().route(
        "/x",
        get({
            let (calls, gate) = (calls.clone(), gate.clone());
            move || {
                let (calls, gate) = (calls.clone(), gate.clone());
                async move {
                    if calls.bump() == 1 {
                        return (StatusCode::OK, "good".to_owned());
                    }
                    gate.passed().await;
                    (StatusCode::BAD_GATEWAY, "bad".to_owned())
                }
            }
        })
        .layer(route),
    );
    assert_eq!(send(&app, "GET", "/x").await.2, "good");
    clock.advance(Duration::from_secs(20));
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, "GET", "/x").await })
        })
        .collect();
    eventually("19 waiting", || engine.stats().coalesced == 19).await;
    gate.open();
    for r in requests {
        let (status, headers, body) = bounded("a request", r).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "good"));
        assert_eq!(header(&headers, "x-cache"), "STALE");
    }
    assert_eq!(calls.get(), 2);
}

/// A leader that hangs is abandoned at the flight's deadline, and one
/// request at a time takes it over.
#[tokio::test(start_paused = true)]
async fn a_hung_leader_is_taken_over_by_one_request_at_a_time() {
    let world = World::default();
    let layer = ResponseCacheLayer::new(engine());
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(200)))
        .unwrap();
    let app = app(&world, route);
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, "GET", "/v").await })
        })
        .collect();
    world.calls.reached(1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(world.calls.get(), 1, "followers wait for the deadline");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(world.calls.get(), 2, "one request took over at 200 ms");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(world.calls.get(), 3, "and one more at 400 ms");
    world.gate.open();
    for r in requests {
        assert_eq!(r.await.unwrap().0, StatusCode::OK);
    }
    // Each waiting request counted once, at the first deadline it reached
    // (the 18 that waited on to 400 ms were counted again there, before).
    assert_eq!(layer.engine().stats().lock_timeouts, 19);
}

/// A leader slower than `lock_timeout` but alive: the request that took its
/// flight over loads too, but the answer the first leader stores reaches
/// every request still waiting, on whichever flight (found by a black-box
/// audit: each waiter in turn went to the origin, and 50 clients of an 8 s
/// origin took 4 minutes).
#[tokio::test(start_paused = true)]
async fn a_slow_leaders_answer_reaches_the_waiters_of_the_flight_that_took_it_over() {
    let calls = Counter::new();
    let layer = ResponseCacheLayer::new(engine());
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(200)))
        .unwrap();
    let app = Router::new().route(
        "/slow",
        get({
            let calls = calls.clone();
            move || {
                let calls = calls.clone();
                async move {
                    let n = calls.bump();
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    format!("v{n}")
                }
            }
        })
        .layer(route),
    );
    let t0 = tokio::time::Instant::now();
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let (status, headers, body) = send(&app, "GET", "/slow").await;
                let status_field = header(&headers, "cache-status").to_owned();
                (status, body, t0.elapsed(), status_field)
            })
        })
        .collect();
    let mut late = 0;
    for r in requests {
        let (status, body, took, cache_status) = r.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        if body != "v1" {
            late += 1;
            // Its own load, after a wait: not labelled collapsed.
            assert!(!cache_status.contains("collapsed"), "{cache_status}");
        } else {
            assert_eq!(took, Duration::from_millis(250), "answered when v1 was");
        }
    }
    // The first leader (0-250 ms) and the one request that took its flight
    // over at 200 ms; nobody after.
    assert_eq!(calls.get(), 2);
    assert_eq!(
        late, 1,
        "only the request that took over waits for its own load"
    );
}

/// A follower that arrives late waits only for what is left of the flight's
/// `lock_timeout`, not a whole one from its own arrival.
#[tokio::test(start_paused = true)]
async fn a_late_follower_waits_until_the_flights_deadline() {
    let world = World::default();
    world.only_first_gated.store(true, SeqCst); // only the leader hangs
    let layer = ResponseCacheLayer::new(engine());
    let route = layer
        .route(policy().lock_timeout(Duration::from_millis(200)))
        .unwrap();
    let app = app(&world, route);
    let t0 = tokio::time::Instant::now();
    let _leader = tokio::spawn({
        let app = app.clone();
        async move { send(&app, "GET", "/v").await }
    });
    world.calls.reached(1).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, _, _) = send(&app, "GET", "/v").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(world.calls.get(), 2);
    assert_eq!(t0.elapsed(), Duration::from_millis(200));
}

/// `get_or_load` gets the whole orchestration: the fleet lock across
/// instances, stale-while-revalidate, stale-if-error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_or_load_loads_once_across_the_fleet() {
    let (results, calls) = twenty_loads_across_a_fleet(|| Ok(Value::from_body("built"))).await;
    for result in results {
        assert_eq!(result.unwrap().unwrap().body, "built");
    }
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn get_or_load_serves_stale_while_it_refreshes_and_when_the_loader_fails() {
    let clock = MockClock::new();
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .stale_while_revalidate(Duration::from_secs(10))
        .stale_if_error(Duration::from_secs(100))
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let calls = Counter::new();
    let load = |body: &'static str, fail: bool| {
        let calls = calls.clone();
        move || async move {
            calls.bump();
            if fail {
                Err("down")
            } else {
                Ok(Value::from_body(body))
            }
        }
    };
    assert_eq!(
        cache
            .get_or_load(&key, &policy, load("v1", false))
            .await
            .unwrap()
            .body,
        "v1"
    );
    // Stale: answered at once, refreshed in the background.
    clock.advance(Duration::from_secs(15));
    assert_eq!(
        cache
            .get_or_load(&key, &policy, load("v2", false))
            .await
            .unwrap()
            .body,
        "v1"
    );
    calls.reached(2).await;
    eventually("the refresh stored v2", || {
        futures_lite_ready(cache.get(&key))
            .flatten()
            .is_some_and(|v| v.body == "v2")
    })
    .await;
    // Past stale-while-revalidate, inside stale-if-error: a failing loader
    // is answered with the stale value.
    clock.advance(Duration::from_secs(30));
    assert_eq!(
        cache
            .get_or_load(&key, &policy, load("v3", true))
            .await
            .unwrap()
            .body,
        "v2"
    );
    assert_eq!(calls.get(), 3);
}

/// Polls a future once (the engine's L1 reads complete without waiting).
fn futures_lite_ready<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let waker = std::task::Waker::noop();
    match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_values_travel_through_l2() {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq, Clone)]
    struct Product {
        id: u32,
        name: String,
        price_cents: u64,
    }
    let server = ValkeyServer::start();
    let (a, ta) = engine_on(&server).await;
    let (b, _tb) = engine_on(&server).await;
    server.subscribed("tc:inv", 2).await;
    let policy = policy().build().unwrap();
    let key = CacheKey::new("product:7");
    let product = Product {
        id: 7,
        name: "lamp".into(),
        price_cents: 1999,
    };
    let loaded = a
        .get_or_load_as(&key, &policy, {
            let product = product.clone();
            move || async move { Ok::<_, ()>(product) }
        })
        .await
        .unwrap();
    assert_eq!(loaded, product);
    ta.flush().await;
    assert_eq!(b.get_as::<Product>(&key).await, Some(product.clone()));
    // Another type under the key is a miss, not a wrong value.
    assert_eq!(b.get_as::<String>(&key).await, None);
    let again = b
        .get_or_load_as(&key, &policy, || async { Err::<Product, _>("not called") })
        .await;
    assert_eq!(again.unwrap(), product);
}

#[tokio::test]
async fn the_cachex_calls() {
    let clock = MockClock::new();
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let policy = Policy::ttl(Duration::from_secs(60))
        .jitter(0.0)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    assert!(!cache.exists(&key).await);
    assert_eq!(cache.ttl(&key).await, None);
    cache.put(&key, Value::from_body("v"), &policy);
    assert!(cache.exists(&key).await);
    assert_eq!(cache.ttl(&key).await, Some(Duration::from_secs(60)));
    clock.advance(Duration::from_secs(50));
    assert!(cache.touch(&key, &policy).await);
    assert_eq!(cache.ttl(&key).await, Some(Duration::from_secs(60)));
    assert!(
        cache
            .expire_at(&key, cache.now() + Duration::from_secs(5))
            .await
    );
    assert_eq!(cache.ttl(&key).await, Some(Duration::from_secs(5)));
    assert_eq!(cache.take(&key).await.unwrap().body, "v");
    assert!(!cache.exists(&key).await);
    // A loader may answer without storing.
    let ignored = cache
        .get_or_load_with(&key, &policy, || async {
            Ok::<_, ()>(Commit::Ignore(Value::from_body("partial")))
        })
        .await;
    assert_eq!(ignored.unwrap().body, "partial");
    assert!(!cache.exists(&key).await);
}

/// A load that had no room to keep its answer (`Loaded::Busy`, a refusal of
/// the moment) lets the fleet lock go: the instances waiting on it read L2,
/// then take the lock in turn, so one more origin call serves them all.
/// Before, the first to take the lock again loaded, and every other
/// instance, finding it held, loaded alone (counted as a lock timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_instances_waiting_on_a_busy_load_take_the_lock_in_turn() {
    use tiercache::core::{Entry, Fetched, Fill, Loaded, origin_fn};

    let server = ValkeyServer::start();
    let mut fleet = Vec::new();
    for _ in 0..4 {
        fleet.push(engine_on(&server).await.0);
    }
    let (calls, first, later) = (Counter::new(), Gate::new(), Gate::new());
    let fetch = |engine: &TieredCache| {
        let (engine, calls) = (engine.clone(), calls.clone());
        let (first, later) = (first.clone(), later.clone());
        tokio::spawn(async move {
            // The first call has no room to keep its answer; later ones store.
            let origin = origin_fn(move |_stale: Option<Entry>| async move {
                if calls.bump() == 1 {
                    first.passed().await;
                    return Ok::<_, ()>(Loaded::Busy {
                        output: String::from("streamed"),
                        failed: false,
                    });
                }
                later.passed().await;
                Ok(Loaded::Store(Fill::new(Value::from_body("stored"))))
            });
            let policy = policy().build().unwrap();
            match engine.fetch(&key_of("/busy"), &policy, origin).await {
                Ok(Fetched::Entry(answer)) => {
                    String::from_utf8_lossy(&answer.entry.value().body).into_owned()
                }
                Ok(Fetched::Passed { output, .. }) => output,
                Err(e) => panic!("{e:?}"),
            }
        })
    };
    // Each wait on a holder's lock, counted by the instances' tiers.
    let lock_waits =
        |fleet: &[TieredCache]| fleet.iter().map(|e| e.stats().l2.lock_waits).sum::<u64>();
    let leader = fetch(&fleet[0]);
    calls.reached(1).await;
    let waiters: Vec<_> = fleet[1..].iter().map(fetch).collect();
    eventually("three instances wait on the lock", || {
        lock_waits(&fleet) == 3
    })
    .await;
    first.open();
    assert_eq!(
        bounded("the busy leader", leader).await.unwrap(),
        "streamed"
    );
    // One of the three takes the lock and loads; the other two wait on it
    // (or, before, each loaded alone).
    eventually("the two others wait again, or load", || {
        lock_waits(&fleet) == 5 || calls.get() > 2
    })
    .await;
    later.open();
    for waiter in waiters {
        assert_eq!(bounded("a waiter", waiter).await.unwrap(), "stored");
    }
    assert_eq!(
        calls.get(),
        2,
        "instances that found the lock taken again loaded alone: {:?}",
        fleet
            .iter()
            .map(|e| {
                let stats = e.stats();
                (
                    stats.l2.lock_waits,
                    stats.lock_timeouts,
                    stats.l2_errors,
                    stats.l2_timeouts,
                    stats.l2.locks_acquired,
                )
            })
            .collect::<Vec<_>>()
    );
}

/// An app on a fresh engine whose `path` counts its calls in `calls` and,
/// once `gate` opens, answers `respond(the request's headers, the call's
/// number)`.
fn gated_app<R: axum::response::IntoResponse + Send + 'static>(
    path: &str,
    calls: &Counter,
    gate: &Gate,
    respond: fn(&axum::http::HeaderMap, usize) -> R,
) -> (Router, TieredCache) {
    let engine = engine();
    let route = ResponseCacheLayer::new(engine.clone())
        .route(policy())
        .unwrap();
    let (calls, gate) = (calls.clone(), gate.clone());
    let handler = move |headers: axum::http::HeaderMap| {
        let (calls, gate) = (calls.clone(), gate.clone());
        async move {
            let n = calls.bump();
            gate.passed().await;
            respond(&headers, n)
        }
    };
    (Router::new().route(path, get(handler).layer(route)), engine)
}

/// A request that waited on another's load whose answer may not be shared
/// (`private`) loads on its own: RFC 9211's `collapsed` says its answer
/// was another request's, so it is not labelled so (it was, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_ends_in_a_load_of_its_own_is_not_labelled_collapsed() {
    let (calls, gate) = (Counter::new(), Gate::new());
    let (app, engine) = gated_app("/mine", &calls, &gate, |_, n| {
        ([("cache-control", "private")], format!("v{n}"))
    });
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, "GET", "/mine").await })
        })
        .collect();
    eventually("two requests wait on the first", || {
        engine.stats().coalesced == 2
    })
    .await;
    gate.open();
    for request in requests {
        let (_, headers, _) = bounded("a request", request).await.unwrap();
        let status = header(&headers, "cache-status");
        assert!(!status.contains("collapsed"), "{status}");
    }
    assert_eq!(calls.get(), 3);
}

/// The same when that load of its own is stored: a request that waited
/// on a load of another variant (`Vary`) stores its own, labelled stored
/// and not collapsed (before: `fwd=miss; collapsed`, its store unsaid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_ends_in_a_stored_load_of_its_own_says_stored() {
    let (calls, gate) = (Counter::new(), Gate::new());
    let (app, engine) = gated_app("/lang", &calls, &gate, |headers, _| {
        let lang = header(headers, "x-lang").to_owned();
        ([("vary", "x-lang")], format!("in {lang}"))
    });
    let request = |lang: &'static str| {
        let app = app.clone();
        tokio::spawn(async move {
            let req = axum::http::Request::get("/lang")
                .header("host", HOST)
                .header("x-lang", lang)
                .body(axum::body::Body::empty())
                .unwrap();
            let res = tower::ServiceExt::oneshot(app, req).await.unwrap();
            header(res.headers(), "cache-status").to_owned()
        })
    };
    let en = request("en");
    calls.reached(1).await;
    let fr = request("fr");
    eventually("fr waits on en's load", || engine.stats().coalesced == 1).await;
    gate.open();
    assert_eq!(
        bounded("en", en).await.unwrap(),
        "tiercache; fwd=miss; stored"
    );
    assert_eq!(
        bounded("fr", fr).await.unwrap(),
        "tiercache; fwd=miss; stored"
    );
    assert_eq!(calls.get(), 2);
}
