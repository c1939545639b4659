//! Fleets: several engine instances in one process, each with its own
//! Valkey connections, behaving as one cache on one real Valkey server.

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::get;
use tiercache::core::CacheKey;
use tiercache::http::key::request_key;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::http::{header, send};
use tiercache_testkit::{Counter, Fault, FaultProxy, Gate, ValkeyServer, bounded, eventually};
use tokio::sync::Barrier;

/// One instance: an engine on its own connections to `url`, and its app.
struct Instance {
    engine: TieredCache,
    layer: ResponseCacheLayer,
    app: Router,
}

#[derive(Clone)]
struct Origin {
    calls: Counter,
    gate: Gate,
    version: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Origin {
    fn new() -> Self {
        Self {
            calls: Counter::new(),
            gate: Gate::new(),
            version: Default::default(),
        }
    }

    fn version(&self) -> usize {
        self.version.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn bump_version(&self) {
        self.version
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn instance(url: &str, origin: &Origin) -> Instance {
    instance_with(url, origin, |config| config).await
}

/// An instance whose Valkey settings `tune` changes.
async fn instance_with(
    url: &str,
    origin: &Origin,
    tune: impl FnOnce(ValkeyConfig) -> ValkeyConfig,
) -> Instance {
    let engine = engine_on(url, tune).await;
    let layer = ResponseCacheLayer::new(engine.clone());
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(Duration::from_secs(10))
        .tag("products")
        .build()
        .unwrap();
    let route = layer.route(policy).unwrap();
    // `/p/{id}` answers after the gate opens, with the data's version and
    // a surrogate key naming the product.
    let app = Router::new()
        .route(
            "/p/{id}",
            get(
                |State(o): State<Origin>, Path(id): Path<String>| async move {
                    o.calls.bump();
                    o.gate.passed().await;
                    let surrogate = format!("product-{id}");
                    (
                        [("surrogate-key", surrogate)],
                        format!("product {id} v{}", o.version()),
                    )
                },
            )
            .post(|State(o): State<Origin>| async move {
                o.bump_version();
                "updated"
            })
            .layer(route),
        )
        .with_state(origin.clone());
    Instance { engine, layer, app }
}

/// An engine on its own connections to `url`, its Valkey settings changed
/// by `tune`.
async fn engine_on(url: &str, tune: impl FnOnce(ValkeyConfig) -> ValkeyConfig) -> TieredCache {
    // These tests count origin calls and invalidations, not timeouts: a
    // loaded machine must not turn a slow lock command (50 ms by default)
    // into a second origin call, or a slow subscription into a resync.
    let config = ValkeyConfig::from_url(url)
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .command_timeout(Duration::from_secs(1));
    let tier = ValkeyTier::connect(tune(config)).await.unwrap();
    TieredCache::builder()
        .l2(tier)
        .sweep_interval(None)
        .build()
        .unwrap()
}

fn key(path: &str) -> CacheKey {
    let req = Request::get(path)
        .header("host", "shop.test")
        .body(())
        .unwrap();
    request_key(&req.into_parts().0)
}

/// Waits until `n` instances listen on the invalidation channel.
/// (An external server's state: polled every 10 ms, for 10 s at most.)
fn coalesced(fleet: &[Instance]) -> u64 {
    fleet.iter().map(|i| i.engine.stats().coalesced).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_times_300_cold_requests_cost_one_origin_call() {
    let server = ValkeyServer::start();
    let origin = Origin::new();
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(instance(&server.url(), &origin).await);
    }
    let start = std::sync::Arc::new(Barrier::new(300));
    let mut requests = Vec::new();
    for i in 0..300 {
        let app = fleet[i % 3].app.clone();
        let start = start.clone();
        requests.push(tokio::spawn(async move {
            start.wait().await;
            send(&app, "GET", "/p/7").await
        }));
    }
    // Every request is waiting: 99 local followers per instance, and two
    // instances' leaders waiting on the third's lock in Valkey.
    bounded("all 300 requests to wait on one load", async {
        eventually("299 coalesced waits", || coalesced(&fleet) >= 299).await;
        eventually("the leader's origin call", || origin.calls.get() >= 1).await;
    })
    .await;
    assert_eq!(origin.calls.get(), 1);
    origin.gate.open();
    for r in requests {
        let (status, _, body) = r.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "product 7 v0");
    }
    assert_eq!(origin.calls.get(), 1, "one origin call for the whole fleet");
    let locks: u64 = fleet
        .iter()
        .map(|i| i.engine.stats().l2.locks_acquired)
        .sum();
    let waits: u64 = fleet.iter().map(|i| i.engine.stats().l2.lock_waits).sum();
    assert_eq!((locks, waits), (1, 2));
    assert_eq!(server.keys("tc:*:lock").len(), 0, "the lock was released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidation_by_key_tag_and_url_reaches_every_instances_l1() {
    let server = ValkeyServer::start();
    let origin = Origin::new();
    origin.gate.open();
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(instance(&server.url(), &origin).await);
    }
    server.subscribed("tc:inv", 3).await;
    let fill_everywhere = |path: &'static str| {
        let apps: Vec<Router> = fleet.iter().map(|i| i.app.clone()).collect();
        async move {
            for app in &apps {
                let (status, headers, _) = send(app, "GET", path).await;
                assert_eq!(status, StatusCode::OK);
                assert_ne!(header(&headers, "x-cache"), "BYPASS");
            }
        }
    };
    let in_l1 = |fleet: &[Instance], path: &str| -> Vec<bool> {
        fleet
            .iter()
            .map(|i| i.engine.l1_contains(&key(path)))
            .collect()
    };

    // By key, from instance 0.
    fill_everywhere("/p/1").await;
    assert_eq!(in_l1(&fleet, "/p/1"), [true; 3]);
    fleet[0].engine.invalidate(&key("/p/1")).await.unwrap();
    eventually("/p/1 gone from every L1", || {
        in_l1(&fleet, "/p/1") == [false; 3]
    })
    .await;
    assert!(server.keys("tc:*:e").len() <= 1, "and from Valkey");

    // By tag: the origin's Surrogate-Key, from instance 1.
    fill_everywhere("/p/2").await;
    fill_everywhere("/p/3").await;
    fleet[1].layer.invalidate_tag("product-2").await.unwrap();
    eventually("/p/2 gone from every L1", || {
        in_l1(&fleet, "/p/2") == [false; 3]
    })
    .await;
    assert_eq!(in_l1(&fleet, "/p/3"), [true; 3], "other tags stay");
    // By the route's tag: everything.
    fleet[2].engine.invalidate_tag("products").await.unwrap();
    eventually("/p/3 gone from every L1", || {
        in_l1(&fleet, "/p/3") == [false; 3]
    })
    .await;

    // By URL: a POST through instance 2 makes instance 0 miss.
    fill_everywhere("/p/4").await;
    let (_, headers, body) = send(&fleet[0].app, "GET", "/p/4").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("HIT", "product 4 v0")
    );
    // Counted by what the others applied: the instances' own echoes are
    // `PUBLISH`es too.
    let received = |fleet: &[Instance]| -> Vec<u64> {
        let report = |i: &Instance| i.engine.stats().l2.invalidations_received;
        fleet[..2].iter().map(report).collect()
    };
    let before = received(&fleet);
    let (status, _, _) = send(&fleet[2].app, "POST", "/p/4").await;
    assert_eq!(status, StatusCode::OK);
    eventually("/p/4 gone from every L1", || {
        in_l1(&fleet, "/p/4") == [false; 3]
    })
    .await;
    // Counted just after it is applied; a second write marks the end (a
    // message more for the first would be counted before it).
    fleet[2].engine.invalidate(&key("/p/999")).await.unwrap();
    eventually("both to count both", || {
        received(&fleet)
            .iter()
            .zip(&before)
            .all(|(a, b)| *a >= b + 2)
    })
    .await;
    let after = received(&fleet);
    assert_eq!(
        (after[0] - before[0], after[1] - before[1]),
        (2, 2),
        "one message for the URL: its keys and its variants' family tag"
    );
    let (_, headers, body) = send(&fleet[0].app, "GET", "/p/4").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("MISS", "product 4 v1")
    );

    // By prefix: every product, from instance 0; Valkey's copies are banned.
    fill_everywhere("/p/5").await;
    fleet[0]
        .layer
        .invalidate_path_prefix(&"/p/".parse().unwrap())
        .await
        .unwrap();
    eventually("/p/5 and /p/4 gone from every L1", || {
        in_l1(&fleet, "/p/5") == [false; 3] && in_l1(&fleet, "/p/4") == [false; 3]
    })
    .await;
    origin.bump_version();
    let (_, headers, body) = send(&fleet[1].app, "GET", "/p/5").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("MISS", "product 5 v2")
    );
    let received: u64 = fleet
        .iter()
        .map(|i| i.engine.stats().l2.invalidations_received)
        .sum();
    assert!(received >= 10, "messages received: {received}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_missed_an_invalidation_drops_its_l1_on_reconnect() {
    let server = ValkeyServer::start();
    let origin = Origin::new();
    origin.gate.open();
    let a = instance(&server.url(), &origin).await;
    let witness = instance(&server.url(), &origin).await;
    let link = FaultProxy::start(server.addr()).await;
    let b = instance(&link.redis_url(), &origin).await;
    server.subscribed("tc:inv", 3).await;
    send(&a.app, "GET", "/p/9").await;
    let (_, headers, body) = send(&b.app, "GET", "/p/9").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("HIT", "product 9 v0")
    );
    assert!(b.engine.l1_contains(&key("/p/9")));

    // B is cut off; A updates and invalidates; B hears nothing. (Only once
    // every connection through the link is closed: on a loaded machine the
    // link's tasks could see the fault after it was lifted again, and pass
    // the message on, which B then rightly heard: no resync to wait for.)
    link.set(Fault::Reset);
    eventually("B's connections reset", || link.open_connections() == 0).await;
    origin.bump_version();
    a.engine.invalidate(&key("/p/9")).await.unwrap();
    eventually("the witness to hear it", || {
        witness.engine.stats().l2.invalidations_received >= 1
    })
    .await;
    assert!(
        b.engine.l1_contains(&key("/p/9")),
        "B cannot have heard the invalidation"
    );

    // B is back: it assumes it missed messages and drops its L1.
    link.set(Fault::Pass);
    bounded("B to resync after reconnecting", async {
        eventually("a resync", || b.engine.stats().l2.resyncs >= 1).await;
    })
    .await;
    assert!(!b.engine.l1_contains(&key("/p/9")));
    let (_, headers, body) = send(&b.app, "GET", "/p/9").await;
    assert_eq!(body, "product 9 v1", "never the old entry after reconnect");
    assert_eq!(header(&headers, "x-cache"), "MISS");
}

/// An instance cut off from Valkey cannot hear the fleet: past
/// `unheard_l1_for` its L1 entries must ask the origin again (and again
/// each such while), so a write made on another instance shows there
/// during the outage, not only once it is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_cannot_hear_stops_answering_its_l1_as_it_is() {
    for fault in [Fault::Reset, Fault::Blackhole] {
        let server = ValkeyServer::start();
        let origin = Origin::new();
        origin.gate.open();
        let a = instance(&server.url(), &origin).await;
        let link = FaultProxy::start(server.addr()).await;
        let b = instance_with(&link.redis_url(), &origin, |c| {
            c.unheard_l1_for(Duration::from_secs(1))
        })
        .await;
        server.subscribed("tc:inv", 2).await;
        send(&a.app, "GET", "/p/3").await;
        let (_, headers, _) = send(&b.app, "GET", "/p/3").await;
        assert_eq!(header(&headers, "x-cache"), "HIT", "{fault:?}");

        link.set(fault);
        origin.bump_version();
        a.engine.invalidate(&key("/p/3")).await.unwrap();
        // Within the bound, a heartbeat and a command timeout or two; the
        // entry itself lives a minute.
        let heard_of = tokio::time::timeout(Duration::from_secs(10), async {
            while send(&b.app, "GET", "/p/3").await.2 != "product 3 v1" {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(
            heard_of.is_ok(),
            "{fault:?}: B still answers the old version"
        );
    }
}

/// Stale-if-error across the fleet: instance A revalidates its stale copy
/// and the origin fails with a 500 that sets a cookie. A answers with its
/// stale copy. B, with no copy of its own that may stand in, waits on A's
/// fill lock: it must not be handed A's 500 (the cookie is A's client's),
/// but load its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_may_not_be_shared_is_not_handed_to_another_instance() {
    let server = ValkeyServer::start();
    let clock = tiercache::core::MockClock::new();
    let calls = Counter::new();
    let gate = Gate::new();
    let origin = Router::new().route(
        "/e",
        get({
            let (calls, gate) = (calls.clone(), gate.clone());
            move || {
                let (calls, gate) = (calls.clone(), gate.clone());
                async move {
                    let n = calls.bump();
                    if n == 1 {
                        return (
                            StatusCode::OK,
                            [("cache-control", "max-age=1, stale-if-error=60".to_owned())],
                            "good".to_owned(),
                        );
                    }
                    gate.passed().await;
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [("set-cookie", format!("session={n}"))],
                        format!("failed {n}"),
                    )
                }
            }
        }),
    );
    let mut apps = Vec::new();
    let mut engines = Vec::new();
    for _ in 0..2 {
        let config = ValkeyConfig::from_url(&server.url())
            .unwrap()
            .connect_timeout(Duration::from_secs(10))
            .command_timeout(Duration::from_secs(1));
        let engine = TieredCache::builder()
            .l2(ValkeyTier::connect(config).await.unwrap())
            .clock(clock.clone())
            .sweep_interval(None)
            .build()
            .unwrap();
        let policy = Policy::ttl(Duration::from_secs(60))
            .lock_timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let route = ResponseCacheLayer::new(engine.clone())
            .route(policy)
            .unwrap();
        apps.push(origin.clone().layer(route));
        engines.push(engine);
    }
    let (status, _, body) = send(&apps[0], "GET", "/e").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "good"));
    clock.advance(Duration::from_secs(2));
    // A's revalidation is at the origin, holding the fill lock.
    let a = tokio::spawn({
        let app = apps[0].clone();
        async move { send(&app, "GET", "/e").await }
    });
    bounded("A at the origin", calls.reached(2)).await;
    let b = tokio::spawn({
        let app = apps[1].clone();
        async move { send(&app, "GET", "/e").await }
    });
    // B listens for A's release (else it would find the lock gone and read
    // L2 on its own, and never be handed A's answer).
    let channel = format!("tc:{{{}}}:done", key("/e").hash());
    bounded("B waits on A's lock", async {
        while server.shard_subscribers(&channel) != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(engines[1].stats().coalesced, 1);
    gate.open();
    let (status, _, body) = bounded("A", a).await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "good"),
        "A's stale copy"
    );
    let (status, headers, body) = bounded("B", b).await.unwrap();
    assert_ne!(
        header(&headers, "set-cookie"),
        "session=2",
        "B was handed A's response, cookie and all"
    );
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body, "failed 3", "B's own origin call");
}

/// An origin that answers a stored value after `took`, and records what
/// the engine tells it of its request's waits.
struct Watched {
    took: Duration,
    events: std::sync::Arc<std::sync::Mutex<Vec<tiercache::core::Event>>>,
}

impl tiercache::core::Select for Watched {
    fn observe(&self, event: tiercache::core::Event) {
        self.events.lock().unwrap().push(event);
    }
}

impl tiercache::core::Origin for Watched {
    type Output = ();
    type Error = ();

    async fn load(
        self,
        _stale: Option<tiercache::core::Entry>,
    ) -> Result<tiercache::core::Loaded<()>, ()> {
        use tiercache::core::{Fill, Loaded, Value};
        tokio::time::sleep(self.took).await;
        Ok(Loaded::Store(Fill::new(Value::from_body("stored"))))
    }
}

/// Two instances, a flight's wait of 1 s, an origin of 3 s: one
/// request on the first, then three at once on the second. Each of the
/// second's three waited (one on the first's fleet lock, two on the one
/// that leads there), and each is counted once as coalesced and gives one
/// wait sample, whatever flights and locks it waited on after: a request
/// that followed a flight, then took it over and waited on the fleet
/// lock, was counted twice (the second's `coalesced` was 5 of 3 requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_waiting_across_the_fleet_is_counted_once() {
    use tiercache::core::Event;
    let server = ValkeyServer::start();
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(engine_on(&server.url(), |config| config).await);
    }
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let fetch = |engine: &TieredCache, events| {
        let (engine, policy) = (engine.clone(), policy.clone());
        let origin = Watched {
            took: Duration::from_secs(3),
            events,
        };
        tokio::spawn(async move {
            let key = CacheKey::new("fleet-wait");
            assert!(engine.fetch(&key, &policy, origin).await.is_ok());
        })
    };
    let first = fetch(&engines[0], Default::default());
    eventually("the first instance's lock", || {
        server.keys("tc:*:lock").len() == 1
    })
    .await;
    let second: Vec<_> = (0..3).map(|_| fetch(&engines[1], events.clone())).collect();
    bounded("the first", first).await.unwrap();
    for request in second {
        bounded("a request on the second", request).await.unwrap();
    }
    let waits = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::LockWait(_)))
        .count();
    assert_eq!(
        (engines[1].stats().coalesced, waits),
        (3, 3),
        "{:?}",
        events.lock().unwrap()
    );
}

/// An instance whose subscription is lost while Valkey still answers it
/// (its subscriber's connection dropped and cannot come back: here its
/// user was turned off, which leaves the connections it has working) may
/// miss another instance's acknowledged write. Until it is subscribed
/// again and has dropped its L1, its L1 answers nothing as fresh: each
/// request reads Valkey, where the write deleted the entry. It answered
/// its copy before, for as long as the subscription stayed down (a
/// black-box audit: after a 2–3 s pause or a restart, an invalidation
/// acknowledged while the other instances were still subscribing again
/// was followed by their old copies for up to 0.15 s). Subscribed again,
/// its L1 answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_subscription_is_lost_answers_no_l1_copy_as_fresh() {
    let server = ValkeyServer::start();
    server.cmd(&["ACL", "SETUSER", "b", "on", ">secret", "~*", "&*", "+@all"]);
    let origin = Origin::new();
    origin.gate.open();
    let a = instance(&server.url(), &origin).await;
    let b_url = format!("redis://b:secret@{}", server.addr());
    let b = instance(&b_url, &origin).await;
    server.subscribed("tc:inv", 2).await;
    let tier = |headers: &axum::http::HeaderMap| header(headers, "x-cache-tier").to_owned();
    send(&b.app, "GET", "/p/5").await;
    let (_, headers, _) = send(&b.app, "GET", "/p/5").await;
    assert_eq!(tier(&headers), "l1");

    server.cmd(&["ACL", "SETUSER", "b", "off"]);
    server.cmd(&["CLIENT", "KILL", "USER", "b", "TYPE", "pubsub"]);
    let from_l2 = async {
        while tier(&send(&b.app, "GET", "/p/5").await.1) != "l2" {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded("B to answer from Valkey, not its L1", from_l2).await;
    assert!(b.engine.stats().l2.deaf, "said in its stats");
    origin.bump_version();
    a.engine.invalidate(&key("/p/5")).await.unwrap();
    let (_, _, body) = send(&b.app, "GET", "/p/5").await;
    assert_eq!(
        body, "product 5 v1",
        "B answered the copy A's write replaced"
    );
    // A prefix invalidation leaves the entries in Valkey under a ban B has
    // not heard either: B reads the bans with them (the proxy's admin
    // invalidates a URL so).
    send(&b.app, "GET", "/p/6").await;
    origin.bump_version();
    let url = format!("http://{}/p/6", tiercache_testkit::http::HOST);
    let pattern = tiercache::http::key::url_pattern(&url.parse().unwrap());
    a.engine.invalidate_prefix(pattern).await.unwrap();
    let (_, _, body) = send(&b.app, "GET", "/p/6").await;
    assert_eq!(body, "product 6 v2", "B answered a copy A's ban covers");

    server.cmd(&["ACL", "SETUSER", "b", "on"]);
    server.subscribed("tc:inv", 2).await;
    let from_l1 = async {
        loop {
            let (_, headers, body) = send(&b.app, "GET", "/p/5").await;
            assert_eq!(body, "product 5 v2");
            if tier(&headers) == "l1" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded("B to answer from its L1 again", from_l1).await;
    assert!(!b.engine.stats().l2.deaf);
}

/// An instance whose user may not subscribe (an ACL without `subscribe`,
/// or without the channel) is told `Ok` by fred for its refused
/// `SUBSCRIBE`: it believed it heard the fleet and answered its L1 copy
/// after another instance's write. Its subscription is now confirmed by a
/// message it sends itself: unheard (or refused), it is deaf (it answers
/// no L1 copy as it is while Valkey answers), and once its user may
/// subscribe, it subscribes, drops L1 and answers from it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_subscription_was_refused_answers_no_l1_copy_as_fresh() {
    refused_then_allowed(&["-subscribe"], &["+subscribe"]).await;
    // Without the channel, its own writes are refused too.
    refused_then_allowed(&["resetchannels", "&tc:{*"], &["&tc:inv"]).await;
}

async fn refused_then_allowed(refuse: &[&str], allow: &[&str]) {
    let server = ValkeyServer::start();
    let user = ["ACL", "SETUSER", "c", "on", ">secret", "~*", "&*", "+@all"];
    server.cmd(&[&user[..], refuse].concat());
    let origin = Origin::new();
    origin.gate.open();
    let a = instance(&server.url(), &origin).await;
    let c_url = format!("redis://c:secret@{}", server.addr());
    let c = instance(&c_url, &origin).await;
    server.subscribed("tc:inv", 1).await;
    let tier = |headers: &axum::http::HeaderMap| header(headers, "x-cache-tier").to_owned();
    send(&c.app, "GET", "/p/5").await;
    let from_l2 = async {
        while tier(&send(&c.app, "GET", "/p/5").await.1) != "l2" {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded(&format!("C ({refuse:?}) to answer from Valkey"), from_l2).await;
    assert!(c.engine.stats().l2.deaf, "said in its stats");
    // Refused, it keeps its connections: fred matched the refusal's error
    // to the next ping, which made the subscriber reconnect every beat.
    let connections = || -> Vec<String> {
        let list = server.cmd(&["CLIENT", "LIST", "USER", "c"]);
        list.lines()
            .filter_map(|l| Some(l.split(' ').next()?.to_owned()))
            .collect()
    };
    let before = connections();
    assert!(!before.is_empty());
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(connections(), before, "C's connections while refused");
    origin.bump_version();
    a.engine.invalidate(&key("/p/5")).await.unwrap();
    let (_, _, body) = send(&c.app, "GET", "/p/5").await;
    assert_eq!(
        body, "product 5 v1",
        "C answered the copy A's write replaced"
    );
    // A ban recorded while C is refused, and C idle: read once C hears.
    send(&c.app, "GET", "/p/6").await;
    origin.bump_version();
    let url = format!("http://{}/p/6", tiercache_testkit::http::HOST);
    let pattern = tiercache::http::key::url_pattern(&url.parse().unwrap());
    a.engine.invalidate_prefix(pattern).await.unwrap();

    server.cmd(&[&["ACL", "SETUSER", "c"][..], allow].concat());
    server.subscribed("tc:inv", 2).await;
    // No request until it hears: a deaf instance's L2 hit reads the bans.
    let hears = async {
        while c.engine.stats().l2.deaf {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded("C to hear again", hears).await;
    let (_, _, body) = send(&c.app, "GET", "/p/6").await;
    assert_eq!(body, "product 6 v2", "C answered a copy A's ban covers");
    let from_l1 = async {
        loop {
            // v1, or v2 once deaf past `unheard_l1_for` (L1 asks the
            // origin again then): never the copy A's write replaced.
            let (_, headers, body) = send(&c.app, "GET", "/p/5").await;
            assert_ne!(body, "product 5 v0");
            if tier(&headers) == "l1" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded("C to answer from its L1 again", from_l1).await;
    assert!(!c.engine.stats().l2.deaf);
    // Heard now: A's next write reaches C's L1.
    origin.bump_version();
    a.engine.invalidate(&key("/p/5")).await.unwrap();
    let heard = async {
        while send(&c.app, "GET", "/p/5").await.2 != "product 5 v3" {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    bounded("C to hear A's write", heard).await;
}
