//! The origin every cache in `benches/http.rs` sits in front of; the peers'
//! server (`benches/peers`) includes this same file.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::routing::get;

/// The 2 KiB body every cacheable route answers.
pub(crate) const BODY: &[u8] = &[b'x'; 2048];

/// The origin in two parts: `(cacheable, count)`.
///
/// `cacheable` has `/p/{id}` (2 KiB, `public, max-age=3600`) and
/// `/slow/{id}` (the same after 300 ms, each call counted); `count` has
/// `/count`, the number of `/slow` calls (`no-store`). A peer wraps only the
/// first part, so no cache can answer the count, whatever it honours.
pub(crate) fn origin() -> (Router, Router) {
    let calls = Arc::new(AtomicUsize::new(0));
    let headers = [
        ("cache-control", "public, max-age=3600"),
        ("content-type", "application/octet-stream"),
    ];
    let slow_calls = calls.clone();
    let cacheable = Router::new()
        .route(
            "/p/{id}",
            get(move || async move { (headers, bytes::Bytes::from_static(BODY)) }),
        )
        .route(
            "/slow/{id}",
            get(move || {
                slow_calls.fetch_add(1, SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    (headers, bytes::Bytes::from_static(BODY))
                }
            }),
        );
    let count = Router::new().route(
        "/count",
        get(move || {
            let n = calls.load(SeqCst);
            async move { ([("cache-control", "no-store")], n.to_string()) }
        }),
    );
    (cacheable, count)
}
