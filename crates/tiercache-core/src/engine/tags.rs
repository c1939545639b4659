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
//! tag's invalidation drop all of L1).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use moka::ops::compute::Op;

use super::Inner;
use crate::l1::Holding;
use crate::{Entry, KeyHash};

/// The keys this instance stored under one tag, each with the fill it
/// stored under it.
#[derive(Debug, Default)]
pub(crate) struct TagKeys {
    keys: HashMap<KeyHash, Holding>,
    /// A key stored under the tag was not recorded (the index had no room
    /// left): the tag's invalidation drops all of L1.
    pub(super) overflowed: bool,
    /// Pruned out of the index (no live key was left): a key is recorded
    /// in the tag's new index instead.
    dead: bool,
}

impl TagKeys {
    /// Records `key` (alive in L1 as `holding`'s fill); with no `room`
    /// left in the index the tag is marked overflowed instead. `None` when
    /// this index left the tag index; else whether `key` was added.
    fn record(&mut self, key: KeyHash, holding: &Holding, room: bool) -> Option<bool> {
        if self.dead {
            return None;
        }
        if self.overflowed {
            return Some(false);
        }
        if let Some(recorded) = self.keys.get_mut(&key) {
            // Its newest fill under the tag: an older one may be gone.
            *recorded = holding.clone();
            return Some(false);
        }
        if !room {
            self.overflowed = true;
            return Some(false);
        }
        self.keys.insert(key, holding.clone());
        Some(true)
    }

    /// Drains the keys of an index taken out for the tag's invalidation:
    /// a key recorded after it goes in the tag's next index.
    pub(super) fn take(&mut self) -> Vec<KeyHash> {
        self.dead = true;
        self.keys.drain().map(|(key, _)| key).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

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
            loop {
                let index = self.tags.get_with(tag.clone(), Default::default);
                let room = self.tag_keys.load(Relaxed) < self.tag_room;
                let recorded = index
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .record(hash, holding, room);
                let Some(added) = recorded else {
                    // Pruned away meanwhile: the tag's next index.
                    self.forget_tag_index(tag, &index);
                    continue;
                };
                if added {
                    self.tag_keys.fetch_add(1, Relaxed);
                }
                break;
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
            if tags.contains(gone) {
                continue;
            }
            let Some(index) = self.tags.get(gone) else {
                continue;
            };
            if index
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keys
                .remove(&hash)
                .is_some()
            {
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

    /// Takes `index` (pruned away) out of the tag index, unless the tag has
    /// a newer one.
    pub(super) fn forget_tag_index(&self, tag: &Bytes, index: &Arc<Mutex<TagKeys>>) {
        self.tags
            .entry(tag.clone())
            .and_compute_with(|held| match held {
                Some(held) if Arc::ptr_eq(held.value(), index) => Op::Remove,
                _ => Op::Nop,
            });
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
    /// set's lock a prune holds, so a record pruned here was of a fill
    /// already gone.
    pub(super) fn prune_tags(&self) {
        let mut left = 0;
        for (tag, index) in self.tags.iter() {
            let dead = {
                let mut keys = index.lock().unwrap_or_else(|e| e.into_inner());
                keys.keys.retain(|_, fill| fill.held());
                // A set that once held many more keys gives their room back.
                let live = keys.keys.len();
                if keys.keys.capacity() > 4 * live + 64 {
                    keys.keys.shrink_to(2 * live);
                }
                keys.dead |= keys.keys.is_empty() && !keys.overflowed;
                if !keys.dead {
                    left += keys.keys.len();
                }
                keys.dead
            };
            if dead {
                self.forget_tag_index(&tag, &index);
            }
        }
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
