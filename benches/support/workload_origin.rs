//! The origin of `benches/workload.rs`, also served behind the Rust peers
//! by `benches/peers`: 50 ms a call, at most 64 at once, bodies of 2–20 KiB
//! by key, every response `public, max-age=5`; it records when each call
//! began and the most calls it was asked to run at once.

#![allow(dead_code)] // each includer uses its own part

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

/// Each entry's lifetime, as the origin declares it.
pub(crate) const LIFETIME: Duration = Duration::from_secs(5);
/// The origin's time per call.
pub(crate) const ORIGIN_LATENCY: Duration = Duration::from_millis(50);
/// Calls the origin runs at once (more wait for a slot).
pub(crate) const ORIGIN_CAP: usize = 64;

/// The origin's state: its pool, and its record.
struct Origin {
    pool: tokio::sync::Semaphore,
    asked: AtomicUsize,
    demand: AtomicUsize,
    times: std::sync::Mutex<Vec<u64>>,
}

/// The largest body, sliced per key.
static BODY: [u8; 20 * 1024] = [b'x'; 20 * 1024];

fn body_size(key: u64) -> usize {
    2048 + (key.wrapping_mul(2_654_435_761) % (18 * 1024 + 1)) as usize
}

/// `/k/{key}` (the origin's work) and `/_origin` (its record; never cached:
/// `no-store`, and outside any cached route).
pub(crate) fn origin_routes() -> (axum::Router, axum::Router) {
    use axum::extract::{Path as UrlPath, State};
    use axum::routing::get;
    let origin = Arc::new(Origin {
        pool: tokio::sync::Semaphore::new(ORIGIN_CAP),
        asked: AtomicUsize::new(0),
        demand: AtomicUsize::new(0),
        times: std::sync::Mutex::new(Vec::new()),
    });
    let work = axum::Router::new()
        .route(
            "/k/{key}",
            get(
                |State(o): State<Arc<Origin>>, UrlPath(key): UrlPath<u64>| async move {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as u64;
                    o.times.lock().unwrap().push(now);
                    let asked = o.asked.fetch_add(1, SeqCst) + 1;
                    o.demand.fetch_max(asked, SeqCst);
                    let permit = o.pool.acquire().await.unwrap();
                    tokio::time::sleep(ORIGIN_LATENCY).await;
                    drop(permit);
                    o.asked.fetch_sub(1, SeqCst);
                    (
                        [
                            ("cache-control", "public, max-age=5"),
                            ("content-type", "application/octet-stream"),
                        ],
                        Bytes::from_static(&BODY[..body_size(key)]),
                    )
                },
            ),
        )
        .with_state(origin.clone());
    let record = axum::Router::new()
        .route(
            "/_origin",
            get(|State(o): State<Arc<Origin>>| async move {
                let mut text = format!("demand {}\n", o.demand.load(SeqCst));
                for t in o.times.lock().unwrap().iter() {
                    text.push_str(&t.to_string());
                    text.push('\n');
                }
                ([("cache-control", "no-store")], text)
            }),
        )
        .with_state(origin);
    (work, record)
}
