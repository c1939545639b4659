//! A circuit breaker: after repeated failures Valkey is left alone for an
//! interval, then one probe decides whether it is back.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    interval: Duration,
    state: Mutex<State>,
    pub(crate) trips: AtomicU64,
}

#[derive(Debug)]
enum State {
    Closed {
        failures: u32,
    },
    /// `since`, in both open states: when it opened after being closed
    /// (kept through probes that fail).
    Open {
        until: Instant,
        since: Instant,
    },
    /// One probe is out; everyone else is refused until it answers, or
    /// until `until`: a probe whose caller gave up on it (its future was
    /// dropped by a timeout) never answers, and must not keep the breaker
    /// open for good.
    Probing {
        until: Instant,
        since: Instant,
    },
}

impl Breaker {
    pub(crate) fn new(threshold: u32, interval: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            interval,
            state: Mutex::new(State::Closed { failures: 0 }),
            trips: AtomicU64::new(0),
        }
    }

    /// Whether an operation may go to Valkey now.
    pub(crate) fn allow(&self) -> bool {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        match *state {
            State::Closed { .. } => true,
            State::Open { until, since } | State::Probing { until, since } if now >= until => {
                *state = State::Probing {
                    until: now + self.interval,
                    since,
                };
                true
            }
            State::Open { .. } | State::Probing { .. } => false,
        }
    }

    pub(crate) fn success(&self) {
        *self.state.lock().unwrap() = State::Closed { failures: 0 };
    }

    pub(crate) fn failure(&self) {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        let since = match *state {
            State::Closed { failures } if failures + 1 < self.threshold => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                return;
            }
            State::Open { .. } => return,
            State::Closed { .. } => now,
            State::Probing { since, .. } => since,
        };
        *state = State::Open {
            until: now + self.interval,
            since,
        };
        self.trips.fetch_add(1, Relaxed);
    }

    /// How long it has stayed open (no probe succeeding since it opened),
    /// or `None` while closed.
    pub(crate) fn open_for(&self) -> Option<Duration> {
        match *self.state.lock().unwrap() {
            State::Closed { .. } => None,
            State::Open { since, .. } | State::Probing { since, .. } => Some(since.elapsed()),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        !matches!(*self.state.lock().unwrap(), State::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_probes_once_and_closes() {
        let b = Breaker::new(3, Duration::from_secs(1));
        b.failure();
        b.failure();
        assert!(b.allow(), "two failures keep it closed");
        b.failure();
        assert!(!b.allow(), "the third opens it");
        assert_eq!(b.trips.load(Relaxed), 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.allow(), "one probe after the interval");
        assert!(!b.allow(), "and only one");
        b.failure();
        assert!(!b.allow(), "a failed probe reopens");
        assert_eq!(b.trips.load(Relaxed), 2);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.allow());
        b.success();
        assert!(b.allow() && b.allow(), "a good probe closes it");
        assert!(!b.is_open());
    }

    /// Open since the first trip, through failed probes; a good probe ends it.
    #[tokio::test(start_paused = true)]
    async fn counts_how_long_it_stays_open() {
        let b = Breaker::new(1, Duration::from_secs(1));
        assert_eq!(b.open_for(), None);
        b.failure();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.allow());
        b.failure();
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(b.open_for(), Some(Duration::from_secs(3)));
        assert!(b.allow());
        b.success();
        assert_eq!(b.open_for(), None);
    }

    /// A probe whose caller went away (its future dropped by a timeout)
    /// never reports; after an interval another probe goes out.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_does_not_keep_it_open() {
        let b = Breaker::new(1, Duration::from_secs(1));
        b.failure();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.allow(), "the probe goes out, and is never heard of again");
        assert!(!b.allow());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.allow(), "a new probe after the interval");
        b.success();
        assert!(!b.is_open());
    }
}
