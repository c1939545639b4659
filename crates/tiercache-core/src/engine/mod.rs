//! The engine: [`TieredCache`] ties L1, the optional shared tier, single
//! flight, the clock and the counters together, and owns the one sequence
//! every caller goes through ([`TieredCache::fetch`]).
//!
//! One module per concept: `builder` (settings, the sweeper), `store` (what
//! a fill becomes), `read` (L1 and L2 reads), `fetch` (the orchestration:
//! hits, refreshes, the flight, the origin), `fleet` (the shared fill lock),
//! `journal` and `invalidate` (invalidations, and fills they overtake), `api`
//! (the programmatic calls: get, put, get_or_load, expire, …).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rand::rngs::SmallRng;

use crate::flight::Flights;
use crate::l1::L1;
use crate::stats::{Counters, bump};
use crate::{Clock, KeyHash, Stats, Tier};

mod alone;
mod api;
mod builder;
mod detach;
mod fetch;
mod fill;
mod fleet;
mod invalidate;
mod journal;
mod miss;
mod outbox;
pub(crate) mod read;
mod store;
mod tag_index;
mod tags;

pub use api::{Commit, LoadError};
pub use builder::{BuildError, TieredCacheBuilder};
pub use detach::outliving_the_caller;
pub use fetch::{Begin, Hit, Miss, Refresh};
pub use outbox::Queued;
pub use store::{Fill, Lifetime};

use journal::Journal;
use outbox::Outbox;

/// A two-tier cache engine. Cheap to clone: clones share everything.
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = TieredCache::builder().l1_capacity(64 * 1024 * 1024).build()?;
/// let policy = Policy::ttl(Duration::from_secs(30)).build()?;
/// let key = CacheKey::new("user:7");
/// cache.put(&key, Value::from_body("hello"), &policy);
/// assert_eq!(cache.get(&key).await.unwrap().body, "hello");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TieredCache {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) l1: L1,
    /// The byte budget the engine was built with: L1's, and the
    /// hit-for-miss marks' share of it (see [`marks_room`]).
    budget: u64,
    l2: Option<Arc<dyn Tier>>,
    flights: Arc<Flights>,
    clock: Arc<dyn Clock>,
    counters: Arc<Counters>,
    rng: Mutex<SmallRng>,
    /// Keys whose last response could not be shared, until when (hit-for-miss).
    pub(crate) uncacheable: moka::sync::Cache<KeyHash, SystemTime>,
    /// Keys whose last load met the origin failing, and until when their
    /// stale copy answers without another (see [`RETRY_FAILING_AFTER`]);
    /// at most [`FAILING_KEYS`].
    pub(crate) failing: moka::sync::Cache<KeyHash, SystemTime>,
    /// Tag → the keys this instance stored with it (tag invalidation without L2).
    pub(crate) tags: tag_index::TagIndex,
    /// The tag index lost a tag to its bound: the next tag invalidation
    /// cannot know every live key under it, and drops all of L1 instead.
    tags_incomplete: std::sync::atomic::AtomicBool,
    /// The shared tier's message stream is lost (see
    /// [`InvalidationSink::deaf`](crate::InvalidationSink::deaf)).
    deaf: std::sync::atomic::AtomicBool,
    /// Keys recorded across all tags (bounded by `tag_room`).
    tag_keys: std::sync::atomic::AtomicUsize,
    /// The records all tags share (see [`Inner::tag_room`]).
    tag_room: usize,
    /// A fill found the index past `tags_prune_at`: pruned once out of
    /// the journal's lock.
    tags_prune_due: std::sync::atomic::AtomicBool,
    /// Records past which the tag index is pruned (see [`tags`]).
    tags_prune_at: std::sync::atomic::AtomicUsize,
    /// Recent invalidations, so a fill they overtook is not stored.
    journal: Journal,
    /// Invalidations on their way to the shared tier, and their tombstones.
    outbox: Arc<Outbox>,
    /// Slots for background refreshes (see `max_refreshes`).
    refreshes: Arc<tokio::sync::Semaphore>,
    /// Slots for fills whose caller left (see `max_detached_fills`).
    detached: Arc<tokio::sync::Semaphore>,
    /// See [`TieredCache::shared_state`].
    shared: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

/// How long after a load of a key met the origin failing (its error, or
/// an answer that broke off) the key's stale entry answers without
/// another: inside stale-while-revalidate no refresh starts, inside
/// stale-if-error no load. A failing origin is asked once a second per
/// key, not by every stale hit (a black-box audit: 24 refreshes a second
/// for one key of 8 clients), nor by each flight back to back (nginx
/// rests a failed upstream `fail_timeout`, 10 s; FusionCache throttles
/// its fail-safe). Its cost: an origin back within the second is asked
/// again at its end.
pub(crate) const RETRY_FAILING_AFTER: Duration = Duration::from_secs(1);

/// The most keys whose origin's failure is remembered (each about a
/// hit-for-miss mark's [`MARK_WEIGHT`], so 3.3 MB at most, beside L1's
/// budget): past it, the oldest are forgotten, and asked at their next
/// stale hit.
pub(crate) const FAILING_KEYS: u64 = 10_000;

/// What one hit-for-miss mark holds: moka's node with its timer, the key
/// hash and the time (~330 bytes measured, from a flood of `private` URLs
/// through the proxy).
pub(crate) const MARK_WEIGHT: u32 = 330;

/// The bytes the hit-for-miss marks may hold for a budget of
/// `l1_capacity`, and the part of it taken out of L1's: a 32nd of the
/// budget (at most ~100,000 marks), so a flood of keys that may not be
/// stored holds the process within its budget beside a full L1. A budget
/// too small for a 32nd to hold 200 marks gets them beside it.
pub(crate) fn marks_room(l1_capacity: u64) -> (u64, u64) {
    let share = l1_capacity / 32;
    let room = share.clamp(
        200 * u64::from(MARK_WEIGHT),
        100_000 * u64::from(MARK_WEIGHT),
    );
    (room, share.min(room))
}

/// A hit-for-miss mark leaves memory when it lapses on the engine's clock
/// (a second later): its policy's `hit_for_miss_ttl`, however long, not a
/// fixed bound.
pub(crate) struct MarkExpiry(pub(crate) Arc<dyn Clock>);

impl MarkExpiry {
    fn bound(&self, until: &SystemTime) -> Option<Duration> {
        let left = until.duration_since(self.0.now()).unwrap_or_default();
        Some(left + Duration::from_secs(1))
    }
}

impl moka::Expiry<KeyHash, SystemTime> for MarkExpiry {
    fn expire_after_create(&self, _: &KeyHash, until: &SystemTime, _: Instant) -> Option<Duration> {
        self.bound(until)
    }

    fn expire_after_update(
        &self,
        _: &KeyHash,
        until: &SystemTime,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        self.bound(until)
    }
}

impl fmt::Debug for TieredCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieredCache")
            .field("l1", &self.inner.l1)
            .field("l2", &self.inner.l2)
            .finish()
    }
}

impl TieredCache {
    /// Starts building an engine.
    pub fn builder() -> TieredCacheBuilder {
        TieredCacheBuilder::default()
    }

    /// The engine's clock reading: every freshness decision is made on it.
    pub fn now(&self) -> SystemTime {
        self.inner.clock.now()
    }

    /// Counts a request that skipped the cache before reaching the engine,
    /// by reason (a static token such as `cookie`, `authorization`, `method`).
    pub fn record_bypass(&self, reason: &'static str) {
        self.inner.counters.bypass(reason);
    }

    /// Hits (any tier, stale included) over lookups so far.
    pub fn hit_ratio(&self) -> f64 {
        self.inner.counters.hit_ratio()
    }

    /// A snapshot of every counter.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = tiercache_core::TieredCache::builder().build().unwrap();
    /// assert_eq!(cache.stats().misses, 0);
    /// # }
    /// ```
    pub fn stats(&self) -> Stats {
        let l2 = self.inner.l2.as_ref();
        self.inner.counters.snapshot(
            l2.map(|t| t.report()).unwrap_or_default(),
            l2.and_then(|t| t.last_failure()),
            self.inner.outbox.pending(),
        )
    }

    /// Runs one sweep now: reclaims every entry past its hard expiry on the
    /// engine's clock. Returns how many were reclaimed.
    pub fn sweep(&self) -> u64 {
        self.inner.sweep()
    }

    /// Entries in L1 (after pending housekeeping).
    pub fn l1_entry_count(&self) -> u64 {
        self.inner.l1.run_pending_tasks();
        self.inner.l1.entry_count()
    }

    /// Bytes held by L1, as weighed (after pending housekeeping).
    pub fn l1_weighted_size(&self) -> u64 {
        self.inner.l1.run_pending_tasks();
        self.inner.l1.weighted_size()
    }

    /// Records in L1's expiry index (bounded by about twice the entries;
    /// none on a clock that keeps the machine's time, see
    /// [`Clock::keeps_machine_time`](crate::Clock::keeps_machine_time)).
    pub fn l1_index_records(&self) -> usize {
        self.inner.l1.index_records()
    }

    /// Whether this instance's L1 holds an entry for `key`, fresh or stale
    /// (dead ones excepted), without reading L2 or counting anything.
    pub fn l1_contains(&self, key: &crate::CacheKey) -> bool {
        self.peek(key, self.now()).is_some()
    }

    /// Drops `key` from this instance's L1 only: L2 and the other instances
    /// keep their copies (to free memory, or to make the next read go to L2).
    /// To remove a value everywhere, [`invalidate`](Self::invalidate) it.
    pub fn forget_local(&self, key: &crate::CacheKey) {
        self.inner.l1.invalidate(&key.hash());
    }

    /// Whether the shared tier is being asked (true without one; false while
    /// a Valkey tier's circuit breaker is open).
    pub fn l2_available(&self) -> bool {
        self.inner.l2.as_ref().is_none_or(|t| t.available())
    }

    /// The byte budget the cache was built with
    /// ([`l1_capacity`](TieredCacheBuilder::l1_capacity)): L1 holds it
    /// less the hit-for-miss marks' 32nd.
    pub fn l1_capacity(&self) -> u64 {
        self.inner.budget
    }

    /// Whether the engine has a shared tier (L2).
    pub fn has_l2(&self) -> bool {
        self.inner.l2.is_some()
    }

    /// How many L1 entries go stale in each of the next `seconds` seconds,
    /// on the engine's clock: the expiry waves to come, before they reach
    /// the origin. Reads at most [`Horizon::SAMPLE`](crate::Horizon::SAMPLE) entries (a fair
    /// sample: moka's iteration is in hash order), scaled to them all.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(30)).jitter(0.0).build().unwrap();
    /// cache.put(&CacheKey::new("k"), Value::from_body("v"), &policy);
    /// let horizon = cache.expiry_horizon(60);
    /// assert_eq!(horizon.buckets.iter().sum::<u64>(), 1);
    /// assert_eq!(horizon.buckets[29], 1); // stale in 29.x seconds
    /// # }
    /// ```
    pub fn expiry_horizon(&self, seconds: usize) -> crate::Horizon {
        self.inner
            .l1
            .horizon(self.now(), seconds, crate::Horizon::SAMPLE)
    }

    /// Keys with an origin load in flight right now.
    pub fn in_flight(&self) -> usize {
        self.inner.flights.in_flight()
    }

    /// State kept once per engine for what is built on it: the first call
    /// for a type makes it with `make`; every later call, from any clone of
    /// this engine, gets that same value. The HTTP layer keeps its `Vary`
    /// bookkeeping here, so layers built apart on one engine (a proxy's
    /// routes, an application's routers) share its one bound.
    ///
    /// ```
    /// # use std::sync::{Arc, atomic::AtomicU64};
    /// # use tiercache_core::TieredCache;
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let a = cache.shared_state(|| AtomicU64::new(7));
    /// let b = cache.clone().shared_state(|| AtomicU64::new(0));
    /// assert!(Arc::ptr_eq(&a, &b));
    /// ```
    pub fn shared_state<T: Any + Send + Sync>(&self, make: impl FnOnce() -> T) -> Arc<T> {
        let mut shared = self.inner.shared.lock().unwrap_or_else(|e| e.into_inner());
        let state = shared
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(make()));
        match Arc::clone(state).downcast::<T>() {
            Ok(state) => state,
            // Stored under its own type id: cannot be another.
            Err(_) => unreachable!("shared state stored under another type"),
        }
    }
}

impl Inner {
    fn sweep(&self) -> u64 {
        let reclaimed = self.l1.sweep();
        self.prune_tags();
        self.uncacheable.run_pending_tasks();
        self.failing.run_pending_tasks();
        bump(&self.counters.sweeps);
        reclaimed
    }
}

#[cfg(test)]
impl TieredCache {
    pub(crate) fn inner_for_tests(&self) -> &Inner {
        &self.inner
    }
}
