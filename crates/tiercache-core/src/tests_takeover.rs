//! Loads slower than the flight's wait: one waiting request takes the
//! flight over at each deadline. When the slow load answers at last, its
//! answer reaches the requests waiting on the flight that took it over.

use std::time::Duration;

use tokio::time::Instant;

use crate::*;

const WAIT: Duration = Duration::from_secs(5);
const SLOW: Duration = Duration::from_secs(8);

/// An engine, and a minute's policy whose flights wait `wait`.
fn cache_waiting(wait: Duration) -> (TieredCache, Policy) {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(wait)
        .build()
        .unwrap();
    (cache, policy)
}

/// An origin that answers `loaded()` after [`SLOW`].
fn slow_origin(
    loaded: fn() -> Loaded<&'static str>,
) -> impl Origin<Output = &'static str, Error = ()> + use<> {
    origin_fn(move |_stale: Option<Entry>| async move {
        tokio::time::sleep(SLOW).await;
        Ok(loaded())
    })
}

/// Twenty requests at once on one key whose origin answers after
/// [`SLOW`] (past the flight's [`WAIT`]) with `loaded()`: when each was
/// answered, from the start.
async fn twenty_requests(loaded: fn() -> Loaded<&'static str>) -> Vec<Duration> {
    let (cache, policy) = cache_waiting(WAIT);
    let started = Instant::now();
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let (cache, policy) = (cache.clone(), policy.clone());
            let origin = slow_origin(loaded);
            tokio::spawn(async move {
                let fetched = cache.fetch(&CacheKey::new("k"), &policy, origin).await;
                assert!(fetched.is_ok());
                started.elapsed()
            })
        })
        .collect();
    let mut answered = Vec::new();
    for request in requests {
        answered.push(request.await.unwrap());
    }
    answered.sort();
    answered
}

/// A request for the key `k` through `origin`, in a task of its own,
/// answered without error.
fn fetch_k<O: Origin>(
    cache: &TieredCache,
    policy: &Policy,
    origin: O,
) -> tokio::task::JoinHandle<()> {
    let (cache, policy) = (cache.clone(), policy.clone());
    tokio::spawn(async move {
        let fetched = cache.fetch(&CacheKey::new("k"), &policy, origin).await;
        assert!(fetched.is_ok());
    })
}

/// An answer that may not be shared (a long poll's, say): the requests
/// waiting are released when it comes, to load alone at once. They were
/// not: the ones waiting on the flight that took the slow one over waited
/// on its leader, one more taking it over at each deadline, so twenty
/// requests of an 8 s origin were answered one every 5 s, the last after
/// 103 s.
#[tokio::test(start_paused = true)]
async fn an_answer_that_may_not_be_shared_releases_every_waiting_request() {
    let passed = || Loaded::Pass {
        output: "mine",
        failed: false,
        uncacheable: false,
    };
    let answered = twenty_requests(passed).await;
    let last = *answered.last().unwrap();
    assert!(
        last <= WAIT + SLOW * 2,
        "the last request waited {last:?}: {answered:?}"
    );
}

/// What an origin answers, or fails with.
type Load = fn() -> Result<Loaded<&'static str>, ()>;

/// An origin that counts its calls and answers `loaded()` after `took`.
fn counted_origin(
    loaded: Load,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    took: Duration,
) -> impl Origin<Output = &'static str, Error = ()> + use<> {
    origin_fn(move |_stale: Option<Entry>| {
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            tokio::time::sleep(took).await;
            loaded()
        }
    })
}

/// A slow load that fails, or answers what is not stored: its answer
/// reaches the requests waiting on the flight that took it over, as its
/// own followers get it. It did not (only a stored answer or a release
/// did): each waiting request waited on the next leader, one more taking
/// the flight over at each deadline (a black-box audit: six clients of a
/// 503 after 6 s under a 5 s wait made six origin calls, answered 6 to
/// 31 s; an origin that never answered, one call per client).
#[tokio::test(start_paused = true)]
async fn a_slow_failure_reaches_the_requests_waiting_on_the_flight_that_took_it_over() {
    let cases: [(&str, Load); 4] = [
        ("a failure shared", || {
            Ok(Loaded::Share {
                value: Value::from_body("503"),
                failed: true,
            })
        }),
        ("an answer not stored", || {
            Ok(Loaded::Share {
                value: Value::from_body("200"),
                failed: false,
            })
        }),
        ("a failure", || Ok(Loaded::Failed { output: "502" })),
        ("an error", || Err(())),
    ];
    for (case, loaded) in cases {
        let (cache, policy) = cache_waiting(WAIT);
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = Instant::now();
        let requests: Vec<_> = (0..20)
            .map(|_| {
                let (cache, policy, calls) = (cache.clone(), policy.clone(), calls.clone());
                let origin = counted_origin(loaded, calls, SLOW);
                tokio::spawn(async move {
                    let _ = cache.fetch(&CacheKey::new("k"), &policy, origin).await;
                    started.elapsed()
                })
            })
            .collect();
        let mut last = Duration::ZERO;
        for request in requests {
            last = last.max(request.await.unwrap());
        }
        // The first load, and the one that took it over at its deadline
        // (its own request waits on it): 1 + SLOW / WAIT.
        let calls = calls.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(calls, 2, "{case}: origin calls");
        assert!(
            last <= WAIT + SLOW,
            "{case}: the last request waited {last:?}"
        );
    }
}

/// An origin that answers a stored value after `took`, and records what
/// the engine tells it of its request's waits.
struct Watched {
    took: Duration,
    events: std::sync::Arc<std::sync::Mutex<Vec<Event>>>,
}

impl Select for Watched {
    fn observe(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }
}

impl Origin for Watched {
    type Output = ();
    type Error = ();

    async fn load(self, _stale: Option<Entry>) -> Result<Loaded<()>, ()> {
        tokio::time::sleep(self.took).await;
        Ok(Loaded::Store(Fill::new(Value::from_body("stored"))))
    }
}

/// Five requests at once, an origin of 1 s, a flight's wait of 300 ms:
/// each of the four that waited is counted once as coalesced, once as a
/// lock timeout, and gives one wait sample, however many flights it
/// followed (one taken over at each deadline). They were counted at
/// every deadline each reached: 9 lock timeouts, 10 wait samples.
#[tokio::test(start_paused = true)]
async fn each_request_that_waited_is_counted_once() {
    let (cache, policy) = cache_waiting(Duration::from_millis(300));
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let origin = Watched {
                took: Duration::from_secs(1),
                events: events.clone(),
            };
            fetch_k(&cache, &policy, origin)
        })
        .collect();
    for request in requests {
        request.await.unwrap();
    }
    let stats = cache.stats();
    let events = events.lock().unwrap();
    let waits = events
        .iter()
        .filter(|e| matches!(e, Event::LockWait(_)))
        .count();
    let timeouts = events
        .iter()
        .filter(|e| matches!(e, Event::LockTimeout))
        .count();
    assert_eq!(
        (stats.coalesced, stats.lock_timeouts, waits, timeouts),
        (4, 4, 4, 4),
        "{events:?}"
    );
}

/// An origin that answers after `ticks` seconds, telling the engine of
/// its progress each second while `alive` (a body that keeps coming),
/// and counts its calls.
pub(crate) struct Ticking {
    pub(crate) ticks: u32,
    pub(crate) alive: bool,
    pub(crate) calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Select for Ticking {}

impl Origin for Ticking {
    type Output = ();
    type Error = ();

    async fn load(self, stale: Option<Entry>) -> Result<Loaded<()>, ()> {
        self.load_with(stale, Progress::none()).await
    }

    async fn load_with(self, _stale: Option<Entry>, progress: Progress) -> Result<Loaded<()>, ()> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for _ in 0..self.ticks {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if self.alive {
                progress.made();
            }
        }
        Ok(Loaded::Store(Fill::new(Value::from_body("stored"))))
    }
}

/// Twenty requests at once on a key whose origin takes `ticks` seconds
/// (past the flight's 5 s wait): the origin calls they make, and the lock
/// timeouts.
async fn twenty_on_a_ticking_origin(ticks: u32, alive: bool) -> (usize, u64) {
    let (cache, policy) = cache_waiting(WAIT);
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let origin = Ticking {
                ticks,
                alive,
                calls: calls.clone(),
            };
            fetch_k(&cache, &policy, origin)
        })
        .collect();
    for request in requests {
        request.await.unwrap();
    }
    let calls = calls.load(std::sync::atomic::Ordering::Relaxed);
    (calls, cache.stats().lock_timeouts)
}

/// A load that keeps telling of its progress (an answer whose body keeps
/// coming) is waited for past the flight's wait: one origin call, no lock
/// timeout. Without progress the same origin is taken over at the deadline,
/// as a stalled one must be; so is one still going at four waits (the
/// waiters get nothing until it ends). Each waiting request took the
/// flight over at each deadline, calling the origin again (1 + T /
/// lock_timeout calls for an answer taking T).
#[tokio::test(start_paused = true)]
async fn a_load_that_makes_progress_is_waited_for_past_the_deadline() {
    assert_eq!(twenty_on_a_ticking_origin(8, true).await, (1, 0));
    let (calls, timeouts) = twenty_on_a_ticking_origin(8, false).await;
    assert!(
        calls >= 2 && timeouts > 0,
        "{calls} calls, {timeouts} timeouts"
    );
    let (calls, timeouts) = twenty_on_a_ticking_origin(30, true).await;
    assert!(
        calls >= 2 && timeouts > 0,
        "taken over at four waits: {calls} calls, {timeouts} timeouts"
    );
}

/// A request that leaves while it waits on another's load (its future
/// dropped: a client gone) gives its wait sample: counted as coalesced,
/// it gave none, and the wait histogram's count fell below `coalesced`.
#[tokio::test(start_paused = true)]
async fn a_request_gone_mid_wait_gives_its_wait_sample() {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let request = || {
        let origin = Watched {
            took: Duration::from_secs(1),
            events: events.clone(),
        };
        fetch_k(&cache, &policy, origin)
    };
    let leader = request();
    while cache.in_flight() == 0 {
        tokio::task::yield_now().await;
    }
    let follower = request();
    while cache.stats().coalesced == 0 {
        tokio::task::yield_now().await;
    }
    follower.abort();
    assert!(follower.await.unwrap_err().is_cancelled());
    leader.await.unwrap();
    let waits = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::LockWait(_)))
        .count();
    assert_eq!((cache.stats().coalesced, waits), (1, 1));
}

/// An origin telling of its progress at these times from its call, which
/// leaves its `Progress` behind.
struct Beating(Vec<u64>, std::sync::Arc<std::sync::Mutex<Option<Progress>>>);

impl Select for Beating {}

impl Origin for Beating {
    type Output = ();
    type Error = ();

    async fn load(self, stale: Option<Entry>) -> Result<Loaded<()>, ()> {
        self.load_with(stale, Progress::none()).await
    }

    async fn load_with(self, _stale: Option<Entry>, progress: Progress) -> Result<Loaded<()>, ()> {
        let start = tokio::time::Instant::now();
        for at in self.0 {
            tokio::time::sleep_until(start + Duration::from_millis(at)).await;
            progress.made();
        }
        *self.1.lock().unwrap() = Some(progress);
        Ok(Loaded::Store(Fill::new(Value::from_body("stored"))))
    }
}

/// A load's progress moves the fleet lock it holds to a wait from then
/// (a quarter wait past its last end at least, so not at each frame), up
/// to four waits from its take; after the load, nothing moves it. The
/// lock ended a wait after its take before, whatever the load did, and
/// other instances took it over and called the origin.
#[tokio::test(start_paused = true)]
async fn a_loads_progress_moves_its_fleet_lock_on() {
    let tier = std::sync::Arc::new(crate::tests_busy::RecordingLocks::default());
    let cache = TieredCache::builder()
        .sweep_interval(None)
        .l2_shared(tier.clone())
        .build()
        .unwrap();
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let left: std::sync::Arc<std::sync::Mutex<Option<Progress>>> = Default::default();
    let beats = Beating(vec![100, 300, 600, 1000, 3500, 3900], left.clone());
    let fetched = cache.fetch(&CacheKey::new("k"), &policy, beats).await;
    assert!(fetched.is_ok());
    // 100 ms: 150 ms short of a quarter past the end; 3.5 s: to four
    // waits from the take; 3.9 s: nothing left to move.
    let ms = |ms| Duration::from_millis(ms);
    assert_eq!(
        *tier.moved.lock().unwrap(),
        [ms(1000), ms(1000), ms(1000), ms(500)]
    );
    let beats = Beating(vec![], left.clone());
    assert!(
        cache
            .fetch(&CacheKey::new("k2"), &policy, beats)
            .await
            .is_ok()
    );
    tokio::time::advance(ms(500)).await;
    left.lock().unwrap().take().unwrap().made();
    assert_eq!(tier.moved.lock().unwrap().len(), 4, "a released lock moved");
}

/// A slow load that answers after the flight that took it over stored a
/// newer answer: the slow one still answers its own request, but the
/// newer answer stays stored. It did not: the older answer replaced it
/// (a black-box audit: a `500` that took 5 s replaced the `200` a newer
/// flight stored at 2.7 s, then answered as a hit; and the reverse).
#[tokio::test(start_paused = true)]
async fn a_slow_answer_does_not_replace_the_newer_one_stored_meanwhile() {
    let (cache, policy) = cache_waiting(WAIT);
    let key = CacheKey::new("k");
    fn answer(body: &'static str, after: Duration) -> impl Origin<Output = (), Error = ()> {
        origin_fn(move |_stale: Option<Entry>| async move {
            tokio::time::sleep(after).await;
            Ok(Loaded::Store(Fill::new(Value::from_body(body))))
        })
    }
    let slow = {
        let (cache, policy, key) = (cache.clone(), policy.clone(), key.clone());
        tokio::spawn(async move { cache.fetch(&key, &policy, answer("older", SLOW)).await })
    };
    tokio::task::yield_now().await;
    // Waits on the slow flight, takes it over at its deadline, stores.
    let newer = cache.fetch(&key, &policy, answer("newer", Duration::ZERO));
    let Ok(Fetched::Entry(newer)) = newer.await else {
        panic!("the request that took the flight over was not answered");
    };
    assert_eq!(newer.entry.value().body, "newer");
    let Ok(Fetched::Entry(older)) = slow.await.unwrap() else {
        panic!("the slow request was not answered");
    };
    assert_eq!(older.entry.value().body, "older", "its own load's answer");
    let stored = cache.get(&key).await.expect("an entry stored");
    assert_eq!(stored.body, "newer", "the newer answer stays stored");
}

/// A slow load whose failure may not be shared, its stale copy standing
/// in for it, ends while the requests that came after an invalidation
/// (no copy of their own) wait on a newer flight: they keep waiting on
/// it, rather than each loading alone as its own followers without a
/// copy would.
#[tokio::test(start_paused = true)]
async fn a_slow_stand_in_without_the_failure_is_not_handed_on() {
    let clock = MockClock::new();
    let cache = crate::tests_freshness::engine(&clock, 1);
    let policy = Policy::ttl(Duration::from_secs(1))
        .jitter(0.0)
        .stale_if_error(Duration::from_secs(60))
        .lock_timeout(WAIT)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    cache.put(&key, Value::from_body("stale"), &policy);
    clock.advance(Duration::from_secs(2));
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let private_failure: Load = || {
        Ok(Loaded::Pass {
            output: "mine",
            failed: true,
            uncacheable: false,
        })
    };
    let first = fetch_k(
        &cache,
        &policy,
        counted_origin(private_failure, calls.clone(), SLOW),
    );
    tokio::task::yield_now().await;
    let _ = cache.invalidate(&key).await;
    // Their load answers within the flight's wait: the slow one ends while
    // they wait on the one that took it over.
    let stored: Load = || Ok(Loaded::Store(Fill::new(Value::from_body("new"))));
    let quick = WAIT - Duration::from_secs(1);
    let after: Vec<_> = (0..5)
        .map(|_| {
            let (cache, policy, key) = (cache.clone(), policy.clone(), key.clone());
            let origin = counted_origin(stored, calls.clone(), quick);
            tokio::spawn(async move { cache.fetch(&key, &policy, origin).await })
        })
        .collect();
    first.await.unwrap();
    for request in after {
        let Ok(Fetched::Entry(answer)) = request.await.unwrap() else {
            panic!("a request after the invalidation was not answered");
        };
        assert_eq!(answer.entry.value().body, "new");
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
}
