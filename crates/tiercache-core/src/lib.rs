//! The tiercache engine: a two-tier cache with jittered TTLs and single-flight loads.
//!
//! This crate has no HTTP, no tower and no Valkey in it. It holds:
//!
//! - [`CacheKey`]: structured, length-prefixed keys, hashed for the tiers;
//! - [`Entry`] and [`Value`]: what is stored, with its times;
//! - [`Policy`]: ttl, jitter band, lock timeout, validated once;
//! - [`Tier`]: the trait a shared second tier (Valkey) implements;
//! - L1 on moka, bounded by bytes, with a sweeper and lazy expiry;
//! - [`TieredCache::fetch`]: the one orchestration every caller goes
//!   through (L1, refreshes, single flight, L2, fleet lock, origin,
//!   stale-if-error, storage), with the origin supplied as an [`Origin`];
//! - [`Clock`]: every freshness decision is made on the engine's clock;
//! - fleets ([`Invalidation`], [`Tier::try_lock`]): invalidations that reach
//!   every instance's L1 and fill locks shared through the tier;
//! - [`Stats`]: counters for hits by tier, misses, loads, waits, expiry and eviction.
//!
//! ```
//! use std::time::Duration;
//! use tiercache_core::{CacheKey, Policy, TieredCache, Value};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cache = TieredCache::builder().build()?;
//! let policy = Policy::ttl(Duration::from_secs(30)).jitter(0.1).build()?;
//! let key = CacheKey::new("report:2026");
//!
//! let report = cache
//!     .get_or_load(&key, &policy, || async { Ok::<_, std::io::Error>(Value::from_body("…")) })
//!     .await?;
//! assert_eq!(report.body, "…");
//! assert_eq!(cache.stats().misses, 1);
//! # Ok(()) }
//! ```
//!
//! | feature | what it adds |
//! | --- | --- |
//! | `test-util` | `MockClock` and `MemoryTier`, for tests of code built on the engine |

pub mod body;
mod clock;
mod engine;
mod entry;
mod fleet;
mod flight;
pub mod key;
mod l1;
mod origin;
mod policy;
mod stats;
mod tier;

#[cfg(any(test, feature = "test-util"))]
pub use clock::MockClock;
pub use clock::{Clock, SystemClock};
pub use engine::{
    Begin, BuildError, Commit, Fill, Hit, Lifetime, LoadError, Miss, Queued, Refresh, TieredCache,
    TieredCacheBuilder, outliving_the_caller,
};
pub use entry::{Entry, Freshness, Source, Times, Value};
pub use fleet::{
    Invalidation, InvalidationSink, LateFill, LockAttempt, LockLapse, LockToken, Unlocked,
};
pub use flight::Progress;
pub use key::{CacheKey, KeyBuilder, KeyHash, KeyPattern};
pub use origin::{
    Answer, Event, FetchError, Fetched, FnOrigin, Loaded, Origin, Panic, Select, Served,
    StaleReason, origin_fn,
};
pub use policy::{
    IntoPolicy, Jitter, MAX_JITTER, MAX_LOCK_TIMEOUT, MAX_TTL, Policy, PolicyBuilder, PolicyError,
    deserialize_duration, parse_duration,
};
pub use stats::{Horizon, InvalidationStats, LatencyStats, Stats};
#[cfg(any(test, feature = "test-util"))]
pub use tier::MemoryTier;
pub use tier::{BoxFuture, Tier, TierError, TierFailure, TierHit, TierReport};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_budget;
#[cfg(test)]
mod tests_busy;
#[cfg(test)]
mod tests_detached;
#[cfg(test)]
mod tests_fleet_mark;
#[cfg(test)]
mod tests_freshness;
#[cfg(test)]
mod tests_refresh;
#[cfg(test)]
mod tests_renew;
#[cfg(test)]
mod tests_tags;
#[cfg(test)]
mod tests_takeover;
#[cfg(test)]
mod tests_unheard;
