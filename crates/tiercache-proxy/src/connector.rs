//! The upstream connector: hyper-util's `HttpConnector`, each connection
//! stamped with when it was opened, so a failed request can tell a kept-alive
//! connection (which the upstream may have closed as the request arrived:
//! worth sending once more) from the one it opened itself (an upstream that
//! took the request and then dropped it: sending it again would be a second
//! origin call for one load).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// When a connection was opened, in its [`Connected`] extras.
#[derive(Debug, Clone, Copy)]
struct Opened(Instant);

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
                opened: Instant::now(),
            })
        })
    }
}

/// A connection to the upstream and when it was opened.
#[derive(Debug)]
pub(crate) struct Stamped {
    io: TokioIo<TcpStream>,
    opened: Instant,
}

/// Whether the request that failed with `error`, sent at `sent`, is worth
/// sending once more: it went out on a connection opened before it (one
/// kept alive from an earlier request, which the upstream may have closed
/// as it arrived), or was never written at all (hyper canceled it; hyper-util
/// resends those itself only on a kept connection). A failure before any
/// connection was had is not.
pub(crate) fn worth_sending_again(
    error: &hyper_util::client::legacy::Error,
    sent: Instant,
) -> bool {
    let never_written = std::error::Error::source(error)
        .and_then(|e| e.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_canceled);
    let Some(info) = error.connect_info() else {
        return false;
    };
    if never_written {
        return true;
    }
    let mut extras = http::Extensions::new();
    info.get_extras(&mut extras);
    extras.get::<Opened>().is_some_and(|opened| opened.0 < sent)
}

impl Connection for Stamped {
    fn connected(&self) -> Connected {
        self.io.connected().extra(Opened(self.opened))
    }
}

impl Read for Stamped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl Write for Stamped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
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
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}
