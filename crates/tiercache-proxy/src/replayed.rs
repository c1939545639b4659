//! A new connection's first bytes: read to tell HTTP/2 from HTTP/1, then
//! read again by hyper ([`Replayed`]), with the send timer hyper lacks.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// What an HTTP/2 client sends first (RFC 9113 §3.4).
pub(crate) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the bytes seen are the whole HTTP/2 preface, or cannot be
/// (the first byte of an HTTP/1 request is enough, mostly).
pub(crate) async fn read_version(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut seen = Vec::with_capacity(H2_PREFACE.len());
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = stream
            .read(&mut buf[..H2_PREFACE.len() - seen.len()])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        seen.extend_from_slice(&buf[..n]);
        if seen.len() == H2_PREFACE.len() || !H2_PREFACE.starts_with(&seen) {
            return Ok(seen);
        }
    }
}

/// A connection whose first bytes were already read: they are read again
/// first, then the stream. A write the client leaves pending (it reads
/// nothing) for `send_timeout` fails, which ends the connection.
pub(crate) struct Replayed {
    first: Vec<u8>,
    at: usize,
    stream: TcpStream,
    send_timeout: Duration,
    /// Since when a write has been pending.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes written, for HTTP/2's watchdog.
    written: Arc<AtomicU64>,
}

impl Replayed {
    /// `stream`, whose `first` bytes were read already; `written` counts
    /// the bytes written to it.
    pub(crate) fn new(
        first: Vec<u8>,
        stream: TcpStream,
        send_timeout: Duration,
        written: Arc<AtomicU64>,
    ) -> Self {
        Self {
            first,
            at: 0,
            stream,
            send_timeout,
            stalled: None,
            written,
        }
    }

    /// Counts the bytes a ready write took.
    fn count(&self, polled: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = polled {
            self.written.fetch_add(*n as u64, Relaxed);
        }
    }

    /// Runs a write step: a pending one starts (or goes on) the send
    /// timer, which fails it once it runs out; one that is ready stops it.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        step: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match step(Pin::new(&mut self.stream), cx) {
            Poll::Pending => {
                let timeout = self.send_timeout;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client read nothing for the client timeout",
                    )));
                }
                Poll::Pending
            }
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl AsyncRead for Replayed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.first.len() {
            let n = buf.remaining().min(this.first.len() - this.at);
            buf.put_slice(&this.first[this.at..this.at + n]);
            this.at += n;
            if this.at == this.first.len() {
                this.first = Vec::new();
                this.at = 0;
                // With what has come after them, if anything has: hyper's
                // first read then holds a whole head of a packet, where a
                // head in two reads doubled its buffer (8 KiB more a
                // connection). Nothing more now is no failure: the bytes
                // replayed answer this read, and what comes wakes the
                // next. An error is dropped: the connection is over either
                // way (the next read sees its end, or the error again).
                if buf.remaining() > 0 {
                    let _ = Pin::new(&mut this.stream).poll_read(cx, buf);
                }
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replayed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = this.timed(cx, |s, cx| s.poll_write(cx, buf));
        this.count(&polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = this.timed(cx, |s, cx| s.poll_write_vectored(cx, bufs));
        this.count(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().timed(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A connection on loopback whose client sent `head` in one write, its
    /// version read: the server's side, replaying.
    async fn replaying(head: &'static [u8]) -> (Replayed, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        client.write_all(head).await.unwrap();
        let (mut stream, _) = listener.accept().await.unwrap();
        let first = read_version(&mut stream).await.unwrap();
        assert!(first.len() < head.len(), "the version read stops early");
        let written = Arc::new(AtomicU64::new(0));
        (
            Replayed::new(first, stream, Duration::from_secs(5), written),
            client,
        )
    }

    const HEAD: &[u8] = b"GET /a/long/enough/path HTTP/1.1\r\nhost: example.com\r\n\r\n";

    #[tokio::test]
    async fn the_first_read_holds_the_bytes_replayed_and_what_came_with_them() {
        let (mut replayed, _client) = replaying(HEAD).await;
        let mut buf = vec![0; 8192];
        let n = replayed.read(&mut buf).await.unwrap();
        // hyper parses the whole head from its first read (a head split
        // over two reads doubled its buffer).
        assert_eq!(&buf[..n], HEAD);
    }

    #[tokio::test]
    async fn a_small_read_replays_in_parts_then_reads_the_stream() {
        let (mut replayed, mut client) = replaying(HEAD).await;
        let mut got = Vec::new();
        let mut buf = [0; 10];
        while got.len() < HEAD.len() {
            let n = replayed.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, HEAD);
        client.write_all(b"more").await.unwrap();
        let n = replayed.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"more");
    }
}
