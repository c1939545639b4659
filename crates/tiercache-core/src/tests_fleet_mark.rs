//! The fleet's failing mark ([`LockAttempt::Failing`]): a load with a
//! stale copy answers it without asking the origin, and the requests
//! waiting on that load without a copy of their own load on their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::tests_busy::until;
use crate::tests_refresh::fresh_a_second_then_failing_over;
use crate::*;

/// A shared tier that stores nothing and whose fleet lock any load takes,
/// except a load with a stale copy: that one is told, once `gate` lets it
/// through, that another instance met the origin failing.
#[derive(Debug)]
struct MarkedFailing {
    asked: AtomicUsize,
    gate: Semaphore,
}

impl Tier for MarkedFailing {
    fn get<'a>(&'a self, _: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async { Ok(None) })
    }

    fn put(&self, _: &CacheKey, _: &Entry, _: Duration, _: &[bytes::Bytes]) {}

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

    fn try_lock_unless_failing<'a>(
        &'a self,
        _: &'a CacheKey,
        _: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        self.asked.fetch_add(1, SeqCst);
        Box::pin(async {
            self.gate.acquire().await.unwrap().forget();
            Ok(LockAttempt::Failing {
                left: Duration::from_secs(1),
            })
        })
    }
}

/// The leader has a stale-if-error copy and meets the mark; a request
/// that joined its flight after an invalidation took the copy has none.
/// The leader answers its copy; the other loads (nobody asked the origin
/// for it), where it was failed as after a failed load.
#[tokio::test]
async fn a_request_without_a_stale_copy_loads_past_the_fleets_failing_mark() {
    let tier = Arc::new(MarkedFailing {
        asked: AtomicUsize::new(0),
        gate: Semaphore::new(0),
    });
    let clock = MockClock::new();
    let cache = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .l2_shared(tier.clone())
        .build()
        .unwrap();
    let key = CacheKey::new("k");
    let policy = fresh_a_second_then_failing_over().build().unwrap();
    cache.put(&key, Value::from_body("v1"), &policy);
    clock.advance(Duration::from_secs(2));
    let calls = Arc::new(AtomicUsize::new(0));
    let fetch = || {
        let (cache, key, policy, calls) =
            (cache.clone(), key.clone(), policy.clone(), calls.clone());
        tokio::spawn(async move {
            let origin = origin_fn(move |_stale: Option<Entry>| {
                calls.fetch_add(1, SeqCst);
                async { Ok::<_, ()>(Loaded::<()>::Store(Fill::new(Value::from_body("v2")))) }
            });
            match cache.fetch(&key, &policy, origin).await {
                Ok(Fetched::Entry(answer)) => {
                    Ok((answer.entry.value().body.clone(), answer.served))
                }
                Ok(Fetched::Passed { .. }) => panic!("passed"),
                Err(e) => Err(format!("{e:?}")),
            }
        })
    };
    let leader = fetch();
    until("the leader at the lock", || tier.asked.load(SeqCst) == 1).await;
    cache.invalidate(&key).await.unwrap();
    let follower = fetch();
    until("the follower waiting", || cache.stats().coalesced == 1).await;
    tier.gate.add_permits(10);
    let (body, served) = leader.await.unwrap().unwrap();
    assert_eq!(body, "v1");
    assert_eq!(served, Served::Stale(StaleReason::OriginError));
    let (body, _) = follower.await.unwrap().expect("the follower failed");
    assert_eq!(body, "v2");
    assert_eq!(calls.load(SeqCst), 1, "the follower's own load");
}
