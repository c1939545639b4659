//! A live dashboard for a tiercache engine, as an axum [`Router`].
//!
//! [`router`] serves, at its root, one self-contained HTML page (no external
//! scripts, fonts or styles: it works offline) that refreshes every second
//! from two JSON endpoints beside it, and draws its charts in SVG itself:
//!
//! - `GET /api/stats` ([`Snapshot`]): the hit ratio (last minute and since
//!   start), requests by outcome and tier, origin calls, in-flight fills, lock
//!   waits and timeouts, stale answers, the origin latency histogram, L1 bytes
//!   against the budget, entries, expired vs evicted, the shared tier's state
//!   (breaker, write queue, invalidations queued), and a per-second history
//!   of the last ten minutes;
//! - `GET /api/horizon?seconds=N` ([`tiercache_core::Horizon`]): how many L1
//!   entries go stale in each of the next `N` seconds (default 120, at most
//!   3,600): an expiry wave, seen before it reaches the origin.
//!
//! The proxy serves it on its admin address; an app mounts it wherever it
//! likes, ideally where only operators reach it:
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tiercache_core::{Policy, TieredCache};
//! use tiercache_http::ResponseCacheLayer;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
//! let app: Router = Router::new()
//!     .route("/products/{id}", get(|| async { "p" }).layer(cache.route(Policy::ttl(Duration::from_secs(30)))?))
//!     .nest("/admin/cache", tiercache_dashboard::router(cache.engine()));
//! // Open http://127.0.0.1:3000/admin/cache
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tiercache_core::{Horizon, LatencyStats, Stats, TieredCache};

/// The page, as served at the router's root.
pub const PAGE: &str = include_str!("page.html");

/// Per-second samples kept: ten minutes.
pub const HISTORY: usize = 600;

/// Longest horizon asked of `/api/horizon`, in seconds.
pub const MAX_HORIZON: usize = 3600;

/// The dashboard over `engine`: the page at `/`, its JSON at `/api/stats`
/// and `/api/horizon`. Sampling starts with the first request (or at once,
/// inside a Tokio runtime) and stops when the router is dropped. The router
/// needs no state of yours, so it nests or merges into a `Router<S>` of any
/// state `S`.
pub fn router<S>(engine: &TieredCache) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let state = Arc::new(Dashboard {
        engine: engine.clone(),
        started: Instant::now(),
        history: Mutex::new(History::default()),
        sampler: OnceLock::new(),
    });
    state.start_sampling();
    Router::new()
        .route("/", get(page))
        .route("/api/stats", get(stats))
        .route("/api/horizon", get(horizon))
        .with_state(state)
}

/// What the dashboard keeps between requests.
#[derive(Debug)]
struct Dashboard {
    engine: TieredCache,
    started: Instant,
    history: Mutex<History>,
    /// Set once the sampling task runs.
    sampler: OnceLock<()>,
}

impl Dashboard {
    /// Starts the once-a-second sampler, if there is a runtime to run it.
    fn start_sampling(self: &Arc<Self>) {
        if self.sampler.get().is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.sampler.set(()).is_ok() {
            runtime.spawn(sample(Arc::downgrade(self)));
        }
    }
}

async fn sample(dashboard: Weak<Dashboard>) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(dashboard) = dashboard.upgrade() else {
            return;
        };
        let totals = Totals::of(&dashboard.engine.stats());
        dashboard.history.lock().unwrap().push(totals);
    }
}

#[derive(Debug, Default)]
struct History {
    last: Option<Totals>,
    samples: VecDeque<Sample>,
}

impl History {
    fn push(&mut self, totals: Totals) {
        if let Some(last) = self.last {
            if self.samples.len() == HISTORY {
                self.samples.pop_front();
            }
            self.samples.push_back(Sample {
                at_ms: unix_ms(SystemTime::now()),
                counts: totals.since(&last),
            });
        }
        self.last = Some(totals);
    }
}

/// The engine's request counters; in a [`Sample`], their growth over one second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Totals {
    /// Fresh answers from L1.
    pub hits_l1: u64,
    /// Answers from L2.
    pub hits_l2: u64,
    /// Stale answers (stale-while-revalidate, stale-if-error, soft timeout).
    pub stale: u64,
    /// Lookups that waited on, or made, an origin load.
    pub misses: u64,
    /// Requests that skipped the cache.
    pub bypassed: u64,
    /// Calls that reached the origin.
    pub origin_loads: u64,
    /// Requests that waited on another's load (lock waits).
    pub coalesced: u64,
    /// Requests whose wait on another's load reached the lock timeout
    /// (once each).
    pub lock_timeouts: u64,
    /// Entries reclaimed past their hard expiry.
    pub expired: u64,
    /// Entries pushed out by L1's budget.
    pub evicted: u64,
}

impl Totals {
    fn of(stats: &Stats) -> Self {
        Self {
            hits_l1: stats.hits_l1,
            hits_l2: stats.hits_l2,
            stale: stats.stale_served,
            misses: stats.misses,
            bypassed: stats.bypassed.values().sum(),
            origin_loads: stats.origin_loads,
            coalesced: stats.coalesced,
            lock_timeouts: stats.lock_timeouts,
            expired: stats.expired,
            evicted: stats.evicted,
        }
    }

    fn since(&self, before: &Self) -> Self {
        let d = |now: u64, then: u64| now.saturating_sub(then);
        Self {
            hits_l1: d(self.hits_l1, before.hits_l1),
            hits_l2: d(self.hits_l2, before.hits_l2),
            stale: d(self.stale, before.stale),
            misses: d(self.misses, before.misses),
            bypassed: d(self.bypassed, before.bypassed),
            origin_loads: d(self.origin_loads, before.origin_loads),
            coalesced: d(self.coalesced, before.coalesced),
            lock_timeouts: d(self.lock_timeouts, before.lock_timeouts),
            expired: d(self.expired, before.expired),
            evicted: d(self.evicted, before.evicted),
        }
    }
}

/// One second of traffic: how much each counter grew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Sample {
    /// When the second ended, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The growth of each counter over it.
    #[serde(flatten)]
    pub counts: Totals,
}

/// The body of `GET /api/stats`.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// When it was taken, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Seconds since the dashboard was built.
    pub uptime_s: u64,
    /// Hits (any tier, stale included) over lookups since start.
    pub hit_ratio: f64,
    /// The same over the last 60 samples (`None` before any traffic).
    pub hit_ratio_last_minute: Option<f64>,
    /// The counters since start.
    pub totals: Totals,
    /// L1's bytes, budget and entries.
    pub l1: L1State,
    /// Keys with an origin load in flight now.
    pub in_flight: usize,
    /// Origin load times, with their histogram.
    pub origin_latency: Latency,
    /// The shared tier's state.
    pub l2: L2State,
    /// Invalidations on their way to the shared tier.
    pub invalidations: tiercache_core::InvalidationStats,
    /// The last [`HISTORY`] seconds, oldest first.
    pub history: HistoryView,
}

/// L1's occupancy.
#[derive(Debug, Clone, Copy, Serialize)]
#[non_exhaustive]
pub struct L1State {
    /// Bytes held, as weighed.
    pub bytes: u64,
    /// The byte budget.
    pub budget: u64,
    /// Entries held.
    pub entries: u64,
}

/// Origin load times.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Latency {
    /// Loads measured.
    pub count: u64,
    /// Mean load time.
    pub mean_ms: f64,
    /// Slowest load.
    pub max_ms: f64,
    /// How many loads took at most `le_ms` (and more than the bucket
    /// before); the last bucket (`le_ms: null`) holds the slower ones.
    pub buckets: Vec<Bucket>,
}

/// One histogram bucket.
#[derive(Debug, Clone, Copy, Serialize)]
#[non_exhaustive]
pub struct Bucket {
    /// Upper bound in milliseconds; `None` for the last, open bucket.
    pub le_ms: Option<f64>,
    /// Loads in it.
    pub count: u64,
}

impl Latency {
    fn of(stats: &LatencyStats) -> Self {
        let buckets = stats
            .buckets
            .iter()
            .enumerate()
            .map(|(i, &count)| Bucket {
                le_ms: LatencyStats::BOUNDS_MS.get(i).copied(),
                count,
            })
            .collect();
        Self {
            count: stats.count,
            mean_ms: stats.mean_ms,
            max_ms: stats.max_ms,
            buckets,
        }
    }
}

/// The shared tier, as this instance sees it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct L2State {
    /// Whether the engine has a shared tier.
    pub configured: bool,
    /// Whether its circuit breaker is open (requests go to the origin).
    pub breaker_open: bool,
    /// Writes waiting in its queue now.
    pub write_queue: u64,
    /// Writes dropped because the queue was full.
    pub write_drops: u64,
    /// Writes that failed or timed out.
    pub write_errors: u64,
    /// Failed or timed-out reads (each fell through to the origin).
    pub errors: u64,
    /// Of those, the timeouts.
    pub timeouts: u64,
    /// Invalidations received from other instances.
    pub invalidations_received: u64,
    /// Waits on another instance's fill lock.
    pub lock_waits: u64,
    /// Times the breaker opened.
    pub breaker_trips: u64,
    /// Times the tier's client was made to reconnect because Valkey stayed
    /// out (a connection gone silent, or a server down).
    pub reconnects_forced: u64,
    /// Times L1 was dropped because invalidations from other instances may
    /// have been missed (the message stream was lost or went silent).
    pub resyncs: u64,
    /// Failures of its connections (refused, TLS, a password, lost).
    pub connection_errors: u64,
    /// The last of them, and how long ago: why it is off.
    pub last_failure: Option<tiercache_core::TierFailure>,
}

/// The per-second history.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct HistoryView {
    /// Seconds per sample.
    pub interval_s: u64,
    /// Oldest first.
    pub samples: Vec<Sample>,
}

impl Dashboard {
    fn snapshot(&self) -> Snapshot {
        let stats = self.engine.stats();
        let samples: Vec<Sample> = self
            .history
            .lock()
            .unwrap()
            .samples
            .iter()
            .copied()
            .collect();
        let minute = samples
            .iter()
            .rev()
            .take(60)
            .fold((0, 0), |(hits, asked), s| {
                let c = &s.counts;
                let h = c.hits_l1 + c.hits_l2 + c.stale;
                (hits + h, asked + h + c.misses)
            });
        Snapshot {
            at_ms: unix_ms(SystemTime::now()),
            uptime_s: self.started.elapsed().as_secs(),
            hit_ratio: stats.hit_ratio,
            hit_ratio_last_minute: (minute.1 > 0).then(|| minute.0 as f64 / minute.1 as f64),
            totals: Totals::of(&stats),
            l1: L1State {
                bytes: self.engine.l1_weighted_size(),
                budget: self.engine.l1_capacity(),
                entries: self.engine.l1_entry_count(),
            },
            in_flight: self.engine.in_flight(),
            origin_latency: Latency::of(&stats.origin_latency),
            l2: L2State {
                configured: self.engine.has_l2(),
                breaker_open: stats.l2.breaker_open,
                write_queue: stats.l2.write_queue,
                write_drops: stats.l2.write_drops,
                write_errors: stats.l2.write_errors,
                errors: stats.l2_errors,
                timeouts: stats.l2_timeouts,
                invalidations_received: stats.l2.invalidations_received,
                lock_waits: stats.l2.lock_waits,
                breaker_trips: stats.l2.breaker_trips,
                reconnects_forced: stats.l2.reconnects_forced,
                resyncs: stats.l2.resyncs,
                connection_errors: stats.l2.connection_errors,
                last_failure: stats.l2_last_failure.clone(),
            },
            invalidations: stats.invalidations,
            history: HistoryView {
                interval_s: 1,
                samples,
            },
        }
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Never cached by anyone: it is live.
const NO_STORE: (axum::http::HeaderName, &str) = (CACHE_CONTROL, "no-store");

async fn page(State(dashboard): State<Arc<Dashboard>>) -> impl IntoResponse {
    dashboard.start_sampling();
    ([(CONTENT_TYPE, "text/html; charset=utf-8"), NO_STORE], PAGE)
}

async fn stats(State(dashboard): State<Arc<Dashboard>>) -> impl IntoResponse {
    dashboard.start_sampling();
    ([NO_STORE], Json(dashboard.snapshot()))
}

/// `?seconds=N`.
#[derive(Debug, Deserialize)]
struct HorizonQuery {
    seconds: Option<usize>,
}

async fn horizon(
    State(dashboard): State<Arc<Dashboard>>,
    Query(query): Query<HorizonQuery>,
) -> impl IntoResponse {
    let seconds = query.seconds.unwrap_or(120).clamp(1, MAX_HORIZON);
    let horizon: Horizon = dashboard.engine.expiry_horizon(seconds);
    ([NO_STORE], Json(horizon))
}
