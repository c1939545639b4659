//! What goes into the write queue and its byte bound: fills' copies, and
//! the answers lock releases share (see [`crate::writer`] for what drains it).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use tiercache_core::{CacheKey, Entry};

use crate::codec;
use crate::guard::Guard;
use crate::tier::{Inner, ValkeyTier};
use crate::writer::{Command, Write};

impl ValkeyTier {
    /// Queues a fill (see [`Tier::put`]); with a `guard`, stored only
    /// under its condition (see [`Tier::put_over`],
    /// [`Tier::put_unless_newer`]).
    pub(crate) fn queue_fill(
        &self,
        key: &CacheKey,
        entry: &Entry,
        ttl: Duration,
        tags: &[Bytes],
        guard: Option<Guard>,
    ) {
        let px = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        // Measured first: a write the queue has no room for is not made.
        let envelope = codec::Measured::of(entry);
        let size = envelope.len();
        if !self.inner.hold_queued(size) {
            self.inner.write_drops.fetch_add(1, Relaxed);
            return;
        }
        let value = envelope.encode_after(&[]);
        debug_assert_eq!(value.len(), size);
        let write = Write::Command(Command::Set {
            key: self.entry_key(key),
            value,
            px,
            tags: tags.iter().map(|t| self.tag_key(t)).collect(),
            hash: key.hash(),
            full: key.full().clone(),
            heard: self.inner.overtaken.mark(),
            guard,
        });
        if self.inner.writes.try_send(write).is_err() {
            self.inner.queued_bytes.fetch_sub(size, Relaxed);
            self.inner.write_drops.fetch_add(1, Relaxed);
        }
    }
}

impl Inner {
    /// Holds `size` more bytes in the write queue, unless that passes its
    /// bound while it holds any (so one write of any size goes through).
    pub(crate) fn hold_queued(&self, size: usize) -> bool {
        let before = self.queued_bytes.fetch_add(size, Relaxed);
        if before > 0 && before + size > self.queue_bytes_bound {
            self.queued_bytes.fetch_sub(size, Relaxed);
            return false;
        }
        true
    }
}
