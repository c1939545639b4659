//! Fills that run on after their caller stopped waiting, and their cap
//! (`max_detached_fills`).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::TieredCache;
use crate::flight::FlightWatch;
use crate::stats::{Counters, bump};

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
    pub(super) fn spawn(
        engine: &TieredCache,
        flight: FlightWatch,
        fill: impl Future<Output = T> + Send + 'static,
    ) -> Self {
        let slot = Arc::new(Mutex::new(None));
        let held = slot.clone();
        let handle = tokio::spawn(async move {
            let filled = fill.await;
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
        // their wait.
        let left = self.flight.time_left();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                tokio::time::sleep(left).await;
                cancel();
            })),
            // Dropped outside a runtime (one shutting down): nothing runs on.
            Err(_) => cancel(),
        }
    }
}
