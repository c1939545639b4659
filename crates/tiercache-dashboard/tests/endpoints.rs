//! The dashboard's JSON endpoints and page, driven in process.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;
use tiercache_core::{
    BoxFuture, CacheKey, Entry, Invalidation, MockClock, Policy, Tier, TierError, TierHit,
    TierReport, TieredCache, Value as Stored,
};
use tiercache_http::ResponseCacheLayer;
use tower::ServiceExt;

async fn fetch(app: &Router, uri: &str) -> (StatusCode, String, String) {
    let res = app
        .clone()
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let kind = res.headers()["content-type"].to_str().unwrap().to_owned();
    assert_eq!(res.headers()["cache-control"], "no-store", "{uri} is live");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, kind, String::from_utf8(body.to_vec()).unwrap())
}

async fn json(app: &Router, uri: &str) -> Value {
    let (status, kind, body) = fetch(app, uri).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(kind, "application/json");
    serde_json::from_str(&body).unwrap()
}

/// An app with a cached route and the dashboard nested under `/admin/cache`.
fn app(engine: &TieredCache) -> Router {
    let cache = ResponseCacheLayer::new(engine.clone());
    let route = cache
        .route(Policy::ttl(Duration::from_secs(60)).jitter(0.0))
        .unwrap();
    Router::new()
        .route("/p/{id}", get(|| async { "product" }).layer(route))
        .nest("/admin/cache", tiercache_dashboard::router(engine))
}

async fn get_product(app: &Router, id: u32) {
    let req = Request::get(format!("/p/{id}"))
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    res.into_body().collect().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn stats_show_the_traffic_by_outcome_with_a_per_second_history() {
    let engine = TieredCache::builder()
        .sweep_interval(None)
        .l1_capacity(8 << 20)
        .build()
        .unwrap();
    let app = app(&engine);
    // The first sample is the baseline; traffic lands in the next second.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for id in 0..4 {
        get_product(&app, id).await;
        get_product(&app, id).await;
        get_product(&app, id).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let stats = json(&app, "/admin/cache/api/stats").await;
    let totals = &stats["totals"];
    assert_eq!(totals["misses"], 4, "{stats}");
    assert_eq!(totals["hits_l1"], 8);
    assert_eq!(totals["origin_loads"], 4);
    assert!((stats["hit_ratio"].as_f64().unwrap() - 8.0 / 12.0).abs() < 1e-9);
    assert!((stats["hit_ratio_last_minute"].as_f64().unwrap() - 8.0 / 12.0).abs() < 1e-9);
    assert_eq!(stats["l1"]["entries"], 4);
    assert_eq!(stats["l1"]["budget"], 8 << 20);
    assert!(stats["l1"]["bytes"].as_u64().unwrap() > 0);
    assert_eq!(stats["l2"]["configured"], false);
    assert_eq!(stats["in_flight"], 0);
    let buckets = stats["origin_latency"]["buckets"].as_array().unwrap();
    let loads: u64 = buckets.iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(loads, 4, "every origin load is in the histogram");
    assert_eq!(buckets.last().unwrap()["le_ms"], Value::Null);

    let samples = stats["history"]["samples"].as_array().unwrap();
    let last = samples.last().expect("a sample per second");
    assert_eq!(
        (last["misses"].as_u64(), last["hits_l1"].as_u64()),
        (Some(4), Some(8))
    );
    assert!(last["at_ms"].as_u64().unwrap() > 0);
}

/// A shared tier that stores nothing and reports fixed counters: what the
/// L2 panel shows comes from the tier's own report.
#[derive(Debug)]
struct Reporting(TierReport);

impl Tier for Reporting {
    fn get<'a>(&'a self, _: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async { Ok(None) })
    }

    fn put(&self, _: &CacheKey, _: &Entry, _: Duration, _: &[Bytes]) {}

    fn invalidate<'a>(&'a self, _: Invalidation) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async { Ok(()) })
    }

    fn report(&self) -> TierReport {
        self.0
    }

    fn last_failure(&self) -> Option<tiercache_core::TierFailure> {
        Some(tiercache_core::TierFailure::new("Connection refused", 2))
    }
}

#[tokio::test]
async fn the_l2_panel_shows_the_breaker_reconnections_and_resyncs() {
    let mut report = TierReport::default();
    report.breaker_trips = 3;
    report.reconnects_forced = 2;
    report.resyncs = 5;
    report.lock_waits = 7;
    report.connection_errors = 4;
    let engine = TieredCache::builder()
        .sweep_interval(None)
        .l2(Reporting(report))
        .build()
        .unwrap();
    let app = app(&engine);

    let l2 = &json(&app, "/admin/cache/api/stats").await["l2"];
    assert_eq!(l2["configured"], true);
    assert_eq!(
        (
            &l2["breaker_trips"],
            &l2["reconnects_forced"],
            &l2["resyncs"],
            &l2["lock_waits"]
        ),
        (
            &Value::from(3),
            &Value::from(2),
            &Value::from(5),
            &Value::from(7)
        ),
        "{l2}"
    );
    assert_eq!(l2["connection_errors"], 4, "{l2}");
    assert_eq!(l2["last_failure"]["message"], "Connection refused", "{l2}");
    assert_eq!(l2["last_failure"]["seconds_ago"], 2, "{l2}");
    let (_, _, page) = fetch(&app, "/admin/cache").await;
    for id in ["l2-trips", "l2-resyncs", "l2-failure"] {
        assert!(
            page.contains(&format!(r#"id="{id}""#)),
            "the page shows {id}"
        );
    }
}

#[tokio::test]
async fn the_horizon_counts_entries_by_the_second_they_go_stale() {
    let clock = MockClock::new();
    let engine = TieredCache::builder()
        .sweep_interval(None)
        .clock(clock.clone())
        .build()
        .unwrap();
    for (n, ttl) in [(30, 5), (10, 20), (5, 90)] {
        let policy = Policy::ttl(Duration::from_secs(ttl))
            .jitter(0.0)
            .build()
            .unwrap();
        for i in 0..n {
            engine.put(
                &CacheKey::new(format!("{ttl}/{i}")),
                Stored::from_body("v"),
                &policy,
            );
        }
    }
    clock.advance(Duration::from_millis(500));
    let app = app(&engine);

    let horizon = json(&app, "/admin/cache/api/horizon?seconds=60").await;
    let buckets: Vec<u64> = horizon["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    assert_eq!(buckets.len(), 60);
    assert_eq!(buckets[4], 30, "ttl 5 s, 0.5 s ago: stale in 4.5 s");
    assert_eq!(buckets[19], 10);
    assert_eq!(
        buckets.iter().sum::<u64>(),
        40,
        "the 90 s ones lie past the horizon"
    );
    assert_eq!(horizon["entries"], 45);
    assert_eq!(horizon["scaled"], false);

    clock.advance(Duration::from_secs(10));
    let horizon = json(&app, "/admin/cache/api/horizon").await;
    assert_eq!(horizon["buckets"].as_array().unwrap().len(), 120, "default");
    assert_eq!(horizon["already_stale"], 30);
    assert_eq!(horizon["buckets"][9], 10);
    assert_eq!(horizon["buckets"][79], 5);

    let clamped = json(&app, "/admin/cache/api/horizon?seconds=999999").await;
    assert_eq!(
        clamped["buckets"].as_array().unwrap().len(),
        tiercache_dashboard::MAX_HORIZON
    );
}

#[tokio::test]
async fn the_page_is_self_contained_and_finds_its_json_wherever_mounted() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let app = app(&engine);
    let at_root = Router::new().merge(tiercache_dashboard::router(&engine));
    for (app, uri) in [(app, "/admin/cache"), (at_root, "/")] {
        let (status, kind, page) = fetch(&app, uri).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(kind, "text/html; charset=utf-8");
        assert!(page.contains(r#"id="hit-ratio""#));
        assert!(page.contains("api/stats") && page.contains("api/horizon"));
        // Offline: nothing is loaded from anywhere else (the SVG namespace
        // is a name, not a fetch).
        for (at, _) in page.match_indices("http") {
            let rest = &page[at..];
            assert!(
                rest.starts_with("http://www.w3.org/2000/svg"),
                "an external reference: {}",
                &rest[..rest.len().min(60)]
            );
        }
        for tag in ["<link", "<img", "<iframe", "@import", "src="] {
            assert!(!page.contains(tag), "the page loads nothing: found {tag}");
        }
    }
}

#[tokio::test]
async fn a_bad_horizon_query_is_a_clear_400() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let app = app(&engine);
    let res = app
        .oneshot(
            Request::get("/admin/cache/api/horizon?seconds=many")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("seconds"));
}
