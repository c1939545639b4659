//! Fills that run on after their caller stopped waiting, and their cap
//! (`max_detached_fills`).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::TieredCache;
use crate::flight::FlightWatch;
use crate::stats::{Counters, bump};

/// Runs `work` in a task of its own and waits for its output: a caller that
/// goes away (a client that disconnected, a timeout around the call) leaves
/// it to finish, never half done. A panic in it is the caller's;
/// `if_shut_down` answers when the runtime ends first. Outside a runtime it
/// runs in place.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let sent = tiercache_core::outliving_the_caller(async { "sent" }, "cut").await;
/// assert_eq!(sent, "sent");
/// # }
/// ```
pub async fn outliving_the_caller<F>(work: F, if_shut_down: F::Output) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => match runtime.spawn(work).await {
            Ok(output) => output,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => if_shut_down,
        },
        Err(_) => work.await,
    }
}

/// How long past a flight's deadline a detached fill others waited on
/// runs before it is cancelled.
const DECIDED_AFTER: std::time::Duration = std::time::Duration::from_millis(10);

/// A fill's task, as its caller holds it. Dropped before the task ends
/// (the caller went away, or took a stale answer at the soft timeout), it
/// lets the fill run on while a `max_detached_fills` slot is free, held
/// until the fill ends. With no slot free, a fill others wait on runs on
/// until they stop waiting (the flight's deadline); one nobody waits on is
/// cancelled at once.
pub(super) struct FillTask<T> {
    pub(super) handle: tokio::task::JoinHandle<T>,
    /// The slot the fill holds once detached: shared with the task, which
    /// drops its handle when it ends, so the slot is freed then.
    slot: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
    flight: FlightWatch,
    slots: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl<T: Send + 'static> FillTask<T> {
    /// Spawns the future `fill` makes. Made in the task: made by an async
    /// caller, it took room in the caller's future too (rustc keeps a
    /// temporary's place), and passed in made, twice its size in the
    /// task's (the value moved in, and the one awaited): ~10 KiB more a
    /// load in flight each.
    pub(super) fn spawn<F: Future<Output = T> + Send + 'static>(
        engine: &TieredCache,
        flight: FlightWatch,
        fill: impl FnOnce() -> F + Send + 'static,
    ) -> Self {
        let slot = Arc::new(Mutex::new(None));
        let held = slot.clone();
        let handle = tokio::spawn(async move {
            let filled = fill().await;
            drop(held);
            filled
        });
        Self {
            handle,
            slot,
            flight,
            slots: engine.inner.detached.clone(),
            counters: engine.inner.counters.clone(),
        }
    }
}

impl<T> Drop for FillTask<T> {
    fn drop(&mut self) {
        if self.handle.is_finished() {
            return;
        }
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            // Freed when the task drops its handle on the slot (or now,
            // if it ended meanwhile: this handle is then the last).
            *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(permit);
            return;
        }
        let (task, counters) = (self.handle.abort_handle(), self.counters.clone());
        let cancel = move || {
            if !task.is_finished() {
                task.abort();
                bump(&counters.fills_cancelled);
            }
        };
        if !self.flight.waited_on() {
            return cancel();
        }
        // Cancelled now, its followers would load again, one of them
        // leading from the start: it answers them, unless it outlives
        // their wait (which its progress moves on).
        let flight = self.flight.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                loop {
                    let deadline = flight.deadline();
                    // A moment past it: the waiters decide first whether
                    // the deadline moved on (progress made at its edge).
                    tokio::time::sleep_until(deadline + DECIDED_AFTER).await;
                    if flight.deadline() <= deadline || !flight.waited_on() {
                        break;
                    }
                }
                cancel();
            })),
            // Dropped outside a runtime (one shutting down): nothing runs on.
            Err(_) => cancel(),
        }
    }
}
