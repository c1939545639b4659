//! An instance that cannot hear the fleet ([`InvalidationSink::unheard`]):
//! what it holds may be outdated, so each entry needs the origin again,
//! and stale-if-error still has it for an origin that fails too.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::tests_freshness::state;
use crate::*;

/// A shared tier with nothing in it that keeps the engine's sink, and
/// says it is asked unless `down`; its invalidations fail while `refusing`.
#[derive(Default)]
struct Listening {
    sink: Mutex<Option<Weak<dyn InvalidationSink>>>,
    down: std::sync::atomic::AtomicBool,
    refusing: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Listening")
    }
}

impl Listening {
    fn sink(&self) -> Arc<dyn InvalidationSink> {
        self.sink
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .upgrade()
            .unwrap()
    }
}

impl Tier for Listening {
    fn get<'a>(&'a self, _: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async { Ok(None) })
    }

    fn put(&self, _: &CacheKey, _: &Entry, _: Duration, _: &[bytes::Bytes]) {}

    fn invalidate<'a>(&'a self, _: Invalidation) -> BoxFuture<'a, Result<(), TierError>> {
        let refusing = self.refusing.load(std::sync::atomic::Ordering::Relaxed);
        Box::pin(async move {
            match refusing {
                true => Err(TierError::new("unreachable", None)),
                false => Ok(()),
            }
        })
    }

    fn listen(&self, sink: Weak<dyn InvalidationSink>) {
        *self.sink.lock().unwrap() = Some(sink);
    }

    fn available(&self) -> bool {
        !self.down.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// An engine on a mock clock, on a [`Listening`] tier.
fn listening() -> (MockClock, Arc<Listening>, TieredCache) {
    let clock = MockClock::new();
    let tier = Arc::new(Listening::default());
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .l2_shared(tier.clone())
        .build()
        .unwrap();
    (clock, tier, cache)
}

/// No jitter, no XFetch, 30 s of stale-while-revalidate.
fn windows(policy: PolicyBuilder) -> PolicyBuilder {
    policy
        .jitter(0.0)
        .xfetch_beta(0.0)
        .stale_while_revalidate(Duration::from_secs(30))
}

#[tokio::test]
async fn an_entry_unheard_of_needs_the_origin_and_keeps_stale_if_error() {
    let (clock, tier, cache) = listening();
    let policy = windows(Policy::ttl(Duration::from_secs(60)))
        .stale_if_error(Duration::from_secs(300))
        .build()
        .unwrap();
    let (fresh, stale) = (CacheKey::new("fresh"), CacheKey::new("stale"));
    let (plain, strict) = (CacheKey::new("plain"), CacheKey::new("strict"));
    cache.store_now(&stale, Fill::new(Value::from_body("s")), &policy);
    clock.advance(Duration::from_secs(70));
    cache.store_now(&fresh, Fill::new(Value::from_body("f")), &policy);
    let windowless = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    cache.store_now(&plain, Fill::new(Value::from_body("p")), &windowless);
    // The origin said must-revalidate: never served stale, also not now.
    let must_revalidate = Fill::new(Value::from_body("m")).no_stale(true);
    cache.store_now(&strict, must_revalidate, &policy);
    assert_eq!(state(&cache, &fresh, &policy), "fresh");
    assert_eq!(state(&cache, &stale, &policy), "stale");

    tier.sink().unheard();
    // Neither answered as it is (fresh, or stale while it revalidates):
    // the origin is asked, and its failure still gets the stale copy.
    for key in [&fresh, &stale] {
        assert_eq!(state(&cache, key, &policy), "stale-if-error", "{key:?}");
    }
    // One with no window past its fresh time (or none it may use) is a miss.
    assert_eq!(state(&cache, &plain, &windowless), "miss");
    assert_eq!(state(&cache, &strict, &policy), "miss");
    // Its tags still reach it (the rewrite is a new fill to the tag index).
    let tagged = CacheKey::new("tagged");
    let fill = Fill::new(Value::from_body("t")).tags(vec![bytes::Bytes::from_static(b"t")]);
    cache.store_now(&tagged, fill, &policy);
    tier.sink().unheard();
    cache.sweep(); // which prunes tag records of fills no longer held
    assert_eq!(state(&cache, &tagged, &policy), "stale-if-error");
    let _ = cache.invalidate_tag("t").await;
    assert_eq!(
        state(&cache, &tagged, &policy),
        "miss",
        "the tag's invalidation missed it"
    );
    // A fill after it is fresh again.
    cache.store_now(&fresh, Fill::new(Value::from_body("f2")), &policy);
    assert_eq!(state(&cache, &fresh, &policy), "fresh");
}

/// Deaf (its message stream lost, the tier still asked): no L1 copy is
/// answered as it is, fresh or stale while it revalidates; each is a miss
/// that keeps it (for its validators), so the request reads the tier,
/// which another instance's write changed. With the tier not
/// asked either (its breaker open), L1 answers as before; and again once
/// the stream is back.
#[tokio::test]
async fn a_deaf_instance_answers_no_l1_copy_while_the_tier_answers() {
    let (clock, tier, cache) = listening();
    let policy = windows(Policy::ttl(Duration::from_secs(60)))
        .build()
        .unwrap();
    let (fresh, stale) = (CacheKey::new("fresh"), CacheKey::new("stale"));
    cache.store_now(&stale, Fill::new(Value::from_body("s")), &policy);
    clock.advance(Duration::from_secs(70));
    cache.store_now(&fresh, Fill::new(Value::from_body("f")), &policy);
    let states = || [&fresh, &stale].map(|key| state(&cache, key, &policy));
    assert_eq!(states(), ["fresh", "stale"]);
    tier.sink().deaf(true);
    assert_eq!(states(), ["stale-if-error", "stale-if-error"]);
    // The key-value reads too: the tier (empty here) is asked.
    assert!(cache.get(&fresh).await.is_none());
    tier.down.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(states(), ["fresh", "stale"], "the tier not asked either");
    tier.down.store(false, std::sync::atomic::Ordering::Relaxed);
    tier.sink().deaf(false);
    assert_eq!(states(), ["fresh", "stale"]);
}

/// An invalidation queued while the tier failed goes as soon as the tier is
/// heard again, not at the end of its backoff: up to 2 s, while the other
/// instances, their L1 dropped on the same reconnection, read what it has
/// not deleted yet (a black-box audit: a pre-write copy answered by two
/// instances 0.5–1.6 s after a pause of Valkey ended).
#[tokio::test(start_paused = true)]
async fn a_queued_invalidation_goes_as_soon_as_the_tier_is_heard_again() {
    let (_clock, tier, cache) = listening();
    tier.refusing
        .store(true, std::sync::atomic::Ordering::Relaxed);
    tier.sink().deaf(true);
    assert!(cache.invalidate(&CacheKey::new("k")).await.is_err());
    // Retried at 0.05, 0.15, … 3.15, 5.15 s; the next at 7.15 s.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    assert!(cache.stats().invalidations.retried >= 7);
    tier.refusing
        .store(false, std::sync::atomic::Ordering::Relaxed);
    tier.sink().deaf(false);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(cache.stats().invalidations.landed, 1, "still waiting");
}
