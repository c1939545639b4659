//! Fleet-wide fill locks: the scripts that take and release them, the
//! message a release sends to the instances waiting on it, and releases
//! that cannot be lost.
//!
//! A release is small and idempotent (a token-checked delete), so it is
//! never dropped by a full write queue nor skipped by an open breaker: it is
//! retried with backoff until it lands or the lock would have expired
//! anyway. The unlock and the notification are sent independently: a lost
//! notification still lets waiters finish (they re-check the lock on a
//! short backoff), and a lost unlock is retried. A lock attempt whose reply
//! never came is treated as possibly held: its release is sent when Valkey
//! answers again.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pipeline};
use fred::prelude::{ClientLike, KeysInterface, PubsubInterface, Value};
use fred::types::{CustomCommand, Expiration};
use tiercache_core::Unlocked;
use tokio::time::Instant;

use crate::codec;
use crate::tier::Inner;

/// One lock's release: what to delete, announce, and leave for late waiters.
#[derive(Debug, Clone)]
pub(crate) struct Release {
    pub(crate) lock: String,
    pub(crate) channel: String,
    pub(crate) shared: String,
    pub(crate) token: Bytes,
    pub(crate) message: Bytes,
    /// Past this the lock has expired by its `PX`: nothing left to release.
    pub(crate) until: Instant,
    /// Announce even when the lock was not there to delete (a real
    /// release); a possibly-held lock announces only what it deleted.
    pub(crate) announce: bool,
    /// The load met the origin failing: this key marks it so for the fleet
    /// for this long, set before the lock goes (see
    /// [`LOCK_SCRIPT`]).
    pub(crate) failing: Option<(String, Duration)>,
}

impl Release {
    /// Bytes of the answer it shares with the waiters (0 without one): a
    /// message of one byte only says how the flight ended.
    pub(crate) fn answer_bytes(&self) -> usize {
        if self.message.len() > 1 {
            self.message.len()
        } else {
            0
        }
    }

    /// Whether it leaves a word for waiters that subscribe late (under
    /// `shared`): the answer it shares, or that the load failed, so they
    /// do not call the origin the others were kept from.
    pub(crate) fn leaves_word(&self) -> bool {
        self.answer_bytes() > 0 || self.message == FAILED
    }

    /// Sent again after an attempt that failed: without the failing mark,
    /// which a retry must not set (nor start again) once the origin may
    /// be back.
    pub(crate) fn retried(mut self) -> Self {
        self.failing = None;
        self
    }

    /// Goes on without the answer it shares: the waiters look for the
    /// entry, then take turns at the lock.
    pub(crate) fn drop_answer(&mut self) {
        if self.answer_bytes() > 0 {
            self.message = unlock_message(&Unlocked::Gone);
        }
    }
}

/// Sends `release` once: the failing mark and the shared answer (if any),
/// the unlock and the notification, each on its own bound. Whether the unlock landed.
pub(crate) async fn release_once(inner: &Inner, release: &Release) -> bool {
    // Not queued in fred while it reconnects (see `Inner::connected`),
    // nor waiting for it: the writer runs releases inline while the
    // breaker is open, and the retry comes after the backoff.
    if !inner.client().is_connected() {
        return false;
    }
    let client = inner.client();
    let bound = inner.command_timeout;
    if let Some((mark, px)) = &release.failing {
        let set = client.set::<(), _, _>(mark.clone(), "1", Some(failing_px(*px)), None, false);
        let _ = tokio::time::timeout(bound, set).await;
    }
    // A shared answer is left first, for a moment, where a waiter that
    // finds the lock gone (it subscribed too late) reads it: so no waiter
    // can see the lock gone and the answer not there yet.
    if release.leaves_word() {
        let set = client.set::<(), _, _>(
            release.shared.clone(),
            release.message.clone(),
            Some(shared_answer_px()),
            None,
            false,
        );
        let _ = tokio::time::timeout(bound, set).await;
    }
    let (eval, args) = unlock_command(release);
    let unlock = tokio::time::timeout(bound, client.custom::<i64, _>(eval, args));
    let deleted = match unlock.await {
        Ok(Ok(n)) => Some(n > 0),
        _ => None,
    };
    if release.announce || deleted == Some(true) {
        let publish =
            client.spublish::<i64, _, _>(release.channel.clone(), release.message.clone());
        let _ = tokio::time::timeout(bound, publish).await;
    }
    deleted.is_some()
}

/// Queues `release` on a pipeline, in `release_once`'s order: the failing
/// mark (if any), the shared answer (if any), the unlock, the notification (sent whatever the unlock
/// finds: only real releases are queued; a possibly-held lock's goes through
/// `release_until_done`). How many commands it queued, and the offset among
/// them of the unlock, whose reply says whether the release landed.
pub(crate) async fn pipe_release(
    pipe: &Pipeline<Client>,
    release: &Release,
) -> Result<(usize, usize), fred::error::Error> {
    debug_assert!(release.announce);
    let mut queued = 0;
    if let Some((mark, px)) = &release.failing {
        let _: () = pipe
            .set(mark, "1", Some(failing_px(*px)), None, false)
            .await?;
        queued += 1;
    }
    if release.leaves_word() {
        let px = Some(shared_answer_px());
        let _: () = pipe
            .set(&release.shared, release.message.clone(), px, None, false)
            .await?;
        queued += 1;
    }
    let (eval, args) = unlock_command(release);
    let _: () = pipe.custom(eval, args).await?;
    let unlock_at = queued;
    let _: () = pipe
        .spublish(&release.channel, release.message.clone())
        .await?;
    Ok((queued + 2, unlock_at))
}

/// `EVAL UNLOCK_SCRIPT 1 lock token`, routed by the lock key on a
/// cluster: as a custom command, since pipelines have no Lua interface.
fn unlock_command(release: &Release) -> (CustomCommand, Vec<Value>) {
    let eval = crate::writer::eval_on(&release.lock);
    let args = vec![
        Value::from(UNLOCK_SCRIPT),
        Value::from(1),
        Value::from(release.lock.as_str()),
        Value::from(release.token.clone()),
    ];
    (eval, args)
}

/// A shared answer's lifetime, as a `SET` expiration.
fn shared_answer_px() -> Expiration {
    Expiration::PX(SHARED_ANSWER_TTL.as_millis() as i64)
}

/// A failing mark's lifetime, as a `SET` expiration.
fn failing_px(mark: Duration) -> Expiration {
    Expiration::PX(mark.as_millis().clamp(1, i64::MAX as u128) as i64)
}

/// Retries `release` with backoff (50 ms, doubling, 1 s at most) until the
/// unlock lands or the lock would have expired anyway.
pub(crate) async fn release_until_done(inner: Weak<Inner>, mut release: Release) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(live) = inner.upgrade() else {
            return;
        };
        if Instant::now() >= release.until || release_once(&live, &release).await {
            live.released(&release.token);
            return;
        }
        // Retried without the answer it shares: held for the lock's life,
        // outside the write queue's bound, a flood of failing URLs could
        // keep ~1 GiB of them.
        release.drop_answer();
        // Nor as "failed": a retry may land after another instance took the
        // lock, and its message names no holder, so it would fail that
        // holder's waiters; "gone" sends them to re-check the lock.
        if release.message == FAILED {
            release.message = unlock_message(&Unlocked::Gone);
        }
        release = release.retried();
        live.release_retries.fetch_add(1, Relaxed);
        drop(live);
        tokio::time::sleep(backoff.min(release.until.saturating_duration_since(Instant::now())))
            .await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Runs a release now, and on in the background until it lands.
pub(crate) async fn release(inner: &Arc<Inner>, release: Release) {
    if release_once(inner, &release).await {
        inner.released(&release.token);
    } else {
        tokio::spawn(release_until_done(Arc::downgrade(inner), release.retried()));
    }
}

/// Takes the lock (`SET NX PX`) or tells how long it is still held.
/// Replies `{-10, ''}` when taken, else `{PTTL, holder's token}`; given
/// a second key, the origin's failing mark, takes nothing while it stands
/// and replies `{-20, its PTTL}`.
pub(crate) const LOCK_SCRIPT: &str = "if KEYS[2] then local f = redis.call('PTTL', KEYS[2]) \
     if f > 0 then return {-20, f} end end \
     if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return {-10, ''} end \
     return {redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1]) or ''}";

/// Moves the lock's end to `ARGV[2]` ms from now, only if it still holds
/// this owner's token.
pub(crate) const EXTEND_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";

/// Deletes the lock only if it still holds this owner's token.
pub(crate) const UNLOCK_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('DEL', KEYS[1]) else return 0 end";

/// The release message of a load that failed with nothing to share.
const FAILED: &[u8] = b"4";

/// How long a shared answer stays readable for late waiters.
pub(crate) const SHARED_ANSWER_TTL: Duration = Duration::from_secs(1);

/// Largest shared answer carried in an unlock message; a larger one is
/// announced as passed (the waiting instances load it themselves), or, for
/// an origin failure, as failed (they answer with the failure, not its page).
const MAX_SHARED_MESSAGE: usize = 256 * 1024;

/// The message a lock's release sends on the key's done channel: `1`
/// filled or gone (read L2, then try the lock), `0` passed (load), `4`
/// failed (answer with the failure), or `2`/`3` followed by the shared
/// answer's envelope (`2`: an origin failure), which waiting instances
/// answer with instead of calling the origin again.
pub(crate) fn unlock_message(how: &Unlocked) -> Bytes {
    match how {
        // A waiter does the same for both; "passed" would send it to the
        // origin past an entry that may be there.
        Unlocked::Filled | Unlocked::Gone => Bytes::from_static(b"1"),
        Unlocked::Failed => Bytes::from_static(FAILED),
        Unlocked::Shared(entry, failed) if entry.value().body.len() <= MAX_SHARED_MESSAGE => {
            codec::Measured::of(entry).encode_after(&[if *failed { b'2' } else { b'3' }])
        }
        Unlocked::Shared(_, true) => Bytes::from_static(FAILED),
        _ => Bytes::from_static(b"0"),
    }
}

/// Reads [`unlock_message`]'s output; anything else is "passed".
pub(crate) fn read_unlock_message(message: &[u8]) -> Unlocked {
    match message.split_first() {
        Some((b'1', [])) => Unlocked::Filled,
        Some((b'4', [])) => Unlocked::Failed,
        Some((tag @ (b'2' | b'3'), envelope)) => {
            match codec::decode(Bytes::copy_from_slice(envelope)) {
                Ok(entry) => Unlocked::Shared(entry, *tag == b'2'),
                Err(_) => Unlocked::Passed,
            }
        }
        _ => Unlocked::Passed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holder that lets go because the entry is there after all (its
    /// second L2 read) must not send its waiters to the origin: "gone" is
    /// carried as "read L2", not as "passed".
    #[test]
    fn a_release_as_gone_tells_waiters_to_read_l2_not_to_load() {
        let heard = |how: Unlocked| read_unlock_message(&unlock_message(&how));
        assert!(matches!(heard(Unlocked::Gone), Unlocked::Filled));
        assert!(matches!(heard(Unlocked::Filled), Unlocked::Filled));
        assert!(matches!(heard(Unlocked::Passed), Unlocked::Passed));
    }

    /// A failed load's release is heard as failed, and left for the waiters
    /// that subscribe late, outside the write queue's bytes.
    #[test]
    fn a_failed_load_is_heard_as_failed_and_left_for_late_waiters() {
        assert!(matches!(
            read_unlock_message(&unlock_message(&Unlocked::Failed)),
            Unlocked::Failed
        ));
        let mut release = failed_release(None);
        assert_eq!(release.answer_bytes(), 0);
        release.drop_answer();
        assert!(release.leaves_word());
    }

    /// A release sent again after an attempt that failed leaves no
    /// failing mark: by then the origin may be back, and a mark would keep
    /// the fleet from asking it for another second.
    #[test]
    fn a_release_sent_again_marks_nothing() {
        let release = failed_release(Some(("f".into(), Duration::from_secs(1))));
        assert!(release.retried().failing.is_none());
    }

    /// A failed load's release, marking the origin failing with `failing`.
    fn failed_release(failing: Option<(String, Duration)>) -> Release {
        Release {
            lock: "l".into(),
            channel: "c".into(),
            shared: "s".into(),
            token: Bytes::from_static(b"t"),
            message: unlock_message(&Unlocked::Failed),
            until: Instant::now(),
            announce: true,
            failing,
        }
    }

    /// A shared answer, small (on the heap) or large (in a page mapping),
    /// is heard as sent: its envelope read after the tag, failed or not.
    #[test]
    fn a_shared_answer_is_heard_as_sent_whatever_its_size() {
        let now = std::time::SystemTime::now();
        for size in [10, tiercache_core::body::mapped_from() + 10] {
            let answer = tiercache_core::Entry::new(
                "k".into(),
                Bytes::new(),
                tiercache_core::Value::from_body(vec![b'a'; size]),
                tiercache_core::Times::fresh(now, now + Duration::from_secs(1)),
                Duration::ZERO,
            );
            for failed in [false, true] {
                let message = unlock_message(&Unlocked::Shared(answer.clone(), failed));
                let Unlocked::Shared(heard, heard_failed) = read_unlock_message(&message) else {
                    panic!("a {size}-byte answer was not heard as shared");
                };
                assert_eq!((heard.value(), heard_failed), (answer.value(), failed));
            }
        }
    }

    /// A failure page too large to carry still tells the waiters the load
    /// failed (they would each call the failing origin); a large answer
    /// that is no failure sends them to load it.
    #[test]
    fn a_failure_too_large_to_carry_is_heard_as_failed() {
        let now = std::time::SystemTime::now();
        let large = tiercache_core::Entry::new(
            "k".into(),
            Bytes::new(),
            tiercache_core::Value::from_body(vec![b'x'; MAX_SHARED_MESSAGE + 1]),
            tiercache_core::Times::fresh(now, now),
            Duration::ZERO,
        );
        let heard =
            |failed| read_unlock_message(&unlock_message(&Unlocked::Shared(large.clone(), failed)));
        assert!(matches!(heard(true), Unlocked::Failed));
        assert!(matches!(heard(false), Unlocked::Passed));
    }
}
