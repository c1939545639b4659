//! What each metric counts, as a scrape's `# HELP` says it.

/// A metric's kind, for its description.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// What each metric counts, as a scrape's `# HELP` says it.
pub(super) const HELP: &[(&str, Kind, &str)] = &[
    (
        "tiercache_requests_total",
        Kind::Counter,
        "Requests a cached route answered, by outcome (hit, miss, stale, bypass) and tier (l1, l2, origin; none: an only-if-cached request nothing stored answered, a 504).",
    ),
    (
        "tiercache_bypass_total",
        Kind::Counter,
        "Requests that went to the origin past the cache, by reason (cookie, authorization, method, hit-for-miss: a key marked uncacheable, …).",
    ),
    (
        "tiercache_not_stored_total",
        Kind::Counter,
        "Origin answers not stored, by reason (those of hit-for-miss bypasses included).",
    ),
    (
        "tiercache_origin_duration_seconds",
        Kind::Histogram,
        "Each origin load the cache made (misses, refreshes, hit-for-miss; not other bypasses): XFetch's rebuild time.",
    ),
    (
        "tiercache_lock_wait_seconds",
        Kind::Histogram,
        "Each request's whole wait on other requests' loads, one sample a waiting request.",
    ),
    (
        "tiercache_route_lock_timeouts_total",
        Kind::Counter,
        "Requests whose wait on another request's load reached the flight's deadline, once each.",
    ),
    (
        "tiercache_route_early_refreshes_total",
        Kind::Counter,
        "XFetch refreshes started before expiry.",
    ),
    (
        "tiercache_origin_loads_total",
        Kind::Counter,
        "Origin loads the engine made (misses, refreshes, hit-for-miss; not other bypasses).",
    ),
    (
        "tiercache_coalesced_total",
        Kind::Counter,
        "Requests that waited on another request's load (on this instance or, through the fleet lock, another), once each, whether they got its answer or loaded their own past the deadline.",
    ),
    (
        "tiercache_lock_timeouts_total",
        Kind::Counter,
        "Requests (and background refreshes) whose wait on another's load reached its deadline, once each.",
    ),
    (
        "tiercache_early_refreshes_total",
        Kind::Counter,
        "Refreshes started before expiry (XFetch).",
    ),
    (
        "tiercache_refreshes_deferred_total",
        Kind::Counter,
        "Refreshes not started because max_refreshes were running.",
    ),
    (
        "tiercache_fills_cancelled_total",
        Kind::Counter,
        "Fills cancelled after their caller left, no max_detached_fills slot free and nobody waiting on them.",
    ),
    (
        "tiercache_stale_served_total",
        Kind::Counter,
        "Stale entries served (stale-while-revalidate, stale-if-error, the soft timeout).",
    ),
    (
        "tiercache_l2_errors_total",
        Kind::Counter,
        "L2 operations that failed.",
    ),
    (
        "tiercache_l2_timeouts_total",
        Kind::Counter,
        "L2 operations that timed out (counted in tiercache_l2_errors_total too).",
    ),
    (
        "tiercache_l2_write_drops_total",
        Kind::Counter,
        "L2 writes dropped because the write queue was full.",
    ),
    (
        "tiercache_l2_corrupt_total",
        Kind::Counter,
        "L2 values read that could not be decoded (corrupt or foreign bytes), each read.",
    ),
    (
        "tiercache_l2_breaker_trips_total",
        Kind::Counter,
        "Times the L2 circuit breaker opened.",
    ),
    (
        "tiercache_l2_reconnects_forced_total",
        Kind::Counter,
        "L2 clients replaced after their connections stopped answering.",
    ),
    (
        "tiercache_l2_connection_errors_total",
        Kind::Counter,
        "L2 connection failures (refused, TLS, authentication, lost).",
    ),
    (
        "tiercache_l2_breaker_open",
        Kind::Gauge,
        "1 while the L2 circuit breaker is open.",
    ),
    (
        "tiercache_l2_deaf",
        Kind::Gauge,
        "1 while this instance cannot hear the fleet's invalidations (its subscription lost): while L2 answers, its L1 hits read L2.",
    ),
    (
        "tiercache_expired_total",
        Kind::Counter,
        "L1 entries removed past their expiry (by the sweep or a read).",
    ),
    (
        "tiercache_evicted_total",
        Kind::Counter,
        "L1 entries evicted to stay within the budget.",
    ),
    (
        "tiercache_sweeps_total",
        Kind::Counter,
        "Sweeps of expired L1 entries.",
    ),
    (
        "tiercache_invalidations_received_total",
        Kind::Counter,
        "Invalidations received from other instances.",
    ),
    (
        "tiercache_resyncs_total",
        Kind::Counter,
        "Times the invalidation stream was lost and L1 dropped as a precaution.",
    ),
    (
        "tiercache_fleet_locks_acquired_total",
        Kind::Counter,
        "Fleet-wide fill locks this instance took.",
    ),
    (
        "tiercache_fleet_lock_waits_total",
        Kind::Counter,
        "Waits on a fill lock another instance held.",
    ),
    (
        "tiercache_fleet_failing_marks_total",
        Kind::Counter,
        "Loads and refreshes that did not call the origin because another instance's load met it failing a moment ago (a stale copy answered).",
    ),
    (
        "tiercache_fleet_locks_lost_total",
        Kind::Counter,
        "Moves of a held fill lock that did not land (the lock ended under its load, or Valkey lost it): those loads' answers were written to Valkey only over nothing newer.",
    ),
    (
        "tiercache_l1_bytes",
        Kind::Gauge,
        "Bytes L1 holds, weighed against its budget.",
    ),
    ("tiercache_l1_entries", Kind::Gauge, "Entries L1 holds."),
    (
        "tiercache_hit_ratio",
        Kind::Gauge,
        "(hits + stale) / (hits + stale + misses) since the engine started; only-if-cached 504s and bypasses left out.",
    ),
    (
        "tiercache_body_mappings",
        Kind::Gauge,
        "Page mappings of large bodies and L2 envelopes, spares included.",
    ),
    (
        "tiercache_body_heap_fallbacks_total",
        Kind::Counter,
        "Large bodies (and L2 envelopes) stored on the heap: past the mappings' cap, or refused one by the system.",
    ),
];
