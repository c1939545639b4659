//! The tiercache tower layer: caches HTTP responses of any tower service.
//!
//! [`ResponseCacheLayer`] wraps an axum route (or any
//! `Service<http::Request<B>>`) in [`ResponseCache`], which answers cacheable
//! requests from the engine's L1 (and L2, when configured), coalesces
//! concurrent misses into one origin call, and labels every response it
//! handles with `x-cache`, `x-cache-tier`, `x-cache-hit-ratio`,
//! `cache-status` (RFC 9211) and, on hits, `age`.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tiercache_core::{Policy, TieredCache};
//! use tiercache_http::ResponseCacheLayer;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cache = ResponseCacheLayer::new(TieredCache::builder().build()?);
//! let app: Router = Router::new()
//!     .route("/products/{id}", get(|| async { "p" }).layer(cache.route(Policy::ttl(Duration::from_secs(30)))?))
//!     .route("/live", get(|| async { "never cached" }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! Safe by default (RFC 9111): requests with `Cookie` bypass the cache unless
//! the route opts in; requests with `Authorization` are keyed per credential
//! and stored only when the response says it may be shared; inputs that are
//! not keyed (`X-Forwarded-Host` and kin, method overrides) are removed
//! before the origin sees them; responses with `Set-Cookie`, `private`,
//! `no-store` or `Vary: *` are never stored, errors only with explicit
//! freshness. `Vary` variants are kept apart (and capped), `no-cache` entries
//! are revalidated on each use, validators are answered with 304s, and
//! successful unsafe requests invalidate their target. See
//! [`request`], [`cacheable`] and [`invalidate`].
//!
//! This crate has no features.

pub mod body;
pub mod cache_control;
pub mod cacheable;
mod conditional;
mod config;
pub mod freshness;
pub mod future;
pub mod headers;
pub mod invalidate;
pub mod key;
mod layer;
pub mod metrics;
mod one_copy;
mod origin;
mod own_head;
pub mod paths;
pub mod range;
mod reading;
pub mod request;
mod respond;
mod route;
mod service;
mod stored_only;
mod target_keys;
mod values;
mod variants;
mod write;

pub use body::CacheBody;
pub use layer::ResponseCacheLayer;
pub use origin::SURROGATE_KEY;
pub use paths::PathLayer;
pub use service::ResponseCache;
pub use stored_only::{NothingStored, StoredOnly};
