//! HTTP semantics and safety: leaks, poisoning and abuse, each case through
//! the layer on an axum app and through the proxy over real sockets, with a
//! real Valkey as L2 behind both.
//!
//! The origin reflects what it received (method, target, headers, body) and
//! counts its calls; query parameters (and `x-respond-*` request headers, for
//! unsafe methods) choose the response's status and headers. Every case
//! asserts on what the victim's response says and on the origin's counter.

//! One test binary, a module per concern: `harness` (the origin and the
//! apps under test), `storage`, `conformance`, `invalidation`, `poisoning`, `abuse`.

mod abuse;
mod conformance;
mod harness;
mod invalidation;
mod poisoning;
mod storage;
mod streams;
