//! The upstream connector: hyper-util's `HttpConnector`, each connection
//! stamped with when it was opened, so a failed request can tell a kept-alive
//! connection (which the upstream may have closed as the request arrived:
//! worth sending once more) from the one it opened itself (an upstream that
//! took the request and then dropped it: sending it again would be a second
//! origin call for one load), and sharing a [`Lease`] with the answers read
//! from it: an idle connection is closed a margin before the upstream said
//! it would close it itself (its `Keep-Alive: timeout=N`), so no request
//! meets that close on the way (a POST is never sent twice: it was a 502).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// `HttpConnector`, stamping each connection with when it was opened.
#[derive(Debug, Clone)]
pub(crate) struct StampingConnector(pub(crate) HttpConnector);

impl tower::Service<Uri> for StampingConnector {
    type Response = Stamped;
    type Error = <HttpConnector as tower::Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Stamped, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            Ok(Stamped {
                io,
                lease: Arc::new(Lease::new()),
                read_last: true,
                last_read: tokio::time::Instant::now(),
                reuse_ends: None,
            })
        })
    }
}

/// A connection to the upstream, when it was opened, and its [`Lease`].
#[derive(Debug)]
pub(crate) struct Stamped {
    io: TokioIo<TcpStream>,
    lease: Arc<Lease>,
    /// Whether it read last: a write then begins a new exchange.
    read_last: bool,
    /// When it last read: an idle connection's time counts from there.
    last_read: tokio::time::Instant,
    /// Fires when the idle connection stops being reused.
    reuse_ends: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Whether the request that failed with `error`, sent at `sent`, is worth
/// sending once more: it went out on a connection opened before it (one
/// kept alive from an earlier request, which the upstream may have closed
/// as it arrived) and failed as it arrived (within
/// [`CLOSED_AS_IT_ARRIVED`], which leaves room for a far upstream and a
/// busy proxy), or was never written at all (hyper canceled
/// it; hyper-util resends those itself only on a kept connection). A
/// failure before any connection was had is not, nor one the upstream
/// held a while first: it took the request, and failed on it; nor an
/// answer hyper could not read (a head too long, or malformed): the
/// upstream took the request and answered it.
pub(crate) fn worth_sending_again(
    error: &hyper_util::client::legacy::Error,
    sent: Instant,
) -> bool {
    let cause = hyper_cause(error);
    if cause.is_some_and(hyper::Error::is_parse) {
        return false;
    }
    let never_written = cause.is_some_and(hyper::Error::is_canceled);
    let Some(info) = error.connect_info() else {
        return false;
    };
    if never_written {
        return true;
    }
    let mut extras = http::Extensions::new();
    info.get_extras(&mut extras);
    sent.elapsed() < CLOSED_AS_IT_ARRIVED
        && extras
            .get::<Arc<Lease>>()
            .is_some_and(|lease| lease.opened < sent)
}

/// hyper's error behind hyper-util's (its source), if any.
pub(crate) fn hyper_cause(error: &hyper_util::client::legacy::Error) -> Option<&hyper::Error> {
    std::error::Error::source(error).and_then(|e| e.downcast_ref::<hyper::Error>())
}

/// How soon a request on a kept-alive connection must fail to be the
/// upstream's close of that idle connection crossing it (which shows within
/// a round trip), not a failure of the upstream on the request itself (a
/// worker killed mid-request), which a second try would double.
const CLOSED_AS_IT_ARRIVED: Duration = Duration::from_millis(200);

/// When a connection was opened, what the upstream said of how long it
/// keeps an idle one, and whether every answer read from this one has
/// ended: in the connection's [`Connected`] extras, shared by the
/// connection (which, idle, ends itself a margin before the upstream
/// would) and the answers read from it (which tell it the last two).
#[derive(Debug)]
pub(crate) struct Lease {
    opened: Instant,
    /// The upstream's `Keep-Alive: timeout=N` in its last answer, in
    /// milliseconds (0: none said).
    keep_alive_ms: AtomicU64,
    /// Requests begun on the connection: a write after a read begins one
    /// when every answer so far has ended (else it is the same request's:
    /// its body after a `100 Continue`, or a request hyper sent while a
    /// slow client still held the last answer's end). An upload that goes
    /// on after its answer ended counts as one more, and keeps the
    /// connection from looking idle: the pool's own timeout applies then.
    begun: AtomicU64,
    /// Answers read from it that ended (read whole, or dropped).
    ended: AtomicU64,
    /// The connection's task, waiting to read: woken when an answer ends,
    /// since it looked at the counts before.
    reader: Mutex<Option<Waker>>,
}

impl Lease {
    /// The lease of a connection opened now.
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            keep_alive_ms: AtomicU64::new(0),
            begun: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            reader: Mutex::new(None),
        }
    }

    /// Takes the upstream's `Keep-Alive: timeout=N` from an answer's head
    /// (before its hop-by-hop fields are stripped); an answer without one
    /// takes it back. Past a day it is no bound worth keeping (the pool's
    /// own idle timeout is shorter), and no deadline is pushed past what
    /// a clock can add.
    pub(crate) fn answered(&self, headers: &http::HeaderMap) {
        const DAY: u64 = 24 * 3600;
        let ms = keep_alive_timeout(headers).map_or(0, |seconds| seconds.min(DAY) * 1000);
        self.keep_alive_ms.store(ms, Relaxed);
    }

    /// An answer read from the connection ended: once every answer has,
    /// the connection is idle.
    pub(crate) fn ended(&self) {
        self.ended.fetch_add(1, SeqCst);
        let reader = self.reader.lock().unwrap().take();
        if let Some(reader) = reader {
            reader.wake();
        }
    }

    /// The connection wrote after it read: a new request if every answer
    /// so far has ended (see [`Lease::begun`]). Only the connection's own
    /// task writes, so the load and the store do not race another write.
    fn wrote_after_read(&self) {
        let ended = self.ended.load(SeqCst);
        if ended >= self.begun.load(SeqCst) {
            self.begun.store(ended + 1, SeqCst);
        }
    }

    /// The connection's task waits to read.
    fn waiting(&self, waker: &Waker) {
        let mut reader = self.reader.lock().unwrap();
        if !reader.as_ref().is_some_and(|known| known.will_wake(waker)) {
            *reader = Some(waker.clone());
        }
    }

    /// When the connection, idle since its `last_read`, stops being
    /// reused: a second (half the timeout, for one under two seconds)
    /// before the upstream would close it; `None` while a request is in
    /// flight on it (begun, its answer not ended) or the upstream named no
    /// timeout.
    fn reuse_until(&self, last_read: tokio::time::Instant) -> Option<tokio::time::Instant> {
        let keep_alive = Duration::from_millis(self.keep_alive_ms.load(Relaxed));
        if keep_alive.is_zero() || self.ended.load(SeqCst) < self.begun.load(SeqCst) {
            return None;
        }
        let margin = Duration::from_secs(1).min(keep_alive / 2);
        Some(last_read + keep_alive - margin)
    }
}

/// `timeout=N` of a `Keep-Alive` field (RFC 2068 §19.7.1.1, which servers
/// such as Node and Apache still send), in seconds.
fn keep_alive_timeout(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get_all("keep-alive")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|param| {
            let (name, value) = param.split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("timeout")
                .then(|| value.trim().parse().ok())?
        })
}

impl Connection for Stamped {
    fn connected(&self) -> Connected {
        self.io.connected().extra(self.lease.clone())
    }
}

impl Read for Stamped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Poll::Ready(read) = Pin::new(&mut this.io).poll_read(cx, buf) {
            this.read_last = true;
            this.last_read = tokio::time::Instant::now();
            return Poll::Ready(read);
        }
        this.lease.waiting(cx.waker());
        // Only after a read: a write since (an upload that goes on after
        // its answer ended) is not idle.
        let until = this
            .read_last
            .then(|| this.lease.reuse_until(this.last_read))
            .flatten();
        let Some(until) = until else {
            this.reuse_ends = None;
            return Poll::Pending;
        };
        let timer = this
            .reuse_ends
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
        if timer.deadline() != until {
            timer.as_mut().reset(until);
        }
        // Ended here as the upstream would end it: hyper reads the end and
        // takes the connection out of the pool.
        timer.as_mut().poll(cx).map(|()| Ok(()))
    }
}

impl Stamped {
    /// After a write: one after a read may begin a request.
    fn wrote(&mut self, written: &Poll<io::Result<usize>>) {
        if self.read_last && matches!(written, Poll::Ready(Ok(n)) if *n > 0) {
            self.read_last = false;
            self.lease.wrote_after_read();
        }
    }
}

impl Write for Stamped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.wrote(&written);
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.wrote(&written);
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idle only when every answer read has ended, whatever the order:
    /// a body sent after a `100 Continue` is the same request's; an answer
    /// whose end a slow client held while hyper sent the next request on
    /// the connection ends late.
    #[test]
    fn a_connection_is_idle_once_every_answer_has_ended() {
        let lease = Lease::new();
        lease.keep_alive_ms.store(5_000, Relaxed);
        let idle = || lease.reuse_until(tokio::time::Instant::now()).is_some();
        assert!(idle(), "nothing sent yet");
        // Head, `100 Continue` read, body: one request.
        lease.wrote_after_read();
        assert!(!idle());
        lease.wrote_after_read();
        lease.ended();
        assert!(idle());
        // Request 2, read whole by hyper, its end held by a slow client;
        // request 3 sent on the connection meanwhile, and answered.
        lease.wrote_after_read();
        lease.wrote_after_read();
        lease.ended();
        assert!(idle(), "both answers read");
        // Request 2's end comes late; request 4 is in flight.
        lease.ended();
        lease.wrote_after_read();
        assert!(!idle(), "request 4 in flight");
        lease.ended();
        assert!(idle());
        // No timeout named: never ended by the lease.
        lease.keep_alive_ms.store(0, Relaxed);
        assert!(!idle());
    }

    #[test]
    fn the_keep_alive_timeout_is_read_from_its_field() {
        let timeout = |values: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for v in values {
                headers.append("keep-alive", v.parse().unwrap());
            }
            keep_alive_timeout(&headers)
        };
        assert_eq!(timeout(&["timeout=5"]), Some(5));
        assert_eq!(timeout(&["max=100, Timeout = 15"]), Some(15));
        assert_eq!(timeout(&["max=100", "timeout=2"]), Some(2));
        assert_eq!(timeout(&["max=100"]), None);
        assert_eq!(timeout(&["timeout=soon"]), None);
        assert_eq!(timeout(&["timeout=18446744073709551615"]), Some(u64::MAX));
        let lease = Lease::new();
        let mut huge = http::HeaderMap::new();
        huge.insert(
            "keep-alive",
            "timeout=18446744073709551615".parse().unwrap(),
        );
        lease.answered(&huge);
        assert_eq!(lease.keep_alive_ms.load(Relaxed), 24 * 3600 * 1000);
        assert_eq!(timeout(&[]), None);
    }
}
