//! The quickstart: an axum service with one cached route.
//!
//! ```text
//! cargo run --release --example quickstart
//! curl -si http://127.0.0.1:3000/products/7   # x-cache: MISS, ~50 ms
//! curl -si http://127.0.0.1:3000/products/7   # x-cache: HIT, x-cache-tier: l1
//! curl -s  http://127.0.0.1:3000/stats
//! curl -s  http://127.0.0.1:3000/metrics      # Prometheus text
//! open http://127.0.0.1:3000/dashboard          # the live dashboard
//! ```
//!
//! Listens on `$ADDR` (default `127.0.0.1:3000`). L1 only, unless `$VALKEY_URL`
//! is set (e.g. `redis://127.0.0.1:6379`): then Valkey is the shared L2.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::{Value, json};
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};

/// mimalloc, as the README advises for a service with an L1 budget:
/// glibc's per-thread arenas each keep their peak as entries churn (a
/// cold proxy flooded with 1 KiB bodies grew 1.16x its budget under glibc,
/// 0.97-1.00x under mimalloc). `no_thp`: no transparent huge pages, each
/// held while any of its 2 MiB is in use.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The simulated origin: about 50 ms of work per product.
async fn product(Path(id): Path<u64>) -> Json<Value> {
    tokio::time::sleep(Duration::from_millis(50)).await;
    let generated_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    Json(json!({ "id": id, "name": format!("product {id}"), "generated_at_ms": generated_at_ms }))
}

async fn stats(State(app): State<App>) -> Json<tiercache::Stats> {
    Json(app.cache.engine().stats())
}

/// Prometheus text: the per-route request metrics are live, and the layer
/// publishes the engine's every second on its own.
async fn metrics(State(app): State<App>) -> String {
    app.prometheus.render()
}

#[derive(Clone)]
struct App {
    cache: ResponseCacheLayer,
    prometheus: PrometheusHandle,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let mut builder = TieredCache::builder();
    if let Ok(url) = std::env::var("VALKEY_URL") {
        let l2 = ValkeyTier::connect(ValkeyConfig::from_url(&url)?).await?;
        builder = builder.l2(l2);
        println!("L2: Valkey at {url}");
    }
    let engine = builder.build()?;
    let cache = ResponseCacheLayer::new(engine);

    let app = Router::new()
        .route(
            "/products/{id}",
            get(product).layer(
                cache.route_named("products", Policy::ttl(Duration::from_secs(30)).jitter(0.1))?,
            ),
        )
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .nest("/dashboard", tiercache::dashboard::router(cache.engine()))
        .with_state(App { cache, prometheus });

    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "tiercache quickstart listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
