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

/// Most fills sent in one pipeline.
const BATCH: usize = 64;

/// Drains the write queue in order; ends when the tier is dropped. Fills
/// waiting back to back go out as one pipeline (one round trip for up to
/// [`BATCH`] of them, their tag updates included); a release or a flush
/// waits for the fills queued before it.
pub(crate) async fn writer(tier: std::sync::Weak<Inner>, mut rx: mpsc::Receiver<Write>) {
    let mut next = None;
    loop {
        let write = match next.take() {
            Some(write) => write,
            None => match rx.recv().await {
                Some(write) => write,
                None => return,
            },
        };
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let set = match write {
            Write::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            // Never skipped by the breaker: small, idempotent, and a lock
            // left behind stalls every instance that waits on it.
            Write::Command(Command::Unlock(release)) => {
                crate::lock::release(&inner, release).await;
                continue;
            }
            Write::Command(set) => set,
        };
        let mut batch = vec![set];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(Write::Command(set @ Command::Set { .. })) => batch.push(set),
                Ok(other) => {
                    next = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        let bytes: usize = batch
            .iter()
            .map(|c| match c {
                Command::Set { value, .. } => value.len(),
                Command::Unlock(_) => 0,
            })
            .sum();
        if !inner.breaker.allow() {
            inner.skipped.fetch_add(batch.len() as u64, Relaxed);
            inner.queued_bytes.fetch_sub(bytes, Relaxed);
            continue;
        }
        let n = batch.len() as u64;
        let bound = inner.command_timeout * 2;
        match tokio::time::timeout(bound, apply_batch(&inner, batch)).await {
            Ok(Ok(())) => inner.breaker.success(),
            _ => {
                inner.write_errors.fetch_add(n, Relaxed);
                inner.breaker.failure();
            }
        }
        // Sent or failed: the batch's copies are gone.
        inner.queued_bytes.fetch_sub(bytes, Relaxed);
    }
}

/// Sends fills in one pipeline: each `SET … PX`, then its tag sets.
async fn apply_batch(inner: &Inner, batch: Vec<Command>) -> Result<(), fred::error::Error> {
    let pipe = inner.client.pipeline();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    for command in batch {
        let Command::Set {
            key,
            value,
            px,
            tags,
            member,
        } = command
        else {
            continue;
        };
        let _: () = pipe
            .set(key, value, Some(Expiration::PX(px)), None, false)
            .await?;
        // Each tag's sorted set: the member scored by its expiry, expired
        // members trimmed, the set living as long as its longest member.
        for set in tags {
            let _: () = pipe
                .zadd(
                    &set,
                    None,
                    None,
                    false,
                    false,
                    ((now + px) as f64, member.as_str()),
                )
                .await?;
            let _: () = pipe
                .zremrangebyscore(&set, f64::NEG_INFINITY, now as f64)
                .await?;
            let _: () = pipe.pexpire(&set, px, Some(ExpireOptions::NX)).await?;
            let _: () = pipe.pexpire(&set, px, Some(ExpireOptions::GT)).await?;
        }
    }
    let _: Vec<fred::prelude::Value> = pipe.all().await?;
    Ok(())
}
