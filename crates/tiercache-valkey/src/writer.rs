//! The write queue: fills and lock releases, sent in order by one task,
//! off the request path.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::clients::{Client, Pipeline};
use fred::prelude::{ClientLike, Expiration, KeysInterface, SortedSetsInterface, Value};
use fred::types::{ClusterHash, CustomCommand, ExpireOptions};
use tokio::sync::mpsc;

use tiercache_core::KeyHash;

use crate::codec;
use crate::guard::{Guard, pipe_guarded};
use crate::lock::Release;
use crate::overtaken::{STAMP_HEAD, STAMP_TAIL, Stamp, Target, Undo};
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
        hash: KeyHash,
        /// The full key (for prefix invalidations).
        full: Bytes,
        /// [`crate::overtaken::Overtaken::mark`] when it was queued.
        heard: u64,
        /// Stored only under this condition, which a script checks (a
        /// renewal, a late load's answer).
        guard: Option<Guard>,
    },
    /// Delete these entries again, each only while it still holds the
    /// stamped fill: fills another instance's invalidation overtook (see
    /// [`crate::overtaken`]).
    Delete(Vec<Undo>),
    /// Release a fill lock and announce how the fill ended, after the
    /// writes queued before it (see [`Release`]).
    Unlock(Release),
}

/// Most commands (fills and releases) sent in one pipeline.
const BATCH: usize = 64;

/// Drains the write queue in order; ends when the tier is dropped. Commands
/// waiting back to back go out as one pipeline (one round trip for up to
/// [`BATCH`] fills and lock releases, tag updates included), in queue
/// order, so a release still lands after the fill queued before it; a flush
/// waits for everything queued before it.
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
        let first = match write {
            Write::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Write::Command(command) => command,
        };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(Write::Command(command)) => batch.push(command),
                Ok(flush) => {
                    next = Some(flush);
                    break;
                }
                Err(_) => break,
            }
        }
        // Fills an invalidation (another instance's, or this one's) covers
        // since they were queued are never sent; the rest go out under this
        // mark.
        let (sent_under, held) = inner.overtaken.hold_back(&mut batch, |c| match c {
            Command::Set {
                hash,
                full,
                tags,
                heard,
                ..
            } => Some((*heard, *hash, &full[..], tags.as_slice())),
            _ => None,
        });
        if !held.is_empty() {
            inner.fills_overtaken.fetch_add(held.len() as u64, Relaxed);
            inner.queued_bytes.fetch_sub(queued_size(&held), Relaxed);
        }
        if batch.is_empty() {
            continue;
        }
        let bytes = queued_size(&batch);
        if !inner.breaker.allow() {
            // Fills wait for Valkey no longer; releases are never skipped:
            // small, idempotent, and a lock left behind stalls every
            // instance that waits on it.
            inner.queued_bytes.fetch_sub(bytes, Relaxed);
            for command in batch {
                match command {
                    Command::Set {
                        guard, hash, value, ..
                    } => {
                        inner.skipped.fetch_add(1, Relaxed);
                        // Its copy here may be older than Valkey's.
                        if guard.is_some() {
                            drop_renewal_here(&inner, hash, &value);
                        }
                    }
                    // Like a release: never skipped, retried until it lands.
                    Command::Delete(undo) => {
                        tokio::spawn(delete_until_done(Arc::downgrade(&inner), undo));
                    }
                    Command::Unlock(release) => crate::lock::release(&inner, release).await,
                }
            }
            continue;
        }
        let bound = inner.command_timeout * 2;
        // Per command, whether it landed; a pipeline that timed out or
        // could not be sent landed nothing.
        let (landed, every) = match tokio::time::timeout(bound, apply_batch(&inner, &batch)).await {
            Ok(Ok(replies)) => replies,
            _ => (vec![false; batch.len()], false),
        };
        let mut failed_fills = 0;
        // Sent, landed or not (a pipeline that timed out may land yet).
        let mut sent = Vec::new();
        for (command, landed) in batch.into_iter().zip(&landed) {
            match command {
                Command::Set {
                    key,
                    tags,
                    hash,
                    full,
                    value,
                    guard,
                    ..
                } => {
                    if !landed {
                        failed_fills += 1;
                        // A guarded fill that may have been refused without
                        // a word: its copy here goes (a miss at worst).
                        if guard.is_some() {
                            drop_renewal_here(&inner, hash, &value);
                        }
                    }
                    let stamp = Stamp::of(&value);
                    sent.push(Target {
                        hash,
                        full,
                        key,
                        tags,
                        stamp,
                    });
                }
                // Counted by `apply_batch`, as Valkey answers it.
                Command::Delete(_) if *landed => {}
                Command::Delete(undo) => {
                    tokio::spawn(delete_until_done(Arc::downgrade(&inner), undo));
                }
                Command::Unlock(release) if *landed => inner.released(&release.token),
                Command::Unlock(release) => {
                    tokio::spawn(crate::lock::release_until_done(
                        std::sync::Arc::downgrade(&inner),
                        release.retried(),
                    ));
                }
            }
        }
        // The breaker hears of every failed reply (a tag update's too), not
        // only of a pipeline that could not be sent.
        if every {
            inner.breaker.success();
        } else {
            inner.write_errors.fetch_add(failed_fills, Relaxed);
            inner.breaker.failure();
        }
        // Sent or failed: the batch's copies are gone.
        inner.queued_bytes.fetch_sub(bytes, Relaxed);
        // An invalidation heard while they were in flight: delete again.
        let again = inner.overtaken.sent(sent_under, sent, Instant::now());
        if !again.is_empty() && !delete_once(&inner, &again).await {
            tokio::spawn(delete_until_done(Arc::downgrade(&inner), again));
        }
    }
}

/// Drops this instance's L1 copy of a guarded fill (`envelope`: a renewal,
/// a late load's answer) that Valkey refused, or may have: no other
/// instance has it.
fn drop_renewal_here(inner: &Inner, hash: KeyHash, envelope: &[u8]) {
    if let (Some(sink), Some(created)) = (inner.bus.sink(), codec::created_at_of(envelope)) {
        sink.drop_fill(hash, &[created]);
    }
}

/// Bytes `commands` hold in the queue: fills' copies, and the answers
/// releases share (see `Inner::hold_queued`).
fn queued_size(commands: &[Command]) -> usize {
    commands
        .iter()
        .map(|c| match c {
            Command::Set { value, .. } => value.len(),
            Command::Unlock(release) => release.answer_bytes(),
            Command::Delete(_) => 0,
        })
        .sum()
}

/// Deletes again fills an invalidation overtook (each only while Valkey
/// still holds its envelope); whether that landed. The writer runs it
/// inline for a pipeline it has just sent, so a flush waits for it.
async fn delete_once(inner: &Inner, undo: &[Undo]) -> bool {
    let batch = [Command::Delete(undo.to_vec())];
    let bound = inner.command_timeout * 2;
    matches!(
        tokio::time::timeout(bound, apply_batch(inner, &batch)).await,
        Ok(Ok((_, true)))
    )
}

/// Retries a delete again until it lands, for as long as the entries could
/// live (a conditional delete is harmless however late: a newer fill's
/// envelope does not match).
async fn delete_until_done(inner: Weak<Inner>, undo: Vec<Undo>) {
    let until = Instant::now() + DELETE_RETRY_FOR;
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(live) = inner.upgrade() else {
            return;
        };
        if delete_once(&live, &undo).await || Instant::now() >= until {
            return;
        }
        drop(live);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// How long a failed delete again is retried.
const DELETE_RETRY_FOR: Duration = Duration::from_secs(600);

/// `EVAL` of a script on `key` alone, routed on a cluster to its slot.
/// fred routes a custom command by its own hash only when that is
/// `Custom(slot)`; with any other (`Offset(2)` was used) it hashes the
/// first string argument, the script's text, so every script went to one
/// node, which refused two thirds of them with `MOVED`.
pub(crate) fn eval_on(key: &str) -> CustomCommand {
    let slot = fred::util::redis_keyslot(key.as_bytes());
    CustomCommand::new_static("EVAL", ClusterHash::Custom(slot), false)
}

/// Deletes `KEYS[1]` only while it still holds the envelope whose first
/// bytes are `ARGV[1]` and last bytes `ARGV[2]` (see `Stamp`); when it did,
/// publishes `ARGV[6]` on `ARGV[5]` (a `D` message: every instance drops
/// its L1 copies of the key): one may have read the copy from L2 before
/// the delete, after the invalidation that overtook it, and would keep it.
/// Not an invalidation: that would refuse loads in flight and delete again
/// the fresh fills other instances sent lately, each announcing it in turn.
const DELETE_IF_STAMPED: &str = "if redis.call('GETRANGE', KEYS[1], 0, ARGV[3]) == ARGV[1] \
     and redis.call('GETRANGE', KEYS[1], ARGV[4], -1) == ARGV[2] then \
     local n = redis.call('UNLINK', KEYS[1]) \
     if n == 1 then redis.call('PUBLISH', ARGV[5], ARGV[6]) end \
     return n else return 0 end";

/// Sends a batch in one pipeline, in order: each fill's `SET … PX` and its
/// tag sets; each release's failing mark, shared answer, token-checked
/// unlock and notification (see [`crate::lock::pipe_release`]). Per command, whether it
/// landed (a release that did not is retried by the caller), and whether
/// every reply was a success.
async fn apply_batch(
    inner: &Inner,
    batch: &[Command],
) -> Result<(Vec<bool>, bool), fred::error::Error> {
    if inner.connected().await.is_err() {
        // Failed, not queued in fred (see `Inner::connected`).
        return Err(fred::error::Error::new(
            fred::error::ErrorKind::Canceled,
            "not connected",
        ));
    }
    let pipe = inner.client().pipeline();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    // Which of the pipeline's replies decide whether each command landed: a
    // fill's `SET` and its tag updates, a release's unlock.
    let mut deciding = Vec::with_capacity(batch.len());
    let mut sent = 0;
    for command in batch {
        match command {
            Command::Set { .. } => {
                let queued = pipe_fill(inner, &pipe, command, now).await?;
                deciding.push(sent..sent + queued);
                sent += queued;
            }
            Command::Unlock(release) => {
                let (queued, unlock_at) = crate::lock::pipe_release(&pipe, release).await?;
                deciding.push(sent + unlock_at..sent + unlock_at + 1);
                sent += queued;
            }
            Command::Delete(undo) => {
                // One script a key: each entry lives in its own slot.
                for (key, stamp, hash) in undo {
                    let eval = eval_on(key);
                    let message = crate::bus::encode_drop(&inner.bus.instance, &[*hash]);
                    let args = vec![
                        Value::from(DELETE_IF_STAMPED),
                        Value::from(1),
                        Value::from(key.as_str()),
                        Value::from(Bytes::copy_from_slice(&stamp.head)),
                        Value::from(Bytes::copy_from_slice(&stamp.tail)),
                        Value::from((STAMP_HEAD - 1) as i64),
                        Value::from(-(STAMP_TAIL as i64)),
                        Value::from(inner.bus.channel.as_str()),
                        Value::from(message),
                    ];
                    let _: () = pipe.custom(eval, args).await?;
                }
                deciding.push(sent..sent + undo.len());
                sent += undo.len();
            }
        }
    }
    let replies: Vec<Result<Value, fred::error::Error>> = pipe.try_all().await;
    let landed = |span: &std::ops::Range<usize>| {
        replies.len() == sent && replies[span.clone()].iter().all(Result::is_ok)
    };
    let mut every = landed(&(0..sent));
    let mut per_command: Vec<bool> = deciding.iter().map(landed).collect();
    // Fills deleted again: those Valkey still held (a delete that found a
    // newer fill, or none, overtook nothing).
    let removed = batch
        .iter()
        .zip(&deciding)
        .filter(|(command, _)| matches!(command, Command::Delete(_)))
        .flat_map(|(_, span)| replies.get(span.clone()).unwrap_or_default())
        .filter(|reply| matches!(reply, Ok(Value::Integer(1))))
        .count();
    inner.fills_overtaken.fetch_add(removed as u64, Relaxed);
    // Guarded fills that were stored (the script answered 1): their tag
    // sets now, in a second round trip (a refused one adds none).
    let renewals = inner.client().pipeline();
    let mut renewed = Vec::new();
    for (i, command) in batch.iter().enumerate() {
        let Command::Set {
            guard: Some(_),
            tags,
            hash,
            px,
            value,
            ..
        } = command
        else {
            continue;
        };
        if !per_command[i] {
            continue;
        }
        match replies[deciding[i].start] {
            Ok(Value::Integer(1)) if !tags.is_empty() => {
                pipe_tags(&renewals, tags, hash, *px, now).await?;
                renewed.push(i);
            }
            // Refused: this instance's copy is the only one of its fill (a
            // renewal's script message names the fill read, for every
            // instance; a late load's answer is older than the one kept).
            Ok(Value::Integer(0)) => drop_renewal_here(inner, *hash, value),
            _ => {}
        }
    }
    if !renewed.is_empty() {
        let replies: Vec<Result<Value, fred::error::Error>> = renewals.try_all().await;
        if !replies.iter().all(Result::is_ok) {
            every = false;
            renewed.iter().for_each(|&i| per_command[i] = false);
        }
    }
    Ok((per_command, every))
}

/// Queues a fill (a `Command::Set`): its `SET … PX`, then each tag's sorted
/// set (see [`pipe_tags`]); a guarded fill's script alone (its tags wait
/// for its answer). How many commands it queued.
async fn pipe_fill(
    inner: &Inner,
    pipe: &Pipeline<Client>,
    fill: &Command,
    now: i64,
) -> Result<usize, fred::error::Error> {
    let Command::Set {
        key,
        value,
        px,
        tags,
        hash,
        guard,
        ..
    } = fill
    else {
        return Ok(0);
    };
    if let Some(guard) = guard {
        pipe_guarded(inner, pipe, key, (value, *px, *hash), guard.clone()).await?;
        return Ok(1);
    }
    let _: () = pipe
        .set(key, value.clone(), Some(Expiration::PX(*px)), None, false)
        .await?;
    Ok(1 + pipe_tags(pipe, tags, hash, *px, now).await?)
}

/// Queues each tag's sorted set for a fill of `hash` living `px` ms: the
/// member scored by its expiry, expired members trimmed, the set living as
/// long as its longest member. How many commands it queued.
async fn pipe_tags(
    pipe: &Pipeline<Client>,
    tags: &[String],
    hash: &KeyHash,
    px: i64,
    now: i64,
) -> Result<usize, fred::error::Error> {
    // A tag set's member is the key's hash.
    let member = if tags.is_empty() {
        String::new()
    } else {
        hash.to_hex()
    };
    for set in tags {
        let score = ((now + px) as f64, member.as_str());
        let _: () = pipe.zadd(set, None, None, false, false, score).await?;
        let _: () = pipe
            .zremrangebyscore(set, f64::NEG_INFINITY, now as f64)
            .await?;
        let _: () = pipe.pexpire(set, px, Some(ExpireOptions::NX)).await?;
        let _: () = pipe.pexpire(set, px, Some(ExpireOptions::GT)).await?;
    }
    Ok(4 * tags.len())
}
