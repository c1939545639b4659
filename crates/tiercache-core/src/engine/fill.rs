//! The leader's side of a flight: its task (L2, the fleet lock, the
//! origin, storage, stale-if-error) and what its followers make of its
//! result (loads outside any flight are in `alone.rs`).

use std::time::Duration;

use tokio::time::Instant;

use super::TieredCache;
use super::detach::FillTask;
use super::fetch::Keys;
use super::journal::Start;
use crate::fleet::{FleetJoin, FleetLock};
use crate::flight::{FlightError, FlightResult, Leader};
use crate::stats::bump;
use crate::{
    Answer, CacheKey, Entry, Event, FetchError, Fetched, LateFill, Loaded, Origin, Panic, Policy,
    Select, Served, Source, StaleReason, Unlocked,
};

/// What the leader's fill produced.
pub(super) enum Filled<T> {
    Entry(Entry, Source, bool),
    Transient(Entry),
    Stale(Entry),
    /// A stale copy from L2 answers while a refresh runs (stale-while-revalidate).
    Revalidating(Entry),
    Passed(T),
}

/// An origin behind a lock: `Sync` for any `Send` origin, so a future may
/// hold a reference to it across an await.
pub(super) struct Locked<O>(pub(super) std::sync::Mutex<O>);

impl<O> Locked<O> {
    fn into_inner(self) -> O {
        self.0.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

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

    fn observe(&self, event: Event) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(event);
    }
}

/// One sample of a request's whole wait on other loads (see `Miss::run`):
/// on local flights before it led (`earlier`), then on the fleet lock.
fn report_wait(origin: &impl Select, earlier: Option<Duration>, fleet: Option<Duration>) {
    if earlier.is_some() || fleet.is_some() {
        let waited = earlier.unwrap_or_default() + fleet.unwrap_or_default();
        origin.observe(Event::LockWait(waited));
    }
}

/// What a follower does with its leader's result.
pub(super) enum Followed<T, E> {
    Answer(Fetched<T>),
    Error(FetchError<E>),
    /// Load alone: the answer may not be shared, or is another variant.
    Alone,
    /// Join the key's flights again: the answer was overtaken by an
    /// invalidation this request came after.
    Again,
    /// Join the key's flights again, one of the followers loading: the
    /// leader had no room to keep its answer ([`Loaded::Busy`]). Tried
    /// again until the flight's wait from the request's first join.
    Retry,
}

/// A flight this request leads, and how.
pub(super) struct Lead {
    pub(super) leader: Leader,
    pub(super) keys: Keys,
    pub(super) policy: Policy,
    /// An entry to revalidate, or to answer with when the origin fails.
    pub(super) stale: Option<Entry>,
    /// Skip L2 and the fleet lock: revalidate `stale` with the origin.
    pub(super) revalidate: bool,
    /// How long the request waited on other requests' flights before it
    /// led (`None`: it did not): counted as coalesced already, a wait on
    /// the fleet lock is added to its one wait sample, not counted again.
    pub(super) waited: Option<Duration>,
    /// The request's wait reached a flight's deadline already (counted).
    pub(super) timed_out: bool,
    /// A refresh of this entry: only a newer copy from L2 replaces it.
    pub(super) current: Option<Entry>,
}

impl TieredCache {
    /// Leads the flight: the fill runs in a task of its own (a caller that
    /// goes away strands nobody); with a usable stale entry and a soft
    /// timeout, the caller gets the stale entry once the timeout passes.
    /// Its answer is never labelled collapsed, even when the caller waited
    /// on another flight first: it is the caller's own load.
    pub(super) async fn lead<O: Origin>(
        &self,
        lead: Lead,
        origin: O,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        let usable = lead.stale.clone().filter(|e| self.stale_usable(e));
        let soft = lead.policy.soft_timeout();
        let flight = lead.leader.watch();
        let engine = self.clone();
        let mut task = FillTask::spawn(self, flight, move || engine.fill(lead, origin));
        let joined = match (usable, soft) {
            (Some(stale), Some(soft)) => match tokio::time::timeout(soft, &mut task.handle).await {
                Ok(joined) => joined,
                // The origin is slow and a stale answer is at hand: give it
                // now; the fill goes on in the background.
                Err(_) => return Ok(self.answered_stale(stale, StaleReason::OriginTimeout, false)),
            },
            _ => (&mut task.handle).await,
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
                collapsed: false,
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
            Filled::Revalidating(entry) => {
                answer(entry, Source::L2, Served::Stale(StaleReason::Revalidating))
            }
            Filled::Passed(output) => {
                bump(&self.inner.counters.misses);
                Fetched::Passed {
                    output,
                    collapsed: false,
                    hit_for_miss: false,
                }
            }
        })
    }

    /// The leader's fill: L2 first (unless revalidating), the fleet lock,
    /// then the origin (revalidating the stale entry when there is one, and
    /// falling back to it when the origin fails); stores what may be stored
    /// unless an invalidation overtook the fill; completes the flight.
    pub(super) async fn fill<O: Origin>(
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
            waited,
            timed_out,
            current,
        } = lead;
        // A refresh is no request: its waits are not a request's.
        let refresh = current.is_some();
        // Noted before anything is read: an invalidation after this point
        // keeps what this fill reads from being stored (and a later
        // load's answer stored meanwhile stays).
        let start = self.inner.journal.start();
        let epoch = start.epoch;
        // The origin is asked which entries fit across the awaits below; a
        // lock makes it shareable with them whatever it holds (`Send` only).
        let origin = Locked(std::sync::Mutex::new(origin));
        let newer = |e: &Entry| {
            current
                .as_ref()
                .is_none_or(|c| e.times().created_at > c.times().created_at)
        };
        // A first load (not a refresh) may take a copy inside its
        // stale-while-revalidate window: another instance stored it, this
        // one has no copy of its own; it answers at once while a refresh runs.
        let stale_ok = current.is_none();
        if !revalidate
            && let Some(entry) = self
                .read_l2(&keys.requested, &keys.flight, epoch, &origin, stale_ok)
                .await
            && newer(&entry)
        {
            let fresh = matches!(entry.freshness(self.now()), crate::Freshness::Fresh(_));
            if !origin.must_revalidate(&entry) {
                report_wait(&origin, waited, None);
                if fresh {
                    return Ok(self.filled_from_l2(leader, entry));
                }
                leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
                if let Some(refresh) = self.refresh(keys, &policy, &entry) {
                    refresh.spawn(origin.into_inner());
                }
                return Ok(Filled::Revalidating(entry));
            }
            stale = Some(entry);
        }
        // One load per key across the fleet: take the shared lock, or wait
        // for the instance that holds it and answer with what it stored.
        let lock = if revalidate {
            report_wait(&origin, waited, None);
            FleetLock::local()
        } else {
            let fits = |e: &Entry| origin.accepts(e) && !origin.must_revalidate(e) && newer(e);
            let wait = leader.time_left();
            let counted = (waited.is_some() || refresh, timed_out);
            let progress = leader.progress(policy.lock_wait());
            let fallback = stale.as_ref().is_some_and(|e| self.stale_usable(e));
            let fleet = self
                .lead_fleet(
                    &keys.flight,
                    &policy,
                    wait,
                    &progress,
                    epoch,
                    fits,
                    counted,
                    fallback,
                )
                .await;
            if !refresh {
                report_wait(&origin, waited, fleet.waited);
            }
            if fleet.timed_out && !timed_out && !refresh {
                origin.observe(Event::LockTimeout);
            }
            match fleet.join {
                FleetJoin::Filled(entry) => {
                    return Ok(self.filled_from_l2(leader, entry));
                }
                FleetJoin::Shared(entry, failed) => {
                    self.origin_failed(&keys.flight, failed);
                    let usable = stale.clone().filter(|e| self.stale_usable(e));
                    // Another instance's answer that fits this request, or
                    // a failure this one's own stale copy stands in for;
                    // else (its encoding does not fit) this one loads it.
                    if origin.accepts(&entry) || (failed && usable.is_some()) {
                        return Ok(self.shared(leader, entry, failed, usable));
                    }
                    FleetLock::local()
                }
                // Another instance's load failed: so does this one's wait,
                // as a local follower's would (its stale copy stands in).
                FleetJoin::Failed => {
                    self.origin_failed(&keys.flight, true);
                    leader.complete(FlightResult::Failed(FlightError::Origin));
                    return match stale.filter(|e| self.stale_usable(e)) {
                        Some(stale) => Ok(Filled::Stale(stale)),
                        None => Err(FetchError::Failed),
                    };
                }
                // The fleet's mark: nothing asked, so the requests waiting
                // here without a stale copy load on their own (and this
                // one, if its copy's window closed while it waited).
                FleetJoin::Failing(mark) => match stale.clone().filter(|e| self.stale_usable(e)) {
                    Some(stale) => {
                        self.origin_failed_for(&keys.flight, mark);
                        leader.complete(FlightResult::Stale(None));
                        return Ok(Filled::Stale(stale));
                    }
                    None => FleetLock::local(),
                },
                FleetJoin::Lead(lock) => lock,
            }
        };
        let usable = stale.clone().filter(|e| self.stale_usable(e));
        let origin = origin.into_inner();
        let (started, began) = (Instant::now(), self.now());
        let progress = leader.progress(policy.lock_wait());
        let loaded = origin
            .load_with(stale, progress.with_lock(lock.extension()))
            .await;
        let took = started.elapsed();
        let delta = self.delta_since(began, took);
        self.inner.counters.origin_load(took);
        let stand_in = |leader: Leader, stale: Entry| {
            leader.complete(FlightResult::Stale(None));
            Filled::Stale(stale)
        };
        match loaded {
            Ok(Loaded::Store(mut fill)) => {
                if fill.origin_latency_unset() {
                    fill = fill.origin_latency(delta);
                }
                // Past its lock: another instance's later answer may be
                // in L2 already, or on its way, and stays.
                let start = Start {
                    late: lock.late().then(|| LateFill::new(began, lock.token())),
                    ..start
                };
                let (entry, stored) = self.store_since(&keys.flight, fill, &policy, start);
                // After the store was queued (or a later load's): the
                // waiting instances read it.
                lock.release(
                    if stored.is_ok() {
                        Unlocked::Filled
                    } else {
                        Unlocked::Passed
                    },
                    false,
                );
                leader.complete(match stored {
                    Ok(_) => FlightResult::Shared(entry.clone(), Source::Origin),
                    Err(at) => FlightResult::Overtaken(entry.clone(), at),
                });
                Ok(Filled::Entry(entry, Source::Origin, stored == Ok(true)))
            }
            Ok(Loaded::Share { value, failed }) => {
                self.origin_failed(&keys.flight, failed);
                let entry = self.transient(&keys.flight, value, delta);
                lock.release(Unlocked::Shared(entry.clone(), failed), failed);
                Ok(self.shared(leader, entry, failed, usable))
            }
            Ok(Loaded::Pass {
                output,
                failed,
                uncacheable,
            }) => {
                lock.release(Unlocked::Passed, failed);
                self.origin_failed(&keys.flight, failed);
                if let Some(stale) = usable.filter(|_| failed) {
                    return Ok(stand_in(leader, stale));
                }
                if uncacheable {
                    self.mark_uncacheable(&keys.requested, &policy);
                }
                // A refresh answered with what may not be stored or shared
                // (`private`, `Set-Cookie`): the entry it refreshed is out of
                // date, everywhere. Serving it stale for the rest of its
                // window would start another refresh on every request.
                if let Some(outdated) = current.as_ref().filter(|_| !failed) {
                    let key = CacheKey::from_full(outdated.key().clone());
                    let _ = self.invalidate(&key).await;
                }
                leader.complete(FlightResult::Released);
                Ok(Filled::Passed(output))
            }
            Ok(Loaded::Busy { output, failed }) => {
                // Nothing about the resource: the waiting instances read L2,
                // then one takes the lock and the others wait on it, as
                // after a lock that is gone; the key is not marked
                // uncacheable and a refreshed entry stays.
                lock.release(Unlocked::Gone, failed);
                self.origin_failed(&keys.flight, failed);
                if let Some(stale) = usable.filter(|_| failed) {
                    return Ok(stand_in(leader, stale));
                }
                leader.complete(FlightResult::Retry);
                Ok(Filled::Passed(output))
            }
            // The origin failed: the waiting requests (and instances) get
            // the failure, not a call each; nothing is dropped.
            // Each stands in its own stale copy, as this one does: one
            // without (it came after an invalidation, or is another
            // variant) gets the failure too, not a call of its own.
            Ok(Loaded::Failed { output }) => {
                self.origin_failed(&keys.flight, true);
                lock.release(Unlocked::Failed, true);
                leader.complete(FlightResult::Failed(FlightError::Origin));
                Ok(usable.map_or(Filled::Passed(output), Filled::Stale))
            }
            Err(e) => {
                self.origin_failed(&keys.flight, true);
                lock.release(Unlocked::Failed, true);
                leader.complete(FlightResult::Failed(FlightError::Origin));
                usable.map(Filled::Stale).ok_or(FetchError::Origin(e))
            }
        }
    }

    /// An answer shared but not stored (this instance's origin's, or
    /// another instance's): the stale entry stands in for a failure when
    /// stale-if-error allows.
    fn shared<T>(
        &self,
        leader: Leader,
        entry: Entry,
        failed: bool,
        usable: Option<Entry>,
    ) -> Filled<T> {
        match usable.filter(|_| failed) {
            Some(stale) => {
                leader.complete(FlightResult::Stale(Some(entry)));
                Filled::Stale(stale)
            }
            None => {
                leader.complete(FlightResult::Transient(entry.clone(), failed));
                Filled::Transient(entry)
            }
        }
    }

    fn filled_from_l2<T>(&self, leader: Leader, entry: Entry) -> Filled<T> {
        leader.complete(FlightResult::Shared(entry.clone(), Source::L2));
        Filled::Entry(entry, Source::L2, false)
    }

    /// A stale L1 copy answers (stale-if-error, a soft timeout), counted.
    pub(super) fn answered_stale<T>(
        &self,
        entry: Entry,
        why: StaleReason,
        collapsed: bool,
    ) -> Fetched<T> {
        let answer = Answer {
            entry,
            source: Source::L1,
            served: Served::Stale(why),
            collapsed,
        };
        self.count(&answer);
        Fetched::Entry(answer)
    }
}
