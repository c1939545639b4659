//! The accept loop: what `axum::serve` does (HTTP/1 and h2c on one port,
//! the client's address as `ConnectInfo`), plus a timer, so a client that
//! sends its head slowly, or nothing at all, is cut off instead of holding a
//! connection for ever (`axum::serve` sets no timer, so hyper has none).

use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tower::ServiceExt;

use crate::replayed::{H2_PREFACE, Replayed, read_version};

/// Where a server is in stopping (see [`serve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Running,
    /// No new connections; the open ones finish what they started.
    Draining,
    /// The connections still open are closed.
    Now,
}

/// The largest HTTP/1 request head read (a larger one is answered 431).
const MAX_HEAD: usize = 64 * 1024;

/// Serves `app` on `listener` until the task is dropped. `timeout` bounds
/// how long a client may take to send a request's head, how long a
/// keep-alive connection may sit idle between requests (hyper times both
/// with one timer), how long a new connection may take to show which
/// HTTP it speaks, and how long a client may leave what is sent to it
/// unread (as nginx's `send_timeout`: hyper has no write timer, and a
/// client that never reads would hold its connection, and the body it
/// pins, for ever). Over HTTP/2, a connection that starts no request for
/// `timeout` is shut down gracefully, and closed if it then writes next
/// to nothing for another `timeout` while waiting on no upstream (a
/// client that keeps its flow-control window shut).
///
/// `app` is any service (an axum `Router` for the admin port; the proxy's
/// own dispatch for the main one, which needs no router's work a request).
///
/// Once `stop` says [`Stop::Draining`] it accepts no more connections and
/// shuts each open one down gracefully (requests in flight are answered,
/// then the connection closes); [`Stop::Now`] closes those still open. It
/// returns when every one is done.
pub(crate) async fn serve<S, B>(
    listener: TcpListener,
    app: S,
    timeout: Duration,
    max_connections: usize,
    mut stop: watch::Receiver<Stop>,
) where
    S: tower::Service<Request<Body>, Response = Response<B>, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // hyper's own builders, not hyper-util's `auto` one: the version is
    // known here already, and `auto` read the first bytes again itself and
    // replayed them alone (as `Replayed` did), so hyper's first read held
    // only those and the head's rest doubled its read buffer (16 KiB a
    // connection, not 8).
    let mut http1 = http1::Builder::new();
    // A request head of 64 KiB at most (nginx takes 32 KiB; it bounds the
    // write buffer too, which only a pipelining client fills): hyper's
    // ~400 KiB read buffer let each unfinished head hold that much for the
    // whole client timeout, 170 MiB for 500 slow connections.
    // The buffer's bound alone is loose: a read may fill the buffer's
    // room past it, and a head complete in it passes. The head's own
    // bound is exact (it bounds chunked trailers too: 64 KiB, not
    // hyper's 16).
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .max_buf_size(MAX_HEAD)
        .max_header_size(MAX_HEAD);
    // HTTP/2: a ping every `timeout`, and a client that does not answer
    // one within 20 s is dropped (a dead peer, or one that ignores the
    // shutdown below).
    // And at most 128 requests at once on one connection, as nginx's
    // `http2_max_concurrent_streams` (hyper's 200); more wait on the
    // client's side. Each stream buffers 64 KiB of a streamed answer before
    // it stops pulling more (hyper's 400 KiB); a stored answer is one chunk,
    // held whole until the client reads it (see the README).
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .keep_alive_interval(timeout)
        .keep_alive_timeout(Duration::from_secs(20))
        .max_concurrent_streams(128)
        .max_send_buf_size(64 * 1024);
    // Each connection's task holds a sender: when all are gone, all are done.
    let (open, mut all_closed) = mpsc::channel::<()>(1);
    // And a place among `max_connections`: with none free, nothing is
    // accepted (new connections wait in the kernel's backlog).
    let places = Arc::new(tokio::sync::Semaphore::new(
        max_connections.min(tokio::sync::Semaphore::MAX_PERMITS),
    ));
    loop {
        let place = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop != Stop::Running) => break,
            place = places.clone().acquire_owned() => place,
        };
        let Ok(place) = place else { break };
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop != Stop::Running) => break,
            accepted = listener.accept() => accepted,
        };
        let (mut stream, remote) = match accepted {
            Ok(accepted) => accepted,
            // One connection's trouble, not the listener's.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionRefused
                ) =>
            {
                continue;
            }
            Err(e) => {
                // Out of file descriptors, or a connection reset before it
                // was accepted: wait a little rather than spin.
                eprintln!("tiercache-proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let app = app.clone();
        let (http1, http2) = (http1.clone(), http2.clone());
        let (open, mut stop) = (open.clone(), stop.clone());
        tokio::spawn(async move {
            let _open = (open, place);
            // hyper reads the first bytes to tell HTTP/1 from HTTP/2 with
            // no timer (a client sending `P` and no more would be held for
            // ever): they are read here, within the timeout, and replayed.
            let read = tokio::time::timeout(timeout, read_version(&mut stream));
            let first = tokio::select! {
                biased;
                read = read => read,
                // Stopping: a connection that has sent no request yet goes.
                _ = stop.wait_for(|stop| *stop != Stop::Running) => return,
            };
            let Ok(Ok(first)) = first else {
                return;
            };
            let h2 = first == H2_PREFACE;
            let with_address = move |req: Request<Incoming>| {
                let mut req = req.map(Body::new);
                req.extensions_mut()
                    .insert(ConnectInfo::<SocketAddr>(remote));
                req
            };
            let written = Arc::new(AtomicU64::new(0));
            let io = TokioIo::new(Replayed::new(first, stream, timeout, written.clone()));
            if !h2 {
                let service = TowerToHyperService::new(app.map_request(with_address));
                let mut conn = pin!(http1.serve_connection(io, service).with_upgrades());
                // A connection's error (a reset, a timeout) is that client's.
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = stop.wait_for(|stop| *stop != Stop::Running) => {}
                }
                // The request in flight is answered, then the connection
                // closes; at `Stop::Now` it closes as it is.
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = stop.wait_for(|stop| *stop == Stop::Now) => {}
                }
                return;
            }
            // For HTTP/2's watchdog: requests started, and what the
            // connection waits on other than the client.
            let sending = Arc::new(Sending::default());
            let (answering, watched) = (sending.clone(), sending.clone());
            let service = app
                .map_request(with_address)
                .map_future(move |answer| {
                    let answering = InService::new(answering.clone());
                    async move {
                        let answer = answer.await;
                        drop(answering);
                        answer
                    }
                })
                .map_response(move |res: Response<B>| {
                    res.map(|body| Watched::new(body, watched.clone()))
                });
            let service = TowerToHyperService::new(service);
            let mut conn = pin!(http2.serve_connection(io, service));
            // hyper has no idle timeout for HTTP/2 (HTTP/1's is its header
            // timer): a connection that starts no request for `timeout` is
            // shut down gracefully, streams in flight finishing first. And
            // no send timer: a client that takes no data (its flow-control
            // window left shut) leaves no write pending for `Replayed` to
            // time, and h2 holds what hyper handed it. So once closing, a
            // connection that wrote next to nothing for `timeout` while
            // waiting on nothing but its client is closed.
            let mut now = stop.clone();
            let mut seen = 0;
            let mut closing = false;
            let mut written_before = 0;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    // Stopping: streams in flight finish, no new ones.
                    _ = stop.wait_for(|stop| *stop != Stop::Running), if !closing => {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    _ = now.wait_for(|stop| *stop == Stop::Now) => return,
                    () = tokio::time::sleep(timeout) => {
                        let written_now = written.load(Relaxed);
                        if closing
                            && written_now - written_before < PROGRESS_BYTES
                            && !sending.waits_on_source()
                        {
                            return;
                        }
                        let now = sending.started.load(Relaxed);
                        if now == seen && !closing {
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                        seen = now;
                        written_before = written_now;
                    }
                }
            }
        });
    }
    // No more connections; the open ones finish what they started.
    drop(listener);
    drop(open);
    let _ = all_closed.recv().await;
}

/// Fewer bytes written in a watchdog tick than this, by a closing HTTP/2
/// connection, is no progress: its GOAWAY and the pings are ~50.
const PROGRESS_BYTES: u64 = 1024;

/// What an HTTP/2 connection waits on other than its client.
#[derive(Default)]
struct Sending {
    /// Requests started (for the idle shutdown).
    started: AtomicU64,
    /// Requests whose response head has not come yet.
    in_service: AtomicU64,
    /// Response bodies whose last poll was pending on their own source
    /// (the upstream, or the cache's fill).
    on_source: AtomicU64,
}

impl Sending {
    /// Whether the connection waits on an upstream (whose own timeout
    /// bounds it), not only on its client.
    fn waits_on_source(&self) -> bool {
        self.in_service.load(Relaxed) > 0 || self.on_source.load(Relaxed) > 0
    }
}

/// A request of an HTTP/2 connection being answered (counted until its
/// response head comes, or it is dropped).
struct InService(Arc<Sending>);

impl InService {
    fn new(sending: Arc<Sending>) -> Self {
        sending.started.fetch_add(1, Relaxed);
        sending.in_service.fetch_add(1, Relaxed);
        Self(sending)
    }
}

impl Drop for InService {
    fn drop(&mut self) {
        self.0.in_service.fetch_sub(1, Relaxed);
    }
}

/// An HTTP/2 response body, watched: whether it waits on its own source.
struct Watched<B> {
    body: B,
    sending: Arc<Sending>,
    /// Its last poll was pending on the body's own source.
    on_source: bool,
}

impl<B> Watched<B> {
    fn new(body: B, sending: Arc<Sending>) -> Self {
        Self {
            body,
            sending,
            on_source: false,
        }
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        let on_source = polled.is_pending();
        if on_source != this.on_source {
            this.on_source = on_source;
            if on_source {
                this.sending.on_source.fetch_add(1, Relaxed);
            } else {
                this.sending.on_source.fetch_sub(1, Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for Watched<B> {
    fn drop(&mut self) {
        if self.on_source {
            self.sending.on_source.fetch_sub(1, Relaxed);
        }
    }
}
