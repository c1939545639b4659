//! The outbox: invalidations on their way to the shared tier, never lost.
//!
//! Every invalidation that must reach the shared tier (its deletes, the tag
//! set, the bus message) is put here first, with the time it was made: a
//! local tombstone. Until it has landed, this instance does not answer from
//! an L2 copy it covers that was created before it. It is tried at once,
//! within the tier's bound; when that fails it stays queued, and one task
//! retries the queue with backoff (50 ms, doubling, 2 s at most) until each
//! lands, at once when the tier is heard again (a reconnection, the end of
//! a pause: see [`Outbox::nudge`]). The queue is bounded: past [`Outbox::CAP`] the oldest half is
//! merged into one broader invalidation (every key, as of the newest one
//! merged: a ban of all that L2 held before it), never dropped; so are all
//! but the newest past [`Outbox::MAX_HASHES`] key hashes held (a tag's
//! invalidation names up to 100,000 keys).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use crate::stats::{Counters, bump};
use bytes::Bytes;

use crate::{CacheKey, Invalidation, KeyPattern, Tier};

/// An invalidation that reached this instance's L1 but not yet the shared
/// tier (unreachable or too slow within its bound). It is queued and
/// retried until it lands; meanwhile this instance does not answer from the
/// L2 copies it covers, and other instances that missed it drop their L1 when
/// their message stream reconnects.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Queued {
    /// Invalidations waiting for the shared tier, this one included.
    pub pending: usize,
}

impl fmt::Display for Queued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalidated in this instance; the shared tier could not be reached, so the \
             invalidation is queued ({} pending) and retried until it lands",
            self.pending
        )
    }
}

impl std::error::Error for Queued {}

#[derive(Debug)]
struct Pending {
    id: u64,
    invalidation: Invalidation,
    /// When it was made (the engine's clock): L2 copies created before it are refused.
    at: SystemTime,
    /// A tag invalidation that missed its first attempt: it covers every
    /// older copy (see [`Pending::covers`]).
    queued: bool,
}

impl Pending {
    fn covers(&self, key: &CacheKey, created_at: SystemTime, tags: &[Bytes]) -> bool {
        if created_at >= self.at {
            return false;
        }
        match &self.invalidation {
            Invalidation::Keys(hashes) => hashes.contains(&key.hash()),
            // A copy carries its tags (an envelope of the build before
            // carries none), and the hashes are only the members this
            // instance's own index held: a copy under the tag, or a known
            // member, is refused at once; once the invalidation is queued,
            // every older copy is, until it lands. (During its first
            // attempt, every write invalidates its URL's family tag: not
            // every copy then.)
            Invalidation::Tag(tag, hashes) => {
                self.queued || tags.contains(tag) || hashes.contains(&key.hash())
            }
            Invalidation::Prefix(pattern) => pattern.matches(key),
        }
    }
}

impl Pending {
    /// What it holds, in key hashes (16 bytes): its hashes, and its tag's
    /// or pattern's bytes (as the journal weighs them).
    fn hashes(&self) -> usize {
        match &self.invalidation {
            Invalidation::Keys(hashes) => hashes.len(),
            Invalidation::Tag(tag, hashes) => hashes.len() + crate::key::in_hashes(tag.len()),
            Invalidation::Prefix(pattern) => pattern.in_hashes(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    items: VecDeque<Pending>,
    /// The key hashes the items hold.
    hashes: usize,
    draining: bool,
}

impl State {
    /// Merges the oldest `n` items into one invalidation of every key as
    /// of the newest of them (never dropped: broader).
    fn merge_oldest(&mut self, n: usize, counters: &Counters) {
        let merged: Vec<Pending> = self.items.drain(..n).collect();
        let Some(newest) = merged.iter().map(|p| p.at).max() else {
            return;
        };
        self.hashes -= merged.iter().map(Pending::hashes).sum::<usize>();
        counters
            .invalidations_merged
            .fetch_add(merged.len() as u64, Relaxed);
        let everything = Pending {
            id: self.next_id,
            invalidation: Invalidation::Prefix(KeyPattern::new()),
            at: newest,
            queued: true,
        };
        self.next_id += 1;
        self.items.push_front(everything);
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    state: Mutex<State>,
    /// Items in the queue (a lock-free check for the L2 read path).
    len: AtomicUsize,
    /// Ends the retry task's backoff (see [`Outbox::nudge`]).
    wake: Arc<tokio::sync::Notify>,
}

impl Outbox {
    /// Most invalidations kept; past it the oldest half is merged into one.
    pub(crate) const CAP: usize = 10_000;

    /// Most key hashes the items hold together (16 bytes each: 16 MiB):
    /// past it all but the newest item are merged into one.
    pub(crate) const MAX_HASHES: usize = 1 << 20;

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts `invalidation` in the queue (its tombstone is in force from
    /// now); returns its id.
    pub(crate) fn push(
        &self,
        invalidation: Invalidation,
        at: SystemTime,
        counters: &Counters,
    ) -> u64 {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        let item = Pending {
            id,
            invalidation,
            at,
            queued: false,
        };
        state.hashes += item.hashes();
        state.items.push_back(item);
        if state.items.len() > Self::CAP {
            state.merge_oldest(Self::CAP / 2, counters);
        }
        if state.hashes > Self::MAX_HASHES && state.items.len() > 1 {
            let all_but_newest = state.items.len() - 1;
            state.merge_oldest(all_but_newest, counters);
        }
        self.len.store(state.items.len(), Relaxed);
        id
    }

    /// Removes item `id` (it landed).
    /// The first attempt of `id` failed: it is queued for retries.
    pub(crate) fn queued(&self, id: u64) {
        if let Some(item) = self.lock().items.iter_mut().find(|p| p.id == id) {
            item.queued = true;
        }
    }

    pub(crate) fn landed(&self, id: u64) {
        let mut state = self.lock();
        if let Some(at) = state.items.iter().position(|p| p.id == id)
            && let Some(item) = state.items.remove(at)
        {
            state.hashes -= item.hashes();
        }
        self.len.store(state.items.len(), Relaxed);
    }

    /// The tier is heard again: the retry task tries the queue now, not at
    /// the end of its backoff (up to 2 s, while the other instances, their
    /// L1 dropped on the same reconnection, read what it has not deleted
    /// yet: a black-box audit saw a pre-write copy answered by two
    /// instances 0.5–1.6 s after a 3–6 s pause).
    pub(crate) fn nudge(&self) {
        if self.len.load(Relaxed) > 0 {
            self.wake.notify_one();
        }
    }

    /// Invalidations waiting for the shared tier.
    pub(crate) fn pending(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Whether a pending invalidation covers an L2 copy of `key` created at
    /// `created_at` under `tags` (it must not answer).
    pub(crate) fn covers(&self, key: &CacheKey, created_at: SystemTime, tags: &[Bytes]) -> bool {
        if self.len.load(Relaxed) == 0 {
            return false;
        }
        self.lock()
            .items
            .iter()
            .any(|p| p.covers(key, created_at, tags))
    }

    /// Starts the task that retries the queue, unless one runs.
    pub(crate) fn drain_in_background(
        self: &Arc<Self>,
        tier: Arc<dyn Tier>,
        counters: Arc<Counters>,
    ) {
        {
            let mut state = self.lock();
            if state.draining || state.items.is_empty() {
                return;
            }
            state.draining = true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.lock().draining = false;
            return;
        };
        let wake = self.wake.clone();
        runtime.spawn(drain(Arc::downgrade(self), wake, tier, counters));
    }

    /// The oldest pending invalidation, to retry.
    fn oldest(&self) -> Option<(u64, Invalidation)> {
        self.lock()
            .items
            .front()
            .map(|p| (p.id, p.invalidation.clone()))
    }
}

/// Retries the queue, oldest first, until it is empty; a backoff ends
/// early when `wake` is notified.
async fn drain(
    outbox: Weak<Outbox>,
    wake: Arc<tokio::sync::Notify>,
    tier: Arc<dyn Tier>,
    counters: Arc<Counters>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(live) = outbox.upgrade() else {
            return;
        };
        let Some((id, invalidation)) = live.oldest() else {
            let mut state = live.lock();
            if state.items.is_empty() {
                state.draining = false;
                return;
            }
            // Pushed between the look and the lock: go on.
            continue;
        };
        drop(live);
        bump(&counters.invalidations_retried);
        let landed = tier.invalidate(invalidation).await.is_ok();
        let Some(live) = outbox.upgrade() else {
            return;
        };
        if landed {
            live.landed(id);
            bump(&counters.invalidations_landed);
            backoff = Duration::from_millis(50);
        } else {
            drop(live);
            tokio::select! {
                () = tokio::time::sleep(backoff) => {
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                () = wake.notified() => backoff = Duration::from_millis(50),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tombstone_covers_older_copies_of_its_keys_only() {
        let outbox = Outbox::default();
        let counters = Counters::default();
        let now = SystemTime::now();
        let (a, b) = (CacheKey::new("a"), CacheKey::new("b"));
        outbox.push(Invalidation::Keys(vec![a.hash()]), now, &counters);
        let before = now - Duration::from_secs(1);
        assert!(outbox.covers(&a, before, &[]));
        assert!(
            !outbox.covers(&a, now + Duration::from_secs(1), &[]),
            "a newer fill"
        );
        assert!(!outbox.covers(&b, before, &[]));
    }

    /// A tag invalidation names only the members this instance's index
    /// held. While its first attempt runs (every write invalidates its
    /// URL's family tag), only those are refused, or each write would keep
    /// this instance off L2; once queued, every older copy is.
    #[test]
    fn a_tag_tombstone_covers_every_older_copy_once_queued() {
        let outbox = Outbox::default();
        let counters = Counters::default();
        let now = SystemTime::now();
        let (known, elsewhere) = (CacheKey::new("known"), CacheKey::new("stored elsewhere"));
        let id = outbox.push(
            Invalidation::Tag("family".into(), vec![known.hash()]),
            now,
            &counters,
        );
        let before = now - Duration::from_secs(1);
        assert!(outbox.covers(&known, before, &[]));
        assert!(
            !outbox.covers(&elsewhere, before, &[]),
            "during its first attempt"
        );
        // A copy that came with the tag is refused at once (one promoted
        // while the first attempt runs, say), and only an older one.
        let family = [Bytes::from_static(b"family")];
        assert!(outbox.covers(&elsewhere, before, &family));
        assert!(!outbox.covers(&elsewhere, now + Duration::from_secs(1), &family));
        assert!(!outbox.covers(&elsewhere, before, &[Bytes::from_static(b"other")]));
        outbox.queued(id);
        assert!(outbox.covers(&elsewhere, before, &[]), "once queued");
        assert!(!outbox.covers(&elsewhere, now + Duration::from_secs(1), &[]));
    }

    /// Tag invalidations name up to 100,000 keys each: past the hash bound
    /// the older ones are merged into one invalidation of everything.
    #[test]
    fn the_outbox_holds_a_bounded_number_of_hashes() {
        let outbox = Outbox::default();
        let counters = Counters::default();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let big = || {
            let hashes = vec![CacheKey::new("k").hash(); Outbox::MAX_HASHES / 2 + 1];
            Invalidation::Tag(Bytes::from_static(b"t"), hashes)
        };
        outbox.push(big(), at, &counters);
        outbox.push(big(), at, &counters);
        let state = outbox.lock();
        assert!(state.hashes <= Outbox::MAX_HASHES, "{}", state.hashes);
        assert!(matches!(
            state.items.front().map(|p| &p.invalidation),
            Some(Invalidation::Prefix(_))
        ));
    }

    /// A prefix or a tag is as long as its caller makes it: queued while
    /// Valkey is away, 60 KB ones weigh their bytes against the same bound.
    #[test]
    fn long_prefixes_and_tags_weigh_their_bytes_in_the_outbox() {
        let outbox = Outbox::default();
        let counters = Counters::default();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let long = vec![b'p'; 60_000];
        for i in 0..600 {
            let invalidation = if i % 2 == 0 {
                Invalidation::Prefix(crate::KeyPattern::new().prefix(&long))
            } else {
                Invalidation::Tag(Bytes::from(long.clone()), Vec::new())
            };
            outbox.push(invalidation, at, &counters);
        }
        let state = outbox.lock();
        let held: usize = state
            .items
            .iter()
            .map(|p| match &p.invalidation {
                Invalidation::Tag(tag, _) => tag.len(),
                Invalidation::Prefix(pattern) => pattern.byte_len(),
                Invalidation::Keys(_) => 0,
            })
            .sum();
        assert!(
            held <= Outbox::MAX_HASHES * 16 + long.len(),
            "{held} bytes held"
        );
    }

    #[test]
    fn a_full_outbox_merges_its_oldest_into_one_invalidation_of_everything() {
        let outbox = Outbox::default();
        let counters = Counters::default();
        let t0 = SystemTime::now();
        for i in 0..=Outbox::CAP as u32 {
            let key = CacheKey::new(i.to_le_bytes());
            outbox.push(
                Invalidation::Keys(vec![key.hash()]),
                t0 + Duration::from_millis(i as u64),
                &counters,
            );
        }
        assert_eq!(outbox.pending(), Outbox::CAP / 2 + 2);
        assert_eq!(
            counters.invalidations_merged.load(Relaxed),
            (Outbox::CAP / 2) as u64
        );
        // Nothing was lost: a key of a merged invalidation is still covered.
        let merged = CacheKey::new(7u32.to_le_bytes());
        assert!(outbox.covers(&merged, t0, &[]));
        assert!(outbox.covers(&CacheKey::new("never named"), t0, &[]));
    }
}
