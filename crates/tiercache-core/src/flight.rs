//! Single flight: one origin load per key, however many requests miss at once.
//!
//! The first request for a key becomes the [`Leader`]; the others get a
//! [`Follower`] and wait on the leader's result. A leader is a value, not a
//! task: whoever holds it (normally a task detached from the client's request)
//! completes it. Dropping it without completing wakes the followers with an
//! error, [`FlightError::Panicked`] when the drop happens while unwinding.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::{Entry, KeyHash, Source};

/// What a leader hands its followers.
#[derive(Debug, Clone)]
pub enum FlightResult {
    /// A response that may be shared, and the tier it came from.
    Shared(Entry, Source),
    /// The leader's response may not be shared: go to the origin yourself.
    Released,
    /// The load failed.
    Failed(FlightError),
}

/// Why a flight ended without a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlightError {
    /// The origin call panicked.
    Panicked,
    /// The leader was dropped before completing (its task was cancelled, e.g.
    /// at runtime shutdown).
    Abandoned,
}

impl fmt::Display for FlightError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlightError::Panicked => f.write_str("the origin load for this key panicked"),
            FlightError::Abandoned => {
                f.write_str("the origin load for this key was cancelled before it finished")
            }
        }
    }
}

impl std::error::Error for FlightError {}

/// What a follower's wait ended with.
#[derive(Debug, Clone)]
pub enum Waited {
    /// The leader finished.
    Done(FlightResult),
    /// `lock_timeout` passed first (counted as a lock timeout).
    TimedOut,
}

type Slot = watch::Sender<Option<FlightResult>>;

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
pub enum Join {
    /// Load the value and complete the flight.
    Leader(Leader),
    /// Wait for the leader.
    Follower(Follower),
}

impl Flights {
    pub(crate) const DEFAULT_CAP: usize = 65_536;

    pub(crate) fn with_cap(cap: usize) -> Self {
        Self {
            map: Mutex::default(),
            cap,
        }
    }

    pub(crate) fn join(self: &Arc<Self>, key: KeyHash) -> Join {
        let mut map = self.map.lock().unwrap();
        if let Some(slot) = map.get(&key) {
            return Join::Follower(Follower {
                rx: slot.subscribe(),
            });
        }
        let slot = Arc::new(watch::channel(None).0);
        if map.len() < self.cap {
            map.insert(key, slot.clone());
        }
        Join::Leader(Leader {
            key,
            slot,
            flights: self.clone(),
            done: false,
        })
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    fn finish(&self, key: &KeyHash, slot: &Arc<Slot>, result: FlightResult) {
        {
            // Only our own flight: a new one may already hold the key.
            let mut map = self.map.lock().unwrap();
            if map.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
                map.remove(key);
            }
        }
        slot.send_replace(Some(result));
    }
}

/// The one request per key allowed to load it. Complete it with
/// [`Leader::complete`]; dropping it wakes the followers with an error.
pub struct Leader {
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
    pub fn complete(mut self, result: FlightResult) {
        self.done = true;
        self.flights.finish(&self.key, &self.slot, result);
    }

    /// How many followers are waiting right now.
    pub fn waiters(&self) -> usize {
        self.slot.receiver_count()
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
pub struct Follower {
    rx: watch::Receiver<Option<FlightResult>>,
}

impl Follower {
    /// Waits for the leader's result, at most `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> Waited {
        let result = tokio::time::timeout(timeout, self.rx.wait_for(Option::is_some)).await;
        match result {
            Ok(Ok(value)) => Waited::Done(value.clone().expect("waited for Some")),
            // The sender lives in the map and the leader; both gone without a value
            // cannot happen (Drop sends), but fail safe.
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
        flights.join(CacheKey::new("k").hash())
    }

    #[tokio::test]
    async fn followers_get_the_leaders_result() {
        let flights = Arc::new(Flights::default());
        let Join::Leader(leader) = join(&flights) else {
            panic!("first is leader")
        };
        let followers: Vec<_> = (0..10)
            .map(|_| match join(&flights) {
                Join::Follower(f) => tokio::spawn(f.wait(Duration::from_secs(5))),
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
        let waited = follower.wait(Duration::from_secs(5)).await;
        assert!(matches!(
            waited,
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
            follower.wait(Duration::from_secs(5)).await,
            Waited::Done(FlightResult::Failed(FlightError::Abandoned))
        ));
    }

    #[test]
    fn past_the_cap_leaders_load_alone() {
        let flights = Arc::new(Flights::with_cap(2));
        let leaders: Vec<_> = (0..5u32)
            .map(|i| flights.join(CacheKey::new(i.to_le_bytes()).hash()))
            .collect();
        assert!(leaders.iter().all(|j| matches!(j, Join::Leader(_))));
        assert_eq!(flights.in_flight(), 2, "the map stays bounded");
        drop(leaders);
        assert_eq!(flights.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn followers_time_out() {
        let flights = Arc::new(Flights::default());
        let Join::Leader(_leader) = join(&flights) else {
            panic!()
        };
        let Join::Follower(follower) = join(&flights) else {
            panic!()
        };
        assert!(matches!(
            follower.wait(Duration::from_millis(50)).await,
            Waited::TimedOut
        ));
    }
}
