#![doc = include_str!("../README.md")]
//!
//! ## Crates
//!
//! | re-export | crate | what it holds |
//! | --- | --- | --- |
//! | [`core`] | `tiercache-core` | the engine: keys, entries, policy, L1, single flight, clock, stats, the `Tier` trait |
//! | [`http`] | `tiercache-http` | the tower layer, HTTP keys, cacheability rules, cache headers |
//! | [`valkey`] | `tiercache-valkey` | the L2 on Valkey through fred (feature `valkey`) |
//! | [`dashboard`] | `tiercache-dashboard` | the live dashboard: a self-contained page and its JSON, as an axum `Router` (feature `dashboard`) |
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `valkey` | yes | [`valkey`]: `ValkeyTier`, `ValkeyConfig` |
//! | `dashboard` | yes | [`dashboard`]: the live dashboard, an axum `Router` |

pub use tiercache_core as core;
#[cfg(feature = "dashboard")]
pub use tiercache_dashboard as dashboard;
pub use tiercache_http as http;
#[cfg(feature = "valkey")]
pub use tiercache_valkey as valkey;

pub use tiercache_core::{
    BuildError, CacheKey, Clock, Commit, FetchError, Fetched, Fill, Jitter, LoadError, Loaded,
    Origin, Policy, PolicyBuilder, PolicyError, Select, Source, Stats, SystemClock, TieredCache,
    TieredCacheBuilder, Value,
};
pub use tiercache_http::paths::Invalidate;
pub use tiercache_http::{PathLayer, ResponseCache, ResponseCacheLayer};
