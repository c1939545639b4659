//! Invalidation in Valkey: deletes, tag sets, prefix bans, and the
//! message that tells the other instances.

use std::time::SystemTime;

use fred::prelude::{HashesInterface, KeysInterface, PubsubInterface, SetsInterface, Value};
use tiercache_core::{Invalidation, KeyHash, TierError};

use crate::bans::{BAN_RETENTION, bans_key};
use crate::bus::{self, Ban};
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
        let text = bus::encode(&bus::Message {
            from: self.inner.bus.instance.clone(),
            invalidation,
            at,
        });
        let pipe = self.inner.client.pipeline();
        for key in keys {
            let queued: Result<(), _> = pipe.del(key).await;
            queued.map_err(fred_error)?;
        }
        let queued: Result<(), _> = pipe.publish(&self.inner.bus.channel, text).await;
        queued.map_err(fred_error)?;
        let _: Value = pipe.all().await.map_err(fred_error)?;
        Ok(())
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

    pub(crate) async fn apply_invalidation(
        &self,
        invalidation: Invalidation,
    ) -> Result<(), TierError> {
        self.flush().await;
        match invalidation {
            Invalidation::Keys(hashes) => {
                let keys = hashes.iter().map(|h| self.entry_key_of(h)).collect();
                self.delete_and_publish(keys, Invalidation::Keys(hashes), None)
                    .await
            }
            Invalidation::Tag(tag, mut hashes) => {
                let set = self.tag_key(&tag);
                let members: Vec<String> =
                    self.inner.client.smembers(&set).await.map_err(fred_error)?;
                hashes.extend(members.iter().filter_map(|m| KeyHash::from_hex(m)));
                hashes.sort_unstable();
                hashes.dedup();
                // This instance's L1 too: it may hold copies promoted from L2,
                // which its own tag index never saw.
                if let Some(sink) = self.inner.bus.sink() {
                    sink.apply(&Invalidation::Keys(hashes.clone()));
                }
                let mut keys: Vec<String> = hashes.iter().map(|h| self.entry_key_of(h)).collect();
                keys.push(set);
                self.delete_and_publish(keys, Invalidation::Tag(tag, hashes), None)
                    .await
            }
            Invalidation::Prefix(pattern) => {
                let at = SystemTime::now();
                let field = bus::hex(&pattern.to_bytes());
                let recorded: Result<i64, _> = self
                    .inner
                    .client
                    .hset(
                        bans_key(&self.inner.prefix),
                        (field, bus::millis(at).to_string()),
                    )
                    .await;
                recorded.map_err(fred_error)?;
                let ttl = BAN_RETENTION.as_millis() as i64;
                let kept: Result<i64, _> = self
                    .inner
                    .client
                    .pexpire(bans_key(&self.inner.prefix), ttl, None)
                    .await;
                kept.map_err(fred_error)?;
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
