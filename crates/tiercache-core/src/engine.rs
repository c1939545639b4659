//! The engine: [`TieredCache`] ties L1, the optional shared tier, single
//! flight, the clock and the counters together.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::flight::{FlightError, FlightResult, Flights, Follower, Join, Leader, Waited};
use crate::l1::L1;
use crate::stats::{Counters, bump};
use crate::{
    CacheKey, Clock, Entry, FleetJoin, FleetLock, Freshness, Invalidation, InvalidationSink,
    KeyHash, KeyPattern, LockAttempt, Policy, PolicyError, Source, Stats, SystemClock, Tier, Times,
    Unlocked, Value,
};

/// A two-tier cache engine. Cheap to clone: clones share everything.
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::{CacheKey, Fill, Lookup, Policy, TieredCache, Value};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = TieredCache::builder().l1_capacity(64 * 1024 * 1024).build()?;
/// let policy = Policy::ttl(Duration::from_secs(30));
/// let key = CacheKey::new("user:7");
/// cache.store(&key, Fill::new(Value::from_body("hello")), &policy);
/// match cache.lookup(&key, &policy, |_| true) {
///     Lookup::Fresh { entry, .. } => assert_eq!(entry.value().body, "hello"),
///     _ => unreachable!(),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TieredCache {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) l1: L1,
    l2: Option<Arc<dyn Tier>>,
    flights: Arc<Flights>,
    clock: Arc<dyn Clock>,
    counters: Arc<Counters>,
    rng: Mutex<SmallRng>,
    /// Keys whose last response could not be shared, until when (hit-for-miss).
    uncacheable: moka::sync::Cache<KeyHash, SystemTime>,
    /// Tag → the keys this instance stored with it (tag invalidation without L2).
    tags: moka::sync::Cache<Bytes, Arc<Mutex<HashSet<KeyHash>>>>,
}

impl fmt::Debug for TieredCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieredCache")
            .field("l1", &self.inner.l1)
            .field("l2", &self.inner.l2)
            .finish()
    }
}

/// The result of an L1 lookup.
#[derive(Debug)]
pub enum Lookup {
    /// A fresh entry: answer it.
    Fresh {
        /// The entry.
        entry: Entry,
        /// Fresh lifetime left.
        remaining: Duration,
        /// XFetch fired: answer it and refresh in the background.
        refresh: bool,
    },
    /// Stale, inside stale-while-revalidate: answer it and refresh in the background.
    Stale {
        /// The entry.
        entry: Entry,
    },
    /// Nothing to answer with; load it.
    Miss {
        /// A stale entry inside stale-if-error: the answer if the load fails.
        fallback: Option<Entry>,
    },
}

/// Why [`TieredCache::get_or_load`] has no value.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError<E> {
    /// The loader failed.
    Loader(E),
    /// The loader panicked (this caller's, or the one it waited on).
    Panicked,
}

impl<E: fmt::Display> fmt::Display for LoadError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Loader(e) => write!(f, "loading the value failed: {e}"),
            LoadError::Panicked => f.write_str("loading the value panicked"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for LoadError<E> {}

/// Where a fill's fresh lifetime comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// The route's ttl, jittered both ways.
    Route,
    /// The route's negative ttl (404, 410), jittered both ways.
    Negative,
    /// Declared by the origin (what is left of it): jitter only shortens it.
    Declared(Duration),
}

/// A value to store, with what the engine needs besides the policy.
#[derive(Debug, Clone)]
pub struct Fill {
    value: Value,
    variant: Bytes,
    origin_latency: Duration,
    lifetime: Lifetime,
    stale_while_revalidate: Option<Duration>,
    stale_if_error: Option<Duration>,
    no_stale: bool,
    initial_age: Duration,
    tags: Vec<Bytes>,
}

impl Fill {
    /// A fill of `value`, no variant, zero origin latency.
    pub fn new(value: Value) -> Self {
        Self {
            value,
            variant: Bytes::new(),
            origin_latency: Duration::ZERO,
            lifetime: Lifetime::Route,
            stale_while_revalidate: None,
            stale_if_error: None,
            no_stale: false,
            initial_age: Duration::ZERO,
            tags: Vec::new(),
        }
    }

    /// Tags (surrogate keys) to record the entry under, for
    /// [`TieredCache::invalidate_tag`].
    pub fn tags(mut self, tags: Vec<Bytes>) -> Self {
        self.tags = tags;
        self
    }

    /// Where the fresh lifetime comes from (default: the route's ttl).
    pub fn lifetime(mut self, lifetime: Lifetime) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The origin's own stale windows (RFC 5861), overriding the policy's.
    pub fn stale_windows(
        mut self,
        while_revalidate: Option<Duration>,
        if_error: Option<Duration>,
    ) -> Self {
        self.stale_while_revalidate = while_revalidate;
        self.stale_if_error = if_error;
        self
    }

    /// Never serve this entry stale (the origin said `must-revalidate`,
    /// `proxy-revalidate` or `no-cache`).
    pub fn no_stale(mut self, on: bool) -> Self {
        self.no_stale = on;
        self
    }

    /// The age the origin reported (`Age`), so stored ages count from its answer.
    pub fn initial_age(mut self, age: Duration) -> Self {
        self.initial_age = age;
        self
    }

    /// The variant bytes a reader must match (see [`Entry::variant`]).
    pub fn variant(mut self, variant: Bytes) -> Self {
        self.variant = variant;
        self
    }

    /// How long the origin took to produce the value (δ).
    pub fn origin_latency(mut self, took: Duration) -> Self {
        self.origin_latency = took;
        self
    }
}

impl TieredCache {
    /// Starts building an engine.
    pub fn builder() -> TieredCacheBuilder {
        TieredCacheBuilder::default()
    }

    /// The engine's clock reading.
    pub fn now(&self) -> SystemTime {
        self.inner.clock.now()
    }

    /// Looks `key` up in L1 under `policy` (see [`lookup_at`](Self::lookup_at)).
    pub fn lookup(
        &self,
        key: &CacheKey,
        policy: &Policy,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Lookup {
        self.lookup_at(key, self.now(), policy, accept)
    }

    /// Looks `key` up in L1 as of `now` (a reading of [`now`](Self::now) the
    /// caller already took, so one request reads the clock once).
    ///
    /// A dead entry is removed (lazy expiry). An entry `accept` refuses (the
    /// HTTP layer checks the variant there) is a miss. A fresh entry is an L1
    /// hit, with `refresh` set when XFetch fires; a stale one inside
    /// stale-while-revalidate is [`Lookup::Stale`] (counted as stale served);
    /// past that but inside stale-if-error it comes back as the miss's fallback.
    pub fn lookup_at(
        &self,
        key: &CacheKey,
        now: SystemTime,
        policy: &Policy,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Lookup {
        let Some(entry) = self.inner.l1.get(&key.hash(), now) else {
            return Lookup::Miss { fallback: None };
        };
        if entry.key() != key.full() || !accept(&entry) {
            return Lookup::Miss { fallback: None };
        }
        match entry.freshness(now) {
            Freshness::Fresh(remaining) => {
                bump(&self.inner.counters.hits_l1);
                let refresh = self.xfetch_fires(&entry, remaining, policy.beta());
                if refresh {
                    bump(&self.inner.counters.early_refreshes);
                }
                Lookup::Fresh {
                    entry,
                    remaining,
                    refresh,
                }
            }
            Freshness::Stale => Lookup::Stale { entry },
            Freshness::StaleIfError => Lookup::Miss {
                fallback: Some(entry),
            },
            Freshness::Dead => Lookup::Miss { fallback: None },
        }
    }

    /// XFetch (Vattani et al., VLDB 2015): fire when `δ·β·(−ln u) ≥ remaining`,
    /// `u` uniform in (0, 1]. The probability is `exp(−remaining/(δβ))`; far
    /// from expiry it is below 1e-17 and no random number is drawn.
    fn xfetch_fires(&self, entry: &Entry, remaining: Duration, beta: f64) -> bool {
        let scale = entry.origin_latency().as_secs_f64() * beta;
        if scale <= 0.0 || remaining.as_secs_f64() > 40.0 * scale {
            return false;
        }
        let u: f64 = 1.0 - self.inner.rng.lock().unwrap().random::<f64>();
        scale * -u.ln() >= remaining.as_secs_f64()
    }

    /// Counts a stale entry served (stale-while-revalidate, stale-if-error, soft timeout).
    pub fn record_stale_served(&self) {
        bump(&self.inner.counters.stale_served);
    }

    /// Takes the lead of a background refresh for `key`, if nobody is loading
    /// it already (not counted as a miss or a coalesced wait).
    pub fn try_lead(&self, key: &CacheKey) -> Option<Leader> {
        match self.inner.flights.join(key.hash()) {
            Join::Leader(leader) => Some(leader),
            Join::Follower(_) => None,
        }
    }

    /// Joins the single flight for `key` (a follower is counted as coalesced).
    pub fn join(&self, key: &CacheKey) -> Join {
        let join = self.inner.flights.join(key.hash());
        if matches!(join, Join::Follower(_)) {
            bump(&self.inner.counters.coalesced);
        }
        join
    }

    /// Waits on a leader for at most the policy's `lock_timeout`; a timeout is counted.
    pub async fn wait(&self, follower: Follower, policy: &Policy) -> Waited {
        let waited = follower.wait(policy.lock_wait()).await;
        if matches!(waited, Waited::TimedOut) {
            bump(&self.inner.counters.lock_timeouts);
        }
        waited
    }

    /// The L1 entry for `key` whatever its freshness (dead ones excepted),
    /// without counting anything: the HTTP layer takes validators from it.
    pub fn peek(&self, key: &CacheKey) -> Option<Entry> {
        self.inner
            .l1
            .get(&key.hash(), self.now())
            .filter(|e| e.key() == key.full())
    }

    /// L1 expiry-index records (for tests of its bound).
    pub fn l1_index_records(&self) -> usize {
        self.inner.l1.index_records()
    }

    /// Number of keys with a load in flight.
    pub fn in_flight(&self) -> usize {
        self.inner.flights.in_flight()
    }

    /// Reads `key` from the shared tier, if there is one; a hit that `accept`
    /// agrees with is promoted to L1 for no longer than the tier's remaining
    /// TTL. Tier errors are counted and read as a miss. The caller counts the
    /// answer with [`record_served`](Self::record_served).
    pub async fn lookup_l2(
        &self,
        key: &CacheKey,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Option<Entry> {
        let l2 = self.inner.l2.as_ref()?;
        let hit = match l2.get(key).await {
            Ok(Some(hit)) => hit,
            Ok(None) => return None,
            Err(e) => {
                bump(&self.inner.counters.l2_errors);
                if e.is_timeout() {
                    bump(&self.inner.counters.l2_timeouts);
                }
                return None;
            }
        };
        let now = self.now();
        if hit.entry.key() != key.full()
            || !matches!(hit.entry.freshness(now), Freshness::Fresh(_))
            || !accept(&hit.entry)
        {
            return None;
        }
        let promoted = Entry::new(
            hit.entry.key().clone(),
            hit.entry.variant().clone(),
            hit.entry.value().clone(),
            hit.entry.times().capped(now + hit.remaining),
            hit.entry.origin_latency(),
        );
        self.inner.l1.insert(key.hash(), promoted.clone());
        Some(promoted)
    }

    /// Stores a fill in L1 and (queued) in L2. The fresh lifetime is drawn now
    /// from the policy's jitter band (or, for a lifetime the origin declared,
    /// from below it); the stale windows follow it; L2's `PX` is the whole
    /// hard lifetime. Clears any hit-for-miss mark.
    pub fn store(&self, key: &CacheKey, fill: Fill, policy: &Policy) -> Entry {
        let now = self.now();
        let fresh = {
            let mut rng = self.inner.rng.lock().unwrap();
            match fill.lifetime {
                Lifetime::Route => policy.draw_ttl(&mut *rng),
                Lifetime::Negative => policy.draw_negative_ttl(&mut *rng),
                Lifetime::Declared(d) => policy.draw_origin_ttl(d, &mut *rng),
            }
        };
        // A negative entry is not served stale on the route's say-so: the
        // resource may exist by now. Only the origin's own windows apply.
        let (route_swr, route_sie) = match fill.lifetime {
            Lifetime::Negative => (Duration::ZERO, Duration::ZERO),
            _ => (policy.swr_window(), policy.sie_window()),
        };
        let (swr, sie) = if fill.no_stale {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (
                fill.stale_while_revalidate.unwrap_or(route_swr),
                fill.stale_if_error.unwrap_or(route_sie),
            )
        };
        let fresh_until = now + fresh;
        let times = Times {
            created_at: now.checked_sub(fill.initial_age).unwrap_or(now),
            fresh_until,
            stale_until: fresh_until + swr,
            error_until: fresh_until + sie,
            hard_until: fresh_until + swr.max(sie),
        };
        let entry = Entry::new(
            key.full().clone(),
            fill.variant,
            fill.value,
            times,
            fill.origin_latency,
        );
        self.insert(key, entry.clone(), fresh + swr.max(sie), &fill.tags);
        entry
    }

    fn insert(&self, key: &CacheKey, entry: Entry, l2_ttl: Duration, tags: &[Bytes]) {
        self.inner.uncacheable.invalidate(&key.hash());
        if let Some(l2) = &self.inner.l2 {
            l2.put(key, &entry, l2_ttl, tags);
        }
        for tag in tags {
            let keys = self.inner.tags.get_with(tag.clone(), Default::default);
            let mut keys = keys.lock().unwrap_or_else(|e| e.into_inner());
            if keys.len() < Self::MAX_KEYS_PER_TAG {
                keys.insert(key.hash());
            }
        }
        self.inner.l1.insert(key.hash(), entry);
    }

    /// Keys remembered per tag in this process (the shared tier keeps its own index).
    const MAX_KEYS_PER_TAG: usize = 100_000;

    /// Reads `key` without loading: a fresh L1 entry, else a fresh L2 one
    /// (promoted). Not counted as a hit or a miss.
    pub async fn get(&self, key: &CacheKey) -> Option<Value> {
        let now = self.now();
        if let Some(entry) = self.inner.l1.get(&key.hash(), now)
            && entry.key() == key.full()
            && matches!(entry.freshness(now), Freshness::Fresh(_))
        {
            return Some(entry.value().clone());
        }
        self.lookup_l2(key, |_| true)
            .await
            .map(|e| e.value().clone())
    }

    /// Stores `value` under `key` with `policy`'s ttl (the programmatic `put`).
    pub fn put(&self, key: &CacheKey, value: Value, policy: &Policy) -> Entry {
        self.store(key, Fill::new(value), policy)
    }

    /// Sets the time `key` has left to `ttl` from now, in L1 and L2 (stale
    /// windows dropped). Returns whether there was an entry to expire.
    pub async fn expire(&self, key: &CacheKey, ttl: Duration) -> bool {
        let now = self.now();
        let current = match self.inner.l1.get(&key.hash(), now) {
            Some(e) if e.key() == key.full() => Some(e),
            _ => self.lookup_l2(key, |_| true).await,
        };
        let Some(entry) = current else {
            return false;
        };
        let times = Times::fresh(entry.times().created_at.min(now), now + ttl);
        let renewed = Entry::new(
            entry.key().clone(),
            entry.variant().clone(),
            entry.value().clone(),
            times,
            entry.origin_latency(),
        );
        self.insert(key, renewed, ttl, &[]);
        true
    }

    /// Returns `key`'s value, loading it with `loader` on a miss: one load per
    /// key however many callers miss together (they wait, at most
    /// `lock_timeout`, then load themselves). The load runs in its own task,
    /// so a caller that goes away does not cancel it; the value is stored
    /// with `policy`. L2 is read before the loader runs.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60));
    /// let key = CacheKey::new("report");
    /// let v = cache.get_or_load(&key, &policy, || async { Ok::<_, ()>(Value::from_body("built")) }).await;
    /// assert_eq!(v.unwrap().body, "built");
    /// let again = cache.get_or_load(&key, &policy, || async { Err::<Value, _>("not called") }).await;
    /// assert_eq!(again.unwrap().body, "built");
    /// # }
    /// ```
    pub async fn get_or_load<F, Fut, E>(
        &self,
        key: &CacheKey,
        policy: &Policy,
        loader: F,
    ) -> Result<Value, LoadError<E>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Value, E>> + Send + 'static,
        E: Send + 'static,
    {
        if let Lookup::Fresh { entry, .. } | Lookup::Stale { entry } =
            self.lookup(key, policy, |_| true)
        {
            return Ok(entry.value().clone());
        }
        let follower = match self.join(key) {
            Join::Leader(leader) => {
                let (cache, key, policy) = (self.clone(), key.clone(), policy.clone());
                let task = tokio::spawn(async move {
                    if let Some(entry) = cache.lookup_l2(&key, |_| true).await {
                        cache.record_served(Source::L2);
                        leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
                        return Ok(entry.value().clone());
                    }
                    cache.record_served(Source::Origin);
                    let started = tokio::time::Instant::now();
                    let loaded = loader().await;
                    cache.record_origin_load(started.elapsed());
                    match loaded {
                        Ok(value) => {
                            let fill = Fill::new(value).origin_latency(started.elapsed());
                            let entry = cache.store(&key, fill, &policy);
                            leader.complete(FlightResult::Shared(entry.clone(), Source::Origin));
                            Ok(entry.value().clone())
                        }
                        Err(e) => {
                            leader.complete(FlightResult::Released);
                            Err(LoadError::Loader(e))
                        }
                    }
                });
                return match task.await {
                    Ok(result) => result,
                    Err(_) => Err(LoadError::Panicked),
                };
            }
            Join::Follower(follower) => follower,
        };
        match self.wait(follower, policy).await {
            Waited::Done(FlightResult::Shared(entry, source)) => {
                self.record_served(source);
                Ok(entry.value().clone())
            }
            Waited::Done(FlightResult::Failed(FlightError::Panicked)) => Err(LoadError::Panicked),
            _ => {
                self.record_served(Source::Origin);
                let started = tokio::time::Instant::now();
                let value = loader().await.map_err(LoadError::Loader)?;
                self.record_origin_load(started.elapsed());
                let fill = Fill::new(value).origin_latency(started.elapsed());
                Ok(self.store(key, fill, policy).value().clone())
            }
        }
    }

    /// Remembers `key` as uncacheable for the policy's hit-for-miss time.
    pub fn mark_uncacheable(&self, key: &CacheKey, policy: &Policy) {
        let until = self.now() + policy.hit_for_miss();
        self.inner.uncacheable.insert(key.hash(), until);
    }

    /// Whether `key` was recently found uncacheable (requests then go straight
    /// to the origin instead of queueing behind one another).
    pub fn is_uncacheable(&self, key: &CacheKey) -> bool {
        match self.inner.uncacheable.get(&key.hash()) {
            Some(until) if until > self.now() => true,
            Some(_) => {
                self.inner.uncacheable.invalidate(&key.hash());
                false
            }
            None => false,
        }
    }

    /// Removes `key` from L1 and from the shared tier, and from every other
    /// instance's L1 (through the tier's messages).
    pub async fn invalidate(&self, key: &CacheKey) {
        self.invalidate_keys(std::slice::from_ref(key)).await;
    }

    /// Removes `keys` everywhere, like [`invalidate`](Self::invalidate), in one message.
    pub async fn invalidate_keys(&self, keys: &[CacheKey]) {
        let hashes = self.inner.drop_keys(keys);
        self.invalidate_shared(Invalidation::Keys(hashes)).await;
    }

    /// Removes every entry stored with `tag` (see [`Fill::tags`]) from L1,
    /// the shared tier and every instance's L1.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Fill, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60));
    /// let key = CacheKey::new("product:7");
    /// cache.store(&key, Fill::new(Value::from_body("v")).tags(vec!["product-7".into()]), &policy);
    /// cache.invalidate_tag("product-7").await;
    /// assert!(cache.get(&key).await.is_none());
    /// # }
    /// ```
    pub async fn invalidate_tag(&self, tag: impl Into<Bytes>) {
        self.invalidate_tag_and_keys(tag, &[]).await;
    }

    /// Removes every entry stored with `tag` and `keys` too, everywhere, in
    /// one message (what [`invalidate_tag`](Self::invalidate_tag) and
    /// [`invalidate_keys`](Self::invalidate_keys) would do in two).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Fill, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60));
    /// let (tagged, plain) = (CacheKey::new("a"), CacheKey::new("b"));
    /// cache.store(&tagged, Fill::new(Value::from_body("v")).tags(vec!["t".into()]), &policy);
    /// cache.store(&plain, Fill::new(Value::from_body("v")), &policy);
    /// cache.invalidate_tag_and_keys("t", &[plain.clone()]).await;
    /// assert!(cache.get(&tagged).await.is_none() && cache.get(&plain).await.is_none());
    /// # }
    /// ```
    pub async fn invalidate_tag_and_keys(&self, tag: impl Into<Bytes>, keys: &[CacheKey]) {
        let tag = tag.into();
        let mut hashes = self.inner.drop_keys(keys);
        hashes.extend(self.inner.drop_tag(&tag));
        self.invalidate_shared(Invalidation::Tag(tag, hashes)).await;
    }

    /// Removes every key `pattern` matches from L1, the shared tier and
    /// every instance's L1. L1 is scanned (O(entries)); the shared tier
    /// applies the pattern as it sees fit (the Valkey tier records a ban
    /// that its reads check).
    pub async fn invalidate_prefix(&self, pattern: KeyPattern) {
        self.inner.drop_matching(&pattern);
        self.invalidate_shared(Invalidation::Prefix(pattern)).await;
    }

    async fn invalidate_shared(&self, invalidation: Invalidation) {
        if let Some(l2) = &self.inner.l2
            && l2.invalidate(invalidation).await.is_err()
        {
            bump(&self.inner.counters.l2_errors);
        }
    }

    /// Before an origin load for `key` (its L2 read missed): takes the
    /// fleet-wide fill lock, or waits for the instance holding it and
    /// returns what it stored. Without a shared tier that has locks, or when
    /// it fails, the lock is [`FleetLock::local`] and the local single flight
    /// alone protects the origin. A wait lasts at most the policy's
    /// `lock_timeout` (or the lock's own remaining time, if shorter: a lock
    /// whose owner died expires, and this instance takes over); after it the
    /// request loads without the lock (counted as a lock timeout).
    pub async fn lead_fleet(
        &self,
        key: &CacheKey,
        policy: &Policy,
        accept: impl Fn(&Entry) -> bool,
    ) -> FleetJoin {
        let Some(l2) = self.inner.l2.clone() else {
            return FleetJoin::Lead(FleetLock::local());
        };
        let wait = policy.lock_wait();
        let held_for = match l2.try_lock(key, wait).await {
            Ok(LockAttempt::Acquired(token)) => {
                return FleetJoin::Lead(FleetLock::held(l2, key.clone(), token));
            }
            Ok(LockAttempt::Held(left)) => left,
            Ok(_) => return FleetJoin::Lead(FleetLock::local()),
            Err(_) => {
                bump(&self.inner.counters.l2_errors);
                return FleetJoin::Lead(FleetLock::local());
            }
        };
        bump(&self.inner.counters.coalesced);
        // A little past the lock's own end, so an expired lock is seen gone.
        let bound = wait.min(held_for + Duration::from_millis(20));
        // Passed: the owner's answer may not be shared; load without a lock.
        if l2.wait_unlock(key, bound).await.unwrap_or(Unlocked::Gone) == Unlocked::Passed {
            return FleetJoin::Lead(FleetLock::local());
        }
        if let Some(entry) = self.lookup_l2(key, &accept).await {
            return FleetJoin::Filled(entry);
        }
        match l2.try_lock(key, wait).await {
            Ok(LockAttempt::Acquired(token)) => {
                FleetJoin::Lead(FleetLock::held(l2, key.clone(), token))
            }
            _ => {
                bump(&self.inner.counters.lock_timeouts);
                FleetJoin::Lead(FleetLock::local())
            }
        }
    }

    /// Counts a request answered from `source` after an L1 miss: `L2` as an
    /// L2 hit, `Origin` as a miss. (Fresh L1 hits are counted by [`lookup`](Self::lookup).)
    pub fn record_served(&self, source: Source) {
        let c = &self.inner.counters;
        bump(match source {
            Source::L1 => &c.hits_l1,
            Source::L2 => &c.hits_l2,
            Source::Origin => &c.misses,
        });
    }

    /// Counts one origin call and its latency (δ).
    pub fn record_origin_load(&self, took: Duration) {
        self.inner.counters.origin_load(took);
    }

    /// Counts a request that skipped the cache, by reason (a static token).
    pub fn record_bypass(&self, reason: &'static str) {
        self.inner.counters.bypass(reason);
    }

    /// Hits (any tier, stale included) over lookups so far.
    pub fn hit_ratio(&self) -> f64 {
        self.inner.counters.hit_ratio()
    }

    /// A snapshot of every counter.
    pub fn stats(&self) -> Stats {
        let l2 = self
            .inner
            .l2
            .as_ref()
            .map(|t| t.report())
            .unwrap_or_default();
        self.inner.counters.snapshot(l2)
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
}

impl InvalidationSink for Inner {
    fn apply(&self, invalidation: &Invalidation) {
        match invalidation {
            Invalidation::Keys(hashes) => self.drop_hashes(hashes),
            Invalidation::Tag(tag, hashes) => {
                self.drop_tag(tag);
                self.drop_hashes(hashes);
            }
            Invalidation::Prefix(pattern) => self.drop_matching(pattern),
        }
    }

    fn resync(&self) {
        self.l1.clear();
        self.tags.invalidate_all();
    }
}

impl Inner {
    /// Drops the L1 entries recorded under `tag`; returns their keys.
    fn drop_tag(&self, tag: &Bytes) -> Vec<KeyHash> {
        let Some(keys) = self.tags.remove(tag) else {
            return Vec::new();
        };
        let keys: Vec<KeyHash> = keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .collect();
        self.drop_hashes(&keys);
        keys
    }

    /// Drops `keys` from L1; returns their hashes (for the shared tier).
    fn drop_keys(&self, keys: &[CacheKey]) -> Vec<KeyHash> {
        let hashes: Vec<KeyHash> = keys.iter().map(CacheKey::hash).collect();
        self.drop_hashes(&hashes);
        hashes
    }

    fn drop_hashes(&self, hashes: &[KeyHash]) {
        hashes.iter().for_each(|h| self.l1.invalidate(h));
    }

    fn drop_matching(&self, pattern: &KeyPattern) {
        self.l1
            .remove_where(|entry| pattern.matches_full(entry.key()));
    }

    fn sweep(&self) -> u64 {
        let reclaimed = self.l1.sweep();
        self.uncacheable.run_pending_tasks();
        bump(&self.counters.sweeps);
        reclaimed
    }
}

/// Builds a [`TieredCache`]; see [`TieredCache::builder`].
#[derive(Debug)]
pub struct TieredCacheBuilder {
    l1_capacity: u64,
    l2: Option<Arc<dyn Tier>>,
    clock: Arc<dyn Clock>,
    sweep_interval: Option<Duration>,
    rng_seed: Option<u64>,
}

impl Default for TieredCacheBuilder {
    fn default() -> Self {
        Self {
            l1_capacity: TieredCacheBuilder::DEFAULT_L1_CAPACITY,
            l2: None,
            clock: Arc::new(SystemClock),
            sweep_interval: Some(TieredCacheBuilder::DEFAULT_SWEEP_INTERVAL),
            rng_seed: None,
        }
    }
}

impl TieredCacheBuilder {
    /// Default L1 byte budget: 256 MiB.
    pub const DEFAULT_L1_CAPACITY: u64 = 256 * 1024 * 1024;
    /// Default sweeper tick: 1 s.
    pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

    /// L1's budget in bytes (keys, headers and bodies, as weighed).
    pub fn l1_capacity(mut self, bytes: u64) -> Self {
        self.l1_capacity = bytes;
        self
    }

    /// A shared second tier (e.g. `tiercache_valkey::ValkeyTier`).
    pub fn l2(mut self, tier: impl Tier) -> Self {
        self.l2 = Some(Arc::new(tier));
        self
    }

    /// A shared second tier already behind an `Arc`.
    pub fn l2_shared(mut self, tier: Arc<dyn Tier>) -> Self {
        self.l2 = Some(tier);
        self
    }

    /// The clock every freshness decision uses (default: [`SystemClock`]).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// How often the sweeper reclaims expired entries; `None` disables the
    /// tick (reads still expire lazily, and moka's bound still applies).
    pub fn sweep_interval(mut self, interval: Option<Duration>) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Seeds the jitter RNG, for reproducible tests and experiments.
    pub fn rng_seed(mut self, seed: u64) -> Self {
        self.rng_seed = Some(seed);
        self
    }

    /// Builds the engine. With a sweep interval it must run inside a Tokio
    /// runtime, which the sweeper task runs on; the task ends with the engine.
    pub fn build(self) -> Result<TieredCache, BuildError> {
        if self.l1_capacity == 0 {
            return Err(BuildError::Config(PolicyError {
                field: "l1_capacity",
                value: "0".into(),
                allowed: "at least 1 byte",
            }));
        }
        if self.sweep_interval.is_some_and(|i| i.is_zero()) {
            return Err(BuildError::Config(PolicyError {
                field: "sweep_interval",
                value: "0s".into(),
                allowed: "greater than 0, or None to disable the sweeper",
            }));
        }
        let runtime = match self.sweep_interval {
            Some(_) => {
                Some(tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?)
            }
            None => None,
        };
        let counters = Arc::new(Counters::default());
        let rng = match self.rng_seed {
            Some(seed) => SmallRng::seed_from_u64(seed),
            None => SmallRng::from_os_rng(),
        };
        let inner = Arc::new(Inner {
            l1: L1::new(self.l1_capacity, self.clock.clone(), counters.clone()),
            l2: self.l2,
            flights: Arc::default(),
            clock: self.clock,
            counters,
            rng: Mutex::new(rng),
            uncacheable: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(Policy::DEFAULT_HIT_FOR_MISS_TTL * 60)
                .build(),
            tags: moka::sync::Cache::builder().max_capacity(100_000).build(),
        });
        if let Some(l2) = &inner.l2 {
            let sink: Weak<dyn InvalidationSink> = Arc::downgrade(&inner) as _;
            l2.listen(sink);
        }
        if let (Some(handle), Some(interval)) = (runtime, self.sweep_interval) {
            handle.spawn(sweeper(Arc::downgrade(&inner), interval));
        }
        Ok(TieredCache { inner })
    }
}

async fn sweeper(engine: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        // moka's housekeeping can take a while on a large cache: keep it off
        // the async workers.
        let _ = tokio::task::spawn_blocking(move || engine.sweep()).await;
    }
}

/// The engine could not be built.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// A setting is out of range.
    Config(PolicyError),
    /// A sweep interval was set but no Tokio runtime is running.
    NoRuntime,
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Config(e) => write!(f, "{e}"),
            BuildError::NoRuntime => f.write_str(
                "the cache's sweeper needs a Tokio runtime: build the cache inside one, \
                 or disable the sweeper with `.sweep_interval(None)`",
            ),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Config(e) => Some(e),
            BuildError::NoRuntime => None,
        }
    }
}

impl From<PolicyError> for BuildError {
    fn from(e: PolicyError) -> Self {
        BuildError::Config(e)
    }
}

#[cfg(test)]
impl TieredCache {
    pub(crate) fn inner_for_tests(&self) -> &Inner {
        &self.inner
    }
}
