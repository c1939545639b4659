//! The engine's guarantees through the proxy, over real sockets (issue 14):
//! an invalidation during a fill wins, a failing upstream is called once for
//! every request waiting on it, and XFetch refreshes early with Valkey on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tiercache_proxy::{Proxy, ProxyConfig};
use tiercache_testkit::http::BreaksOff;
use tiercache_testkit::{Counter, Gate, Server, ValkeyServer, bounded, eventually};

#[derive(Clone, Default)]
struct Upstream {
    calls: Counter,
    gate: Gate,
    version: Arc<AtomicUsize>,
}

/// `/v` reads its data's version, then waits for the gate; a POST bumps
/// the version. `/fail` waits for the gate and answers 503; `/broken`
/// waits for it and sends a body that breaks off. `/x` takes
/// 300 ms and answers its call number.
async fn upstream() -> (Server, Upstream) {
    let state = Upstream::default();
    let app = Router::new()
        .route(
            "/v",
            get(|State(u): State<Upstream>| async move {
                let version = u.version.load(SeqCst);
                u.calls.bump();
                u.gate.passed().await;
                format!("v{version}")
            })
            .post(|State(u): State<Upstream>| async move {
                u.version.fetch_add(1, SeqCst);
                "ok"
            }),
        )
        .route(
            "/fail",
            get(|State(u): State<Upstream>| async move {
                let n = u.calls.bump();
                u.gate.passed().await;
                (StatusCode::SERVICE_UNAVAILABLE, format!("down {n}"))
            }),
        )
        .route(
            "/broken",
            get(|State(u): State<Upstream>| async move {
                u.calls.bump();
                u.gate.passed().await;
                Body::new(BreaksOff::after(Duration::from_millis(50)))
            }),
        )
        .route(
            "/x",
            get(|State(u): State<Upstream>| async move {
                let n = u.calls.bump();
                tokio::time::sleep(Duration::from_millis(300)).await;
                format!("x{n}")
            }),
        )
        .with_state(state.clone());
    (Server::start(app).await, state)
}

fn config(upstream: &Server) -> ProxyConfig {
    ProxyConfig::new(upstream.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .ttl(Duration::from_secs(60))
}

async fn fetch(method: &str, addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(Body::empty())
        .unwrap();
    let client: Client<HttpConnector, Body> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let res = client.request(req).await.expect("the proxy answers");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn x_cache(headers: &HeaderMap) -> &str {
    headers
        .get("x-cache")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_during_a_fill_is_not_undone_by_it() {
    let (server, state) = upstream().await;
    let proxy = Proxy::start(config(&server)).await.unwrap();
    let addr = proxy.addr();
    let fill = tokio::spawn(fetch("GET", addr, "/v"));
    state.calls.reached(1).await;
    let (status, _, _) = fetch("POST", addr, "/v").await;
    assert_eq!(status, StatusCode::OK);
    state.gate.open();
    assert_eq!(bounded("the fill", fill).await.unwrap().2, "v0");
    let (_, headers, body) = fetch("GET", addr, "/v").await;
    assert_eq!((x_cache(&headers), body.as_str()), ("MISS", "v1"));
    let (_, headers, body) = fetch("GET", addr, "/v").await;
    assert_eq!((x_cache(&headers), body.as_str()), ("HIT", "v1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_upstream_is_called_once_for_every_waiting_request() {
    let (server, state) = upstream().await;
    let proxy = Proxy::start(config(&server)).await.unwrap();
    let addr = proxy.addr();
    let requests: Vec<_> = (0..100)
        .map(|_| tokio::spawn(fetch("GET", addr, "/fail")))
        .collect();
    let engine = proxy.engine().clone();
    eventually("99 waiting", || engine.stats().coalesced == 99).await;
    state.gate.open();
    for r in requests {
        let (status, _, body) = bounded("a request", r).await.unwrap();
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "down 1")
        );
    }
    assert_eq!(state.calls.get(), 1);
    // Nothing stored: the next request tries again.
    assert_eq!(fetch("GET", addr, "/fail").await.2, "down 2");
}

/// An upstream whose body breaks off midway is failing: the requests
/// waiting on it get the 502, not an upstream call each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_body_that_breaks_off_is_fetched_once_for_every_waiting_request() {
    let (server, state) = upstream().await;
    let proxy = Proxy::start(config(&server)).await.unwrap();
    let addr = proxy.addr();
    let requests: Vec<_> = (0..20)
        .map(|_| tokio::spawn(fetch("GET", addr, "/broken")))
        .collect();
    let engine = proxy.engine().clone();
    eventually("19 waiting", || engine.stats().coalesced == 19).await;
    state.gate.open();
    for r in requests {
        let (status, _, _) = bounded("a request", r).await.unwrap();
        assert_eq!(status, StatusCode::BAD_GATEWAY);
    }
    assert_eq!(state.calls.get(), 1, "one upstream call for the twenty");
}

/// ttl 2 s, jitter 0, β 4, an upstream of 300 ms, a request every 50 ms
/// for 5 s: XFetch refreshes each entry before it expires, so no client
/// waits on the upstream after the first, with Valkey on as without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfetch_keeps_clients_off_the_upstream_with_valkey_on() {
    let valkey = ValkeyServer::start();
    let (server, state) = upstream().await;
    let mut config = config(&server).valkey(valkey.url());
    config.ttl = Some(Duration::from_secs(2));
    config.jitter = 0.0;
    config.xfetch_beta = 4.0;
    let proxy = Proxy::start(config).await.unwrap();
    let addr = proxy.addr();
    assert_eq!(x_cache(&fetch("GET", addr, "/x").await.1), "MISS");
    let mut misses = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        let (_, headers, _) = fetch("GET", addr, "/x").await;
        if x_cache(&headers) == "MISS" {
            misses += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(misses, 0, "clients waited on the upstream at an expiry");
    assert!(
        state.calls.get() >= 3,
        "the entry was refreshed early, twice or more"
    );
}
