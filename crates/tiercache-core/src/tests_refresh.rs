//! Background refreshes (stale-while-revalidate, XFetch) on the engine:
//! paced, never taken over at their deadline, never waited for.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::tests_freshness::{ANY, engine};
use crate::*;

/// Fresh for a second (no jitter), then standing in for a minute for an
/// origin that fails.
pub(crate) fn fresh_a_second_then_failing_over() -> PolicyBuilder {
    Policy::ttl(Duration::from_secs(1))
        .jitter(0.0)
        .stale_if_error(Duration::from_secs(60))
}

/// Fresh for a second (no jitter, no early refresh), then served stale
/// for a minute while a refresh runs.
pub(crate) fn stale_for_a_minute() -> PolicyBuilder {
    Policy::ttl(Duration::from_secs(1))
        .jitter(0.0)
        .xfetch_beta(0.0)
        .stale_while_revalidate(Duration::from_secs(60))
}

#[tokio::test]
async fn background_refreshes_are_paced_by_max_refreshes() {
    let clock = MockClock::new();
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .max_refreshes(2)
        .build()
        .unwrap();
    let policy = stale_for_a_minute().build().unwrap();
    let keys: Vec<CacheKey> = (0..3).map(|i| CacheKey::new(format!("k{i}"))).collect();
    for key in &keys {
        cache
            .get_or_load(key, &policy, || async {
                Ok::<_, std::convert::Infallible>(Value::from_body("v1"))
            })
            .await
            .unwrap();
    }
    clock.advance(Duration::from_secs(2));
    // Every refresh's origin call waits here until released.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let read = |key: CacheKey| {
        let (cache, policy, gate, started) =
            (cache.clone(), policy.clone(), gate.clone(), started.clone());
        async move {
            cache
                .get_or_load(&key, &policy, move || async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.acquire().await.unwrap();
                    Ok::<_, std::convert::Infallible>(Value::from_body("v2"))
                })
                .await
                .unwrap()
        }
    };
    for key in &keys {
        assert_eq!(read(key.clone()).await.body, "v1", "stale answers at once");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while started.load(Ordering::SeqCst) < 2 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::task::yield_now().await;
    }
    assert_eq!(
        cache.in_flight(),
        2,
        "two refreshes run, the third waits its turn"
    );
    assert_eq!(cache.stats().refreshes_deferred, 1);
    // A hit on a key whose own refresh runs defers nothing: that refresh
    // is the one it would start.
    assert_eq!(read(keys[0].clone()).await.body, "v1");
    assert_eq!(
        cache.stats().refreshes_deferred,
        1,
        "a running refresh was counted as deferred"
    );

    gate.add_permits(10);
    while cache.in_flight() > 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::task::yield_now().await;
    }
    assert_eq!(read(keys[0].clone()).await.body, "v2");
    // The deferred key's next hit starts its refresh, now that a slot is free.
    assert_eq!(read(keys[2].clone()).await.body, "v1");
    while started.load(Ordering::SeqCst) < 3 || cache.in_flight() > 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::task::yield_now().await;
    }
    assert_eq!(read(keys[2].clone()).await.body, "v2");
    assert_eq!(started.load(Ordering::SeqCst), 3);
}

#[test]
fn max_refreshes_of_zero_is_refused_naming_the_field() {
    let err = TieredCache::builder()
        .sweep_interval(None)
        .max_refreshes(0)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max_refreshes"), "{err}");
}

/// Past tokio's semaphore limit the build panicked (a black-box audit of
/// the proxy's `--max-refreshes`): refused, naming the field.
#[test]
fn counts_past_the_semaphore_limit_are_refused_naming_the_field() {
    let past = tokio::sync::Semaphore::MAX_PERMITS + 1;
    let builder = || TieredCache::builder().sweep_interval(None);
    for (field, refused) in [
        ("max_refreshes", builder().max_refreshes(past)),
        ("max_detached_fills", builder().max_detached_fills(past)),
    ] {
        let err = refused.build().unwrap_err();
        assert!(err.to_string().contains(field), "{err}");
    }
}

/// A refresh nobody waits on is not taken over at its deadline: a slow one
/// past its flight's deadline used to be replaced by a second at the next
/// stale hit (and a third at the next deadline...), each an origin call and
/// each holding one of `max_refreshes`. Only a hung one is, four waits
/// later.
#[tokio::test]
async fn a_slow_refresh_is_not_taken_over_at_its_deadline() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = stale_for_a_minute()
        .lock_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    cache.store_now(&key, Fill::new(Value::from_body("v1")), &policy);
    clock.advance(Duration::from_secs(2));
    let Begin::Hit(first) = cache.begin(&key, &policy, ANY) else {
        panic!("a stale entry answers")
    };
    // Held, not run: the refresh's load is as slow as can be.
    let slow = first.refresh.expect("the first stale hit refreshes");
    // A flight's deadline is on the machine's clock (it bounds real waits).
    std::thread::sleep(Duration::from_millis(150));
    let Begin::Hit(second) = cache.begin(&key, &policy, ANY) else {
        panic!("a stale entry answers")
    };
    assert!(
        second.refresh.is_none(),
        "a second refresh took the slow one over"
    );
    // A hung one is replaced, four waits past its deadline: the entry does
    // not stay frozen for the rest of a long window.
    std::thread::sleep(Duration::from_millis(400));
    let Begin::Hit(third) = cache.begin(&key, &policy, ANY) else {
        panic!("a stale entry answers")
    };
    assert!(third.refresh.is_some(), "a hung refresh is never replaced");
    drop(slow);
}

/// `get_or_load_as` answers a stale hit at once: its loader, moved into
/// the background refresh, is not waited for.
#[tokio::test(start_paused = true)]
async fn a_stale_hit_of_get_or_load_as_does_not_wait_for_its_refresh() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("price");
    let policy = stale_for_a_minute().build().unwrap();
    let loaded: u64 = cache
        .get_or_load_as(&key, &policy, || async {
            Ok::<_, std::convert::Infallible>(1)
        })
        .await
        .unwrap();
    assert_eq!(loaded, 1);
    clock.advance(Duration::from_secs(2));
    let hung = || std::future::pending::<Result<u64, std::convert::Infallible>>();
    let answered = tokio::time::timeout(
        Duration::from_secs(5),
        cache.get_or_load_as(&key, &policy, hung),
    )
    .await
    .expect("a stale hit waited for its refresh's loader");
    assert_eq!(answered.unwrap(), 1);
}

/// `v1` under `k`, loaded in 5 s, a second before its 10 s expire, with
/// XFetch at its strongest: each hit calls for an early refresh.
fn near_expiry_under_xfetch() -> (TieredCache, Policy, CacheKey, MockClock) {
    let clock = MockClock::new();
    let cache = engine(&clock, 3);
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .xfetch_beta(Policy::MAX_XFETCH_BETA)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let fill = Fill::new(Value::from_body("v1")).origin_latency(Duration::from_secs(5));
    cache.put(&key, fill, &policy);
    clock.advance(Duration::from_secs(9));
    (cache, policy, key, clock)
}

/// `early_refreshes` counts the refreshes XFetch started: hits on a key
/// whose early refresh already runs start none, and are not counted.
#[tokio::test]
async fn early_refreshes_count_the_refreshes_started() {
    let (cache, policy, key, _clock) = near_expiry_under_xfetch();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    for _ in 0..5 {
        let (gate, started) = (gate.clone(), started.clone());
        let value = cache
            .get_or_load(&key, &policy, move || async move {
                started.fetch_add(1, Ordering::SeqCst);
                let _ = gate.acquire().await.unwrap();
                Ok::<_, std::convert::Infallible>(Value::from_body("v2"))
            })
            .await
            .unwrap();
        assert_eq!(value.body, "v1");
    }
    assert_eq!(cache.in_flight(), 1, "one early refresh runs");
    assert_eq!(cache.stats().early_refreshes, 1, "{:?}", cache.stats());
    gate.add_permits(1);
}

/// An origin that counts its calls and shares a failure (an error page).
fn failing_origin(calls: Arc<AtomicUsize>) -> impl Origin<Output = (), Error = ()> + use<> {
    origin_fn(move |_stale: Option<Entry>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async move {
            Ok(Loaded::Share {
                value: Value::from_body("503"),
                failed: true,
            })
        }
    })
}

/// What a fetch of `key` through [`failing_origin`] is answered with (the
/// cache's copy: the origin's failure is never the answer here).
async fn answered_failing(
    cache: &TieredCache,
    key: &CacheKey,
    policy: &Policy,
    calls: &Arc<AtomicUsize>,
) -> Answer {
    match cache
        .fetch(key, policy, failing_origin(calls.clone()))
        .await
    {
        Ok(Fetched::Entry(answer)) => answer,
        _ => panic!("the stored copy answers"),
    }
}

/// An XFetch refresh that meets the origin failing marks its key, as a
/// stale entry's does: the next hits near expiry start none for a second.
/// Only a stale entry's stand-in or an error marked it: a failure the
/// origin answered started one refresh after another, each hit as the
/// last ended.
#[tokio::test]
async fn a_failed_early_refresh_is_not_started_again_by_the_next_hits() {
    let (cache, policy, key, _clock) = near_expiry_under_xfetch();
    let calls = Arc::new(AtomicUsize::new(0));
    for _ in 0..5 {
        let answer = answered_failing(&cache, &key, &policy, &calls).await;
        assert_eq!(answer.entry.value().body, "v1");
        for _ in 0..1000 {
            if cache.in_flight() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one early refresh");
}

/// Past stale-while-revalidate, inside stale-if-error, a key whose origin
/// failed a moment ago: its stale copy answers without another load until
/// [`RETRY_FAILING_AFTER`](crate::engine::RETRY_FAILING_AFTER) has passed,
/// then the origin is asked again. Each request was a flight of its own
/// that asked it, back to back (one call per flight, however fast it
/// failed).
#[tokio::test]
async fn a_failing_origin_is_asked_once_a_second_while_a_stale_copy_stands_in() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = fresh_a_second_then_failing_over().build().unwrap();
    cache.put(&key, Value::from_body("v1"), &policy);
    clock.advance(Duration::from_secs(2));
    let calls = Arc::new(AtomicUsize::new(0));
    let stale_answer = || async {
        let answer = answered_failing(&cache, &key, &policy, &calls).await;
        assert_eq!(answer.entry.value().body, "v1");
        assert_eq!(answer.served, Served::Stale(StaleReason::OriginError));
    };
    for _ in 0..5 {
        stale_answer().await;
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one call for five requests"
    );
    clock.advance(crate::engine::RETRY_FAILING_AFTER);
    stale_answer().await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "asked again a second later"
    );
    assert_eq!(cache.stats().stale_served, 6);
}
