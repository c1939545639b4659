//! Giving memory back to the system once a burst is over.
//!
//! mimalloc (the proxy's allocator) gives freed memory back lazily: a page
//! of a thread's heap whose blocks were freed goes back once that thread
//! collects its heap, which it does in the course of its own later
//! allocations (every 10,000 that take its slow path), and the system gets
//! the page once a purge runs, a second later, when some page is freed.
//! An idle worker allocates nothing: a proxy that went quiet after 9,000
//! requests in flight kept 174 MiB with 4 KB in L1 for as long as it
//! stayed quiet; traffic afterwards brought it back to ~12 MiB.
//!
//! The workspace forbids `unsafe`, so the proxy cannot call `mi_collect`.
//! Instead, when the process has grown past what it needs and its workers
//! are quiet ([`Quiet`]), [`watch`] asks each worker thread, as it parks,
//! to make the allocations that lead mimalloc to collect its heap: 20,000
//! blocks of 2 KiB, each freed at once (anything over 1 KiB takes the slow
//! path). About a millisecond a worker, on a thread with nothing else to
//! do. A 1 MiB block a second besides (a page of its own, freed) lets the
//! purges that came due run on an idle process. And [`purge_promptly`]
//! has the binary start again with mimalloc's purge delay at zero, so a
//! freed page goes back at once, not a second late.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// mimalloc's option for how long a freed page stays resident before it
/// goes back to the system (1,000 ms by default), read from the
/// environment once, as the process starts.
pub const PURGE_DELAY: &str = "MIMALLOC_PURGE_DELAY";

/// The older name mimalloc also reads for [`PURGE_DELAY`].
const RESET_DELAY: &str = "MIMALLOC_RESET_DELAY";

/// Starts this binary again in place (`exec`: same process, arguments and
/// open files) with [`PURGE_DELAY`] at 0, unless the environment names a
/// delay already (as mimalloc reads it: either name, in any case; so a
/// deployment's own value, even mimalloc's default, is kept), or the
/// binary was started through the dynamic loader (`ld-linux… ./proxy`,
/// whose arguments a new start would not keep). Returns only when it did
/// not: `None` when it was not to, or why the new start failed. After a
/// failed start `SIGPIPE` is back at its default (std's `exec` resets it
/// for the new program), so the caller must ignore it again: see
/// [`ignore_sigpipe`].
///
/// Why: under churn, freed pages waiting out the delay held 3–4 MiB (a
/// cold flood of 64 KiB bodies grew a 32 MiB proxy 1.15×, 1.13× without
/// the delay; with Valkey on 1.31×, 1.15–1.18×), at no throughput cost
/// past this machine's noise (1 KiB fills level, 64 KiB 2–3 % fewer in
/// two runs). mimalloc reads its options before `main`, and the workspace
/// forbids the `unsafe` `mi_option_set`, so only a new start can set it.
#[cfg(unix)]
pub fn purge_promptly() -> Option<std::io::Error> {
    use std::os::unix::process::CommandExt;
    let named = |name: &std::ffi::OsStr| {
        name.to_str().is_some_and(|name| {
            name.eq_ignore_ascii_case(PURGE_DELAY) || name.eq_ignore_ascii_case(RESET_DELAY)
        })
    };
    if std::env::vars_os().any(|(name, _)| named(&name)) {
        return None;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(e),
    };
    let loader = exe
        .file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with("ld-"));
    if loader {
        return None;
    }
    let mut args = std::env::args_os();
    let mut command = std::process::Command::new(exe);
    if let Some(name) = args.next() {
        command.arg0(name);
    }
    Some(command.args(args).env(PURGE_DELAY, "0").exec())
}

/// Ignores `SIGPIPE` again for the rest of the process (a write to a
/// closed socket or pipe then fails with `EPIPE` rather than killing it),
/// as Rust's start does before `main`: for after a failed
/// [`purge_promptly`]. Needs a Tokio runtime.
#[cfg(unix)]
pub fn ignore_sigpipe() -> std::io::Result<()> {
    // Tokio's handler stays installed for the process's life once made.
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::pipe()).map(drop)
}

/// Bumped each time [`watch`] asks for a collection: a worker that has not
/// collected since, collects as it parks, while [`WANTED`].
static EPOCH: AtomicU64 = AtomicU64::new(0);
/// Set while [`watch`] waits for the workers to collect: a worker that
/// parks only once traffic is back does not collect then.
static WANTED: AtomicBool = AtomicBool::new(false);
/// Workers that collected in this epoch.
static DONE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COLLECTED: Cell<u64> = const { Cell::new(0) };
}

/// How often [`watch`] looks at the runtime.
const TICK: Duration = Duration::from_secs(1);

/// mimalloc collects a thread's heap every 10,000 allocations on its slow
/// path (`MIMALLOC_GENERIC_COLLECT`), and frees the empty pages it keeps
/// for reuse after 16 looks, one every 1,000: this many guarantee both.
const SLOW_ALLOCATIONS: usize = 20_000;

/// Over mimalloc's fast path (1 KiB and less), reused at once.
const SLOW_BLOCK: usize = 2 << 10;

/// Over mimalloc's largest size class (512 KiB): a page of its own, whose
/// freeing runs the purges that are due.
const PAGE_BLOCK: usize = 1 << 20;

/// Ticks [`watch`] keeps asking (and waking workers) for one collection.
const ASKING: u32 = 3;

/// The runtime's `on_thread_park` hook: a worker parking while [`watch`]
/// asks for a collection, and not collected since it asked, collects its
/// heap.
pub fn on_thread_park() {
    if !WANTED.load(Relaxed) {
        return;
    }
    let epoch = EPOCH.load(Relaxed);
    if COLLECTED.with(|seen| seen.replace(epoch)) != epoch {
        allocate_and_free(SLOW_ALLOCATIONS, SLOW_BLOCK);
        DONE.fetch_add(1, Relaxed);
    }
}

/// Watches the current runtime's workers and the process's resident set,
/// and asks the workers to collect (see [`on_thread_park`]) when the
/// process has grown and they are quiet. Runs until the runtime stops;
/// returns at once but on Linux (it reads `/proc/self/status`).
pub async fn watch() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let runtime = tokio::runtime::Handle::current().metrics();
    let busy = || {
        (0..runtime.num_workers())
            .map(|w| runtime.worker_total_busy_duration(w))
            .sum::<Duration>()
    };
    // Parked workers sleep until there is work, and tokio wakes one at a
    // time, the last to park (one that has collected, it may be): a task
    // for each worker, each holding its worker until all have started
    // (2 ms at most), so the rest are stolen, waking the others in turn.
    let wake = || {
        let workers = runtime.num_workers();
        let started = Arc::new(AtomicUsize::new(0));
        for _ in 0..workers {
            let started = started.clone();
            tokio::spawn(async move {
                started.fetch_add(1, Relaxed);
                let until = Instant::now() + Duration::from_millis(2);
                while started.load(Relaxed) < workers && Instant::now() < until {
                    std::hint::spin_loop();
                }
            });
        }
    };
    let mut quiet = Quiet::default();
    let mut last = busy();
    let mut asking = 0;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = busy();
        let worked = now.saturating_sub(last);
        if asking > 0 {
            asking -= 1;
            // Traffic back: a worker not collected yet does not now.
            let done = DONE.load(Relaxed) >= runtime.num_workers();
            if asking == 0 || done || worked >= Quiet::QUIET {
                asking = 0;
                WANTED.store(false, Relaxed);
            } else {
                wake();
            }
        }
        // A failed read (out of open files, say) skips a tick.
        if let Some(resident) = resident_bytes()
            && quiet.after(worked, resident)
        {
            DONE.store(0, Relaxed);
            EPOCH.fetch_add(1, Relaxed);
            WANTED.store(true, Relaxed);
            asking = ASKING;
            wake();
        }
        last = now;
        allocate_and_free(1, PAGE_BLOCK);
    }
}

/// The process's resident set (`VmRSS`), on Linux.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kib = kib.trim().trim_end_matches("kB").trim();
    Some(kib.parse::<u64>().ok()? * 1024)
}

fn allocate_and_free(times: usize, bytes: usize) {
    for _ in 0..times {
        // `black_box`: the compiler may otherwise drop an allocation
        // nothing reads.
        drop(std::hint::black_box(Vec::<u8>::with_capacity(bytes)));
    }
}

/// Tells, one tick (a second) at a time, when a collection is worth it:
/// the process is 4 MiB past the least it has needed, it has moved 4 MiB
/// since it last gave up (below), and the workers have been quiet for two
/// ticks (busy, their own allocations collect, and a collection would
/// hold up requests). Three collections are tried, 3 and 5 ticks apart,
/// unless the process moves 4 MiB up meanwhile (a new burst: they start
/// over); after the third, what stays is taken as live (the memory was,
/// or was freed only after them) until the process moves 4 MiB again, up
/// or down (connections closed, say).
#[derive(Debug, Default)]
pub struct Quiet {
    /// The least resident set seen.
    low: Option<u64>,
    /// The resident set when the process last moved, or last collected.
    at: Option<u64>,
    /// Whether the process has moved 4 MiB since it last gave up.
    armed: bool,
    /// Quiet ticks in a row.
    quiet: u32,
    /// Ticks before the next try.
    wait: u32,
    /// Collections since the process last moved.
    tries: u32,
}

impl Quiet {
    /// Under this much busy time a tick (all workers), they are quiet.
    const QUIET: Duration = Duration::from_millis(50);
    /// What the process must have grown, or moved.
    const MOVED: u64 = 4 << 20;
    /// Collections tried before what stays is taken as live.
    const TRIES: u32 = 3;

    /// Takes one tick's busy time (all workers) and the resident set at
    /// its end; true when the workers should collect now.
    pub fn after(&mut self, busy: Duration, resident: u64) -> bool {
        self.quiet = if busy < Self::QUIET {
            self.quiet + 1
        } else {
            0
        };
        let low = self.low.map_or(resident, |low| low.min(resident));
        self.low = Some(low);
        let at = *self.at.get_or_insert(resident);
        if resident.abs_diff(at) >= Self::MOVED {
            (self.at, self.armed, self.tries) = (Some(resident), true, 0);
            if resident > at {
                // A new burst. (Down is a collection's own doing, maybe:
                // the next try keeps its time.)
                self.wait = 0;
            }
        }
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        if !self.armed || self.quiet < 2 || resident < low + Self::MOVED {
            return false;
        }
        if self.tries == Self::TRIES {
            self.armed = false;
            return false;
        }
        self.at = Some(resident);
        self.tries += 1;
        self.wait = 1 << self.tries;
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
        assert!(!quiet.after(900 * MS, 180 * MIB), "busy: they collect");
        assert!(!quiet.after(10 * MS, 180 * MIB), "quiet for one tick");
        assert!(quiet.after(10 * MS, 180 * MIB), "for two, and grown");
        assert!(
            collecting(&mut quiet, 20, 12 * MIB).is_empty(),
            "given back"
        );
        assert!(!quiet.after(MS, 13 * MIB), "grown less than 4 MiB");
        assert!(quiet.after(MS, 15 * MIB));
    }

    #[test]
    fn what_three_collections_leave_is_taken_as_live_until_the_process_moves() {
        let mut quiet = Quiet::default();
        assert!(!quiet.after(MS, 10 * MIB));
        assert_eq!(collecting(&mut quiet, 300, 40 * MIB), [0, 3, 8]);
        // A new burst...
        assert!(!quiet.after(900 * MS, 60 * MIB));
        assert_eq!(collecting(&mut quiet, 6, 60 * MIB), [1, 4]);
        // ...or connections closed, which freed memory not all given back
        // (after the wait the last try left).
        assert_eq!(collecting(&mut quiet, 6, 30 * MIB), [3]);
    }

    #[test]
    fn a_worker_collects_once_an_epoch_while_asked() {
        let done = DONE.load(Relaxed);
        EPOCH.fetch_add(1, Relaxed);
        WANTED.store(true, Relaxed);
        on_thread_park();
        assert_eq!(DONE.load(Relaxed), done + 1);
        on_thread_park();
        assert_eq!(DONE.load(Relaxed), done + 1, "once an epoch");
        EPOCH.fetch_add(1, Relaxed);
        WANTED.store(false, Relaxed);
        on_thread_park();
        assert_eq!(DONE.load(Relaxed), done + 1, "not once no longer asked");
    }
}
