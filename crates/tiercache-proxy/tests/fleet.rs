//! Several `tiercache-proxy` processes on one real Valkey behave as one cache.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tiercache_testkit::valkey::free_port;
use tiercache_testkit::{Counter, Gate, Server, ValkeyServer, bounded};

#[derive(Clone, Default)]
struct Upstream {
    calls: Counter,
    gate: Gate,
    version: Arc<AtomicUsize>,
}

/// `/slow` waits for the gate; `/item` answers its version, which a POST bumps.
async fn upstream() -> (Server, Upstream) {
    let state = Upstream::default();
    let app = Router::new()
        .route(
            "/slow",
            get(|State(u): State<Upstream>| async move {
                let n = u.calls.bump();
                u.gate.passed().await;
                format!("slow {n}")
            }),
        )
        .route(
            "/item",
            get(|State(u): State<Upstream>| async move {
                u.calls.bump();
                format!("item v{}", u.version.load(SeqCst))
            })
            .post(|State(u): State<Upstream>| async move {
                u.version.fetch_add(1, SeqCst);
                "updated"
            }),
        )
        .with_state(state.clone());
    (Server::start(app).await, state)
}

/// A `tiercache-proxy` process, killed on drop.
struct ProxyProcess {
    child: Child,
    addr: SocketAddr,
    admin: SocketAddr,
}

impl ProxyProcess {
    async fn start(upstream: &Server, valkey: &ValkeyServer, extra: &[&str]) -> Self {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let child = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
            .args(["--upstream", &upstream.url()])
            .args(["--listen", &addr.to_string()])
            .args(["--admin", &admin.to_string()])
            .args(["--valkey", &valkey.url()])
            // These tests count upstream calls, not timeouts: a loaded
            // machine must not turn a slow lock command (50 ms by default)
            // into a second upstream call.
            .args(["--valkey-timeout", "1s"])
            .args(["--ttl", "60s"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start tiercache-proxy");
        let mut proxy = Self { child, addr, admin };
        // A process's readiness: polled every 10 ms, for 10 s at most.
        for _ in 0..1000 {
            if TcpStream::connect(addr).is_ok() && TcpStream::connect(admin).is_ok() {
                return proxy;
            }
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("tiercache-proxy exited at start: {status}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("tiercache-proxy did not listen on {addr} within 10 s");
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn stats(&self) -> serde_json::Value {
        let (_, _, body) = fetch(Method::GET, self.admin, "/stats").await;
        serde_json::from_str(&body).expect("stats JSON")
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn fetch(method: Method, addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
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
        .map(|v| v.to_str().unwrap())
        .unwrap_or("")
}

/// Polls the proxies' `/stats` (other processes: no clock to inject) until
/// their `coalesced` counts add up to `n`.
async fn coalesced(proxies: &[&ProxyProcess], n: u64) {
    for _ in 0..1000 {
        let mut total = 0;
        for p in proxies {
            total += p.stats().await["coalesced"].as_u64().unwrap();
        }
        if total >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the proxies never counted {n} coalesced requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_load_once_and_a_post_through_one_makes_the_other_miss() {
    let valkey = ValkeyServer::start();
    let (server, state) = upstream().await;
    let a = ProxyProcess::start(&server, &valkey, &[]).await;
    let b = ProxyProcess::start(&server, &valkey, &[]).await;

    // 100 concurrent cold requests, split across both → one upstream call.
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let addr = if i % 2 == 0 { a.addr } else { b.addr };
            tokio::spawn(fetch(Method::GET, addr, "/slow"))
        })
        .collect();
    bounded(
        "all 100 requests to wait on one load",
        coalesced(&[&a, &b], 99),
    )
    .await;
    state.gate.open();
    for t in tasks {
        let (status, _, body) = bounded("a proxied request", t).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "slow 1"));
    }
    assert_eq!(state.calls.get(), 1, "one upstream call for both proxies");

    // Both cache /item; a POST through A; B answers MISS 200 ms later.
    fetch(Method::GET, a.addr, "/item").await;
    for proxy in [&a, &b] {
        let (_, headers, body) = fetch(Method::GET, proxy.addr, "/item").await;
        assert_eq!((x_cache(&headers), body.as_str()), ("HIT", "item v0"));
    }
    let (status, _, _) = fetch(Method::POST, a.addr, "/item").await;
    assert_eq!(status, StatusCode::OK);
    // The deadline the fleet promises, measured as a user would.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, headers, body) = fetch(Method::GET, b.addr, "/item").await;
    assert_eq!((x_cache(&headers), body.as_str()), ("MISS", "item v1"));

    // The admin endpoint invalidates everywhere too.
    let (_, headers, _) = fetch(Method::GET, a.addr, "/item").await;
    assert_eq!(x_cache(&headers), "HIT");
    let (status, _, _) = fetch(Method::POST, b.admin, "/invalidate?key=/item").await;
    assert_eq!(status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, headers, _) = fetch(Method::GET, a.addr, "/item").await;
    assert_eq!(x_cache(&headers), "MISS");
    let (status, _, body) = fetch(Method::POST, b.admin, "/invalidate?nothing=1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_lock_owner_dies_mid_fill_another_proxy_fills_after_the_locks_px() {
    let valkey = ValkeyServer::start();
    let (server, state) = upstream().await;
    let mut a = ProxyProcess::start(&server, &valkey, &["--lock-timeout", "1s"]).await;
    let b = ProxyProcess::start(&server, &valkey, &["--lock-timeout", "1s"]).await;

    // A leads the fill and holds the fleet lock; then it is killed.
    let orphan = tokio::spawn(fetch(Method::GET, a.addr, "/slow"));
    state.calls.reached(1).await;
    assert_eq!(valkey.keys("tc:*:lock").len(), 1, "A holds the lock");
    a.kill();
    let _ = orphan.await;

    // B's requests wait for the lock's PX, then one of them fills.
    let tasks: Vec<_> = (0..20)
        .map(|_| tokio::spawn(fetch(Method::GET, b.addr, "/slow")))
        .collect();
    bounded(
        "B to take over after the lock expires",
        state.calls.reached(2),
    )
    .await;
    state.gate.open();
    for t in tasks {
        let (status, _, body) = bounded("a request to B", t).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "slow 2"));
    }
    assert_eq!(state.calls.get(), 2);
}
