//! Fills whose caller went away: they run on (the cache gets the answer,
//! and anyone who joined the flight meanwhile gets it too), but only so
//! many at once, so an origin that never answers cannot pile them up.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::*;

/// Counts the loads alive (started, not yet dropped).
struct Alive(Arc<AtomicUsize>);

impl Alive {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, SeqCst);
        Self(count.clone())
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

fn engine(max_detached: usize) -> TieredCache {
    TieredCache::builder()
        .sweep_interval(None)
        .max_detached_fills(max_detached)
        .build()
        .unwrap()
}

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(60)).build().unwrap()
}

/// Starts a request on each key whose load never answers, waits until every
/// load has started, then cancels the requests (their clients went away).
/// Returns the count of those loads still alive.
async fn abandon_hung_loads(cache: &TieredCache, keys: usize) -> Arc<AtomicUsize> {
    let alive = Arc::new(AtomicUsize::new(0));
    let mut requests = Vec::new();
    for i in 0..keys {
        let (cache, alive) = (cache.clone(), alive.clone());
        requests.push(tokio::spawn(async move {
            let key = CacheKey::new(format!("hung/{i}"));
            let _ = cache
                .get_or_load(&key, &policy(), move || async move {
                    let _alive = Alive::new(&alive);
                    std::future::pending::<Result<Value, ()>>().await
                })
                .await;
        }));
    }
    while alive.load(SeqCst) < keys {
        tokio::task::yield_now().await;
    }
    for request in &requests {
        request.abort();
    }
    for request in requests {
        assert!(request.await.unwrap_err().is_cancelled());
    }
    alive
}

/// Yields until `alive` is down to `want` (the runtime drops cancelled tasks
/// as it polls them), or gives up after many rounds.
async fn settle(alive: &Arc<AtomicUsize>, want: usize) -> usize {
    for _ in 0..10_000 {
        if alive.load(SeqCst) <= want {
            break;
        }
        tokio::task::yield_now().await;
    }
    alive.load(SeqCst)
}

/// A request on `key` whose load counts itself in `calls`, then answers
/// `body` once `gate` opens.
fn gated_request(
    cache: &TieredCache,
    key: &str,
    calls: &Arc<AtomicUsize>,
    gate: &Arc<Notify>,
    body: &str,
) -> JoinHandle<Result<Value, LoadError<()>>> {
    let (cache, key, body) = (cache.clone(), CacheKey::new(key), body.to_owned());
    let (calls, gate) = (calls.clone(), gate.clone());
    tokio::spawn(async move {
        cache
            .get_or_load(&key, &policy(), move || async move {
                calls.fetch_add(1, SeqCst);
                gate.notified().await;
                Ok(Value::from_body(body))
            })
            .await
    })
}

/// Yields until `done` holds.
async fn until(done: impl Fn() -> bool) {
    while !done() {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn fills_whose_callers_left_run_on_only_up_to_the_cap() {
    let cache = engine(4);
    let alive = abandon_hung_loads(&cache, 10).await;
    assert_eq!(settle(&alive, 4).await, 4, "loads left running");
    assert_eq!(cache.stats().fills_cancelled, 6);
}

#[tokio::test]
async fn a_fill_whose_caller_left_still_fills_the_cache() {
    let cache = engine(4);
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
    let request = gated_request(&cache, "slow", &calls, &gate, "filled");
    until(|| calls.load(SeqCst) == 1).await;
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    gate.notify_one();
    let value = cache
        .get_or_load(&CacheKey::new("slow"), &policy(), || async {
            Err::<Value, _>("not called")
        })
        .await
        .unwrap();
    assert_eq!(value.body, "filled");
    // Its slot was freed when it ended: four more fit.
    let alive = abandon_hung_loads(&cache, 4).await;
    assert_eq!(settle(&alive, 0).await, 4, "loads left running");
    assert_eq!(cache.stats().fills_cancelled, 0);
}

/// Past the cap, a fill others wait on is not cancelled when its caller
/// leaves: they would each load again from the start (one leading, then,
/// at a soft timeout, the next...). It answers them.
#[tokio::test]
async fn a_fill_others_wait_on_runs_on_past_the_cap_and_answers_them() {
    let cache = engine(1);
    abandon_hung_loads(&cache, 1).await; // the one slot, taken
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
    let leader = gated_request(&cache, "shared", &calls, &gate, "the leader's");
    until(|| calls.load(SeqCst) == 1).await;
    let follower = gated_request(&cache, "shared", &calls, &gate, "the follower's own");
    until(|| cache.stats().coalesced == 1).await;
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    gate.notify_one();
    let answer = follower.await.unwrap().unwrap();
    assert_eq!(answer.body, "the leader's");
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(cache.stats().fills_cancelled, 0);
}

/// A shared tier with a fleet lock on the key `locked` alone, whose reads
/// of it never answer once this instance holds it; it records each
/// release. Other keys have no lock and nothing stored.
#[derive(Debug, Default)]
struct LockingTier {
    locked: std::sync::atomic::AtomicBool,
    reading_under_lock: Notify,
    released: std::sync::Mutex<Vec<Unlocked>>,
}

impl Tier for LockingTier {
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async move {
            if *key == CacheKey::new("locked") && self.locked.load(SeqCst) {
                self.reading_under_lock.notify_one();
                std::future::pending::<()>().await;
            }
            Ok(None)
        })
    }

    fn put(&self, _: &CacheKey, _: &Entry, _: Duration, _: &[bytes::Bytes]) {}

    fn invalidate<'a>(&'a self, _: Invalidation) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async { Ok(()) })
    }

    fn try_lock<'a>(
        &'a self,
        key: &'a CacheKey,
        _: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        if *key != CacheKey::new("locked") {
            return Box::pin(async { Ok(LockAttempt::Unsupported) });
        }
        self.locked.store(true, SeqCst);
        let token = LockToken(bytes::Bytes::from_static(b"this instance"));
        Box::pin(async { Ok(LockAttempt::Acquired(token)) })
    }

    fn unlock(&self, _: &CacheKey, _: &LockToken, how: Unlocked) {
        self.released.lock().unwrap().push(how);
    }
}

#[tokio::test]
async fn a_fill_cancelled_while_reading_l2_under_the_fleet_lock_lets_the_lock_go() {
    let tier = Arc::new(LockingTier::default());
    let cache = TieredCache::builder()
        .sweep_interval(None)
        .max_detached_fills(1)
        .l2_shared(tier.clone())
        .build()
        .unwrap();
    // The one fill allowed to run on after its caller left is taken: the
    // next such fill is cancelled as soon as its caller goes.
    let hung = abandon_hung_loads(&cache, 1).await;
    assert_eq!(settle(&hung, 1).await, 1);
    let loads = Arc::new(AtomicUsize::new(0));
    let request = {
        let (cache, loads) = (cache.clone(), loads.clone());
        tokio::spawn(async move {
            let _ = cache
                .get_or_load(&CacheKey::new("locked"), &policy(), move || async move {
                    loads.fetch_add(1, SeqCst);
                    Ok::<_, ()>(Value::from_body("v"))
                })
                .await;
        })
    };
    // The lock is taken, and L2 is read once more under it: the client leaves.
    tier.reading_under_lock.notified().await;
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    // Released at once, as gone (the other instances read L2, then take
    // the lock in turn), not left to its expiry.
    for _ in 0..10_000 {
        if !tier.released.lock().unwrap().is_empty() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        matches!(tier.released.lock().unwrap()[..], [Unlocked::Gone]),
        "the lock was left to its expiry"
    );
    assert_eq!(loads.load(SeqCst), 0, "the origin was never reached");
}
