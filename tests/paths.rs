//! The cache applied once over a whole router (`cache.paths()`): a policy
//! per path glob, excluded paths untouched, writes that invalidate wherever
//! they are routed, and the setting scopes that used to be silent traps.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use tiercache::{Invalidate, Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::Counter;
use tiercache_testkit::http::{header, send};
use tower::ServiceExt;

const TTL: Duration = Duration::from_secs(60);

fn cache() -> ResponseCacheLayer {
    ResponseCacheLayer::new(TieredCache::builder().sweep_interval(None).build().unwrap())
}

/// Bumped by each handler; bodies carry the count so a stale copy shows.
#[derive(Clone, Default)]
struct Calls {
    item: Counter,
    list: Counter,
    metrics: Counter,
    other: Counter,
}

/// A catalogue: items and their list are read under one router; the write
/// handlers are routed on their own (no layer of theirs), as an app would
/// add them later.
fn catalogue(calls: Calls) -> Router {
    let reads = Router::new()
        .route(
            "/products",
            get(|State(c): State<Calls>| async move { format!("list {}", c.list.bump()) }),
        )
        .route(
            "/products/{id}",
            get(|State(c): State<Calls>, Path(id): Path<u32>| async move {
                format!("item {id} v{}", c.item.bump())
            }),
        )
        .route(
            "/metrics",
            get(|State(c): State<Calls>| async move { format!("scrape {}", c.metrics.bump()) }),
        )
        .route(
            "/about",
            get(|State(c): State<Calls>| async move { format!("about {}", c.other.bump()) }),
        );
    let writes = Router::new()
        .route("/products/{id}", post(|| async { "saved" }))
        .route("/admin/reindex", post(|| async { "done" }))
        .route("/metrics", post(|| async { "reset" }));
    reads.merge(writes).with_state(calls)
}

fn layered(calls: Calls) -> Router {
    catalogue(calls).layer(
        cache()
            .paths()
            .exclude("/metrics")
            .route("/products/*", Policy::ttl(TTL))
            .unwrap()
            .route("/products", Policy::ttl(TTL).tag("product-lists"))
            .unwrap()
            .on_write("/products/*", [Invalidate::tag("product-lists")])
            .on_write("/admin/reindex", [Invalidate::path_prefix("/products")]),
    )
}

#[tokio::test]
async fn a_write_routed_apart_from_the_reads_still_invalidates() {
    let calls = Calls::default();
    let app = layered(calls.clone());
    assert_eq!(
        header(&send(&app, "GET", "/products/7").await.1, "x-cache"),
        "MISS"
    );
    let (_, headers, body) = send(&app, "GET", "/products/7").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("HIT", "item 7 v1")
    );

    let (status, headers, _) = send(&app, "POST", "/products/7").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-cache-invalidation"], "done");

    let (_, headers, body) = send(&app, "GET", "/products/7").await;
    assert_eq!(
        (header(&headers, "x-cache"), body.as_str()),
        ("MISS", "item 7 v2")
    );
    assert_eq!(calls.item.get(), 2);
}

#[tokio::test]
async fn a_write_on_an_item_drops_the_list_pages_it_names() {
    let calls = Calls::default();
    let app = layered(calls.clone());
    for page in ["/products?page=1", "/products?page=2"] {
        send(&app, "GET", page).await;
        assert_eq!(header(&send(&app, "GET", page).await.1, "x-cache"), "HIT");
    }
    send(&app, "GET", "/products/8").await;

    send(&app, "POST", "/products/7").await;
    for page in ["/products?page=1", "/products?page=2"] {
        assert_eq!(
            header(&send(&app, "GET", page).await.1, "x-cache"),
            "MISS",
            "{page}"
        );
    }
    // The other item was not named: the tag covers lists only.
    assert_eq!(
        header(&send(&app, "GET", "/products/8").await.1, "x-cache"),
        "HIT"
    );
}

#[tokio::test]
async fn a_write_may_drop_a_whole_path_prefix() {
    let calls = Calls::default();
    let app = layered(calls.clone());
    for path in ["/products/1", "/products/2", "/products?page=1"] {
        send(&app, "GET", path).await;
    }
    let (_, headers, _) = send(&app, "POST", "/admin/reindex").await;
    assert_eq!(headers["x-cache-invalidation"], "done");
    for path in ["/products/1", "/products/2", "/products?page=1"] {
        assert_eq!(
            header(&send(&app, "GET", path).await.1, "x-cache"),
            "MISS",
            "{path}"
        );
    }
}

#[tokio::test]
async fn excluded_and_unmatched_reads_are_untouched() {
    let calls = Calls::default();
    let app = layered(calls.clone());
    for n in 0..3 {
        let (_, headers, body) = send(&app, "GET", "/metrics").await;
        assert_eq!(
            body,
            format!("scrape {}", n + 1),
            "a scrape is never frozen"
        );
        assert!(
            headers.get("x-cache").is_none(),
            "excluded: no cache fields"
        );
        let (_, headers, body) = send(&app, "GET", "/about").await;
        assert_eq!(body, format!("about {}", n + 1));
        assert!(headers.get("x-cache").is_none(), "unmatched: not cached");
    }
    // A write on an excluded path passes untouched too.
    let (_, headers, _) = send(&app, "POST", "/metrics").await;
    assert!(headers.get("x-cache-invalidation").is_none());
}

#[tokio::test]
async fn the_first_matching_rule_wins() {
    let calls = Calls::default();
    let app = catalogue(calls.clone()).layer(
        cache()
            .paths()
            .exclude("/products/9")
            .route("/products/*", Policy::ttl(TTL))
            .unwrap(),
    );
    for _ in 0..2 {
        let (_, headers, _) = send(&app, "GET", "/products/9").await;
        assert!(headers.get("x-cache").is_none());
    }
    send(&app, "GET", "/products/1").await;
    assert_eq!(
        header(&send(&app, "GET", "/products/1").await.1, "x-cache"),
        "HIT"
    );
    assert_eq!(calls.item.get(), 3);
}

#[tokio::test]
async fn each_rule_has_its_own_metrics_label() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let scrape = recorder.handle();
    let cache = cache().metrics_recorder(Arc::new(recorder));
    let assets = cache
        .route_named("assets", Policy::ttl(TTL))
        .unwrap()
        .ignore_cookies();
    let app = catalogue(Calls::default()).layer(
        cache
            .paths()
            .route("/products/*", Policy::ttl(TTL))
            .unwrap()
            .route_layer("/about", assets),
    );
    send(&app, "GET", "/products/1").await;
    send(&app, "GET", "/about").await;
    let text = scrape.render();
    assert!(
        text.contains(r#"route="/products/*""#),
        "the glob labels the rule:\n{text}"
    );
    assert!(text.contains(r#"route="assets""#), "{text}");
}

#[test]
#[should_panic(expected = "ResponseCacheLayer::max_body was called on the base layer after")]
fn a_base_setter_after_a_route_was_derived_fails_loudly() {
    let cache = cache();
    let _products = cache.route(Policy::ttl(TTL)).unwrap();
    // Would not reach `_products`: refused rather than silently ignored.
    let _ = cache.max_body(1024);
}

#[test]
#[should_panic(expected = "ResponseCacheLayer::ignore_cookies was called on the base layer")]
fn a_base_setter_after_paths_fails_loudly() {
    let cache = cache();
    let _paths = cache.paths();
    let _ = cache.ignore_cookies();
}

#[tokio::test]
async fn a_setter_before_route_and_one_on_the_route_both_apply_to_it() {
    let big = "x".repeat(4096);
    for (label, layer) in [
        (
            "base",
            cache().max_body(1024).route(Policy::ttl(TTL)).unwrap(),
        ),
        (
            "route",
            cache().route(Policy::ttl(TTL)).unwrap().max_body(1024),
        ),
    ] {
        let calls = Counter::new();
        let body = big.clone();
        let app = Router::new().route(
            "/big",
            get(move |State(c): State<Counter>| {
                let body = body.clone();
                async move {
                    c.bump();
                    body
                }
            })
            .layer(layer)
            .with_state(calls.clone()),
        );
        for _ in 0..2 {
            send(&app, "GET", "/big").await;
        }
        assert_eq!(calls.get(), 2, "{label}: a body over the cap is not stored");
    }
    // A clone of the base is a new base: its setters are allowed.
    let cache = cache();
    let _a = cache.route(Policy::ttl(TTL)).unwrap();
    let assets = cache.clone().ignore_cookies().route(Policy::ttl(TTL));
    assert!(assets.is_ok());
    assert!(cache.route(Policy::ttl(TTL)).is_ok());
}

#[tokio::test]
async fn a_canonical_authority_shares_entries_across_names_and_ports() {
    async fn get_from(app: &Router, host: &str) -> (String, String) {
        let req = Request::get("/products/1")
            .header("host", host)
            .body(Body::empty())
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        let x = header(res.headers(), "x-cache").to_owned();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (x, String::from_utf8_lossy(&body).into_owned())
    }
    let host_seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let app = |cache: ResponseCacheLayer| {
        let seen = host_seen.clone();
        Router::new().route(
            "/products/1",
            get(move |headers: HeaderMap| {
                let seen = seen.clone();
                async move {
                    let host = headers["host"].to_str().unwrap().to_owned();
                    seen.lock().unwrap().push(host);
                    "item"
                }
            })
            .layer(cache.route(Policy::ttl(TTL)).unwrap()),
        )
    };
    // Without it, each authority (port included) is its own entry.
    let plain = app(cache());
    assert_eq!(get_from(&plain, "shop.test:8080").await.0, "MISS");
    assert_eq!(get_from(&plain, "shop.test:8081").await.0, "MISS");

    host_seen.lock().unwrap().clear();
    let canonical = app(cache().canonical_authority("shop.example"));
    assert_eq!(get_from(&canonical, "shop.test:8080").await.0, "MISS");
    assert_eq!(get_from(&canonical, "10.0.0.7:8081").await.0, "HIT");
    assert_eq!(get_from(&canonical, "shop.example").await.0, "HIT");
    assert_eq!(*host_seen.lock().unwrap(), ["shop.example"]);
}

#[test]
#[should_panic(expected = "is not a URI authority")]
fn a_bad_canonical_authority_is_refused() {
    let _ = cache().canonical_authority("not an authority/");
}
