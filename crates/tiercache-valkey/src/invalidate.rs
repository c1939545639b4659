//! Invalidation in Valkey: deletes, tag sets, prefix bans, and the
//! message that tells the other instances.

use std::time::{Instant, SystemTime};

use bytes::Bytes;
use fred::prelude::{
    HashesInterface, KeysInterface, LuaInterface, PubsubInterface, SetsInterface,
    SortedSetsInterface, Value,
};
use tiercache_core::{Invalidation, KeyHash, TierError};

use crate::bans::{BAN_RETENTION, BANS_SCRIPT, bans_key, bans_script_args, take_oldest};
use crate::bus::{self, Ban};
use crate::overtaken::Scope;
use crate::tier::{ValkeyTier, fred_error};
use crate::writer::Write;

impl ValkeyTier {
    /// Deletes `keys` and announces `invalidation`, in one pipeline (one
    /// key per `DEL`: in a cluster the entries live on many slots).
    async fn delete_and_publish(
        &self,
        keys: Vec<String>,
        invalidation: Invalidation,
        at: Option<SystemTime>,
    ) -> Result<(), TierError> {
        let text = self.message(invalidation, at);
        let pipe = self.inner.client().pipeline();
        for key in keys {
            let queued: Result<(), _> = pipe.unlink(key).await;
            queued.map_err(fred_error)?;
        }
        let queued: Result<(), _> = pipe.publish(&self.inner.bus.channel, text).await;
        queued.map_err(fred_error)?;
        let _: Value = pipe.all().await.map_err(fred_error)?;
        Ok(())
    }

    fn message(&self, invalidation: Invalidation, at: Option<SystemTime>) -> String {
        bus::encode(&bus::Message {
            from: self.inner.bus.instance.clone(),
            invalidation,
            at,
        })
    }

    /// Waits (at most two command timeouts) until the writes queued so far
    /// are done: before a delete, so an earlier fill's `SET` cannot land
    /// after it, and before a graceful shutdown.
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.inner.writes.try_send(Write::Flush(tx)).is_ok() {
            let _ = tokio::time::timeout(self.inner.command_timeout * 2, rx).await;
        }
    }

    /// Invalidates a tag page by page: each page of its members (oldest
    /// first) is unlinked, removed from the tag's set and announced, so a
    /// tag of any size makes progress within the tier's time bound, and a
    /// retry goes on where the last attempt stopped. Then the tag itself
    /// goes, with a message naming it (other instances drop what their own
    /// tag index holds).
    async fn invalidate_tag(&self, tag: Bytes, mut hashes: Vec<KeyHash>) -> Result<(), TierError> {
        const PAGE: i64 = 500;
        let set = self.tag_key(&tag);
        // The previous version's plain set, read once during an upgrade.
        let legacy = self.legacy_tag_key(&tag);
        let pipe = self.inner.client().pipeline();
        let queued: Result<(), _> = pipe.smembers(&legacy).await;
        queued.map_err(fred_error)?;
        let queued: Result<(), _> = pipe
            .zrange(&set, 0, PAGE - 1, None, false, None, false)
            .await;
        queued.map_err(fred_error)?;
        let (old, mut members): (Vec<String>, Vec<String>) =
            pipe.all().await.map_err(fred_error)?;
        hashes.extend(old.iter().filter_map(|m| KeyHash::from_hex(m)));
        // A tag larger than a page goes page by page; the last (or only)
        // page goes out with the tag itself, in one round trip.
        while members.len() as i64 == PAGE {
            let page: Vec<KeyHash> = members
                .iter()
                .filter_map(|m| KeyHash::from_hex(m))
                .collect();
            // This instance's L1 too: a copy it promoted is in its tag
            // index only if it came with its tags (not from a version 2
            // envelope) and the tag did not overflow the index.
            if let Some(sink) = self.inner.bus.sink() {
                sink.apply(&Invalidation::Keys(page.clone()));
            }
            let text = self.message(Invalidation::Keys(page.clone()), None);
            let pipe = self.inner.client().pipeline();
            for hash in &page {
                let queued: Result<(), _> = pipe.unlink(self.entry_key_of(hash)).await;
                queued.map_err(fred_error)?;
            }
            let queued: Result<(), _> = pipe.zrem(&set, members).await;
            queued.map_err(fred_error)?;
            let queued: Result<(), _> = pipe.publish(&self.inner.bus.channel, text).await;
            queued.map_err(fred_error)?;
            let queued: Result<(), _> = pipe
                .zrange(&set, 0, PAGE - 1, None, false, None, false)
                .await;
            queued.map_err(fred_error)?;
            let mut replies: Vec<Value> = pipe.all().await.map_err(fred_error)?;
            members = replies
                .pop()
                .and_then(|v| v.into_array().into_iter().map(|m| m.as_string()).collect())
                .unwrap_or_default();
        }
        hashes.extend(members.iter().filter_map(|m| KeyHash::from_hex(m)));
        hashes.sort_unstable();
        hashes.dedup();
        if let Some(sink) = self.inner.bus.sink() {
            sink.apply(&Invalidation::Keys(hashes.clone()));
        }
        let mut keys: Vec<String> = hashes.iter().map(|h| self.entry_key_of(h)).collect();
        keys.push(set);
        keys.push(legacy);
        self.delete_and_publish(keys, Invalidation::Tag(tag, hashes), None)
            .await
    }

    /// Runs [`BANS_SCRIPT`] on this prefix's bans hash.
    async fn change_bans(
        &self,
        raise: Option<(String, u64)>,
        upto: u64,
        drop: Vec<String>,
    ) -> Result<(), TierError> {
        let args = bans_script_args(raise, upto, drop);
        let done: Result<i64, _> = self
            .inner
            .client()
            .eval(BANS_SCRIPT, vec![bans_key(&self.inner.prefix)], args)
            .await;
        done.map(|_| ()).map_err(fred_error)
    }

    /// Drops the recorded bans older than [`BAN_RETENTION`] (the hash is
    /// renewed with every ban, so without this it would only grow), and
    /// folds the oldest into the ban of every key past
    /// [`ValkeyConfig::max_prefix_bans`](crate::ValkeyConfig::max_prefix_bans).
    /// Each change leaves a ban recorded again meanwhile, later, in place.
    async fn prune_bans(&self, now: SystemTime) -> Result<(), TierError> {
        let key = bans_key(&self.inner.prefix);
        let fields: std::collections::HashMap<String, String> = self
            .inner
            .client()
            .hgetall(&key)
            .await
            .map_err(fred_error)?;
        let cutoff = bus::millis(now).saturating_sub(BAN_RETENTION.as_millis() as u64);
        let (mut held, lapsed): (Vec<_>, Vec<_>) = fields
            .into_iter()
            .map(|(field, at)| (field, at.parse::<u64>().unwrap_or(0)))
            .partition(|(_, at)| *at >= cutoff);
        if !lapsed.is_empty() {
            let lapsed = lapsed.into_iter().map(|(field, _)| field).collect();
            self.change_bans(None, cutoff.saturating_sub(1), lapsed)
                .await?;
        }
        let everything = bus::hex(&tiercache_core::KeyPattern::new().to_bytes());
        held.retain(|(field, _)| *field != everything);
        // The field of every key is not counted: the bound is on the others.
        if let Some((at, oldest)) =
            take_oldest(&mut held, self.inner.max_prefix_bans - 1, |(_, at)| *at)
        {
            let oldest = oldest.into_iter().map(|(field, _)| field).collect();
            self.change_bans(Some((everything, at)), at, oldest).await?;
        }
        Ok(())
    }

    pub(crate) async fn apply_invalidation(
        &self,
        invalidation: Invalidation,
    ) -> Result<(), TierError> {
        // This instance's own fills of what it invalidates, still queued
        // (or just sent), must not land after the delete: the flush waits
        // on them, but not on a full queue nor past its bound. Those sent
        // lately are deleted again once the delete has gone, in case one
        // (a pipeline that timed out) lands after it.
        // Queued when this ends, also when its caller gives up on it (the
        // fills were taken out of the log: nobody else would).
        let _again = DeleteAgainOnDrop {
            overtaken: &self.inner.overtaken,
            undo: Scope::of(&invalidation, &self.inner.prefix)
                .map(|scope| self.inner.overtaken.note(scope, Instant::now()))
                .unwrap_or_default(),
        };
        self.flush().await;
        self.send_invalidation(invalidation).await
    }

    /// Sends `invalidation` to Valkey: its deletes, and its message.
    async fn send_invalidation(&self, invalidation: Invalidation) -> Result<(), TierError> {
        match invalidation {
            Invalidation::Keys(hashes) => {
                let keys = hashes.iter().map(|h| self.entry_key_of(h)).collect();
                self.delete_and_publish(keys, Invalidation::Keys(hashes), None)
                    .await
            }
            Invalidation::Tag(tag, hashes) => self.invalidate_tag(tag, hashes).await,
            Invalidation::Prefix(pattern) => {
                let at = SystemTime::now();
                let field = bus::hex(&pattern.to_bytes());
                self.change_bans(Some((field, bus::millis(at))), 0, Vec::new())
                    .await?;
                let ttl = BAN_RETENTION.as_millis() as i64;
                let kept: Result<i64, _> = self
                    .inner
                    .client()
                    .pexpire(bans_key(&self.inner.prefix), ttl, None)
                    .await;
                kept.map_err(fred_error)?;
                self.prune_bans(at).await?;
                self.inner.bus.add_ban(
                    Ban {
                        pattern: pattern.clone(),
                        at,
                    },
                    BAN_RETENTION,
                );
                self.delete_and_publish(Vec::new(), Invalidation::Prefix(pattern), Some(at))
                    .await
            }
            other => self.delete_and_publish(Vec::new(), other, None).await,
        }
    }
}

/// Fills an own invalidation took out of the sent log, deleted again
/// once it ends, however it ends.
struct DeleteAgainOnDrop<'a> {
    overtaken: &'a crate::overtaken::Overtaken,
    undo: Vec<crate::overtaken::Undo>,
}

impl Drop for DeleteAgainOnDrop<'_> {
    fn drop(&mut self) {
        self.overtaken.delete_again(std::mem::take(&mut self.undo));
    }
}
