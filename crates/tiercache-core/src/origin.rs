//! What a caller supplies to [`TieredCache::fetch`](crate::TieredCache::fetch)
//! (the origin, and which stored entries answer its request) and what it
//! gets back.
//!
//! The engine owns the whole sequence: L1 and its freshness, XFetch and
//! stale-while-revalidate refreshes, the single flight and its deadline, the
//! L2 read, the fleet lock, the origin call with its soft timeout,
//! stale-if-error, revalidation, storage and the bookkeeping. The caller says
//! only how to load, and whether what it loaded may be stored and shared:
//! HTTP rules reach the engine as data ([`Loaded`]), never as HTTP.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::{CacheKey, Entry, Fill, Progress, Source, Value};

/// Which stored entries answer one request. Every method has a default for
/// a caller without variants (the programmatic API).
pub trait Select {
    /// Whether `entry` may answer this request (the HTTP layer checks the
    /// entry's `Vary` variant and content coding).
    fn accepts(&self, entry: &Entry) -> bool {
        let _ = entry;
        true
    }

    /// `latest`, the entry stored under the requested key, answers another
    /// variant: the key this request's variant is stored under, when
    /// `latest` says how to find it (the HTTP layer reads its `Vary` names).
    fn variant_key(&self, requested: &CacheKey, latest: &Entry) -> Option<CacheKey> {
        let _ = (requested, latest);
        None
    }

    /// Whether `entry` must be revalidated with the origin before each use
    /// (HTTP's `no-cache`): it is then sent to [`Origin::load`] as the entry
    /// to revalidate, never answered as is.
    fn must_revalidate(&self, entry: &Entry) -> bool {
        let _ = entry;
        false
    }

    /// The request asks the cache to go to the origin (a client's `no-cache`
    /// that the route honours): the L1 entry, if any, is only revalidated.
    fn reload(&self) -> bool {
        false
    }

    /// Told of what the engine did for this request that its answer does
    /// not show (waits on other requests' loads), for per-route metrics.
    fn observe(&self, event: Event) {
        let _ = event;
    }
}

/// No variants: every entry under the key answers.
impl Select for () {}

/// Something the engine did on behalf of one request (see [`Select::observe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// This request waited on another's load for this long.
    LockWait(Duration),
    /// The wait reached the flight's deadline.
    LockTimeout,
}

/// How to load a key from the origin. A closure
/// `FnOnce(Option<Entry>) -> impl Future<Output = Result<Loaded<T>, E>>` is an
/// origin with no variants; a type that needs variants implements [`Select`]
/// too.
pub trait Origin: Select + Send + 'static {
    /// What the caller gets back when the origin's answer is neither stored
    /// nor shared (the HTTP layer's streaming response).
    type Output: Send + 'static;
    /// The origin's error.
    type Error: Send + 'static;

    /// Calls the origin. `stale` is an entry to revalidate (its validators)
    /// when there is one; the answer may then renew it (an HTTP 304 becomes
    /// [`Loaded::Store`] of the renewed entry).
    fn load(
        self,
        stale: Option<Entry>,
    ) -> impl Future<Output = Result<Loaded<Self::Output>, Self::Error>> + Send;

    /// [`load`](Self::load), telling the engine of its progress: each
    /// [`Progress::made`] (the origin answered, more of a body came) moves
    /// the deadline of the requests waiting on this load to the policy's
    /// `lock_timeout` from then (up to four `lock_timeout`s from the
    /// flight's start), so a slow answer that keeps coming is waited for
    /// rather than asked for again. What the engine calls; the
    /// default ignores the progress.
    fn load_with(
        self,
        stale: Option<Entry>,
        progress: Progress,
    ) -> impl Future<Output = Result<Loaded<Self::Output>, Self::Error>> + Send
    where
        Self: Sized,
    {
        let _ = progress;
        self.load(stale)
    }
}

/// What the origin produced, and what may be done with it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Loaded<T> {
    /// Store it (L1 and L2) and share it with the waiting requests.
    Store(Fill),
    /// Share it with the waiting requests, but do not store it: an error
    /// page any client may see, or a value the loader chose not to keep.
    /// `failed` marks an origin failure (an HTTP 5xx): a stale entry inside
    /// stale-if-error answers instead.
    Share {
        /// The answer.
        value: Value,
        /// Whether it is an origin failure.
        failed: bool,
    },
    /// Neither store nor share: the answer is this caller's alone (a private
    /// response, one made for a credentialed request). The waiting requests
    /// go to the origin each on their own.
    Pass {
        /// The caller's answer.
        output: T,
        /// Whether it is an origin failure (stale-if-error applies).
        failed: bool,
        /// Remember the key as uncacheable for the policy's hit-for-miss
        /// time, so later requests go straight to the origin instead of
        /// queueing behind one another.
        uncacheable: bool,
    },
    /// Neither stored nor shared for a reason of the moment, not of the
    /// resource: the caller had no room to hold the answer whole (the HTTP
    /// layer's bound on bodies being read, `detail=busy`), so it streams
    /// to this caller alone. Unlike [`Loaded::Pass`], the key is not marked
    /// uncacheable, an entry this load refreshed stays as it is (it is not
    /// outdated), and the requests waiting on this load try again (one of
    /// them loads, the others wait on it; on other instances too) for as
    /// long as a flight may be waited on, instead of each calling the
    /// origin.
    Busy {
        /// The caller's answer.
        output: T,
        /// Whether it is an origin failure (stale-if-error applies).
        failed: bool,
    },
    /// The origin failed in a way that says nothing about this request
    /// (its answer broke off midway), and this is the caller's own answer
    /// of that failure. As for an error from [`Origin::load`], the requests
    /// waiting on this load, here and on the other instances waiting on
    /// its fleet lock, get the failure ([`FetchError::Failed`]) or their
    /// stale copies (stale-if-error), not an origin call each; the key is
    /// not marked uncacheable, and an entry this load refreshed stays.
    Failed {
        /// The caller's answer.
        output: T,
    },
}

/// What a [`fetch`](crate::TieredCache::fetch) answered with.
#[derive(Debug)]
pub enum Fetched<T> {
    /// An entry answers: from a tier, or the origin's answer (stored, or
    /// shared without being stored).
    Entry(Answer),
    /// The origin's answer, neither stored nor shared.
    Passed {
        /// The origin's answer.
        output: T,
        /// This request waited on another first (whose answer could not be shared).
        collapsed: bool,
        /// The key was marked uncacheable, so the request skipped the cache.
        hit_for_miss: bool,
    },
}

/// An entry that answers a request, and how it was reached.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The entry.
    pub entry: Entry,
    /// The tier it came from (`Origin`: loaded for this request or the one it waited on).
    pub source: Source,
    /// Fresh, stale, or the origin's.
    pub served: Served,
    /// Whether this request waited on another request's load and is
    /// answered from it (or stands a stale copy in for its failure); a
    /// request that waited, then loaded on its own, is not.
    pub collapsed: bool,
}

/// How an [`Answer`] relates to the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Served {
    /// A fresh entry from a tier.
    Hit,
    /// A stale entry, and why it was allowed.
    Stale(StaleReason),
    /// The origin's answer; `stored` tells whether it was cached (an
    /// invalidation that overtook the load keeps it from being stored).
    Miss {
        /// Whether the answer was stored.
        stored: bool,
    },
    /// The origin's answer, shared with the requests that waited on it but
    /// not stored ([`Loaded::Share`]: an origin error, an ignored value).
    Shared,
}

/// Why a stale entry answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StaleReason {
    /// Inside stale-while-revalidate: a refresh runs in the background.
    Revalidating,
    /// The origin failed (stale-if-error).
    OriginError,
    /// The origin took longer than the policy's soft timeout.
    OriginTimeout,
}

impl StaleReason {
    /// The token used in `cache-status` details: `origin-error`, `origin-timeout`.
    pub fn as_str(&self) -> Option<&'static str> {
        match self {
            StaleReason::Revalidating => None,
            StaleReason::OriginError => Some("origin-error"),
            StaleReason::OriginTimeout => Some("origin-timeout"),
        }
    }
}

/// Why a [`fetch`](crate::TieredCache::fetch) has no answer.
#[derive(Debug)]
#[non_exhaustive]
pub enum FetchError<E> {
    /// This request's own origin call failed.
    Origin(E),
    /// The load this request waited on failed, with no answer it may share
    /// and no stale entry to stand in.
    Failed,
    /// The origin call panicked: this request's own (the panic travels
    /// with it: [`Panic::resume`]) or the one it waited on.
    Panicked(Panic),
}

/// A panic in an origin call. The request that made the call carries the
/// panic itself, to resume it where the origin would have panicked without a
/// cache; the requests that waited on it carry none.
pub struct Panic(pub(crate) Option<Box<dyn Any + Send>>);

impl Panic {
    /// Whether this request's own origin call panicked (not the one it waited on).
    pub fn is_own(&self) -> bool {
        self.0.is_some()
    }

    /// Resumes the origin's panic here (for the request whose call
    /// panicked), or panics with a message (for one that waited on it).
    pub fn resume(self) -> ! {
        match self.0 {
            Some(payload) => std::panic::resume_unwind(payload),
            None => panic!("the origin load this request waited on panicked"),
        }
    }
}

impl fmt::Debug for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Panic")
            .field("own", &self.is_own())
            .finish()
    }
}

impl<E: fmt::Display> fmt::Display for FetchError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchError::Origin(e) => write!(f, "loading the value failed: {e}"),
            FetchError::Failed => f.write_str(
                "the load this request waited on failed, and no stale value may stand in",
            ),
            FetchError::Panicked(_) => f.write_str("loading the value panicked"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for FetchError<E> {}

/// An origin made of a closure `FnOnce(Option<Entry>) -> Future<Output =
/// Result<Loaded<T>, E>>`, with no variants (the closure gets the entry to
/// revalidate, if any).
///
/// ```
/// use tiercache_core::{Entry, Fill, Loaded, Value, origin_fn};
///
/// let origin = origin_fn(|_stale: Option<Entry>| async {
///     Ok::<_, std::io::Error>(Loaded::<()>::Store(Fill::new(Value::from_body("v"))))
/// });
/// # let _ = origin;
/// ```
pub fn origin_fn<F>(load: F) -> FnOrigin<F> {
    FnOrigin(load)
}

/// See [`origin_fn`].
pub struct FnOrigin<F>(F);

impl<F> fmt::Debug for FnOrigin<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnOrigin(..)")
    }
}

impl<F> Select for FnOrigin<F> {}

impl<F, Fut, T, E> Origin for FnOrigin<F>
where
    F: FnOnce(Option<Entry>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Loaded<T>, E>> + Send,
    T: Send + 'static,
    E: Send + 'static,
{
    type Output = T;
    type Error = E;

    fn load(self, stale: Option<Entry>) -> impl Future<Output = Result<Loaded<T>, E>> + Send {
        (self.0)(stale)
    }
}
