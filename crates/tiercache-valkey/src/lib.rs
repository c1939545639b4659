//! The tiercache L2 on Valkey (or Redis), through fred.
//!
//! [`ValkeyTier`] implements the engine's [`tiercache_core::Tier`]: one round
//! trip per read (`GET` + `PTTL` pipelined, so a promoted copy never outlives
//! the server's own TTL), writes off the request path through a bounded queue
//! (`SET key value PX ttl`), a versioned, checksummed envelope ([`codec`]),
//! keys `PREFIX:{HASH}:e` with a cluster hash tag, command timeouts and a
//! circuit breaker. Nothing here ever fails a request: errors are counted and
//! read as misses.
//!
//! For fleets (many instances on one Valkey, standalone or cluster) it also
//! carries invalidations to every instance over pub/sub (`PREFIX:inv`; an
//! instance whose subscriber reconnects drops its L1, having perhaps missed
//! some), keeps tag sets (`PREFIX:{TAGHASH}:tag`) and prefix bans
//! (`PREFIX:bans`), and holds fleet-wide fill locks (`PREFIX:{HASH}:lock`,
//! `SET NX PX` with a random token, released by its owner only) whose
//! waiters are woken on the key's shard channel (`SPUBLISH PREFIX:{HASH}:done`).
//!
//! ```no_run
//! use tiercache_core::TieredCache;
//! use tiercache_valkey::{ValkeyConfig, ValkeyTier};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let l2 = ValkeyTier::connect(ValkeyConfig::from_url("redis://127.0.0.1:6379")?).await?;
//! let cache = TieredCache::builder().l2(l2).build()?;
//! # Ok(()) }
//! ```
//!
//! TLS (`rediss://`) uses rustls with the ring provider. This crate has no
//! features of its own.

mod bans;
mod breaker;
mod bus;
pub mod codec;
mod config;
mod deaf;
mod echo;
mod failures;
mod guard;
mod invalidate;
mod keys;
mod lock;
mod message;
mod overtaken;
mod queue;
mod reconnect;
mod report;
mod tier;
mod tier_lock;
mod writer;

pub use bans::BAN_RETENTION;
pub use config::{ValkeyConfig, ValkeyError};
pub use tier::ValkeyTier;
