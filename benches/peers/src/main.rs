//! `bench-peer NAME PORT`: serves the bench origin (`../support/origin.rs`)
//! on 127.0.0.1:PORT behind NAME, one of the Rust crates a user might pick
//! instead of tiercache, each set up the way its documentation shows and
//! made to cache what the other caches in the run cache (2 KiB, an hour):
//!
//! - `axum-response-cache` 0.5: its layer with a lifespan, the origin's
//!   headers kept;
//! - `hitbox` 0.2: `hitbox-tower` over `hitbox-moka` storing Bincode (its
//!   JSON default costs a hit ~19× the bare handler), GET and 200 only, the
//!   path in the key, request coalescing on (its broadcast concurrency
//!   manager with a limit of one);
//! - `tower-http-cache` 0.6: its in-memory backend, with
//!   `application/octet-stream` taken off its default list of content types
//!   it never caches (the origin answers octet-stream);
//! - `http-cache-tower-server` 0.2: `http-cache`'s moka manager, the query
//!   in the key (`QueryKeyer`).
//!
//! Only the cacheable routes sit behind the peer; `/count` stays outside it.
//! Run by `cargo bench --bench http`, which builds this crate itself.
//!
//! `bench-peer NAME PORT workload` serves the origin of `cargo bench --bench
//! workload` (`../support/workload_origin.rs`) instead, cached for its 5 s
//! lifetime; its record, `/_origin`, stays outside the peer.

#[path = "../../support/origin.rs"]
mod origin;
#[path = "../../support/workload_origin.rs"]
mod workload_origin;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleError;
use axum::response::{IntoResponse, Response};
use http::Request;
use tower::{Layer, ServiceExt};

const TTL: Duration = Duration::from_secs(3600);

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(name), Some(port)) = (args.next(), args.next()) else {
        eprintln!("usage: bench-peer NAME PORT");
        std::process::exit(2);
    };
    let port: u16 = port.parse().expect("PORT is a number");
    let workload = args.next().as_deref() == Some("workload");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async move {
        let ((cacheable, count), ttl) = if workload {
            (workload_origin::origin_routes(), workload_origin::LIFETIME)
        } else {
            (origin::origin(), TTL)
        };
        let cached = match name.as_str() {
            "axum-response-cache" => axum_response_cache(cacheable, ttl),
            "hitbox" => hitbox(cacheable, ttl),
            "tower-http-cache" => tower_http_cache(cacheable, ttl),
            "http-cache-tower-server" => http_cache_tower_server(cacheable),
            other => {
                eprintln!("unknown peer {other}");
                std::process::exit(2);
            }
        };
        let app = count.merge(cached);
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .expect("bind the peer's port");
        axum::serve(listener, app).await.expect("serve");
    });
}

fn axum_response_cache(origin: Router, ttl: Duration) -> Router {
    origin.layer(axum_response_cache::CacheLayer::with_lifespan(ttl).add_response_headers())
}

fn hitbox(origin: Router, ttl: Duration) -> Router {
    use hitbox::Config;
    use hitbox::concurrency::BroadcastConcurrencyManager;
    use hitbox::policy::{ConcurrencyLimit, PolicyConfig};
    use hitbox_http::extractors::Method as MethodKey;
    use hitbox_http::extractors::path::PathExtractor;
    use hitbox_http::predicates::request::MethodPredicate;
    use hitbox_http::predicates::response::StatusCodePredicate;
    use hitbox_http::predicates::{NeutralRequestPredicate, NeutralResponsePredicate};

    let backend = hitbox_moka::MokaBackend::builder()
        .max_entries(100_000)
        .value_format(hitbox_backend::format::BincodeFormat)
        .build();
    let config = Config::builder()
        .request_predicate(NeutralRequestPredicate::new().method(http::Method::GET))
        .response_predicate(NeutralResponsePredicate::new().status_code(http::StatusCode::OK))
        .extractor(MethodKey::new().path("/{kind}/{id}"))
        .policy(
            PolicyConfig::builder()
                .ttl(ttl)
                .concurrency(ConcurrencyLimit::new(1).expect("1 is in range"))
                .build(),
        )
        .build();
    let layer = hitbox_tower::Cache::builder()
        .backend(backend)
        .config(config)
        .concurrency_manager(BroadcastConcurrencyManager::new())
        .build();
    // hitbox hands its inner service its own body type; axum wants its own.
    let inner =
        origin.map_request(|req: Request<hitbox_http::BufferedBody<Body>>| req.map(Body::new));
    let service = layer.layer(inner).map_response(IntoResponse::into_response);
    Router::new().fallback_service(service)
}

fn tower_http_cache(origin: Router, ttl: Duration) -> Router {
    use tower_http_cache::prelude::*;
    use tower_http_cache::streaming::StreamingPolicy;

    let mut streaming = StreamingPolicy::default();
    streaming
        .excluded_content_types
        .remove("application/octet-stream");
    let policy = CachePolicy::default()
        .with_ttl(ttl)
        .with_streaming_policy(streaming);
    let layer = CacheLayer::new_in_memory(100_000).with_policy(policy);
    // It stores a `Sync` body; axum's is not, so the origin's is buffered first.
    let inner = ServiceExt::<Request<Body>>::and_then(origin, |res: Response| async move {
        let (parts, body) = res.into_parts();
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Ok::<_, Infallible>(Response::from_parts(
            parts,
            http_body_util::Full::new(bytes),
        ))
    });
    let service =
        ServiceExt::<Request<Body>>::map_response(layer.layer(inner), IntoResponse::into_response);
    Router::new().fallback_service(HandleError::new(service, bad_gateway))
}

fn http_cache_tower_server(origin: Router) -> Router {
    use http_cache_tower_server::{QueryKeyer, ServerCacheLayer};

    let manager = http_cache::MokaManager::new(moka::future::Cache::new(100_000));
    let layer = ServerCacheLayer::with_keyer(manager, QueryKeyer);
    let service =
        ServiceExt::<Request<Body>>::map_response(layer.layer(origin), |res| res.map(Body::new));
    Router::new().fallback_service(HandleError::new(service, bad_gateway))
}

/// What a peer's own error becomes (none occurred in the runs measured).
async fn bad_gateway(_: Box<dyn std::error::Error + Send + Sync>) -> http::StatusCode {
    http::StatusCode::BAD_GATEWAY
}
