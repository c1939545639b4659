//! [`ResponseFuture`], the future of [`crate::ResponseCache`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::CacheBody;
use crate::headers::{self, Outcome};
use tiercache_core::TieredCache;

type BoxedResponse<B, E> = Pin<Box<dyn Future<Output = Result<Response<CacheBody<B>>, E>> + Send>>;

pin_project! {
    /// The response future: ready at once for an L1 hit, the inner future for
    /// a request the cache does not handle, boxed for a miss.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Ready { response: Option<Response<CacheBody<B>>> },
        Inner { #[pin] future: F, label: Option<(Outcome, TieredCache)> },
        Boxed { future: BoxedResponse<B, E> },
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn ready(response: Response<CacheBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    /// The inner service's future; `label` adds the cache headers (a bypass).
    pub(crate) fn inner(future: F, label: Option<(Outcome, TieredCache)>) -> Self {
        Self {
            kind: Kind::Inner { future, label },
        }
    }

    pub(crate) fn boxed(future: BoxedResponse<B, E>) -> Self {
        Self {
            kind: Kind::Boxed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<CacheBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProj::Inner { future, label } => {
                let response = ready!(future.poll(cx))?;
                let mut response = response.map(CacheBody::stream);
                if let Some((outcome, engine)) = label.take() {
                    headers::apply(response.headers_mut(), &outcome, engine.hit_ratio());
                }
                Poll::Ready(Ok(response))
            }
            KindProj::Boxed { future } => future.as_mut().poll(cx),
        }
    }
}
