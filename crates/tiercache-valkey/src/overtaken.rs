//! Fills that an invalidation (another instance's, or this one's) overtook
//! on their way to Valkey.
//!
//! The engine's journal keeps a fill out of both tiers once an invalidation
//! covers it, but only up to the moment it is stored: the L2 write then
//! waits in the write queue and crosses the network. If instance B
//! invalidates a key meanwhile, B's `DEL` can land before A's `SET`, and
//! the old version would sit in L2 for the whole fleet until its `PX`. B's
//! message reaches A a moment later, so A settles it:
//!
//! - a fill still queued when the message arrives is never sent;
//! - a fill in flight then is deleted again once its pipeline is answered;
//! - a fill sent within the grace before the message arrives (its `SET`
//!   may have landed between B's `DEL` and B's message) is deleted again.
//!
//! A delete again is conditional: it removes the entry only while Valkey
//! still holds this fill's envelope (its times, length and checksum), so a
//! newer fill by anyone survives it, and it can be retried until it lands.
//! Keys, tags and prefixes are covered (a prefix's ban is no help here: it
//! compares the time an entry was stored, which for an overtaken fill is
//! after the ban); a resync (messages may have been missed) covers every
//! fill. (Memcache's leases solve the same race on the server.)
//!
//! This instance's own invalidations are heard here too, before their
//! delete goes out: a fill of the old version still queued behind a slow
//! pipeline (the delete's flush waits at most two command timeouts, and not
//! at all on a full queue) would otherwise land after the delete.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tiercache_core::{Invalidation, KeyHash, KeyPattern};
use tokio::sync::mpsc;

use crate::writer::{Command, Write};

mod sent;
#[cfg(test)]
use sent::SENT_BYTES;
use sent::SentLog;

/// Most invalidations remembered for the queued fills; a fill queued before
/// the oldest is held back (it only costs L2 a copy).
const HEARD_CAP: usize = 1024;

/// Most key hashes the remembered invalidations hold together (16 bytes
/// each: 16 MiB; a tag's page names thousands): past it the oldest go too
/// (the newest always stays).
const HEARD_HASHES: usize = 1 << 20;

/// What one invalidation heard (another instance's, or this one's) covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    /// These keys.
    Keys(Vec<KeyHash>),
    /// Entries stored with this tag (its set's Valkey key), and these keys.
    Tag(String, Vec<KeyHash>),
    /// Every key the pattern matches.
    Prefix(KeyPattern),
    /// Everything (a resync).
    Everything,
}

impl Scope {
    /// The key hashes it holds.
    fn hashes(&self) -> usize {
        match self {
            Scope::Keys(hashes) | Scope::Tag(_, hashes) => hashes.len(),
            Scope::Prefix(_) | Scope::Everything => 0,
        }
    }

    /// What `invalidation` covers, a tag named by its set's Valkey key
    /// under `prefix`; `None` for what names no key, tag or prefix.
    pub(crate) fn of(invalidation: &Invalidation, prefix: &str) -> Option<Self> {
        match invalidation {
            Invalidation::Keys(hashes) => Some(Scope::Keys(hashes.clone())),
            Invalidation::Tag(tag, hashes) => Some(Scope::Tag(
                crate::keys::tag_key_in(prefix, tag),
                hashes.clone(),
            )),
            Invalidation::Prefix(pattern) => Some(Scope::Prefix(pattern.clone())),
            _ => None,
        }
    }

    /// Whether it covers the fill of the full key `full` (hashed `hash`)
    /// stored with the tag sets `tags` (its hashes sorted: see `heard`).
    fn covers<'a>(
        &self,
        hash: &KeyHash,
        full: &[u8],
        mut tags: impl Iterator<Item = &'a [u8]>,
    ) -> bool {
        match self {
            Scope::Keys(hashes) => hashes.binary_search(hash).is_ok(),
            Scope::Tag(tag, hashes) => {
                tags.any(|t| t == tag.as_bytes()) || hashes.binary_search(hash).is_ok()
            }
            Scope::Prefix(pattern) => pattern.matches_full(full),
            Scope::Everything => true,
        }
    }
}

/// The first bytes of an envelope (magic, version, length and the six
/// times) and its last four (the payload's CRC-32): what tells one fill's
/// value from any other fill of the same key.
pub(crate) const STAMP_HEAD: usize = 56;
/// See [`STAMP_HEAD`].
pub(crate) const STAMP_TAIL: usize = 4;

/// An envelope's identity (see [`STAMP_HEAD`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) head: [u8; STAMP_HEAD],
    pub(crate) tail: [u8; STAMP_TAIL],
}

impl Stamp {
    /// The stamp of an encoded envelope (zeros where it is too short, which
    /// no envelope is).
    pub(crate) fn of(envelope: &[u8]) -> Self {
        let mut head = [0; STAMP_HEAD];
        let mut tail = [0; STAMP_TAIL];
        if envelope.len() >= STAMP_HEAD + STAMP_TAIL {
            head.copy_from_slice(&envelope[..STAMP_HEAD]);
            tail.copy_from_slice(&envelope[envelope.len() - STAMP_TAIL..]);
        }
        Self { head, tail }
    }
}

/// A fill as this module sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) hash: KeyHash,
    /// The full key (for prefixes).
    pub(crate) full: Bytes,
    /// The entry's Valkey key.
    pub(crate) key: String,
    /// Its tag sets' Valkey keys.
    pub(crate) tags: Vec<String>,
    pub(crate) stamp: Stamp,
}

/// A delete again: the entry's Valkey key and the stamp it must still hold.
pub(crate) type Undo = (String, Stamp, KeyHash);

#[derive(Default)]
struct State {
    /// The last invalidations heard, oldest first, each with its number.
    log: VecDeque<(u64, Scope)>,
    /// The key hashes `log` holds.
    hashes: usize,
    /// Fills sent lately, oldest first.
    sent: SentLog,
}

impl State {
    /// Whether an invalidation heard after number `since` covers the fill
    /// (or may have: the log no longer reaches back that far).
    fn overtaken_since(&self, since: u64, hash: &KeyHash, full: &[u8], tags: &[String]) -> bool {
        let forgotten = self
            .log
            .front()
            .is_some_and(|(first, _)| *first > since + 1);
        forgotten
            || self
                .log
                .iter()
                .rev()
                .take_while(|(n, _)| *n > since)
                .any(|(_, scope)| scope.covers(hash, full, tags.iter().map(|t| t.as_bytes())))
    }
}

/// The invalidations heard lately (other instances', and this one's own)
/// and the fills this one sent lately; see the module's doc.
pub(crate) struct Overtaken {
    /// How many invalidations have been heard: a fill notes it when queued,
    /// a pipeline when sent, and each checks what was heard after. Read
    /// without the lock (every fill does); written under it.
    heard: AtomicU64,
    state: Mutex<State>,
    /// How long after it was sent a fill can still be overtaken: a message
    /// trails the `SET` it overtook by its delivery, and a subscription
    /// that lags longer is found by the heartbeat and resynced.
    grace: Duration,
    /// Where deletes of fills that landed go (behind what is queued).
    writes: mpsc::Sender<Write>,
    /// The tier's key prefix, to name a remembered fill's entry again.
    prefix: String,
}

impl Overtaken {
    /// For the tier whose keys start with `prefix`.
    pub(crate) fn new(writes: mpsc::Sender<Write>, grace: Duration, prefix: String) -> Self {
        Self {
            heard: AtomicU64::new(0),
            state: Mutex::default(),
            grace,
            writes,
            prefix,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The number of the last invalidation heard, for a fill being queued.
    ///
    /// A fill is queued under the engine's journal lock, and an invalidation
    /// reaches this module only after the journal has it: a fill the journal
    /// let through was queued before, so it reads a number below the
    /// invalidation's.
    pub(crate) fn mark(&self) -> u64 {
        self.heard.load(SeqCst)
    }

    /// An instance (another, or this one about to send its delete)
    /// invalidated `scope`: fills still queued that it covers are never
    /// sent, and fills sent within the grace that it covers are deleted
    /// again (queued behind the writes before).
    pub(crate) fn heard(&self, scope: Scope, now: Instant) {
        let again = self.note(scope, now);
        self.delete_again(again);
    }

    /// [`heard`](Self::heard), the deletes again left to the caller: this
    /// instance's own invalidation queues them once its own delete has
    /// gone, so they take only what landed after it (before it, they
    /// took the fills the delete would have, and counted them overtaken).
    pub(crate) fn note(&self, mut scope: Scope, now: Instant) -> Vec<Undo> {
        // Sorted once, searched by every fill it is checked against (a big
        // tag's page names thousands of keys).
        if let Scope::Keys(hashes) | Scope::Tag(_, hashes) = &mut scope {
            hashes.sort_unstable();
        }
        let mut state = self.lock();
        let n = self.heard.fetch_add(1, SeqCst) + 1;
        state.sent.age(now, self.grace);
        // Taken out: each fill is deleted again once at most.
        let again = state
            .sent
            .take_covered(&scope, |hash| crate::keys::entry_key_in(&self.prefix, hash));
        state.hashes += scope.hashes();
        state.log.push_back((n, scope));
        while state.log.len() > HEARD_CAP || (state.hashes > HEARD_HASHES && state.log.len() > 1) {
            let Some((_, old)) = state.log.pop_front() else {
                break;
            };
            state.hashes -= old.hashes();
        }
        again
    }

    /// Queues a delete again of `again`, behind the writes queued before.
    pub(crate) fn delete_again(&self, again: Vec<Undo>) {
        if again.is_empty() {
            return;
        }
        let delete = Write::Command(Command::Delete(again));
        if let Err(mpsc::error::TrySendError::Full(delete)) = self.writes.try_send(delete) {
            // A full queue must not lose a delete: wait for room off the
            // subscriber's task (a late one is harmless: it is conditional).
            let writes = self.writes.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = writes.send(delete).await;
                });
            }
        }
    }

    /// The writer is about to send `fills`; `target` gives each one's mark
    /// when it was queued, its key's hash, full key and tag sets (`None`:
    /// not a fill). Those an invalidation heard since covers are taken out
    /// of `fills` and returned, never to be sent; the number returned is
    /// the mark the rest are sent under (see [`Self::sent`]).
    pub(crate) fn hold_back<T>(
        &self,
        fills: &mut Vec<T>,
        target: impl Fn(&T) -> Option<(u64, KeyHash, &[u8], &[String])>,
    ) -> (u64, Vec<T>) {
        let state = self.lock();
        let heard = self.heard.load(SeqCst);
        // Nothing heard since these fills were queued (the usual case): no
        // walk, no allocation.
        let last = state.log.back().map_or(0, |(n, _)| *n);
        if !fills
            .iter()
            .any(|f| target(f).is_some_and(|(since, ..)| since < last))
        {
            return (heard, Vec::new());
        }
        let mut held = Vec::new();
        let mut kept = Vec::with_capacity(fills.len());
        for fill in fills.drain(..) {
            match target(&fill) {
                Some((since, hash, full, tags))
                    if state.overtaken_since(since, &hash, full, tags) =>
                {
                    held.push(fill)
                }
                _ => kept.push(fill),
            }
        }
        *fills = kept;
        (heard, held)
    }

    /// Forgets the fills sent more than the grace before `now`, giving
    /// their memory back: the heartbeat's tick, so an idle instance keeps
    /// none (sends and invalidations heard age the log too).
    pub(crate) fn age(&self, now: Instant) {
        let mut state = self.lock();
        state.sent.age(now, self.grace);
        state.sent.shrink();
    }

    /// Fills sent under mark `since` have been answered (or timed out, and
    /// may land yet): those an invalidation heard while they were in flight
    /// covers are returned, to delete again; the rest are remembered for
    /// the grace.
    pub(crate) fn sent(&self, since: u64, fills: Vec<Target>, now: Instant) -> Vec<Undo> {
        let mut state = self.lock();
        // Aged here too: with no invalidation heard, nothing else would.
        state.sent.age(now, self.grace);
        let mut again = Vec::new();
        for fill in fills {
            if state.overtaken_since(since, &fill.hash, &fill.full, &fill.tags) {
                again.push((fill.key, fill.stamp, fill.hash));
                continue;
            }
            state.sent.push(now, fill);
        }
        again
    }
}

#[cfg(test)]
mod tests;
