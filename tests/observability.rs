//! Traces: one `tiercache` span per cached request, with the key's hash,
//! the outcome and the tier, and nothing from the URL or the body. Metrics:
//! a route's lock timeouts and early refreshes under its `route` label.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::get;
use http_body_util::BodyExt;
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tower::ServiceExt;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Every field written to a span or event, as `(span id or 0, name, value)`.
#[derive(Clone, Default)]
struct Capture {
    fields: Arc<Mutex<Vec<(u64, String, String)>>>,
    next: Arc<Mutex<u64>>,
    /// Entered spans, innermost last (what `Span::current()` reads).
    stack: Arc<Mutex<Vec<(u64, &'static Metadata<'static>)>>>,
    metadata: Arc<Mutex<std::collections::HashMap<u64, &'static Metadata<'static>>>>,
}

struct Fields<'a>(&'a Capture, u64);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        let value = format!("{value:?}").trim_matches('"').to_owned();
        let mut fields = self.0.fields.lock().unwrap();
        fields.push((self.1, field.name().to_owned(), value));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut next = self.next.lock().unwrap();
        *next += 1;
        let id = *next;
        self.fields
            .lock()
            .unwrap()
            .push((id, "span".into(), span.metadata().name().into()));
        span.record(&mut Fields(self, id));
        self.metadata.lock().unwrap().insert(id, span.metadata());
        Id::from_u64(id)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        values.record(&mut Fields(self, span.into_u64()));
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        event.record(&mut Fields(self, 0));
    }

    fn enter(&self, span: &Id) {
        let meta = self.metadata.lock().unwrap()[&span.into_u64()];
        self.stack.lock().unwrap().push((span.into_u64(), meta));
    }

    fn exit(&self, span: &Id) {
        let mut stack = self.stack.lock().unwrap();
        if let Some(i) = stack.iter().rposition(|(id, _)| *id == span.into_u64()) {
            stack.remove(i);
        }
    }

    fn current_span(&self) -> tracing_core::span::Current {
        match self.stack.lock().unwrap().last() {
            Some((id, meta)) => tracing_core::span::Current::new(Id::from_u64(*id), meta),
            None => tracing_core::span::Current::none(),
        }
    }
}

thread_local! {
    /// The capture of the test running on this thread, if it installed one.
    static CAPTURE: std::cell::RefCell<Option<Capture>> = const { std::cell::RefCell::new(None) };
}

/// The one global subscriber of this file's tests: it forwards to the
/// capture its thread installed. Thread-local subscribers (`set_default`)
/// race with another test thread's first use of a callsite, which
/// tracing-core may then cache as "never" for every subscriber: a capture
/// saw no span once in CI.
struct Forward;

impl Forward {
    fn to<T>(&self, f: impl FnOnce(&Capture) -> T) -> Option<T> {
        CAPTURE.with(|c| c.borrow().as_ref().map(f))
    }
}

impl Subscriber for Forward {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing_core::Interest {
        // Asked again on every use: whether this thread captures.
        tracing_core::Interest::sometimes()
    }

    fn enabled(&self, _: &Metadata<'_>) -> bool {
        self.to(|_| true).unwrap_or(false)
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        // Not enabled without a capture; an id is still owed.
        self.to(|c| c.new_span(span))
            .unwrap_or_else(|| Id::from_u64(u64::MAX))
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        self.to(|c| c.record(span, values));
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        self.to(|c| c.event(event));
    }

    fn enter(&self, span: &Id) {
        self.to(|c| c.enter(span));
    }

    fn exit(&self, span: &Id) {
        self.to(|c| c.exit(span));
    }

    fn current_span(&self) -> tracing_core::span::Current {
        self.to(|c| c.current_span())
            .unwrap_or_else(tracing_core::span::Current::none)
    }
}

/// Uninstalls this thread's capture when dropped.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        CAPTURE.with(|c| c.borrow_mut().take());
    }
}

impl Capture {
    /// Captures what this thread traces until the guard drops.
    fn install(&self) -> Installed {
        static FORWARD: std::sync::Once = std::sync::Once::new();
        FORWARD.call_once(|| {
            tracing::subscriber::set_global_default(Forward)
                .expect("no other global subscriber in this test binary");
        });
        CAPTURE.with(|c| *c.borrow_mut() = Some(self.clone()));
        Installed
    }

    /// The fields of span `id`.
    fn span(&self, id: u64) -> Vec<(String, String)> {
        let fields = self.fields.lock().unwrap();
        fields
            .iter()
            .filter(|(i, _, _)| *i == id)
            .map(|(_, n, v)| (n.clone(), v.clone()))
            .collect()
    }

    fn spans(&self) -> Vec<u64> {
        let fields = self.fields.lock().unwrap();
        fields
            .iter()
            .filter(|(_, n, v)| n == "span" && v == "tiercache")
            .map(|(i, _, _)| *i)
            .collect()
    }
}

#[tokio::test]
async fn each_cached_request_has_a_span_with_outcome_tier_and_key_hash_only() {
    let capture = Capture::default();
    let _installed = capture.install();
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let cache = ResponseCacheLayer::new(engine);
    let route = cache.route(Policy::ttl(Duration::from_secs(60))).unwrap();
    let app = Router::new().route(
        "/secret-path/{id}",
        get(|| async { "secret body" }).layer(route),
    );
    let send = |req: Request<Body>| {
        let app = app.clone();
        async move {
            let res = app.oneshot(req).await.unwrap();
            res.into_body().collect().await.unwrap();
        }
    };
    let get = |path: &str| {
        Request::get(path)
            .header("host", "shop.test")
            .body(Body::empty())
            .unwrap()
    };
    send(get("/secret-path/7?token=abc")).await;
    send(get("/secret-path/7?token=abc")).await;
    let mut with_cookie = get("/secret-path/7?token=abc");
    with_cookie
        .headers_mut()
        .insert("cookie", "session=s3cr3t".parse().unwrap());
    send(with_cookie).await;

    let spans = capture.spans();
    assert_eq!(spans.len(), 2, "one span per cached request");
    let field = |span: u64, name: &str| {
        capture
            .span(span)
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .unwrap_or_default()
    };
    let (miss, hit) = (spans[0], spans[1]);
    assert_eq!(
        (
            field(miss, "outcome").as_str(),
            field(miss, "tier").as_str()
        ),
        ("MISS", "origin")
    );
    assert_eq!(
        (field(hit, "outcome").as_str(), field(hit, "tier").as_str()),
        ("HIT", "l1")
    );
    let key = field(hit, "key");
    assert_eq!(key.len(), 32, "{key}");
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(field(miss, "key"), key);

    let everything = capture.fields.lock().unwrap().clone();
    assert!(
        everything
            .iter()
            .any(|(_, n, v)| n == "reason" && v == "cookie"),
        "the bypass is an event with its reason"
    );
    for (_, name, value) in everything {
        for secret in ["secret", "token", "abc", "s3cr3t"] {
            assert!(!value.contains(secret), "{name}={value} leaks {secret}");
        }
    }
}

/// The value of the Prometheus sample `name{…route="r"…}` in `text` (0 when absent).
fn route_sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| l.contains("route=\"r\""))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum()
}

/// `GET /r` from a client of `shop.test`.
/// `/r` answering "body", cached for 60 s under a route named `name`.
fn app_r(layer: &ResponseCacheLayer, name: &str) -> Router {
    let route = layer
        .route_named(name, Policy::ttl(Duration::from_secs(60)))
        .unwrap();
    // `with_state` turns the handler into a route once, as `axum::serve` does
    // (without it axum applies the layer again on every request).
    Router::new()
        .route("/r", get(|| async { "body" }).layer(route))
        .with_state(())
}

fn get_r() -> Request<Body> {
    Request::get("/r")
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap()
}

/// A layer, and its route `r` recording into a recorder of its own.
fn recorded(
    engine: TieredCache,
    policy: Policy,
) -> (
    ResponseCacheLayer,
    ResponseCacheLayer,
    metrics_exporter_prometheus::PrometheusHandle,
) {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let layer = ResponseCacheLayer::new(engine).metrics_recorder(std::sync::Arc::new(recorder));
    let route = layer.route_named("r", policy).unwrap();
    (layer, route, handle)
}

#[tokio::test(start_paused = true)]
async fn a_routes_lock_timeouts_are_counted_under_its_label() {
    use tiercache_testkit::{Counter, Gate};
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let policy = Policy::ttl(Duration::from_secs(60))
        .lock_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let (layer, route, recorder) = recorded(engine, policy);
    let (calls, gate) = (Counter::new(), Gate::new());
    let handler = {
        let (calls, gate) = (calls.clone(), gate.clone());
        move || {
            let (calls, gate) = (calls.clone(), gate.clone());
            async move {
                if calls.bump() == 1 {
                    // Only the leader's call hangs.
                    gate.passed().await;
                }
                "body"
            }
        }
    };
    let app = Router::new().route("/r", get(handler).layer(route));
    let leader = tokio::spawn(app.clone().oneshot(get_r()));
    calls.reached(1).await;
    let res = app.clone().oneshot(get_r()).await.unwrap();
    assert_eq!(res.headers()["x-cache"], "MISS", "the follower gave up");
    gate.open();
    leader.await.unwrap().unwrap();

    let text = recorder.render();
    assert_eq!(layer.engine().stats().lock_timeouts, 1);
    assert_eq!(
        route_sample(&text, "tiercache_route_lock_timeouts_total"),
        1.0,
        "{text}"
    );
    assert_eq!(
        route_sample(&text, "tiercache_lock_wait_seconds_count"),
        1.0,
        "{text}"
    );
}

#[tokio::test]
async fn a_routes_early_refreshes_are_counted_under_its_label() {
    use tiercache::core::MockClock;
    let clock = MockClock::new();
    let engine = TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build()
        .unwrap();
    // β = 1 and an origin that takes 1,000 s on the engine's clock: a hit
    // 1 µs before expiry refreshes with probability 1 − 1e-9.
    let policy = Policy::ttl(Duration::from_secs(3600))
        .jitter(0.0)
        .xfetch_beta(1.0)
        .build()
        .unwrap();
    let (layer, route, recorder) = recorded(engine.clone(), policy);
    let handler = {
        let clock = clock.clone();
        move || {
            clock.advance(Duration::from_secs(1000));
            async { "body" }
        }
    };
    let app = Router::new().route("/r", get(handler).layer(route));
    app.clone().oneshot(get_r()).await.unwrap();
    let key = tiercache::http::key::request_key(&get_r().into_parts().0);
    let left = engine.ttl(&key).await.expect("stored");
    clock.advance(left - Duration::from_micros(1));
    let res = app.clone().oneshot(get_r()).await.unwrap();
    assert_eq!(res.headers()["x-cache"], "HIT");

    let text = recorder.render();
    assert_eq!(layer.engine().stats().early_refreshes, 1);
    assert_eq!(
        route_sample(&text, "tiercache_route_early_refreshes_total"),
        1.0,
        "{text}"
    );
}

/// A route whose requests mostly carry a cookie bypasses the cache (the
/// safe default) and says why, once: a warning naming the way out.
#[tokio::test]
async fn cookies_causing_most_bypasses_are_warned_about_once() {
    let capture = Capture::default();
    let _installed = capture.install();
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let app = app_r(&layer, "pages");
    for _ in 0..60 {
        let req = Request::get("/r")
            .header("host", "shop.test")
            .header("cookie", "_ga=GA1.1.123")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req).await.unwrap();
    }
    let fields = capture.fields.lock().unwrap().clone();
    let warnings: Vec<_> = fields
        .iter()
        .filter(|(span, name, value)| {
            *span == 0 && name == "message" && value.contains("ignore_cookies")
        })
        .collect();
    assert_eq!(warnings.len(), 1, "{fields:?}");
    assert!(fields.iter().any(|(_, n, v)| n == "route" && v == "pages"));
}

/// A bypassed request is counted where the metrics doc says:
/// `tiercache_requests_total{outcome="bypass"}`, besides its reason. Reason
/// series appear on first use, not as a wall of zeros on the first scrape.
#[tokio::test]
async fn bypasses_are_requests_with_outcome_bypass() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    let (_layer, route, recorder) = recorded(engine, policy);
    let app = Router::new()
        .route("/r", get(|| async { "body" }).layer(route))
        .with_state(());
    let first = recorder.render();
    assert!(
        !first.contains("tiercache_bypass_total"),
        "no reason series before its first bypass:\n{first}"
    );
    let req = Request::get("/r")
        .header("host", "shop.test")
        .header("cookie", "_ga=GA1.1.123")
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(req).await.unwrap();
    let text = recorder.render();
    let bypass = text
        .lines()
        .filter(|l| l.starts_with("tiercache_requests_total{"))
        .filter(|l| l.contains("route=\"r\"") && l.contains("outcome=\"bypass\""))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum::<f64>();
    assert_eq!(bypass, 1.0, "{text}");
    assert_eq!(route_sample(&text, "tiercache_bypass_total"), 1.0, "{text}");
    let reasons = text
        .lines()
        .filter(|l| l.starts_with("tiercache_bypass_total{"))
        .count();
    assert_eq!(reasons, 1, "only the reason used has a series:\n{text}");
}

/// The recorder need not exist when the layer is built: a route's series are
/// registered on first use, in the recorder in force then.
#[tokio::test]
async fn a_recorder_installed_after_the_layer_is_built_gets_the_metrics() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let layer = ResponseCacheLayer::new(engine);
    let app = app_r(&layer, "r");
    // Installed late; thread-local, and this runtime runs on this thread.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    app.clone().oneshot(get_r()).await.unwrap();
    app.clone().oneshot(get_r()).await.unwrap();
    layer.publish_metrics();
    let text = handle.render();
    assert_eq!(
        route_sample(&text, "tiercache_requests_total"),
        2.0,
        "{text}"
    );
    assert!(text.contains("tiercache_l1_entries 1"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn the_engine_metrics_are_current_at_a_scrape_without_publish_metrics() {
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let layer = ResponseCacheLayer::new(engine).metrics_recorder(Arc::new(recorder));
    let app = app_r(&layer, "r");
    app.clone().oneshot(get_r()).await.unwrap();
    app.clone().oneshot(get_r()).await.unwrap();
    // No publish_metrics(): the layer's own task publishes within a second
    // (the paused clock moves on while every task waits).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let text = handle.render();
    assert!(text.contains("tiercache_l1_entries 1"), "{text}");
    assert!(text.contains("tiercache_origin_loads_total 1"), "{text}");
    assert!(text.contains("tiercache_hit_ratio 0.5"), "{text}");
    app.clone().oneshot(get_r()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let text = handle.render();
    assert!(
        text.contains("tiercache_hit_ratio 0.66"),
        "the next second's scrape sees the third request:\n{text}"
    );
}
