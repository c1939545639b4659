//! The engine's clock.
//!
//! Every freshness decision (fresh, stale, dead), every jitter draw's anchor and
//! the sweeper use this clock, never moka's internal one: moka's own TTL is only
//! the memory bound. Tests inject a [`MockClock`] (feature `test-util`) and move
//! time by hand.

use std::fmt::Debug;
use std::time::SystemTime;

/// A source of wall-clock time for the engine.
///
/// Wall-clock (not monotonic) because stored times travel with the entry into
/// L2 and to other instances; the remaining lifetime of an L2 entry comes from
/// the server's own `PTTL`, so a pod's skew never extends a lifetime.
pub trait Clock: Send + Sync + Debug + 'static {
    /// The current time.
    fn now(&self) -> SystemTime;

    /// Whether this clock keeps the machine's own time, as moka's does.
    /// Then moka reclaims each dead entry on time by itself and L1 keeps no
    /// expiry index beside it (~45 bytes an entry, and more between its
    /// rebuilds). `false` unless a clock says otherwise: one that runs apart
    /// from the machine's (a mock, an offset) has its dead entries found by
    /// the sweep through that index.
    fn keeps_machine_time(&self) -> bool {
        false
    }
}

/// The real clock, [`SystemTime::now`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn keeps_machine_time(&self) -> bool {
        true
    }
}

#[cfg(any(test, feature = "test-util"))]
pub use mock::MockClock;

#[cfg(any(test, feature = "test-util"))]
mod mock {
    use super::Clock;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    /// A clock that only moves when told to. Clones share the same time.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{Clock, MockClock};
    ///
    /// let clock = MockClock::new();
    /// let t0 = clock.now();
    /// clock.advance(Duration::from_secs(30));
    /// assert_eq!(clock.now().duration_since(t0).unwrap(), Duration::from_secs(30));
    /// ```
    #[derive(Debug, Clone)]
    pub struct MockClock {
        nanos_since_epoch: Arc<AtomicU64>,
    }

    impl MockClock {
        /// A clock standing at 2026-01-01T00:00:00Z.
        pub fn new() -> Self {
            Self::at(UNIX_EPOCH + Duration::from_secs(1_767_225_600))
        }

        /// A clock standing at `time`.
        pub fn at(time: SystemTime) -> Self {
            let nanos = time
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64;
            Self {
                nanos_since_epoch: Arc::new(AtomicU64::new(nanos)),
            }
        }

        /// Moves the clock forward by `by`.
        pub fn advance(&self, by: Duration) {
            self.nanos_since_epoch
                .fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
        }
    }

    impl Default for MockClock {
        fn default() -> Self {
            Self::new()
        }
    }

    impl Clock for MockClock {
        fn now(&self) -> SystemTime {
            UNIX_EPOCH + Duration::from_nanos(self.nanos_since_epoch.load(Ordering::SeqCst))
        }
    }
}
