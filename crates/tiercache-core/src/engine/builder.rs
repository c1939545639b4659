//! Building the engine: L1's budget, the shared tier, the clock, the sweeper.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::{Inner, Journal, TieredCache};
use crate::l1::L1;
use crate::stats::Counters;
use crate::{Clock, InvalidationSink, PolicyError, SystemClock, Tier};

/// Builds a [`TieredCache`]; see [`TieredCache::builder`].
#[derive(Debug)]
pub struct TieredCacheBuilder {
    l1_capacity: u64,
    l2: Option<Arc<dyn Tier>>,
    clock: Arc<dyn Clock>,
    sweep_interval: Option<Duration>,
    rng_seed: Option<u64>,
    max_refreshes: usize,
    max_detached_fills: usize,
}

impl Default for TieredCacheBuilder {
    fn default() -> Self {
        Self {
            l1_capacity: TieredCacheBuilder::DEFAULT_L1_CAPACITY,
            l2: None,
            clock: Arc::new(SystemClock),
            sweep_interval: Some(TieredCacheBuilder::DEFAULT_SWEEP_INTERVAL),
            rng_seed: None,
            max_refreshes: TieredCacheBuilder::DEFAULT_MAX_REFRESHES,
            max_detached_fills: TieredCacheBuilder::DEFAULT_MAX_DETACHED_FILLS,
        }
    }
}

impl TieredCacheBuilder {
    /// Default L1 byte budget: 256 MiB.
    pub const DEFAULT_L1_CAPACITY: u64 = 256 * 1024 * 1024;
    /// Default [`max_refreshes`](Self::max_refreshes): 32.
    pub const DEFAULT_MAX_REFRESHES: usize = 32;
    /// Default [`max_detached_fills`](Self::max_detached_fills): 1,024.
    pub const DEFAULT_MAX_DETACHED_FILLS: usize = 1024;
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

    /// Most background refreshes (stale-while-revalidate, XFetch) running
    /// at once (default 32). A hit that would start one more answers without
    /// it (a later hit starts it, once a refresh has finished): refreshes
    /// are paced, never fired at the origin all together when a cohort goes
    /// stale, and never starve the misses that must wait on it. Size it
    /// below the origin's own concurrency (a database pool), leaving room
    /// for the misses.
    pub fn max_refreshes(mut self, n: usize) -> Self {
        self.max_refreshes = n;
        self
    }

    /// Most fills running on after their caller stopped waiting (default
    /// 1,024). A fill runs in a task of its own so that a client who
    /// disconnects strands nobody: it goes on to store its answer, and
    /// anyone who joined the flight meanwhile gets it. Past this many at
    /// once, the fill of a caller that goes away is cancelled instead, as
    /// the origin call would be without a cache, once nobody waits on it:
    /// at once, or at the flight's deadline when others wait (they get its
    /// answer if it comes first). A refresh left behind by a caller that
    /// took the stale answer at the soft timeout counts too. An origin that
    /// never answers cannot pile up tasks one abandoned request at a time.
    /// `/stats` counts them (`fills_cancelled`).
    ///
    /// ```
    /// use tiercache_core::TieredCache;
    ///
    /// let cache = TieredCache::builder().sweep_interval(None).max_detached_fills(64).build();
    /// assert!(cache.is_ok());
    /// let refused = TieredCache::builder().sweep_interval(None).max_detached_fills(0).build();
    /// assert!(refused.unwrap_err().to_string().contains("max_detached_fills"));
    /// ```
    pub fn max_detached_fills(mut self, n: usize) -> Self {
        self.max_detached_fills = n;
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
        // (Past tokio's semaphore limit, the build panicked.)
        let permits = 1..=tokio::sync::Semaphore::MAX_PERMITS;
        if !permits.contains(&self.max_refreshes) {
            return Err(BuildError::Config(PolicyError {
                field: "max_refreshes",
                value: self.max_refreshes.to_string(),
                allowed: "at least 1 (background refreshes at once), at most tokio's `Semaphore::MAX_PERMITS`",
            }));
        }
        if !permits.contains(&self.max_detached_fills) {
            return Err(BuildError::Config(PolicyError {
                field: "max_detached_fills",
                value: self.max_detached_fills.to_string(),
                allowed: "at least 1 (fills running on after their caller left), at most tokio's `Semaphore::MAX_PERMITS`",
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
        let marks_clock = self.clock.clone();
        let failing_clock = self.clock.clone();
        let tag_room = Inner::tag_room(self.l1_capacity);
        let (marks_room, carved) = super::marks_room(self.l1_capacity);
        let inner = Arc::new(Inner {
            l1: L1::new(
                self.l1_capacity - carved,
                self.clock.clone(),
                counters.clone(),
            ),
            budget: self.l1_capacity,
            l2: self.l2,
            flights: Arc::default(),
            clock: self.clock,
            counters,
            rng: Mutex::new(rng),
            uncacheable: moka::sync::Cache::builder()
                .max_capacity(marks_room)
                .weigher(|_, _| super::MARK_WEIGHT)
                .expire_after(super::MarkExpiry(marks_clock))
                .build(),
            failing: moka::sync::Cache::builder()
                .max_capacity(super::FAILING_KEYS)
                .expire_after(super::MarkExpiry(failing_clock))
                .build(),
            // Pruned to follow L1 (see `engine::tags`), with a room past
            // which a tag invalidation drops all of L1.
            tags: Default::default(),
            tags_incomplete: Default::default(),
            deaf: Default::default(),
            tag_keys: Default::default(),
            tag_room,
            tags_prune_due: std::sync::atomic::AtomicBool::new(false),
            tags_prune_at: std::sync::atomic::AtomicUsize::new(Inner::next_prune(0, tag_room)),
            journal: Journal::default(),
            outbox: Arc::default(),
            refreshes: Arc::new(tokio::sync::Semaphore::new(self.max_refreshes)),
            detached: Arc::new(tokio::sync::Semaphore::new(self.max_detached_fills)),
            shared: Mutex::default(),
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
        // the async workers. Idle spare body mappings go back to the system.
        let _ = tokio::task::spawn_blocking(move || {
            engine.sweep();
            crate::body::trim_spares();
        })
        .await;
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
