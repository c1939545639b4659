//! The response body type of [`crate::ResponseCache`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::{mpsc, oneshot};

/// An error from the origin's body, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A response body: a cached one, or the origin's streaming through.
    #[project = CacheBodyProj]
    #[derive(Debug)]
    pub struct CacheBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Stream { #[pin] body: B },
        // Frames already read while deciding whether to store, then the rest.
        Replay {
            prefix: VecDeque<Frame<Bytes>>,
            error: Option<BoxError>,
            // Boxed so the origin's body need not be `Unpin`: it was polled
            // in place while the cache read it.
            rest: Option<Pin<Box<B>>>,
        },
        // A body being read to be stored, sent on as it is read (see
        // `Teed`).
        Tee {
            frames: mpsc::UnboundedReceiver<Teed<B>>,
            rest: Option<Pin<Box<CacheBody<B>>>>,
            ended: bool,
            // Told once the client has the whole body (its end, or the
            // bytes its `Content-Length` announced: HTTP/1 stops there);
            // dropped untold, the client went before.
            whole: Option<oneshot::Sender<()>>,
            left: Option<u64>,
        },
    }
}

/// What the read of a body being stored sends on to its client as it reads.
#[derive(Debug)]
pub(crate) enum Teed<B> {
    /// A frame, as read.
    Frame(Frame<Bytes>),
    /// What the read does not store, whole: the rest of the body (past
    /// `max_body`, after trailers or at a deadline), or its error.
    Rest(CacheBody<B>),
    /// The body was read whole. Frames that stop without it (a read
    /// cancelled, or panicked) are a body cut short, an error.
    End,
}

impl<B> CacheBody<B> {
    /// A complete body (a cached one, or one read in full).
    pub fn full(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: Kind::Full { data },
        }
    }

    /// No body (HEAD).
    pub fn empty() -> Self {
        Self {
            kind: Kind::Full { data: None },
        }
    }

    /// The origin's body, untouched.
    pub fn stream(body: B) -> Self {
        Self {
            kind: Kind::Stream { body },
        }
    }

    /// The frames a body's read sends on as it reads (see [`Teed`]),
    /// `announced` bytes if its head says so, and what says when its
    /// client has them all (an error: the client went before).
    pub(crate) fn tee(
        frames: mpsc::UnboundedReceiver<Teed<B>>,
        announced: Option<u64>,
    ) -> (Self, oneshot::Receiver<()>) {
        let (whole, told) = oneshot::channel();
        let kind = Kind::Tee {
            frames,
            rest: None,
            ended: false,
            whole: Some(whole),
            left: announced,
        };
        (Self { kind }, told)
    }

    /// Frames already read, then an error or the rest of the origin's body.
    pub(crate) fn replay(
        prefix: VecDeque<Frame<Bytes>>,
        error: Option<BoxError>,
        rest: Option<Pin<Box<B>>>,
    ) -> Self {
        Self {
            kind: Kind::Replay {
                prefix,
                error,
                rest,
            },
        }
    }
}

impl<B> Body for CacheBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Replay {
                prefix,
                error,
                rest,
            } => {
                if let Some(frame) = prefix.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(e) = error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                match rest {
                    Some(rest) => rest.as_mut().poll_frame(cx).map_err(Into::into),
                    None => Poll::Ready(None),
                }
            }
            KindProj::Tee {
                frames,
                rest,
                ended,
                whole,
                left,
            } => {
                let next = match rest {
                    Some(rest) => ready!(rest.as_mut().poll_frame(cx)),
                    None if *ended => None,
                    None => match ready!(frames.poll_recv(cx)) {
                        Some(Teed::Frame(frame)) => Some(Ok(frame)),
                        Some(Teed::Rest(body)) => {
                            ready!(rest.insert(Box::pin(body)).as_mut().poll_frame(cx))
                        }
                        Some(Teed::End) => {
                            *ended = true;
                            None
                        }
                        None => {
                            *ended = true;
                            let cut = "the origin's answer was cut short while it was read";
                            return Poll::Ready(Some(Err(cut.into())));
                        }
                    },
                };
                let sent = match &next {
                    Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
                    Some(Err(_)) => return Poll::Ready(next),
                    None => 0,
                };
                if let Some(left) = left {
                    *left = left.saturating_sub(sent);
                }
                if (next.is_none() || *left == Some(0))
                    && let Some(whole) = whole.take()
                {
                    let _ = whole.send(());
                }
                Poll::Ready(next)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Stream { body } => body.is_end_stream(),
            Kind::Replay {
                prefix,
                error,
                rest,
            } => {
                prefix.is_empty()
                    && error.is_none()
                    && rest.as_ref().is_none_or(|r| r.is_end_stream())
            }
            Kind::Tee { rest, ended, .. } => match rest {
                Some(rest) => rest.is_end_stream(),
                None => *ended,
            },
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Stream { body } => body.size_hint(),
            Kind::Replay {
                prefix,
                error,
                rest,
            } => {
                let buffered: u64 = prefix
                    .iter()
                    .filter_map(|f| f.data_ref())
                    .map(|d| d.len() as u64)
                    .sum();
                // A body that broke off has no exact size: an exact hint
                // would frame what was read as the whole body, and the
                // server would end the response cleanly without polling the
                // error (a cut answer would reach the client as complete).
                if error.is_some() {
                    let mut hint = SizeHint::new();
                    hint.set_lower(buffered);
                    return hint;
                }
                let inner = rest
                    .as_ref()
                    .map(|r| r.size_hint())
                    .unwrap_or_else(|| SizeHint::with_exact(0));
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + buffered);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + buffered);
                }
                hint
            }
            // The origin's `Content-Length`, if any, frames it.
            Kind::Tee { .. } => SizeHint::new(),
        }
    }
}
