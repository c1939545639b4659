use std::sync::Arc;
use std::time::Duration;

use crate::engine::read::Lookup;
use crate::*;

/// Accepts every entry.
struct Any;
impl Select for Any {}
const ANY: &Any = &Any;

/// Refuses every entry.
struct Refuse;
impl Select for Refuse {
    fn accepts(&self, _: &Entry) -> bool {
        false
    }
}
#[allow(dead_code)]
const REFUSE: &Refuse = &Refuse;

pub(crate) const TTL: Duration = Duration::from_secs(60);

pub(crate) fn engine(clock: &MockClock) -> TieredCache {
    TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .rng_seed(1)
        .build()
        .unwrap()
}

/// Builds engines on `clock` that share one in-memory L2.
pub(crate) fn on_shared_l2(clock: &MockClock) -> impl Fn() -> TieredCache + use<> {
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let clock = clock.clone();
    move || {
        TieredCache::builder()
            .clock(clock.clone())
            .l2(l2.clone())
            .sweep_interval(None)
            .build()
            .unwrap()
    }
}

pub(crate) fn fill(body: &str) -> Fill {
    Fill::new(Value::from_body(body.to_owned()))
}

#[tokio::test]
async fn fresh_then_dead_on_the_engine_clock() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let key = CacheKey::new("a");
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    cache.store_now(&key, fill("v"), &policy);
    match cache.lookup_at(&key, cache.now(), &Policy::ttl(TTL).build().unwrap(), ANY) {
        Lookup::Fresh { remaining, .. } => assert_eq!(remaining, TTL),
        _ => panic!("expected a hit"),
    }
    clock.advance(TTL - Duration::from_millis(1));
    assert!(matches!(
        cache.lookup_at(&key, cache.now(), &Policy::ttl(TTL).build().unwrap(), ANY),
        Lookup::Fresh { .. }
    ));
    clock.advance(Duration::from_millis(1));
    assert!(matches!(
        cache.lookup_at(&key, cache.now(), &Policy::ttl(TTL).build().unwrap(), ANY),
        Lookup::Miss { .. }
    ));
    // Lazy expiry removed it and counted it.
    assert_eq!(cache.stats().expired, 1);
    assert_eq!(cache.l1_entry_count(), 0);
}

#[tokio::test]
async fn accept_can_refuse_an_entry() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let key = CacheKey::new("a");
    cache.store_now(&key, fill("v"), &Policy::ttl(TTL).build().unwrap());
    assert!(matches!(
        cache.lookup_at(
            &key,
            cache.now(),
            &Policy::ttl(TTL).build().unwrap(),
            REFUSE
        ),
        Lookup::Miss { .. }
    ));
    assert_eq!(cache.stats().hits_l1, 0);
}

#[tokio::test]
async fn sweeper_reclaims_expired_entries_without_reads() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let policy = Policy::ttl(TTL).jitter(0.5).build().unwrap();
    for i in 0..100_000u32 {
        cache.store_now(&CacheKey::new(i.to_le_bytes()), fill("x"), &policy);
    }
    // A second cohort that stays fresh.
    let long = Policy::ttl(TTL * 10).build().unwrap();
    for i in 0..1_000u32 {
        cache.store_now(&CacheKey::new(format!("long{i}")), fill("x"), &long);
    }
    assert_eq!(cache.l1_entry_count(), 101_000);
    assert_eq!(cache.sweep(), 0, "nothing is due yet");
    clock.advance(TTL * 2);
    assert_eq!(cache.sweep(), 100_000);
    assert_eq!(cache.l1_entry_count(), 1_000);
    let stats = cache.stats();
    assert_eq!(stats.expired, 100_000);
    assert_eq!(stats.evicted, 0);
    assert_eq!(stats.sweeps, 2);
}

#[tokio::test(start_paused = true)]
async fn the_sweeper_ticks_on_its_own() {
    let clock = MockClock::new();
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    for i in 0..1_000u32 {
        cache.store_now(
            &CacheKey::new(i.to_le_bytes()),
            fill("x"),
            &Policy::ttl(TTL).build().unwrap(),
        );
    }
    clock.advance(TTL * 2);
    // Paused tokio time: each sleep auto-advances to the next timer, no waiting.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if cache.stats().expired == 1_000 {
            break;
        }
    }
    assert_eq!(cache.stats().expired, 1_000);
    assert!(cache.stats().sweeps >= 1);
}

#[tokio::test]
async fn a_replaced_entry_is_not_swept_early() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let key = CacheKey::new("a");
    cache.store_now(
        &key,
        fill("old"),
        &Policy::ttl(Duration::from_secs(1))
            .jitter(0.0)
            .build()
            .unwrap(),
    );
    cache.store_now(
        &key,
        fill("new"),
        &Policy::ttl(TTL).jitter(0.0).build().unwrap(),
    );
    clock.advance(Duration::from_secs(2));
    assert_eq!(cache.sweep(), 0);
    match cache.lookup_at(&key, cache.now(), &Policy::ttl(TTL).build().unwrap(), ANY) {
        Lookup::Fresh { entry, .. } => assert_eq!(entry.value().body, "new"),
        _ => panic!("the new entry was swept"),
    }
}

#[tokio::test]
async fn hit_for_miss_expires_on_the_engine_clock() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let key = CacheKey::new("a");
    let policy = Policy::ttl(TTL)
        .hit_for_miss_ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    cache.mark_uncacheable(&key, &policy);
    assert!(cache.is_uncacheable(&key, cache.now()));
    clock.advance(Duration::from_secs(5));
    assert!(!cache.is_uncacheable(&key, cache.now()));
    cache.mark_uncacheable(&key, &policy);
    cache.store_now(&key, fill("v"), &policy);
    assert!(
        !cache.is_uncacheable(&key, cache.now()),
        "a store clears the mark"
    );
}

#[tokio::test]
async fn l2_hits_are_promoted_for_at_most_the_tiers_remaining_ttl() {
    let clock = MockClock::new();
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let writer = TieredCache::builder()
        .clock(clock.clone())
        .l2(l2.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let reader = TieredCache::builder()
        .clock(clock.clone())
        .l2(l2.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let key = CacheKey::new("a");
    writer.store_now(
        &key,
        fill("v"),
        &Policy::ttl(TTL).jitter(0.0).build().unwrap(),
    );
    clock.advance(Duration::from_secs(20));
    assert!(matches!(
        reader.lookup_at(&key, reader.now(), &Policy::ttl(TTL).build().unwrap(), ANY),
        Lookup::Miss { .. }
    ));
    let promoted = reader.lookup_l2(&key, 0, |_| true).await.expect("l2 hit");
    assert_eq!(promoted.value().body, "v");
    assert_eq!(
        promoted.remaining_hard(clock.now()),
        Duration::from_secs(40)
    );
    match reader.lookup_at(&key, reader.now(), &Policy::ttl(TTL).build().unwrap(), ANY) {
        Lookup::Fresh { remaining, .. } => assert_eq!(remaining, Duration::from_secs(40)),
        _ => panic!("not promoted"),
    }
    let stats = reader.stats();
    assert_eq!(
        (stats.hits_l2, stats.hits_l1),
        (0, 1),
        "a bare L2 read counts nothing"
    );
}

#[tokio::test]
async fn a_miss_answered_from_storage_alone_reads_l2_and_never_waits() {
    let clock = MockClock::new();
    let build = on_shared_l2(&clock);
    let (writer, reader) = (build(), build());
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    let (stored, cold) = (CacheKey::new("stored"), CacheKey::new("cold"));
    writer.store_now(&stored, fill("v"), &policy);
    let miss = |key: &CacheKey| match reader.begin(key, &policy, &()) {
        Begin::Miss(miss) => miss,
        Begin::Hit(_) => panic!("the reader's L1 is empty"),
    };
    let answer = miss(&stored).stored(()).await.expect("L2 holds it");
    assert_eq!(
        (answer.entry.value().body.as_ref(), answer.source),
        (&b"v"[..], Source::L2)
    );
    assert!(matches!(reader.begin(&stored, &policy, &()), Begin::Hit(_)));
    assert_eq!(reader.stats().hits_l2, 1);
    // Nothing stored: no answer, even while another request leads a load
    // of the key (it is not waited on).
    let _leader = match reader.begin(&cold, &policy, &()) {
        Begin::Miss(miss) => tokio::spawn(miss.run(origin_fn(|_| {
            std::future::pending::<Result<Loaded<()>, String>>()
        }))),
        Begin::Hit(_) => unreachable!(),
    };
    tokio::task::yield_now().await;
    let read = tokio::time::timeout(Duration::from_secs(5), miss(&cold).stored(()));
    assert!(read.await.expect("never waits on the load").is_none());
    // Past its lifetime on the engine's clock, L2's copy answers nothing.
    clock.advance(TTL * 2);
    let late = build();
    let Begin::Miss(miss) = late.begin(&stored, &policy, &()) else {
        panic!("a new engine's L1 is empty");
    };
    assert!(miss.stored(()).await.is_none());
}

#[tokio::test]
async fn a_foreign_key_under_the_same_hash_is_a_miss() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let key = CacheKey::new("a");
    let policy = Policy::ttl(TTL).build().unwrap();
    cache.store_now(&key, fill("v"), &policy);
    // Same hash slot, different full key: what a collision would look like.
    let l1 = &cache.inner_for_tests().l1;
    let foreign = Entry::new(
        "not-a".into(),
        Default::default(),
        Value::from_body("evil"),
        Times::fresh(clock.now(), clock.now() + TTL),
        Duration::ZERO,
    );
    l1.insert(key.hash(), foreign);
    assert!(matches!(
        cache.lookup_at(&key, cache.now(), &Policy::ttl(TTL).build().unwrap(), ANY),
        Lookup::Miss { .. }
    ));
}

#[test]
fn a_sweeper_without_a_runtime_is_a_clear_error() {
    let err = TieredCache::builder().build().unwrap_err();
    assert!(err.to_string().contains("sweep_interval(None)"), "{err}");
    assert!(TieredCache::builder().sweep_interval(None).build().is_ok());
}

#[test]
fn bad_builder_settings_are_named() {
    let err = TieredCache::builder()
        .l1_capacity(0)
        .sweep_interval(None)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("`l1_capacity`"), "{err}");
}

#[test]
fn stats_serialise_with_the_contract_names() {
    let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    let json = serde_json::to_value(cache.stats()).unwrap();
    for field in [
        "hits_l1",
        "hits_l2",
        "misses",
        "stale_served",
        "origin_loads",
        "coalesced",
        "lock_timeouts",
        "l2_errors",
        "expired",
        "evicted",
        "sweeps",
        "bypassed",
        "hit_ratio",
        "origin_latency",
    ] {
        assert!(json.get(field).is_some(), "missing {field}");
    }
}

/// The hit-for-miss marks' memory bound was a fixed 10 minutes, which cut a
/// longer `hit_for_miss_ttl` short (the policy allows up to 365 days): a
/// mark now stays in memory as long as it lasts on the engine's clock.
#[test]
fn a_hit_for_miss_mark_stays_as_long_as_its_policy_says() {
    use moka::Expiry;
    let clock = MockClock::new();
    let expiry = crate::engine::MarkExpiry(Arc::new(clock.clone()));
    let until = clock.now() + Duration::from_secs(3600);
    let hash = CacheKey::new("k").hash();
    let bound = expiry
        .expire_after_create(&hash, &until, std::time::Instant::now())
        .unwrap();
    assert!(bound >= Duration::from_secs(3600), "{bound:?}");
    assert!(bound <= Duration::from_secs(3602), "{bound:?}");
}

/// An invalidation whose caller goes away while the shared tier is asked
/// (a client that disconnected, a timeout around the call) still lands:
/// the attempt runs on, and nothing is left behind in the outbox (it was
/// neither sent nor queued for a retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_whose_caller_goes_away_still_lands() {
    let clock = MockClock::new();
    let (l2, open) = MemoryTier::holding_invalidations(Arc::new(clock.clone()));
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .l2(l2)
        .sweep_interval(None)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let gone = tokio::time::timeout(Duration::from_millis(20), cache.invalidate(&key)).await;
    assert!(gone.is_err(), "the tier held the attempt");
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let invalidations = cache.stats().invalidations;
        if invalidations.landed == 1 && invalidations.pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the invalidation was left behind: {invalidations:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A slower load of this instance ends after it read a newer copy from the
/// shared tier (another instance's, stored meanwhile): the copy stays, in
/// L1 and in the shared tier. A promoted copy had no load number (`0`),
/// and the slower load's answer replaced it in both (a review finding).
#[tokio::test(start_paused = true)]
async fn a_slower_load_does_not_replace_a_newer_copy_read_from_the_shared_tier() {
    let clock = MockClock::new();
    let make = on_shared_l2(&clock);
    let (here, other) = (make(), make());
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    let key = CacheKey::new("k");
    let slow = {
        let (here, policy, key) = (here.clone(), policy.clone(), key.clone());
        tokio::spawn(async move {
            let origin = origin_fn(|_stale: Option<Entry>| async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, ()>(Loaded::<()>::Store(fill("older")))
            });
            here.fetch(&key, &policy, origin).await
        })
    };
    tokio::task::yield_now().await;
    other.put(&key, Value::from_body("newer"), &policy);
    assert_eq!(here.get(&key).await.unwrap().body, "newer", "read from L2");
    assert!(slow.await.unwrap().is_ok());
    assert_eq!(here.get(&key).await.unwrap().body, "newer", "in L1");
    assert_eq!(make().get(&key).await.unwrap().body, "newer", "in L2");
}
