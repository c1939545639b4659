//! The write queue: fills and lock releases, sent in order by one task,
//! off the request path.

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use fred::prelude::{Expiration, KeysInterface, SortedSetsInterface};
use fred::types::ExpireOptions;
use tokio::sync::mpsc;

use crate::lock::Release;
use crate::tier::Inner;

/// What the writer task does, in queue order.
pub(crate) enum Write {
    /// Sends a command (skipped while the breaker is open).
    Command(Command),
    /// Answers once every write queued before it is done.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// A queued command.
pub(crate) enum Command {
    /// `SET key value PX px`, then the key's hash into each tag set.
    Set {
        key: String,
        value: Bytes,
        px: i64,
        tags: Vec<String>,
        member: String,
    },
    /// Release a fill lock and announce how the fill ended, after the
    /// writes queued before it (see [`Release`]).
    Unlock(Release),
}

/// Drains the write queue in order; ends when the tier is dropped.
pub(crate) async fn writer(tier: std::sync::Weak<Inner>, mut rx: mpsc::Receiver<Write>) {
    while let Some(write) = rx.recv().await {
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let command = match write {
            Write::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Write::Command(command) => command,
        };
        let command = match command {
            // Never skipped by the breaker: small, idempotent, and a lock
            // left behind stalls every instance that waits on it.
            Command::Unlock(release) => {
                crate::lock::release(&inner, release).await;
                continue;
            }
            set => set,
        };
        if !inner.breaker.allow() {
            inner.skipped.fetch_add(1, Relaxed);
            continue;
        }
        let done = tokio::time::timeout(inner.command_timeout, apply(&inner, command)).await;
        match done {
            Ok(Ok(())) => inner.breaker.success(),
            _ => {
                inner.write_errors.fetch_add(1, Relaxed);
                inner.breaker.failure();
            }
        }
    }
}

async fn apply(inner: &Inner, command: Command) -> Result<(), fred::error::Error> {
    let client = &inner.client;
    match command {
        Command::Set {
            key,
            value,
            px,
            tags,
            member,
        } => {
            client
                .set::<(), _, _>(key, value, Some(Expiration::PX(px)), None, false)
                .await?;
            // Each tag's sorted set: the member scored by its expiry, expired
            // members trimmed, the set living as long as its longest member.
            let expires = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as i64;
            for set in tags {
                client
                    .zadd::<i64, _, _>(
                        &set,
                        None,
                        None,
                        false,
                        false,
                        ((expires + px) as f64, member.as_str()),
                    )
                    .await?;
                client
                    .zremrangebyscore::<i64, _, _, _>(&set, f64::NEG_INFINITY, expires as f64)
                    .await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::NX))
                    .await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::GT))
                    .await?;
            }
            Ok(())
        }
        Command::Unlock(_) => Ok(()),
    }
}
