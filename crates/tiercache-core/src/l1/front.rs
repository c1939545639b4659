//! A per-thread table of the entries each thread read from L1 last, in
//! front of moka, so a hot key's hit skips moka's read (~1,000
//! instructions: its table, its read log, its housekeeping).
//!
//! A slot answers only while nothing can have changed L1 under its key
//! since the slot was filled: every change (a store, a removal, moka's own
//! evictions and expirations, through its listener) moves the epoch of the
//! key's shard, a change of many keys at once moves the L1-wide epoch, and
//! a slot remembers both as they were read *before* moka was asked. A
//! change that lands after that read leaves the slot stale at once; a
//! change that lands before it is in what moka answered.
//!
//! One read in [`FEEDBACK_EVERY`] of a slot's key goes to moka anyway, so
//! moka still sees a hot key read (its eviction order and its popularity
//! estimate), at that fraction of the rate.
//!
//! A slot holds its entry weakly: what moka drops (evicted, expired,
//! replaced) is freed as soon as no response in flight holds it, and a
//! thread's table keeps only [`SLOTS`] entry records (~200 bytes each),
//! never a body, past that.

use std::cell::RefCell;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crate::entry::WeakEntry;
use crate::{Entry, KeyHash};

/// Slots a thread holds (direct-mapped by digest).
pub(crate) const SLOTS: usize = 32;
/// One read in this many of a slot's key is answered by moka instead.
pub(crate) const FEEDBACK_EVERY: u32 = 16;
/// Epoch shards: a store under one key rarely stops another key's slot.
const SHARDS: usize = 1024;

/// Tells one L1 from another in a thread's slots (tests build many).
static NEXT_L1: AtomicU64 = AtomicU64::new(1);

/// An L1's change counters, shared with its eviction listener.
pub(crate) struct Epochs {
    l1: u64,
    all: AtomicU64,
    shards: Box<[AtomicU64]>,
}

/// The epochs a slot was filled under.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Stamp {
    all: u64,
    shard: u64,
}

struct Slot {
    l1: u64,
    hash: KeyHash,
    stamp: Stamp,
    answered: u32,
    entry: WeakEntry,
}

thread_local! {
    static FRONT: RefCell<[Option<Slot>; SLOTS]> = const { RefCell::new([const { None }; SLOTS]) };
}

fn halves(hash: &KeyHash) -> (u64, u64) {
    let bytes = hash.as_bytes();
    let (lo, hi) = bytes.split_at(8);
    (
        u64::from_le_bytes(lo.try_into().unwrap()),
        u64::from_le_bytes(hi.try_into().unwrap()),
    )
}

fn slot_of(hash: &KeyHash) -> usize {
    halves(hash).1 as usize % SLOTS
}

impl Epochs {
    pub(crate) fn new() -> Self {
        Self {
            l1: NEXT_L1.fetch_add(1, Relaxed),
            all: AtomicU64::new(0),
            shards: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn shard(&self, hash: &KeyHash) -> &AtomicU64 {
        &self.shards[halves(hash).0 as usize % SHARDS]
    }

    /// L1 changed under `hash`: slots holding it stop answering.
    pub(crate) fn moved(&self, hash: &KeyHash) {
        self.shard(hash).fetch_add(1, Release);
    }

    /// L1 changed under many keys at once: no slot answers.
    pub(crate) fn moved_all(&self) {
        self.all.fetch_add(1, Release);
    }

    /// The epochs as of now: read before moka is asked.
    pub(crate) fn stamp(&self, hash: &KeyHash) -> Stamp {
        Stamp {
            all: self.all.load(Acquire),
            shard: self.shard(hash).load(Acquire),
        }
    }

    /// The entry this thread read under `hash` last, if nothing changed
    /// L1 under it since (and it is not moka's turn); otherwise the stamp
    /// to read moka under and to [`keep`](Self::keep) its answer with.
    // On every L1 hit: inlined into the application's crate too.
    #[inline]
    pub(crate) fn lookup(&self, hash: &KeyHash) -> Result<Entry, Stamp> {
        let now = self.stamp(hash);
        let answer = FRONT.try_with(|front| {
            let mut front = front.borrow_mut();
            match front[slot_of(hash)].as_mut() {
                Some(slot)
                    if slot.l1 == self.l1
                        && slot.hash == *hash
                        && slot.stamp == now
                        && slot.answered + 1 < FEEDBACK_EVERY =>
                {
                    slot.answered += 1;
                    slot.entry.upgrade()
                }
                _ => None,
            }
        });
        // No table (the thread is ending) or nothing to answer: moka's turn.
        answer.ok().flatten().ok_or(now)
    }

    /// Keeps `entry`, read from moka under `stamp`, for this thread's next reads.
    pub(crate) fn keep(&self, hash: &KeyHash, stamp: Stamp, entry: &Entry) {
        let slot = Slot {
            l1: self.l1,
            hash: *hash,
            stamp,
            answered: 0,
            entry: entry.downgrade(),
        };
        // The slot it replaces is dropped after the table is let go.
        let _replaced = FRONT.try_with(|front| front.borrow_mut()[slot_of(hash)].replace(slot));
    }
}
