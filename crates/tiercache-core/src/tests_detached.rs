//! Fills whose caller went away: they run on (the cache gets the answer,
//! and anyone who joined the flight meanwhile gets it too), but only so
//! many at once, so an origin that never answers cannot pile them up.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

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

/// Starts a request on each key whose load never answers, waits until every
/// load has started, then cancels the requests (their clients went away).
async fn abandon_hung_loads(cache: &TieredCache, keys: usize, alive: &Arc<AtomicUsize>) {
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let mut requests = Vec::new();
    for i in 0..keys {
        let (cache, policy, alive) = (cache.clone(), policy.clone(), alive.clone());
        requests.push(tokio::spawn(async move {
            let key = CacheKey::new(format!("hung/{i}"));
            let _ = cache
                .get_or_load(&key, &policy, move || async move {
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

#[tokio::test]
async fn fills_whose_callers_left_run_on_only_up_to_the_cap() {
    let cache = engine(4);
    let alive = Arc::new(AtomicUsize::new(0));
    abandon_hung_loads(&cache, 10, &alive).await;
    assert_eq!(settle(&alive, 4).await, 4, "loads left running");
    assert_eq!(cache.stats().fills_cancelled, 6);
}

#[tokio::test]
async fn a_fill_whose_caller_left_still_fills_the_cache() {
    let cache = engine(4);
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::new("slow");
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let request = {
        let (cache, policy, key) = (cache.clone(), policy.clone(), key.clone());
        let (gate, started) = (gate.clone(), started.clone());
        tokio::spawn(async move {
            cache
                .get_or_load(&key, &policy, move || async move {
                    started.notify_one();
                    gate.notified().await;
                    Ok::<_, ()>(Value::from_body("filled"))
                })
                .await
        })
    };
    started.notified().await;
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    gate.notify_one();
    let value = cache
        .get_or_load(&key, &policy, || async { Err::<Value, _>("not called") })
        .await
        .unwrap();
    assert_eq!(value.body, "filled");
    // Its slot was freed when it ended: four more fit.
    let alive = Arc::new(AtomicUsize::new(0));
    abandon_hung_loads(&cache, 4, &alive).await;
    assert_eq!(settle(&alive, 0).await, 4, "loads left running");
    assert_eq!(cache.stats().fills_cancelled, 0);
}

/// Past the cap, a fill others wait on is not cancelled when its caller
/// leaves: they would each load again from the start (one leading, then,
/// at a soft timeout, the next...). It answers them.
#[tokio::test]
async fn a_fill_others_wait_on_runs_on_past_the_cap_and_answers_them() {
    let cache = engine(1);
    let alive = Arc::new(AtomicUsize::new(0));
    abandon_hung_loads(&cache, 1, &alive).await; // the one slot, taken
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::new("shared");
    let calls = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let load = |body: String| {
        let (calls, gate, cache, policy, key) = (
            calls.clone(),
            gate.clone(),
            cache.clone(),
            policy.clone(),
            key.clone(),
        );
        tokio::spawn(async move {
            cache
                .get_or_load(&key, &policy, move || async move {
                    calls.fetch_add(1, SeqCst);
                    gate.notified().await;
                    Ok::<_, ()>(Value::from_body(body))
                })
                .await
        })
    };
    let leader = load("the leader's".to_owned());
    while calls.load(SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let follower = load("the follower's own".to_owned());
    while cache.stats().coalesced == 0 {
        tokio::task::yield_now().await;
    }
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    gate.notify_one();
    let answer = follower.await.unwrap().unwrap();
    assert_eq!(answer.body, "the leader's");
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(cache.stats().fills_cancelled, 0);
}
