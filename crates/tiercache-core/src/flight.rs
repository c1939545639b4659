//! Single flight: one origin load per key, however many requests miss at once.
//!
//! The first request for a key becomes the [`Leader`]; the others get a
//! [`Follower`] and wait on the leader's result, at most until the flight's
//! deadline (`lock_timeout` from the flight's start, not from each
//! follower's arrival). A leader past its deadline is abandoned: the next
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
    deadline: Instant,
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
            && slot.deadline + grace > now
        {
            return Join::Follower(Follower {
                rx: slot.tx.subscribe(),
                deadline: slot.deadline,
            });
        }
        let slot = Arc::new(Slot {
            tx: watch::channel(None).0,
            deadline: now + wait,
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
        // flight over in turn.
        if let (Some(newer), FlightResult::Shared(..)) = (newer, &result) {
            newer.tx.send_if_modified(|value| {
                value.is_none() && {
                    *value = Some(result.clone());
                    true
                }
            });
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
        self.slot.deadline.saturating_duration_since(Instant::now())
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
pub(crate) struct FlightWatch(Arc<Slot>);

impl FlightWatch {
    /// Whether a follower is waiting right now.
    pub(crate) fn waited_on(&self) -> bool {
        self.0.tx.receiver_count() > 0
    }

    /// What is left of the flight's deadline, past which its followers
    /// stop waiting on it.
    pub(crate) fn time_left(&self) -> Duration {
        self.0.deadline.saturating_duration_since(Instant::now())
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
    deadline: Instant,
}

impl Follower {
    /// Waits for the leader's result, at most until the flight's deadline.
    pub(crate) async fn wait(mut self) -> Waited {
        let result =
            tokio::time::timeout_at(self.deadline, self.rx.wait_for(Option::is_some)).await;
        match result {
            Ok(Ok(value)) => Waited::Done(value.clone().unwrap_or(FlightResult::Released)),
            // The sender lives in the map and the leader; both gone without a
            // value cannot happen (Drop sends), but fail safe.
            Ok(Err(_)) => Waited::Done(FlightResult::Failed(FlightError::Abandoned)),
            Err(_) => Waited::TimedOut,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheKey, Times, Value};
    use std::time::SystemTime;

    const WAIT: Duration = Duration::from_secs(5);

    fn entry() -> Entry {
        let now = SystemTime::now();
        Entry::new(
            "k".into(),
            Default::default(),
            Value::from_body("v"),
            Times::fresh(now, now),
            Duration::ZERO,
        )
    }

    fn join(flights: &Arc<Flights>) -> Join {
        flights.join(CacheKey::new("k").hash(), WAIT)
    }

    #[tokio::test]
    async fn followers_get_the_leaders_result() {
        let flights = Arc::new(Flights::default());
        let Join::Leader(leader) = join(&flights) else {
            panic!("first is leader")
        };
        let followers: Vec<_> = (0..10)
            .map(|_| match join(&flights) {
                Join::Follower(f) => tokio::spawn(f.wait()),
                Join::Leader(_) => panic!("second leader"),
            })
            .collect();
        assert_eq!(leader.waiters(), 10);
        leader.complete(FlightResult::Shared(entry(), Source::Origin));
        for f in followers {
            assert!(matches!(
                f.await.unwrap(),
                Waited::Done(FlightResult::Shared(_, Source::Origin))
            ));
        }
        assert_eq!(flights.in_flight(), 0);
        assert!(matches!(join(&flights), Join::Leader(_)));
    }

    #[tokio::test]
    async fn a_panicking_leader_wakes_followers_with_an_error() {
        let flights = Arc::new(Flights::default());
        let Join::Leader(leader) = join(&flights) else {
            panic!()
        };
        let Join::Follower(follower) = join(&flights) else {
            panic!()
        };
        let task = tokio::spawn(async move {
            let _leader = leader;
            panic!("origin exploded");
        });
        assert!(task.await.unwrap_err().is_panic());
        assert!(matches!(
            follower.wait().await,
            Waited::Done(FlightResult::Failed(FlightError::Panicked))
        ));
        assert_eq!(flights.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_dropped_leader_abandons() {
        let flights = Arc::new(Flights::default());
        let Join::Leader(leader) = join(&flights) else {
            panic!()
        };
        let Join::Follower(follower) = join(&flights) else {
            panic!()
        };
        drop(leader);
        assert!(matches!(
            follower.wait().await,
            Waited::Done(FlightResult::Failed(FlightError::Abandoned))
        ));
    }

    #[test]
    fn past_the_cap_leaders_load_alone() {
        let flights = Arc::new(Flights::with_cap(2));
        let leaders: Vec<_> = (0..5u32)
            .map(|i| flights.join(CacheKey::new(i.to_le_bytes()).hash(), WAIT))
            .collect();
        assert!(leaders.iter().all(|j| matches!(j, Join::Leader(_))));
        assert_eq!(flights.in_flight(), 2, "the map stays bounded");
        drop(leaders);
        assert_eq!(flights.in_flight(), 0);
    }

    /// The deadline counts from the flight's start: a follower that arrives
    /// late waits only for what is left of it.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_counts_from_the_flights_start() {
        let flights = Arc::new(Flights::default());
        let wait = Duration::from_millis(100);
        let key = CacheKey::new("k").hash();
        let Join::Leader(_leader) = flights.join(key, wait) else {
            panic!()
        };
        tokio::time::sleep(Duration::from_millis(80)).await;
        let Join::Follower(late) = flights.join(key, wait) else {
            panic!()
        };
        let started = Instant::now();
        assert!(matches!(late.wait().await, Waited::TimedOut));
        assert_eq!(started.elapsed(), Duration::from_millis(20));
    }

    /// Past the deadline the next request takes the flight over, and the
    /// ones after it follow the new leader (one at a time, not all at once).
    #[tokio::test(start_paused = true)]
    async fn a_stalled_leader_is_taken_over_by_one_request() {
        let flights = Arc::new(Flights::default());
        let wait = Duration::from_millis(100);
        let key = CacheKey::new("k").hash();
        let Join::Leader(stalled) = flights.join(key, wait) else {
            panic!()
        };
        tokio::time::sleep(wait).await;
        let Join::Leader(new) = flights.join(key, wait) else {
            panic!("the stalled flight is taken over")
        };
        assert!(matches!(flights.join(key, wait), Join::Follower(_)));
        // The stalled leader finishing late does not end the new flight.
        stalled.complete(FlightResult::Released);
        assert_eq!(flights.in_flight(), 1);
        new.complete(FlightResult::Released);
        assert_eq!(flights.in_flight(), 0);
    }

    /// A slow leader's stored answer reaches the followers of the flight
    /// that took it over, and whoever joins that flight later; an answer
    /// that may not be shared does not.
    #[tokio::test(start_paused = true)]
    async fn a_slow_leaders_shared_answer_reaches_the_newer_flight() {
        let flights = Arc::new(Flights::default());
        let wait = Duration::from_millis(100);
        let key = CacheKey::new("k").hash();
        let Join::Leader(slow) = flights.join(key, wait) else {
            panic!()
        };
        tokio::time::sleep(wait).await;
        let Join::Leader(new) = flights.join(key, wait) else {
            panic!()
        };
        let Join::Follower(waiting) = flights.join(key, wait) else {
            panic!()
        };
        slow.complete(FlightResult::Shared(entry(), Source::Origin));
        assert!(matches!(
            waiting.wait().await,
            Waited::Done(FlightResult::Shared(..))
        ));
        let Join::Follower(later) = flights.join(key, wait) else {
            panic!("the newer flight is still its leader's")
        };
        assert!(matches!(
            later.wait().await,
            Waited::Done(FlightResult::Shared(..))
        ));
        new.complete(FlightResult::Released);
        assert_eq!(flights.in_flight(), 0);

        // Released (not shareable): the newer flight's followers wait on.
        let Join::Leader(slow) = flights.join(key, wait) else {
            panic!()
        };
        tokio::time::sleep(wait).await;
        let Join::Leader(_new) = flights.join(key, wait) else {
            panic!()
        };
        let Join::Follower(waiting) = flights.join(key, wait) else {
            panic!()
        };
        slow.complete(FlightResult::Released);
        assert!(matches!(waiting.wait().await, Waited::TimedOut));
    }
}
