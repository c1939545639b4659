//! Single flight: one origin load per key, however many requests miss at once.
//!
//! The first request for a key becomes the [`Leader`]; the others get a
//! [`Follower`] and wait on the leader's result, at most until the flight's
//! deadline (`lock_timeout` from the flight's start, not from each
//! follower's arrival, moved on by the load's [`Progress`]: `lock_timeout`
//! from the origin's last sign of life, up to four `lock_timeout`s from
//! the start). A leader past its deadline is abandoned: the next
//! request to join takes the flight over and becomes the new leader, one at
//! a time, while the old load finishes on its own (pingora's cache lock does
//! the same).
//!
//! A leader is a value, not a task: whoever holds it (normally a task
//! detached from the client's request) completes it. Dropping it without
//! completing wakes the followers: with [`FlightError::Panicked`] when the
//! drop happens while unwinding, else as abandoned, which sends them back to
//! join again (one of them leads).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::{Entry, KeyHash, Source};

/// What a leader hands its followers.
#[derive(Debug, Clone)]
pub(crate) enum FlightResult {
    /// An entry that may be shared (stored, or read from L2), and its tier.
    Shared(Entry, Source),
    /// The origin's answer, not stored: the invalidation recorded with this
    /// journal sequence overtook it. It answers only the followers that
    /// joined before that invalidation (noted a journal epoch no later than
    /// it); one that came after must not read what the write replaced.
    Overtaken(Entry, u64),
    /// An answer that may be shared but was not stored (an error page, a
    /// value the loader chose not to keep); `true` for an origin failure.
    Transient(Entry, bool),
    /// The leader's answer failed and may not be shared (or had no room),
    /// and its stale entry answered it (stale-if-error); each follower
    /// stands in its own (see
    /// `TieredCache::followed`), or gets the failure, when any client may
    /// see it.
    Stale(Option<Entry>),
    /// The leader's answer may not be shared: go to the origin alone.
    Released,
    /// The leader's answer was not kept for a reason of the moment
    /// ([`Loaded::Busy`](crate::Loaded::Busy)): join again, one of the
    /// followers loads (until the flight's wait from a follower's first
    /// join).
    Retry,
    /// The load ended without an answer to share.
    Failed(FlightError),
}

/// Why a flight ended without a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlightError {
    /// The origin call panicked.
    Panicked,
    /// The origin call failed with an error that is the leader's own.
    Origin,
    /// The leader was dropped before completing (its task was cancelled);
    /// followers join again, and one of them leads.
    Abandoned,
}

/// What a follower's wait ended with.
#[derive(Debug, Clone)]
pub(crate) enum Waited {
    /// The leader finished.
    Done(FlightResult),
    /// The flight's deadline passed first.
    TimedOut,
}

#[derive(Debug)]
struct Slot {
    tx: watch::Sender<Option<FlightResult>>,
    /// What a slower flight ended with, when not a stored answer, while
    /// this one held its key (it took it over, or took over one that did):
    /// for the requests waiting then (see `Flights::finish`); those that
    /// join later wait on this flight.
    handed: watch::Sender<Option<FlightResult>>,
    deadline: Deadline,
}

/// How many flight waits from its start a load's progress may move its
/// deadline to: the requests waiting get nothing until the body is whole
/// (no stream is shared with them), so a body that trickles on is taken
/// over at last, as a hung one is at once.
pub(crate) const PROGRESS_WAITS_AT_MOST: u32 = 4;

/// A flight's deadline, which its load's progress moves on (never back),
/// to [`PROGRESS_WAITS_AT_MOST`] waits from its start at most.
#[derive(Debug)]
struct Deadline {
    start: Instant,
    /// Nanoseconds from `start`.
    after: AtomicU64,
    /// How far progress may move it, nanoseconds from `start`.
    limit: u64,
}

impl Deadline {
    /// `wait` from `start`.
    fn new(start: Instant, wait: Duration) -> Self {
        Self {
            start,
            after: AtomicU64::new(nanos(wait)),
            limit: nanos(wait.saturating_mul(PROGRESS_WAITS_AT_MOST)),
        }
    }

    fn at(&self) -> Instant {
        self.start + Duration::from_nanos(self.after.load(Relaxed))
    }

    /// Moves the deadline to `at`, if that is later (within its limit).
    fn extend_to(&self, at: Instant) {
        let after = nanos(at.saturating_duration_since(self.start)).min(self.limit);
        self.after.fetch_max(after, Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Debug)]
pub(crate) struct Flights {
    map: Mutex<HashMap<KeyHash, Arc<Slot>>>,
    /// Past this many keys in flight, new leaders load alone (no followers
    /// can find them), so a flood of unique misses cannot grow the map.
    cap: usize,
}

impl Default for Flights {
    fn default() -> Self {
        Self::with_cap(Self::DEFAULT_CAP)
    }
}

/// The role a request got for a key.
#[derive(Debug)]
pub(crate) enum Join {
    /// Load the value and complete the flight.
    Leader(Leader),
    /// Wait for the leader.
    Follower(Follower),
}

/// How many waits past its deadline a load must be before a background
/// refresh takes it over (a request's miss does at the deadline).
const REFRESH_TAKES_OVER_AFTER: u32 = 4;

impl Flights {
    pub(crate) const DEFAULT_CAP: usize = 65_536;

    pub(crate) fn with_cap(cap: usize) -> Self {
        Self {
            map: Mutex::default(),
            cap,
        }
    }

    /// Joins the flight for `key`: leads it when there is none, or when the
    /// current one is past its deadline (the stalled leader is abandoned);
    /// else follows it. A new flight's deadline is `wait` from now.
    pub(crate) fn join(self: &Arc<Self>, key: KeyHash, wait: Duration) -> Join {
        self.join_after(key, wait, Duration::ZERO)
    }

    /// [`join`](Self::join), taking a stalled flight over only `grace` past
    /// its deadline.
    fn join_after(self: &Arc<Self>, key: KeyHash, wait: Duration, grace: Duration) -> Join {
        let now = Instant::now();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = map.get(&key)
            && slot.deadline.at() + grace > now
        {
            let mut handed = slot.handed.subscribe();
            handed.mark_unchanged();
            return Join::Follower(Follower {
                rx: slot.tx.subscribe(),
                handed,
                slot: slot.clone(),
            });
        }
        let slot = Arc::new(Slot {
            tx: watch::channel(None).0,
            handed: watch::channel(None).0,
            deadline: Deadline::new(now, wait),
        });
        // A stalled flight's slot is replaced: its leader finishes alone.
        if map.contains_key(&key) || map.len() < self.cap {
            map.insert(key, slot.clone());
        }
        Join::Leader(Leader {
            key,
            slot,
            flights: self.clone(),
            done: false,
        })
    }

    /// Leads the flight for `key` if nobody is loading it: a background
    /// refresh never waits on another load, and takes over one past its
    /// deadline only [`REFRESH_TAKES_OVER_AFTER`] waits later (nobody waits
    /// on a refresh, and taking a slow one over at each deadline called the
    /// origin again at every stale hit past it; a hung one is still
    /// replaced, so the entry does not stay frozen for a long window).
    pub(crate) fn try_lead_idle(self: &Arc<Self>, key: KeyHash, wait: Duration) -> Option<Leader> {
        let grace = wait.saturating_mul(REFRESH_TAKES_OVER_AFTER);
        match self.join_after(key, wait, grace) {
            Join::Leader(leader) => Some(leader),
            Join::Follower(_) => None,
        }
    }

    /// Whether a load of `key` is in flight.
    pub(crate) fn is_loading(&self, key: KeyHash) -> bool {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&key)
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn finish(&self, key: &KeyHash, slot: &Arc<Slot>, result: FlightResult) {
        let newer = {
            // Only our own flight: a new one may already hold the key.
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            match map.get(key) {
                Some(s) if Arc::ptr_eq(s, slot) => {
                    map.remove(key);
                    None
                }
                other => other.cloned(),
            }
        };
        // A leader that was only slow, not stalled: what it stored answers
        // the requests waiting on the flight that took its over too (that
        // flight's leader still finishes its own load, and later joiners
        // get this answer at once), instead of each waiter taking the
        // flight over in turn. What else it ends with reaches the ones
        // waiting now, each taking it as this flight's own followers do: an
        // answer they may not share releases them to load alone; a failure,
        // a stale stand-in, an answer not stored or one an invalidation
        // overtook answers them. Before, they waited on the next leader,
        // one more taking the flight over at each deadline: twenty
        // requests of an 8 s long poll were answered 5 s apart, and six of
        // a 503 after 6 s under a 5 s wait cost six origin calls, the last
        // answered at 31 s. Not the later ones, whose flight's leader may
        // yet store what they want; nor a panic (this load's own), a drop
        // or a retry, which say nothing of the origin's answer.
        if let Some(newer) = newer {
            match &result {
                FlightResult::Shared(..) => {
                    newer.tx.send_if_modified(|value| {
                        value.is_none() && {
                            *value = Some(result.clone());
                            true
                        }
                    });
                }
                // Not a stale stand-in without the failure: a request with
                // no copy of its own would load alone, where it waits on
                // the newer flight's call.
                FlightResult::Released
                | FlightResult::Transient(..)
                | FlightResult::Stale(Some(_))
                | FlightResult::Overtaken(..)
                | FlightResult::Failed(FlightError::Origin) => {
                    newer.handed.send_replace(Some(result.clone()));
                }
                FlightResult::Retry | FlightResult::Stale(None) | FlightResult::Failed(_) => {}
            }
        }
        slot.tx.send_replace(Some(result));
    }
}

/// The one request per key allowed to load it. Complete it with
/// [`Leader::complete`]; dropping it wakes the followers.
pub(crate) struct Leader {
    key: KeyHash,
    slot: Arc<Slot>,
    flights: Arc<Flights>,
    done: bool,
}

impl fmt::Debug for Leader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leader").field("key", &self.key).finish()
    }
}

impl Leader {
    /// Ends the flight: followers receive `result`, new requests start afresh
    /// (or hit the cache, when the result was stored before this call).
    pub(crate) fn complete(mut self, result: FlightResult) {
        self.done = true;
        self.flights.finish(&self.key, &self.slot, result);
    }

    /// What is left of the flight's deadline.
    pub(crate) fn time_left(&self) -> Duration {
        self.slot
            .deadline
            .at()
            .saturating_duration_since(Instant::now())
    }

    /// What the load tells of its progress, each sign moving the flight's
    /// deadline to `wait` from then.
    pub(crate) fn progress(&self, wait: Duration) -> Progress {
        Progress {
            flight: Some((Arc::downgrade(&self.slot), wait)),
            lock: None,
        }
    }

    /// How many followers are waiting right now.
    #[cfg(test)]
    pub(crate) fn waiters(&self) -> usize {
        self.slot.tx.receiver_count()
    }

    /// A view of this flight that outlives the leader (its task's handle
    /// holds one).
    pub(crate) fn watch(&self) -> FlightWatch {
        FlightWatch(self.slot.clone())
    }
}

/// Whether anyone waits on a flight, and until when.
#[derive(Clone)]
pub(crate) struct FlightWatch(Arc<Slot>);

impl FlightWatch {
    /// Whether a follower is waiting right now.
    pub(crate) fn waited_on(&self) -> bool {
        self.0.tx.receiver_count() > 0
    }

    /// The flight's deadline, past which its followers stop waiting on
    /// it (its load's progress may move it on).
    pub(crate) fn deadline(&self) -> Instant {
        self.0.deadline.at()
    }
}

/// A load's way to tell the engine it is making progress (the origin
/// answered, more of its body came): its flight's deadline, past which the
/// requests waiting on it go to the origin themselves, moves to
/// `lock_timeout` from then, up to four `lock_timeout`s from the flight's
/// start. A slow body that keeps coming is waited for, not asked for again
/// by each request that waited `lock_timeout`; an origin gone quiet is
/// still taken over. The fleet-wide fill lock the load holds, if any, is
/// moved on the same way, so other instances wait too. See
/// [`Origin::load_with`].
///
/// [`Origin::load_with`]: crate::Origin::load_with
#[derive(Clone, Default)]
pub struct Progress {
    flight: Option<(std::sync::Weak<Slot>, Duration)>,
    lock: Option<Arc<crate::fleet::LockExtension>>,
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress")
            .field("flight", &self.flight.is_some())
            .field("lock", &self.lock.is_some())
            .finish()
    }
}

impl Progress {
    /// A load nobody waits on (no flight): its progress tells no one.
    pub fn none() -> Self {
        Self::default()
    }

    /// The same, moving the fleet lock `lock` on too.
    pub(crate) fn with_lock(self, lock: Option<Arc<crate::fleet::LockExtension>>) -> Self {
        Self { lock, ..self }
    }

    /// The load made progress now (atomics at most, and a command to the
    /// shared tier a quarter of a flight's wait apart: cheap per frame;
    /// nothing for [`Progress::none`] or a flight that has ended).
    #[inline]
    pub fn made(&self) {
        if let Some((slot, wait)) = &self.flight
            && let Some(slot) = slot.upgrade()
        {
            slot.deadline.extend_to(Instant::now() + *wait);
        }
        if let Some(lock) = &self.lock {
            lock.made();
        }
    }

    /// The flight's deadline as its progress moved it (`None` without a
    /// flight, or once it ended).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let (slot, _) = self.flight.as_ref()?;
        Some(slot.upgrade()?.deadline.at())
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if !self.done {
            let err = if std::thread::panicking() {
                FlightError::Panicked
            } else {
                FlightError::Abandoned
            };
            self.flights
                .finish(&self.key, &self.slot, FlightResult::Failed(err));
        }
    }
}

/// A request waiting on a leader.
#[derive(Debug)]
pub(crate) struct Follower {
    rx: watch::Receiver<Option<FlightResult>>,
    /// What a slower flight this one took over ended with (see
    /// `Flights::finish`).
    handed: watch::Receiver<Option<FlightResult>>,
    slot: Arc<Slot>,
}

impl Follower {
    /// Waits for the leader's result, at most until the flight's deadline
    /// (as its load's progress moves it).
    pub(crate) async fn wait(mut self) -> Waited {
        let slot = self.slot.clone();
        let handed = &mut self.handed;
        let answered = async {
            tokio::select! {
                biased;
                value = self.rx.wait_for(Option::is_some) => {
                    value.map(|v| v.clone().unwrap_or(FlightResult::Released))
                }
                // The sender lives as long as its slot: an error is no news.
                Ok(()) = handed.changed() => {
                    Ok(handed.borrow().clone().unwrap_or(FlightResult::Released))
                }
            }
        };
        let mut answered = std::pin::pin!(answered);
        let result = loop {
            let deadline = slot.deadline.at();
            match tokio::time::timeout_at(deadline, &mut answered).await {
                Err(_) if slot.deadline.at() > deadline => continue,
                result => break result,
            }
        };
        match result {
            Ok(Ok(value)) => Waited::Done(value),
            // The sender lives in the map and the leader; both gone without a
            // value cannot happen (Drop sends), but fail safe.
            Ok(Err(_)) => Waited::Done(FlightResult::Failed(FlightError::Abandoned)),
            Err(_) => Waited::TimedOut,
        }
    }
}

#[cfg(test)]
mod tests;
