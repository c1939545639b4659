//! The bytes of bodies being read whole to be stored, across every layer on
//! one engine, and their bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// What bodies read whole to be stored hold at once (the layer keeps a body
/// until its end, then stores it), and its bound: a sixteenth of L1's
/// budget. A read that would pass it while other reads hold bytes stops
/// and streams the rest through unstored; a read alone may always go on
/// (to `max_body`), so any one body within it can be stored. Without it
/// only their count bounded them: every fill whose client left (up to
/// `max_detached_fills`) could hold a whole `max_body`.
#[derive(Debug)]
pub(crate) struct Reading {
    held: AtomicUsize,
    bound: usize,
}

impl Reading {
    /// The bound for an L1 of `l1_capacity` bytes (64 KiB at least).
    pub(crate) fn for_l1(l1_capacity: u64) -> Self {
        Self {
            held: AtomicUsize::new(0),
            bound: usize::try_from(l1_capacity / 16)
                .unwrap_or(usize::MAX)
                .max(64 * 1024),
        }
    }

    /// One read's share, empty.
    pub(crate) fn share(self: &Arc<Self>) -> Share {
        Share {
            reading: self.clone(),
            bytes: 0,
        }
    }
}

/// What one read holds; given back when it is dropped (the body read
/// whole and stored, cut, or its request gone).
#[derive(Debug)]
pub(crate) struct Share {
    reading: Arc<Reading>,
    bytes: usize,
}

impl Share {
    /// Holds `total` bytes in all (more than before): refused when that
    /// passes the bound while other reads hold bytes.
    pub(crate) fn grow_to(&mut self, total: usize) -> bool {
        let Some(more) = total.checked_sub(self.bytes).filter(|&n| n > 0) else {
            return true;
        };
        let before = self.reading.held.fetch_add(more, Relaxed);
        if before.saturating_add(more) > self.reading.bound && before > self.bytes {
            self.reading.held.fetch_sub(more, Relaxed);
            return false;
        }
        self.bytes = total;
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.reading.held.fetch_sub(self.bytes, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_alone_goes_past_the_bound_others_do_not() {
        let reading = Arc::new(Reading::for_l1(16 << 20));
        let mut a = reading.share();
        assert!(a.grow_to(600 << 10));
        assert!(a.grow_to(2 << 20), "alone: up to max_body");
        let mut b = reading.share();
        assert!(!b.grow_to(1), "past the bound while a holds bytes");
        drop(a);
        assert!(b.grow_to(900 << 10), "a's bytes were given back");
        let mut c = reading.share();
        assert!(c.grow_to(100 << 10));
        assert!(!c.grow_to(200 << 10));
        drop((b, c));
        assert_eq!(reading.held.load(Relaxed), 0);
    }
}
