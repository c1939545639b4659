//! Invalidation: by key, tag or prefix; in L1 at once (recorded in the
//! journal, so fills in flight that it covers are not stored), then in the
//! shared tier and, through its messages, every other instance's L1.

use bytes::Bytes;

use super::journal::Scope;
use super::outbox::Queued;
use super::{Inner, TieredCache};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

use crate::stats::bump;
use crate::{CacheKey, Invalidation, InvalidationSink, KeyHash, KeyPattern};

impl TieredCache {
    /// Removes `key` from L1 and from the shared tier, and from every other
    /// instance's L1 (through the tier's messages). A load of `key` already
    /// in flight still answers the requests waiting on it, but is not stored.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tiercache_core::Queued> {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    /// let key = CacheKey::new("user:7");
    /// cache.put(&key, Value::from_body("v"), &policy);
    /// cache.invalidate(&key).await?;
    /// assert!(!cache.exists(&key).await);
    /// # Ok(()) }
    /// ```
    pub async fn invalidate(&self, key: &CacheKey) -> Result<(), Queued> {
        self.invalidate_keys(std::slice::from_ref(key)).await
    }

    /// Removes `keys` everywhere, like [`invalidate`](Self::invalidate), in one message.
    pub async fn invalidate_keys(&self, keys: &[CacheKey]) -> Result<(), Queued> {
        let hashes: Vec<KeyHash> = keys.iter().map(CacheKey::hash).collect();
        self.inner.apply(&Invalidation::Keys(hashes.clone()));
        self.invalidate_shared(Invalidation::Keys(hashes)).await
    }

    /// Removes every entry stored with `tag` (see [`Fill::tags`](crate::Fill::tags)
    /// and [`Policy::tags`](crate::Policy::tags)) from L1, the shared tier and
    /// every instance's L1.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Fill, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tiercache_core::Queued> {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60)).tag("products").build().unwrap();
    /// let key = CacheKey::new("product:7");
    /// cache.put(&key, Value::from_body("v"), &policy);
    /// cache.invalidate_tag("products").await?;
    /// assert!(cache.get(&key).await.is_none());
    /// # Ok(()) }
    /// ```
    pub async fn invalidate_tag(&self, tag: impl Into<Bytes>) -> Result<(), Queued> {
        self.invalidate_tag_and_keys(tag, &[]).await
    }

    /// Removes every entry stored with `tag` and `keys` too, everywhere, in
    /// one message (what [`invalidate_tag`](Self::invalidate_tag) and
    /// [`invalidate_keys`](Self::invalidate_keys) would do in two).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tiercache_core::Queued> {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let tagged = Policy::ttl(Duration::from_secs(60)).tag("t").build().unwrap();
    /// let plain = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    /// let (a, b) = (CacheKey::new("a"), CacheKey::new("b"));
    /// cache.put(&a, Value::from_body("v"), &tagged);
    /// cache.put(&b, Value::from_body("v"), &plain);
    /// cache.invalidate_tag_and_keys("t", &[b.clone()]).await?;
    /// assert!(cache.get(&a).await.is_none() && cache.get(&b).await.is_none());
    /// # Ok(()) }
    /// ```
    pub async fn invalidate_tag_and_keys(
        &self,
        tag: impl Into<Bytes>,
        keys: &[CacheKey],
    ) -> Result<(), Queued> {
        let tag = tag.into();
        let mut hashes: Vec<KeyHash> = keys.iter().map(CacheKey::hash).collect();
        hashes.extend(
            self.inner
                .journal
                .record(Scope::Tag(tag.clone(), hashes.clone()), || {
                    self.inner.drop_hashes(&hashes);
                    self.inner.drop_tag(&tag)
                }),
        );
        self.invalidate_shared(Invalidation::Tag(tag, hashes)).await
    }

    /// Removes every key `pattern` matches from L1, the shared tier and
    /// every instance's L1. L1 is scanned (O(entries)); the shared tier
    /// applies the pattern as it sees fit (the Valkey tier records a ban
    /// that its reads check).
    pub async fn invalidate_prefix(&self, pattern: KeyPattern) -> Result<(), Queued> {
        self.inner.apply(&Invalidation::Prefix(pattern.clone()));
        self.invalidate_shared(Invalidation::Prefix(pattern)).await
    }

    /// Sends `invalidation` to the shared tier through the outbox: its
    /// tombstone is in force at once, one attempt is made within the tier's
    /// bound, and if that fails the outbox retries it until it lands.
    ///
    /// The attempt runs in a task of its own: a caller that goes away
    /// meanwhile (a client that disconnected, a timeout around the call)
    /// leaves it to land or be queued, never half done in the outbox.
    async fn invalidate_shared(&self, invalidation: Invalidation) -> Result<(), Queued> {
        let Some(l2) = self.inner.l2.clone() else {
            return Ok(());
        };
        let (counters, outbox) = (self.inner.counters.clone(), self.inner.outbox.clone());
        let id = outbox.push(invalidation.clone(), self.now(), &counters);
        let attempt = {
            let outbox = outbox.clone();
            async move {
                if l2.invalidate(invalidation).await.is_ok() {
                    outbox.landed(id);
                    bump(&counters.invalidations_landed);
                    return true;
                }
                bump(&counters.l2_errors);
                bump(&counters.invalidations_queued);
                outbox.queued(id);
                outbox.drain_in_background(l2, counters);
                false
            }
        };
        if super::outliving_the_caller(attempt, false).await {
            return Ok(());
        }
        Err(Queued {
            pending: outbox.pending(),
        })
    }
}

impl InvalidationSink for Inner {
    fn apply(&self, invalidation: &Invalidation) {
        match invalidation {
            Invalidation::Keys(hashes) => self
                .journal
                .record(Scope::Keys(hashes.clone()), || self.drop_hashes(hashes)),
            Invalidation::Tag(tag, hashes) => {
                self.journal
                    .record(Scope::Tag(tag.clone(), hashes.clone()), || {
                        self.drop_tag(tag);
                        self.drop_hashes(hashes);
                    });
            }
            Invalidation::Prefix(pattern) => {
                self.journal.record(Scope::Prefix(pattern.clone()), || {
                    self.drop_matching(pattern)
                })
            }
        }
    }

    fn drop_banned(&self, bans: &[(crate::KeyPattern, std::time::SystemTime)]) {
        // Only the copies a ban covers, in one scan: not through the
        // journal, which would also refuse every load in flight under a
        // pattern (and a fold's pattern is every key).
        self.l1.remove_where(|e| {
            let created = e.times().created_at;
            bans.iter()
                .any(|(pattern, at)| created <= *at && pattern.matches_full(e.key()))
        });
    }

    fn drop_copies(&self, hashes: &[KeyHash]) {
        self.drop_hashes(hashes);
    }

    fn drop_fill(&self, hash: KeyHash, created: &[std::time::SystemTime]) {
        self.l1.remove_if(&hash, |live| {
            let at = live.created_ms();
            created.iter().any(|&c| crate::entry::millis(c) == at)
        });
    }

    fn unheard(&self) {
        let now = self.clock.now();
        // Under the journal's lock (an invalidation cannot land between an
        // entry's read and its rewrite), and recorded as missed messages
        // are: a fill in flight may be as outdated as what L1 holds.
        self.journal.record(Scope::All, || {
            for (hash, holding, entry) in self.l1.expire_all(now) {
                self.record_tags(hash, &holding, entry.tags());
            }
        });
        self.prune_tags_if_due();
    }

    fn deaf(&self, deaf: bool) {
        self.deaf.store(deaf, SeqCst);
        // Heard again: what waits for the tier goes now.
        if !deaf {
            self.outbox.nudge();
        }
    }

    fn resync(&self) {
        self.journal.record(Scope::All, || {
            self.l1.clear();
            self.tags.clear();
            self.tag_keys.store(0, Relaxed);
        });
        self.outbox.nudge();
    }
}

impl Inner {
    /// Drops the L1 entries recorded under `tag`; returns their keys. When
    /// the index cannot know them all (the tag overflowed it, or tags were
    /// evicted from it), all of L1 goes: a live key is never missed.
    fn drop_tag(&self, tag: &Bytes) -> Vec<KeyHash> {
        // Taken first, then the flag read: a prune that takes the tag's
        // overflowed mark sets the flag under the shard's lock, so either
        // the take finds the mark or this finds the flag.
        let (mut keys, overflowed) = self.tags.take(tag);
        let incomplete = self.tags_incomplete.swap(false, SeqCst);
        self.forget_tag_keys(keys.len());
        if incomplete || overflowed {
            self.l1.clear();
            self.tags.clear();
            self.tag_keys.store(0, Relaxed);
        } else {
            // Only entries that carry the tag: a key stored again under
            // other tags (its record here outlived the entry it was made
            // for) stays here, and is left out of the message (the shared
            // tier's own tag set, by key, may still name it: then it goes
            // there, and from every L1 with it, as an over-invalidation).
            keys.retain(|hash| !self.l1.invalidate_tagged(hash, tag));
            // moka hides an entry past its own expiry (or cleared) before
            // its housekeeping removes it, so no listener has moved its
            // shard yet: a thread's table may still answer one whose
            // record `invalidate_tagged` passed over as absent.
            self.l1.forget_thread_copies();
        }
        keys
    }

    pub(crate) fn drop_hashes(&self, hashes: &[KeyHash]) {
        hashes.iter().for_each(|h| self.l1.invalidate(h));
    }

    fn drop_matching(&self, pattern: &KeyPattern) {
        self.l1
            .remove_where(|entry| pattern.matches_full(entry.key()));
    }
}
