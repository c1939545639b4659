//! What a request in flight costs: the heap a request holds through the
//! layer while its load runs (a leader) or while it waits on another's (a
//! follower), counted by this binary's allocator (issue 17: thousands of
//! requests to a slow origin grew the proxy by ~75 KiB each).
//!
//! The requests are the test's own (no connection, no hyper buffers): what
//! is counted is the layer's and the engine's state, and each task's.

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use cap::Cap;
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::http::send;
use tiercache_testkit::{Counter, Gate, bounded, eventually};

#[global_allocator]
static ALLOCATOR: Cap<std::alloc::System> = Cap::new(std::alloc::System, usize::MAX);

/// Requests in flight at once in each measure.
const REQUESTS: usize = 400;

#[derive(Clone, Default)]
struct Origin {
    calls: Counter,
    gate: Gate,
}

fn app(origin: &Origin, engine: &TieredCache) -> Router {
    let layer = ResponseCacheLayer::new(engine.clone());
    Router::new()
        .route(
            "/k/{id}",
            get(
                |State(o): State<Origin>, Path(id): Path<String>| async move {
                    o.calls.bump();
                    o.gate.passed().await;
                    format!("value of {id}")
                },
            ),
        )
        .layer(layer.route(Policy::ttl(Duration::from_secs(60))).unwrap())
        .with_state(origin.clone())
}

/// Heap bytes held per request while `REQUESTS` requests are in flight:
/// each on a key of its own (each leads a load the origin holds), or all
/// on one key (one leads, the rest wait on it).
async fn held_per_request(one_key: bool) -> usize {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let origin = Origin::default();
    // First allocations (metric handles, the runtime's own) out of the figure.
    let warm = Origin::default();
    warm.gate.open();
    send(&app(&warm, &engine), "GET", "/k/warm").await;
    let app = app(&origin, &engine);
    let before = ALLOCATOR.allocated();
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let app = app.clone();
            let path = if one_key {
                "/k/one".to_string()
            } else {
                format!("/k/{i}")
            };
            tokio::spawn(async move { send(&app, "GET", &path).await })
        })
        .collect();
    if one_key {
        origin.calls.reached(1).await;
        let followers = REQUESTS as u64 - 1;
        eventually("every other request waits on the load", || {
            engine.stats().coalesced == followers
        })
        .await;
    } else {
        origin.calls.reached(REQUESTS).await;
    }
    let held = ALLOCATOR.allocated().saturating_sub(before) / REQUESTS;
    origin.gate.open();
    for request in requests {
        let (status, _, _) = bounded("a request", request).await.unwrap();
        assert!(status.is_success());
    }
    assert_eq!(origin.calls.get(), if one_key { 1 } else { REQUESTS });
    held
}

// One test: the allocator's count is the whole binary's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_holds_a_bounded_share_of_the_heap() {
    let leading = held_per_request(false).await;
    let waiting = held_per_request(true).await;
    eprintln!(
        "held per request in flight: leading its load {leading} B, waiting on one {waiting} B"
    );
    // Debug build: 14.1 and 5.6 KiB; before the loads' futures were kept
    // apart (each took room in the futures around it as well), 24.5 and
    // 10.2 KiB.
    assert!(
        leading <= 16 * 1024,
        "a request leading its load holds {leading} B"
    );
    assert!(
        waiting <= 7 * 1024,
        "a request waiting on a load holds {waiting} B"
    );
}
