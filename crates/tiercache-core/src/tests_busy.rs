//! A load whose answer the caller had no room to keep ([`Loaded::Busy`]):
//! a refusal of the moment, not of the resource. The key is not marked,
//! a refreshed entry stays, and the requests waiting on the load try again
//! (one of them loads) instead of each calling the origin.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::*;

/// What each test's origin answers: `busy` for its first call, then a fill.
fn first_busy_then_stored(
    calls: &Arc<AtomicUsize>,
    gate: &Arc<Semaphore>,
) -> impl Origin<Output = &'static str, Error = ()> + use<> {
    busy_then_stored(1, calls, gate)
}

/// An origin whose first `busy` calls have no room to keep their answers,
/// and whose later ones store; each call waits for a permit of `gate`.
fn busy_then_stored(
    busy: usize,
    calls: &Arc<AtomicUsize>,
    gate: &Arc<Semaphore>,
) -> impl Origin<Output = &'static str, Error = ()> + use<> {
    let (calls, gate) = (calls.clone(), gate.clone());
    origin_fn(move |_stale: Option<Entry>| async move {
        let call = calls.fetch_add(1, SeqCst);
        gate.acquire().await.unwrap().forget();
        Ok(if call < busy {
            Loaded::Busy {
                output: "streamed",
                failed: false,
            }
        } else {
            Loaded::Store(Fill::new(Value::from_body("stored")))
        })
    })
}

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(60)).build().unwrap()
}

/// Yields until `done` holds, or fails after many rounds.
pub(crate) async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..100_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never: {what}");
}

fn body_of(fetched: Fetched<&'static str>) -> String {
    match fetched {
        Fetched::Entry(answer) => String::from_utf8_lossy(&answer.entry.value().body).into(),
        Fetched::Passed { output, .. } => output.to_owned(),
    }
}

/// Five requests on one key whose first `busy` loads have no room to keep
/// their answers: each request's body, sorted, and the origin's calls.
async fn five_requests_after(busy: usize) -> (Vec<String>, usize) {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Semaphore::new(0)));
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let (cache, origin) = (cache.clone(), busy_then_stored(busy, &calls, &gate));
            tokio::spawn(async move {
                let fetched = cache.fetch(&CacheKey::new("k"), &policy(), origin).await;
                body_of(fetched.unwrap())
            })
        })
        .collect();
    until("four requests wait on the first", || {
        cache.stats().coalesced == 4
    })
    .await;
    gate.add_permits(100);
    let mut bodies = Vec::new();
    for request in requests {
        bodies.push(request.await.unwrap());
    }
    bodies.sort();
    (bodies, calls.load(SeqCst))
}

#[tokio::test]
async fn the_requests_waiting_on_a_busy_load_try_again_and_one_loads() {
    let (bodies, calls) = five_requests_after(1).await;
    assert_eq!(bodies, ["stored", "stored", "stored", "stored", "streamed"]);
    assert_eq!(
        calls, 2,
        "the followers of a busy load each called the origin"
    );
}

/// Room lacking for longer than one load (the pool full, the place outside
/// it taken): each busy load answers its own request, and the others keep
/// waiting their turn, one load at a time, within the flight's wait.
#[tokio::test]
async fn busy_loads_in_a_row_still_call_the_origin_one_at_a_time() {
    let (bodies, calls) = five_requests_after(2).await;
    assert_eq!(
        bodies,
        ["stored", "stored", "stored", "streamed", "streamed"]
    );
    assert_eq!(
        calls, 3,
        "after a second busy load each follower loaded alone"
    );
}

#[tokio::test]
async fn a_busy_load_does_not_mark_the_key_uncacheable() {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let key = CacheKey::new("k");
    for _ in 0..2 {
        let origin = origin_fn(|_stale: Option<Entry>| async {
            Ok::<_, ()>(Loaded::Busy {
                output: "streamed",
                failed: false,
            })
        });
        match cache.fetch(&key, &policy(), origin).await.unwrap() {
            Fetched::Passed { hit_for_miss, .. } => {
                assert!(!hit_for_miss, "the key was marked uncacheable");
            }
            Fetched::Entry(_) => panic!("a busy answer was stored"),
        }
    }
}

#[tokio::test]
async fn a_busy_refresh_leaves_the_entry_it_refreshes() {
    let clock = MockClock::new();
    let cache = crate::tests_freshness::engine(&clock, 1);
    let policy = crate::tests_refresh::stale_for_a_minute().build().unwrap();
    let key = CacheKey::new("k");
    cache.put(&key, Value::from_body("v1"), &policy);
    clock.advance(Duration::from_secs(2));
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Semaphore::new(100)));
    let fetched = cache
        .fetch(&key, &policy, first_busy_then_stored(&calls, &gate))
        .await
        .unwrap();
    assert_eq!(body_of(fetched), "v1", "stale, while the refresh runs");
    until("the refresh ended", || {
        calls.load(SeqCst) == 1 && cache.in_flight() == 0
    })
    .await;
    // Still there, stale: the next request answers with it and refreshes
    // again. A refresh whose answer may not be stored (`Pass`) drops it.
    let fetched = cache
        .fetch(&key, &policy, first_busy_then_stored(&calls, &gate))
        .await
        .unwrap();
    match &fetched {
        Fetched::Entry(answer) => {
            assert_eq!(answer.served, Served::Stale(StaleReason::Revalidating));
        }
        Fetched::Passed { .. } => panic!("the busy refresh dropped the entry"),
    }
    assert_eq!(body_of(fetched), "v1");
}

/// A shared tier whose fleet lock every key takes, and which records each
/// release and each move of a lock's end, and counts how each fill was
/// written (as an owner's, or as a late one); it stores nothing. It tells
/// each move landed, or (`silent`) never answers it.
#[derive(Debug, Default)]
pub(crate) struct RecordingLocks {
    pub(crate) released: std::sync::Mutex<Vec<Unlocked>>,
    pub(crate) moved: std::sync::Mutex<Vec<Duration>>,
    silent: bool,
    plain: AtomicUsize,
    late: AtomicUsize,
}

impl Tier for RecordingLocks {
    fn get<'a>(&'a self, _: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async { Ok(None) })
    }

    fn put(&self, _: &CacheKey, _: &Entry, _: Duration, _: &[bytes::Bytes]) {
        self.plain.fetch_add(1, SeqCst);
    }

    fn put_unless_newer(
        &self,
        _: &CacheKey,
        _: &Entry,
        _: Duration,
        _: &[bytes::Bytes],
        _: &LateFill,
    ) {
        self.late.fetch_add(1, SeqCst);
    }

    fn invalidate<'a>(&'a self, _: Invalidation) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async { Ok(()) })
    }

    fn try_lock<'a>(
        &'a self,
        _: &'a CacheKey,
        _: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        let token = LockToken(bytes::Bytes::from_static(b"this instance"));
        Box::pin(async { Ok(LockAttempt::Acquired(token)) })
    }

    fn unlock(&self, _: &CacheKey, _: &LockToken, how: Unlocked) {
        self.released.lock().unwrap().push(how);
    }

    fn extend_lock(&self, _: &CacheKey, _: &LockToken, ttl: Duration, lapse: LockLapse) {
        self.moved.lock().unwrap().push(ttl);
        if !self.silent {
            lapse.landed();
        }
    }
}

#[tokio::test]
async fn a_busy_load_lets_the_fleet_lock_go_as_gone_not_passed() {
    let tier = Arc::new(RecordingLocks::default());
    let cache = TieredCache::builder()
        .sweep_interval(None)
        .l2_shared(tier.clone())
        .build()
        .unwrap();
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Semaphore::new(100)));
    let origin = first_busy_then_stored(&calls, &gate);
    let fetched = cache.fetch(&CacheKey::new("k"), &policy(), origin).await;
    assert_eq!(body_of(fetched.unwrap()), "streamed");
    // Gone: the other instances read L2, then take the lock in turn;
    // passed would send each of them to the origin.
    assert!(
        matches!(tier.released.lock().unwrap()[..], [Unlocked::Gone]),
        "released as {:?}",
        tier.released.lock().unwrap()
    );
}

/// A load whose progress moved its fleet lock on ends before the move is
/// answered: the lock may have ended under it (the move may be refused),
/// so its fill is written as a late one; with the move answered, as an
/// owner's. It was an owner's either way (a review found it: a refusal
/// answered after the fill was missed).
#[tokio::test(start_paused = true)]
async fn a_fill_whose_lock_move_is_not_answered_yet_is_a_late_one() {
    for answer in [true, false] {
        let tier = Arc::new(RecordingLocks {
            silent: !answer,
            ..Default::default()
        });
        let cache = TieredCache::builder()
            .sweep_interval(None)
            .l2_shared(tier.clone())
            .build()
            .unwrap();
        // A body that comes over three seconds, a frame a second.
        let streaming = crate::tests_takeover::Ticking {
            ticks: 3,
            alive: true,
            calls: Default::default(),
        };
        let fetched = cache.fetch(&CacheKey::new("k"), &policy(), streaming).await;
        assert!(fetched.is_ok());
        assert!(!tier.moved.lock().unwrap().is_empty(), "no move was sent");
        let written = (tier.plain.load(SeqCst), tier.late.load(SeqCst));
        let expected = if answer { (1, 0) } else { (0, 1) };
        assert_eq!(written, expected, "(plain, late), moves answered: {answer}");
    }
}
