//! The rest of a fetch after [`TieredCache::begin`](super::TieredCache::begin):
//! a [`Miss`] run with the origin (the single flight, L2, the fleet lock,
//! the origin, storage), what its followers answer with, and a
//! [`Refresh`] spawned in the background.

use std::time::Duration;

use tokio::time::Instant;

use super::fetch::{Miss, MissState, Refresh, RefreshState};
use super::fill::{Followed, Lead, Locked};

use crate::flight::{FlightError, FlightResult, Join, Waited};
use crate::stats::bump;
use crate::{
    Answer, Entry, Event, FetchError, Fetched, Freshness, Origin, Panic, Select, Served, Source,
    StaleReason,
};

impl Miss {
    /// Whether the key is marked uncacheable (hit-for-miss): the request
    /// goes to the origin alone, without waiting on anyone.
    pub fn hit_for_miss(&self) -> bool {
        self.0.hit_for_miss
    }

    /// Ends the fetch from storage alone, never the origin (HTTP's
    /// `only-if-cached`, RFC 9111 §5.2.1.7): the fresh L2 entry that
    /// `select` accepts (promoted to L1, counted as an L2 hit), or `None`.
    /// `select` is taken whole, as [`run`](Self::run) takes its origin.
    /// No flight is joined: a load another request leads is not waited on.
    /// An entry that must be revalidated before use answers nothing here.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tiercache_core::{Begin, CacheKey, Policy, TieredCache};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = TieredCache::builder().build()?;
    /// let policy = Policy::ttl(Duration::from_secs(30)).build()?;
    /// let Begin::Miss(miss) = cache.begin(&CacheKey::new("cold"), &policy, &()) else {
    ///     unreachable!("nothing is stored yet");
    /// };
    /// assert!(miss.stored(()).await.is_none());
    /// # Ok(()) }
    /// ```
    pub async fn stored<S: Select + Send>(self, select: S) -> Option<Answer> {
        let MissState {
            engine,
            keys,
            revalidate,
            hit_for_miss,
            ..
        } = *self.0;
        if hit_for_miss || revalidate {
            return None;
        }
        let select = Locked(std::sync::Mutex::new(select));
        let epoch = engine.inner.journal.epoch();
        let entry = engine
            .read_l2(&keys.requested, &keys.flight, epoch, &select, false)
            .await
            .filter(|entry| !select.must_revalidate(entry))?;
        let answer = Answer {
            entry,
            source: Source::L2,
            served: Served::Hit,
            collapsed: false,
        };
        engine.count(&answer);
        Some(answer)
    }

    /// Runs the rest of the fetch with `origin`: see [`TieredCache::fetch`](crate::TieredCache::fetch).
    pub async fn run<O: Origin>(
        self,
        mut origin: O,
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
            return engine
                .load_alone(&keys, &policy, origin, None, false, true)
                .await;
        }
        let mut collapsed = false;
        // Counted once a request: all of its wait on others' loads, however
        // many flights it followed, and whether a wait reached a deadline.
        let mut waited = Duration::ZERO;
        let mut timed_out = false;
        // Joined again once after an overtaken answer; a second overtaken
        // one (a key invalidated faster than it loads) loads alone.
        let mut rejoined = false;
        // A stale entry that may stand in for a slow origin: past the soft
        // timeout it answers a follower as it answers the leader.
        let stand_in = fallback
            .clone()
            .filter(|e| engine.stale_usable(e))
            .zip(policy.soft_timeout())
            .map(|(entry, soft)| (entry, Instant::now() + soft));
        // Busy loads are tried again by their followers until the wait a
        // flight is allowed from this request's first join.
        let began = Instant::now();
        loop {
            // Before the join: an invalidation recorded after this epoch
            // came after the request (see `FlightResult::Overtaken`).
            let joined = engine.inner.journal.epoch();
            let follower = match engine
                .inner
                .flights
                .join(keys.flight.hash(), policy.lock_wait())
            {
                Join::Leader(leader) => {
                    // Joining again (the flight was abandoned, busy,
                    // overtaken or past its deadline): the request that
                    // led before this one may have stored the key, its
                    // flight already over.
                    // (`collapsed`: it followed a flight before.)
                    if collapsed
                        && !revalidate
                        && let Some(answer) = engine.l1_answer(&keys.flight, &policy, &origin)
                    {
                        origin.observe(Event::LockWait(waited));
                        leader.complete(FlightResult::Shared(answer.entry.clone(), Source::L1));
                        return Ok(Fetched::Entry(answer));
                    }
                    let lead = Lead {
                        leader,
                        keys,
                        policy,
                        stale: fallback,
                        revalidate,
                        waited: collapsed.then_some(waited),
                        timed_out,
                        current: None,
                    };
                    return engine.lead(lead, origin).await;
                }
                Join::Follower(follower) => follower,
            };
            if !collapsed {
                bump(&engine.inner.counters.coalesced);
                collapsed = true;
            }
            let started = Instant::now();
            // A caller gone mid-wait (its future dropped) still gives its
            // wait sample, as it was counted coalesced.
            let sample = WaitSample {
                origin: Some(origin),
                waited,
                started,
            };
            let outcome = match &stand_in {
                Some((stale, at)) => match tokio::time::timeout_at(*at, follower.wait()).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        drop(sample);
                        let why = StaleReason::OriginTimeout;
                        return Ok(engine.answered_stale(stale.clone(), why, true));
                    }
                },
                None => follower.wait().await,
            };
            origin = sample.end();
            waited += started.elapsed();
            match outcome {
                Waited::Done(FlightResult::Failed(FlightError::Abandoned)) => continue,
                Waited::Done(result) => {
                    let followed = engine.followed(result, fallback.clone(), &origin, joined);
                    match &followed {
                        Followed::Again if !rejoined => {
                            rejoined = true;
                            continue;
                        }
                        Followed::Retry if began.elapsed() < policy.lock_wait() => continue,
                        _ => {}
                    }
                    origin.observe(Event::LockWait(waited));
                    return match followed {
                        Followed::Answer(answer) => Ok(answer),
                        Followed::Error(e) => Err(e),
                        Followed::Alone | Followed::Again | Followed::Retry => {
                            engine
                                .load_alone(&keys, &policy, origin, fallback, true, false)
                                .await
                        }
                    };
                }
                // The flight's deadline passed: the next join takes it over
                // (or follows whoever did). Counted once a request.
                Waited::TimedOut if !timed_out => {
                    timed_out = true;
                    bump(&engine.inner.counters.lock_timeouts);
                    origin.observe(Event::LockTimeout);
                }
                Waited::TimedOut => {}
            }
        }
    }
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
            slot,
        } = *self.0;
        let lead = Lead {
            leader,
            keys,
            policy,
            stale: Some(current.clone()),
            revalidate: false,
            waited: None,
            timed_out: false,
            current: Some(current),
        };
        tokio::spawn(async move {
            // An origin failing marks the key (see `origin_failed`).
            let _ = engine.fill(lead, origin).await;
            drop(slot);
        });
    }
}

/// A follower's wait, holding its origin: told to it as one sample when
/// dropped before it [`end`](Self::end)s (the caller went away). The
/// request waited `waited` before, and since `started`.
struct WaitSample<O: Select> {
    origin: Option<O>,
    waited: Duration,
    started: Instant,
}

impl<O: Select> WaitSample<O> {
    /// The wait ended: the origin back, nothing told (the caller tells the
    /// whole wait once it ends).
    fn end(mut self) -> O {
        self.origin.take().expect("a wait ends once")
    }
}

impl<O: Select> Drop for WaitSample<O> {
    fn drop(&mut self) {
        if let Some(origin) = &self.origin {
            origin.observe(Event::LockWait(self.waited + self.started.elapsed()));
        }
    }
}

impl super::TieredCache {
    /// What a follower answers with, given its leader's result; `joined`
    /// is the journal epoch it noted before it joined the flight.
    pub(super) fn followed<O: Origin>(
        &self,
        result: FlightResult,
        fallback: Option<Entry>,
        origin: &O,
        joined: u64,
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
                    // A copy read inside its stale-while-revalidate window:
                    // stale for the followers too, while the refresh runs.
                    _ if !matches!(entry.freshness(self.now()), Freshness::Fresh(_)) => {
                        Served::Stale(StaleReason::Revalidating)
                    }
                    _ => Served::Hit,
                };
                answer(entry, source, served)
            }
            // Invalidated while it loaded: an answer for the requests that
            // were already waiting (as the leader's own is), not for one
            // that came after the write.
            FlightResult::Overtaken(_, at) if joined > at => Followed::Again,
            // The leader had no room to keep its answer: one follower loads.
            FlightResult::Retry => Followed::Retry,
            FlightResult::Overtaken(entry, _) if origin.accepts(&entry) => {
                answer(entry, Source::Origin, Served::Miss { stored: false })
            }
            FlightResult::Transient(entry, failed) => match stale(fallback.filter(|_| failed)) {
                Some(stand_in) => stand_in,
                None if origin.accepts(&entry) => answer(entry, Source::Origin, Served::Shared),
                None => Followed::Alone,
            },
            // The origin failed and the leader stood its stale entry in:
            // this request stands in its own, the copy it found in L1 (the
            // same one, unless its variant is another). One that found none
            // came after an invalidation removed it (or never had one), and
            // gets the failure, as it would alone.
            FlightResult::Stale(failure) => match stale(fallback) {
                Some(stand_in) => stand_in,
                None => match failure.filter(|f| origin.accepts(f)) {
                    Some(failure) => answer(failure, Source::Origin, Served::Shared),
                    None => Followed::Alone,
                },
            },
            FlightResult::Failed(FlightError::Panicked) => {
                Followed::Error(FetchError::Panicked(Panic(None)))
            }
            FlightResult::Failed(_) => {
                stale(fallback).unwrap_or(Followed::Error(FetchError::Failed))
            }
            // Not shareable, or another variant: this request loads alone.
            FlightResult::Released | FlightResult::Shared(..) | FlightResult::Overtaken(..) => {
                Followed::Alone
            }
        }
    }
}
