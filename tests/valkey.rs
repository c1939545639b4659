//! The L2 against a real Valkey server that the test starts itself.

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use tiercache::core::{CacheKey, Fill, Value};
use tiercache::http::{NothingStored, StoredOnly};
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::{Counter, Fault, FaultProxy, ValkeyServer, bounded, eventually};
use tower::ServiceExt;

async fn connect(config: ValkeyConfig) -> ValkeyTier {
    ValkeyTier::connect(config).await.unwrap()
}

async fn tier(url: &str, prefix: &str) -> ValkeyTier {
    connect(ValkeyConfig::from_url(url).unwrap().prefix(prefix)).await
}

fn engine(l2: ValkeyTier) -> TieredCache {
    TieredCache::builder()
        .l2(l2)
        .sweep_interval(None)
        .build()
        .unwrap()
}

/// An app caching `/p/{id}` for 60 s; the origin takes 20 ms and counts calls.
fn app(engine: &TieredCache, calls: &Counter) -> Router {
    let layer = ResponseCacheLayer::new(engine.clone());
    let route = layer.route(Policy::ttl(Duration::from_secs(60))).unwrap();
    Router::new()
        .route(
            "/p/{id}",
            get(
                |State(calls): State<Counter>, Path(id): Path<String>| async move {
                    let n = calls.bump();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    format!("product {id} (load {n})")
                },
            )
            .layer(route),
        )
        .with_state(calls.clone())
}

async fn send(app: &Router, path: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::get(path)
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

async fn wait_for_keys(server: &ValkeyServer, pattern: &str, n: usize) {
    eventually(&format!("{n} keys matching {pattern}"), || {
        server.keys(pattern).len() >= n
    })
    .await;
}

#[tokio::test]
async fn a_cohort_filled_together_spreads_its_pttls_over_the_band() {
    let server = ValkeyServer::start();
    let cache = engine(tier(&server.url(), "tc").await);
    let policy = Policy::ttl(Duration::from_secs(100))
        .jitter(0.2)
        .build()
        .unwrap();
    for i in 0..1000 {
        cache.put(
            &CacheKey::new(format!("k{i}")),
            Fill::new(Value::from_body("v")),
            &policy,
        );
    }
    let filled = std::time::Instant::now();
    wait_for_keys(&server, "tc:*", 1000).await;
    let mut buckets = [0usize; 10];
    for key in server.keys("tc:*") {
        assert!(key.starts_with("tc:{") && key.ends_with("}:e"), "{key}");
        let pttl: u64 = server.cmd(&["PTTL", &key]).parse().unwrap();
        // The band is 80..=120 s, less the time since the fill (a loaded
        // machine reading 1,000 PTTLs one connection each takes seconds).
        let floor = 80_000u64.saturating_sub(filled.elapsed().as_millis() as u64 + 50);
        assert!(
            (floor..=120_000).contains(&pttl),
            "PTTL {pttl} outside {floor}..120000 ms"
        );
        let i = ((pttl.saturating_sub(80_000)) / 4_000).min(9) as usize;
        buckets[i] += 1;
    }
    assert!(buckets.iter().all(|&b| b > 0), "PTTLs bunched: {buckets:?}");
    assert!(
        buckets.iter().all(|&b| b < 250),
        "PTTLs bunched: {buckets:?}"
    );
}

#[tokio::test]
async fn a_restarted_instance_answers_from_l2_for_no_longer_than_the_servers_pttl() {
    let server = ValkeyServer::start();
    let calls = Counter::new();
    let first = app(&engine(tier(&server.url(), "tc").await), &calls);
    let (_, headers, body) = send(&first, "/p/7").await;
    assert_eq!(h(&headers, "x-cache"), "MISS");
    wait_for_keys(&server, "tc:*", 1).await;
    let key = server.keys("tc:*").pop().unwrap();
    // The server's clock decides: shorten the key's life there.
    server.cmd(&["PEXPIRE", &key, "5000"]);

    let restarted_engine = engine(tier(&server.url(), "tc").await);
    let restarted = app(&restarted_engine, &calls);
    let (_, headers, again) = send(&restarted, "/p/7").await;
    assert_eq!(again, body);
    assert_eq!(
        (h(&headers, "x-cache"), h(&headers, "x-cache-tier")),
        ("HIT", "l2")
    );
    let status = h(&headers, "cache-status");
    let ttl: u64 = status
        .split("ttl=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        ttl <= 5,
        "promoted for {ttl} s, longer than the server's 5 s PTTL: {status}"
    );
    // Now it is in the restarted instance's L1.
    let (_, headers, _) = send(&restarted, "/p/7").await;
    assert_eq!(h(&headers, "x-cache-tier"), "l1");
    assert_eq!(calls.get(), 1);
    assert_eq!(restarted_engine.stats().hits_l2, 1);
}

/// A request marked `StoredOnly::L1` (the proxy at its bound on requests
/// in flight) is answered from L1 alone: a copy only in Valkey is not read,
/// so nothing waits on Valkey; `StoredOnly::Anywhere` reads it, as a
/// client's `only-if-cached` does. Neither asks the origin.
#[tokio::test]
async fn a_request_marked_l1_only_does_not_wait_on_valkey() {
    let server = ValkeyServer::start();
    let calls = Counter::new();
    let first = app(&engine(tier(&server.url(), "tc").await), &calls);
    send(&first, "/p/7").await;
    wait_for_keys(&server, "tc:*", 1).await;
    let other_engine = engine(tier(&server.url(), "tc").await);
    let other = app(&other_engine, &calls);
    let marked = |mark: StoredOnly| {
        let mut req = Request::get("/p/7")
            .header("host", "shop.test")
            .body(Body::empty())
            .unwrap();
        req.extensions_mut().insert(mark);
        other.clone().oneshot(req)
    };
    let answer = marked(StoredOnly::L1).await.unwrap();
    assert_eq!(answer.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(answer.extensions().get::<NothingStored>().is_some());
    assert_eq!(other_engine.stats().hits_l2, 0, "Valkey was read");
    let answer = marked(StoredOnly::Anywhere).await.unwrap();
    assert_eq!(
        (answer.status(), h(answer.headers(), "x-cache-tier")),
        (StatusCode::OK, "l2")
    );
    assert_eq!(calls.get(), 1, "the origin was asked");
}

#[tokio::test]
async fn an_l2_hit_costs_one_get_and_one_pttl_in_one_round_trip() {
    let server = ValkeyServer::start();
    let writer = engine(tier(&server.url(), "tc").await);
    let key = CacheKey::new("counted");
    writer.put(
        &key,
        Fill::new(Value::from_body("v")),
        &Policy::ttl(Duration::from_secs(60)).build().unwrap(),
    );
    wait_for_keys(&server, "tc:*", 1).await;
    let reader = engine(tier(&server.url(), "tc").await);
    let (gets, pttls, sets) = (
        server.command_calls("get"),
        server.command_calls("pttl"),
        server.command_calls("set"),
    );
    for _ in 0..50 {
        reader.forget_local(&key);
        let hit = reader.get(&key).await;
        assert_eq!(hit.unwrap().body, "v");
    }
    assert_eq!(server.command_calls("get") - gets, 50);
    assert_eq!(server.command_calls("pttl") - pttls, 50);
    assert_eq!(server.command_calls("set") - sets, 0);
}

#[tokio::test]
async fn corrupt_and_foreign_bytes_are_a_miss_and_get_repaired() {
    let server = ValkeyServer::start();
    let calls = Counter::new();
    let first = app(&engine(tier(&server.url(), "tc").await), &calls);
    let (_, _, good_body) = send(&first, "/p/9").await;
    wait_for_keys(&server, "tc:*", 1).await;
    let key = server.keys("tc:*").pop().unwrap();
    let good = {
        // The stored envelope, to damage in several ways.
        let reader = tier(&server.url(), "tc").await;
        let value: Option<bytes::Bytes> = fred::prelude::KeysInterface::get(&reader.client(), &key)
            .await
            .unwrap();
        value.unwrap()
    };
    let mut flipped = good.to_vec();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0xff;
    let mut version = good.to_vec();
    version[3] = 99;
    let damages: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"not an envelope at all".to_vec()),
        ("json", br#"{"status":200,"body":"evil"}"#.to_vec()),
        ("truncated", good[..good.len() - 10].to_vec()),
        ("flipped", flipped),
        ("unknown version", version),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in damages {
        server
            .cmd_bytes(&[b"SET", key.as_bytes(), &bytes, b"PX", b"60000"])
            .unwrap();
        let fresh_engine = engine(tier(&server.url(), "tc").await);
        let fresh = app(&fresh_engine, &calls);
        let before = calls.get();
        let (status, headers, body) = send(&fresh, "/p/9").await;
        assert_eq!(status, StatusCode::OK, "{what}");
        assert_eq!(h(&headers, "x-cache"), "MISS", "{what}");
        assert!(body.starts_with("product 9"), "{what}: {body}");
        assert_eq!(calls.get(), before + 1, "{what}: the origin answered");
        if what != "empty" {
            // Read once before the fill lock, and once more after it.
            assert!(fresh_engine.stats().l2.corrupt >= 1, "{what}");
        }
        // The fill overwrote the damage: another fresh instance reads it from L2.
        // (The damaged version also starts with `TCE`: its version byte
        // tells them apart.)
        eventually("the repair", || {
            server
                .cmd_bytes(&[b"GET", key.as_bytes()])
                .is_ok_and(|v| v.starts_with("TCE") && v.as_bytes().get(3) == good.get(3))
        })
        .await;
        let (_, headers, _) = send(
            &app(&engine(tier(&server.url(), "tc").await), &calls),
            "/p/9",
        )
        .await;
        assert_eq!(h(&headers, "x-cache-tier"), "l2", "{what}: not repaired");
    }
    assert!(good_body.starts_with("product 9"));
}

#[tokio::test]
async fn two_prefixes_on_one_server_stay_apart() {
    let server = ValkeyServer::start();
    let (shop_calls, blog_calls) = (Counter::new(), Counter::new());
    let shop = app(&engine(tier(&server.url(), "shop").await), &shop_calls);
    send(&shop, "/p/1").await;
    wait_for_keys(&server, "shop:*", 1).await;
    let blog = app(&engine(tier(&server.url(), "blog").await), &blog_calls);
    let (_, headers, _) = send(&blog, "/p/1").await;
    assert_eq!(h(&headers, "x-cache"), "MISS");
    assert_eq!(blog_calls.get(), 1);
    wait_for_keys(&server, "blog:*", 1).await;
    assert_eq!(server.keys("shop:*").len(), 1);
}

#[tokio::test]
async fn valkey_absent_at_start_costs_nothing_but_the_origin() {
    let dead = tiercache_testkit::valkey::free_port();
    let calls = Counter::new();
    let cache = engine(tier(&format!("redis://127.0.0.1:{dead}"), "tc").await);
    let app = app(&cache, &calls);
    for i in 0..20 {
        let started = Instant::now();
        let (status, _, _) = send(&app, &format!("/p/{i}")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "request {i} took {:?}",
            started.elapsed()
        );
    }
    let (_, headers, _) = send(&app, "/p/0").await;
    assert_eq!(h(&headers, "x-cache"), "HIT", "L1 still works");
    let stats = cache.stats();
    assert!(stats.l2.breaker_trips >= 1, "{stats:?}");
    assert!(
        stats.l2.skipped > 0,
        "the breaker spared most requests: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_run_under_load_fails_no_request_and_l2_returns_within_a_second() {
    let mut server = ValkeyServer::start();
    let calls = Counter::new();
    let cache = engine(tier(&server.url(), "tc").await);
    let app = app(&cache, &calls);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..8)
        .map(|w| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, 0u32);
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    // Mostly new keys, so L2 is consulted all the time.
                    let (status, _, _) = send(&app, &format!("/p/w{w}-{}", i % 500)).await;
                    if status == StatusCode::OK {
                        ok += 1
                    } else {
                        failed += 1
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    server.restart();
    let back = Instant::now();
    // L2 in use again: a fresh key written now shows up in the server.
    let probe = CacheKey::new("after-restart");
    loop {
        cache.put(
            &probe,
            Fill::new(Value::from_body("v")),
            &Policy::ttl(Duration::from_secs(60)).build().unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
        if !server.keys("tc:*").is_empty() {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "L2 not used 5 s after the restart"
        );
    }
    let returned_after = back.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut failed) = (0, 0);
    for t in load {
        let (o, f) = bounded("a load worker", t).await.unwrap();
        ok += o;
        failed += f;
    }
    assert_eq!(failed, 0, "{failed} requests failed");
    assert!(ok > 100, "only {ok} requests ran");
    assert!(
        returned_after < Duration::from_secs(1),
        "L2 came back after {returned_after:?}"
    );
}

#[tokio::test]
async fn a_paused_server_costs_a_request_the_l2_timeout_at_most() {
    let server = ValkeyServer::start();
    let calls = Counter::new();
    let cache = engine(tier(&server.url(), "tc").await);
    let app = app(&cache, &calls);
    send(&app, "/p/warm").await;
    server.pause(3000);
    for i in 0..5 {
        let started = Instant::now();
        let (status, _, _) = send(&app, &format!("/p/paused{i}")).await;
        assert_eq!(status, StatusCode::OK);
        // 50 ms L2 timeout + 20 ms origin, with slack for a loaded machine;
        // the pause itself is 3 s.
        assert!(
            started.elapsed() < Duration::from_millis(600),
            "took {:?}",
            started.elapsed()
        );
    }
    assert!(cache.stats().l2_errors > 0 || cache.stats().l2.skipped > 0);
}

#[tokio::test]
async fn a_full_write_queue_drops_and_counts_without_blocking() {
    let server = ValkeyServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let config = ValkeyConfig::from_url(&proxy.redis_url())
        .unwrap()
        .write_queue(4);
    let cache = engine(connect(config).await);
    // Let the connection come up, then make every write crawl.
    cache.put(
        &CacheKey::new("first"),
        Fill::new(Value::from_body("v")),
        &Policy::ttl(Duration::from_secs(60)).build().unwrap(),
    );
    wait_for_keys(&server, "tc:*", 1).await;
    proxy.set(Fault::Latency(Duration::from_millis(200)));
    let started = Instant::now();
    for i in 0..200 {
        cache.put(
            &CacheKey::new(format!("k{i}")),
            Fill::new(Value::from_body("v")),
            &Policy::ttl(Duration::from_secs(60)).build().unwrap(),
        );
    }
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "stores blocked: {:?}",
        started.elapsed()
    );
    assert!(
        cache.stats().l2.write_drops >= 190,
        "{:?}",
        cache.stats().l2
    );
}

#[tokio::test]
async fn the_write_queue_holds_no_more_than_its_byte_bound() {
    let server = ValkeyServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    // Room for 4,096 writes, but only 100 KiB of them.
    let config = ValkeyConfig::from_url(&proxy.redis_url())
        .unwrap()
        .write_queue_bytes(100 * 1024);
    let cache = engine(connect(config).await);
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    cache.put(
        &CacheKey::new("first"),
        Fill::new(Value::from_body("v")),
        &policy,
    );
    wait_for_keys(&server, "tc:*", 1).await;
    proxy.set(Fault::Latency(Duration::from_millis(500)));
    let body = vec![b'x'; 10 * 1024];
    for i in 0..100 {
        cache.put(
            &CacheKey::new(format!("k{i}")),
            Fill::new(Value::from_body(body.clone())),
            &policy,
        );
    }
    // At most ~10 fills of 10 KiB fit (those the writer has taken still
    // count until they are sent); the rest are dropped and counted.
    let drops = cache.stats().l2.write_drops;
    assert!((89..=100).contains(&drops), "{:?}", cache.stats().l2);
}

#[tokio::test]
async fn a_blackholed_connection_is_bounded_by_the_timeout_and_the_breaker() {
    let server = ValkeyServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let calls = Counter::new();
    let cache = engine(connect(ValkeyConfig::from_url(&proxy.redis_url()).unwrap()).await);
    let app = app(&cache, &calls);
    send(&app, "/p/warm").await;
    wait_for_keys(&server, "tc:*", 1).await;
    proxy.set(Fault::Blackhole);
    let started = Instant::now();
    for i in 0..30 {
        let (status, _, _) = send(&app, &format!("/p/bh{i}")).await;
        assert_eq!(status, StatusCode::OK);
    }
    // 30 misses × 20 ms origin, plus a few 50 ms timeouts before the breaker opened.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    let stats = cache.stats();
    assert!(
        stats.l2_timeouts >= 1 && stats.l2.breaker_trips >= 1,
        "{stats:?}"
    );
    proxy.set(Fault::Reset);
    let (status, _, _) = send(&app, "/p/reset").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn an_instance_without_a_copy_answers_a_stale_l2_copy_while_it_refreshes() {
    use tiercache::core::MockClock;
    use tiercache_testkit::Gate;
    let server = ValkeyServer::start();
    let clock = MockClock::new();
    let instance = |clock: MockClock| {
        let server = server.url();
        async move {
            TieredCache::builder()
                .l2(tier(&server, "tc").await)
                .clock(clock)
                .sweep_interval(None)
                .build()
                .unwrap()
        }
    };
    let (a, b) = (instance(clock.clone()).await, instance(clock.clone()).await);
    let calls = Counter::new();
    let gate = Gate::new();
    let app = |engine: &TieredCache, gated: bool| {
        let policy = Policy::ttl(Duration::from_secs(1))
            .jitter(0.0)
            .xfetch_beta(0.0)
            .stale_while_revalidate(Duration::from_secs(60));
        let route = ResponseCacheLayer::new(engine.clone())
            .route(policy)
            .unwrap();
        let (calls, gate) = (calls.clone(), gate.clone());
        Router::new().route(
            "/p/{id}",
            get(move || {
                let (calls, gate) = (calls.clone(), gate.clone());
                async move {
                    let n = calls.bump();
                    if gated {
                        gate.passed().await;
                    }
                    format!("version {n}")
                }
            })
            .layer(route),
        )
    };
    let (app_a, app_b) = (app(&a, false), app(&b, true));
    assert_eq!(send(&app_a, "/p/1").await.2, "version 1");
    wait_for_keys(&server, "tc:*:e", 1).await;
    clock.advance(Duration::from_secs(2));

    // B has no copy; L2's is stale but inside its window: B answers with it
    // at once (the origin is held shut), and refreshes in the background.
    let (_, headers, body) = tokio::time::timeout(Duration::from_secs(5), send(&app_b, "/p/1"))
        .await
        .expect("answered without waiting on the (shut) origin");
    assert_eq!(
        (h(&headers, "x-cache"), body.as_str()),
        ("STALE", "version 1")
    );
    assert_eq!(h(&headers, "x-cache-tier"), "l2", "read from L2");
    eventually("the refresh reaches the origin", || calls.get() == 2).await;
    gate.open();
    eventually("the refresh is stored", || b.stats().origin_loads == 1).await;
    let (_, headers, body) = send(&app_b, "/p/1").await;
    assert_eq!(
        (h(&headers, "x-cache"), body.as_str()),
        ("HIT", "version 2")
    );
    assert_eq!(calls.get(), 2, "one refresh");
}

/// An instance hears invalidations from the moment `connect` returns. One
/// published before its subscription was missed unheard (the first
/// connection is no reconnect, so nothing dropped L1): a proxy that filled
/// an entry in that window kept serving it after a write elsewhere.
#[tokio::test]
async fn connect_returns_once_invalidations_are_heard() {
    let server = ValkeyServer::start();
    let observer = tier(&server.url(), "sub").await;
    let mut fleet = Vec::new();
    for n in 1..=5i64 {
        fleet.push(tier(&server.url(), "sub").await);
        // The server may read another connection's `NUMSUB` before the
        // `SUBSCRIBE` already sent on this one: a few ms of slack, no more.
        let mut subscribed = None;
        for _ in 0..10 {
            let reply: Vec<fred::prelude::Value> =
                fred::prelude::PubsubInterface::pubsub_numsub(&observer.client(), "sub:inv")
                    .await
                    .unwrap();
            subscribed = reply.get(1).and_then(fred::prelude::Value::as_i64);
            if subscribed == Some(n + 1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            subscribed,
            Some(n + 1),
            "instance {n} was not yet subscribed when connect returned"
        );
    }
}

/// Valkey down when an instance starts: it serves, and fills L1, without
/// hearing invalidations; when Valkey comes up, its first subscription
/// drops L1 as a reconnect's does (what it filled may have been
/// invalidated meanwhile).
#[tokio::test]
async fn an_instance_that_started_without_valkey_drops_l1_once_it_hears() {
    let server = ValkeyServer::start();
    let link = FaultProxy::start(server.addr()).await;
    link.set(Fault::Reset);
    let config = ValkeyConfig::from_url(&link.redis_url())
        .unwrap()
        .prefix("late")
        .connect_timeout(Duration::from_millis(300));
    let l2 = connect(config).await;
    let cache = engine(l2.clone());
    let key = CacheKey::new("filled-unheard");
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    cache.put(&key, Fill::new(Value::from_body("v")), &policy);
    assert!(cache.l1_contains(&key));
    link.set(Fault::Pass);
    eventually("the first subscription to drop L1", || {
        !cache.l1_contains(&key)
    })
    .await;
}

/// A tier under prefix `prefix` for a user the server refuses `HGETALL`
/// (the prefix bans' read) until `ACL SETUSER <user> +hgetall`.
async fn without_bans_read(server: &ValkeyServer, user: &str, prefix: &str) -> ValkeyTier {
    server.cmd(&[
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-hgetall",
    ]);
    let url = format!("redis://{user}:pw@127.0.0.1:{}", server.port());
    connect(ValkeyConfig::from_url(&url).unwrap().prefix(prefix)).await
}

/// Prefix bans are read when the subscriber connects; a read that failed
/// (here the server refuses `HGETALL` at first) was never tried again, and
/// the instance answered from L2 the copies a prefix invalidation had
/// banned until their `PX`. It is retried until it succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_could_not_read_the_bans_retries_until_it_can() {
    let server = ValkeyServer::start();
    let a = engine(tier(&server.url(), "bans").await);
    // The copy is B's, and B hears nothing more: a fill of its own sent in
    // the last 2 s would be deleted again on hearing the invalidation.
    let link = FaultProxy::start(server.addr()).await;
    let b_tier = connect(
        ValkeyConfig::from_url(&link.redis_url())
            .unwrap()
            .prefix("bans"),
    )
    .await;
    let b = engine(b_tier.clone());
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::builder().part(b"/p/1").finish();
    b.put(&key, Fill::new(Value::from_body("old")), &policy);
    bounded("B's fill", b_tier.flush()).await;
    wait_for_keys(&server, "bans:*:e", 1).await;
    link.set(Fault::Blackhole);
    a.invalidate_prefix(tiercache::core::KeyPattern::new().prefix(b"/p/"))
        .await
        .unwrap();
    let c = engine(without_bans_read(&server, "late", "bans").await);
    assert_eq!(
        c.get(&key).await.map(|v| v.body),
        Some("old".into()),
        "the copy is in L2, and C could not read the ban"
    );
    server.cmd(&["ACL", "SETUSER", "late", "+hgetall"]);
    // Retried within a second or so (the old code learned it only at a
    // later reconnect, ~60 s here).
    let learned = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            c.forget_local(&key);
            if c.get(&key).await.is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(learned.is_ok(), "C answered the banned copy for 10 s");
}

/// Each prefix invalidation records a ban for a day, and every L2 read
/// checks them all: sustained purges by prefix grew the bans (in Valkey and
/// in every instance) without a bound. Past `max_prefix_bans` the oldest
/// fold into one ban of every key: still no banned copy is read, and a copy
/// stored after them is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_bans_past_their_bound_fold_and_still_refuse_every_banned_copy() {
    let server = ValkeyServer::start();
    let bound = |url: &str| {
        ValkeyConfig::from_url(url)
            .unwrap()
            .prefix("fold")
            .max_prefix_bans(8)
    };
    let a = engine(connect(bound(&server.url())).await);
    // B stores the copies and then hears nothing (a fill of its own sent in
    // the last 2 s would be deleted again on hearing the invalidations).
    let link = FaultProxy::start(server.addr()).await;
    let b_tier = connect(bound(&link.redis_url())).await;
    let b = engine(b_tier.clone());
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = |i: usize| {
        CacheKey::builder()
            .part(format!("/p/{i}/x").as_bytes())
            .finish()
    };
    for i in 0..20 {
        b.put(&key(i), Fill::new(Value::from_body("old")), &policy);
    }
    bounded("B's fills", b_tier.flush()).await;
    wait_for_keys(&server, "fold:*:e", 20).await;
    link.set(Fault::Blackhole);
    for i in 0..20 {
        let prefix = format!("/p/{i}/");
        a.invalidate_prefix(tiercache::core::KeyPattern::new().prefix(prefix.as_bytes()))
            .await
            .unwrap();
    }
    let held: usize = server.cmd(&["HLEN", "fold:bans"]).parse().unwrap();
    assert!(held <= 8, "{held} bans in Valkey, past the bound of 8");
    // A new instance reads the folded bans: every banned copy is a miss.
    let c = engine(connect(bound(&server.url())).await);
    for i in 0..20 {
        assert!(a.get(&key(i)).await.is_none(), "A read banned /p/{i}/x");
        // C's bans are read as its subscriber connects: wait for them.
        let refused = tokio::time::timeout(Duration::from_secs(10), async {
            while c.get(&key(i)).await.is_some() {
                c.forget_local(&key(i));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(refused.is_ok(), "C read the banned /p/{i}/x for 10 s");
    }
    // A copy stored after the bans is read (by A, whose bans folded too).
    let d_tier = connect(bound(&server.url())).await;
    let d = engine(d_tier.clone());
    d.put(&key(0), Fill::new(Value::from_body("new")), &policy);
    bounded("D's fill", d_tier.flush()).await;
    for reader in [&a, &c] {
        reader.forget_local(&key(0));
        assert_eq!(
            reader.get(&key(0)).await.map(|v| v.body),
            Some("new".into())
        );
    }
}

/// A ban only moves later: recording one for a pattern that already holds a
/// later time (the fold's ban of every key, or an instance whose clock is
/// ahead) overwrote it with the earlier one, and the copies between the two
/// times, banned, were read again.
#[tokio::test]
async fn a_recorded_ban_never_moves_earlier() {
    let server = ValkeyServer::start();
    let a = engine(tier(&server.url(), "later").await);
    let ahead = ban_time(std::time::SystemTime::now() + Duration::from_secs(3600));
    // The field of every key (its pattern's bytes are empty).
    server.cmd(&["HSET", "later:bans", "", &ahead]);
    a.invalidate_prefix(tiercache::core::KeyPattern::new())
        .await
        .unwrap();
    assert_eq!(server.cmd(&["HGET", "later:bans", ""]), ahead);
}

/// A reconnect drops L1 even when the bans cannot be read (here never: the
/// server refuses `HGETALL`): the messages missed while away are not
/// waited on for the bans' sake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_drops_l1_even_when_the_bans_cannot_be_read() {
    let server = ValkeyServer::start();
    let c = engine(without_bans_read(&server, "nobans", "nb").await);
    let key = CacheKey::new("held");
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    c.put(&key, Fill::new(Value::from_body("v")), &policy);
    assert!(c.l1_contains(&key));
    // The subscriber's connection drops; it reconnects at once.
    server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    bounded("L1 dropped on the reconnect", async {
        eventually("L1 dropped", || !c.l1_contains(&key)).await;
    })
    .await;
}

/// Runs a load on `c` (whose user `user` may not read the bans yet) that
/// is at the origin while the bans are read late, and lets it finish once
/// what follows the read (the merge, and what it drops) has run; returns
/// its key.
async fn load_across_a_late_bans_read(
    server: &ValkeyServer,
    c: &TieredCache,
    user: &str,
) -> CacheKey {
    let key = CacheKey::new("loading");
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let gate = tiercache_testkit::Gate::new();
    let started = Counter::new();
    let load = {
        let (c, key, gate, started) = (c.clone(), key.clone(), gate.clone(), started.clone());
        tokio::spawn(async move {
            c.get_or_load(&key, &policy, move || async move {
                started.bump();
                gate.passed().await;
                Ok::<_, std::convert::Infallible>(Value::from_body("v"))
            })
            .await
        })
    };
    bounded("the load at the origin", started.reached(1)).await;
    server.cmd(&["ACL", "SETUSER", user, "+hgetall"]);
    bounded("the bans read", async {
        while server.command_calls("hgetall") == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // What follows the read (the merge, and what it drops) has run.
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.open();
    bounded("the load", load).await.unwrap().unwrap();
    key
}

/// A time as the bans hash records it (milliseconds since the epoch).
fn ban_time(at: std::time::SystemTime) -> String {
    at.duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string()
}

/// A late read of the bans (the first failed, as it often does while a new
/// instance's clients come up) must not cost the loads in flight: it used
/// to drop L1 as a resync does, through the journal, so a fill loading
/// then was stored nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_read_of_the_bans_does_not_drop_the_loads_in_flight() {
    let server = ValkeyServer::start();
    let c = engine(without_bans_read(&server, "slow", "lb").await);
    let key = load_across_a_late_bans_read(&server, &c, "slow").await;
    assert!(c.l1_contains(&key), "the fill in flight was not stored");
}

/// A late read of the bans that finds the ban of every key (a fold's) must
/// drop only the copies created before it: it was applied as a prefix
/// invalidation of everything, through the journal, so the loads in flight
/// were stored nowhere and every newer L1 entry went too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_read_of_a_folded_ban_drops_only_the_copies_it_covers() {
    let server = ValkeyServer::start();
    let a_second_ago = ban_time(std::time::SystemTime::now() - Duration::from_secs(1));
    server.cmd(&["HSET", "lf:bans", "", &a_second_ago]);
    let c = engine(without_bans_read(&server, "fold", "lf").await);
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let newer = CacheKey::new("stored-after-the-ban");
    c.put(&newer, Fill::new(Value::from_body("n")), &policy);
    let key = load_across_a_late_bans_read(&server, &c, "fold").await;
    assert!(c.l1_contains(&key), "the fill in flight was not stored");
    assert!(
        c.l1_contains(&newer),
        "an entry newer than the ban was dropped"
    );
}

/// An instance reaching `server` through a fault proxy (passing for now),
/// with a command timeout long enough for the latency the tests add.
async fn behind_a_link(server: &ValkeyServer) -> (FaultProxy, ValkeyTier, TieredCache) {
    let link = FaultProxy::start(server.addr()).await;
    let config = ValkeyConfig::from_url(&link.redis_url())
        .unwrap()
        .command_timeout(Duration::from_secs(3));
    let tier = connect(config).await;
    let cache = engine(tier.clone());
    (link, tier, cache)
}

/// Instance A behind a link, one entry of its own stored (its connections
/// warm), then the link slowed to 300 ms each way; a 60 s policy.
async fn a_warm_instance_on_a_slow_link(
    server: &ValkeyServer,
) -> (FaultProxy, ValkeyTier, TieredCache, Policy) {
    let (link, a_tier, a) = behind_a_link(server).await;
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    a.put(
        &CacheKey::new("warm"),
        Fill::new(Value::from_body("w")),
        &policy,
    );
    wait_for_keys(server, "tc:*:e", 1).await;
    link.set(Fault::Latency(Duration::from_millis(300)));
    (link, a_tier, a, policy)
}

/// Issue 14's open seam: instance A's fill is on its way to Valkey (a slow
/// link) when instance B invalidates the key. B's `DEL` lands first and A's
/// `SET` after it, so without more the old version sits in L2, served to
/// the whole fleet until its TTL. Once B's message reaches A, A takes its
/// copy out again, and a fill still queued then is never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_lands_after_another_instances_invalidation_is_taken_out_again() {
    let server = ValkeyServer::start();
    let (link, a_tier, a, policy) = a_warm_instance_on_a_slow_link(&server).await;
    let b = engine(tier(&server.url(), "tc").await);
    let in_flight = CacheKey::new("in flight");
    let queued = CacheKey::new("queued");
    a.put(&in_flight, Fill::new(Value::from_body("old")), &policy);
    // Queued behind the pipeline in flight (or in it): sent after B's
    // message has reached A, unless A holds it back.
    a.put(&queued, Fill::new(Value::from_body("old")), &policy);
    b.invalidate_keys(&[in_flight.clone(), queued.clone()])
        .await
        .unwrap();
    // B's message takes 300 ms to reach A; the `SET` of `in_flight` lands
    // 300 ms after it left, after B's `DEL`.
    eventually("A hears B's invalidation", || {
        a.stats().l2.invalidations_received >= 1
    })
    .await;
    bounded("A's write queue", a_tier.flush()).await;
    link.set(Fault::Pass);
    assert_eq!(a.stats().l2.fills_overtaken, 2, "{:?}", a.stats().l2);
    for key in [&in_flight, &queued] {
        b.forget_local(key);
        assert_eq!(
            b.get(key).await.map(|v| v.body),
            None,
            "L2 kept a fill that another instance's invalidation overtook"
        );
    }
}

/// `fills_overtaken` counts fills an invalidation overtook, not every
/// delete again that found nothing to take: an instance's own
/// invalidation just after its fill landed (its `DEL` takes the fill, the
/// delete again finds none) counted one (a black-box audit: one a purge
/// or a write within 2 s of the fill, and every fill of the last 2 s on a
/// reconnection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_after_the_fill_landed_overtook_nothing() {
    let server = ValkeyServer::start();
    let a_tier = tier(&server.url(), "tc").await;
    let a = engine(a_tier.clone());
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::new("landed");
    a.put(&key, Fill::new(Value::from_body("v1")), &policy);
    // Landed, and its answer read (one still in flight when its own
    // invalidation comes is deleted again as that comes, and counted).
    bounded("A's write queue", a_tier.flush()).await;
    wait_for_keys(&server, "tc:*:e", 1).await;
    a.invalidate(&key).await.unwrap();
    bounded("A's write queue", a_tier.flush()).await;
    wait_for_keys(&server, "tc:*:e", 0).await;
    assert_eq!(a.stats().l2.fills_overtaken, 0, "{:?}", a.stats().l2);
}

/// The same race, seen by a third instance: D heard B's invalidation, then
/// read A's overtaken copy from L2 before A deleted it again, and kept it
/// in its L1 for the copy's whole lifetime. A announces what its delete
/// again removed, so D drops it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_read_before_the_delete_again_leaves_every_l1() {
    let server = ValkeyServer::start();
    let b = engine(tier(&server.url(), "tc").await);
    let d = engine(tier(&server.url(), "tc").await);
    let (link, a_tier, a, policy) = a_warm_instance_on_a_slow_link(&server).await;
    server.subscribed("tc:inv", 3).await;
    let key = CacheKey::new("in flight");
    a.put(&key, Fill::new(Value::from_body("old")), &policy);
    b.invalidate(&key).await.unwrap();
    eventually("D hears B's invalidation", || {
        d.stats().l2.invalidations_received >= 1
    })
    .await;
    // A's `SET` lands after B's `DEL`; D reads the copy and keeps it.
    wait_for_keys(&server, "tc:*:e", 2).await;
    assert_eq!(d.get(&key).await.map(|v| v.body), Some("old".into()));
    eventually("A hears B's invalidation", || {
        a.stats().l2.invalidations_received >= 1
    })
    .await;
    bounded("A's write queue", a_tier.flush()).await;
    link.set(Fault::Pass);
    eventually("A deleted its copy again", || {
        a.stats().l2.fills_overtaken >= 1
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while d.get(&key).await.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "D kept the copy A's delete again removed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The same race on one instance: its own fill of the old version is
/// still queued (behind a pipeline on a slow link) when a write on that
/// instance invalidates the key. The invalidation's flush does not wait on
/// a full queue (nor past two command timeouts), so its `UNLINK` can go
/// out first; the queued `SET` must then never be sent, or the old version
/// comes back to L2 for the whole fleet after the write was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_queued_before_this_instances_own_invalidation_is_never_sent() {
    let server = ValkeyServer::start();
    let link = FaultProxy::start(server.addr()).await;
    let config = ValkeyConfig::from_url(&link.redis_url())
        .unwrap()
        .command_timeout(Duration::from_secs(3))
        .write_queue(1);
    let a_tier = connect(config).await;
    let a = engine(a_tier.clone());
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    a.put(
        &CacheKey::new("warm"),
        Fill::new(Value::from_body("w")),
        &policy,
    );
    wait_for_keys(&server, "tc:*:e", 1).await;

    link.set(Fault::Latency(Duration::from_millis(300)));
    a.put(
        &CacheKey::new("in flight"),
        Fill::new(Value::from_body("x")),
        &policy,
    );
    // The writer has taken it and waits on the slow link.
    eventually("the writer takes the first fill", || {
        a.stats().l2.write_queue == 0
    })
    .await;
    let key = CacheKey::new("queued");
    a.put(&key, Fill::new(Value::from_body("old")), &policy);
    assert_eq!(a.stats().l2.write_queue, 1, "the second fill waits");
    bounded("the invalidation", a.invalidate(&key))
        .await
        .unwrap();
    bounded("A's write queue", a_tier.flush()).await;
    link.set(Fault::Pass);
    bounded("A's write queue", a_tier.flush()).await;
    a.forget_local(&key);
    assert_eq!(
        a.get(&key).await.map(|v| v.body),
        None,
        "L2 kept a fill its own instance's invalidation overtook"
    );
}

/// A lock's holder that finds the entry stored after all (its second L2
/// read) lets go without loading: the instances waiting on it must read
/// L2, not go to the origin. Its release was announced as "passed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_let_go_because_the_entry_is_there_does_not_send_waiters_to_the_origin() {
    use tiercache::core::{LockAttempt, Tier, Unlocked};
    let server = ValkeyServer::start();
    let a = tier(&server.url(), "gone").await;
    let b = tier(&server.url(), "gone").await;
    let key = CacheKey::new("stored meanwhile");
    let Ok(LockAttempt::Acquired(token)) = a.try_lock(&key, Duration::from_secs(5)).await else {
        panic!("A did not get the lock");
    };
    let waiting = {
        let (b, key, holder) = (b.clone(), key.clone(), token.clone());
        tokio::spawn(async move {
            b.wait_unlock(&key, Some(&holder), Duration::from_secs(5))
                .await
        })
    };
    // B listens on the key's channel before A lets go.
    let channel = format!("gone:{{{}}}:done", key.hash());
    bounded("B's subscription", async {
        while server.shard_subscribers(&channel) != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    a.unlock(&key, &token, Unlocked::Gone);
    let how = bounded("B's wait", waiting).await.unwrap().unwrap();
    assert!(
        !matches!(how, Unlocked::Passed),
        "a waiter was sent to the origin: {how:?}"
    );
}

/// The delete again is conditional: when a newer fill has replaced the
/// overtaken one in Valkey by the time it lands, the newer one stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_again_leaves_a_newer_fill_in_place() {
    let server = ValkeyServer::start();
    let (link, a_tier, a) = behind_a_link(&server).await;
    let b_tier = tier(&server.url(), "tc").await;
    let b = engine(b_tier.clone());
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    link.set(Fault::Latency(Duration::from_millis(300)));
    let key = CacheKey::new("replaced");
    a.put(&key, Fill::new(Value::from_body("old")), &policy);
    // A's `SET` has landed (its answer is still on its way back to A).
    wait_for_keys(&server, "tc:*:e", 1).await;
    b.invalidate(&key).await.unwrap();
    b.put(&key, Fill::new(Value::from_body("new")), &policy);
    bounded("B's write queue", b_tier.flush()).await;
    eventually("A hears B's invalidation", || {
        a.stats().l2.invalidations_received >= 1
    })
    .await;
    bounded("A's write queue", a_tier.flush()).await;
    link.set(Fault::Pass);
    b.forget_local(&key);
    assert_eq!(
        b.get(&key).await.map(|v| v.body),
        Some("new".into()),
        "the newer fill was deleted"
    );
}

/// `expire_at` and `touch` read the entry, then store it again: an
/// invalidation while the read is on its way wins (the journal refuses the
/// read). The store is now checked under the journal's lock too, closing
/// the few instructions between the two that a review pointed at (not
/// reproduced: this test passes on the code before that change too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_during_expire_at_or_touch_wins() {
    let server = ValkeyServer::start();
    let (link, a_tier, a) = behind_a_link(&server).await;
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    for touch in [false, true] {
        let key = CacheKey::new(format!("renewed {touch}"));
        a.put(&key, Fill::new(Value::from_body("old")), &policy);
        bounded("the fill", a_tier.flush()).await;
        // The read goes to L2, over a slow link.
        a.forget_local(&key);
        link.set(Fault::Latency(Duration::from_millis(300)));
        let gets = server.command_calls("get");
        let renewing = {
            let (a, key, policy) = (a.clone(), key.clone(), policy.clone());
            tokio::spawn(async move {
                if touch {
                    a.touch(&key, &policy).await
                } else {
                    let at = std::time::SystemTime::now() + Duration::from_secs(30);
                    a.expire_at(&key, at).await
                }
            })
        };
        // The read has reached Valkey (its answer is on the way back).
        eventually("the read", || server.command_calls("get") > gets).await;
        a.invalidate(&key).await.unwrap();
        bounded("the renewal", renewing).await.unwrap();
        bounded("A's write queue", a_tier.flush()).await;
        link.set(Fault::Pass);
        assert_eq!(a.get(&key).await.map(|v| v.body), None, "touch: {touch}");
    }
}

/// `touch` and `expire_at` read the entry (here an L1 copy promoted from
/// L2), then store it again: over the newer fill another instance stored
/// in Valkey meanwhile, which every instance then read as the old value.
/// Valkey's copy is replaced only while it is the fill read (and then it
/// is, promoted copy or not); refused, the renewal adds the key to no tag
/// set, and the renewer drops its own copy (L2 no longer backs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_never_overwrites_another_instances_newer_fill() {
    let server = ValkeyServer::start();
    let writer_tier = tier(&server.url(), "renewal").await;
    let renewer_tier = tier(&server.url(), "renewal").await;
    let (writer, renewer) = (engine(writer_tier.clone()), engine(renewer_tier.clone()));
    // Long lives: nothing here may expire while the test runs.
    let policy = Policy::ttl(Duration::from_secs(600)).build().unwrap();
    let short = |tag: &str| {
        Policy::ttl(Duration::from_secs(300))
            .jitter(0.0)
            .tag(tag.to_owned())
            .build()
            .unwrap()
    };
    let renew = async |key: &CacheKey, touch: bool, tag: &str| {
        let renewed = if touch {
            renewer.touch(key, &short(tag)).await
        } else {
            let at = std::time::SystemTime::now() + Duration::from_secs(300);
            renewer.expire_at(key, at).await
        };
        assert!(renewed);
        bounded("the renewal", renewer_tier.flush()).await;
        engine(tier(&server.url(), "renewal").await)
    };
    for touch in [true, false] {
        let key = CacheKey::new(format!("renewed {touch}"));
        writer.put(&key, Fill::new(Value::from_body("old")), &policy);
        bounded("the first fill", writer_tier.flush()).await;
        assert_eq!(renewer.get(&key).await.map(|v| v.body), Some("old".into()));
        let reader = renew(&key, touch, "renewed").await;
        let ttl = reader.ttl(&key).await.expect("renewed in Valkey");
        assert!(ttl <= Duration::from_secs(300), "touch: {touch}: {ttl:?}");
        // Two fills of one key are told apart by their creation, in ms.
        tokio::time::sleep(Duration::from_millis(5)).await;
        writer.put(&key, Fill::new(Value::from_body("new")), &policy);
        bounded("the newer fill", writer_tier.flush()).await;
        let reader = renew(&key, touch, "refused").await;
        assert_eq!(
            reader.get(&key).await.map(|v| v.body),
            Some("new".into()),
            "touch: {touch}: the renewal overwrote a newer fill"
        );
        eventually("the renewer drops its old copy", || {
            !renewer.l1_contains(&key)
        })
        .await;
        assert!(
            writer.l1_contains(&key),
            "touch: {touch}: the newer fill's copy was dropped too"
        );
        writer.invalidate_tag("refused").await.unwrap();
        reader.forget_local(&key);
        assert_eq!(
            reader.get(&key).await.map(|v| v.body),
            Some("new".into()),
            "touch: {touch}: a refused renewal added its tag to the newer fill"
        );
    }
}

/// A renewal stores its fill again only while Valkey still holds it: one
/// deleted behind the renewer's back (as a delete again does, with only a
/// drop message after it) is not brought back for the renewal's lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_never_brings_back_a_fill_valkey_no_longer_holds() {
    let server = ValkeyServer::start();
    let l2 = tier(&server.url(), "gone").await;
    let cache = engine(l2.clone());
    let policy = Policy::ttl(Duration::from_secs(600)).build().unwrap();
    for touch in [true, false] {
        let key = CacheKey::new(format!("gone {touch}"));
        cache.put(&key, Fill::new(Value::from_body("v")), &policy);
        bounded("the fill", l2.flush()).await;
        server.cmd(&["DEL", &l2.entry_key(&key)]);
        let renewed = if touch {
            cache.touch(&key, &policy).await
        } else {
            let at = std::time::SystemTime::now() + Duration::from_secs(300);
            cache.expire_at(&key, at).await
        };
        assert!(renewed, "a fresh copy in L1 to renew");
        bounded("the renewal", l2.flush()).await;
        assert!(
            server.keys(&l2.entry_key(&key)).is_empty(),
            "touch: {touch}: brought back in Valkey"
        );
    }
}

/// The tier's connections (its own and its subscriber's) ask the kernel to
/// find a peer gone without a word: TCP keepalive on an idle connection
/// (`TCP_USER_TIMEOUT` too, for data left unacknowledged). A NAT or
/// firewall that forgets an idle connection and drops what follows left
/// it open, silent, until the kernel's retransmissions gave up (~15
/// minutes). Read from `/proc/net/tcp`: an established socket with its
/// keepalive timer armed shows timer kind 2.
#[tokio::test]
async fn the_tiers_connections_keep_alive_at_the_tcp_level() {
    let server = ValkeyServer::start();
    let _tier = connect(ValkeyConfig::from_url(&server.url()).unwrap()).await;
    let to_server = format!("0100007F:{:04X}", server.port());
    // sl local rem st tx:rx tr:when …; a connection with data in flight
    // shows its retransmission timer (01) instead: read again until none.
    let timers = || -> Vec<String> {
        let table = std::fs::read_to_string("/proc/self/net/tcp").expect("/proc/self/net/tcp");
        table
            .lines()
            .skip(1)
            .map(|row| row.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() > 5 && f[2] == to_server && f[3] == "01")
            .map(|f| f[5].split(':').next().unwrap_or("").to_owned())
            .collect()
    };
    let mut timers_now = timers();
    for _ in 0..100 {
        if !timers_now.iter().any(|timer| timer == "01") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        timers_now = timers();
    }
    let timers = timers_now;
    assert!(timers.len() >= 2, "the tier's connections: {timers:?}");
    assert!(
        timers.iter().all(|timer| timer == "02"),
        "a connection without its keepalive timer: {timers:?}"
    );
}

/// The answer a lock release shares with the waiters (an origin error read
/// whole, up to 256 KiB) rides the write queue within its byte bound, as a
/// fill's copy does: past it the release goes without it. They were not
/// counted, so a flood of failing URLs while Valkey was slow could queue
/// 4,096 of them (~1 GiB) beside a 16 MiB bound.
#[tokio::test]
async fn answers_shared_by_lock_releases_count_against_the_write_queues_bytes() {
    use tiercache::core::{Entry, LockToken, Tier, Times, Unlocked};

    let server = ValkeyServer::start();
    let bound = 1 << 20;
    let tier = connect(
        ValkeyConfig::from_url(&server.url())
            .unwrap()
            .write_queue_bytes(bound),
    )
    .await;
    let now = std::time::SystemTime::now();
    // One thread: the writer runs only once this test awaits, so all of
    // these are queued together.
    for i in 0..50 {
        let key = CacheKey::new(format!("/failing/{i}"));
        let mut error = Value::from_body(vec![b'e'; 100 << 10]);
        error.status = 503;
        let entry = Entry::new(
            key.full().clone(),
            bytes::Bytes::new(),
            error,
            Times::fresh(now, now + Duration::from_secs(1)),
            Duration::ZERO,
        );
        let token = LockToken(bytes::Bytes::from(format!("token-{i}")));
        tier.unlock(&key, &token, Unlocked::Shared(entry, true));
    }
    let queued = tier.report().write_queue_bytes;
    assert!(
        queued > bound as u64 / 2,
        "the shared answers are not counted: {queued} bytes"
    );
    assert!(queued <= bound as u64, "{queued} bytes past the bound");
    bounded("the releases", tier.flush()).await;
    assert_eq!(tier.report().write_queue_bytes, 0);
}

/// A tier on a client the caller built, still connecting: its first
/// commands wait for the connection under way (within the command
/// timeout) rather than fail at once and open the breaker, which would
/// send every instance of a deploy to the origin for its first moments.
#[tokio::test]
async fn a_tier_on_a_client_still_connecting_waits_for_it() {
    use tiercache::core::Tier;

    let server = ValkeyServer::start();
    let client = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&server.url()).unwrap(),
    )
    .build()
    .unwrap();
    let tier =
        ValkeyTier::from_client(client, ValkeyConfig::from_url(&server.url()).unwrap()).unwrap();
    for i in 0..5 {
        let read = tier.get(&CacheKey::new(format!("/k/{i}"))).await;
        assert!(read.is_ok(), "read {i}: {read:?}");
    }
    assert_eq!(tier.report().breaker_trips, 0);
}

/// A late load's fill (`Tier::put_unless_newer`, the answer of a load that
/// outlived its fleet lock) is stored over nothing, over the fill of a load
/// that began before it (created before, or after when that load took
/// longer: a black-box audit had the older of two slow loads kept, and the
/// fleet answer it), and over a value of another type (as a `SET` replaces
/// it); never over the fill of a load that began after it, nor while
/// another instance holds the key's lock (its load began after this one's
/// and is on its way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_fill_never_replaces_the_fill_of_a_load_that_began_after_it() {
    use tiercache::core::{Entry, LockToken, Tier, Times};
    let server = ValkeyServer::start();
    let l2 = tier(&server.url(), "late").await;
    let now = std::time::SystemTime::now();
    let secs = Duration::from_secs;
    let fill = |key: &CacheKey, body: &str, (created, took): (std::time::SystemTime, u64)| {
        let times = Times::fresh(created, created + secs(600));
        let value = Value::from_body(body.to_owned());
        Entry::new(
            key.full().clone(),
            Default::default(),
            value,
            times,
            secs(took),
        )
    };
    // The load began 10 s ago; what Valkey holds was created when, by a
    // load that took how long?
    let began = now - secs(10);
    // And whose token holds the key's fleet lock? The load held "mine".
    let cases = [
        ("nothing", None, None, Some("late")),
        ("older", Some((now - secs(20), 0)), None, Some("late")),
        ("newer", Some((now - secs(5), 0)), None, Some("there")),
        (
            "newer, of an older load",
            Some((now - secs(5), 8)),
            None,
            Some("late"),
        ),
        ("a list", None, None, Some("late")),
        ("nothing, its own lock", None, Some("mine"), Some("late")),
        ("nothing, another's lock", None, Some("theirs"), None),
        (
            "older, another's lock",
            Some((now - secs(20), 0)),
            Some("theirs"),
            Some("there"),
        ),
    ];
    let late = tiercache::core::LateFill::new(began, Some(LockToken("mine".into())));
    for (what, there, lock, expected) in cases {
        let key = CacheKey::new(what);
        if let Some(created) = there {
            l2.put(&key, &fill(&key, "there", created), secs(600), &[]);
        }
        if what == "a list" {
            server.cmd(&["RPUSH", &l2.entry_key(&key), "x"]);
        }
        if let Some(token) = lock {
            server.cmd(&["SET", &l2.lock_key(&key), token, "PX", "60000"]);
        }
        l2.put_unless_newer(&key, &fill(&key, "late", (now, 10)), secs(600), &[], &late);
        bounded("the writes", l2.flush()).await;
        let held = l2
            .get(&key)
            .await
            .unwrap()
            .map(|hit| hit.entry.value().body.clone());
        assert_eq!(held.as_deref(), expected.map(str::as_bytes), "over {what}");
    }
}
