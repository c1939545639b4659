//! The tiercache engine: a two-tier cache with jittered TTLs and single-flight loads.
//!
//! This crate has no HTTP, no tower and no Valkey in it. It holds:
//!
//! - [`CacheKey`]: structured, length-prefixed keys, hashed for the tiers;
//! - [`Entry`] and [`Value`]: what is stored, with its times;
//! - [`Policy`]: ttl, jitter band, lock timeout, validated once;
//! - [`Tier`]: the trait a shared second tier (Valkey) implements;
//! - L1 on moka, bounded by bytes, with a sweeper and lazy expiry;
//! - single flight ([`Join`], [`Leader`], [`Follower`]);
//! - [`Clock`]: every freshness decision is made on the engine's clock;
//! - fleets ([`Invalidation`], [`FleetLock`]): invalidations that reach every
//!   instance's L1 and fill locks shared through the tier;
//! - [`Stats`]: counters for hits by tier, misses, loads, waits, expiry and eviction.
//!
//! ```
//! use std::time::Duration;
//! use tiercache_core::{CacheKey, Fill, Join, Lookup, Policy, TieredCache, Value};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cache = TieredCache::builder().build()?;
//! let policy = Policy::ttl(Duration::from_secs(30)).jitter(0.1);
//! policy.validate()?;
//! let key = CacheKey::new("report:2026");
//!
//! if let Lookup::Miss { .. } = cache.lookup(&key, &policy, |_| true) {
//!     if let Join::Leader(leader) = cache.join(&key) {
//!         let entry = cache.store(&key, Fill::new(Value::from_body("…")), &policy);
//!         leader.complete(tiercache_core::FlightResult::Shared(entry, tiercache_core::Source::Origin));
//!     }
//! }
//! assert!(matches!(cache.lookup(&key, &policy, |_| true), Lookup::Fresh { .. }));
//! # Ok(()) }
//! ```
//!
//! | feature | what it adds |
//! | --- | --- |
//! | `test-util` | `MockClock` and `MemoryTier`, for tests of code built on the engine |

mod clock;
mod engine;
mod entry;
mod fleet;
mod flight;
pub mod key;
mod l1;
mod policy;
mod stats;
mod tier;

#[cfg(any(test, feature = "test-util"))]
pub use clock::MockClock;
pub use clock::{Clock, SystemClock};
pub use engine::{BuildError, Fill, Lifetime, LoadError, Lookup, TieredCache, TieredCacheBuilder};
pub use entry::{Entry, Freshness, Source, Times, Value};
pub use fleet::{
    FleetJoin, FleetLock, Invalidation, InvalidationSink, LockAttempt, LockToken, Unlocked,
};
pub use flight::{FlightError, FlightResult, Follower, Join, Leader, Waited};
pub use key::{CacheKey, KeyBuilder, KeyHash, KeyPattern};
pub use policy::{Jitter, MAX_JITTER, MAX_LOCK_TIMEOUT, MAX_TTL, Policy, PolicyError};
pub use stats::{LatencyStats, Stats};
#[cfg(any(test, feature = "test-util"))]
pub use tier::MemoryTier;
pub use tier::{BoxFuture, Tier, TierError, TierHit, TierReport};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_freshness;
