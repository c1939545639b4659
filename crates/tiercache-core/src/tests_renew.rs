//! Renewals (`touch`, `expire_at`) and promotions store what they read:
//! never over a newer fill stored meanwhile, here or by another instance.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::tests::{TTL, on_shared_l2};
use crate::tier::BoxFuture;
use crate::*;

fn fill(body: &str) -> Fill {
    Fill::new(Value::from_body(body.to_owned()))
}

/// An engine on `clock` with `l2` as its shared tier.
fn on(clock: &MockClock, l2: impl Tier) -> TieredCache {
    TieredCache::builder()
        .clock(clock.clone())
        .l2(l2)
        .sweep_interval(None)
        .build()
        .unwrap()
}

/// Waits until a read holds its answer at `open`'s gate.
async fn a_read_waits(open: &tokio::sync::watch::Sender<bool>, what: &str) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while open.receiver_count() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect(what);
}

/// Renews `key` by `touch` (`true`) or `expire_at`.
async fn renew(cache: &TieredCache, key: &CacheKey, touch: bool) -> bool {
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    if touch {
        cache.touch(key, &policy).await
    } else {
        cache.expire_at(key, cache.now() + TTL / 2).await
    }
}

/// A renewal read the key (here from L1, a copy promoted from L2), then
/// stored it again with a new lifetime: over the newer fill another
/// instance had stored in L2 meanwhile, which every instance then read as
/// the old value. L2's copy is replaced only while it is the fill read.
#[tokio::test]
async fn a_renewal_never_overwrites_another_instances_newer_fill() {
    for touch in [true, false] {
        let clock = MockClock::new();
        let build = on_shared_l2(&clock);
        let (writer, renewer, reader) = (build(), build(), build());
        let policy = Policy::ttl(TTL).build().unwrap();
        let key = CacheKey::new("k");
        writer.store_now(&key, fill("old"), &policy);
        assert_eq!(renewer.get(&key).await.unwrap().body, "old", "promoted");
        clock.advance(Duration::from_millis(5));
        writer.store_now(&key, fill("new"), &policy);
        assert!(renew(&renewer, &key, touch).await);
        assert_eq!(
            reader.get(&key).await.unwrap().body,
            "new",
            "touch: {touch}: the renewal overwrote a newer fill"
        );
    }
}

/// An in-memory L2 that reads at once and answers once the gate opens
/// (the first `held` reads; later ones at once).
#[derive(Debug)]
struct HeldAnswers {
    inner: MemoryTier,
    open: tokio::sync::watch::Sender<bool>,
    held: std::sync::atomic::AtomicUsize,
}

impl HeldAnswers {
    fn new(inner: MemoryTier, open: &tokio::sync::watch::Sender<bool>, held: usize) -> Self {
        let (open, held) = (open.clone(), held.into());
        Self { inner, open, held }
    }
}

impl Tier for HeldAnswers {
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        let mut open = self.open.subscribe();
        let held = self
            .held
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            let read = self.inner.get(key).await;
            if held {
                let _ = open.wait_for(|open| *open).await;
            }
            read
        })
    }

    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[bytes::Bytes]) {
        self.inner.put(key, entry, ttl, tags);
    }

    fn invalidate<'a>(
        &'a self,
        invalidation: Invalidation,
    ) -> BoxFuture<'a, Result<(), TierError>> {
        self.inner.invalidate(invalidation)
    }
}

/// An L2 read's answer (a miss's, a renewal's) was promoted over whatever
/// this instance stored while it was on its way: a `put` made then was
/// replaced in L1 by the older copy read, and a renewal stored that copy
/// again, in L2 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_l2_never_replaces_a_fill_stored_while_it_was_on_its_way() {
    for touch in [None, Some(true), Some(false)] {
        let clock = MockClock::new();
        let l2 = MemoryTier::new(Arc::new(clock.clone()));
        let policy = Policy::ttl(TTL).build().unwrap();
        let key = CacheKey::new("k");
        let writer = on(&clock, l2.clone());
        writer.store_now(&key, fill("old"), &policy);
        let open = tokio::sync::watch::Sender::new(false);
        let cache = on(&clock, HeldAnswers::new(l2.clone(), &open, usize::MAX));
        let reading = {
            let (cache, key) = (cache.clone(), key.clone());
            tokio::spawn(async move {
                match touch {
                    None => cache.get(&key).await.is_some(),
                    Some(touch) => renew(&cache, &key, touch).await,
                }
            })
        };
        // The read has its answer (the old fill) and waits to return it.
        a_read_waits(&open, "the read began").await;
        clock.advance(Duration::from_millis(5));
        cache.store_now(&key, fill("new"), &policy);
        open.send_replace(true);
        assert!(reading.await.unwrap());
        assert_eq!(
            cache.get(&key).await.unwrap().body,
            "new",
            "{touch:?}: L1 went back to the old fill"
        );
        writer.forget_local(&key);
        assert_eq!(
            writer.get(&key).await.unwrap().body,
            "new",
            "{touch:?}: L2 went back to the old fill"
        );
    }
}

/// Two reads of one fill from L2 make two copies, and only the first is
/// promoted: a renewal whose read was the other was refused (L1 did not
/// hold the very copy it read), in L1 and L2, though it renewed the fill
/// L1 held. A renewal replaces a copy of the same fill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_copy_was_not_the_one_promoted_still_renews() {
    for touch in [true, false] {
        let clock = MockClock::new();
        let l2 = MemoryTier::new(Arc::new(clock.clone()));
        let long = Policy::ttl(TTL * 10).jitter(0.0).build().unwrap();
        let key = CacheKey::new("k");
        let writer = on(&clock, l2.clone());
        writer.store_now(&key, fill("v"), &long);
        let open = tokio::sync::watch::Sender::new(false);
        let cache = on(&clock, HeldAnswers::new(l2.clone(), &open, 1));
        let renewing = {
            let (cache, key) = (cache.clone(), key.clone());
            tokio::spawn(async move { renew(&cache, &key, touch).await })
        };
        a_read_waits(&open, "the renewal's read began").await;
        // Another read of the same fill is promoted first.
        assert_eq!(cache.get(&key).await.unwrap().body, "v");
        open.send_replace(true);
        assert!(renewing.await.unwrap());
        let ttl = cache.ttl(&key).await.unwrap();
        assert!(ttl <= TTL, "touch: {touch}: not renewed here ({ttl:?})");
        writer.forget_local(&key);
        let ttl = writer.ttl(&key).await.unwrap();
        assert!(ttl <= TTL, "touch: {touch}: not renewed in L2 ({ttl:?})");
    }
}

/// A fill stored while an L2 read was on its way, already stale (here its
/// lifetime ran out before the read's answer came, within its
/// stale-while-revalidate window), was replaced by the older copy read:
/// a promotion replaces a stale entry only if it is not newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_l2_never_replaces_a_newer_stale_fill() {
    let clock = MockClock::new();
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let long = Policy::ttl(TTL * 10).jitter(0.0).build().unwrap();
    let brief = Policy::ttl(Duration::from_secs(1))
        .jitter(0.0)
        .stale_while_revalidate(TTL)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let writer = on(&clock, l2.clone());
    writer.store_now(&key, fill("old"), &long);
    let open = tokio::sync::watch::Sender::new(false);
    let cache = on(&clock, HeldAnswers::new(l2.clone(), &open, 1));
    let reading = {
        let (cache, key) = (cache.clone(), key.clone());
        tokio::spawn(async move { cache.get(&key).await.is_some() })
    };
    a_read_waits(&open, "the read began").await;
    clock.advance(Duration::from_millis(5));
    cache.store_now(&key, fill("new"), &brief);
    clock.advance(Duration::from_secs(2));
    open.send_replace(true);
    assert!(reading.await.unwrap());
    let held = cache.inner_for_tests().l1.held(&key.hash()).unwrap();
    assert_eq!(held.value().body, "new", "L1 went back to the old fill");
}

/// An in-memory L2 that keeps creation times to the millisecond, as
/// Valkey's envelope does.
#[derive(Debug)]
struct Millis(MemoryTier);

impl Tier for Millis {
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async move {
            let hit = self.0.get(key).await?;
            Ok(hit.map(|mut hit| {
                let mut times = hit.entry.times();
                let since = times
                    .created_at
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap();
                times.created_at =
                    std::time::UNIX_EPOCH + Duration::from_millis(since.as_millis() as u64);
                hit.entry = hit.entry.with_times(times);
                hit
            }))
        })
    }

    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[bytes::Bytes]) {
        self.0.put(key, entry, ttl, tags);
    }

    fn put_over(
        &self,
        key: &CacheKey,
        entry: &Entry,
        ttl: Duration,
        tags: &[bytes::Bytes],
        read: &Entry,
    ) {
        self.0.put_over(key, entry, ttl, tags, read);
    }

    fn invalidate<'a>(
        &'a self,
        invalidation: Invalidation,
    ) -> BoxFuture<'a, Result<(), TierError>> {
        self.0.invalidate(invalidation)
    }
}

/// A fill made here carries its creation to the nanosecond, its copy read
/// back from L2 to the millisecond: the two were told apart, so a copy of
/// this instance's own fill (renewed in L2 by another instance) was never
/// promoted over its stale entry, and a renewal of it was refused.
#[tokio::test]
async fn a_copy_read_back_to_the_millisecond_is_the_same_fill() {
    let clock = MockClock::new();
    clock.advance(Duration::from_micros(300));
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let build = || on(&clock, Millis(l2.clone()));
    let (filler, other) = (build(), build());
    let policy = Policy::ttl(Duration::from_secs(10))
        .jitter(0.0)
        .stale_if_error(TTL)
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    filler.store_now(&key, fill("v"), &policy);
    assert!(other.get(&key).await.is_some(), "promoted");
    assert!(other.expire_at(&key, other.now() + TTL * 5).await);
    clock.advance(Duration::from_secs(11));
    // The filler's own entry is stale now; L2's copy is fresh.
    let touch = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    assert!(filler.touch(&key, &touch).await);
    let ttl = filler.ttl(&key).await.unwrap();
    assert!(ttl > Duration::from_secs(59), "not renewed ({ttl:?})");
}

/// Two fills of one key in the same millisecond on this instance were one
/// fill to a renewal: a `touch` that read the first replaced the second,
/// stored meanwhile. Entries made here keep their nanoseconds: only a copy
/// read back to the millisecond (from Valkey) matches by millisecond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_never_replaces_a_fill_made_here_in_the_same_millisecond() {
    let clock = MockClock::new();
    clock.advance(Duration::from_micros(100));
    let l2 = MemoryTier::new(Arc::new(clock.clone()));
    let writer = on(&clock, l2.clone());
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    let key = CacheKey::new("k");
    writer.store_now(&key, fill("old"), &policy);
    let open = tokio::sync::watch::Sender::new(false);
    let cache = on(&clock, HeldAnswers::new(l2.clone(), &open, 1));
    let renewing = {
        let (cache, key) = (cache.clone(), key.clone());
        tokio::spawn(async move { renew(&cache, &key, true).await })
    };
    a_read_waits(&open, "the renewal's read began").await;
    clock.advance(Duration::from_micros(800));
    cache.store_now(&key, fill("new"), &policy);
    open.send_replace(true);
    assert!(renewing.await.unwrap());
    assert_eq!(cache.get(&key).await.unwrap().body, "new", "replaced");
}

/// A renewal whose copy L1 no longer holds (moka refused the promotion, or
/// evicted it) still renews the shared tier's fill, which it holds. But it
/// never creates: a fill taken out of both tiers after the renewal read it
/// (by a delete again, whose `D` message records nothing in the journal)
/// came back everywhere for the renewal's lifetime.
#[tokio::test]
async fn a_renewal_with_nothing_in_l1_renews_l2_and_never_creates() {
    let clock = MockClock::new();
    let build = crate::tests::on_shared_l2(&clock);
    let (cache, reader) = (build(), build());
    let policy = Policy::ttl(TTL).jitter(0.0).build().unwrap();
    let key = CacheKey::new("k");
    let read = cache.store_now(&key, fill("v"), &policy);
    cache.forget_local(&key);
    let renewed = |ttl| read.with_times(Times::fresh(read.times().created_at, cache.now() + ttl));
    assert!(!cache.insert_over(&key, renewed(TTL * 5), TTL * 5, &read));
    let ttl = reader.ttl(&key).await.unwrap();
    assert!(ttl > TTL, "not renewed in L2 ({ttl:?})");
    // Taken out of both tiers after the renewal read it.
    reader.invalidate(&key).await.unwrap();
    assert!(!cache.insert_over(&key, renewed(TTL), TTL, &read));
    assert!(reader.get(&key).await.is_none(), "brought back in L2");
    assert!(cache.get(&key).await.is_none(), "brought back in L1");
}
