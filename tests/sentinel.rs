//! The L2 behind a real Valkey Sentinel group (primary, replica, Sentinel)
//! that the test starts itself: fred finds the primary through the
//! Sentinel, and a failover under load costs no failed request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::{ValkeySentinel, bounded, eventually};
use tower::ServiceExt;

struct Instance {
    tier: ValkeyTier,
    app: Router,
}

async fn instance(group: &ValkeySentinel) -> Instance {
    let config = ValkeyConfig::from_url(&group.url()).unwrap();
    let tier = ValkeyTier::connect(config).await.unwrap();
    let engine = TieredCache::builder()
        .l2(tier.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let route = layer.route(Policy::ttl(Duration::from_secs(60))).unwrap();
    let app = Router::new().route(
        "/p/{id}",
        get(|Path(id): Path<String>| async move { format!("product {id}") }).layer(route),
    );
    Instance { tier, app }
}

async fn send(app: &Router, path: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::get(path)
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn tier_of(headers: &HeaderMap) -> &str {
    headers
        .get("x-cache-tier")
        .map(|v| v.to_str().unwrap())
        .unwrap_or("")
}

/// What A stores now, B reads from L2 (retried while the group settles).
async fn l2_serves(a: &Instance, b: &Instance, tag: &str) {
    bounded("L2 to serve through the Sentinel's primary", async {
        let mut i = 0;
        loop {
            i += 1;
            let path = format!("/p/{tag}{i}");
            send(&a.app, &path).await;
            a.tier.flush().await;
            let (_, headers, _) = send(&b.app, &path).await;
            if tier_of(&headers) == "l2" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_behind_sentinel_under_load_fails_no_request() {
    let mut group = ValkeySentinel::start();
    let a = instance(&group).await;
    let b = instance(&group).await;
    l2_serves(&a, &b, "before").await;

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (app, stop, ok, failed, next) = (
                a.app.clone(),
                stop.clone(),
                ok.clone(),
                failed.clone(),
                next.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(SeqCst) {
                    let i = next.fetch_add(1, SeqCst);
                    let (status, _, body) = send(&app, &format!("/p/load{i}")).await;
                    if status == StatusCode::OK && body == format!("product load{i}") {
                        ok.fetch_add(1, SeqCst);
                    } else {
                        failed.fetch_add(1, SeqCst);
                    }
                }
            })
        })
        .collect();
    eventually("load under way", || ok.load(SeqCst) >= 200).await;

    let replica = group.replica().port();
    group.primary_mut().kill();
    bounded("the Sentinel to promote the replica", async {
        while group.primary_port() != Some(replica) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let after = ok.load(SeqCst) + 200;
    eventually("load goes on after the failover", || {
        ok.load(SeqCst) >= after
    })
    .await;
    stop.store(true, SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(failed.load(SeqCst), 0, "of {} requests", ok.load(SeqCst));
    l2_serves(&a, &b, "after").await;
}
