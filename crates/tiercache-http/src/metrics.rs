//! Metrics through the [`metrics`] facade, for any exporter (Prometheus,
//! StatsD, …).
//!
//! Per route (label `route`, from [`ResponseCacheLayer::route_named`]):
//!
//! | metric | kind | labels |
//! | --- | --- | --- |
//! | `tiercache_requests_total` | counter | `route`, `outcome` (`hit`, `miss`, `stale`, `bypass`), `tier` (`l1`, `l2`, `origin`; `none` for an `only-if-cached` miss, answered 504) |
//! | `tiercache_bypass_total` | counter | `route`, `reason` (`authorization`, `cookie`, `method`, …) |
//! | `tiercache_not_stored_total` | counter | `route`, `reason` (`set-cookie`, `private`, `too-large`, …) |
//! | `tiercache_origin_duration_seconds` | histogram | `route`: every origin load's time (misses, refreshes, hit-for-miss; XFetch's δ) |
//! | `tiercache_lock_wait_seconds` | histogram | `route`: one sample a request that waited on another's load, all of its wait (its count: the route's coalesced requests) |
//! | `tiercache_route_lock_timeouts_total` | counter | `route`: requests whose wait reached the policy's `lock_timeout`, once each |
//! | `tiercache_route_early_refreshes_total` | counter | `route`: XFetch refreshes started before expiry |
//!
//! For the engine, set from its counters by a task the layer starts (inside a
//! Tokio runtime, when it wraps its first service) that publishes them every
//! second while any of its layers or services lives, so a scrape needs no
//! call; [`ResponseCacheLayer::publish_metrics`] publishes them at once:
//! `tiercache_origin_loads_total`, `tiercache_coalesced_total`,
//! `tiercache_lock_timeouts_total`, `tiercache_early_refreshes_total`,
//! `tiercache_refreshes_deferred_total`, `tiercache_fills_cancelled_total`,
//! `tiercache_stale_served_total`, `tiercache_l2_errors_total`,
//! `tiercache_l2_timeouts_total`, `tiercache_l2_write_drops_total`,
//! `tiercache_l2_corrupt_total`, `tiercache_l2_breaker_trips_total`,
//! `tiercache_l2_reconnects_forced_total`, `tiercache_l2_connection_errors_total`,
//! `tiercache_l2_breaker_open`, `tiercache_l2_deaf` (gauges), `tiercache_expired_total`,
//! `tiercache_evicted_total`, `tiercache_sweeps_total`,
//! `tiercache_invalidations_received_total`, `tiercache_resyncs_total`,
//! `tiercache_fleet_locks_acquired_total`, `tiercache_fleet_lock_waits_total`,
//! `tiercache_fleet_failing_marks_total`, `tiercache_fleet_locks_lost_total`,
//! `tiercache_l1_bytes`, `tiercache_l1_entries`, `tiercache_hit_ratio` (gauges);
//! for the process (see `tiercache_core::body`): `tiercache_body_mappings`
//! (gauge: the page mappings of large bodies and L2 envelopes, spares
//! included) and `tiercache_body_heap_fallbacks_total` (large bodies and
//! envelopes stored on the heap:
//! past the mappings' cap, or refused one by the system).
//!
//! Each series is registered on its first use, so a scrape shows what
//! happened (a route's first bypass adds its `reason` series), not a wall of
//! zeros. It goes to the recorder given with
//! [`ResponseCacheLayer::metrics_recorder`] or, without one, to the recorder in
//! force at that first use (the global one, installed at any time before
//! traffic). Without any recorder every metric is a no-op. The exporter
//! versions this crate is built and tested with: `metrics` 0.24 and
//! `metrics-exporter-prometheus` 0.18.
//!
//! [`ResponseCacheLayer::route_named`]: crate::ResponseCacheLayer::route_named
//! [`ResponseCacheLayer::publish_metrics`]: crate::ResponseCacheLayer::publish_metrics
//! [`ResponseCacheLayer::metrics_recorder`]: crate::ResponseCacheLayer::metrics_recorder

use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use tiercache_core::{Source, Stats, TieredCache, body};

use crate::cacheable::Reason;

mod help;
use help::{HELP, Kind};

/// Where handles are registered: a recorder of the layer's own, or the one
/// in force at registration.
#[derive(Clone, Default)]
pub(crate) struct Sink(Option<Arc<dyn Recorder + Send + Sync>>);

impl fmt::Debug for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Sink(own)"
        } else {
            "Sink(ambient)"
        })
    }
}

/// What the `metrics` macros would attach: this module, at `INFO`.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

impl Sink {
    pub(crate) fn own(recorder: Arc<dyn Recorder + Send + Sync>) -> Self {
        Self(Some(recorder))
    }

    fn with<T>(&self, f: impl FnOnce(&dyn Recorder) -> T) -> T {
        match &self.0 {
            Some(recorder) => f(&**recorder),
            None => metrics::with_recorder(f),
        }
    }

    fn counter(&self, name: &'static str, labels: Vec<Label>) -> Counter {
        let key = Key::from_parts(name, labels);
        self.with(|r| r.register_counter(&key, &METADATA))
    }

    fn histogram(&self, name: &'static str, labels: Vec<Label>) -> Histogram {
        let key = Key::from_parts(name, labels);
        self.with(|r| r.register_histogram(&key, &METADATA))
    }

    fn gauge(&self, name: &'static str) -> Gauge {
        let key = Key::from_name(name);
        self.with(|r| r.register_gauge(&key, &METADATA))
    }

    /// Says what each metric counts (Prometheus's `# HELP`) to the recorder
    /// in force now, unless it was the one told last (`told` holds its
    /// address): a recorder installed late hears it at the next publish,
    /// and none is told every second (the Prometheus exporter keeps each
    /// description in a log until its next render).
    fn describe(&self, told: &AtomicUsize) {
        self.with(|r| {
            let address = r as *const dyn Recorder as *const () as usize;
            if told.swap(address, Relaxed) == address {
                return;
            }
            for &(name, kind, help) in HELP {
                let help = metrics::SharedString::const_str(help);
                match kind {
                    Kind::Counter => r.describe_counter(name.into(), None, help),
                    Kind::Gauge => r.describe_gauge(name.into(), None, help),
                    Kind::Histogram => {
                        r.describe_histogram(name.into(), Some(metrics::Unit::Seconds), help)
                    }
                }
            }
        });
    }
}

/// A handle registered on its first use.
type Lazy<T> = OnceLock<T>;

/// One route's handles, each registered on first use.
#[derive(Debug)]
pub(crate) struct RouteMetrics {
    name: String,
    sink: Sink,
    hit_l1: Lazy<Counter>,
    hit_l2: Lazy<Counter>,
    miss: Lazy<Counter>,
    stale: Lazy<Counter>,
    bypassed: Lazy<Counter>,
    not_cached: Lazy<Counter>,
    bypass: Vec<Lazy<Counter>>,
    not_stored: Vec<Lazy<Counter>>,
    origin: Lazy<Histogram>,
    lock_wait: Lazy<Histogram>,
    lock_timeouts: Lazy<Counter>,
    early_refreshes: Lazy<Counter>,
}

impl RouteMetrics {
    pub(crate) fn new(route: &str, sink: Sink) -> Self {
        let per_reason = || Reason::ALL.iter().map(|_| Lazy::new()).collect();
        Self {
            name: route.to_owned(),
            sink,
            hit_l1: Lazy::new(),
            hit_l2: Lazy::new(),
            miss: Lazy::new(),
            stale: Lazy::new(),
            bypassed: Lazy::new(),
            not_cached: Lazy::new(),
            bypass: per_reason(),
            not_stored: per_reason(),
            origin: Lazy::new(),
            lock_wait: Lazy::new(),
            lock_timeouts: Lazy::new(),
            early_refreshes: Lazy::new(),
        }
    }

    /// The route's label.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn route_label(&self) -> Label {
        Label::new("route", self.name.clone())
    }

    /// `tiercache_requests_total{route, outcome, tier}`, once.
    fn requests(&self, cell: &Lazy<Counter>, outcome: &'static str, tier: &'static str) {
        cell.get_or_init(|| {
            let labels = vec![
                self.route_label(),
                Label::new("outcome", outcome),
                Label::new("tier", tier),
            ];
            self.sink.counter("tiercache_requests_total", labels)
        })
        .increment(1);
    }

    /// `name{route}`, once.
    fn route_counter<'a>(&self, cell: &'a Lazy<Counter>, name: &'static str) -> &'a Counter {
        cell.get_or_init(|| self.sink.counter(name, vec![self.route_label()]))
    }

    fn route_histogram<'a>(&self, cell: &'a Lazy<Histogram>, name: &'static str) -> &'a Histogram {
        cell.get_or_init(|| self.sink.histogram(name, vec![self.route_label()]))
    }

    fn by_reason(&self, cells: &[Lazy<Counter>], name: &'static str, reason: Reason) {
        cells[reason as usize]
            .get_or_init(|| {
                let labels = vec![self.route_label(), Label::new("reason", reason.as_str())];
                self.sink.counter(name, labels)
            })
            .increment(1);
    }

    pub(crate) fn hit_l1(&self) {
        self.requests(&self.hit_l1, "hit", "l1");
    }

    pub(crate) fn served(&self, source: Source) {
        match source {
            Source::L1 => self.requests(&self.hit_l1, "hit", "l1"),
            Source::L2 => self.requests(&self.hit_l2, "hit", "l2"),
            Source::Origin => self.requests(&self.miss, "miss", "origin"),
        }
    }

    pub(crate) fn stale(&self) {
        self.requests(&self.stale, "stale", "l1");
    }

    /// A request the cache stood aside for: counted as a request with
    /// `outcome="bypass"` (it went to the origin) and under its reason.
    pub(crate) fn bypass(&self, reason: Reason) {
        self.requests(&self.bypassed, "bypass", "origin");
        self.by_reason(&self.bypass, "tiercache_bypass_total", reason);
    }

    /// An `only-if-cached` request nothing stored answers: a miss that
    /// reached no tier and not the origin.
    pub(crate) fn not_cached(&self) {
        self.requests(&self.not_cached, "miss", "none");
    }

    pub(crate) fn not_stored(&self, reason: Reason) {
        self.by_reason(&self.not_stored, "tiercache_not_stored_total", reason);
    }

    pub(crate) fn origin(&self, took: Duration) {
        self.route_histogram(&self.origin, "tiercache_origin_duration_seconds")
            .record(took.as_secs_f64());
    }

    pub(crate) fn lock_wait(&self, took: Duration) {
        self.route_histogram(&self.lock_wait, "tiercache_lock_wait_seconds")
            .record(took.as_secs_f64());
    }

    pub(crate) fn lock_timeout(&self) {
        self.route_counter(&self.lock_timeouts, "tiercache_route_lock_timeouts_total")
            .increment(1);
    }

    pub(crate) fn early_refresh(&self) {
        self.route_counter(
            &self.early_refreshes,
            "tiercache_route_early_refreshes_total",
        )
        .increment(1);
    }
}

/// Reads one counter out of a snapshot.
type Read = fn(&Stats) -> u64;

/// The engine's counters and gauges, set from a [`Stats`] snapshot; handles
/// are looked up at each publish, so a recorder installed late still gets them.
#[derive(Debug, Default)]
pub(crate) struct EngineMetrics {
    sink: Sink,
    /// Whether the task that keeps them current was started (or tried).
    publishing: std::sync::atomic::AtomicBool,
    /// The recorder told what each metric counts (see [`Sink::describe`]).
    described: AtomicUsize,
}

/// How often the engine's metrics are published on their own.
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// The engine's counters, by name.
const TOTALS: &[(&str, Read)] = &[
    ("tiercache_origin_loads_total", |s| s.origin_loads),
    ("tiercache_coalesced_total", |s| s.coalesced),
    ("tiercache_lock_timeouts_total", |s| s.lock_timeouts),
    ("tiercache_early_refreshes_total", |s| s.early_refreshes),
    ("tiercache_refreshes_deferred_total", |s| {
        s.refreshes_deferred
    }),
    ("tiercache_fills_cancelled_total", |s| s.fills_cancelled),
    ("tiercache_stale_served_total", |s| s.stale_served),
    ("tiercache_l2_errors_total", |s| s.l2_errors),
    ("tiercache_l2_timeouts_total", |s| s.l2_timeouts),
    ("tiercache_l2_write_drops_total", |s| s.l2.write_drops),
    ("tiercache_l2_corrupt_total", |s| s.l2.corrupt),
    ("tiercache_l2_breaker_trips_total", |s| s.l2.breaker_trips),
    ("tiercache_l2_reconnects_forced_total", |s| {
        s.l2.reconnects_forced
    }),
    ("tiercache_l2_connection_errors_total", |s| {
        s.l2.connection_errors
    }),
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
    ("tiercache_fleet_failing_marks_total", |s| {
        s.l2.failing_marks
    }),
    ("tiercache_fleet_locks_lost_total", |s| s.l2.locks_lost),
];

impl EngineMetrics {
    pub(crate) fn new(sink: Sink) -> Self {
        Self {
            sink,
            publishing: Default::default(),
            described: Default::default(),
        }
    }

    /// Keeps the engine's metrics current without `publish_metrics()`: a
    /// task publishes them every [`PUBLISH_EVERY`] while any layer or
    /// service built from these metrics lives. Started once, from inside a
    /// Tokio runtime (at `layer()`, or else at the first request).
    pub(crate) fn keep_current(self: &Arc<Self>, engine: &TieredCache) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.publishing.load(Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.publishing.swap(true, Relaxed) {
            return;
        }
        let metrics = Arc::downgrade(self);
        let engine = engine.clone();
        runtime.spawn(async move {
            let mut every = tokio::time::interval(PUBLISH_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(metrics) = metrics.upgrade() else {
                    return;
                };
                metrics.publish_from(&engine);
            }
        });
    }

    /// Publishes the engine's current counters and gauges.
    pub(crate) fn publish_from(&self, engine: &TieredCache) {
        self.publish(
            &engine.stats(),
            engine.l1_weighted_size(),
            engine.l1_entry_count(),
        );
    }

    pub(crate) fn publish(&self, stats: &Stats, l1_bytes: u64, l1_entries: u64) {
        self.sink.describe(&self.described);
        for (name, read) in TOTALS {
            self.sink.counter(name, Vec::new()).absolute(read(stats));
        }
        let open = if stats.l2.breaker_open { 1.0 } else { 0.0 };
        self.sink.gauge("tiercache_l2_breaker_open").set(open);
        let deaf = if stats.l2.deaf { 1.0 } else { 0.0 };
        self.sink.gauge("tiercache_l2_deaf").set(deaf);
        self.sink.gauge("tiercache_l1_bytes").set(l1_bytes as f64);
        self.sink
            .gauge("tiercache_l1_entries")
            .set(l1_entries as f64);
        self.sink.gauge("tiercache_hit_ratio").set(stats.hit_ratio);
        let body = (body::mappings(), body::heap_fallbacks());
        self.sink
            .gauge("tiercache_body_mappings")
            .set(body.0 as f64);
        self.sink
            .counter("tiercache_body_heap_fallbacks_total", Vec::new())
            .absolute(body.1);
    }
}

#[cfg(test)]
mod tests;
