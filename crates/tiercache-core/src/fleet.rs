//! Many instances, one shared tier: cluster-wide fill locks and
//! invalidations that reach every instance's L1.
//!
//! The engine speaks to the fleet only through its [`Tier`]: a tier that
//! supports it takes fill locks ([`Tier::try_lock`]), wakes the instances
//! waiting on one ([`Tier::unlock`], [`Tier::wait_unlock`]), and carries
//! [`Invalidation`]s to the other instances, which apply them through the
//! [`InvalidationSink`] the engine registers ([`Tier::listen`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::{CacheKey, KeyHash, KeyPattern, Tier};

/// What an invalidation reaches. Sent to the other instances as is; each
/// drops the matching entries from its L1.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// These keys.
    Keys(Vec<KeyHash>),
    /// Every entry stored with this tag (surrogate key), and these keys,
    /// which the sender found under the tag.
    Tag(Bytes, Vec<KeyHash>),
    /// Every key the pattern matches.
    Prefix(KeyPattern),
}

/// A fill lock held in the shared tier, identified by a random token so only
/// its owner releases it.
#[derive(Clone, PartialEq, Eq)]
pub struct LockToken(pub Bytes);

impl fmt::Debug for LockToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LockToken(..)")
    }
}

/// Where a tier tells a lock's holder how a move of its lock went (see
/// [`Tier::extend_lock`]): [`landed`](Self::landed), or
/// [`report`](Self::report)ed not landed. Until it is told, and once a move
/// did not land, the lock may have ended under the load, and another
/// instance taken it and stored meanwhile, so the load's fill is written
/// as a late one (it gives way to a newer fill, see
/// [`Tier::put_unless_newer`]).
///
/// ```
/// use tiercache_core::LockLapse;
///
/// let lapse = LockLapse::default();
/// assert!(!lapse.reported());
/// lapse.clone().report(); // told by the tier, from its own task
/// assert!(lapse.reported());
/// ```
#[derive(Debug, Clone, Default)]
pub struct LockLapse(Arc<LapseState>);

#[derive(Debug, Default)]
struct LapseState {
    lapsed: AtomicBool,
    /// Moves sent and not told landed (a move reported stays counted:
    /// the lapse is for good, and the count is then never read alone
    /// between two changes).
    unanswered: AtomicIsize,
}

impl LockLapse {
    /// The move was refused (the lock is not this holder's any more), or
    /// was not sent or not answered in time: it may not have landed. Told
    /// once a move, as [`landed`](Self::landed) is.
    pub fn report(&self) {
        self.0.lapsed.store(true, Relaxed);
    }

    /// The move landed: the lock is the holder's until its new end. Told
    /// once a move, and never for a move reported.
    pub fn landed(&self) {
        self.0.unanswered.fetch_sub(1, Relaxed);
    }

    /// Whether a move was reported not landed, or one is not answered yet.
    pub fn reported(&self) -> bool {
        self.0.lapsed.load(Relaxed) || self.0.unanswered.load(Relaxed) > 0
    }

    /// A move is about to be sent.
    fn sending(&self) {
        self.0.unanswered.fetch_add(1, Relaxed);
    }

    /// The lock's end, as reckoned here, passed or is near.
    fn lapse(&self) {
        self.0.lapsed.store(true, Relaxed);
    }
}

/// A late fill's terms (see [`Tier::put_unless_newer`]): when its load
/// began, and the fleet lock the load held on the fill's key, if any.
///
/// ```
/// use std::time::SystemTime;
/// use tiercache_core::{LateFill, LockToken};
///
/// let late = LateFill::new(SystemTime::now(), Some(LockToken("t1".into())));
/// assert!(late.holder.is_some());
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LateFill {
    /// When the load began (this instance's clock).
    pub since: std::time::SystemTime,
    /// The token of the fleet lock the load took on the key: while the
    /// tier finds another token there, another instance took the lock
    /// after this one's ended, so its load began after this one's and
    /// its answer is on its way; this fill gives way to it. `None` for a
    /// load without a lock of its own (beside one given up on).
    pub holder: Option<LockToken>,
}

impl LateFill {
    /// The terms of a fill whose load began at `since`, holding `holder`.
    pub fn new(since: std::time::SystemTime, holder: Option<LockToken>) -> Self {
        Self { since, holder }
    }
}

/// The answer to [`Tier::try_lock`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockAttempt {
    /// This instance holds the lock now.
    Acquired(LockToken),
    /// Another instance holds it, for at most this much longer; `holder`
    /// is its token when the tier tells it (to find what that holder
    /// shared, see [`Tier::wait_unlock`]).
    Held {
        /// How long the lock lives at most.
        left: Duration,
        /// The holder's token.
        holder: Option<LockToken>,
    },
    /// The tier has no locks (the engine keeps its local single flight only).
    Unsupported,
    /// Nothing taken: another instance's load of the key met the origin
    /// failing a moment ago, and says so for `left` more (see
    /// [`Tier::try_lock_unless_failing`]).
    Failing {
        /// How long the mark lasts (the tier's clock).
        left: Duration,
    },
}

/// How a wait on another instance's lock ended (and how an owner
/// announces its release, [`Tier::unlock`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Unlocked {
    /// The owner stored a fill: read the shared tier.
    Filled,
    /// The owner's response may not be shared: go to the origin without
    /// waiting on anyone.
    Passed,
    /// The owner's answer may be shared but was not stored (an origin
    /// error any client may see): here it is, so the fleet's waiting
    /// instances answer with it instead of each calling the failing origin.
    /// `true` marks an origin failure (stale-if-error applies).
    Shared(crate::Entry, bool),
    /// The owner's load failed (the origin's error, or its answer broke
    /// off) with nothing any client may see: the waiting instances answer
    /// with the failure (or their stale copies) instead of each calling
    /// the failing origin.
    Failed,
    /// The lock is gone without a word (expired, or released before the
    /// wait began): read the shared tier, then try to lock.
    Gone,
    /// The wait's time ran out with the lock still held.
    TimedOut,
}

/// What a tier calls when another instance invalidated something, or when
/// it may have missed messages.
pub trait InvalidationSink: Send + Sync + 'static {
    /// Applies another instance's invalidation to this instance's L1.
    fn apply(&self, invalidation: &Invalidation);

    /// The tier lost its message stream (reconnect, lag): messages may have
    /// been missed, so every L1 entry is dropped.
    fn resync(&self);

    /// The tier cannot hear other instances (its message stream is down):
    /// what L1 holds may have been invalidated elsewhere meanwhile. The
    /// default drops L1 ([`resync`](Self::resync)); the engine instead makes
    /// every entry need the origin again (no longer fresh, nor answered
    /// while it revalidates), keeping it for stale-if-error and for its
    /// validators, so an instance cut off from the origin too still has
    /// its stale copies.
    fn unheard(&self) {
        self.resync();
    }

    /// Prefix bans learned late (read from the shared tier after copies may
    /// have been promoted), each a pattern and a time: drops the L1 entries a
    /// ban's pattern matches that were created at or before its time, and
    /// nothing else (loads in flight and later copies stay). By default,
    /// every entry a pattern matches.
    fn drop_banned(&self, bans: &[(crate::KeyPattern, std::time::SystemTime)]) {
        for (pattern, _) in bans {
            self.apply(&Invalidation::Prefix(pattern.clone()));
        }
    }

    /// The tier's message stream is lost (`true`: its connection failed or
    /// went silent) or back, with L1 resynced since (`false`). While it is
    /// lost and the tier still answers, another instance's write may be
    /// acknowledged unheard here: the engine then answers no L1 copy as
    /// fresh (each request reads the tier, which the write changed). By
    /// default, nothing.
    fn deaf(&self, deaf: bool) {
        let _ = deaf;
    }

    /// Copies of these keys may be ones the shared tier no longer holds
    /// (an overtaken fill it deleted again, read by some instance first):
    /// drops them from L1, and nothing else (no load in flight is
    /// refused; a newer copy dropped with them costs one miss). By
    /// default, as an invalidation of the keys.
    fn drop_copies(&self, hashes: &[KeyHash]) {
        self.apply(&Invalidation::Keys(hashes.to_vec()));
    }

    /// Copies of `hash` created at one of `created` (to the millisecond)
    /// are no longer backed by the shared tier, which holds a newer fill (a
    /// renewal of an old one was refused there, or a later load's late
    /// fill replaced it: see [`Tier::put_unless_newer`]): drops them from L1, and
    /// nothing else (the newer fill's copies stay). By default, as
    /// [`drop_copies`](Self::drop_copies).
    fn drop_fill(&self, hash: KeyHash, created: &[std::time::SystemTime]) {
        let _ = created;
        self.drop_copies(&[hash]);
    }
}

/// A leader's hold on the fleet-wide fill lock for one key. Release it with
/// [`release`](Self::release) once the fill is stored (queued writes land
/// first); dropping it releases it as gone (failed, in a panic), so waiting
/// instances take the lock in turn (or fail) instead of waiting it out.
#[must_use = "dropping the lock releases it as gone"]
pub(crate) struct FleetLock {
    held: Option<(Arc<dyn Tier>, CacheKey, LockToken)>,
    /// How the load's progress moves the lock on (see [`LockExtension`]).
    extension: Option<Arc<LockExtension>>,
}

impl fmt::Debug for FleetLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetLock")
            .field("held", &self.held.is_some())
            .finish()
    }
}

impl FleetLock {
    /// No lock in the shared tier (none there, or it is unreachable): the
    /// local single flight alone protects the origin.
    pub(crate) fn local() -> Self {
        Self {
            held: None,
            extension: None,
        }
    }

    /// A lock taken by an attempt sent at `asked`, to live `hold` from
    /// then (its `PX` counts from a moment later) unless the load's
    /// progress moves it on.
    pub(crate) fn held(
        tier: Arc<dyn Tier>,
        (key, token): (CacheKey, LockToken),
        hold: Duration,
        asked: Instant,
    ) -> Self {
        let extension = LockExtension {
            tier: tier.clone(),
            key: key.clone(),
            token: token.clone(),
            start: asked,
            hold: nanos(hold),
            end: AtomicU64::new(nanos(hold)),
            limit: nanos(hold.saturating_mul(crate::flight::PROGRESS_WAITS_AT_MOST)),
            done: AtomicBool::new(false),
            lapsed_once: LockLapse::default(),
        };
        Self {
            held: Some((tier, key, token)),
            extension: Some(Arc::new(extension)),
        }
    }

    /// What moves the lock on as the load makes progress (none for a local
    /// lock).
    pub(crate) fn extension(&self) -> Option<Arc<LockExtension>> {
        self.extension.clone()
    }

    /// Releases the lock, telling the waiting instances how the fill ended:
    /// stored (they read it), shared unstored (they answer with it), failed
    /// (they answer with the failure), passed (they load), or gone (they
    /// take the lock in turn). `failing`: the load met the origin failing,
    /// which the fleet is told for a while (see [`Tier::unlock_failing`]).
    pub(crate) fn release(mut self, how: Unlocked, failing: bool) {
        self.stop_extending();
        if let Some((tier, key, token)) = self.held.take() {
            unlock(&*tier, &key, &token, how, failing);
        }
    }

    /// The lock's token, when it is held in the shared tier.
    pub(crate) fn token(&self) -> Option<LockToken> {
        self.held.as_ref().map(|(_, _, token)| token.clone())
    }

    /// Whether the load's fill is written as a late one (see
    /// [`Tier::put_unless_newer`](crate::Tier::put_unless_newer)): the lock
    /// has ended by its `PX` under its load (which made no progress that
    /// moved it on for a whole wait), or is about to (an eighth of a hold
    /// from it), or a move of it did not land, so another instance may
    /// have taken it and loaded since. A local lock is never late.
    pub(crate) fn late(&self) -> bool {
        self.held.is_some() && self.extension.as_ref().is_some_and(|e| e.lapsed())
    }

    fn stop_extending(&self) {
        if let Some(extension) = &self.extension {
            extension.done.store(true, Relaxed);
        }
    }
}

impl Drop for FleetLock {
    fn drop(&mut self) {
        self.stop_extending();
        if let Some((tier, key, token)) = self.held.take() {
            // Dropped by the origin's panic: the waiting instances fail as
            // the local waiters do, and the fleet leaves the origin alone
            // a moment (a panic counts as its failure). Else the fill was
            // cancelled (its callers left): one of them takes the lock in
            // turn.
            let panicking = std::thread::panicking();
            let how = if panicking {
                Unlocked::Failed
            } else {
                Unlocked::Gone
            };
            unlock(&*tier, &key, &token, how, panicking);
        }
    }
}

/// A held lock's release, telling the fleet its origin is failing when
/// the load met it so.
fn unlock(tier: &dyn Tier, key: &CacheKey, token: &LockToken, how: Unlocked, failing: bool) {
    if failing {
        tier.unlock_failing(key, token, how, crate::engine::RETRY_FAILING_AFTER);
    } else {
        tier.unlock(key, token, how);
    }
}

/// A held fleet lock's end, moved on by its load's progress: to `hold`
/// from the last sign of life, as a local flight's deadline is, so the
/// instances waiting on it keep waiting on a slow body that keeps coming
/// instead of each taking the lock over at its first end and calling the
/// origin. A quarter of a hold apart at most (one command per quarter
/// hold, not per frame), and up to four holds from the lock's take: what
/// the waiting instances follow, as their own waiters do (see
/// [`Progress`](crate::Progress)). An origin gone quiet lets it end.
pub(crate) struct LockExtension {
    tier: Arc<dyn Tier>,
    key: CacheKey,
    token: LockToken,
    start: Instant,
    /// Nanoseconds, as the others below, from `start`.
    hold: u64,
    /// Where the lock ends as last moved.
    end: AtomicU64,
    limit: u64,
    /// Released: nothing left to move.
    done: AtomicBool,
    /// Its end passed before a move, or a move did not land or is not
    /// answered yet (see [`lapsed`](Self::lapsed)).
    lapsed_once: LockLapse,
}

impl LockExtension {
    /// Whether the lock's end, as last moved, has passed (now, or before
    /// a move) or is an eighth of a hold away, or a move did not land (see
    /// [`FleetLock::late`]).
    fn lapsed(&self) -> bool {
        let now = nanos(Instant::now().saturating_duration_since(self.start));
        self.lapsed_once.reported() || now.saturating_add(self.hold / 8) >= self.end.load(Relaxed)
    }

    /// The load made progress now: moves the lock to end `hold` from now
    /// if that is a quarter hold past its end as last moved (within four
    /// holds of its take).
    pub(crate) fn made(&self) {
        if self.done.load(Relaxed) {
            return;
        }
        let now = nanos(Instant::now().saturating_duration_since(self.start));
        let end = self.end.load(Relaxed);
        // Near or past its end as reckoned here (a little early): a move
        // may land too late, and the lock be taken, moved on or not.
        if now.saturating_add(self.hold / 8) >= end {
            self.lapsed_once.lapse();
        }
        let moved = now.saturating_add(self.hold).min(self.limit);
        // Past its limit (the lock has lapsed by then), or not a quarter
        // hold later than it ends now.
        if moved <= now || moved < end.saturating_add(self.hold / 4) {
            return;
        }
        // Until it is answered, the fill is a late one: counted before
        // the end moves here, so no fill sees the one without the other.
        let lapse = self.lapsed_once.clone();
        lapse.sending();
        // One caller moves it; a frame at the same moment has nothing to add.
        if self
            .end
            .compare_exchange(end, moved, Relaxed, Relaxed)
            .is_ok()
        {
            let ttl = Duration::from_nanos(moved - now);
            self.tier.extend_lock(&self.key, &self.token, ttl, lapse);
        } else {
            lapse.landed();
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What the engine's fleet lock step decided.
#[derive(Debug)]
pub(crate) enum FleetJoin {
    /// Load from the origin, holding this lock (perhaps only a local one).
    Lead(FleetLock),
    /// Another instance filled the key while this one waited: its entry,
    /// read from the shared tier and promoted to L1.
    Filled(crate::Entry),
    /// Another instance's answer, shared but not stored (`true`: an origin
    /// failure).
    Shared(crate::Entry, bool),
    /// Another instance's load failed with nothing to share.
    Failed,
    /// Another instance's load met the origin failing a moment ago (the
    /// fleet's mark, this long left): nothing was asked, and the stale
    /// copy answers.
    Failing(Duration),
}
