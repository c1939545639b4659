//! The tag index's storage: tag → the keys stored under it, in shards of
//! plain hash maps.
//!
//! A tag of its own (each object's id, each `Vary`ing URL's family tag)
//! is the common case, so a record is kept small: the tag by two seeded
//! 64-bit hashes of it (the tag's bytes stay with the entries), and a tag
//! with one
//! key holds it inline, so such a record is one 40-byte slot of its
//! shard's map. A moka cache of sets held ~950 bytes a tag (its node, the
//! set's `Arc` and table, the tag's copy), 2.3× a 32 MiB budget under
//! responses of 32 tags each, where each entry pays 250 bytes a tag.
//!
//! Two tags whose hashes both collide would share a record: the first one
//! invalidated would drop only its own entries and forget the other's
//! records, so the other's invalidation would miss them. The two hashes
//! are foldhash's, seeded apart per process (they share its global seed),
//! so the odds are at most those of a 64-bit collision among the tags
//! alive at once (~n²/2⁶⁵: below 10⁻⁷ for a million tags).

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};

use crate::KeyHash;
use crate::l1::Holding;

type Hasher = foldhash::fast::RandomState;

/// Shards: fills on many threads record tags without one lock between them.
const SHARDS: usize = 64;

/// A tag, by two seeded 64-bit hashes of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct TagId(u64, u64);

/// The keys one tag was stored with, each with the fill it was stored
/// under it.
#[derive(Debug)]
enum Keys {
    One(KeyHash, Holding),
    /// Boxed: most tags have one key, and the shard's slot stays small
    /// (a record is 40 bytes with the box, see the test).
    #[allow(clippy::box_collection)]
    Many(Box<HashMap<KeyHash, Holding, Hasher>>),
}

impl Keys {
    fn len(&self) -> usize {
        match self {
            Keys::One(..) => 1,
            Keys::Many(keys) => keys.len(),
        }
    }
}

#[derive(Debug, Default)]
struct Shard {
    tags: HashMap<TagId, Keys, Hasher>,
    /// Tags a key stored under was not recorded for (the index had no
    /// room left): their invalidation drops all of L1.
    overflowed: HashSet<TagId, Hasher>,
}

/// What [`TagIndex::record`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// A new record (the count grows by one).
    Added,
    /// The key was there already (now with this fill), or its tag had
    /// overflowed.
    Kept,
    /// No room: the tag is marked overflowed, or, new, left out of the
    /// index (the caller marks the whole index incomplete: a set of
    /// overflowed tags would grow with every new tag).
    NoRoom { tag_left_out: bool },
}

/// Tag → keys, sharded.
pub(crate) struct TagIndex {
    shards: Box<[Mutex<Shard>]>,
    seeds: (Hasher, Hasher),
}

impl std::fmt::Debug for TagIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagIndex")
            .field("tags", &self.len())
            .finish()
    }
}

impl Default for TagIndex {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            seeds: (Hasher::default(), Hasher::default()),
        }
    }
}

fn lock<T>(shard: &Mutex<T>) -> MutexGuard<'_, T> {
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

impl TagIndex {
    fn shard(&self, tag: &[u8]) -> (TagId, MutexGuard<'_, Shard>) {
        let id = TagId(self.seeds.0.hash_one(tag), self.seeds.1.hash_one(tag));
        (id, lock(&self.shards[id.1 as usize % SHARDS]))
    }

    /// Records `key` (alive in L1 as `holding`'s fill) under `tag`; with no
    /// `room` left for a new record, the tag is marked overflowed instead.
    pub(crate) fn record(
        &self,
        tag: &[u8],
        key: KeyHash,
        holding: &Holding,
        room: bool,
    ) -> Recorded {
        let (id, mut shard) = self.shard(tag);
        if shard.overflowed.contains(&id) {
            return Recorded::Kept;
        }
        let Some(keys) = shard.tags.get_mut(&id) else {
            if !room {
                return Recorded::NoRoom { tag_left_out: true };
            }
            shard.tags.insert(id, Keys::One(key, holding.clone()));
            return Recorded::Added;
        };
        match keys {
            // Its newest fill under the tag: an older one may be gone.
            Keys::One(one, fill) if *one == key => {
                *fill = holding.clone();
                return Recorded::Kept;
            }
            Keys::Many(many) => {
                if let Some(fill) = many.get_mut(&key) {
                    *fill = holding.clone();
                    return Recorded::Kept;
                }
            }
            Keys::One(..) => {}
        }
        if !room {
            shard.overflowed.insert(id);
            return Recorded::NoRoom {
                tag_left_out: false,
            };
        }
        if let Keys::One(one, fill) = keys {
            let mut many = HashMap::with_capacity_and_hasher(2, Hasher::default());
            many.insert(*one, fill.clone());
            *keys = Keys::Many(Box::new(many));
        }
        if let Keys::Many(many) = keys {
            many.insert(key, holding.clone());
        }
        Recorded::Added
    }

    /// Takes `key` out of `tag`'s records; whether it was there.
    pub(crate) fn forget(&self, tag: &[u8], key: &KeyHash) -> bool {
        let (id, mut shard) = self.shard(tag);
        let Some(keys) = shard.tags.get_mut(&id) else {
            return false;
        };
        let (found, left) = match keys {
            Keys::One(one, _) => (*one == *key, *one != *key),
            Keys::Many(many) => (many.remove(key).is_some(), !many.is_empty()),
        };
        if !left {
            shard.tags.remove(&id);
        }
        found
    }

    /// Takes `tag` out: its keys, and whether it had overflowed (then some
    /// of its keys in L1 were not recorded). A key recorded after this
    /// goes in the tag's next record.
    pub(crate) fn take(&self, tag: &[u8]) -> (Vec<KeyHash>, bool) {
        let (id, mut shard) = self.shard(tag);
        let overflowed = shard.overflowed.remove(&id);
        let keys = match shard.tags.remove(&id) {
            None => Vec::new(),
            Some(Keys::One(key, _)) => vec![key],
            Some(Keys::Many(many)) => many.into_keys().collect(),
        };
        (keys, overflowed)
    }

    /// Drops every record.
    pub(crate) fn clear(&self) {
        for shard in self.shards.iter() {
            *lock(shard) = Shard::default();
        }
    }

    /// Keeps the records whose fill `live` says L1 still holds, and the
    /// tags left with one. Returns the records left. An overflowed tag
    /// left with none loses its mark, and sets `incomplete` instead (its
    /// unrecorded keys may still be in L1), under its shard's lock: a tag
    /// invalidation that takes the tag after that finds the flag set.
    pub(crate) fn retain(&self, live: impl Fn(&Holding) -> bool, incomplete: &AtomicBool) -> usize {
        let mut left = 0;
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let shard = &mut *shard;
            shard.tags.retain(|_, keys| {
                match keys {
                    Keys::One(_, fill) => {
                        if !live(fill) {
                            return false;
                        }
                    }
                    Keys::Many(many) => {
                        many.retain(|_, fill| live(fill));
                        // A set that once held many more keys gives its room back.
                        let n = many.len();
                        if many.capacity() > 4 * n + 64 {
                            many.shrink_to(2 * n);
                        }
                    }
                }
                left += keys.len();
                keys.len() > 0
            });
            let tags = &shard.tags;
            let before = shard.overflowed.len();
            shard.overflowed.retain(|id| tags.contains_key(id));
            if shard.overflowed.len() < before {
                incomplete.store(true, SeqCst);
            }
            // A shard that once held many more tags gives its room back.
            let n = shard.tags.len();
            if shard.tags.capacity() > 4 * n + 64 {
                shard.tags.shrink_to(2 * n);
            }
        }
        left
    }

    /// Tags in the index.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).tags.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of a tag of its own is one small slot (with `Keys`' niche,
    /// no room for a discriminant).
    #[test]
    fn a_record_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<(TagId, Keys)>(), 40);
    }

    fn key(i: u8) -> KeyHash {
        crate::CacheKey::new(format!("/{i}")).hash()
    }

    /// Past the room, a tag already in the index is marked overflowed (its
    /// invalidation then drops all of L1) and a new one is left out (the
    /// caller marks the index incomplete); a tag whose keys all left L1
    /// takes its mark with it only by saying so.
    #[test]
    fn without_room_a_tag_overflows_and_says_so_when_it_goes() {
        let index = TagIndex::default();
        let fill = Holding::never();
        assert_eq!(index.record(b"a", key(1), &fill, true), Recorded::Added);
        assert_eq!(index.record(b"a", key(1), &fill, false), Recorded::Kept);
        let full = index.record(b"a", key(2), &fill, false);
        assert_eq!(
            full,
            Recorded::NoRoom {
                tag_left_out: false
            }
        );
        let new = index.record(b"b", key(3), &fill, false);
        assert_eq!(new, Recorded::NoRoom { tag_left_out: true });
        assert_eq!(index.len(), 1);
        let incomplete = AtomicBool::new(false);
        assert_eq!(index.retain(|_| true, &incomplete), 1);
        assert!(!incomplete.load(SeqCst));
        assert_eq!(index.retain(|_| false, &incomplete), 0);
        assert!(incomplete.load(SeqCst), "the mark went unsaid");
        assert_eq!(index.take(b"a"), (Vec::new(), false));
        index.record(b"a", key(1), &fill, true);
        index.record(b"a", key(2), &fill, false);
        assert_eq!(index.take(b"a"), (vec![key(1)], true));
        assert_eq!(index.take(b"a"), (Vec::new(), false), "taken twice");
    }

    /// A tag with several keys keeps them all; one that loses its last
    /// key leaves the index.
    #[test]
    fn a_tag_leaves_with_its_last_key() {
        let index = TagIndex::default();
        let fill = Holding::never();
        for i in 0..3 {
            assert_eq!(index.record(b"t", key(i), &fill, true), Recorded::Added);
        }
        assert!(index.forget(b"t", &key(0)));
        assert!(!index.forget(b"t", &key(0)));
        assert!(index.forget(b"t", &key(1)));
        assert_eq!(index.len(), 1);
        assert!(index.forget(b"t", &key(2)));
        assert_eq!(index.len(), 0);
        index.record(b"t", key(4), &fill, true);
        assert_eq!(index.take(b"t"), (vec![key(4)], false));
    }
}
