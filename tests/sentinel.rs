//! The L2 behind a real Valkey Sentinel group (primary, replica, Sentinel)
//! that the test starts itself: fred finds the primary through the
//! Sentinel, and a failover under load costs no failed request.

use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::routing::get;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::http::{Load, until_shared_through_l2};
use tiercache_testkit::{ValkeySentinel, bounded};

struct Instance {
    tier: ValkeyTier,
    engine: TieredCache,
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
    let layer = ResponseCacheLayer::new(engine.clone());
    let route = layer.route(Policy::ttl(Duration::from_secs(60))).unwrap();
    let app = Router::new().route(
        "/p/{id}",
        get(|Path(id): Path<String>| async move { format!("product {id}") }).layer(route),
    );
    Instance { tier, engine, app }
}

/// What A stores now, B reads from L2 (retried while the group settles).
async fn l2_serves(a: &Instance, b: &Instance, tag: &str) {
    bounded(
        "L2 to serve through the Sentinel's primary",
        until_shared_through_l2(&a.app, &b.app, || a.tier.flush(), tag, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_behind_sentinel_under_load_fails_no_request() {
    let mut group = ValkeySentinel::start();
    let a = instance(&group).await;
    let b = instance(&group).await;
    l2_serves(&a, &b, "before").await;

    let load = Load::start(&a.app, 8);
    load.answers(200).await;

    let replica = group.replica().port();
    group.primary_mut().kill();
    bounded("the Sentinel to promote the replica", async {
        while group.primary_port() != Some(replica) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    load.answers(200).await;
    let (ok, failed) = load.finish().await;
    assert_eq!(failed, 0, "of {ok} requests");
    l2_serves(&a, &b, "after").await;
    // Invalidations sent while they were switching over were missed: each
    // dropped its L1 on reaching the new primary (a server never seen
    // before, which used to count as a first connection).
    for i in [&a, &b] {
        bounded("a resync after the failover", async {
            tiercache_testkit::eventually("a resync", || i.engine.stats().l2.resyncs >= 1).await;
        })
        .await;
    }
}
