//! [`ValkeyTier`]'s side of the fleet-wide fill lock: acquiring it, waiting
//! on another instance's, and releasing it (through the write queue, after
//! the fill it guards). The scripts and the release's retries are in
//! [`crate::lock`].

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use fred::prelude::{ClientLike, KeysInterface, LuaInterface, PubsubInterface, Value};
use rand::Rng;
use tiercache_core::{CacheKey, LockAttempt, LockLapse, LockToken, TierError, Unlocked};

use crate::bus;
use crate::keys::slot_key;
use crate::lock::{
    EXTEND_SCRIPT, LOCK_SCRIPT, Release, read_unlock_message, release_until_done, unlock_message,
};
use crate::tier::{Inner, ValkeyTier, fred_error};
use crate::writer::{Command, Write};

/// How long a lock's re-checks must keep failing before its waiter gives
/// up on Valkey and goes to the origin itself; at least two command
/// timeouts, so one slow answer under a longer timeout is not enough.
const FAIL_OPEN_AFTER: Duration = Duration::from_millis(500);

impl ValkeyTier {
    /// [`Tier::try_lock`](tiercache_core::Tier::try_lock): one run of the
    /// lock script, and a second when the holder is this instance's own
    /// finished flight. `unless_failing`: nothing is taken while the key's
    /// failing mark stands
    /// ([`Tier::try_lock_unless_failing`](tiercache_core::Tier::try_lock_unless_failing)).
    pub(crate) async fn acquire_lock(
        &self,
        key: &CacheKey,
        ttl: Duration,
        unless_failing: bool,
    ) -> Result<LockAttempt, TierError> {
        if !self.inner.fill_locks {
            return Ok(LockAttempt::Unsupported);
        }
        if !self.inner.breaker.allow() {
            self.inner.skipped.fetch_add(1, Relaxed);
            return Ok(LockAttempt::Unsupported);
        }
        let token = Bytes::from(bus::hex(&rand::rng().random::<[u8; 16]>()));
        let px = ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        let mark = unless_failing.then(|| self.failing_key(key));
        let mut attempt = self
            .attempt_lock(key, &token, px, ttl, mark.as_deref())
            .await?;
        // Held by this instance's own finished flight, whose release is
        // still in the write queue: let it land and try again, rather
        // than wait on (or answer with) a flight that is over.
        if let LockAttempt::Held {
            holder: Some(holder),
            ..
        } = &attempt
            && self.is_releasing(holder)
        {
            self.flush().await;
            attempt = self
                .attempt_lock(key, &token, px, ttl, mark.as_deref())
                .await?;
        }
        if let LockAttempt::Acquired(_) = &attempt {
            self.inner
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(token, tokio::time::Instant::now() + ttl);
        }
        Ok(attempt)
    }

    /// One lock attempt with `token`. Unless Valkey answers it (it failed,
    /// timed out, or was dropped with its cancelled caller), the script
    /// may still run once Valkey reads it: the lock is then taken as
    /// possibly held and released by its token when Valkey answers again.
    async fn attempt_lock(
        &self,
        key: &CacheKey,
        token: &Bytes,
        px: i64,
        ttl: Duration,
        mark: Option<&str>,
    ) -> Result<LockAttempt, TierError> {
        let mut unanswered = Unanswered {
            tier: self,
            key,
            token,
            ttl,
            armed: true,
        };
        let attempt = self.lock_once(key, token, px, mark).await;
        unanswered.armed = attempt.is_err();
        attempt
    }

    /// [`Tier::unlock`](tiercache_core::Tier::unlock): queued behind the
    /// fill's writes; with `failing`, the key's failing mark set for that
    /// long first ([`Tier::unlock_failing`](tiercache_core::Tier::unlock_failing)).
    pub(crate) fn release_lock(
        &self,
        key: &CacheKey,
        token: &LockToken,
        how: Unlocked,
        failing: Option<Duration>,
    ) {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token.0.clone());
        let until = self
            .inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token.0)
            .unwrap_or_else(tokio::time::Instant::now);
        let mut release = Release {
            lock: self.lock_key(key),
            channel: self.done_channel(key),
            shared: self.shared_key(key, token),
            token: token.0.clone(),
            message: unlock_message(&how),
            until,
            announce: true,
            failing: failing.map(|mark| (self.failing_key(key), mark)),
        };
        // The answer it shares rides the queue as a fill's copy does,
        // within its byte bound: past it the release goes without it.
        if release.answer_bytes() > 0 && !self.inner.hold_queued(release.answer_bytes()) {
            release.drop_answer();
        }
        // After the writes queued before it (a fill's `SET` lands first); a
        // full queue does not drop it: it goes out on its own at once,
        // without the answer (retried, it would hold it for the lock's
        // life, outside any bound).
        let queued = self
            .inner
            .writes
            .try_send(Write::Command(Command::Unlock(release)));
        if let Err(full) = queued
            && let Write::Command(Command::Unlock(mut release)) = full.into_inner()
        {
            self.inner
                .queued_bytes
                .fetch_sub(release.answer_bytes(), Relaxed);
            release.drop_answer();
            tokio::spawn(release_until_done(Arc::downgrade(&self.inner), release));
        }
    }

    /// [`Tier::extend_lock`](tiercache_core::Tier::extend_lock): a task
    /// running the token-checked `PEXPIRE` within the command timeout; not
    /// sent while the breaker is open or the client reconnects (the lock
    /// then ends as it would have, and the waiting instances take it over).
    /// A move not sent, refused (the lock is gone or another's) or not
    /// answered in time is reported to `lapse`; one that landed (or whose
    /// lock was released meanwhile) is told landed.
    pub(crate) fn move_lock_on(
        &self,
        key: &CacheKey,
        token: &LockToken,
        ttl: Duration,
        lapse: LockLapse,
    ) {
        let inner = &self.inner;
        if inner.breaker.is_open() || !inner.client().is_connected() {
            return lost(inner, &lapse);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return lost(inner, &lapse);
        };
        let (lock, token) = (self.lock_key(key), token.0.clone());
        let px = ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        // Its release is retried until this end, not the first one: set
        // before the command, which may land unanswered.
        let until = tokio::time::Instant::now() + ttl;
        if let Some(end) = inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&token)
        {
            *end = (*end).max(until);
        }
        let inner = Arc::downgrade(inner);
        runtime.spawn(async move {
            // Gone with its tier: nothing is written any more.
            let Some(inner) = inner.upgrade() else {
                return lapse.landed();
            };
            let args = vec![Value::from(token.clone()), px.into()];
            let client = inner.client();
            let moved = client.eval::<i64, _, _, _>(EXTEND_SCRIPT, vec![lock], args);
            let landed = matches!(
                tokio::time::timeout(inner.command_timeout, moved).await,
                Ok(Ok(1))
            );
            // A lock released meanwhile (its release landed first) lost
            // nothing.
            let held = || {
                let held = inner.held.lock().unwrap_or_else(|e| e.into_inner());
                held.contains_key(&token)
            };
            if !landed && held() {
                lost(&inner, &lapse);
            } else {
                lapse.landed();
            }
        });
    }

    /// [`Tier::wait_unlock`](tiercache_core::Tier::wait_unlock): the lock's
    /// release heard on its channel, or found by re-checking.
    pub(crate) async fn wait_for_release(
        &self,
        key: &CacheKey,
        holder: Option<&LockToken>,
        timeout: Duration,
    ) -> Result<Unlocked, TierError> {
        let channel = self.done_channel(key);
        let mut waiter = self.inner.bus.wait_on(&channel);
        // Not subscribed while the subscriber reconnects (fred would hold
        // the command until it is back): the re-checks below find the
        // release.
        if waiter.first && self.inner.bus.subscriber.is_connected() {
            let subscriber = self.inner.bus.subscriber.clone();
            self.bounded(async {
                subscriber
                    .ssubscribe(channel.clone())
                    .await
                    .map_err(fred_error)
            })
            .await?;
        }
        // Subscribed: a release from now on is heard. One before it left
        // no lock behind. The notification is not relied on alone: the
        // lock is re-checked on a short backoff (50, 100, 200 ms), so a
        // lost release or notification costs one step, not the lock's
        // whole life.
        // Failed re-checks are a blip (a slow moment under load) until
        // they have failed for `FAIL_OPEN_AFTER`: then Valkey is gone,
        // and the wait fails open (the request goes to the origin).
        let deadline = tokio::time::Instant::now() + timeout;
        let mut step = Duration::from_millis(50);
        let mut failing_since = None;
        loop {
            match self.lock_held(key, holder).await {
                Ok(false) => return self.bounded(self.gone(key, holder)).await,
                Ok(true) => failing_since = None,
                Err(e) => {
                    let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= FAIL_OPEN_AFTER.max(2 * self.inner.command_timeout) {
                        return Err(e);
                    }
                }
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(Unlocked::TimedOut);
            }
            match tokio::time::timeout(step.min(left), waiter.rx.wait_for(Option::is_some)).await {
                Ok(Ok(how)) => return Ok(how.clone().unwrap_or(Unlocked::Gone)),
                Ok(Err(_)) => return Ok(Unlocked::Gone),
                Err(_) => step = (step * 2).min(Duration::from_millis(200)),
            }
        }
    }

    /// Where a lock's holder leaves an answer it shared unstored:
    /// `PREFIX:{HASH}:shared:TOKEN`, for
    /// [`SHARED_ANSWER_TTL`](crate::lock::SHARED_ANSWER_TTL). Named by the
    /// holder's token, so only the requests that waited on that holder read
    /// it; the next flight goes to the origin again.
    fn shared_key(&self, key: &CacheKey, holder: &LockToken) -> String {
        let token = String::from_utf8_lossy(&holder.0);
        slot_key(&self.inner.prefix, &key.hash(), &format!("shared:{token}"))
    }

    /// How a lock found gone ended: filled (the entry is there), shared (its
    /// holder left its answer), or gone without a word.
    async fn gone(
        &self,
        key: &CacheKey,
        holder: Option<&LockToken>,
    ) -> Result<Unlocked, TierError> {
        let pipe = self.inner.client().pipeline();
        let queued: Result<(), _> = pipe.exists(self.entry_key(key)).await;
        queued.map_err(fred_error)?;
        if let Some(holder) = holder {
            let queued: Result<(), _> = pipe.get(self.shared_key(key, holder)).await;
            queued.map_err(fred_error)?;
        }
        let mut replies: Vec<Value> = pipe.all().await.map_err(fred_error)?;
        let shared = replies
            .pop()
            .and_then(|v| v.as_bytes().map(read_unlock_message));
        let filled = replies.pop().and_then(|v| v.as_i64()).unwrap_or(0) > 0;
        Ok(match shared {
            _ if filled => Unlocked::Filled,
            Some(word @ (Unlocked::Shared(..) | Unlocked::Failed)) => word,
            _ => Unlocked::Gone,
        })
    }

    fn done_channel(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "done")
    }

    /// A lock attempt got no answer: if the script ran after all, this
    /// instance holds a lock nobody knows of. Release it by its token when
    /// Valkey answers again (announcing only if it was there).
    fn release_possibly_held(&self, key: &CacheKey, token: &Bytes, ttl: Duration) {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token.clone());
        let release = Release {
            lock: self.lock_key(key),
            channel: self.done_channel(key),
            shared: String::new(),
            token: token.clone(),
            message: Bytes::from_static(b"0"),
            until: tokio::time::Instant::now() + ttl,
            announce: false,
            failing: None,
        };
        tokio::spawn(release_until_done(Arc::downgrade(&self.inner), release));
    }

    /// Whether `key`'s fill lock is still `holder`'s (any holder's when
    /// the holder is not known): a lock another instance took after it is
    /// not the one waited on, whose release (a fill, an answer it shared)
    /// may have been missed.
    async fn lock_held(
        &self,
        key: &CacheKey,
        holder: Option<&LockToken>,
    ) -> Result<bool, TierError> {
        let lock = self.lock_key(key);
        self.bounded(async {
            let Some(holder) = holder else {
                let r: Result<i64, _> = self.inner.client().exists(lock).await;
                return r.map(|n| n > 0).map_err(fred_error);
            };
            let r: Result<Option<Bytes>, _> = self.inner.client().get(lock).await;
            r.map(|token| token.is_some_and(|t| t == holder.0))
                .map_err(fred_error)
        })
        .await
    }

    fn is_releasing(&self, holder: &LockToken) -> bool {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&holder.0)
    }

    /// One run of the lock script.
    async fn lock_once(
        &self,
        key: &CacheKey,
        token: &Bytes,
        px: i64,
        mark: Option<&str>,
    ) -> Result<LockAttempt, TierError> {
        {
            let mut keys = vec![self.lock_key(key)];
            keys.extend(mark.map(str::to_owned));
            let reply: Vec<Value> = self
                .bounded(async {
                    let r: Result<Vec<Value>, _> = self
                        .inner
                        .client()
                        .eval(
                            LOCK_SCRIPT,
                            keys,
                            vec![Value::from(token.clone()), px.into()],
                        )
                        .await;
                    r.map_err(fred_error)
                })
                .await?;
            let ms = reply.first().and_then(Value::as_i64).unwrap_or(0);
            let holder = reply
                .get(1)
                .and_then(Value::as_bytes)
                .filter(|t| !t.is_empty())
                .map(|t| LockToken(Bytes::copy_from_slice(t)));
            Ok(match ms {
                -10 => {
                    self.inner.bus.locks_acquired.fetch_add(1, Relaxed);
                    LockAttempt::Acquired(LockToken(token.clone()))
                }
                -20 => {
                    self.inner.bus.failing_marks.fetch_add(1, Relaxed);
                    let left = reply.get(1).and_then(Value::as_i64).unwrap_or(0);
                    LockAttempt::Failing {
                        left: Duration::from_millis(left.max(0) as u64),
                    }
                }
                ms if ms > 0 => LockAttempt::Held {
                    left: Duration::from_millis(ms as u64),
                    holder,
                },
                // Gone between SET and PTTL, or no expiry (not ours to judge).
                _ => LockAttempt::Held {
                    left: Duration::ZERO,
                    holder,
                },
            })
        }
    }
}

/// A lock attempt sent and not answered: dropped armed, it releases the
/// lock the script may still take, by its token, when Valkey answers
/// (else the lock would stand until its `PX` with nobody to release it).
struct Unanswered<'a> {
    tier: &'a ValkeyTier,
    key: &'a CacheKey,
    token: &'a Bytes,
    ttl: Duration,
    armed: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        // The release is a task: without a runtime (one shutting down)
        // the lock is left to its expiry.
        if self.armed && tokio::runtime::Handle::try_current().is_ok() {
            self.tier
                .release_possibly_held(self.key, self.token, self.ttl);
        }
    }
}

/// A move of a held lock that did not land: counted, and told its holder.
fn lost(inner: &Inner, lapse: &LockLapse) {
    inner.bus.locks_lost.fetch_add(1, Relaxed);
    lapse.report();
}
