//! HTTP semantics and safety: leaks, poisoning and abuse, each case through
//! the layer on an axum app and through the proxy over real sockets, with a
//! real Valkey as L2 behind both.
//!
//! The origin reflects what it received (method, target, headers, body) and
//! counts its calls; query parameters (and `x-respond-*` request headers, for
//! unsafe methods) choose the response's status and headers. Every case
//! asserts on what the victim's response says and on the origin's counter.

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
use tiercache::http::request::UNKEYED;
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_proxy::{Proxy, ProxyConfig};
use tiercache_testkit::{Counter, Server, ValkeyServer, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const HOST: &str = "shop.test";
const TTL: Duration = Duration::from_secs(60);
const CDN: HeaderName = HeaderName::from_static("cdn-cache-control");

// ---------------------------------------------------------------- the origin

#[derive(Clone, Default)]
struct Origin {
    calls: Counter,
    /// The `If-None-Match` of each call, in order.
    validators: Arc<Mutex<Vec<Option<String>>>>,
}

impl Origin {
    fn validators(&self) -> Vec<Option<String>> {
        self.validators.lock().unwrap().clone()
    }
}

/// Reflects the request; `?status=`, `?cc=`, `?cdn=`, `?vary=`,
/// `?set_cookie=`, `?ce=`, `?etag=`, `?lm=`, `?age=`, `?size=`, `?hop`
/// shape the response (and `x-respond-status` / `x-respond-location` on
/// any method). Paths with `account` in them are private, as an account
/// page behind lenient path matching would be. A request with `x-bad`
/// is a 400; one with a header value over 4 KiB a 431.
async fn reflect(
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

fn big_body(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

fn origin_app(origin: &Origin, layer: Option<&ResponseCacheLayer>) -> Router {
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

// --------------------------------------------------------------- the harness

/// How the requests reach the cache.
enum Via {
    /// In process, through the layer on an axum app.
    Layer { app: Router, engine: TieredCache },
    /// Over real sockets, through the proxy in front of the origin server.
    Proxy { proxy: Proxy, _origin: Arc<Server> },
}

/// What one harness is built with.
#[derive(Clone)]
struct Settings {
    /// `None`: the proxy without `--ttl` (the layer always has its route ttl).
    ttl: Option<Duration>,
    l1_capacity: u64,
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
struct Harness {
    name: &'static str,
    via: Via,
    origin: Origin,
    valkey: Arc<ValkeyServer>,
    settings: Settings,
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn h(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    fn x_cache(&self) -> &str {
        self.h("x-cache")
    }
}

impl Harness {
    async fn layer(settings: Settings) -> Self {
        let valkey = Arc::new(ValkeyServer::start());
        Self::layer_on(valkey, Origin::default(), settings).await
    }

    async fn layer_on(valkey: Arc<ValkeyServer>, origin: Origin, settings: Settings) -> Self {
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

    async fn proxy(settings: Settings) -> Self {
        let origin = Origin::default();
        let server = Arc::new(Server::start(origin_app(&origin, None)).await);
        let valkey = Arc::new(ValkeyServer::start());
        Self::proxy_on(valkey, origin, server, settings).await
    }

    async fn proxy_on(
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
                proxy,
                _origin: server,
            },
            origin,
            valkey,
            settings,
        }
    }

    /// The layer and the proxy, each on its own origin and Valkey.
    async fn both() -> [Harness; 2] {
        [
            Self::layer(Settings::default()).await,
            Self::proxy(Settings::default()).await,
        ]
    }

    /// Another instance (own L1) on the same origin and Valkey.
    async fn sibling(&self) -> Harness {
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

    fn engine(&self) -> &TieredCache {
        match &self.via {
            Via::Layer { engine, .. } => engine,
            Via::Proxy { proxy, .. } => proxy.engine(),
        }
    }

    fn calls(&self) -> usize {
        self.origin.calls.get()
    }

    fn request(&self, method: &str, target: &str) -> http::request::Builder {
        self.request_to(method, target).header("host", HOST)
    }

    /// A request without a `Host` yet.
    fn request_to(&self, method: &str, target: &str) -> http::request::Builder {
        let uri = match &self.via {
            Via::Layer { .. } => target.to_owned(),
            Via::Proxy { proxy, .. } => format!("http://{}{target}", proxy.addr()),
        };
        Request::builder().method(method).uri(uri)
    }

    async fn send(&self, req: Request<Body>) -> Reply {
        let (parts, body) = match &self.via {
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
        };
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    async fn get(&self, target: &str) -> Reply {
        self.send(self.request("GET", target).body(Body::empty()).unwrap())
            .await
    }

    async fn get_with(&self, target: &str, headers: &[(&str, &str)]) -> Reply {
        let mut b = self.request("GET", target);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        self.send(b.body(Body::empty()).unwrap()).await
    }

    /// The entry keys in Valkey once every write queued so far has landed:
    /// a control entry is stored last (the writer is FIFO), then waited for,
    /// and left out of the answer.
    async fn stored_in_valkey(&self) -> Vec<String> {
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

// ------------------------------------------------------------ storage, reuse

#[tokio::test]
async fn set_cookie_responses_reach_the_origin_every_time_and_are_never_stored() {
    for h in Harness::both().await {
        for _ in 0..2 {
            let r = h.get("/login?set_cookie=session%3Dalice").await;
            assert_eq!(r.h("set-cookie"), "session=alice", "{}", h.name);
            assert_ne!(r.x_cache(), "HIT", "{}", h.name);
        }
        assert_eq!(h.calls(), 2, "{}: both requests reach the origin", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn bob_never_sees_alices_authorization_response() {
    for h in Harness::both().await {
        let alice = [("authorization", "Bearer alice")];
        let bob = [("authorization", "Bearer bob")];
        // Not marked shareable: every credentialed request goes to the origin.
        let a = h.get_with("/me", &alice).await;
        assert!(a.text().contains("Bearer alice"), "{}", h.name);
        let b = h.get_with("/me", &bob).await;
        assert!(b.text().contains("Bearer bob"), "{}", h.name);
        assert!(!b.text().contains("alice"), "{}: {}", h.name, b.text());
        let a2 = h.get_with("/me", &alice).await;
        assert!(a2.text().contains("call=3"), "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);

        // `public` lets a credentialed response be stored (RFC 9111 §3.5),
        // for that credential only.
        let target = "/me-public?cc=public%2C%20max-age%3D60";
        let a = h.get_with(target, &alice).await;
        let a2 = h.get_with(target, &alice).await;
        assert_eq!((a.x_cache(), a2.x_cache()), ("MISS", "HIT"), "{}", h.name);
        assert_eq!(a.body, a2.body);
        let b = h.get_with(target, &bob).await;
        assert_ne!(b.x_cache(), "HIT", "{}", h.name);
        assert!(b.text().contains("Bearer bob") && !b.text().contains("alice"));
        let anonymous = h.get(target).await;
        assert!(!anonymous.text().contains("Bearer"), "{}", h.name);
        assert_eq!(h.calls(), 6, "{}", h.name);
    }
}

#[tokio::test]
async fn bob_never_sees_alices_cookie_response() {
    for h in Harness::both().await {
        let a = h.get_with("/cart", &[("cookie", "session=alice")]).await;
        let b = h.get_with("/cart", &[("cookie", "session=bob")]).await;
        assert_eq!(a.x_cache(), "BYPASS", "{}", h.name);
        assert!(a.text().contains("session=alice"));
        assert!(b.text().contains("session=bob") && !b.text().contains("alice"));
        assert_eq!(h.calls(), 2, "{}", h.name);
    }
}

#[tokio::test]
async fn cookie_opt_ins_ignore_or_key_on_named_cookies() {
    let h = Harness::layer(Settings::default()).await;
    // Ignored: the origin never sees the cookie, so one answer fits everyone.
    let a = h
        .get_with("/ignore/logo", &[("cookie", "session=alice")])
        .await;
    let b = h
        .get_with("/ignore/logo", &[("cookie", "session=bob")])
        .await;
    assert!(!a.text().contains("session"), "{}", a.text());
    assert_eq!((a.x_cache(), b.x_cache()), ("MISS", "HIT"));
    assert_eq!(h.calls(), 1);

    // Keyed on `lang`: the origin sees only that cookie; languages stay apart.
    let fr_alice = h
        .get_with("/lang/home", &[("cookie", "session=alice; lang=fr")])
        .await;
    assert!(
        fr_alice.text().contains("cookie: lang=fr\n"),
        "{}",
        fr_alice.text()
    );
    assert!(!fr_alice.text().contains("alice"));
    let fr_bob = h
        .get_with("/lang/home", &[("cookie", "lang=fr; session=bob")])
        .await;
    assert_eq!(fr_bob.x_cache(), "HIT");
    let en = h.get_with("/lang/home", &[("cookie", "lang=en")]).await;
    assert_eq!(en.x_cache(), "MISS");
    assert!(en.text().contains("cookie: lang=en\n"));
    assert_eq!(h.calls(), 3);
}

#[tokio::test]
async fn private_and_no_store_are_never_stored() {
    for h in Harness::both().await {
        let refused = [
            "/p1?cc=private",
            "/p2?cc=private%3D%22x-user%22%2C%20max-age%3D60",
            "/p3?cc=no-store%2C%20max-age%3D60",
            "/p4?cc=NO-STORE",
            "/p5?cc=public%2C%20max-age%3D60%2C%20No-Store",
        ];
        for target in refused {
            for _ in 0..2 {
                let r = h.get(target).await;
                assert_ne!(r.x_cache(), "HIT", "{} {target}", h.name);
            }
        }
        // A request's own `no-store` keeps a storable response out too.
        for _ in 0..2 {
            let r = h
                .get_with("/p6?cc=max-age%3D60", &[("cache-control", "no-store")])
                .await;
            assert_eq!(r.x_cache(), "BYPASS", "{}", h.name);
        }
        assert_eq!(h.calls(), 12, "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}: nothing private or no-store in Valkey (SCAN)",
            h.name
        );
    }
}

#[tokio::test]
async fn vary_variants_stay_apart_in_l1_and_l2() {
    for h in Harness::both().await {
        let target = "/news?vary=accept-language&cc=max-age%3D60";
        let en = [("accept-language", "en")];
        let fr = [("accept-language", "fr")];
        let r_en = h.get_with(target, &en).await;
        let r_fr = h.get_with(target, &fr).await;
        assert!(r_en.text().contains("accept-language: en"), "{}", h.name);
        assert!(r_fr.text().contains("accept-language: fr"), "{}", h.name);
        assert_eq!(h.calls(), 2, "{}", h.name);
        // Both variants are kept, each answers only its own requests.
        let again_en = h.get_with(target, &en).await;
        let again_fr = h.get_with(target, &fr).await;
        assert_eq!(
            (again_en.x_cache(), again_fr.x_cache()),
            ("HIT", "HIT"),
            "{}",
            h.name
        );
        assert_eq!(
            (again_en.body.clone(), again_fr.body.clone()),
            (r_en.body.clone(), r_fr.body.clone())
        );
        let none = h.get(target).await;
        assert_ne!(none.x_cache(), "HIT", "{}", h.name);
        assert!(
            !none.text().contains("accept-language:"),
            "{}: {}",
            h.name,
            none.text()
        );
        assert_eq!(h.calls(), 3, "{}", h.name);

        // Another instance finds each variant in L2.
        let sibling = h.sibling().await;
        let s_fr = sibling.get_with(target, &fr).await;
        let s_en = sibling.get_with(target, &en).await;
        assert_eq!(
            (s_fr.h("x-cache-tier"), s_en.h("x-cache-tier")),
            ("l2", "l2"),
            "{}",
            h.name
        );
        assert_eq!((s_fr.body, s_en.body), (r_fr.body, r_en.body), "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);
    }
}

#[tokio::test]
async fn vary_star_is_never_reused_in_any_spelling() {
    for h in Harness::both().await {
        for (i, vary) in ["*", "accept%2C%20*", "Accept-Language%2C*%2Caccept"]
            .iter()
            .enumerate()
        {
            let target = format!("/star{i}?vary={vary}&cc=max-age%3D60");
            for _ in 0..2 {
                assert_ne!(h.get(&target).await.x_cache(), "HIT", "{} {vary}", h.name);
            }
        }
        assert_eq!(h.calls(), 6, "{}", h.name);
    }
}

#[tokio::test]
async fn a_vary_explosion_stops_at_the_cap() {
    for h in Harness::both().await {
        let target = "/explode?vary=x-tenant&cc=max-age%3D60";
        for i in 0..40 {
            let r = h.get_with(target, &[("x-tenant", &format!("t{i}"))]).await;
            assert_eq!(r.x_cache(), "MISS", "{}", h.name);
        }
        assert_eq!(h.calls(), 40);
        // The first 32 were stored and stay; the rest were not.
        for i in 0..32 {
            let r = h.get_with(target, &[("x-tenant", &format!("t{i}"))]).await;
            assert_eq!(r.x_cache(), "HIT", "{} t{i}", h.name);
            assert!(r.text().contains(&format!("x-tenant: t{i}\n")));
        }
        let past = h.get_with(target, &[("x-tenant", "t35")]).await;
        assert_eq!(past.x_cache(), "MISS", "{}", h.name);
        assert!(
            past.h("cache-status").contains("detail=vary-limit"),
            "{}",
            past.h("cache-status")
        );
        assert_eq!(h.calls(), 41, "{}", h.name);
    }
}

#[tokio::test]
async fn a_coded_body_without_vary_goes_only_to_clients_that_accept_it() {
    for h in Harness::both().await {
        let target = "/asset?ce=gzip&cc=max-age%3D60";
        let gzip = [("accept-encoding", "gzip, br")];
        h.get_with(target, &gzip).await;
        assert_eq!(
            h.get_with(target, &gzip).await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 1);
        for refuses in [
            &[][..],
            &[("accept-encoding", "br")],
            &[("accept-encoding", "gzip;q=0")],
        ] {
            let r = h.get_with(target, refuses).await;
            assert_ne!(r.x_cache(), "HIT", "{} {refuses:?}", h.name);
        }
        assert_eq!(h.calls(), 4, "{}", h.name);
    }
}

#[tokio::test]
async fn no_cache_responses_are_stored_and_revalidated_before_each_reuse() {
    for h in Harness::both().await {
        let target = "/rev?cc=no-cache&etag=%22v1%22";
        let first = h.get(target).await;
        assert_eq!(first.status, StatusCode::OK);
        for n in 2..=3 {
            let r = h.get(target).await;
            assert_eq!(r.status, StatusCode::OK, "{}", h.name);
            assert_eq!(
                r.body, first.body,
                "{}: the stored body, renewed by a 304",
                h.name
            );
            assert_eq!(h.calls(), n, "{}: revalidated on every reuse", h.name);
        }
        assert_eq!(
            h.origin.validators(),
            vec![None, Some("\"v1\"".into()), Some("\"v1\"".into())],
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn validators_are_answered_from_the_cache_with_304() {
    for h in Harness::both().await {
        let lm = "Sun, 06 Nov 1994 08:49:37 GMT";
        let target =
            "/doc?cc=max-age%3D60&etag=%22v1%22&lm=Sun%2C%2006%20Nov%201994%2008%3A49%3A37%20GMT";
        // Cold: the origin gets no validator (its 200 is stored), the client its 304.
        let cold = h.get_with(target, &[("if-none-match", "\"v1\"")]).await;
        assert_eq!(cold.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        assert_eq!(h.origin.validators(), vec![None], "{}", h.name);
        assert!(cold.body.is_empty());
        assert_eq!(cold.h("etag"), "\"v1\"");

        let other = h.get_with(target, &[("if-none-match", "\"v0\"")]).await;
        assert_eq!(
            (other.status, other.x_cache()),
            (StatusCode::OK, "HIT"),
            "{}",
            h.name
        );
        assert!(other.text().contains("call=1"));
        let weak = h
            .get_with(target, &[("if-none-match", "\"v0\", W/\"v1\"")])
            .await;
        assert_eq!(
            (weak.status, weak.x_cache()),
            (StatusCode::NOT_MODIFIED, "HIT")
        );
        assert_eq!(weak.h("cache-control"), "max-age=60");
        let since = h.get_with(target, &[("if-modified-since", lm)]).await;
        assert_eq!(since.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        let before = h
            .get_with(
                target,
                &[("if-modified-since", "Sat, 05 Nov 1994 08:49:37 GMT")],
            )
            .await;
        assert_eq!(before.status, StatusCode::OK, "{}", h.name);
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

#[tokio::test]
async fn age_counts_the_origins_age_and_the_time_stored() {
    for h in Harness::both().await {
        let target = "/aged?cc=max-age%3D60&age=10";
        h.get(target).await;
        let hit = h.get(target).await;
        assert_eq!((hit.x_cache(), hit.h("age")), ("HIT", "10"), "{}", h.name);
        let ttl = hit.h("cache-status");
        assert!(
            ttl.contains("ttl=4") || ttl.contains("ttl=5"),
            "{}: 60 s − 10 s, jittered down: {ttl}",
            h.name
        );
    }
}

#[tokio::test]
async fn headers_round_trip_byte_exact_through_l1_and_l2_without_hop_by_hop_ones() {
    for h in Harness::both().await {
        let target = "/fields?cc=max-age%3D60&hop";
        h.get(target).await;
        let l1 = h.get(target).await;
        let l2 = h.sibling().await.get(target).await;
        for (tier, r) in [("l1", &l1), ("l2", &l2)] {
            assert_eq!(r.h("x-cache-tier"), tier, "{}", h.name);
            assert_eq!(r.h("x-case"), "MiXeD;Value=\"1\"", "{} {tier}", h.name);
            let multi: Vec<_> = r.headers.get_all("x-multi").iter().collect();
            assert_eq!(multi, ["a", "b"], "{} {tier}", h.name);
            assert_eq!(
                r.headers.get("x-empty").map(|v| v.as_bytes()),
                Some(&b""[..])
            );
            assert!(
                !r.headers.contains_key("x-hop"),
                "{} {tier}: named in Connection",
                h.name
            );
            assert!(!r.headers.contains_key("keep-alive"), "{} {tier}", h.name);
            assert_eq!(r.body, l1.body);
        }
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

#[tokio::test]
async fn targeted_cache_control_wins_for_this_cache() {
    for h in Harness::both().await {
        let stored = "/cdn1?cc=no-store&cdn=max-age%3D60";
        h.get(stored).await;
        assert_eq!(h.get(stored).await.x_cache(), "HIT", "{}", h.name);
        for refused in [
            "/cdn2?cc=max-age%3D60&cdn=no-store",
            "/cdn3?cc=max-age%3D60&cdn=private",
        ] {
            h.get(refused).await;
            assert_ne!(
                h.get(refused).await.x_cache(),
                "HIT",
                "{} {refused}",
                h.name
            );
        }
        assert_eq!(h.calls(), 5, "{}", h.name);
    }
}

#[tokio::test]
async fn a_client_cannot_push_load_onto_the_origin_unless_allowed() {
    for h in Harness::both().await {
        let target = "/busy?cc=max-age%3D60";
        h.get(target).await;
        for ask in [
            ("cache-control", "no-cache"),
            ("cache-control", "max-age=0"),
            ("pragma", "no-cache"),
            ("cache-control", "no-cache, x-unknown-directive=1"),
        ] {
            assert_eq!(
                h.get_with(target, &[ask]).await.x_cache(),
                "HIT",
                "{} {ask:?}",
                h.name
            );
        }
        assert_eq!(h.calls(), 1, "{}", h.name);
    }

    // Opted in: a reload goes to the origin and refreshes the entry.
    let origin = Origin::default();
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let layer = ResponseCacheLayer::new(engine).honor_client_no_cache(true);
    let app = origin_app(&origin, Some(&layer));
    let send = |headers: &'static [(&'static str, &'static str)]| {
        let app = app.clone();
        async move {
            let mut b = Request::get("/busy").header("host", HOST);
            for (n, v) in headers {
                b = b.header(*n, *v);
            }
            let res = app.oneshot(b.body(Body::empty()).unwrap()).await.unwrap();
            String::from_utf8_lossy(&res.into_body().collect().await.unwrap().to_bytes())
                .into_owned()
        }
    };
    send(&[]).await;
    let reloaded = send(&[("cache-control", "no-cache")]).await;
    assert!(reloaded.contains("call=2"), "{reloaded}");
    assert!(
        send(&[]).await.contains("call=2"),
        "the reload refreshed the entry"
    );
    assert_eq!(origin.calls.get(), 2);
}

#[tokio::test]
async fn errors_are_stored_only_with_explicit_freshness_and_never_long() {
    for h in Harness::both().await {
        for status in [400, 403, 405, 414, 501, 500, 502, 503] {
            let target = format!("/err{status}?status={status}");
            h.get(&target).await;
            assert_ne!(h.get(&target).await.x_cache(), "HIT", "{} {status}", h.name);
        }
        assert_eq!(h.calls(), 16, "{}", h.name);
        // 404 is the route's negative cache; 4xx with max-age is capped at 60 s.
        h.get("/gone?status=404").await;
        assert_eq!(
            h.get("/gone?status=404").await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        let target = "/forbidden?status=403&cc=max-age%3D86400";
        h.get(target).await;
        let hit = h.get(target).await;
        assert_eq!(hit.x_cache(), "HIT", "{}", h.name);
        let ttl: u64 = hit
            .h("cache-status")
            .split("ttl=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ttl <= 60, "{}: an error kept {ttl} s", h.name);
        // 5xx: never, even with max-age (stale-if-error answers those).
        let target = "/down?status=503&cc=max-age%3D60";
        h.get(target).await;
        assert_ne!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
        assert_eq!(h.calls(), 20, "{}", h.name);
    }
}

#[tokio::test]
async fn the_proxy_without_ttl_stores_only_explicit_freshness() {
    let h = Harness::proxy(Settings {
        ttl: None,
        ..Settings::default()
    })
    .await;
    for target in ["/plain", "/missing?status=404", "/moved?status=301"] {
        h.get(target).await;
        assert_ne!(h.get(target).await.x_cache(), "HIT", "{target}");
    }
    assert_eq!(h.calls(), 6);
    for target in ["/fresh?cc=max-age%3D60", "/cdn?cdn=s-maxage%3D60"] {
        h.get(target).await;
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{target}");
    }
    assert_eq!(h.calls(), 8);
}

// ------------------------------------------------------------- invalidation

#[tokio::test]
async fn successful_unsafe_methods_invalidate_the_target_in_l1_and_l2() {
    for h in Harness::both().await {
        for (i, method) in ["POST", "PUT", "PATCH", "DELETE", "PURGE"]
            .iter()
            .enumerate()
        {
            let target = format!("/item{i}?cc=max-age%3D60");
            h.get(&target).await;
            assert_eq!(h.get(&target).await.x_cache(), "HIT");
            let before = h.calls();
            let write = h
                .send(h.request(method, &target).body(Body::from("x")).unwrap())
                .await;
            assert_eq!(write.status, StatusCode::OK);
            let after = h.get(&target).await;
            assert_eq!(after.x_cache(), "MISS", "{} {method}", h.name);
            assert_eq!(h.calls(), before + 2, "{} {method}", h.name);
        }
        // A redirect is a success too (the classic POST → 303 See Other).
        let target = "/form?cc=max-age%3D60";
        h.get(target).await;
        let see_other = h
            .request("POST", target)
            .header("x-respond-status", "303")
            .body(Body::empty())
            .unwrap();
        assert_eq!(h.send(see_other).await.status, StatusCode::SEE_OTHER);
        assert_eq!(
            h.get(target).await.x_cache(),
            "MISS",
            "{} after a 303",
            h.name
        );
        // L2 too: an instance that never saw it finds nothing stale there.
        let target = "/item9?cc=max-age%3D60";
        h.get(target).await;
        h.stored_in_valkey().await;
        h.send(h.request("POST", target).body(Body::empty()).unwrap())
            .await;
        let fresh_eyes = h.sibling().await.get(target).await;
        assert_eq!(fresh_eyes.h("x-cache-tier"), "origin", "{}", h.name);
    }
}

#[tokio::test]
async fn failed_writes_and_cross_origin_locations_invalidate_nothing() {
    for h in Harness::both().await {
        let target = "/stock?cc=max-age%3D60";
        h.get(target).await;
        for status in ["500", "404", "403"] {
            let failed = h
                .request("POST", target)
                .header("x-respond-status", status)
                .body(Body::empty())
                .unwrap();
            h.send(failed).await;
            assert_eq!(
                h.get(target).await.x_cache(),
                "HIT",
                "{} after a {status}",
                h.name
            );
        }

        let elsewhere = "/list?cc=max-age%3D60";
        h.get(elsewhere).await;
        let foreign = h
            .request("POST", "/orders")
            .header("x-respond-status", "201")
            .header(
                "x-respond-location",
                "http://other.example/list?cc=max-age%3D60",
            )
            .body(Body::empty())
            .unwrap();
        h.send(foreign).await;
        assert_eq!(
            h.get(elsewhere).await.x_cache(),
            "HIT",
            "{}: cross-origin",
            h.name
        );
        let same = h
            .request("POST", "/orders")
            .header("x-respond-status", "201")
            .header("x-respond-location", "/list?cc=max-age%3D60")
            .body(Body::empty())
            .unwrap();
        h.send(same).await;
        assert_eq!(
            h.get(elsewhere).await.x_cache(),
            "MISS",
            "{}: same origin",
            h.name
        );
    }
}

// ------------------------------------------------------------------ poisoning

#[tokio::test]
async fn unkeyed_headers_never_reach_a_victim() {
    for h in Harness::both().await {
        for (i, name) in UNKEYED.iter().enumerate() {
            let target = format!("/page{i}?cc=max-age%3D60");
            let attacker = h.get_with(&target, &[(name, "evil.example")]).await;
            assert!(
                !attacker.text().contains("evil.example"),
                "{} {name}: reached the origin",
                h.name
            );
            let victim = h.get(&target).await;
            assert_eq!(victim.x_cache(), "HIT", "{} {name}", h.name);
            assert!(!victim.text().contains("evil.example"), "{} {name}", h.name);
        }
        assert_eq!(h.calls(), UNKEYED.len(), "{}", h.name);
    }
}

#[tokio::test]
async fn a_get_with_a_body_bypasses_the_cache() {
    for h in Harness::both().await {
        let target = "/search?cc=max-age%3D60";
        let fat = h
            .request("GET", target)
            .body(Body::from("evil-body"))
            .unwrap();
        let attacker = h.send(fat).await;
        assert_eq!(attacker.x_cache(), "BYPASS", "{}", h.name);
        let victim = h.get(target).await;
        assert!(!victim.text().contains("evil-body"), "{}", h.name);
        assert_eq!(h.get(target).await.body, victim.body);
        assert_eq!(h.calls(), 2, "{}", h.name);
    }
}

#[tokio::test]
async fn requests_that_make_the_origin_fail_poison_nothing() {
    for h in Harness::both().await {
        let target = "/fragile?cc=max-age%3D60";
        let bad = h.get_with(target, &[("x-bad", "1")]).await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        let huge = "a".repeat(6000);
        let big = h.get_with(target, &[("x-huge", &huge)]).await;
        assert_eq!(big.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        let victim = h.get(target).await;
        assert_eq!(victim.status, StatusCode::OK, "{}", h.name);
        // And caching was not switched off for the URL (no hit-for-miss).
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);
    }
}

#[tokio::test]
async fn query_host_port_and_case_are_keyed_exactly() {
    for h in Harness::both().await {
        h.get("/q?cc=max-age%3D60&utm=evil").await;
        let victim = h.get("/q?cc=max-age%3D60").await;
        assert!(!victim.text().contains("evil"), "{}", h.name);
        assert_eq!(h.calls(), 2);

        let other_port = h
            .send(
                h.request_to("GET", "/hp?cc=max-age%3D60")
                    .header("host", "shop.test:8443")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        let victim = h.get("/hp?cc=max-age%3D60").await;
        assert_ne!(victim.body, other_port.body, "{}", h.name);
        let upper = h
            .send(
                h.request_to("GET", "/hp?cc=max-age%3D60")
                    .header("host", "SHOP.TEST")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(
            (upper.x_cache(), &upper.body),
            ("HIT", &victim.body),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 4, "{}", h.name);
        // Two `Host` fields: which one the origin reads is anyone's guess.
        let doubled = h
            .send(
                h.request("GET", "/hp?cc=max-age%3D60")
                    .header("host", "evil.example")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(doubled.x_cache(), "BYPASS", "{}", h.name);
        assert_eq!(h.get("/hp?cc=max-age%3D60").await.body, victim.body);
        // Two `Host` fields: which one the origin reads is anyone's guess.
        let doubled = h
            .send(
                h.request("GET", "/hp?cc=max-age%3D60")
                    .header("host", "evil.example")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(doubled.x_cache(), "BYPASS", "{}", h.name);
        assert_eq!(h.get("/hp?cc=max-age%3D60").await.body, victim.body);
    }
}

#[tokio::test]
async fn an_absolute_form_target_naming_another_host_bypasses() {
    for h in Harness::both().await {
        let attacker = match &h.via {
            Via::Layer { .. } => {
                h.send(
                    Request::get("http://shop.test/abs?cc=max-age%3D60")
                        .header("host", "evil.example")
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
            }
            Via::Proxy { proxy, .. } => raw_absolute_form(proxy.addr()).await,
        };
        assert_eq!(attacker.x_cache(), "BYPASS", "{}", h.name);
        let victim = h.get("/abs?cc=max-age%3D60").await;
        assert!(!victim.text().contains("evil"), "{}", h.name);
        assert_eq!(victim.x_cache(), "MISS", "{}", h.name);
    }
}

/// `GET http://shop.test/abs` with `Host: evil.example`, as raw HTTP/1.1.
async fn raw_absolute_form(addr: SocketAddr) -> Reply {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        b"GET http://shop.test/abs?cc=max-age%3D60 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse::<u16>()
        .unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (n, v) = line.split_once(':').unwrap();
        headers.append(
            HeaderName::from_bytes(n.trim().as_bytes()).unwrap(),
            v.trim().parse().unwrap(),
        );
    }
    Reply {
        status: StatusCode::from_u16(status).unwrap(),
        headers,
        body: Bytes::from(body.to_owned()),
    }
}

#[tokio::test]
async fn path_confusion_never_makes_a_private_page_cacheable() {
    for h in Harness::both().await {
        let confusing = [
            "/account/x.css",
            "/account;x.css",
            "/account/..%2fstatic/app.js",
            "//account",
            "/static/%2e%2e/account/x.png",
        ];
        for target in confusing {
            let alice = h.get_with(target, &[("x-user", "alice")]).await;
            assert_eq!(alice.h("cache-control"), "private", "{} {target}", h.name);
            let bob = h.get(target).await;
            assert!(!bob.text().contains("alice"), "{} {target}", h.name);
        }
        assert_eq!(h.calls(), 2 * confusing.len(), "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn different_requests_never_share_a_key_and_braces_do_not_steer_slots() {
    for h in Harness::both().await {
        let targets = [
            "/k/a?b=c",
            "/k/a%3Fb=c",
            "/k/a?b%3Dc",
            "/k/%7Bslot%7D",
            "/k/%7bslot%7d",
            "/k/x?{tag}=1",
        ];
        let mut bodies = Vec::new();
        for t in targets {
            let target = format!(
                "{t}{}cc=max-age%3D60",
                if t.contains('?') { "&" } else { "?" }
            );
            bodies.push(h.get(&target).await.body);
        }
        assert_eq!(
            h.calls(),
            targets.len(),
            "{}: each a key of its own",
            h.name
        );
        let keys = h.stored_in_valkey().await;
        assert_eq!(keys.len(), targets.len(), "{}", h.name);
        for key in keys {
            let hash = key
                .strip_prefix("tc:{")
                .and_then(|k| k.strip_suffix("}:e"))
                .unwrap_or("");
            assert!(
                hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                "{key}"
            );
        }
    }
}

#[tokio::test]
async fn cache_status_never_emits_the_key() {
    for h in Harness::both().await {
        let target = "/secret-path-xyz?token=abc123&cc=max-age%3D60";
        for r in [h.get(target).await, h.get(target).await] {
            let status = r.h("cache-status");
            assert!(status.starts_with("tiercache;"), "{status}");
            assert!(
                !status.contains("secret") && !status.contains("abc123") && !status.contains(HOST),
                "{status}"
            );
        }
    }
}

#[tokio::test]
async fn head_never_poisons_get() {
    for h in Harness::both().await {
        let target = "/h?cc=max-age%3D60";
        let head = h
            .send(h.request("HEAD", target).body(Body::empty()).unwrap())
            .await;
        assert!(head.body.is_empty());
        let get = h.get(target).await;
        assert_eq!(
            get.x_cache(),
            "HIT",
            "{}: the HEAD loaded the GET entry",
            h.name
        );
        assert!(
            get.text().contains("method=GET"),
            "{}: {}",
            h.name,
            get.text()
        );
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

// ---------------------------------------------------------------------- abuse

#[tokio::test]
async fn a_20_mb_body_streams_through_intact_and_unstored() {
    for h in Harness::both().await {
        let target = "/big?size=20000000&cc=max-age%3D60";
        for _ in 0..2 {
            let r = h.get(target).await;
            assert_eq!(r.body.len(), 20_000_000, "{}", h.name);
            assert!(r.body == big_body(20_000_000), "{}: bytes changed", h.name);
            // Too large; the second time the key is known uncacheable.
            let status = r.h("cache-status");
            assert!(
                status.contains("too-large") || status.contains("hit-for-miss"),
                "{status}"
            );
        }
        assert_eq!(h.calls(), 2, "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn a_flood_of_unique_urls_keeps_l1_in_its_budget() {
    let budget = 256 * 1024;
    let settings = Settings {
        l1_capacity: budget,
        ..Settings::default()
    };
    for h in [
        Harness::layer(settings.clone()).await,
        Harness::proxy(settings).await,
    ] {
        for i in 0..1500 {
            h.get(&format!("/flood/{i}?size=1000&cc=max-age%3D60"))
                .await;
        }
        let engine = h.engine();
        assert!(
            engine.l1_weighted_size() <= budget,
            "{}: {} bytes",
            h.name,
            engine.l1_weighted_size()
        );
        assert!(engine.l1_entry_count() < 1500, "{}", h.name);
        assert_eq!(engine.in_flight(), 0, "{}", h.name);
        assert!(engine.stats().evicted > 0, "{}", h.name);
    }
}
