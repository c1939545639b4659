//! The one orchestration: L1 and its freshness, refreshes (XFetch,
//! stale-while-revalidate), the single flight and its deadline, L2, the fleet
//! lock, the origin with its soft timeout, stale-if-error, and storage.
//!
//! [`TieredCache::fetch`] runs it in one call. [`TieredCache::begin`] is its
//! first step, synchronous, for callers that keep hits off the async path
//! (the HTTP layer answers a hit without a boxed future); its [`Miss`] and
//! [`Refresh`] carry the rest of the sequence, so no caller re-implements it.

use std::fmt;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::TieredCache;
use super::read::Lookup;
use crate::fleet::{FleetJoin, FleetLock};
use crate::flight::{FlightError, FlightResult, Join, Leader, Waited};
use crate::stats::bump;
use crate::{
    Answer, CacheKey, Entry, Event, FetchError, Fetched, Freshness, Loaded, Origin, Panic, Policy,
    Select, Served, Source, StaleReason,
};

/// The first step of a fetch: an answer now, or the rest of the sequence.
#[derive(Debug)]
#[must_use = "a miss does nothing until it is run with the origin"]
pub enum Begin {
    /// An entry answers now (fresh, or stale inside stale-while-revalidate).
    Hit(Hit),
    /// Nothing answers yet: [`Miss::run`] it with the origin.
    Miss(Miss),
}

/// An entry that answers at once, with the background refresh it calls for.
#[derive(Debug)]
pub struct Hit {
    /// The answer (from L1).
    pub answer: Answer,
    /// Fresh lifetime left (zero when stale).
    pub remaining: Duration,
    /// The engine's clock reading the entry was judged at (frame the
    /// response with it: one reading per request).
    pub at: SystemTime,
    /// XFetch fired on this fresh hit (counted as an early refresh).
    pub early_refresh: bool,
    /// A refresh to start with the origin ([`Refresh::spawn`]): XFetch
    /// fired, or the entry is stale. Dropping it skips the refresh.
    pub refresh: Option<Refresh>,
}

/// The keys of one request: the one it asked for (hit-for-miss marks, the
/// latest entry) and the one it loads under (the requested key, or the key
/// of its variant when the latest entry named it).
#[derive(Debug, Clone)]
struct Keys {
    requested: CacheKey,
    flight: CacheKey,
}

/// The rest of a fetch after an L1 miss: see [`Miss::run`]. (Boxed: a hit
/// never pays for moving it.)
pub struct Miss(Box<MissState>);

struct MissState {
    engine: TieredCache,
    keys: Keys,
    policy: Policy,
    /// An entry to revalidate, or to answer with when the origin fails.
    fallback: Option<Entry>,
    /// Go to the origin (with `fallback`'s validators) without reading L2.
    revalidate: bool,
    /// The key is marked uncacheable: straight to the origin, no flight.
    hit_for_miss: bool,
}

impl fmt::Debug for Miss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Miss")
            .field("key", &self.0.keys.flight)
            .field("revalidate", &self.0.revalidate)
            .field("hit_for_miss", &self.0.hit_for_miss)
            .finish()
    }
}

/// A background refresh of an entry that answered (its flight is already
/// led: nobody else starts one for the key meanwhile).
pub struct Refresh(Box<RefreshState>);

struct RefreshState {
    engine: TieredCache,
    keys: Keys,
    policy: Policy,
    current: Entry,
    leader: Leader,
}

impl fmt::Debug for Refresh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refresh")
            .field("key", &self.0.keys.flight)
            .finish()
    }
}

/// What the leader's fill produced.
enum Filled<T> {
    Entry(Entry, Source, bool),
    Transient(Entry),
    Stale(Entry),
    Passed(T),
}

impl TieredCache {
    /// Answers `key` under `policy`, loading it with `origin` when no tier
    /// may answer: the whole sequence, owned by the engine.
    ///
    /// A fresh L1 entry answers (and XFetch may start a background refresh
    /// through the same single flight); a stale one inside
    /// stale-while-revalidate answers while one refresh runs. Otherwise one
    /// request per key (per fleet, with a shared tier that has locks) reads
    /// L2 and then calls the origin in a task of its own, so a caller that
    /// goes away strands nobody; the others wait at most `lock_timeout` from
    /// the flight's start and get its answer when it may be shared, or the
    /// stale entry when stale-if-error allows. An invalidation that arrives
    /// while a load runs wins: its answer goes to the waiting requests but
    /// is not stored.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Entry, Fetched, Fill, Loaded, Policy, TieredCache, Value, origin_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = TieredCache::builder().build()?;
    /// let policy = Policy::ttl(Duration::from_secs(30)).build()?;
    /// let key = CacheKey::new("report:2026");
    /// let origin = origin_fn(|_stale: Option<Entry>| async {
    ///     Ok::<_, std::io::Error>(Loaded::<()>::Store(Fill::new(Value::from_body("…"))))
    /// });
    /// match cache.fetch(&key, &policy, origin).await? {
    ///     Fetched::Entry(answer) => assert_eq!(answer.entry.value().body, "…"),
    ///     Fetched::Passed { .. } => unreachable!("the origin stored it"),
    ///     _ => unreachable!(),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn fetch<O: Origin>(
        &self,
        key: &CacheKey,
        policy: &Policy,
        origin: O,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        match self.begin(key, policy, &origin) {
            Begin::Hit(hit) => {
                if let Some(refresh) = hit.refresh {
                    refresh.spawn(origin);
                }
                Ok(Fetched::Entry(hit.answer))
            }
            Begin::Miss(miss) => miss.run(origin).await,
        }
    }

    /// The first step of [`fetch`](Self::fetch), without awaiting anything:
    /// an L1 answer (with the refresh it calls for) or the [`Miss`] that
    /// carries the rest. For callers that answer hits without a future.
    pub fn begin<S: Select>(&self, key: &CacheKey, policy: &Policy, select: &S) -> Begin {
        let now = self.now();
        if select.reload() {
            let fallback = self.peek(key, now).filter(|e| select.accepts(e));
            return Begin::Miss(self.miss(key.clone(), key.clone(), policy, fallback, true, now));
        }
        let mut flight = None;
        let mut lookup = self.lookup_at(key, now, policy, select);
        // The latest entry is another variant: its names say which key this
        // request's variant is under.
        if matches!(lookup, Lookup::Miss { fallback: None })
            && let Some(latest) = self.peek(key, now)
            && !select.accepts(&latest)
            && let Some(variant) = select.variant_key(key, &latest)
        {
            lookup = self.lookup_at(&variant, now, policy, select);
            flight = Some(variant);
        }
        let keys = |flight: Option<CacheKey>| Keys {
            requested: key.clone(),
            flight: flight.unwrap_or_else(|| key.clone()),
        };
        match lookup {
            Lookup::Fresh {
                entry,
                remaining,
                refresh,
            } => {
                let early_refresh = refresh;
                let refresh = if refresh {
                    self.refresh(keys(flight), policy, &entry)
                } else {
                    None
                };
                Begin::Hit(Hit {
                    answer: Answer {
                        entry,
                        source: Source::L1,
                        served: Served::Hit,
                        collapsed: false,
                    },
                    remaining,
                    at: now,
                    early_refresh,
                    refresh,
                })
            }
            Lookup::Stale { entry } => {
                bump(&self.inner.counters.stale_served);
                let refresh = self.refresh(keys(flight), policy, &entry);
                Begin::Hit(Hit {
                    answer: Answer {
                        entry,
                        source: Source::L1,
                        served: Served::Stale(StaleReason::Revalidating),
                        collapsed: false,
                    },
                    remaining: Duration::ZERO,
                    at: now,
                    early_refresh: false,
                    refresh,
                })
            }
            Lookup::Revalidate { entry } => {
                let Keys { requested, flight } = keys(flight);
                Begin::Miss(self.miss(requested, flight, policy, Some(entry), true, now))
            }
            Lookup::Miss { fallback } => {
                let Keys { requested, flight } = keys(flight);
                Begin::Miss(self.miss(requested, flight, policy, fallback, false, now))
            }
        }
    }

    fn miss(
        &self,
        requested: CacheKey,
        flight: CacheKey,
        policy: &Policy,
        fallback: Option<Entry>,
        revalidate: bool,
        now: SystemTime,
    ) -> Miss {
        let hit_for_miss = self.is_uncacheable(&requested, now);
        Miss(Box::new(MissState {
            engine: self.clone(),
            keys: Keys { requested, flight },
            policy: policy.clone(),
            fallback,
            revalidate,
            hit_for_miss,
        }))
    }

    /// Leads a background refresh of `current`, unless a load for the key
    /// is already running (it will do).
    fn refresh(&self, keys: Keys, policy: &Policy, current: &Entry) -> Option<Refresh> {
        let leader = self
            .inner
            .flights
            .try_lead(keys.flight.hash(), policy.lock_wait())?;
        Some(Refresh(Box::new(RefreshState {
            engine: self.clone(),
            keys,
            policy: policy.clone(),
            current: current.clone(),
            leader,
        })))
    }

    /// Whether `key` was recently found uncacheable (hit-for-miss).
    pub(crate) fn is_uncacheable(&self, key: &CacheKey, now: SystemTime) -> bool {
        match self.inner.uncacheable.get(&key.hash()) {
            Some(until) if until > now => true,
            Some(_) => {
                self.inner.uncacheable.invalidate(&key.hash());
                false
            }
            None => false,
        }
    }

    /// Remembers `key` as uncacheable for the policy's hit-for-miss time.
    pub(crate) fn mark_uncacheable(&self, key: &CacheKey, policy: &Policy) {
        let until = self
            .now()
            .checked_add(policy.hit_for_miss())
            .unwrap_or_else(|| self.now());
        self.inner.uncacheable.insert(key.hash(), until);
    }

    /// Counts an answer given after an L1 miss.
    fn count(&self, answer: &Answer) {
        let c = &self.inner.counters;
        bump(match (answer.served, answer.source) {
            (Served::Stale(_), _) => &c.stale_served,
            (_, Source::L1) => &c.hits_l1,
            (_, Source::L2) => &c.hits_l2,
            (_, Source::Origin) => &c.misses,
        });
    }

    fn stale_usable(&self, entry: &Entry) -> bool {
        matches!(
            entry.freshness(self.now()),
            Freshness::Stale | Freshness::StaleIfError
        )
    }
}

impl Miss {
    /// Whether the key is marked uncacheable (hit-for-miss): the request
    /// goes to the origin alone, without waiting on anyone.
    pub fn hit_for_miss(&self) -> bool {
        self.0.hit_for_miss
    }

    /// Runs the rest of the fetch with `origin`: see [`TieredCache::fetch`].
    pub async fn run<O: Origin>(
        self,
        origin: O,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        let MissState {
            engine,
            keys,
            policy,
            fallback,
            revalidate,
            hit_for_miss,
        } = *self.0;
        if hit_for_miss {
            engine.record_bypass("hit-for-miss");
            return engine.load_alone(&keys, &policy, origin, false, true).await;
        }
        let mut collapsed = false;
        loop {
            let follower = match engine
                .inner
                .flights
                .join(keys.flight.hash(), policy.lock_wait())
            {
                Join::Leader(leader) => {
                    let lead = Lead {
                        leader,
                        keys,
                        policy,
                        stale: fallback,
                        revalidate,
                        current: None,
                    };
                    return engine.lead(lead, origin, collapsed).await;
                }
                Join::Follower(follower) => follower,
            };
            if !collapsed {
                bump(&engine.inner.counters.coalesced);
                collapsed = true;
            }
            let started = Instant::now();
            let waited = follower.wait().await;
            origin.observe(Event::LockWait(started.elapsed()));
            match waited {
                Waited::Done(FlightResult::Failed(FlightError::Abandoned)) => continue,
                Waited::Done(result) => {
                    return match engine.followed(result, fallback, &origin) {
                        Followed::Answer(answer) => Ok(answer),
                        Followed::Error(e) => Err(e),
                        Followed::Alone => {
                            engine.load_alone(&keys, &policy, origin, true, false).await
                        }
                    };
                }
                // The flight's deadline passed: the next join takes it over
                // (or follows whoever did).
                Waited::TimedOut => {
                    bump(&engine.inner.counters.lock_timeouts);
                    origin.observe(Event::LockTimeout);
                }
            }
        }
    }
}

/// An origin behind a lock: `Sync` for any `Send` origin, so a future may
/// hold a reference to it across an await.
struct Locked<O>(std::sync::Mutex<O>);

impl<O: Select> Select for Locked<O> {
    fn accepts(&self, entry: &Entry) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .accepts(entry)
    }

    fn variant_key(&self, requested: &CacheKey, latest: &Entry) -> Option<CacheKey> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .variant_key(requested, latest)
    }

    fn must_revalidate(&self, entry: &Entry) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .must_revalidate(entry)
    }
}

/// What a follower does with its leader's result.
enum Followed<T, E> {
    Answer(Fetched<T>),
    Error(FetchError<E>),
    /// Load alone: the answer may not be shared, or is another variant.
    Alone,
}

impl Refresh {
    /// Starts the refresh in the background with `origin`: it reads L2 (a
    /// copy newer than the current entry ends it), then calls the origin
    /// with the current entry to revalidate.
    pub fn spawn<O: Origin>(self, origin: O) {
        let RefreshState {
            engine,
            keys,
            policy,
            current,
            leader,
        } = *self.0;
        let lead = Lead {
            leader,
            keys,
            policy,
            stale: Some(current.clone()),
            revalidate: false,
            current: Some(current),
        };
        tokio::spawn(engine.fill(lead, origin));
    }
}

/// A flight this request leads, and how.
struct Lead {
    leader: Leader,
    keys: Keys,
    policy: Policy,
    /// An entry to revalidate, or to answer with when the origin fails.
    stale: Option<Entry>,
    /// Skip L2 and the fleet lock: revalidate `stale` with the origin.
    revalidate: bool,
    /// A refresh of this entry: only a newer copy from L2 replaces it.
    current: Option<Entry>,
}

impl TieredCache {
    /// Leads the flight: the fill runs in a task of its own (a caller that
    /// goes away strands nobody); with a usable stale entry and a soft
    /// timeout, the caller gets the stale entry once the timeout passes.
    async fn lead<O: Origin>(
        &self,
        lead: Lead,
        origin: O,
        collapsed: bool,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        let usable = lead.stale.clone().filter(|e| self.stale_usable(e));
        let soft = lead.policy.soft_timeout();
        let stale_answer = |entry: Entry, why| Answer {
            entry,
            source: Source::L1,
            served: Served::Stale(why),
            collapsed,
        };
        let mut task = tokio::spawn(self.clone().fill(lead, origin));
        let joined = match (usable, soft) {
            (Some(stale), Some(soft)) => match tokio::time::timeout(soft, &mut task).await {
                Ok(joined) => joined,
                // The origin is slow and a stale answer is at hand: give it
                // now; the fill goes on in the background.
                Err(_) => {
                    bump(&self.inner.counters.stale_served);
                    let answer = stale_answer(stale, StaleReason::OriginTimeout);
                    return Ok(Fetched::Entry(answer));
                }
            },
            _ => task.await,
        };
        let filled = match joined {
            Ok(filled) => filled?,
            Err(e) if e.is_panic() => {
                return Err(FetchError::Panicked(Panic(Some(e.into_panic()))));
            }
            Err(_) => return Err(FetchError::Failed),
        };
        let answer = |entry, source, served| {
            let answer = Answer {
                entry,
                source,
                served,
                collapsed,
            };
            self.count(&answer);
            Fetched::Entry(answer)
        };
        Ok(match filled {
            Filled::Entry(entry, source, stored) => {
                let served = match source {
                    Source::Origin => Served::Miss { stored },
                    _ => Served::Hit,
                };
                answer(entry, source, served)
            }
            Filled::Transient(entry) => answer(entry, Source::Origin, Served::Shared),
            Filled::Stale(entry) => {
                answer(entry, Source::L1, Served::Stale(StaleReason::OriginError))
            }
            Filled::Passed(output) => {
                bump(&self.inner.counters.misses);
                Fetched::Passed {
                    output,
                    collapsed,
                    hit_for_miss: false,
                }
            }
        })
    }

    /// The leader's fill: L2 first (unless revalidating), the fleet lock,
    /// then the origin (revalidating the stale entry when there is one, and
    /// falling back to it when the origin fails); stores what may be stored
    /// unless an invalidation overtook the fill; completes the flight.
    async fn fill<O: Origin>(
        self,
        lead: Lead,
        origin: O,
    ) -> Result<Filled<O::Output>, FetchError<O::Error>> {
        let Lead {
            leader,
            keys,
            policy,
            mut stale,
            revalidate,
            current,
        } = lead;
        // Noted before anything is read: an invalidation after this point
        // keeps what this fill reads from being stored.
        let epoch = self.inner.journal.epoch();
        // The origin is asked which entries fit across the awaits below; a
        // lock makes it shareable with them whatever it holds (`Send` only).
        let origin = Locked(std::sync::Mutex::new(origin));
        let newer = |e: &Entry| {
            current
                .as_ref()
                .is_none_or(|c| e.times().created_at > c.times().created_at)
        };
        if !revalidate
            && let Some(entry) = self
                .read_l2(&keys.requested, &keys.flight, epoch, &origin)
                .await
            && newer(&entry)
        {
            if !origin.must_revalidate(&entry) {
                return Ok(self.filled_from_l2(leader, entry));
            }
            stale = Some(entry);
        }
        // One load per key across the fleet: take the shared lock, or wait
        // for the instance that holds it and answer with what it stored.
        let lock = if revalidate {
            FleetLock::local()
        } else {
            let fits = |e: &Entry| origin.accepts(e) && !origin.must_revalidate(e) && newer(e);
            let wait = leader.time_left();
            match self
                .lead_fleet(&keys.flight, &policy, wait, epoch, fits)
                .await
            {
                FleetJoin::Filled(entry) => {
                    return Ok(self.filled_from_l2(leader, entry));
                }
                FleetJoin::Lead(lock) => lock,
            }
        };
        let usable = stale.clone().filter(|e| self.stale_usable(e));
        let origin = origin.0.into_inner().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        let loaded = origin.load(stale).await;
        let took = started.elapsed();
        self.inner.counters.origin_load(took);
        let stand_in = |leader: Leader, stale: Entry| {
            leader.complete(FlightResult::Stale(stale.clone()));
            Filled::Stale(stale)
        };
        match loaded {
            Ok(Loaded::Store(mut fill)) => {
                if fill.origin_latency_unset() {
                    fill = fill.origin_latency(took);
                }
                let (entry, stored) = self.store_since(&keys.flight, fill, &policy, epoch);
                // After the store was queued: the waiting instances read it.
                lock.release(stored);
                leader.complete(FlightResult::Shared(entry.clone(), Source::Origin));
                Ok(Filled::Entry(entry, Source::Origin, stored))
            }
            Ok(Loaded::Share { value, failed }) => {
                lock.release(false);
                match usable.filter(|_| failed) {
                    Some(stale) => Ok(stand_in(leader, stale)),
                    None => {
                        let entry = self.transient(&keys.flight, value, took);
                        leader.complete(FlightResult::Transient(entry.clone(), failed));
                        Ok(Filled::Transient(entry))
                    }
                }
            }
            Ok(Loaded::Pass {
                output,
                failed,
                uncacheable,
            }) => {
                lock.release(false);
                if let Some(stale) = usable.filter(|_| failed) {
                    return Ok(stand_in(leader, stale));
                }
                if uncacheable {
                    self.mark_uncacheable(&keys.requested, &policy);
                }
                leader.complete(FlightResult::Released);
                Ok(Filled::Passed(output))
            }
            Err(e) => {
                lock.release(false);
                match usable {
                    Some(stale) => Ok(stand_in(leader, stale)),
                    None => {
                        leader.complete(FlightResult::Failed(FlightError::Origin));
                        Err(FetchError::Origin(e))
                    }
                }
            }
        }
    }

    fn filled_from_l2<T>(&self, leader: Leader, entry: Entry) -> Filled<T> {
        leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
        Filled::Entry(entry, Source::L2, false)
    }

    /// What a follower answers with, given its leader's result.
    fn followed<O: Origin>(
        &self,
        result: FlightResult,
        fallback: Option<Entry>,
        origin: &O,
    ) -> Followed<O::Output, O::Error> {
        let answer = |entry, source, served| {
            let answer = Answer {
                entry,
                source,
                served,
                collapsed: true,
            };
            self.count(&answer);
            Followed::Answer(Fetched::Entry(answer))
        };
        let stale = |fallback: Option<Entry>| {
            fallback
                .filter(|e| self.stale_usable(e))
                .map(|e| answer(e, Source::L1, Served::Stale(StaleReason::OriginError)))
        };
        match result {
            FlightResult::Shared(entry, source) if origin.accepts(&entry) => {
                let served = match source {
                    Source::Origin => Served::Miss { stored: true },
                    _ => Served::Hit,
                };
                answer(entry, source, served)
            }
            FlightResult::Transient(entry, failed) => match stale(fallback.filter(|_| failed)) {
                Some(stand_in) => stand_in,
                None => answer(entry, Source::Origin, Served::Shared),
            },
            FlightResult::Stale(entry) => {
                answer(entry, Source::L1, Served::Stale(StaleReason::OriginError))
            }
            FlightResult::Failed(FlightError::Panicked) => {
                Followed::Error(FetchError::Panicked(Panic(None)))
            }
            FlightResult::Failed(_) => {
                stale(fallback).unwrap_or(Followed::Error(FetchError::Failed))
            }
            // Not shareable, or another variant: this request loads alone.
            FlightResult::Released | FlightResult::Shared(..) => Followed::Alone,
        }
    }

    /// One origin call outside any flight (hit-for-miss, or a follower whose
    /// leader's answer could not be shared); what may be stored still is.
    async fn load_alone<O: Origin>(
        &self,
        keys: &Keys,
        policy: &Policy,
        origin: O,
        collapsed: bool,
        hit_for_miss: bool,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        let epoch = self.inner.journal.epoch();
        let started = Instant::now();
        let loaded = origin.load(None).await;
        let took = started.elapsed();
        self.inner.counters.origin_load(took);
        let answer = |entry, stored| {
            let answer = Answer {
                entry,
                source: Source::Origin,
                served: Served::Miss { stored },
                collapsed,
            };
            bump(&self.inner.counters.misses);
            Fetched::Entry(answer)
        };
        match loaded.map_err(FetchError::Origin)? {
            Loaded::Store(mut fill) => {
                if fill.origin_latency_unset() {
                    fill = fill.origin_latency(took);
                }
                let (entry, stored) = self.store_since(&keys.flight, fill, policy, epoch);
                Ok(answer(entry, stored))
            }
            Loaded::Share { value, .. } => {
                let mut fetched = answer(self.transient(&keys.flight, value, took), false);
                if let Fetched::Entry(answer) = &mut fetched {
                    answer.served = Served::Shared;
                }
                Ok(fetched)
            }
            Loaded::Pass {
                output,
                uncacheable,
                ..
            } => {
                if uncacheable {
                    self.mark_uncacheable(&keys.requested, policy);
                }
                if !hit_for_miss {
                    bump(&self.inner.counters.misses);
                }
                Ok(Fetched::Passed {
                    output,
                    collapsed,
                    hit_for_miss,
                })
            }
        }
    }
}
