//! Counters kept by the engine, and their snapshot.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::Serialize;

/// A point-in-time copy of the engine's counters (serialises to the `/stats` JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Fresh answers from L1.
    pub hits_l1: u64,
    /// Answers from L2 (promoted to L1).
    pub hits_l2: u64,
    /// Lookups that found nothing usable and waited on, or made, an origin load.
    pub misses: u64,
    /// Stale entries served (stale-while-revalidate, stale-if-error, soft timeout).
    pub stale_served: u64,
    /// Fresh hits that started an early refresh (XFetch).
    pub early_refreshes: u64,
    /// Refreshes not started because `max_refreshes` were running (the
    /// entry answered; a later hit starts it).
    pub refreshes_deferred: u64,
    /// Calls that reached the origin on behalf of the cache.
    pub origin_loads: u64,
    /// Fills cancelled when their caller went away while
    /// `max_detached_fills` others ran on without theirs (a fill that
    /// finished at that very moment may be counted too).
    pub fills_cancelled: u64,
    /// Requests that waited on another request's origin load (on this
    /// instance, or another's through the fleet lock), once each, whether
    /// they got its answer or loaded their own past the deadline.
    pub coalesced: u64,
    /// Requests (and background refreshes, on the fleet lock) whose wait
    /// on another's load reached its deadline (`lock_timeout`), once each
    /// however many flights they followed.
    pub lock_timeouts: u64,
    /// Failed or timed-out L2 reads (each fell through to the origin) and failed L2 writes.
    pub l2_errors: u64,
    /// Of the L2 read errors, those that were timeouts.
    pub l2_timeouts: u64,
    /// The shared tier's own counters (zero without one).
    pub l2: crate::TierReport,
    /// The shared tier's last connection failure, if it ever had one.
    pub l2_last_failure: Option<crate::TierFailure>,
    /// Entries reclaimed because they outlived their hard expiry (sweeper, read, or moka's bound).
    pub expired: u64,
    /// Entries pushed out of L1 by its byte budget.
    pub evicted: u64,
    /// Sweeper passes run.
    pub sweeps: u64,
    /// Requests that skipped the cache, by reason (`authorization`, `cookie`, `method`, …).
    pub bypassed: BTreeMap<String, u64>,
    /// Hits (any tier, stale included) over lookups, `0.0..=1.0`.
    pub hit_ratio: f64,
    /// Origin load time (δ, the XFetch input).
    pub origin_latency: LatencyStats,
    /// Invalidations on their way to the shared tier.
    pub invalidations: InvalidationStats,
}

/// What became of the invalidations that had to reach the shared tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct InvalidationStats {
    /// Landed in the shared tier (at once, or after retries).
    pub landed: u64,
    /// Could not land at once, and were queued for retries.
    pub queued: u64,
    /// Retries sent.
    pub retried: u64,
    /// Merged into one broader invalidation because the queue was full.
    pub merged: u64,
    /// Waiting in the queue now.
    pub pending: u64,
}

/// Origin latency summary, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct LatencyStats {
    /// Loads measured.
    pub count: u64,
    /// The last load's time.
    pub last_ms: f64,
    /// Mean load time.
    pub mean_ms: f64,
    /// Slowest load.
    pub max_ms: f64,
    /// Loads by time: `buckets[i]` counts those that took at most
    /// [`BOUNDS_MS[i]`](Self::BOUNDS_MS) (and more than the bound before);
    /// the last bucket, the slower ones.
    pub buckets: [u64; LatencyStats::BUCKETS],
}

impl LatencyStats {
    /// Buckets in [`buckets`](Self::buckets): one per bound, and one open.
    pub const BUCKETS: usize = 13;
    /// Upper bounds of the histogram's buckets, in milliseconds.
    pub const BOUNDS_MS: [f64; Self::BUCKETS - 1] = [
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
    ];

    fn bucket(nanos: u64) -> usize {
        let ms = nanos as f64 / 1e6;
        Self::BOUNDS_MS
            .iter()
            .position(|&bound| ms <= bound)
            .unwrap_or(Self::BUCKETS - 1)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) hits_l1: AtomicU64,
    pub(crate) hits_l2: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) stale_served: AtomicU64,
    pub(crate) early_refreshes: AtomicU64,
    pub(crate) refreshes_deferred: AtomicU64,
    pub(crate) origin_loads: AtomicU64,
    pub(crate) fills_cancelled: AtomicU64,
    pub(crate) coalesced: AtomicU64,
    pub(crate) lock_timeouts: AtomicU64,
    /// Waits on another instance's fill lock (`TierReport::lock_waits`).
    pub(crate) fleet_waits: AtomicU64,
    pub(crate) l2_errors: AtomicU64,
    pub(crate) l2_timeouts: AtomicU64,
    pub(crate) expired: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) sweeps: AtomicU64,
    pub(crate) invalidations_landed: AtomicU64,
    pub(crate) invalidations_queued: AtomicU64,
    pub(crate) invalidations_retried: AtomicU64,
    pub(crate) invalidations_merged: AtomicU64,
    origin_nanos_total: AtomicU64,
    origin_nanos_last: AtomicU64,
    origin_nanos_max: AtomicU64,
    origin_buckets: [AtomicU64; LatencyStats::BUCKETS],
    bypassed: Mutex<BTreeMap<&'static str, u64>>,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Relaxed);
}

impl Counters {
    pub(crate) fn bypass(&self, reason: &'static str) {
        *self.bypassed.lock().unwrap().entry(reason).or_default() += 1;
    }

    pub(crate) fn origin_load(&self, took: Duration) {
        let nanos = took.as_nanos().min(u64::MAX as u128) as u64;
        bump(&self.origin_loads);
        self.origin_nanos_total.fetch_add(nanos, Relaxed);
        self.origin_nanos_last.store(nanos, Relaxed);
        self.origin_nanos_max.fetch_max(nanos, Relaxed);
        bump(&self.origin_buckets[LatencyStats::bucket(nanos)]);
    }

    pub(crate) fn hit_ratio(&self) -> f64 {
        let hits = self.hits_l1.load(Relaxed)
            + self.hits_l2.load(Relaxed)
            + self.stale_served.load(Relaxed);
        let lookups = hits + self.misses.load(Relaxed);
        if lookups == 0 {
            0.0
        } else {
            hits as f64 / lookups as f64
        }
    }

    pub(crate) fn snapshot(
        &self,
        l2: crate::TierReport,
        l2_last_failure: Option<crate::TierFailure>,
        pending: usize,
    ) -> Stats {
        let count = self.origin_loads.load(Relaxed);
        let ms = |n: u64| n as f64 / 1e6;
        Stats {
            hits_l1: self.hits_l1.load(Relaxed),
            hits_l2: self.hits_l2.load(Relaxed),
            misses: self.misses.load(Relaxed),
            stale_served: self.stale_served.load(Relaxed),
            early_refreshes: self.early_refreshes.load(Relaxed),
            refreshes_deferred: self.refreshes_deferred.load(Relaxed),
            origin_loads: count,
            fills_cancelled: self.fills_cancelled.load(Relaxed),
            coalesced: self.coalesced.load(Relaxed),
            lock_timeouts: self.lock_timeouts.load(Relaxed),
            l2_errors: self.l2_errors.load(Relaxed) + l2.write_errors,
            l2_timeouts: self.l2_timeouts.load(Relaxed),
            l2: crate::TierReport {
                lock_waits: l2.lock_waits + self.fleet_waits.load(Relaxed),
                ..l2
            },
            l2_last_failure,
            expired: self.expired.load(Relaxed),
            evicted: self.evicted.load(Relaxed),
            sweeps: self.sweeps.load(Relaxed),
            bypassed: self
                .bypassed
                .lock()
                .unwrap()
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
            hit_ratio: self.hit_ratio(),
            origin_latency: LatencyStats {
                count,
                last_ms: ms(self.origin_nanos_last.load(Relaxed)),
                mean_ms: if count == 0 {
                    0.0
                } else {
                    ms(self.origin_nanos_total.load(Relaxed)) / count as f64
                },
                max_ms: ms(self.origin_nanos_max.load(Relaxed)),
                buckets: std::array::from_fn(|i| self.origin_buckets[i].load(Relaxed)),
            },
            invalidations: InvalidationStats {
                landed: self.invalidations_landed.load(Relaxed),
                queued: self.invalidations_queued.load(Relaxed),
                retried: self.invalidations_retried.load(Relaxed),
                merged: self.invalidations_merged.load(Relaxed),
                pending: pending as u64,
            },
        }
    }
}

/// L1's expiry horizon: entries going stale in each of the coming seconds
/// (see [`TieredCache::expiry_horizon`](crate::TieredCache::expiry_horizon)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Horizon {
    /// `buckets[i]`: entries whose fresh lifetime ends between `i` and
    /// `i + 1` seconds from now.
    pub buckets: Vec<u64>,
    /// Entries already stale (served stale, revalidated, or awaiting the sweep).
    pub already_stale: u64,
    /// Entries read to count.
    pub examined: u64,
    /// Entries in L1.
    pub entries: u64,
    /// Whether the counts were scaled up from a sample.
    pub scaled: bool,
}

impl Horizon {
    /// Most entries read for one horizon (~10 ms of a core).
    pub const SAMPLE: usize = 100_000;
}
