//! The bound on requests in flight (`--max-requests-in-flight`): those the
//! proxy could not answer on the spot, waiting on the upstream, on Valkey
//! or on another request's load. Each holds its connection's state, its
//! task and, at the upstream, an upstream connection's buffers: ~7 to
//! ~51 KiB (the README's memory section). `--max-connections` bounds them
//! over HTTP/1.1, one a connection; over HTTP/2 a connection carries up to
//! 128, so connections alone bound nothing useful.
//!
//! A request takes a place when the service is called, and the mark
//! below if there is none: what it may do is decided before any work
//! starts (the call already looks L1 up and answers a hit). One
//! answered on its first poll (an L1 hit, the proxy's own answers) gives
//! the place back then, one that waits holds it until its answer's body is
//! sent or dropped. Over HTTP/2 hyper calls the service on the
//! connection's task and polls each stream on a task of its own, so an
//! answered hit keeps its place (and its answer) until that task runs.
//! Taken on the first poll instead, every request would wait whole in its
//! future until then (~250 bytes each, where the call has answered a hit
//! and let its request go).
//! With no place free, a request is asked of L1 alone
//! ([`StoredOnly::L1`]): a hit is still answered, and anything else is
//! answered 503 at once (`Retry-After: 1`): no load started, nothing sent
//! upstream or to Valkey. A client's own `only-if-cached` request keeps
//! its 504 (RFC 9111 §5.2.1.7).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::{Body, Frame, SizeHint};
use metrics::{Counter, Gauge, Key, KeyName, Level, Metadata, Recorder, SharedString};
use tiercache_http::cache_control::has_directive;
use tiercache_http::{CacheBody, NothingStored, StoredOnly};

use crate::forward::UpstreamBody;
use crate::own_answers::own_answer;

/// The body of every answer the main port's service gives.
type Answer = CacheBody<UpstreamBody>;

/// `tiercache_requests_in_flight`: requests waiting, or sending an answer
/// they waited for.
const IN_FLIGHT: &str = "tiercache_requests_in_flight";
/// `tiercache_requests_shed_total`: requests refused for want of a place.
const SHED: &str = "tiercache_requests_shed_total";

/// What every request's future shares: the places and their metrics.
struct Places {
    /// Places taken, on a cache line of its own (every request, hits
    /// included, takes and gives back one).
    taken: Padded,
    bound: usize,
    in_flight: Gauge,
    shed: Counter,
}

/// An atomic alone on its cache line (128 bytes: two lines, as adjacent
/// lines are fetched in pairs on x86).
#[repr(align(128))]
struct Padded(AtomicUsize);

impl Places {
    /// A place, if one is free (never more than `bound` taken, even for
    /// an instant); else the places back.
    fn take(self: Arc<Self>) -> Result<Place, Arc<Self>> {
        let bound = self.bound;
        match self
            .taken
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            }) {
            Ok(_) => Ok(Place {
                places: self,
                waited: false,
            }),
            Err(_) => Err(self),
        }
    }
}

/// `inner` with at most `bound` requests in flight (see the module's doc).
#[derive(Clone)]
pub(crate) struct Bounded<S> {
    inner: S,
    places: Arc<Places>,
}

impl<S> Bounded<S> {
    /// `inner` bounded to `bound` requests in flight, its gauge and
    /// counter registered in `recorder`.
    pub(crate) fn new(inner: S, bound: usize, recorder: &dyn Recorder) -> Self {
        static METADATA: Metadata<'static> =
            Metadata::new(module_path!(), Level::INFO, Some(module_path!()));
        recorder.describe_gauge(
            KeyName::from_const_str(IN_FLIGHT),
            None,
            SharedString::const_str(
                "Requests in flight: waiting on the upstream, Valkey or another's load, or \
                 sending an answer they waited for (an L1 hit is never one); at most \
                 --max-requests-in-flight.",
            ),
        );
        recorder.describe_counter(
            KeyName::from_const_str(SHED),
            None,
            SharedString::const_str(
                "Requests answered 503 at once, every place among --max-requests-in-flight \
                 taken and nothing stored answering them.",
            ),
        );
        let places = Places {
            taken: Padded(AtomicUsize::new(0)),
            bound,
            in_flight: recorder.register_gauge(&Key::from_static_name(IN_FLIGHT), &METADATA),
            shed: recorder.register_counter(&Key::from_static_name(SHED), &METADATA),
        };
        Self {
            inner,
            places: Arc::new(places),
        }
    }
}

impl<S> tower::Service<Request<axum::body::Body>> for Bounded<S>
where
    S: tower::Service<Request<axum::body::Body>, Response = Response<Answer>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<Placed<Answer>>;
    type Error = Infallible;
    type Future = InFlight<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<axum::body::Body>) -> Self::Future {
        let (place, at_bound) = match self.places.clone().take() {
            Ok(place) => (Some(place), None),
            Err(places) => {
                req.extensions_mut().insert(StoredOnly::L1);
                let at_bound = AtBound {
                    places,
                    head: req.method() == http::Method::HEAD,
                    asked: has_directive(req.headers(), "only-if-cached"),
                };
                (None, Some(at_bound))
            }
        };
        InFlight {
            future: self.inner.call(req),
            place,
            at_bound,
        }
    }
}

/// A request's future: the inner service's, holding the request's place
/// while it waits.
pub(crate) struct InFlight<F> {
    future: F,
    place: Option<Place>,
    /// With no place to be had: asked of L1 alone.
    at_bound: Option<AtBound>,
}

/// A request that found no place.
struct AtBound {
    /// For the refusal's counter and text.
    places: Arc<Places>,
    head: bool,
    /// The client asked `only-if-cached` itself: the cache's 504 stands.
    asked: bool,
}

impl<F> Future for InFlight<F>
where
    F: Future<Output = Result<Response<Answer>, Infallible>> + Unpin,
{
    type Output = Result<Response<Placed<Answer>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let InFlight {
            future,
            place,
            at_bound,
        } = self.get_mut();
        let Poll::Ready(Ok(response)) = Pin::new(future).poll(cx) else {
            if let Some(place) = place {
                place.waits();
            }
            return Poll::Pending;
        };
        if let Some(at_bound) = at_bound
            && response.extensions().get::<NothingStored>().is_some()
            && !(at_bound.asked && response.status() == StatusCode::GATEWAY_TIMEOUT)
        {
            at_bound.places.shed.increment(1);
            return Poll::Ready(Ok(refusal(at_bound.places.bound, at_bound.head)));
        }
        // An answer ready on the first poll gives its place back now.
        let place = place.take().filter(|place| place.waited);
        Poll::Ready(Ok(response.map(|body| Placed {
            body,
            _place: place,
        })))
    }
}

/// The 503 for a request with no place that nothing stored answers.
fn refusal(bound: usize, head: bool) -> Response<Placed<Answer>> {
    let text = format!(
        "tiercache-proxy: too many requests in flight (--max-requests-in-flight {bound}); \
         try again shortly\n"
    );
    let mut answer = own_answer(StatusCode::SERVICE_UNAVAILABLE, text, head);
    answer
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    answer.map(|own| Placed {
        body: CacheBody::stream(own),
        _place: None,
    })
}

/// What [`Forward`](crate::forward::Forward) answers a request asked of
/// storage alone (one with no place, which the cache did not look up: not
/// a GET or HEAD, a route that does not cache, a path whose rules differ
/// as sent and as resolved): a 503 marked [`NothingStored`], nothing sent
/// upstream ([`Bounded`] answers its own 503 in its place). `None` for a
/// request not marked.
pub(crate) fn not_forwarded(
    req: &Request<axum::body::Body>,
    head: bool,
) -> Option<Response<UpstreamBody>> {
    req.extensions().get::<StoredOnly>()?;
    let text = "tiercache-proxy: too many requests in flight\n".to_string();
    let mut answer = own_answer(StatusCode::SERVICE_UNAVAILABLE, text, head);
    answer.extensions_mut().insert(NothingStored);
    Some(answer)
}

/// A place taken: given back when dropped.
struct Place {
    places: Arc<Places>,
    /// Its request waited (counted in the gauge).
    waited: bool,
}

impl Place {
    /// Its request waits: counted in the gauge, once.
    fn waits(&mut self) {
        if !self.waited {
            self.waited = true;
            self.places.in_flight.increment(1.0);
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.taken.0.fetch_sub(1, Ordering::AcqRel);
        if self.waited {
            self.places.in_flight.decrement(1.0);
        }
    }
}

/// An answer's body, holding the place of a request that waited until it
/// is sent or dropped.
pub(crate) struct Placed<B> {
    body: B,
    _place: Option<Place>,
}

impl<B: Body + Unpin> Body for Placed<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
