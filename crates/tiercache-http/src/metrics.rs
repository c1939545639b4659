//! Metrics through the [`metrics`] facade, for any exporter (Prometheus,
//! StatsD, …).
//!
//! Per route (label `route`, from [`ResponseCacheLayer::route_named`]):
//!
//! | metric | kind | labels |
//! | --- | --- | --- |
//! | `tiercache_requests_total` | counter | `route`, `outcome` (`hit`, `miss`, `stale`, `bypass`), `tier` (`l1`, `l2`, `origin`) |
//! | `tiercache_bypass_total` | counter | `route`, `reason` (`authorization`, `cookie`, `method`, …) |
//! | `tiercache_not_stored_total` | counter | `route`, `reason` (`set-cookie`, `private`, `too-large`, …) |
//! | `tiercache_origin_duration_seconds` | histogram | `route`: every origin call's time (XFetch's δ) |
//! | `tiercache_lock_wait_seconds` | histogram | `route`: waits on another request's load (its count: the route's coalesced waiters) |
//! | `tiercache_route_lock_timeouts_total` | counter | `route`: waits that gave up after the policy's `lock_timeout` |
//! | `tiercache_route_early_refreshes_total` | counter | `route`: XFetch refreshes started before expiry |
//!
//! For the engine, set from its counters by [`ResponseCacheLayer::publish_metrics`]
//! (call it before each scrape; the per-route metrics need no call):
//! `tiercache_origin_loads_total`, `tiercache_coalesced_total`,
//! `tiercache_lock_timeouts_total`, `tiercache_early_refreshes_total`,
//! `tiercache_stale_served_total`, `tiercache_l2_errors_total`,
//! `tiercache_l2_timeouts_total`, `tiercache_l2_write_drops_total`,
//! `tiercache_l2_corrupt_total`, `tiercache_l2_breaker_trips_total`,
//! `tiercache_l2_breaker_open` (gauge), `tiercache_expired_total`,
//! `tiercache_evicted_total`, `tiercache_sweeps_total`,
//! `tiercache_invalidations_received_total`, `tiercache_resyncs_total`,
//! `tiercache_fleet_locks_acquired_total`, `tiercache_fleet_lock_waits_total`,
//! `tiercache_l1_bytes`, `tiercache_l1_entries`, `tiercache_hit_ratio` (gauges).
//!
//! Handles are taken when the layer and its routes are built, from the
//! recorder in force then: install the recorder (or enter a local one)
//! first. Without one, every metric is a no-op.
//!
//! [`ResponseCacheLayer::route_named`]: crate::ResponseCacheLayer::route_named
//! [`ResponseCacheLayer::publish_metrics`]: crate::ResponseCacheLayer::publish_metrics

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use tiercache_core::{Source, Stats};

use crate::cacheable::Reason;

/// One route's handles.
#[derive(Debug)]
pub(crate) struct RouteMetrics {
    name: String,
    hit_l1: Counter,
    hit_l2: Counter,
    miss: Counter,
    stale: Counter,
    bypass: Vec<Counter>,
    not_stored: Vec<Counter>,
    origin: Histogram,
    lock_wait: Histogram,
    lock_timeouts: Counter,
    early_refreshes: Counter,
}

impl RouteMetrics {
    pub(crate) fn new(route: &str) -> Self {
        let route = route.to_owned();
        let requests = |outcome: &'static str, tier: &'static str| counter!("tiercache_requests_total", "route" => route.clone(), "outcome" => outcome, "tier" => tier);
        let by_reason = |name: &'static str| -> Vec<Counter> {
            Reason::ALL
                .iter()
                .map(|r| counter!(name, "route" => route.clone(), "reason" => r.as_str()))
                .collect()
        };
        Self {
            name: route.clone(),
            hit_l1: requests("hit", "l1"),
            hit_l2: requests("hit", "l2"),
            miss: requests("miss", "origin"),
            stale: requests("stale", "l1"),
            bypass: by_reason("tiercache_bypass_total"),
            not_stored: by_reason("tiercache_not_stored_total"),
            origin: histogram!("tiercache_origin_duration_seconds", "route" => route.clone()),
            lock_wait: histogram!("tiercache_lock_wait_seconds", "route" => route.clone()),
            lock_timeouts: counter!("tiercache_route_lock_timeouts_total", "route" => route.clone()),
            early_refreshes: counter!("tiercache_route_early_refreshes_total", "route" => route),
        }
    }

    /// The route's label.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn hit_l1(&self) {
        self.hit_l1.increment(1);
    }

    pub(crate) fn served(&self, source: Source) {
        match source {
            Source::L1 => &self.hit_l1,
            Source::L2 => &self.hit_l2,
            Source::Origin => &self.miss,
        }
        .increment(1);
    }

    pub(crate) fn stale(&self) {
        self.stale.increment(1);
    }

    pub(crate) fn bypass(&self, reason: Reason) {
        self.bypass[reason as usize].increment(1);
    }

    pub(crate) fn not_stored(&self, reason: Reason) {
        self.not_stored[reason as usize].increment(1);
    }

    pub(crate) fn origin(&self, took: Duration) {
        self.origin.record(took.as_secs_f64());
    }

    pub(crate) fn lock_wait(&self, took: Duration) {
        self.lock_wait.record(took.as_secs_f64());
    }

    pub(crate) fn lock_timeout(&self) {
        self.lock_timeouts.increment(1);
    }

    pub(crate) fn early_refresh(&self) {
        self.early_refreshes.increment(1);
    }
}

/// Reads one counter out of a snapshot.
type Read = fn(&Stats) -> u64;

/// The engine's handles, set from a [`Stats`] snapshot.
#[derive(Debug)]
pub(crate) struct EngineMetrics {
    totals: Vec<(Read, Counter)>,
    breaker_open: Gauge,
    l1_bytes: Gauge,
    l1_entries: Gauge,
    hit_ratio: Gauge,
}

impl EngineMetrics {
    pub(crate) fn new() -> Self {
        let totals: Vec<(&'static str, Read)> = vec![
            ("tiercache_origin_loads_total", |s| s.origin_loads),
            ("tiercache_coalesced_total", |s| s.coalesced),
            ("tiercache_lock_timeouts_total", |s| s.lock_timeouts),
            ("tiercache_early_refreshes_total", |s| s.early_refreshes),
            ("tiercache_stale_served_total", |s| s.stale_served),
            ("tiercache_l2_errors_total", |s| s.l2_errors),
            ("tiercache_l2_timeouts_total", |s| s.l2_timeouts),
            ("tiercache_l2_write_drops_total", |s| s.l2.write_drops),
            ("tiercache_l2_corrupt_total", |s| s.l2.corrupt),
            ("tiercache_l2_breaker_trips_total", |s| s.l2.breaker_trips),
            ("tiercache_expired_total", |s| s.expired),
            ("tiercache_evicted_total", |s| s.evicted),
            ("tiercache_sweeps_total", |s| s.sweeps),
            ("tiercache_invalidations_received_total", |s| {
                s.l2.invalidations_received
            }),
            ("tiercache_resyncs_total", |s| s.l2.resyncs),
            ("tiercache_fleet_locks_acquired_total", |s| {
                s.l2.locks_acquired
            }),
            ("tiercache_fleet_lock_waits_total", |s| s.l2.lock_waits),
        ];
        Self {
            totals: totals
                .into_iter()
                .map(|(name, read)| (read, counter!(name)))
                .collect(),
            breaker_open: gauge!("tiercache_l2_breaker_open"),
            l1_bytes: gauge!("tiercache_l1_bytes"),
            l1_entries: gauge!("tiercache_l1_entries"),
            hit_ratio: gauge!("tiercache_hit_ratio"),
        }
    }

    pub(crate) fn publish(&self, stats: &Stats, l1_bytes: u64, l1_entries: u64) {
        for (read, counter) in &self.totals {
            counter.absolute(read(stats));
        }
        self.breaker_open
            .set(if stats.l2.breaker_open { 1.0 } else { 0.0 });
        self.l1_bytes.set(l1_bytes as f64);
        self.l1_entries.set(l1_entries as f64);
        self.hit_ratio.set(stats.hit_ratio);
    }
}
