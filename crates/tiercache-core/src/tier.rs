//! The shared-tier trait the Valkey tier implements.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;

use crate::{
    CacheKey, Entry, Invalidation, InvalidationSink, LateFill, LockAttempt, LockLapse, LockToken,
    Unlocked,
};

/// A boxed, sendable future (the `Tier` trait is used as `dyn Tier`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An entry read from a shared tier, with the server's remaining lifetime.
#[derive(Debug, Clone)]
pub struct TierHit {
    /// The decoded entry.
    pub entry: Entry,
    /// The tier's own remaining TTL for the key (Valkey's `PTTL`): the server's
    /// clock decides how long a promoted copy may live, never this process's.
    pub remaining: Duration,
}

/// A second cache tier shared by many processes (Valkey, or a fake in tests).
///
/// Every method fails open: the engine counts an error and goes on to the
/// origin, so an implementation should bound its own latency. The fleet
/// methods (locks, invalidation messages) have defaults for a tier that is
/// not shared by several instances: no locks, no messages.
pub trait Tier: Send + Sync + fmt::Debug + 'static {
    /// Reads `key` in one round trip. `Ok(None)` is a miss, including bytes
    /// that do not decode or belong to another key.
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>>;

    /// Stores `entry` under `key` for `ttl`, and records it under each of
    /// `tags`, off the caller's path: it queues and returns at once; a full
    /// queue drops the write (and counts it).
    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[Bytes]);

    /// Stores `entry` as [`put`](Self::put) does, only while the tier holds
    /// under `key` the fill `read` (the one stored when `read` was created:
    /// the same [`Times::created_at`](crate::Times::created_at), to the
    /// millisecond): a renewal of `read` never replaces a newer fill another
    /// instance stored meanwhile, nor brings back one taken out. The default
    /// stores it as `put` does, for a tier that cannot tell.
    fn put_over(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[Bytes], read: &Entry) {
        let _ = read;
        self.put(key, entry, ttl, tags);
    }

    /// Stores `entry` as [`put`](Self::put) does, unless the tier holds
    /// under `key` the fill of a load that began after `late.since` (its
    /// creation less its [`origin_latency`](Entry::origin_latency), to the
    /// millisecond), or `key`'s fleet lock under another token than
    /// `late.holder` (a load begun since is on its way): the answer of a
    /// load that outlived its fleet lock (it lapsed, or the tier lost it),
    /// so another instance may have taken the lock and stored a later
    /// load's answer meanwhile, or be loading it, which stays (and this
    /// instance drops its own copy). A fill it replaces (an earlier load's
    /// late fill, stored first) is dropped from every instance's L1 (see
    /// [`InvalidationSink::drop_fill`]). The default stores it as `put`
    /// does, for a tier that cannot tell.
    fn put_unless_newer(
        &self,
        key: &CacheKey,
        entry: &Entry,
        ttl: Duration,
        tags: &[Bytes],
        late: &LateFill,
    ) {
        let _ = late;
        self.put(key, entry, ttl, tags);
    }

    /// Removes what `invalidation` names from the tier (for a tag, with the
    /// keys recorded under it, which it adds to the message) and tells the
    /// other instances, whose sinks drop the same from their L1.
    fn invalidate<'a>(&'a self, invalidation: Invalidation)
    -> BoxFuture<'a, Result<(), TierError>>;

    /// Registers the engine's sink for other instances' invalidations.
    fn listen(&self, sink: std::sync::Weak<dyn InvalidationSink>) {
        let _ = sink;
    }

    /// Tries to take the fleet-wide fill lock for `key`, held for at most `ttl`.
    fn try_lock<'a>(
        &'a self,
        key: &'a CacheKey,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        let _ = (key, ttl);
        Box::pin(async { Ok(LockAttempt::Unsupported) })
    }

    /// Tries to take the lock as [`try_lock`](Self::try_lock) does, for a
    /// load with a stale copy to answer instead: while a load of `key`
    /// (any instance's) met the origin failing a moment ago (see
    /// [`unlock_failing`](Self::unlock_failing)), takes nothing and answers
    /// [`LockAttempt::Failing`], so a fleet asks a failing origin once per
    /// mark, not once per instance. By default, `try_lock`.
    fn try_lock_unless_failing<'a>(
        &'a self,
        key: &'a CacheKey,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        self.try_lock(key, ttl)
    }

    /// Releases a lock this instance holds (only with its token), after the
    /// writes queued before this call, and tells the waiting instances how
    /// the fill ended (`Filled`, `Passed`, `Failed`, `Gone`, or `Shared`
    /// with the answer).
    fn unlock(&self, key: &CacheKey, token: &LockToken, how: Unlocked) {
        let _ = (key, token, how);
    }

    /// Releases the lock as [`unlock`](Self::unlock) does after a load
    /// that met the origin failing, and marks `key` so for `mark` (set
    /// before the lock goes, so no instance takes it in between): within
    /// it, [`try_lock_unless_failing`](Self::try_lock_unless_failing)
    /// answers [`LockAttempt::Failing`]. By default, `unlock` alone.
    fn unlock_failing(&self, key: &CacheKey, token: &LockToken, how: Unlocked, mark: Duration) {
        let _ = mark;
        self.unlock(key, token, how);
    }

    /// Moves a lock this instance holds (only with its token) to end `ttl`
    /// from now: the load it guards is making progress, so the instances
    /// waiting on it keep waiting instead of taking it over at its first
    /// end. Sent on its own (it must not hold the load up); a lost one
    /// leaves the lock to end as it would have. How it went is told to
    /// `lapse`, once: [`LockLapse::landed`], or [`LockLapse::report`] for a move
    /// refused (the lock is gone or another's), not sent or not answered;
    /// until then, and after a report, the holder's fill is written as a
    /// late one.
    fn extend_lock(&self, key: &CacheKey, token: &LockToken, ttl: Duration, lapse: LockLapse) {
        let _ = (key, token, ttl);
        // Nothing moved: the lock ends as it would have.
        lapse.report();
    }

    /// Waits at most `timeout` for another instance's lock on `key` to go
    /// (`holder`: the token [`try_lock`](Self::try_lock) reported, so a lock
    /// found gone is told apart from a later holder's).
    fn wait_unlock<'a>(
        &'a self,
        key: &'a CacheKey,
        holder: Option<&'a LockToken>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Unlocked, TierError>> {
        let _ = (key, holder, timeout);
        Box::pin(async { Ok(Unlocked::Gone) })
    }

    /// Whether the tier is being asked at all (a tier behind a circuit
    /// breaker says no while it is open): the HTTP layer says so in
    /// `cache-status`.
    fn available(&self) -> bool {
        true
    }

    /// The tier's own counters, merged into the engine's [`crate::Stats`].
    fn report(&self) -> TierReport {
        TierReport::default()
    }

    /// What the tier's connection last failed with (refused, a TLS
    /// handshake, authentication), for an operator: `None` if it never did.
    fn last_failure(&self) -> Option<TierFailure> {
        None
    }
}

/// A shared tier's last connection failure (see [`Tier::last_failure`]).
///
/// ```
/// let failure = tiercache_core::TierFailure::new("connection refused", 3);
/// assert_eq!(failure.message, "connection refused");
/// assert_eq!(failure.seconds_ago, 3);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct TierFailure {
    /// What failed, as the tier's client said it (and the server it named).
    pub message: String,
    /// How long ago, in whole seconds.
    pub seconds_ago: u64,
}

impl TierFailure {
    /// A failure `seconds_ago` seconds ago.
    pub fn new(message: impl Into<String>, seconds_ago: u64) -> Self {
        Self {
            message: message.into(),
            seconds_ago,
        }
    }
}

/// What a tier counts by itself (writes happen off the request path, decode
/// failures are misses to the engine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct TierReport {
    /// Writes waiting in the write queue now.
    pub write_queue: u64,
    /// Bytes those writes hold (fills' copies, and the answers lock
    /// releases share), within the tier's bound.
    pub write_queue_bytes: u64,
    /// Writes dropped because the write queue was full.
    pub write_drops: u64,
    /// Writes that failed or timed out.
    pub write_errors: u64,
    /// Reads whose bytes did not decode (corrupt, truncated, foreign, unknown version).
    pub corrupt: u64,
    /// Operations skipped because the circuit breaker was open.
    pub skipped: u64,
    /// Times the breaker opened.
    pub breaker_trips: u64,
    /// Whether the breaker is open now.
    pub breaker_open: bool,
    /// Whether the message stream is lost now: while the tier answers, L1
    /// hits read it instead (see [`InvalidationSink::deaf`]).
    pub deaf: bool,
    /// Invalidations received from other instances.
    pub invalidations_received: u64,
    /// Times the message stream was lost and L1 dropped as a precaution.
    pub resyncs: u64,
    /// Fleet-wide fill locks taken by this instance.
    pub locks_acquired: u64,
    /// Lock attempts answered that another instance's load met the origin
    /// failing a moment ago: origin calls the fleet was spared (this
    /// instance's stale copies answered instead; see
    /// [`Tier::try_lock_unless_failing`]).
    pub failing_marks: u64,
    /// Moves of a held fill lock that did not land: refused (the lock had
    /// ended under its load, or the tier lost it, and it may be another
    /// instance's now), unanswered, or not sent. Each such load's fill is
    /// written as a late one (see [`LockLapse`]).
    pub locks_lost: u64,
    /// Waits on another instance's fill lock, one per request and holder
    /// waited on (however often the wait looks at the lock again): counted
    /// by the engine and added to this (a tier's own count, normally 0).
    pub lock_waits: u64,
    /// Lock releases sent again after a failure (they are retried until
    /// they land or the lock would have expired anyway).
    pub release_retries: u64,
    /// Fills kept out of L2, or deleted from it again, because an
    /// invalidation overtook them on their way to Valkey (another
    /// instance's, or this one's own behind a slow queue; after a
    /// reconnection, any fill of the last moments, since messages may have
    /// been missed). A delete again counts only when Valkey still held
    /// the fill.
    pub fills_overtaken: u64,
    /// Times the tier's own client was asked to reconnect because Valkey
    /// stayed out (the breaker open for seconds, a ping unanswered): a
    /// connection gone silent, or a server down. Requests, counted when
    /// made (one that times out included).
    pub reconnects_forced: u64,
    /// Failures of the tier's connections (a connection or reconnection
    /// refused, a TLS handshake or authentication that failed, one lost);
    /// the last one's message is [`Tier::last_failure`].
    pub connection_errors: u64,
}

/// A shared tier failed (unreachable, timed out, refused).
#[derive(Debug)]
#[non_exhaustive]
pub struct TierError {
    message: String,
    timeout: bool,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TierError {
    /// The operation ran past the tier's timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            timeout: true,
            source: None,
        }
    }

    /// Whether this is a timeout.
    pub fn is_timeout(&self) -> bool {
        self.timeout
    }

    /// An error with a message and an optional cause.
    pub fn new(
        message: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            message: message.into(),
            timeout: false,
            source,
        }
    }
}

impl fmt::Display for TierError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shared cache tier failed: {}", self.message)
    }
}

impl std::error::Error for TierError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}

#[cfg(any(test, feature = "test-util"))]
pub use memory::MemoryTier;

#[cfg(any(test, feature = "test-util"))]
mod memory {
    use super::*;
    use crate::Clock;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::SystemTime;

    /// An in-memory [`Tier`] for unit tests of the engine (never a stand-in
    /// for Valkey where Valkey is the point). Its expiry follows the given
    /// clock. It has no fleet: no locks, no messages.
    #[derive(Debug, Clone)]
    pub struct MemoryTier {
        clock: Arc<dyn Clock>,
        map: Arc<Mutex<HashMap<bytes::Bytes, (Entry, SystemTime)>>>,
        tags: Arc<Mutex<HashMap<bytes::Bytes, Vec<bytes::Bytes>>>>,
        /// Invalidations wait until this turns true (see
        /// [`holding_invalidations`](Self::holding_invalidations)).
        held: Option<tokio::sync::watch::Receiver<bool>>,
    }

    impl MemoryTier {
        /// An empty tier on `clock`.
        pub fn new(clock: Arc<dyn Clock>) -> Self {
            Self {
                clock,
                map: Arc::default(),
                tags: Arc::default(),
                held: None,
            }
        }

        /// An empty tier on `clock` whose invalidations wait until the
        /// sender returned is set to `true` (a shared tier that hangs:
        /// for tests of callers that go away meanwhile).
        pub fn holding_invalidations(
            clock: Arc<dyn Clock>,
        ) -> (Self, tokio::sync::watch::Sender<bool>) {
            let (open, held) = tokio::sync::watch::channel(false);
            let tier = Self {
                held: Some(held),
                ..Self::new(clock)
            };
            (tier, open)
        }

        /// Number of stored keys, dead or alive.
        pub fn len(&self) -> usize {
            self.map.lock().unwrap().len()
        }

        /// Whether nothing is stored.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }
    }

    impl Tier for MemoryTier {
        fn get<'a>(
            &'a self,
            key: &'a CacheKey,
        ) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
            let now = self.clock.now();
            let hit = self
                .map
                .lock()
                .unwrap()
                .get(key.full())
                .and_then(|(e, until)| {
                    until.duration_since(now).ok().map(|remaining| TierHit {
                        entry: e.clone(),
                        remaining,
                    })
                });
            Box::pin(async move { Ok(hit) })
        }

        fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[Bytes]) {
            let until = self.clock.now() + ttl;
            self.map
                .lock()
                .unwrap()
                .insert(key.full().clone(), (entry.clone(), until));
            self.record_tags(key, tags);
        }

        fn put_over(
            &self,
            key: &CacheKey,
            entry: &Entry,
            ttl: Duration,
            tags: &[Bytes],
            read: &Entry,
        ) {
            let now = self.clock.now();
            let mut map = self.map.lock().unwrap();
            // As Valkey: the same fill (to the millisecond), still alive; a
            // renewal never creates.
            let replaced = map.get(key.full()).is_some_and(|(held, until)| {
                *until > now && held.created_ms() == read.created_ms()
            });
            if replaced {
                map.insert(key.full().clone(), (entry.clone(), now + ttl));
                drop(map);
                self.record_tags(key, tags);
            }
        }

        fn invalidate<'a>(
            &'a self,
            invalidation: Invalidation,
        ) -> BoxFuture<'a, Result<(), TierError>> {
            let held = self.held.clone();
            Box::pin(async move {
                if let Some(mut held) = held {
                    let _ = held.wait_for(|open| *open).await;
                }
                self.apply(invalidation);
                Ok(())
            })
        }
    }

    impl MemoryTier {
        fn record_tags(&self, key: &CacheKey, tags: &[Bytes]) {
            let mut index = self.tags.lock().unwrap();
            for tag in tags {
                index
                    .entry(tag.clone())
                    .or_default()
                    .push(key.full().clone());
            }
        }

        fn apply(&self, invalidation: Invalidation) {
            let mut map = self.map.lock().unwrap();
            match invalidation {
                Invalidation::Keys(hashes) => map
                    .retain(|full, _| !hashes.contains(&CacheKey::from_full(full.clone()).hash())),
                Invalidation::Tag(tag, hashes) => {
                    let tagged = self.tags.lock().unwrap().remove(&tag).unwrap_or_default();
                    map.retain(|full, _| {
                        !tagged.contains(full)
                            && !hashes.contains(&CacheKey::from_full(full.clone()).hash())
                    });
                }
                Invalidation::Prefix(pattern) => map.retain(|full, _| !pattern.matches_full(full)),
            }
        }
    }
}
