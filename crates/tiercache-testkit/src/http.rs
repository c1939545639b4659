//! Driving an axum app in process, the way the integration tests do.

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// The host every helper request names.
pub const HOST: &str = "shop.test";

/// Sends `method path` (with `Host: shop.test`, no body) to `app` and reads
/// the whole answer: status, headers, body as text.
pub async fn send(app: &Router, method: &str, path: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", HOST)
        .body(Body::empty())
        .expect("a valid request");
    let res = app.clone().oneshot(req).await.expect("routers do not fail");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("a readable body").to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// A body that sends three bytes (`bod`), then fails: an upstream that
/// resets midway, or a stalled one cut by its timeout. [`after`](Self::after)
/// waits between the two, so a server sends the head and the first bytes
/// before the failure (else it may close the connection with nothing sent).
///
/// ```
/// let body = axum::body::Body::new(tiercache_testkit::http::BreaksOff::default());
/// # drop(body);
/// ```
#[derive(Debug, Default)]
pub struct BreaksOff {
    sent: bool,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl BreaksOff {
    /// Fails `pause` after its first bytes.
    pub fn after(pause: std::time::Duration) -> Self {
        Self {
            sent: false,
            pause: Some(Box::pin(tokio::time::sleep(pause))),
        }
    }
}

impl axum::body::HttpBody for BreaksOff {
    type Data = axum::body::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        if !std::mem::replace(&mut self.sent, true) {
            let bytes = axum::body::Bytes::from_static(b"bod");
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(bytes))));
        }
        if let Some(pause) = self.pause.as_mut()
            && pause.as_mut().poll(cx).is_pending()
        {
            return Poll::Pending;
        }
        Poll::Ready(Some(Err(std::io::Error::other("upstream reset"))))
    }
}

/// A body of two chunks: `first` at once, then what `rest` yields once it
/// is ready (a gate opened, a pause over): an upstream slow in the middle
/// of its answer.
pub struct TwoChunks {
    first: Option<&'static str>,
    rest: Option<std::pin::Pin<Box<dyn std::future::Future<Output = &'static str> + Send>>>,
}

impl std::fmt::Debug for TwoChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoChunks")
            .field("first", &self.first)
            .field("rest", &self.rest.as_ref().map(|_| "pending"))
            .finish()
    }
}

impl TwoChunks {
    /// `first`, then `rest`'s output.
    pub fn new(
        first: &'static str,
        rest: impl std::future::Future<Output = &'static str> + Send + 'static,
    ) -> Self {
        Self {
            first: Some(first),
            rest: Some(Box::pin(rest)),
        }
    }
}

impl axum::body::HttpBody for TwoChunks {
    type Data = axum::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(first.into()))));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let rest = std::task::ready!(rest.as_mut().poll(cx));
        self.rest = None;
        Poll::Ready(Some(Ok(hyper::body::Frame::data(rest.into()))))
    }
}

/// A body that never ends: server-sent events (`data: 0`, `data: 1`, …),
/// one every `every`, the first at once, until its reader goes.
///
/// ```
/// let events = tiercache_testkit::http::Events::every(std::time::Duration::from_millis(20));
/// let body = axum::body::Body::new(events);
/// # drop(body);
/// ```
#[derive(Debug)]
pub struct Events {
    sent: usize,
    every: std::time::Duration,
    /// Started at the first read (a timer needs the runtime).
    ticks: Option<tokio::time::Interval>,
}

impl Events {
    /// An event every `every`.
    pub fn every(every: std::time::Duration) -> Self {
        Self {
            sent: 0,
            every,
            ticks: None,
        }
    }
}

impl axum::body::HttpBody for Events {
    type Data = axum::body::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let every = self.every;
        let ticks = self
            .ticks
            .get_or_insert_with(|| tokio::time::interval(every));
        if ticks.poll_tick(cx).is_pending() {
            return std::task::Poll::Pending;
        }
        let event = format!("data: {}\n\n", self.sent);
        self.sent += 1;
        let data = axum::body::Bytes::from(event);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(data))))
    }
}

/// A header's value as text (empty when absent).
pub fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Returns once `b` answers from L2 what `a` has just stored, over at least
/// `rounds` fresh URLs (`/p/{prefix}1`, `/p/{prefix}2`, …; more URLs reach
/// more cluster slots). Each round GETs the URL through `a`, awaits `flush`
/// (`a`'s queued L2 writes), then GETs it through `b`; a round `b` did not
/// answer from L2 is retried after 20 ms. Wrap it in
/// [`bounded`](crate::bounded).
pub async fn until_shared_through_l2<F: Future<Output = ()>>(
    a: &Router,
    b: &Router,
    flush: impl Fn() -> F,
    prefix: &str,
    rounds: usize,
) {
    for i in 1.. {
        let path = format!("/p/{prefix}{i}");
        send(a, "GET", &path).await;
        flush().await;
        let (_, headers, _) = send(b, "GET", &path).await;
        if header(&headers, "x-cache-tier") != "l2" {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        } else if i >= rounds {
            return;
        }
    }
}

/// Request loops over fresh URLs (`/p/load0`, `/p/load1`, …: every request
/// a cold miss) against an app whose `/p/{id}` answers `product {id}`,
/// counting right answers and everything else, until [`finish`](Self::finish).
#[derive(Debug)]
pub struct Load {
    ok: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    failed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Starts `clients` loops on `app`.
    pub fn start(app: &Router, clients: usize) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let load = Self {
            ok: Default::default(),
            failed: Default::default(),
            stop: Default::default(),
            tasks: Vec::new(),
        };
        let next = std::sync::Arc::new(AtomicUsize::new(0));
        let tasks = (0..clients)
            .map(|_| {
                let (app, next) = (app.clone(), next.clone());
                let (ok, failed, stop) = (load.ok.clone(), load.failed.clone(), load.stop.clone());
                tokio::spawn(async move {
                    while !stop.load(SeqCst) {
                        let i = next.fetch_add(1, SeqCst);
                        let (status, _, body) = send(&app, "GET", &format!("/p/load{i}")).await;
                        if status == StatusCode::OK && body == format!("product load{i}") {
                            ok.fetch_add(1, SeqCst);
                        } else {
                            failed.fetch_add(1, SeqCst);
                        }
                    }
                })
            })
            .collect();
        Self { tasks, ..load }
    }

    /// Right answers so far.
    pub fn ok(&self) -> usize {
        self.ok.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits (30 s at most) for `more` right answers than now.
    pub async fn answers(&self, more: usize) {
        let target = self.ok() + more;
        crate::eventually(&format!("{target} answers"), || self.ok() >= target).await;
    }

    /// Stops the loops; returns `(right answers, failed requests)`.
    pub async fn finish(self) -> (usize, usize) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for task in self.tasks {
            task.await.expect("a load loop panicked");
        }
        let ordering = std::sync::atomic::Ordering::SeqCst;
        (self.ok.load(ordering), self.failed.load(ordering))
    }
}

/// A client connection to `addr` speaking HTTP/2 with prior knowledge
/// (h2c), the stream window at `window` bytes (`None`: hyper's default):
/// its sender, and the task driving it, which ends with the connection.
pub async fn h2c(
    addr: std::net::SocketAddr,
    window: Option<u32>,
) -> (
    hyper::client::conn::http2::SendRequest<Body>,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(window)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("the server speaks h2c");
    (sender, tokio::spawn(conn))
}
