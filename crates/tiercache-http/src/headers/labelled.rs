//! Each thread's last finished heads of plain L1 hits.
//!
//! A plain L1 hit's head is the entry's stored head with this cache's own
//! fields set, and those change only with the entry, its age and fresh
//! seconds (once a second) and the hit ratio's fourth decimal. Setting them
//! cost ~1,350 instructions a hit, more than the rest of the head's clone;
//! a hot entry's hits within one second mostly get the same head, so the
//! finished head is kept per thread and cloned. What it was built from is
//! its [`Stamp`], compared in full: a remembered head only ever answers for
//! the same entry (by [`Entry::id`], never reused) and the same values.
//!
//! Memory: at most [`SLOTS`] heads a thread, each within [`MAX_HEAD_BYTES`]
//! (measured before the own fields, which add ~100) and [`MAX_HEAD_FIELDS`],
//! copied out of whatever buffer they came in; a head is kept only the
//! second time its stamp comes, so an entry hit once pays no copy.
//!
//! [`Entry::id`]: tiercache_core::Entry::id

use std::cell::RefCell;

use http::{HeaderMap, HeaderValue};

/// Slots in each thread's table (a power of two).
const SLOTS: usize = 32;
/// Heads with more bytes of field names and values are not kept.
pub(super) const MAX_HEAD_BYTES: usize = 4096;
/// Nor heads of more fields (each costs a slot's bookkeeping besides its bytes).
pub(super) const MAX_HEAD_FIELDS: usize = 64;

/// Everything a plain L1 hit's own fields are built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    /// [`tiercache_core::Entry::id`].
    pub(super) entry: u64,
    /// `age`, whole seconds.
    pub(super) age: u64,
    /// Fresh seconds left (`cache-status`'s `ttl`).
    pub(super) ttl: u64,
    /// The hit ratio's step of 0.0001.
    pub(super) ratio: u16,
}

enum Slot {
    /// Seen once: the next hit with this stamp keeps its head.
    Seen(Stamp),
    Kept(Stamp, HeaderMap),
}

thread_local! {
    static HEADS: RefCell<[Option<Slot>; SLOTS]> =
        const { RefCell::new([const { None }; SLOTS]) };
}

/// What the table holds for a stamp.
pub(super) enum Remembered {
    /// The finished head.
    Head(HeaderMap),
    /// Nothing yet: build it, and [`keep`] it when `true`.
    Build(bool),
}

fn slot_of(stamp: &Stamp) -> usize {
    // Ids are handed out in order, so hot entries spread over the slots.
    (stamp.entry % SLOTS as u64) as usize
}

/// The head kept for `stamp`, or whether to keep the one about to be built.
// On every L1 hit: inlined into the application's crate too.
#[inline]
pub(super) fn recall(stamp: Stamp) -> Remembered {
    HEADS
        .try_with(|heads| {
            let mut heads = heads.borrow_mut();
            let slot = &mut heads[slot_of(&stamp)];
            match slot {
                Some(Slot::Kept(kept, head)) if *kept == stamp => Remembered::Head(head.clone()),
                Some(Slot::Seen(seen)) if *seen == stamp => Remembered::Build(true),
                _ => {
                    *slot = Some(Slot::Seen(stamp));
                    Remembered::Build(false)
                }
            }
        })
        // A thread being torn down has no table any more.
        .unwrap_or(Remembered::Build(false))
}

/// Keeps a copy of `head` as the finished head for `stamp`.
pub(super) fn keep(stamp: Stamp, head: &HeaderMap) {
    let _ = HEADS.try_with(|heads| {
        heads.borrow_mut()[slot_of(&stamp)] = Some(Slot::Kept(stamp, owned(head)));
    });
}

/// `head` with every value in an allocation of its own. A stored head's
/// values may be slices of the buffer an L2 read brought (the whole
/// payload, body included): held by a slot, that buffer would outlive
/// its entry, outside L1's budget.
fn owned(head: &HeaderMap) -> HeaderMap {
    let mut copy = HeaderMap::with_capacity(head.len());
    for (name, value) in head {
        let mut owned = HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone());
        owned.set_sensitive(value.is_sensitive());
        copy.append(name.clone(), owned);
    }
    copy
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn stamp(entry: u64, age: u64) -> Stamp {
        Stamp {
            entry,
            age,
            ttl: 60,
            ratio: 9_000,
        }
    }

    fn head(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-v", HeaderValue::from_static(v));
        h
    }

    #[test]
    fn a_head_is_kept_the_second_time_and_answers_only_its_own_stamp() {
        let s = stamp(7, 1);
        assert!(matches!(recall(s), Remembered::Build(false)));
        assert!(matches!(recall(s), Remembered::Build(true)));
        keep(s, &head("a"));
        match recall(s) {
            Remembered::Head(h) => assert_eq!(h["x-v"], "a"),
            Remembered::Build(_) => panic!("kept head not recalled"),
        }
        // Same slot, any other value of the stamp: never the kept head.
        for other in [
            stamp(7, 2),
            stamp(7 + SLOTS as u64, 1),
            Stamp { ttl: 59, ..s },
            Stamp { ratio: 9_001, ..s },
        ] {
            assert!(matches!(recall(other), Remembered::Build(false)));
            assert!(
                matches!(recall(s), Remembered::Build(false)),
                "{other:?} replaced it"
            );
        }
    }

    /// A kept head holds no share of the buffer its values came in (an L2
    /// read's: the payload, body included).
    #[test]
    fn a_kept_head_owns_its_values() {
        let payload = Bytes::from(vec![b'v'; 64 * 1024]);
        let mut head = HeaderMap::new();
        head.insert(
            "x-v",
            HeaderValue::from_maybe_shared(payload.slice(..8)).unwrap(),
        );
        head.insert("x-w", HeaderValue::from_static("w"));
        let s = stamp(11, 1);
        keep(s, &head);
        drop(head);
        assert!(payload.is_unique(), "a kept head pins the payload");
        match recall(s) {
            Remembered::Head(h) => {
                assert_eq!(h["x-v"], "vvvvvvvv");
                assert_eq!(h["x-w"], "w");
            }
            Remembered::Build(_) => panic!("kept head not recalled"),
        }
    }
}
