//! Fleets on one real Valkey (started by the testkit): how fast an
//! invalidation reaches another instance's L1, and how many origin calls a
//! cold stampede across N instances costs.
//!
//! Run: `cargo bench --bench fleet`
//!
//! 1. Invalidation latency: instance A calls `invalidate(key)` (flush of its
//!    write queue, then `DEL` and `PUBLISH` pipelined); the clock stops when
//!    instance B's tier hands the message to its handler (an engine drops
//!    the L1 entry there; a probe records it, so nothing spins on the two
//!    cores). 2,000 keys, one at a time.
//!    The baseline, measured in the same run, is a raw fred `PING` round trip.
//! 2. Fleet stampede: N instances × M concurrent cold requests for one key
//!    (origin 50 ms), with fleet-wide fill locks on and off.
//!
//! Last measured (2 cores, shared machine, 2026-12-03, Valkey 9 on loopback,
//! four runs): PING p50 148–261 µs, p99 0.2–2.1 ms; `invalidate()` returns
//! p50 229–469 µs; B has handled it p50 255–478 µs (1.7–2.0× a PING), p99
//! 0.36–3.3 ms (goal p99 ≤ 5 ms). Stampede origin calls, locks on / off:
//! 2×100 → 1 / 2; 2×250 → 1 / 2; 4×100 → 1 / 4; 4×250 → 1 / 4.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::get;
use fred::prelude::ClientLike;
use http_body_util::BodyExt;
use tiercache::core::{CacheKey, Invalidation, InvalidationSink, Tier};
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::{Counter, ValkeyServer};
use tokio::sync::{Barrier, watch};
use tower::ServiceExt;

async fn engine(url: &str, locks: bool) -> (TieredCache, ValkeyTier) {
    let config = ValkeyConfig::from_url(url)
        .unwrap()
        .command_timeout(Duration::from_secs(1))
        .fill_locks(locks);
    let tier = ValkeyTier::connect(config).await.unwrap();
    let engine = TieredCache::builder()
        .l2(tier.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    (engine, tier)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    println!(
        "{what:<40} p50 {:>7.1} µs   p99 {:>7.1} µs   max {:>8.1} µs",
        percentile(&samples, 0.5).as_secs_f64() * 1e6,
        percentile(&samples, 0.99).as_secs_f64() * 1e6,
        samples.last().unwrap().as_secs_f64() * 1e6,
    );
}

/// Instance B's side of the bus: counts the invalidations it is handed
/// (an engine's handler drops the L1 entries then, in well under a µs).
struct Probe(watch::Sender<u64>);

impl InvalidationSink for Probe {
    fn apply(&self, _: &Invalidation) {
        self.0.send_modify(|n| *n += 1);
    }

    fn resync(&self) {}
}

async fn invalidation_latency(server: &ValkeyServer) {
    let (a, a_tier) = engine(&server.url(), true).await;
    let (_, b_tier) = engine(&server.url(), true).await;
    let probe = Arc::new(Probe(watch::channel(0).0));
    let sink: Arc<dyn InvalidationSink> = probe.clone();
    b_tier.listen(Arc::downgrade(&sink));
    let mut heard = probe.0.subscribe();
    // Both subscribed before measuring.
    while !server.cmd(&["PUBSUB", "NUMSUB", "tc:inv"]).ends_with("\n2") {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut ping, mut call, mut dropped) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..2000 {
        let started = Instant::now();
        let _: String = a_tier.client().ping(None).await.unwrap();
        ping.push(started.elapsed());

        let key = CacheKey::new(format!("bench:inv:{i}"));
        heard.mark_unchanged();
        let started = Instant::now();
        a.invalidate(&key).await.unwrap();
        call.push(started.elapsed());
        heard.changed().await.unwrap();
        dropped.push(started.elapsed());
    }
    println!("== invalidation latency, 2,000 keys, loopback");
    report("raw PING round trip (baseline)", ping);
    report("A: invalidate() returns", call);
    report("B: invalidation handled (from A's call)", dropped);
}

async fn stampede(server: &ValkeyServer, instances: usize, per: usize, locks: bool, run: usize) {
    let origin = Counter::new();
    let mut apps = Vec::new();
    for _ in 0..instances {
        let (engine, _) = engine(&server.url(), locks).await;
        let layer = ResponseCacheLayer::new(engine);
        let route = layer.route(Policy::ttl(Duration::from_secs(60))).unwrap();
        let calls = origin.clone();
        apps.push(
            Router::new().route(
                "/hot",
                get(move || {
                    let calls = calls.clone();
                    async move {
                        calls.bump();
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        "hot"
                    }
                })
                .layer(route),
            ),
        );
    }
    let start = Arc::new(Barrier::new(instances * per));
    let path = format!("/hot?run={run}");
    let tasks: Vec<_> = (0..instances * per)
        .map(|i| {
            let (app, start, path) = (apps[i % instances].clone(), start.clone(), path.clone());
            tokio::spawn(async move {
                start.wait().await;
                let req = Request::get(path).body(Body::empty()).unwrap();
                let res = app.oneshot(req).await.unwrap();
                assert!(res.status().is_success());
                res.into_body().collect().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "{instances} instances × {per:>3} cold requests, fill locks {:<3}: {} origin call(s)",
        if locks { "on" } else { "off" },
        origin.get()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = ValkeyServer::start();
    rt.block_on(async {
        invalidation_latency(&server).await;
        println!("== fleet stampede (origin 50 ms)");
        let mut run = 0;
        for (instances, per) in [(2, 100), (2, 250), (4, 100), (4, 250)] {
            for locks in [true, false] {
                run += 1;
                stampede(&server, instances, per, locks, run).await;
            }
        }
    });
}
