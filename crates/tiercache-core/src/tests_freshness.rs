//! Freshness layers on the engine, with the mock clock and seeded randomness.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::engine::read::Lookup;
use crate::*;

/// Accepts every entry.
pub(crate) struct Any;
impl Select for Any {}
pub(crate) const ANY: &Any = &Any;

/// Refuses every entry.
struct Refuse;
impl Select for Refuse {
    fn accepts(&self, _: &Entry) -> bool {
        false
    }
}
#[allow(dead_code)]
const REFUSE: &Refuse = &Refuse;

/// An engine on `clock` without a sweeper, its randomness seeded.
pub(crate) fn engine(clock: &MockClock, seed: u64) -> TieredCache {
    TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .rng_seed(seed)
        .build()
        .unwrap()
}

/// What a lookup of `key` finds now, in a word.
pub(crate) fn state(cache: &TieredCache, key: &CacheKey, policy: &Policy) -> &'static str {
    match cache.lookup_at(key, cache.now(), policy, ANY) {
        Lookup::Fresh { refresh: false, .. } => "fresh",
        Lookup::Fresh { refresh: true, .. } => "fresh+xfetch",
        Lookup::Stale { .. } => "stale",
        Lookup::Miss { fallback: Some(_) } => "stale-if-error",
        Lookup::Miss { fallback: None } => "miss",
        Lookup::Revalidate { .. } => "revalidate",
    }
}

#[tokio::test]
async fn fresh_then_stale_then_error_window_then_dead() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .xfetch_beta(0.0)
        .stale_while_revalidate(Duration::from_secs(5))
        .stale_if_error(Duration::from_secs(20))
        .build()
        .unwrap();
    cache.store_now(&key, Fill::new(Value::from_body("v")), &policy);
    let steps = [
        (0, "fresh"),
        (9, "fresh"),
        (1, "stale"),
        (4, "stale"),
        (1, "stale-if-error"),
        (14, "stale-if-error"),
        (1, "miss"),
    ];
    for (advance, expected) in steps {
        clock.advance(Duration::from_secs(advance));
        assert_eq!(state(&cache, &key, &policy), expected, "after +{advance} s");
    }
}

#[tokio::test]
async fn the_origin_can_forbid_stale_answers() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .stale_while_revalidate(Duration::from_secs(5))
        .stale_if_error(Duration::from_secs(20))
        .build()
        .unwrap();
    cache.store_now(
        &key,
        Fill::new(Value::from_body("v")).no_stale(true),
        &policy,
    );
    clock.advance(Duration::from_secs(10));
    assert_eq!(state(&cache, &key, &policy), "miss");
}

#[tokio::test]
async fn origin_windows_override_the_policy() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = Policy::ttl(Duration::from_secs(60))
        .jitter(0.0)
        .xfetch_beta(0.0)
        .build()
        .unwrap();
    let fill = Fill::new(Value::from_body("v"))
        .lifetime(Lifetime::Declared(Duration::from_secs(1)))
        .stale_windows(Some(Duration::from_secs(30)), None);
    cache.store_now(&key, fill, &policy);
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        state(&cache, &key, &policy),
        "stale",
        "max-age=1 beat the 60 s ttl"
    );
    clock.advance(Duration::from_secs(30));
    assert_eq!(state(&cache, &key, &policy), "miss");
}

#[tokio::test]
async fn negative_entries_live_for_the_negative_ttl() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("missing");
    let policy = Policy::ttl(Duration::from_secs(300))
        .jitter(0.0)
        .negative_ttl(Duration::from_secs(2))
        .stale_while_revalidate(Duration::from_secs(30))
        .stale_if_error(Duration::from_secs(30))
        .build()
        .unwrap();
    cache.store_now(
        &key,
        Fill::new(Value::from_body("nope")).lifetime(Lifetime::Negative),
        &policy,
    );
    clock.advance(Duration::from_millis(1999));
    assert_eq!(state(&cache, &key, &policy), "fresh");
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        state(&cache, &key, &policy),
        "miss",
        "no stale 404 on the route's say-so"
    );
}

/// The fire rate at `before` seconds from expiry, over `n` seeded lookups.
fn xfetch_rate(before: u64, delta: Duration, beta: f64, n: usize) -> f64 {
    let clock = MockClock::new();
    let cache = engine(&clock, 42);
    let key = CacheKey::new("hot");
    let policy = Policy::ttl(Duration::from_secs(300))
        .jitter(0.0)
        .xfetch_beta(beta)
        .build()
        .unwrap();
    cache.store_now(
        &key,
        Fill::new(Value::from_body("v")).origin_latency(delta),
        &policy,
    );
    clock.advance(Duration::from_secs(300 - before));
    let fired = (0..n)
        .filter(|_| state(&cache, &key, &policy) == "fresh+xfetch")
        .count();
    fired as f64 / n as f64
}

#[test]
fn xfetch_fires_at_the_rate_the_formula_gives() {
    let delta = Duration::from_secs(10);
    // P(fire) = exp(-remaining / (δ·β)).
    let near = xfetch_rate(10, delta, 1.0, 20_000);
    let expected = (-1.0f64).exp();
    assert!(
        (near - expected).abs() < 0.02,
        "10 s before: {near}, formula {expected}"
    );
    let far = xfetch_rate(290, delta, 1.0, 20_000);
    assert_eq!(far, 0.0, "290 s before expiry it practically never fires");
    let doubled = xfetch_rate(10, delta, 2.0, 20_000);
    let expected = (-0.5f64).exp();
    assert!(
        (doubled - expected).abs() < 0.02,
        "β = 2: {doubled}, formula {expected}"
    );
    assert_eq!(xfetch_rate(1, delta, 0.0, 1_000), 0.0, "β = 0 disables it");
    assert_eq!(
        xfetch_rate(1, Duration::ZERO, 1.0, 1_000),
        0.0,
        "no δ, no early refresh"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_or_load_loads_once_for_concurrent_callers() {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::new("report");
    let loads = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (cache, policy, key, loads, gate) = (
                cache.clone(),
                policy.clone(),
                key.clone(),
                loads.clone(),
                gate.clone(),
            );
            tokio::spawn(async move {
                cache
                    .get_or_load(&key, &policy, move || async move {
                        loads.fetch_add(1, Ordering::SeqCst);
                        gate.notified().await;
                        Ok::<_, std::convert::Infallible>(Value::from_body("built"))
                    })
                    .await
            })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cache.stats().coalesced < 49 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            cache.stats()
        );
        tokio::task::yield_now().await;
    }
    gate.notify_one();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().body, "built");
    }
    assert_eq!(loads.load(Ordering::SeqCst), 1);
    assert_eq!(cache.get(&key).await.unwrap().body, "built");
}

#[tokio::test]
async fn expire_and_invalidate() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let key = CacheKey::new("k");
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    cache.put(&key, Value::from_body("v"), &policy);
    assert!(cache.expire(&key, Duration::from_secs(2)).await);
    clock.advance(Duration::from_secs(2));
    assert!(cache.get(&key).await.is_none());
    cache.put(&key, Value::from_body("v"), &policy);
    cache.invalidate(&key).await.unwrap();
    assert!(cache.get(&key).await.is_none());
    assert!(!cache.expire(&key, Duration::from_secs(2)).await);
    // A lifetime past the clock's end keeps the value as long as any
    // lifetime may (it used to turn into "expire now", a delete).
    cache.put(&key, Value::from_body("v"), &policy);
    assert!(cache.expire(&key, Duration::MAX).await);
    assert!(
        cache.get(&key).await.is_some(),
        "expire(MAX) deleted the value"
    );
    assert_eq!(cache.ttl(&key).await, Some(MAX_TTL));
}

/// Whatever an origin declares (a lifetime or stale windows far past a
/// year), storing it neither panics nor overflows the clock.
#[tokio::test]
async fn huge_origin_lifetimes_are_clamped_not_a_panic() {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let key = CacheKey::new("k");
    let fill = Fill::new(Value::from_body("v"))
        .lifetime(Lifetime::Declared(Duration::MAX))
        .stale_windows(Some(Duration::MAX), Some(Duration::MAX))
        .initial_age(Duration::MAX);
    let entry = cache.put(&key, fill, &policy);
    let year = Duration::from_secs(365 * 24 * 3600);
    assert!(entry.remaining_hard(clock.now()) <= year * 2);
    assert_eq!(state(&cache, &key, &policy), "fresh");
}

/// An in-memory L2 whose reads wait until the gate opens.
#[derive(Debug)]
struct GatedReads {
    inner: MemoryTier,
    open: tokio::sync::watch::Sender<bool>,
}

impl Tier for GatedReads {
    fn get<'a>(
        &'a self,
        key: &'a CacheKey,
    ) -> crate::tier::BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        let mut open = self.open.subscribe();
        Box::pin(async move {
            let _ = open.wait_for(|open| *open).await;
            self.inner.get(key).await
        })
    }

    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[bytes::Bytes]) {
        self.inner.put(key, entry, ttl, tags);
    }

    fn invalidate<'a>(
        &'a self,
        invalidation: Invalidation,
    ) -> crate::tier::BoxFuture<'a, Result<(), TierError>> {
        self.inner.invalidate(invalidation)
    }
}

/// Requests that wait on a first load which finds L2's copy inside its
/// stale-while-revalidate window are answered stale, as the leader is, and
/// counted so: not as fresh L2 hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_followers_of_a_stale_l2_copy_are_answered_stale() {
    let clock = MockClock::new();
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .xfetch_beta(0.0)
        .stale_while_revalidate(Duration::from_secs(60))
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let filler = TieredCache::builder()
        .clock(clock.clone())
        .l2(l2.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    filler.store_now(&key, Fill::new(Value::from_body("old")), &policy);
    clock.advance(Duration::from_secs(20));
    let open = tokio::sync::watch::Sender::new(false);
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .l2(GatedReads {
            inner: l2,
            open: open.clone(),
        })
        .sweep_interval(None)
        .build()
        .unwrap();
    let loads = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (cache, policy, key, loads) =
                (cache.clone(), policy.clone(), key.clone(), loads.clone());
            tokio::spawn(async move {
                cache
                    .get_or_load(&key, &policy, move || async move {
                        loads.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(Value::from_body("new"))
                    })
                    .await
            })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cache.stats().coalesced < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            cache.stats()
        );
        tokio::task::yield_now().await;
    }
    open.send_replace(true);
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().body, "old");
    }
    let stats = cache.stats();
    assert_eq!(
        (stats.stale_served, stats.hits_l2),
        (3, 0),
        "the followers were counted as fresh hits: {stats:?}"
    );
}
