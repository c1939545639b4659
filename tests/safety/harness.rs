//! The origin every safety test runs against, and the apps (layer, proxy;
//! with and without Valkey) that put the cache in front of it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tiercache::http::key::request_key;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_proxy::{Proxy, ProxyConfig};
use tiercache_testkit::http::Events;
use tiercache_testkit::{Counter, Server, ValkeyServer, eventually};
use tower::ServiceExt;

pub(crate) const HOST: &str = "shop.test";
pub(crate) const TTL: Duration = Duration::from_secs(60);
pub(crate) const CDN: HeaderName = HeaderName::from_static("cdn-cache-control");

#[derive(Clone, Default)]
pub(crate) struct Origin {
    pub(crate) calls: Counter,
    /// The `If-None-Match` of each call, in order.
    pub(crate) validators: Arc<Mutex<Vec<Option<String>>>>,
}

impl Origin {
    pub(crate) fn validators(&self) -> Vec<Option<String>> {
        self.validators.lock().unwrap().clone()
    }
}

/// Reflects the request; `?status=`, `?cc=`, `?cdn=`, `?vary=`,
/// `?set_cookie=`, `?ce=`, `?etag=`, `?lm=`, `?age=`, `?size=`, `?hop`,
/// `?events` (server-sent events that never end) shape the response (and `x-respond-status` / `x-respond-location` on
/// any method). Paths with `account` in them are private, as an account
/// page behind lenient path matching would be. A request with `x-bad`
/// is a 400; one with a header value over 4 KiB a 431.
pub(crate) async fn reflect(
    State(origin): State<Origin>,
    method: Method,
    uri: Uri,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = origin.calls.bump();
    let inm = headers
        .get("if-none-match")
        .map(|v| v.to_str().unwrap().to_owned());
    origin.validators.lock().unwrap().push(inm.clone());
    if headers.contains_key("x-bad") {
        return (StatusCode::BAD_REQUEST, "bad request").into_response();
    }
    if headers.values().any(|v| v.len() > 4096) {
        return (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "header too large",
        )
            .into_response();
    }
    let mut out = HeaderMap::new();
    let mut set = |name: &'static str, value: &str| {
        out.append(name, HeaderValue::from_str(value).unwrap());
    };
    for (param, name) in [
        ("cc", "cache-control"),
        ("cdn", "cdn-cache-control"),
        ("vary", "vary"),
        ("set_cookie", "set-cookie"),
        ("ce", "content-encoding"),
        ("etag", "etag"),
        ("lm", "last-modified"),
        ("age", "age"),
        ("location", "location"),
        ("pai", "proxy-authentication-info"),
    ] {
        if let Some(v) = q.get(param) {
            set(name, v);
        }
    }
    if let Some(v) = headers.get("x-respond-location") {
        set("location", v.to_str().unwrap());
    }
    if uri.path().contains("account") {
        set("cache-control", "private");
    }
    if q.contains_key("hop") {
        set("connection", "x-hop");
        set("x-hop", "secret");
        set("keep-alive", "timeout=5");
        set("x-case", "MiXeD;Value=\"1\"");
        set("x-multi", "a");
        set("x-multi", "b");
        set("x-empty", "");
    }
    let status = q
        .get("status")
        .map(String::as_str)
        .or_else(|| headers.get("x-respond-status").map(|v| v.to_str().unwrap()))
        .map(|s| StatusCode::from_bytes(s.as_bytes()).unwrap())
        .unwrap_or(StatusCode::OK);
    if let (Some(etag), Some(inm)) = (q.get("etag"), &inm)
        && inm == etag
    {
        return (StatusCode::NOT_MODIFIED, out).into_response();
    }
    if q.contains_key("events") {
        set("content-type", "text/event-stream");
        let events = Body::new(Events::every(Duration::from_millis(20)));
        return (status, out, events).into_response();
    }
    if let Some(size) = q.get("size") {
        let size: usize = size.parse().unwrap();
        return (status, out, big_body(size)).into_response();
    }
    let mut text = format!("call={n}\nmethod={method}\nuri={uri}\n");
    let mut lines: Vec<String> = headers
        .iter()
        .map(|(k, v)| format!("{k}: {}", String::from_utf8_lossy(v.as_bytes())))
        .collect();
    lines.sort();
    text.push_str(&lines.join("\n"));
    text.push_str("\nbody=");
    text.push_str(&String::from_utf8_lossy(&body));
    (status, out, text).into_response()
}

pub(crate) fn big_body(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

pub(crate) fn origin_app(origin: &Origin, layer: Option<&ResponseCacheLayer>) -> Router {
    let Some(layer) = layer else {
        return Router::new().fallback(reflect).with_state(origin.clone());
    };
    let route = layer.route(Policy::ttl(TTL)).unwrap();
    Router::new()
        .route(
            "/ignore/{*p}",
            any(reflect).layer(route.clone().ignore_cookies()),
        )
        .route(
            "/lang/{*p}",
            any(reflect).layer(route.clone().key_cookies(["lang"])),
        )
        .route("/{*p}", any(reflect).layer(route))
        .with_state(origin.clone())
}

/// How the requests reach the cache.
pub(crate) enum Via {
    /// In process, through the layer on an axum app.
    Layer { app: Router, engine: TieredCache },
    /// Over real sockets, through the proxy in front of the origin server.
    Proxy {
        proxy: Box<Proxy>,
        _origin: Arc<Server>,
    },
}

/// What one harness is built with.
#[derive(Clone)]
pub(crate) struct Settings {
    /// `None`: the proxy without `--ttl` (the layer always has its route ttl).
    pub(crate) ttl: Option<Duration>,
    pub(crate) l1_capacity: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            ttl: Some(TTL),
            l1_capacity: 64 * 1024 * 1024,
        }
    }
}

/// A cache between a client and a reflecting origin, with its own Valkey.
pub(crate) struct Harness {
    pub(crate) name: &'static str,
    pub(crate) via: Via,
    pub(crate) origin: Origin,
    pub(crate) valkey: Arc<ValkeyServer>,
    pub(crate) settings: Settings,
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn h(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    pub(crate) fn x_cache(&self) -> &str {
        self.h("x-cache")
    }
}

impl Harness {
    pub(crate) async fn layer(settings: Settings) -> Self {
        let valkey = Arc::new(ValkeyServer::start());
        Self::layer_on(valkey, Origin::default(), settings).await
    }

    pub(crate) async fn layer_on(
        valkey: Arc<ValkeyServer>,
        origin: Origin,
        settings: Settings,
    ) -> Self {
        let l2 = ValkeyTier::connect(ValkeyConfig::from_url(&valkey.url()).unwrap())
            .await
            .unwrap();
        let engine = TieredCache::builder()
            .l1_capacity(settings.l1_capacity)
            .l2(l2)
            .sweep_interval(None)
            .build()
            .unwrap();
        let layer = ResponseCacheLayer::new(engine.clone()).targeted_fields([CDN]);
        let app = origin_app(&origin, Some(&layer));
        Self {
            name: "layer",
            via: Via::Layer { app, engine },
            origin,
            valkey,
            settings,
        }
    }

    pub(crate) async fn proxy(settings: Settings) -> Self {
        let origin = Origin::default();
        let server = Arc::new(Server::start(origin_app(&origin, None)).await);
        let valkey = Arc::new(ValkeyServer::start());
        Self::proxy_on(valkey, origin, server, settings).await
    }

    pub(crate) async fn proxy_on(
        valkey: Arc<ValkeyServer>,
        origin: Origin,
        server: Arc<Server>,
        settings: Settings,
    ) -> Self {
        let mut config = ProxyConfig::new(server.url().parse().unwrap())
            .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
            .valkey(valkey.url());
        config.ttl = settings.ttl;
        config.l1_capacity = settings.l1_capacity;
        config.targets = vec![CDN.to_string()];
        let proxy = Proxy::start(config).await.unwrap();
        Self {
            name: "proxy",
            via: Via::Proxy {
                proxy: Box::new(proxy),
                _origin: server,
            },
            origin,
            valkey,
            settings,
        }
    }

    /// The layer and the proxy, each on its own origin and Valkey.
    pub(crate) async fn both() -> [Harness; 2] {
        [
            Self::layer(Settings::default()).await,
            Self::proxy(Settings::default()).await,
        ]
    }

    /// Another instance (own L1) on the same origin and Valkey.
    pub(crate) async fn sibling(&self) -> Harness {
        let settings = self.settings.clone();
        match &self.via {
            Via::Layer { .. } => {
                Self::layer_on(self.valkey.clone(), self.origin.clone(), settings).await
            }
            Via::Proxy { _origin, .. } => {
                Self::proxy_on(
                    self.valkey.clone(),
                    self.origin.clone(),
                    _origin.clone(),
                    settings,
                )
                .await
            }
        }
    }

    pub(crate) fn engine(&self) -> &TieredCache {
        match &self.via {
            Via::Layer { engine, .. } => engine,
            Via::Proxy { proxy, .. } => proxy.engine(),
        }
    }

    pub(crate) fn calls(&self) -> usize {
        self.origin.calls.get()
    }

    pub(crate) fn request(&self, method: &str, target: &str) -> http::request::Builder {
        self.request_to(method, target).header("host", HOST)
    }

    /// A request without a `Host` yet.
    pub(crate) fn request_to(&self, method: &str, target: &str) -> http::request::Builder {
        let uri = match &self.via {
            Via::Layer { .. } => target.to_owned(),
            Via::Proxy { proxy, .. } => format!("http://{}{target}", proxy.addr()),
        };
        Request::builder().method(method).uri(uri)
    }

    pub(crate) async fn send(&self, req: Request<Body>) -> Reply {
        let (parts, body) = self.send_for_head(req).await;
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    /// The answer's head as soon as the cache gives it, its body unread.
    pub(crate) async fn send_for_head(&self, req: Request<Body>) -> (http::response::Parts, Body) {
        match &self.via {
            Via::Layer { app, .. } => app.clone().oneshot(req).await.unwrap().into_parts(),
            Via::Proxy { .. } => {
                let client: Client<HttpConnector, Body> =
                    Client::builder(TokioExecutor::new()).build(HttpConnector::new());
                let (parts, body) = client
                    .request(req)
                    .await
                    .expect("the proxy answers")
                    .into_parts();
                (parts, Body::new(body))
            }
        }
    }

    pub(crate) async fn get(&self, target: &str) -> Reply {
        self.send(self.request("GET", target).body(Body::empty()).unwrap())
            .await
    }

    pub(crate) async fn get_with(&self, target: &str, headers: &[(&str, &str)]) -> Reply {
        let mut b = self.request("GET", target);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        self.send(b.body(Body::empty()).unwrap()).await
    }

    /// The entry keys in Valkey once every write queued so far has landed:
    /// a control entry is stored last (the writer is FIFO), then waited for,
    /// and left out of the answer.
    pub(crate) async fn stored_in_valkey(&self) -> Vec<String> {
        let control = "/control?cc=max-age%3D60";
        let reply = self.get(control).await;
        assert_eq!(reply.status, StatusCode::OK);
        let parts = Request::get(control)
            .header("host", HOST)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let control_key = format!("tc:{{{}}}:e", request_key(&parts).hash().to_hex());
        let valkey = self.valkey.clone();
        eventually("the control entry in Valkey", || {
            valkey.keys("*").contains(&control_key)
        })
        .await;
        // Entries only: fill locks and tag sets are not responses.
        let mut keys = self.valkey.keys("*:e");
        keys.retain(|k| *k != control_key);
        keys
    }
}
