//! Giving memory back to the system once a burst is over.
//!
//! mimalloc (the proxy's allocator) returns freed memory lazily: a page
//! freed from another thread, or left empty, goes back to the system only
//! when the thread that owns it collects its heap, which it does on its own
//! later allocations (every 10,000 calls of its slow path), and the
//! system gets the pages once a purge runs after that. A proxy that went
//! quiet after 9,000 requests in flight kept ~175 MiB a minute later with
//! 4 KB in L1; traffic afterwards brought it back to ~12 MiB.
//!
//! The workspace forbids `unsafe`, so the proxy cannot call `mi_collect`.
//! Instead, when the process has grown past the least it needed and its
//! workers are quiet ([`Quiet`]), each worker thread, as it parks, makes the
//! allocations that lead mimalloc to collect its heap: blocks of 1 MiB,
//! each freed at once (mimalloc serves that size on its slow path only).
//! That takes ~12 ms a worker, once a burst, on a thread with nothing else
//! to do. A block a second besides lets purges that came due on an idle
//! process run.
//!
//! ```no_run
//! let runtime = tokio::runtime::Builder::new_multi_thread()
//!     .enable_all()
//!     .on_thread_park(tiercache_proxy::give_back::on_thread_park)
//!     .build()?;
//! runtime.block_on(async {
//!     tokio::spawn(tiercache_proxy::give_back::watch());
//!     // ... serve
//! });
//! # Ok::<(), std::io::Error>(())
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Bumped each time [`watch`] asks for a collection: a worker that has not
/// collected since, collects as it parks.
static EPOCH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COLLECTED: Cell<u64> = const { Cell::new(0) };
}

/// How often [`watch`] looks at the runtime.
const TICK: Duration = Duration::from_secs(1);

/// mimalloc collects a thread's heap every 10,000 calls of its slow path
/// (`MIMALLOC_GENERIC_COLLECT`), and frees the pages it keeps for reuse
/// (retired) after 16 looks every 1,000 calls: this many guarantee both.
const SLOW_ALLOCATIONS: usize = 20_000;

/// Above mimalloc's largest size class (512 KiB), so always its slow path.
const BLOCK: usize = 1 << 20;

/// The runtime's `on_thread_park` hook: a worker parking for the first
/// time since [`watch`] asked for a collection collects its heap.
pub fn on_thread_park() {
    let epoch = EPOCH.load(Relaxed);
    if COLLECTED.with(|seen| seen.replace(epoch)) != epoch {
        allocate_and_free(SLOW_ALLOCATIONS);
    }
}

/// Watches the current runtime's workers and the process's resident set,
/// and lets [`on_thread_park`] collect when the process has grown and the
/// workers are quiet. Runs until the runtime stops.
pub async fn watch() {
    let runtime = tokio::runtime::Handle::current().metrics();
    let busy = || {
        (0..runtime.num_workers())
            .map(|w| runtime.worker_total_busy_duration(w))
            .sum::<Duration>()
    };
    let mut quiet = Quiet::default();
    let mut last = busy();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = busy();
        let Some(resident) = resident_bytes() else {
            return; // not Linux: nothing to go by
        };
        if quiet.after(now.saturating_sub(last), resident) {
            EPOCH.fetch_add(1, Relaxed);
            // Parked workers sleep until there is work: a task each wakes
            // them, and each parks again, collecting.
            for _ in 0..runtime.num_workers() {
                tokio::spawn(async {});
            }
        }
        last = now;
        // A purge comes due a few milliseconds after pages are freed and
        // runs on the next page freed: on an idle process, this one.
        allocate_and_free(1);
    }
}

/// The process's resident set (`VmRSS`), on Linux.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    Some(
        kib.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?
            * 1024,
    )
}

fn allocate_and_free(times: usize) {
    for _ in 0..times {
        // `black_box`: the compiler may otherwise drop an allocation
        // nothing reads.
        drop(std::hint::black_box(Vec::<u8>::with_capacity(BLOCK)));
    }
}

/// Tells, one tick (a second) at a time, when collecting is worth it: the
/// process is 4 MiB past the least it has needed, and the workers are
/// quiet (busy, their own allocations collect, and a collection would hold
/// up requests). A collection that left the process where it was (what
/// stays is live: L1's entries, say; or it came before the last frees) is
/// tried again after 1, 2, 4, ... up to 64 ticks; moving 4 MiB up or down
/// since starts that over (a new burst, or connections closed).
#[derive(Debug, Default)]
pub struct Quiet {
    /// The least resident set seen.
    low: Option<u64>,
    /// The resident set at the last collection (or the first tick).
    at: Option<u64>,
    /// Ticks to wait before the next collection may come.
    wait: u32,
    /// The wait after the next collection.
    gap: u32,
}

impl Quiet {
    /// Under this much busy time a tick (all workers), they are quiet.
    const QUIET: Duration = Duration::from_millis(50);
    /// Grown this much, the process collects.
    const GROWN: u64 = 4 << 20;
    /// The longest wait between collections, in ticks.
    const MAX_GAP: u32 = 64;

    /// Takes one tick's busy time (all workers) and the resident set at
    /// its end; true when the workers should collect now.
    pub fn after(&mut self, busy: Duration, resident: u64) -> bool {
        let low = self.low.map_or(resident, |low| low.min(resident));
        let at = *self.at.get_or_insert(resident);
        self.low = Some(low);
        if resident.abs_diff(at) >= Self::GROWN {
            // A new burst, collected when it ends; or memory freed, some
            // of it maybe not given back yet.
            (self.wait, self.gap) = (0, 1);
        }
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        if busy >= Self::QUIET || resident < low + Self::GROWN {
            return false;
        }
        self.at = Some(resident);
        self.wait = self.gap.max(1);
        self.gap = (self.wait * 2).min(Self::MAX_GAP);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    const MIB: u64 = 1 << 20;

    /// Which of `ticks` ticks collect, all quiet at `resident`.
    fn collecting(quiet: &mut Quiet, ticks: usize, resident: u64) -> Vec<usize> {
        (0..ticks).filter(|_| quiet.after(MS, resident)).collect()
    }

    #[test]
    fn a_process_grown_collects_once_its_workers_are_quiet() {
        let mut quiet = Quiet::default();
        assert!(!quiet.after(MS, 10 * MIB), "the start");
        assert!(
            !quiet.after(900 * MS, 180 * MIB),
            "busy: they collect themselves"
        );
        assert!(quiet.after(10 * MS, 180 * MIB), "quiet, and grown");
        assert!(
            collecting(&mut quiet, 20, 12 * MIB).is_empty(),
            "given back"
        );
        assert!(!quiet.after(MS, 13 * MIB), "grown less than 4 MiB");
        assert!(quiet.after(MS, 15 * MIB));
    }

    #[test]
    fn a_collection_that_gave_nothing_back_is_tried_again_ever_less_often() {
        let mut quiet = Quiet::default();
        assert!(!quiet.after(MS, 10 * MIB));
        let ticks = collecting(&mut quiet, 300, 40 * MIB);
        assert_eq!(ticks, [0, 2, 5, 10, 19, 36, 69, 134, 199, 264]);
        // Growing again starts over...
        assert!(!quiet.after(900 * MS, 60 * MIB));
        assert_eq!(collecting(&mut quiet, 6, 60 * MIB), [0, 2, 5]);
        // ...and so does shrinking (connections closed, say).
        assert_eq!(collecting(&mut quiet, 6, 30 * MIB), [0, 2, 5]);
    }

    #[test]
    fn a_worker_collects_once_an_epoch() {
        let before = COLLECTED.with(Cell::get);
        EPOCH.fetch_add(1, Relaxed);
        on_thread_park();
        let epoch = EPOCH.load(Relaxed);
        assert_eq!(COLLECTED.with(Cell::get), epoch);
        assert_ne!(before, epoch);
    }
}
