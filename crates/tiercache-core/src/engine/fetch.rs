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

use super::TieredCache;
use super::read::Lookup;

use crate::flight::Leader;
use crate::stats::bump;
use crate::{
    Answer, CacheKey, Entry, FetchError, Fetched, Freshness, Origin, Policy, Select, Served,
    Source, StaleReason,
};

/// The first step of a fetch: an answer now, or the rest of the sequence.
#[derive(Debug)]
#[must_use = "a miss does nothing until it is run with the origin"]
pub enum Begin {
    /// An entry answers now (fresh; stale inside stale-while-revalidate; or
    /// inside stale-if-error, its origin failing a moment ago).
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
pub(super) struct Keys {
    pub(super) requested: CacheKey,
    pub(super) flight: CacheKey,
}

/// The rest of a fetch after an L1 miss: see [`Miss::run`]. (Boxed: a hit
/// never pays for moving it.)
pub struct Miss(pub(super) Box<MissState>);

pub(super) struct MissState {
    pub(super) engine: TieredCache,
    pub(super) keys: Keys,
    pub(super) policy: Policy,
    /// An entry to revalidate, or to answer with when the origin fails.
    pub(super) fallback: Option<Entry>,
    /// Go to the origin (with `fallback`'s validators) without reading L2.
    pub(super) revalidate: bool,
    /// The key is marked uncacheable: straight to the origin, no flight.
    pub(super) hit_for_miss: bool,
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
pub struct Refresh(pub(super) Box<RefreshState>);

pub(super) struct RefreshState {
    pub(super) engine: TieredCache,
    pub(super) keys: Keys,
    pub(super) policy: Policy,
    pub(super) current: Entry,
    pub(super) leader: Leader,
    /// Its slot among the refreshes running at once, held until it ends.
    pub(super) slot: tokio::sync::OwnedSemaphorePermit,
}

impl fmt::Debug for Refresh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refresh")
            .field("key", &self.0.keys.flight)
            .finish()
    }
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
    /// the flight's start or its load's last progress (four `lock_timeout`s
    /// at most) and get its answer when it may be shared, or the
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
                let refresh = if refresh {
                    self.refresh(keys(flight), policy, &entry)
                } else {
                    None
                };
                // Counted when one starts: XFetch fires on every hit near
                // expiry, and the key's refresh may already run.
                let early_refresh = refresh.is_some();
                if early_refresh {
                    bump(&self.inner.counters.early_refreshes);
                }
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
            // Inside stale-if-error, its origin failing a moment ago: the
            // stale copy answers without asking it again.
            Lookup::Miss {
                fallback: Some(stale),
            } if stale.freshness(now) == Freshness::StaleIfError
                && !self.deaf_to_the_fleet()
                && self.origin_failing(flight.as_ref().unwrap_or(key)) =>
            {
                bump(&self.inner.counters.stale_served);
                Begin::Hit(Hit {
                    answer: Answer {
                        entry: stale,
                        source: Source::L1,
                        served: Served::Stale(StaleReason::OriginError),
                        collapsed: false,
                    },
                    remaining: Duration::ZERO,
                    at: now,
                    early_refresh: false,
                    refresh: None,
                })
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
    /// is already running (it will do), or as many refreshes as allowed are
    /// running (a later hit starts it: refreshes are paced).
    pub(super) fn refresh(&self, keys: Keys, policy: &Policy, current: &Entry) -> Option<Refresh> {
        // Its origin failed a moment ago: the stale entry answers on.
        if self.origin_failing(&keys.flight) {
            return None;
        }
        // No slot free: deferred, unless the key's own load runs (it will
        // do). Looked up, not led: no flight opened and closed per hit.
        if self.inner.refreshes.available_permits() == 0 {
            if !self.inner.flights.is_loading(keys.flight.hash()) {
                bump(&self.inner.counters.refreshes_deferred);
            }
            return None;
        }
        let leader = self
            .inner
            .flights
            .try_lead_idle(keys.flight.hash(), policy.lock_wait())?;
        let Ok(slot) = self.inner.refreshes.clone().try_acquire_owned() else {
            // Taken meanwhile: the flight just opened ends (nobody waits on
            // a refresh's).
            drop(leader);
            bump(&self.inner.counters.refreshes_deferred);
            return None;
        };
        Some(Refresh(Box::new(RefreshState {
            engine: self.clone(),
            keys,
            policy: policy.clone(),
            current: current.clone(),
            leader,
            slot,
        })))
    }

    /// A load of `key` (a request's or a refresh) met the origin failing
    /// (`failed`): for [`RETRY_FAILING_AFTER`] stale hits start no
    /// refresh, an XFetch hit near expiry neither, and a stale-if-error
    /// copy answers without a load. Marked before its flight ends, so no
    /// request starts one in between.
    ///
    /// [`RETRY_FAILING_AFTER`]: super::RETRY_FAILING_AFTER
    pub(super) fn origin_failed(&self, key: &CacheKey, failed: bool) {
        if failed {
            self.origin_failed_for(key, super::RETRY_FAILING_AFTER);
        }
    }

    /// As [`origin_failed`](Self::origin_failed), for `mark` (what the
    /// fleet's mark has left, when another instance's load met it).
    pub(super) fn origin_failed_for(&self, key: &CacheKey, mark: Duration) {
        let until = self.now() + mark;
        self.inner.failing.insert(key.hash(), until);
    }

    /// Whether a load of `key` met the origin failing a moment ago (see
    /// [`origin_failed`](Self::origin_failed)).
    fn origin_failing(&self, key: &CacheKey) -> bool {
        self.inner
            .failing
            .get(&key.hash())
            .is_some_and(|until| until > self.now())
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
    pub(super) fn count(&self, answer: &Answer) {
        let c = &self.inner.counters;
        bump(match (answer.served, answer.source) {
            (Served::Stale(_), _) => &c.stale_served,
            (_, Source::L1) => &c.hits_l1,
            (_, Source::L2) => &c.hits_l2,
            (_, Source::Origin) => &c.misses,
        });
    }

    /// The origin's time on the engine's clock (XFetch's δ: a freshness
    /// input, so a mock clock drives it too), or the real time when the
    /// clock went backwards.
    pub(super) fn delta_since(&self, began: SystemTime, took: Duration) -> Duration {
        self.now().duration_since(began).unwrap_or(took)
    }

    pub(super) fn stale_usable(&self, entry: &Entry) -> bool {
        matches!(
            entry.freshness(self.now()),
            Freshness::Stale | Freshness::StaleIfError
        )
    }
}
