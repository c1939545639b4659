//! The bytes of bodies being read whole to be stored, across every layer on
//! one engine, and their bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

/// The bytes bodies read whole to be stored (or shared) have read at once:
/// the layer keeps a body until its end, then stores it. Without a bound
/// only their count limited them, and every fill whose client left (up to
/// `max_detached_fills`, 1,024) could hold a whole `max_body` (8 MiB).
/// Counted are the bytes read; what holds them may be larger for a while
/// (a body of unknown length grows its buffer, and its last copy is made
/// before the bytes are given back), and a refused read's bytes stream on
/// to its client uncounted.
///
/// The reads share a pool of a sixteenth of L1's budget (64 KiB at least).
/// One read that does not fit what the pool has left may go on outside it,
/// up to `max_body`, so a body as large as `max_body` can be stored under
/// any budget, and one slow large body cannot take the pool from the
/// others. A read that fits neither is refused: its body streams through
/// unstored (`detail=busy`), a refusal of the moment the engine treats as
/// such ([`tiercache_core::Loaded::Busy`]). At most a sixteenth of the
/// budget plus one `max_body` is read at once.
#[derive(Debug)]
pub(crate) struct Reading {
    /// Bytes held in the pool.
    pooled: AtomicUsize,
    pool: usize,
    /// Whether the one read outside the pool is taken.
    outside_taken: AtomicBool,
}

impl Reading {
    /// The bound for an L1 of `l1_capacity` bytes.
    pub(crate) fn for_l1(l1_capacity: u64) -> Self {
        Self {
            pooled: AtomicUsize::new(0),
            pool: usize::try_from(l1_capacity / 16)
                .unwrap_or(usize::MAX)
                .max(64 * 1024),
            outside_taken: AtomicBool::new(false),
        }
    }

    /// One read's share, empty.
    pub(crate) fn share(self: &Arc<Self>) -> Share {
        Share {
            reading: self.clone(),
            pooled: 0,
            outside: false,
        }
    }
}

/// What one read holds; given back when it is dropped (the body read
/// whole and stored, cut, or its request gone).
#[derive(Debug)]
pub(crate) struct Share {
    reading: Arc<Reading>,
    /// Bytes held in the pool (none once the read is outside it).
    pooled: usize,
    /// This is the one read outside the pool (bounded by `max_body`).
    outside: bool,
}

impl Share {
    /// Holds `total` bytes in all: from the pool while it has room, else
    /// as the one read outside it; refused when neither can take them.
    pub(crate) fn grow_to(&mut self, total: usize) -> bool {
        let Some(more) = total.checked_sub(self.pooled).filter(|&n| n > 0) else {
            return true;
        };
        if self.outside {
            return true;
        }
        let reading = &self.reading;
        // Taken only when it fits: a read refused does not make others
        // see the pool fuller than it is.
        let taken = reading.pooled.fetch_update(Relaxed, Relaxed, |held| {
            held.checked_add(more)
                .filter(|&after| after <= reading.pool)
        });
        if taken.is_ok() {
            self.pooled = total;
            return true;
        }
        if reading
            .outside_taken
            .compare_exchange(false, true, Relaxed, Relaxed)
            .is_err()
        {
            return false;
        }
        // Its bytes leave the pool with it.
        reading.pooled.fetch_sub(self.pooled, Relaxed);
        self.pooled = 0;
        self.outside = true;
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if self.outside {
            self.reading.outside_taken.store(false, Relaxed);
        } else {
            self.reading.pooled.fetch_sub(self.pooled, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_share_the_pool_and_one_goes_past_it() {
        // A pool of 1 MiB.
        let reading = Arc::new(Reading::for_l1(16 << 20));
        let mut a = reading.share();
        assert!(a.grow_to(600 << 10));
        let mut b = reading.share();
        assert!(b.grow_to(300 << 10));
        // Past the pool: A goes on outside it, its bytes leave the pool.
        assert!(a.grow_to(8 << 20), "one read may go on to max_body");
        assert_eq!(reading.pooled.load(Relaxed), 300 << 10);
        // The pool is the others' still; past it, nothing is left.
        assert!(b.grow_to(1 << 20));
        let mut c = reading.share();
        assert!(!c.grow_to(1), "past the pool with the one outside taken");
        drop(a);
        assert!(
            c.grow_to(2 << 20),
            "the place outside the pool is free again"
        );
        drop(b);
        let mut d = reading.share();
        assert!(d.grow_to(1 << 20));
        assert!(!d.grow_to((1 << 20) + 1));
        drop((c, d));
        assert_eq!(reading.pooled.load(Relaxed), 0);
        assert!(!reading.outside_taken.load(Relaxed));
    }
}
