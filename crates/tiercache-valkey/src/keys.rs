//! The names of what the tier keeps in Valkey: every key about one cache
//! key shares its hash tag (one cluster slot), and no URL byte reaches a
//! name.

use tiercache_core::{CacheKey, KeyHash};

use crate::tier::ValkeyTier;

impl ValkeyTier {
    /// The Valkey key of `key`'s fill lock: `PREFIX:{HASH}:lock`, in the entry's slot.
    pub fn lock_key(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "lock")
    }

    /// The Valkey key that marks `key`'s origin failing for the fleet:
    /// `PREFIX:{HASH}:failing`, in the lock's slot (the lock script reads it).
    pub(crate) fn failing_key(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "failing")
    }

    /// The Valkey sorted set of the keys stored with `tag`: `PREFIX:{TAGHASH}:tags`.
    ///
    /// A sorted set: each member (a key's hash) scored by when its entry
    /// expires, trimmed of expired members on every write, so a tag that
    /// every response carries stays the size of what is alive.
    pub fn tag_key(&self, tag: &[u8]) -> String {
        tag_key_in(&self.inner.prefix, tag)
    }

    /// The plain set the previous version kept a tag's keys in (read once
    /// by an invalidation, during a rolling upgrade).
    pub(crate) fn legacy_tag_key(&self, tag: &[u8]) -> String {
        let hash = CacheKey::builder().part(b"tag").part(tag).finish().hash();
        slot_key(&self.inner.prefix, &hash, "tag")
    }

    pub(crate) fn entry_key_of(&self, hash: &KeyHash) -> String {
        entry_key_in(&self.inner.prefix, hash)
    }

    /// The Valkey key an entry is stored under: `PREFIX:{HASH}:e`. The hash
    /// tag keeps an entry and its lock on one cluster slot, and no URL byte
    /// reaches the key.
    pub fn entry_key(&self, key: &CacheKey) -> String {
        self.entry_key_of(&key.hash())
    }
}

/// `PREFIX:{HASH}:SUFFIX`: the hash tag puts everything about one key (its
/// entry, lock and wake-up channel) on one cluster slot.
pub(crate) fn slot_key(prefix: &str, hash: &KeyHash, suffix: &str) -> String {
    format!("{prefix}:{{{hash}}}:{suffix}")
}

/// [`ValkeyTier::entry_key`] of the key hashed `hash`, under `prefix`.
pub(crate) fn entry_key_in(prefix: &str, hash: &KeyHash) -> String {
    slot_key(prefix, hash, "e")
}

/// [`ValkeyTier::tag_key`] under `prefix`.
pub(crate) fn tag_key_in(prefix: &str, tag: &[u8]) -> String {
    let hash = CacheKey::builder().part(b"tag").part(tag).finish().hash();
    slot_key(prefix, &hash, "tags")
}
