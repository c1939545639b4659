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

mod breaker;
pub mod codec;
mod tier;

pub use tier::{ValkeyConfig, ValkeyError, ValkeyTier};
