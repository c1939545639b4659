//! The log of fills sent lately (see the parent module): each is deleted
//! again if an invalidation heard within the grace covers it.
//!
//! Each fill's full key and tag sets are copied into one buffer the log
//! owns, in the order the fills were sent, and the fill's own allocations
//! go (its entry key is made again from its hash when it is deleted again).
//! Held an allocation or two each (its entry key, its full key shared with
//! the entry), the last 4,096 fills of a flood kept ~2–3 MiB of a proxy's
//! pages resident past L1's budget: small blocks scattered among the pages
//! the connections churn, each page pinned by one.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tiercache_core::KeyHash;

use super::{Scope, Stamp, Target, Undo};

/// Most sent fills remembered, and most bytes they may hold (their records
/// and keys: a URL's length is the client's to choose); under a flood the
/// oldest are forgotten before the grace is up.
const SENT_CAP: usize = 4096;
pub(super) const SENT_BYTES: usize = 2 * 1024 * 1024;

/// A record's fixed part, counted against [`SENT_BYTES`] with its bytes.
const SLOT: usize = std::mem::size_of::<Sent>();

impl Target {
    /// Bytes the log holds for it: its record, its full key and tag sets.
    pub(super) fn size(&self) -> usize {
        SLOT + self.full.len() + self.tags.iter().map(|t| 4 + t.len()).sum::<usize>()
    }
}

/// One fill sent. Its full key and tag sets lie in the log's buffer from
/// `start`, in that order; each tag set as a little-endian `u32` length
/// and its name.
struct Sent {
    at: Instant,
    hash: KeyHash,
    stamp: Stamp,
    /// Where its bytes start: an offset into the bytes the log has held
    /// since they last started over (empty, or compacted); it wraps.
    start: usize,
    full_len: u32,
    tags_len: u32,
}

impl Sent {
    /// Its full key and tag sets, read from `bytes` (the log's buffer,
    /// whose first byte is at `base`).
    fn parts<'a>(&self, bytes: &'a [u8], base: usize) -> (&'a [u8], TagSets<'a>) {
        let at = self.start.wrapping_sub(base);
        let (full, rest) = bytes[at..].split_at(self.full_len as usize);
        (full, TagSets(&rest[..self.tags_len as usize]))
    }

    fn len(&self) -> usize {
        self.full_len as usize + self.tags_len as usize
    }
}

/// A record's tag sets, as they lie in the buffer.
struct TagSets<'a>(&'a [u8]);

impl<'a> Iterator for TagSets<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (len, rest) = self.0.split_first_chunk::<4>()?;
        let (tag, rest) = rest.split_at_checked(u32::from_le_bytes(*len) as usize)?;
        self.0 = rest;
        Some(tag)
    }
}

/// The fills sent within the grace, oldest first, within [`SENT_CAP`] and
/// [`SENT_BYTES`].
#[derive(Default)]
pub(super) struct SentLog {
    fills: VecDeque<Sent>,
    /// The fills' bytes, and gaps: before the oldest fill's (dropped once
    /// they are a quarter of it) and those of fills taken out (dropped once
    /// they pass what the fills use and 64 KiB).
    bytes: Vec<u8>,
    /// The offset of `bytes[0]` (see [`Sent::start`]; offsets wrap).
    base: usize,
    /// The bytes of the fills in the log.
    live: usize,
}

impl SentLog {
    /// Fills remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.fills.len()
    }

    /// Bytes held against [`SENT_BYTES`]: the records and their bytes.
    pub(super) fn held(&self) -> usize {
        self.fills.len() * SLOT + self.live
    }

    /// Records it has room for.
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        self.fills.capacity()
    }

    /// The memory it keeps: slots and buffer, used or not.
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.fills.capacity() * SLOT + self.bytes.capacity()
    }

    pub(super) fn push(&mut self, at: Instant, fill: Target) {
        let size = fill.size();
        // Alone past the bound: never kept (it would push out every other).
        if size > SENT_BYTES {
            return;
        }
        // Room first: a deque pushed past its capacity doubles it.
        while self.fills.len() >= SENT_CAP || self.held() + size > SENT_BYTES {
            self.pop_front();
        }
        self.drop_front();
        let start = self.base.wrapping_add(self.bytes.len());
        let need = size - SLOT;
        if self.bytes.capacity() - self.bytes.len() < need {
            // Grown by a quarter, not doubled: amortised all the same.
            self.bytes
                .reserve_exact(need.max(self.bytes.len() / 4).max(4096));
        }
        self.bytes.extend_from_slice(&fill.full);
        for tag in &fill.tags {
            // Within SENT_BYTES, so within u32.
            self.bytes
                .extend_from_slice(&(tag.len() as u32).to_le_bytes());
            self.bytes.extend_from_slice(tag.as_bytes());
        }
        self.live += need;
        self.fills.push_back(Sent {
            at,
            hash: fill.hash,
            stamp: fill.stamp,
            start,
            full_len: fill.full.len() as u32,
            tags_len: (need - fill.full.len()) as u32,
        });
    }

    /// Forgets the fills sent more than `grace` before `now`.
    pub(super) fn age(&mut self, now: Instant, grace: Duration) {
        while self
            .fills
            .front()
            .is_some_and(|f| now.saturating_duration_since(f.at) > grace)
        {
            self.pop_front();
        }
        self.tidy();
    }

    /// Gives back room it no longer needs: all of it when it holds no fill
    /// (an idle instance keeps none); else slots past four times the fills
    /// and 64 (to a power of two, as a deque grows, within the cap) and
    /// buffer past twice its bytes and 64 KiB. On the heartbeat's tick, not
    /// on every change: a log emptied (or nearly) under a flood, by a
    /// resync or a hot tag, would give its room back and grow it again
    /// under the lock the writer shares.
    pub(super) fn shrink(&mut self) {
        if self.fills.is_empty() {
            *self = Self::default();
            return;
        }
        if self.fills.capacity() > 4 * self.fills.len() + 64 {
            let room = (2 * self.fills.len()).next_power_of_two().min(SENT_CAP);
            self.fills.shrink_to(room);
        }
        let len = self.bytes.len();
        if self.bytes.capacity() > 2 * len + 64 * 1024 {
            self.bytes.shrink_to(len + len / 4);
        }
    }

    /// Takes out the fills `scope` covers, each with its entry key (made
    /// by `entry_key` from its hash).
    pub(super) fn take_covered(
        &mut self,
        scope: &Scope,
        entry_key: impl Fn(&KeyHash) -> String,
    ) -> Vec<Undo> {
        let mut taken = Vec::new();
        let mut freed = 0;
        let (bytes, base) = (&self.bytes, self.base);
        self.fills.retain(|fill| {
            let (full, tags) = fill.parts(bytes, base);
            let hit = scope.covers(&fill.hash, full, tags);
            if hit {
                freed += fill.len();
                taken.push((entry_key(&fill.hash), fill.stamp.clone(), fill.hash));
            }
            !hit
        });
        self.live -= freed;
        self.tidy();
        taken
    }

    fn pop_front(&mut self) {
        if let Some(fill) = self.fills.pop_front() {
            self.live -= fill.len();
        }
    }

    /// Drops the buffer's bytes before the oldest fill's once they are a
    /// quarter of it (each byte is moved at most three times on average).
    fn drop_front(&mut self) {
        let Some(front) = self.fills.front() else {
            self.bytes.clear();
            self.base = 0;
            return;
        };
        let dead = front.start.wrapping_sub(self.base);
        if dead > 0 && dead >= self.bytes.len() / 4 {
            self.bytes.drain(..dead);
            self.base = front.start;
        }
    }

    /// Drops the bytes of fills gone: after the newest fill's, before the
    /// oldest's (see [`drop_front`](Self::drop_front)), and the gaps of
    /// fills taken out once they pass what the fills use and 64 KiB.
    fn tidy(&mut self) {
        // Bytes past the newest fill's are of fills taken out.
        if let Some(back) = self.fills.back() {
            let used = back.start.wrapping_sub(self.base) + back.len();
            self.bytes.truncate(used);
        }
        self.drop_front();
        if self.bytes.len() > 2 * self.live + 64 * 1024 {
            self.compact();
        }
    }

    /// Copies the fills' bytes into a buffer of their own, without the
    /// gaps fills taken out left.
    fn compact(&mut self) {
        let mut bytes = Vec::with_capacity(self.live + self.live / 4);
        for fill in &mut self.fills {
            let at = fill.start.wrapping_sub(self.base);
            fill.start = bytes.len();
            bytes.extend_from_slice(&self.bytes[at..at + fill.len()]);
        }
        self.bytes = bytes;
        self.base = 0;
    }
}
