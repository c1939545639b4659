//! The tier's own counters, as the engine merges them into its stats
//! ([`Tier::report`](tiercache_core::Tier::report)).

use std::sync::atomic::Ordering::Relaxed;

use tiercache_core::TierReport;

use crate::tier::Inner;

impl Inner {
    /// What the tier counted, and the state of its queue, breaker and
    /// message stream, now.
    pub(crate) fn report(&self) -> TierReport {
        let i = self;
        let mut report = TierReport::default();
        report.write_queue = (i.writes.max_capacity() - i.writes.capacity()) as u64;
        report.write_queue_bytes = i.queued_bytes.load(Relaxed) as u64;
        report.write_drops = i.write_drops.load(Relaxed);
        report.write_errors = i.write_errors.load(Relaxed);
        report.corrupt = i.corrupt.load(Relaxed);
        report.skipped = i.skipped.load(Relaxed);
        report.breaker_trips = i.breaker.trips.load(Relaxed);
        report.breaker_open = i.breaker.is_open();
        report.deaf = i.bus.is_deaf();
        report.invalidations_received = i.bus.received.load(Relaxed);
        report.resyncs = i.bus.resyncs.load(Relaxed);
        report.locks_acquired = i.bus.locks_acquired.load(Relaxed);
        report.failing_marks = i.bus.failing_marks.load(Relaxed);
        report.locks_lost = i.bus.locks_lost.load(Relaxed);
        report.release_retries = i.release_retries.load(Relaxed);
        report.fills_overtaken = i.fills_overtaken.load(Relaxed);
        report.reconnects_forced = i.reconnects_forced.load(Relaxed);
        report.connection_errors = i.failures.count.load(Relaxed);
        report
    }
}
