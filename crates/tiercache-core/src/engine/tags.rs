//! The tag index: which L1 keys this instance stored under each tag, so a
//! tag invalidation drops them without a shared tier.
//!
//! The index follows L1: records of entries L1 has evicted or expired are
//! pruned once the records outgrow the last live count by a quarter (and
//! on every sweep), and a tag left with no live key leaves the index. Each
//! live record is weighed in its entry's L1 weight
//! ([`TAG_ALLOWANCE`](crate::entry::TAG_ALLOWANCE) and the tag's bytes), so
//! the index holds at most ~1.25x the records L1's budget pays for plus
//! 1,024, whatever the number of unique tags (each `Vary`ing URL has one).
//! Its room (see [`Inner::tag_room`]) is twice what the budget can pay
//! for, so the prunes keep it short of the room: a crawl never pushes a
//! tag out, nor a tag with many keys past its set (either would make the
//! tag's invalidation drop all of L1). The records themselves are in
//! [`TagIndex`](super::tag_index::TagIndex).

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;

use super::Inner;
use super::tag_index::Recorded;
use crate::l1::Holding;
use crate::{Entry, KeyHash};

impl Inner {
    /// The least room of the index, in records (a key under a tag).
    const MIN_TAG_ROOM: usize = if cfg!(test) { 1_000 } else { 1_000_000 };

    /// The records all tags share, for an L1 of `l1_capacity` bytes: twice
    /// the records its budget can pay for (each weighs at least
    /// `TAG_ALLOWANCE`), at least `MIN_TAG_ROOM`. Past it a tag is marked
    /// overflowed, which the prunes keep the index from reaching.
    pub(super) fn tag_room(l1_capacity: u64) -> usize {
        let paid = l1_capacity / crate::entry::TAG_ALLOWANCE as u64;
        usize::try_from(paid.saturating_mul(2))
            .unwrap_or(usize::MAX)
            .max(Self::MIN_TAG_ROOM)
    }

    /// Records `hash` (just put in L1 as `holding`'s fill) under each of `tags`.
    pub(super) fn record_tags(&self, hash: KeyHash, holding: &Holding, tags: &[Bytes]) {
        for tag in tags {
            let room = self.tag_keys.load(Relaxed) < self.tag_room;
            match self.tags.record(tag, hash, holding, room) {
                Recorded::Added => {
                    self.tag_keys.fetch_add(1, Relaxed);
                }
                Recorded::Kept => {}
                Recorded::NoRoom { tag_left_out } => {
                    if tag_left_out {
                        self.tags_incomplete.store(true, Relaxed);
                    }
                }
            }
        }
        if self.tag_keys.load(Relaxed) > self.tags_prune_at.load(Relaxed) {
            // Pruned by the caller once out of the journal's lock (see
            // `prune_tags_if_due`): a prune walks the whole index.
            self.tags_prune_due.store(true, Relaxed);
        }
    }

    /// Records `hash`, just put in L1 in place of `old`, under `tags`, and
    /// takes it out of the tags only `old` had: a key stored again under
    /// other tags leaves no record behind that no entry weighs (a prune
    /// would drop it too, its fill gone, but only when one comes).
    pub(super) fn retag(
        &self,
        hash: KeyHash,
        holding: &Holding,
        old: Option<&Entry>,
        tags: &[Bytes],
    ) {
        for gone in old.map_or(&[][..], Entry::tags) {
            if !tags.contains(gone) && self.tags.forget(gone, &hash) {
                self.forget_tag_keys(1);
            }
        }
        self.record_tags(hash, holding, tags);
    }

    /// Prunes the index if a fill found it due (see [`record_tags`](Self::record_tags)).
    pub(crate) fn prune_tags_if_due(&self) {
        if self.tags_prune_due.load(Relaxed) && self.tags_prune_due.swap(false, Relaxed) {
            self.prune_tags();
        }
    }

    /// Takes `n` records off the count, never below zero: a clear (a
    /// resync, an overflowed tag's invalidation) resets it to zero while a
    /// prune or an eviction may still count the records it took.
    pub(super) fn forget_tag_keys(&self, n: usize) {
        let _ = self
            .tag_keys
            .fetch_update(Relaxed, Relaxed, |held| Some(held.saturating_sub(n)));
    }

    /// Drops the records of fills L1 no longer holds (a key filled again
    /// since, after its entry left L1, under other tags included), and the
    /// tags left without one; the count is then what is left, and the next
    /// prune comes once the records have grown by a quarter (amortised O(1)
    /// a record), before stale records could use up the index's room. Safe
    /// beside fills: a fill is put in L1 before it is recorded, under the
    /// shard's lock a prune holds, so a record pruned here was of a fill
    /// already gone.
    pub(super) fn prune_tags(&self) {
        let left = self.tags.retain(Holding::held, &self.tags_incomplete);
        // Records added meanwhile may be missed here: the next prune counts
        // them again.
        self.tag_keys.store(left, Relaxed);
        self.tags_prune_at
            .store(Self::next_prune(left, self.tag_room), Relaxed);
    }

    /// When the index is pruned next, with `left` records after a prune:
    /// past a quarter more, and below the room every tag shares. Near that
    /// room (7/8 of it live) only sweeps prune: a prune per fill would walk
    /// the whole index each time.
    pub(super) fn next_prune(left: usize, room: usize) -> usize {
        let near_full = room / 8 * 7;
        if left >= near_full {
            usize::MAX
        } else {
            (left + left / 4 + 1024).min(near_full)
        }
    }
}
