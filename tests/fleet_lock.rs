//! The fleet-wide fill lock under a slow load, on one real Valkey server:
//! a body that keeps coming is waited for by the other instances too.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::routing::get;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::http::send;
use tiercache_testkit::{Counter, Gate, ValkeyServer, bounded};

/// A body fed frame by frame from a task.
struct Fed(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<std::io::Result<http_body::Frame<Bytes>>>> {
        self.0
            .poll_recv(cx)
            .map(|next| next.map(|data| Ok(http_body::Frame::data(data))))
    }
}

/// The whole body each call answers: sixteen frames.
const WHOLE: &str = "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 ";

/// A flight's wait, and so how long a fleet lock lives from its take or
/// its load's last progress: long enough that a loaded machine's stalls
/// stay well inside it.
const LOCK: Duration = Duration::from_secs(2);

/// An instance on its own connections to `url`, its route at `path`
/// answering with `answer` under a flight's wait of [`LOCK`].
async fn instance_answering<F, Fut, T>(url: &str, path: &str, answer: F) -> (TieredCache, Router)
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: axum::response::IntoResponse + 'static,
{
    let (engine, app, _) = instance_with_tier(url, path, answer).await;
    (engine, app)
}

/// As [`instance_answering`], with its tier (to flush its writes).
async fn instance_with_tier<F, Fut, T>(
    url: &str,
    path: &str,
    answer: F,
) -> (TieredCache, Router, ValkeyTier)
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: axum::response::IntoResponse + 'static,
{
    let (engine, policy, tier) = engine_with_tier(url, tiercache::core::SystemClock).await;
    let route = ResponseCacheLayer::new(engine.clone())
        .route(policy)
        .unwrap();
    let app = Router::new().route(path, get(answer).layer(route));
    (engine, app, tier)
}

/// A connection to `url`. Not a slow command on a loaded machine: what
/// is counted is origin calls, not timeouts.
async fn tier_on(url: &str) -> ValkeyTier {
    let config = ValkeyConfig::from_url(url)
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .command_timeout(Duration::from_secs(1));
    ValkeyTier::connect(config).await.unwrap()
}

/// An engine on its own connection to `url`, and a minute's policy under
/// a flight's wait of [`LOCK`].
async fn engine_on(url: &str) -> (TieredCache, Policy) {
    engine_on_clock(url, tiercache::core::SystemClock).await
}

/// As [`engine_on`], on `clock`.
async fn engine_on_clock(
    url: &str,
    clock: impl tiercache::core::Clock + 'static,
) -> (TieredCache, Policy) {
    let (engine, policy, _) = engine_with_tier(url, clock).await;
    (engine, policy)
}

/// As [`engine_on_clock`], with its tier.
async fn engine_with_tier(
    url: &str,
    clock: impl tiercache::core::Clock + 'static,
) -> (TieredCache, Policy, ValkeyTier) {
    let tier = tier_on(url).await;
    let engine = TieredCache::builder()
        .l2(tier.clone())
        .clock(clock)
        .sweep_interval(None)
        .build()
        .unwrap();
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(LOCK)
        .build()
        .unwrap();
    (engine, policy, tier)
}

/// A fleet's instance: its engine, and its app whose `/slow` route answers
/// each call with sixteen frames 300 ms apart (4.8 s), under a flight's
/// wait of [`LOCK`]; `stall` holds the body back 3 s after its second
/// frame (an origin gone quiet mid-body).
async fn instance(url: &str, calls: &Counter, stall: bool) -> (TieredCache, Router) {
    let calls = calls.clone();
    let slow = move || {
        calls.bump();
        let (feed, fed) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for i in 0..16 {
                let gap = if stall && i == 2 { 3000 } else { 300 };
                tokio::time::sleep(Duration::from_millis(gap)).await;
                if feed.send(Bytes::from(format!("{i} "))).is_err() {
                    return;
                }
            }
        });
        std::future::ready(Body::new(Fed(fed)))
    };
    instance_answering(url, "/slow", slow).await
}

/// Instance A leads the load; once it called the origin, instance B gets
/// three requests for the same key. The origin calls, the bodies B
/// answered, and B's engine.
async fn a_fleet_on_a_slow_body(stall: bool) -> (usize, Vec<String>, TieredCache) {
    let server = ValkeyServer::start();
    let calls = Counter::new();
    let (_a, app_a) = instance(&server.url(), &calls, stall).await;
    let (b, app_b) = instance(&server.url(), &calls, stall).await;
    let first = tokio::spawn(async move { send(&app_a, "GET", "/slow").await });
    bounded("A's origin call", calls.reached(1)).await;
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let app = app_b.clone();
            tokio::spawn(async move { send(&app, "GET", "/slow").await })
        })
        .collect();
    let mut bodies = Vec::new();
    for request in requests {
        let (status, _, body) = bounded("B's answer", request).await.unwrap();
        assert_eq!(status, StatusCode::OK);
        bodies.push(body);
    }
    let (status, _, body) = bounded("A's answer", first).await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, WHOLE));
    (calls.get(), bodies, b)
}

/// The instance loading a body that keeps coming moves its fleet lock on
/// with the body's progress, as it moves its own flight's deadline; the
/// instances waiting on the lock follow it, and move their own waiters'
/// deadline. They took the lock over at its first end before (`lock
/// timeout` from its take) and called the origin: a 4.8 s body under a
/// 2 s lock cost three origin calls for two instances. A body gone quiet
/// longer than the lock's wait is still taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_keeps_coming_is_waited_for_across_the_fleet() {
    let (calls, bodies, b) = a_fleet_on_a_slow_body(false).await;
    assert_eq!(calls, 1, "one origin call for the fleet: {bodies:?}");
    assert!(bodies.iter().all(|body| body == WHOLE), "{bodies:?}");
    let stats = b.stats();
    assert_eq!(stats.lock_timeouts, 0);
    // One wait on one holder, however often it looked at the lock again.
    assert_eq!(stats.l2.lock_waits, 1);
    let (calls, _, _) = a_fleet_on_a_slow_body(true).await;
    assert!(calls >= 2, "a stalled body is taken over: {calls} calls");
}

/// The owner of a fleet lock hangs (its origin never answers, as an
/// instance killed mid-load): its lock ends `lock_timeout` after its take,
/// one of the two instances waiting on it takes it and loads, and the
/// other waits on that new holder, as on any load under way, past its own
/// first deadline. It loaded at that deadline before, beside the new
/// holder (a black-box audit: a killed owner cost its fleet of three two
/// more origin calls, 80 ms apart, not one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_lock_holder_is_waited_on_past_the_first_deadline() {
    let server = ValkeyServer::start();
    let (calls, gate) = (Counter::new(), Gate::new());
    let hung = {
        let calls = calls.clone();
        move || {
            calls.bump();
            std::future::pending::<&'static str>()
        }
    };
    let (_a, owner) = instance_answering(&server.url(), "/k", hung).await;
    let answering = {
        let (calls, gate) = (calls.clone(), gate.clone());
        move || {
            let (calls, gate) = (calls.clone(), gate.clone());
            async move {
                calls.bump();
                gate.passed().await;
                "loaded"
            }
        }
    };
    let (b, app_b) = instance_answering(&server.url(), "/k", answering.clone()).await;
    let (c, app_c) = instance_answering(&server.url(), "/k", answering).await;
    let _owner = tokio::spawn(async move { send(&owner, "GET", "/k").await });
    bounded("the owner's origin call", calls.reached(1)).await;
    // The waiters' deadlines come 600 ms after the owner's lock ends (a
    // real server's `PX`, on its own clock).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let waiters: Vec<_> = [app_b, app_c]
        .into_iter()
        .map(|app| tokio::spawn(async move { send(&app, "GET", "/k").await }))
        .collect();
    bounded("the new holder's origin call", calls.reached(2)).await;
    // Past the waiters' first deadline (`LOCK` from their start, 0.6 s
    // past the new holder's take), and well within the new holder's own
    // wait (a load quiet that long is stuck, and taken over).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        calls.get(),
        2,
        "the other waiter loaded beside the new holder"
    );
    gate.open();
    for waiter in waiters {
        let (status, _, body) = bounded("a waiter's answer", waiter).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "loaded"));
    }
    assert_eq!(calls.get(), 2);
    assert_eq!(b.stats().lock_timeouts + c.stats().lock_timeouts, 0);
}

/// The holder's lock, moved on a little (less than counts as its load's
/// progress), ends a moment after a waiter's deadline: the waiter waits
/// for that end and takes the lock, rather than load without it (where
/// the other waiters take the lock as it ends and load beside it: a
/// black-box audit saw two calls at once for a slow failure, 3 / 4 / 6
/// calls where 3 were due).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_about_to_end_at_a_waiters_deadline_is_waited_for() {
    use tiercache::core::{CacheKey, Fill, Loaded, LockAttempt, Tier, Value, origin_fn};
    let server = ValkeyServer::start();
    let holder = tier_on(&server.url()).await;
    let (waiter, policy) = engine_on(&server.url()).await;
    let key = CacheKey::new("k");
    let Ok(LockAttempt::Acquired(token)) = holder.try_lock(&key, LOCK).await else {
        panic!("the holder did not take the lock");
    };
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            let origin = origin_fn(|_stale| async {
                Ok::<_, ()>(Loaded::<()>::Store(Fill::new(Value::from_body("loaded"))))
            });
            waiter.fetch(&key, &policy, origin).await
        })
    };
    // The waiter's deadline is `LOCK` from its start; the lock now ends
    // 100 ms after it (less than an eighth of `LOCK`: no progress).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let lapse = tiercache::core::LockLapse::default();
    holder.extend_lock(&key, &token, LOCK, lapse.clone());
    assert!(
        bounded("the waiter's answer", waiting)
            .await
            .unwrap()
            .is_ok()
    );
    assert_eq!(
        waiter.stats().lock_timeouts,
        0,
        "it loaded without the lock at its deadline"
    );
    assert!(!lapse.reported(), "a move that landed was told lost");
}

/// Polls `app` (20 ms apart, 10 s at most) until it answers `/k` with
/// `body`; else fails with `what`.
async fn until_answers(app: &Router, body: &str, what: &str) {
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        while send(app, "GET", "/k").await.2 != body {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    answered.await.unwrap_or_else(|_| panic!("{what}"));
}

/// Instances A, B and C on `url`, answering `/k` with `answer`, and A's
/// request, spawned, once its origin call (the first of `calls`) began.
async fn three_with_a_loading<F, Fut>(
    url: &str,
    answer: F,
    calls: &Counter,
) -> (
    [Router; 3],
    tokio::task::JoinHandle<(StatusCode, axum::http::HeaderMap, String)>,
)
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = &'static str> + Send + 'static,
{
    let (_, a) = instance_answering(url, "/k", answer.clone()).await;
    let (_, b) = instance_answering(url, "/k", answer.clone()).await;
    let (_, c) = instance_answering(url, "/k", answer).await;
    let first = tokio::spawn({
        let a = a.clone();
        async move { send(&a, "GET", "/k").await }
    });
    bounded("A's origin call", calls.reached(1)).await;
    ([a, b, c], first)
}

/// After two loads of `/k`, A's older and B's newer: A's copy goes once
/// Valkey refuses it (polled: the reply of a real server's script), then
/// A reads B's answer there, and so does C; two origin calls in all.
async fn the_newer_answer_everywhere(a: &Router, c: &Router, calls: &Counter) {
    let older = "A still answers its older copy: Valkey took it over the newer";
    until_answers(a, "new", older).await;
    let (_, _, body) = send(c, "GET", "/k").await;
    assert_eq!(body, "new", "Valkey holds the older load's answer");
    assert_eq!(calls.get(), 2);
}

/// Two instances on `url` sharing `clock`, each with its own engine in
/// front of `origin` under a minute's policy.
async fn two_on_one_clock(
    url: &str,
    clock: &tiercache::core::MockClock,
    origin: &Router,
) -> Vec<(TieredCache, Router)> {
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let (engine, policy) = engine_on_clock(url, clock.clone()).await;
        let route = ResponseCacheLayer::new(engine.clone())
            .route(policy)
            .unwrap();
        fleet.push((engine, origin.clone().layer(route)));
    }
    fleet
}

/// An origin at `/e` whose first call answers `v1` under `cache_control`,
/// and every later one `503`.
fn failing_after_one(cache_control: &'static str, calls: &Counter) -> Router {
    let calls = calls.clone();
    let answer = move || {
        let n = calls.bump();
        let (status, cache_control) = match n {
            1 => (StatusCode::OK, cache_control),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "no-store"),
        };
        std::future::ready((status, [("cache-control", cache_control)], format!("v{n}")))
    };
    Router::new().route("/e", get(answer))
}

/// Instance A's load meets the origin failing (a `503`): for a second
/// the fleet knows, and instance B, with a stale-if-error copy of its
/// own, answers it without calling the origin (each instance asked a
/// failing origin once a second before, so a fleet of N asked N times:
/// a black-box audit of three instances counted 1.8–3 calls a second).
/// Once the mark is gone (a second on Valkey's clock) B asks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_failure_met_by_one_instance_spares_the_fleet_its_call() {
    // The mark lives a second of Valkey's real time. A loaded machine
    // (this suite runs a Valkey per test on two cores) can stretch A's
    // failure and B's request past it, and B then rightly asks the
    // origin: such a run shows nothing either way, so it starts over.
    unless_outlasted(spares_the_fleet_unless_outlasted).await;
}

/// Runs `run` (a fresh server each time) until it ends within the
/// fleet's mark, five times at most.
async fn unless_outlasted<F: std::future::Future<Output = bool>>(run: impl Fn() -> F) {
    for _ in 0..5 {
        if run().await {
            return;
        }
    }
    panic!("five runs in a row outlasted the fleet's one-second mark");
}

/// One run of the test above on a server of its own: false, asserting
/// nothing more, when B's request ended past half the mark's life after
/// A's began.
async fn spares_the_fleet_unless_outlasted() -> bool {
    let server = ValkeyServer::start();
    let clock = tiercache::core::MockClock::new();
    let calls = Counter::new();
    let origin = failing_after_one("max-age=1, stale-if-error=60", &calls);
    let fleet = two_on_one_clock(&server.url(), &clock, &origin).await;
    let (a, b) = (&fleet[0].1, &fleet[1].1);
    let (_, _, body) = send(a, "GET", "/e").await;
    assert_eq!(body, "v1");
    // B's copy, promoted from Valkey.
    let (_, _, body) = send(b, "GET", "/e").await;
    assert_eq!((body.as_str(), calls.get()), ("v1", 1));
    clock.advance(Duration::from_secs(2));
    // Real time, as the mark's life on Valkey is.
    let started = std::time::Instant::now();
    let (status, _, body) = send(a, "GET", "/e").await;
    assert_eq!(
        (status, body.as_str(), calls.get()),
        (StatusCode::OK, "v1", 2)
    );
    let (status, headers, body) = send(b, "GET", "/e").await;
    if started.elapsed() > Duration::from_millis(500) {
        return false;
    }
    assert_eq!((status, body.as_str()), (StatusCode::OK, "v1"));
    assert_eq!(
        calls.get(),
        2,
        "B asked the origin A saw failing a moment ago"
    );
    assert!(
        tiercache_testkit::http::header(&headers, "cache-status").contains("fwd=stale"),
        "{headers:?}"
    );
    // The mark ends on Valkey's clock (polled: an external server's state),
    // B's own on the engine's: then B asks the origin again.
    bounded("the fleet's mark to end", async {
        while !server.keys("*:failing").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    clock.advance(Duration::from_secs(1));
    let (status, _, body) = send(b, "GET", "/e").await;
    assert_eq!(
        (status, body.as_str(), calls.get()),
        (StatusCode::OK, "v1", 3)
    );
    true
}

/// The same for a background refresh: A's refresh meets the origin
/// failing, and B's stale hit a moment later starts none that calls it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_failed_on_one_instance_spares_the_fleet_its_call() {
    // As above: a run in which B's refresh came past half the mark's
    // one-second life shows nothing either way, and starts over.
    unless_outlasted(a_refresh_spares_the_fleet_unless_outlasted).await;
}

/// One run of the test above on a server of its own: false, asserting
/// nothing more, when B's refresh ended past half the mark's life after
/// A's request began (the refresh that sets the mark starts after it).
async fn a_refresh_spares_the_fleet_unless_outlasted() -> bool {
    let server = ValkeyServer::start();
    let clock = tiercache::core::MockClock::new();
    let calls = Counter::new();
    let origin = failing_after_one("max-age=1, stale-while-revalidate=60", &calls);
    let fleet = two_on_one_clock(&server.url(), &clock, &origin).await;
    let ((_, a), (b_engine, b)) = (&fleet[0], &fleet[1]);
    send(a, "GET", "/e").await;
    send(b, "GET", "/e").await;
    clock.advance(Duration::from_secs(2));
    // Real time, as the mark's life on Valkey is.
    let started = std::time::Instant::now();
    let (_, _, body) = send(a, "GET", "/e").await;
    assert_eq!(body, "v1");
    bounded("A's refresh", calls.reached(2)).await;
    // A's refresh marks the key as it ends (its lock released after).
    bounded("the fleet's mark", async {
        while server.keys("*:failing").is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let (_, _, body) = send(b, "GET", "/e").await;
    assert_eq!(body, "v1");
    // B's refresh ends meeting the mark, or (past it) calling the origin.
    bounded("B's refresh to end", async {
        while b_engine.stats().l2.failing_marks == 0 && calls.get() == 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    if started.elapsed() > Duration::from_millis(500) {
        return false;
    }
    assert_eq!(calls.get(), 2, "B's refresh asked the failing origin");
    true
}

/// Instance A's load outlives its fleet lock (its origin silent past the
/// lock's wait); instance B takes the lock as it ends, loads and stores
/// the newer answer. A's answer, when it comes, is its own caller's, but
/// does not replace B's in Valkey (a third instance reads B's), nor stays
/// in A's L1. It replaced it before: every instance reading Valkey then
/// answered the older load's answer (a `500 max-age=30` over a `200`, in
/// a black-box audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_outlived_its_lock_does_not_replace_the_newer_answer() {
    let server = ValkeyServer::start();
    let (calls, gate) = (Counter::new(), Gate::new());
    let answer = {
        let (calls, gate) = (calls.clone(), gate.clone());
        move || {
            let (calls, gate) = (calls.clone(), gate.clone());
            async move {
                if calls.bump() == 1 {
                    gate.passed().await;
                    return "old";
                }
                "new"
            }
        }
    };
    let ([a, b, c], first) = three_with_a_loading(&server.url(), answer, &calls).await;
    // B waits on A's lock until it ends (`LOCK` after its take), then loads.
    let (_, _, body) = bounded("B's answer", send(&b, "GET", "/k")).await;
    assert_eq!(body, "new");
    gate.open();
    let (_, _, body) = bounded("A's answer", first).await.unwrap();
    assert_eq!(body, "old", "A's caller gets its own load's answer");
    the_newer_answer_everywhere(&a, &c, &calls).await;
}

/// Valkey loses instance A's lock under its load (evicted under
/// `allkeys-lru`, a restart without persistence): A's body keeps coming,
/// so A moves the lock on, and Valkey refuses the move. Instance B then
/// takes the lock, loads and stores the newer answer before A's ends.
/// A's answer is its own caller's, but does not replace B's in Valkey
/// (a third instance reads B's), nor stays in A's L1. It replaced it
/// before: A reckoned its lock moved on and stored as an owner does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_whose_lock_was_lost_does_not_replace_the_newer_answer() {
    a_lock_lost_under_a_load(true).await;
}

/// As above, with B still loading when A's answer comes: A's does not
/// land before B's (B holds the lock) to stay in A's L1 once B's plain
/// fill replaces it in Valkey (it stayed before; CI had A's land first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_whose_lock_was_lost_gives_way_to_the_load_under_way() {
    a_lock_lost_under_a_load(false).await;
}

/// A's lock lost under its load, then B's load of the newer answer,
/// stored before A's load ends (`b_stored_first`) or still under way.
async fn a_lock_lost_under_a_load(b_stored_first: bool) {
    let server = ValkeyServer::start();
    let (calls, b_gate) = (Counter::new(), Gate::new());
    let (feed, fed) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let fed = std::sync::Arc::new(std::sync::Mutex::new(Some(fed)));
    let answer = {
        let (calls, b_gate) = (calls.clone(), b_gate.clone());
        move || {
            calls.bump();
            // The first call's body comes as the test feeds it.
            let first = fed.lock().unwrap().take();
            let b_gate = b_gate.clone();
            async move {
                match first {
                    Some(fed) => Body::new(Fed(fed)),
                    None => {
                        b_gate.passed().await;
                        Body::from("new")
                    }
                }
            }
        }
    };
    let (a_engine, a, a_tier) = instance_with_tier(&server.url(), "/k", answer.clone()).await;
    let (_, b, b_tier) = instance_with_tier(&server.url(), "/k", answer.clone()).await;
    let (_, c) = instance_answering(&server.url(), "/k", answer).await;
    let first = tokio::spawn({
        let a = a.clone();
        async move { send(&a, "GET", "/k").await }
    });
    bounded("A's origin call", calls.reached(1)).await;
    let locks = server.cmd(&["KEYS", "*:lock"]);
    assert_eq!(locks.lines().count(), 1, "A's lock: {locks:?}");
    server.cmd(&["DEL", locks.trim()]);
    // A's body makes progress until a move of its lock is refused.
    bounded("A's lock move refused", async {
        while a_engine.stats().l2.locks_lost == 0 {
            feed.send(Bytes::from("old ")).unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let second = tokio::spawn({
        let b = b.clone();
        async move { send(&b, "GET", "/k").await }
    });
    bounded("B's origin call", calls.reached(2)).await;
    let mut second = Some(second);
    if b_stored_first {
        b_gate.open();
        let (_, _, body) = bounded("B's answer", second.take().unwrap()).await.unwrap();
        assert_eq!(body, "new");
        // B's fill in Valkey before A's: A's is the late one.
        bounded("B's writes", b_tier.flush()).await;
    }
    drop(feed);
    let (_, _, body) = bounded("A's answer", first).await.unwrap();
    assert!(
        body.starts_with("old "),
        "A's caller gets its own load's answer"
    );
    if let Some(second) = second {
        // A's fill reached Valkey while B's load was under way.
        bounded("A's writes", a_tier.flush()).await;
        b_gate.open();
        let (_, _, body) = bounded("B's answer", second).await.unwrap();
        assert_eq!(body, "new");
    }
    the_newer_answer_everywhere(&a, &c, &calls).await;
}

/// Instance A's load outlives its lock (its origin silent past the
/// lock's wait); instance B takes the lock as it ends and loads, and
/// outlives its lock too. A's answer comes first and is stored (nothing
/// newer in Valkey, nobody's lock), and instance C reads it there; then
/// B's newer answer replaces it in Valkey, and A's and C's copies of the
/// older one go from their L1. They stayed before: A and C answered the
/// older load's answer for its whole lifetime while Valkey and the rest
/// of the fleet answered B's (a black-box audit's two slow proxies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_earlier_answer_of_two_overlapping_loads_leaves_every_l1() {
    let server = ValkeyServer::start();
    let (calls, old_gate, new_gate) = (Counter::new(), Gate::new(), Gate::new());
    let answer = {
        let (calls, old_gate, new_gate) = (calls.clone(), old_gate.clone(), new_gate.clone());
        move || {
            let (calls, old_gate, new_gate) = (calls.clone(), old_gate.clone(), new_gate.clone());
            async move {
                if calls.bump() == 1 {
                    old_gate.passed().await;
                    return "old";
                }
                new_gate.passed().await;
                "new"
            }
        }
    };
    let ([a, b, c], first) = three_with_a_loading(&server.url(), answer, &calls).await;
    // B waits on A's lock until it ends (`LOCK` after its take), then loads.
    let second = tokio::spawn({
        let b = b.clone();
        async move { send(&b, "GET", "/k").await }
    });
    bounded("B's origin call", calls.reached(2)).await;
    // B's lock ends under its load too (no progress moves it on).
    bounded("B's lock's end", async {
        while !server.cmd(&["KEYS", "*:lock"]).trim().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    old_gate.open();
    let (_, _, body) = bounded("A's answer", first).await.unwrap();
    assert_eq!(body, "old");
    // A's answer is in Valkey (nothing newer was there): C reads it.
    until_answers(&c, "old", "A's answer never reached Valkey").await;
    new_gate.open();
    let (_, _, body) = bounded("B's answer", second).await.unwrap();
    assert_eq!(body, "new");
    // B's answer replaces A's in Valkey, and the copies of A's go (polled:
    // a message from a real server's script).
    for (name, app) in [("A", &a), ("C", &c)] {
        let stale = format!("{name} still answers the older load's answer Valkey no longer holds");
        until_answers(app, "new", &stale).await;
    }
    assert_eq!(calls.get(), 2);
}
