//! An idle-cut body: the upstream's answer and the client's upload, each
//! cut with an error once its sender goes quiet for too long.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::Request;
use hyper::body::{Frame, SizeHint};

use crate::connector::Lease;

/// A body cut with an error once its sender has sent nothing for `idle`
/// (counted from the first wait after each frame); its end (or its drop,
/// once sent whole) is told to `done` when there is one.
#[derive(Debug)]
pub struct Silences<B> {
    body: B,
    idle: Duration,
    /// Who stays silent, for the error: "the upstream", "the client".
    who: &'static str,
    silence: Option<Pin<Box<tokio::time::Sleep>>>,
    done: Option<tokio::sync::oneshot::Sender<()>>,
    /// The upstream slot the answer holds until its body ends (see
    /// [`Forward::max_connections`](crate::forward::Forward::max_connections)).
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The connection the answer came on, told when it ends.
    lease: Option<Arc<Lease>>,
}

impl<B> Silences<B> {
    pub(crate) fn new(body: B, idle: Duration, who: &'static str) -> Self {
        Self {
            body,
            idle,
            who,
            silence: None,
            done: None,
            slot: None,
            lease: None,
        }
    }

    /// This body, telling `lease` (of the connection it came on) when it
    /// ends or is dropped.
    pub(crate) fn answering(mut self, lease: Option<Arc<Lease>>) -> Self {
        self.lease = lease;
        self
    }

    /// This body, holding `slot` until it ends (or is dropped).
    pub(crate) fn holding(mut self, slot: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        self.slot = slot;
        self
    }

    fn ended(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        self.slot = None;
        if let Some(lease) = self.lease.take() {
            lease.ended();
        }
    }
}

impl Silences<Body> {
    /// `req` with its body cut after a silence of `idle`, and what hears
    /// the upload end; `None` for a request without a body (nothing to
    /// wait for).
    pub(crate) fn upload(
        req: Request<Body>,
        idle: Duration,
    ) -> (Request<Body>, Option<tokio::sync::oneshot::Receiver<()>>) {
        if hyper::body::Body::size_hint(req.body()).exact() == Some(0) {
            return (req, None);
        }
        let (done, uploaded) = tokio::sync::oneshot::channel();
        let req = req.map(|body| {
            let mut watched = Self::new(body, idle, "the client");
            watched.done = Some(done);
            Body::new(watched)
        });
        (req, Some(uploaded))
    }
}

impl<B> hyper::body::Body for Silences<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(None) => {
                this.ended();
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => {
                this.silence = None;
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let idle = this.idle;
                let silence = this
                    .silence
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match silence.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                        "{} sent nothing of its body for {idle:?}",
                        this.who
                    )
                    .into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for Silences<B> {
    fn drop(&mut self) {
        // hyper drops a body it has sent whole without polling it again.
        self.ended();
    }
}
