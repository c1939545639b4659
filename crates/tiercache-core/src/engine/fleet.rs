//! The fleet-wide fill lock: before an origin load, one instance per key.

use std::time::Duration;

use tokio::time::Instant;

use super::TieredCache;
use crate::fleet::{FleetJoin, FleetLock};
use crate::stats::bump;
use crate::{CacheKey, Entry, LockAttempt, Policy, Progress, Unlocked};

impl TieredCache {
    /// Before an origin load for `key` (its L2 read missed): takes the
    /// fleet-wide fill lock, or waits for the instance holding it and
    /// returns what it stored. Without a shared tier that has locks, or when
    /// it fails, the lock is [`FleetLock::local`] and the local single flight
    /// alone protects the origin. A wait lasts at most `wait` (what is left
    /// of the flight's deadline), or the lock's own remaining time if
    /// shorter: a lock whose owner died expires, and this instance takes
    /// over. A holder that lets go without a fill (or whose lock ends)
    /// hands the lock to one waiter, and the others wait on that one. A new
    /// holder, and a holder whose lock its load's progress moves on, are
    /// followed as the local flight's own load is: each is progress of this
    /// request's flight (`progress`), whose deadline the wait then takes.
    /// Past it a new holder is waited on once more (for the policy's wait at
    /// most), and the same holder's lock about to end (within a quarter of
    /// the wait) to its end; the same holder still there is stuck, and the
    /// request loads without the lock (counted as a lock timeout).
    /// `(counted, timed_out)`: the request's wait, and its lock timeout,
    /// were counted already (a request is counted once). `fallback`: the
    /// load has a stale copy to answer with, so it takes no lock while
    /// another instance's load met the origin failing a moment ago
    /// ([`Tier::try_lock_unless_failing`](crate::Tier::try_lock_unless_failing)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn lead_fleet(
        &self,
        key: &CacheKey,
        policy: &Policy,
        wait: Duration,
        progress: &Progress,
        epoch: u64,
        accept: impl Fn(&Entry) -> bool,
        (counted, timed_out): (bool, bool),
        fallback: bool,
    ) -> FleetWait {
        let Some(l2) = self.inner.l2.clone() else {
            return FleetLock::local().into();
        };
        // The lock lives the policy's wait from its take, or from its
        // load's last progress: the flight's own deadline abandons a
        // stalled leader by then.
        let hold = policy.lock_wait();
        let began = Instant::now();
        let (held_for, holder) = match try_lock(&l2, key, hold, fallback).await {
            Ok(LockAttempt::Acquired(token)) => {
                let lock = FleetLock::held(l2.clone(), (key.clone(), token), hold, began);
                return self.took_lock(key, lock, epoch, &accept).await.into();
            }
            Ok(LockAttempt::Held { left, holder }) => (left, holder),
            Ok(LockAttempt::Failing { left }) => return FleetJoin::Failing(failing(left)).into(),
            Ok(_) => return FleetLock::local().into(),
            Err(_) => {
                bump(&self.inner.counters.l2_errors);
                return FleetLock::local().into();
            }
        };
        if !counted {
            bump(&self.inner.counters.coalesced);
        }
        let held = HeldLock {
            l2: &l2,
            hold,
            deadline: began + wait,
            held_for,
            holder,
            fallback,
        };
        let (join, gave_up) = self.wait_fleet(key, held, progress, epoch, &accept).await;
        if gave_up && !timed_out {
            bump(&self.inner.counters.lock_timeouts);
        }
        FleetWait {
            join,
            waited: Some(began.elapsed()),
            timed_out: gave_up,
        }
    }

    /// Waits on the fleet lock's holders in turn (see
    /// [`lead_fleet`](Self::lead_fleet)); `true` with a lock timeout.
    async fn wait_fleet(
        &self,
        key: &CacheKey,
        held: HeldLock<'_>,
        progress: &Progress,
        epoch: u64,
        accept: &impl Fn(&Entry) -> bool,
    ) -> (FleetJoin, bool) {
        let HeldLock {
            l2,
            hold,
            mut deadline,
            mut held_for,
            mut holder,
            fallback,
        } = held;
        let (mut extended, mut to_its_end) = (false, false);
        // Where the holder's lock ends, as last seen: a later end is its
        // load's progress.
        let mut ends = Instant::now() + held_for;
        // The holder whose wait was counted last: looking at the same lock
        // again is the same wait.
        let mut counted: Option<Option<crate::LockToken>> = None;
        // Waits on each holder in turn: one that lets go without a fill
        // (its load had no room to keep its answer, or its lock is gone)
        // hands the lock to one of its waiters, and the others wait on that
        // one, until the deadline.
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // A little past the lock's own end, so an expired lock is seen
            // gone; a quarter of a hold at most, so a lock moved on is seen
            // moving before this instance's own waiters stop waiting.
            let bound = left.min(held_for + Duration::from_millis(20)).min(hold / 4);
            if counted.as_ref() != Some(&holder) {
                bump(&self.inner.counters.fleet_waits);
                counted = Some(holder.clone());
            }
            let unlocked = match l2.wait_unlock(key, holder.as_ref(), bound).await {
                Ok(unlocked) => unlocked,
                Err(_) => {
                    // Valkey stopped answering the wait: what follows reads
                    // L2 and tries the lock once more, and may fail open.
                    bump(&self.inner.counters.l2_errors);
                    Unlocked::Gone
                }
            };
            match unlocked {
                // The owner's answer may not be shared; load without a lock.
                Unlocked::Passed => return (FleetJoin::Lead(FleetLock::local()), false),
                Unlocked::Failed => return (FleetJoin::Failed, false),
                Unlocked::Shared(entry, failed) if entry.key() == key.full() => {
                    return (FleetJoin::Shared(entry, failed), false);
                }
                _ => {}
            }
            if let Some(entry) = self.lookup_l2(key, epoch, accept).await {
                return (FleetJoin::Filled(entry), false);
            }
            // Its end is taken from before the ask: a slow answer (a
            // loaded machine) must not read as the holder moving it on.
            let asked = Instant::now();
            let attempt = try_lock(l2, key, hold, fallback).await;
            let now = Instant::now();
            match attempt {
                Ok(LockAttempt::Acquired(token)) => {
                    let lock = FleetLock::held(l2.clone(), (key.clone(), token), hold, asked);
                    return (self.took_lock(key, lock, epoch, accept).await, false);
                }
                Ok(LockAttempt::Failing { left }) => {
                    return (FleetJoin::Failing(failing(left)), false);
                }
                Ok(LockAttempt::Held { left, holder: next }) => {
                    let new_holder = next.is_some() && next != holder;
                    // A new holder is a load under way (a waiter took the
                    // lock at its end, or this instance's own flight was
                    // taken over); the same holder's lock ending later than
                    // it did is its load's progress (`LockExtension`).
                    // Either moves this flight's deadline as its own load's
                    // progress would (up to four waits from its start), so
                    // this request and its waiters wait on that load
                    // rather than load beside it.
                    if new_holder || (next.is_some() && asked + left > ends + hold / 8) {
                        progress.made();
                        deadline = deadline.max(progress.deadline().unwrap_or(deadline));
                    }
                    // Past that, a new holder is still waited on once, for
                    // a flight's wait at most; the same holder still there
                    // is stuck.
                    if deadline <= now && new_holder && !extended {
                        (deadline, extended) = (now + hold, true);
                    }
                    // The same holder's lock about to end on its own (this
                    // request began a little before its take): waited to
                    // its end and taken, not loaded beside the waiter that
                    // takes it then.
                    if deadline <= now && !new_holder && !to_its_end && left <= hold / 4 {
                        let end = asked + left + Duration::from_millis(20);
                        (deadline, to_its_end) = (end, true);
                    }
                    if deadline <= now {
                        return (FleetJoin::Lead(FleetLock::local()), true);
                    }
                    (held_for, holder, ends) = (left, next, asked + left);
                }
                _ => return (FleetJoin::Lead(FleetLock::local()), true),
            }
        }
    }

    /// This instance took the lock: the holder before it (or the one it
    /// waited on, whose fill its earlier read missed) may have stored its
    /// fill and let go meanwhile, so L2 is read once more, one round trip
    /// against an origin call.
    async fn took_lock(
        &self,
        key: &CacheKey,
        // Held from here: a fill cancelled during the read below releases
        // it (as gone) instead of leaving it to its expiry.
        lock: FleetLock,
        epoch: u64,
        accept: &impl Fn(&Entry) -> bool,
    ) -> FleetJoin {
        if let Some(entry) = self.lookup_l2(key, epoch, accept).await {
            // Filled, for the instances that began waiting on this lock
            // meanwhile: the entry is there to read.
            lock.release(Unlocked::Filled, false);
            return FleetJoin::Filled(entry);
        }
        FleetJoin::Lead(lock)
    }
}

/// The fleet lock as a wait on it begins: who holds it, for how long, and
/// until when this request waits.
struct HeldLock<'a> {
    l2: &'a std::sync::Arc<dyn crate::Tier>,
    /// How long a lock taken is held (the policy's wait).
    hold: Duration,
    deadline: Instant,
    held_for: Duration,
    holder: Option<crate::LockToken>,
    /// The load has a stale copy to answer with (see `lead_fleet`).
    fallback: bool,
}

/// One lock attempt; with a `fallback`, none while the fleet knows the
/// origin failing.
async fn try_lock(
    l2: &std::sync::Arc<dyn crate::Tier>,
    key: &CacheKey,
    hold: Duration,
    fallback: bool,
) -> Result<LockAttempt, crate::TierError> {
    if fallback {
        l2.try_lock_unless_failing(key, hold).await
    } else {
        l2.try_lock(key, hold).await
    }
}

/// How long this instance leaves a failing origin alone: what the fleet's
/// mark has left, a second at most.
fn failing(left: Duration) -> Duration {
    left.min(super::RETRY_FAILING_AFTER)
}

/// How a request's turn at the fleet lock went: how it joined, how long it
/// waited on another instance's holder (if it did), and whether that wait
/// reached its deadline.
pub(crate) struct FleetWait {
    pub(crate) join: FleetJoin,
    pub(crate) waited: Option<Duration>,
    pub(crate) timed_out: bool,
}

impl From<FleetJoin> for FleetWait {
    fn from(join: FleetJoin) -> Self {
        Self {
            join,
            waited: None,
            timed_out: false,
        }
    }
}

impl From<FleetLock> for FleetWait {
    fn from(lock: FleetLock) -> Self {
        FleetJoin::Lead(lock).into()
    }
}
