//! Forwarding to the upstream: a tower service that proxies one request.

use std::convert::Infallible;
use std::future::Future;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::header::{CONNECTION, COOKIE, HOST, HeaderMap, HeaderName, HeaderValue, TE, VIA};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tiercache_http::headers::{connection_options, strip_hop_by_hop, strip_hop_by_hop_but_trailer};
use tiercache_http::request::{is_unkeyed, same_name};

use crate::connector::{Lease, StampingConnector, worth_sending_again};
use crate::own_answers::{Failures, failure_text, own_answer};
use crate::read_ahead::Rooms;
pub use crate::silences::Silences;

/// The upstream's answer: its body streams through, or a body of the
/// proxy's own (its error page, or an answer read ahead of a client, see
/// [`ReadAhead`](crate::read_ahead::ReadAhead)).
pub type UpstreamBody = http_body_util::Either<UpstreamStream, Body>;

/// An upstream's body, cut with an error once the upstream has sent nothing
/// for the origin timeout (as nginx's `proxy_read_timeout`, between two
/// reads, not over the whole body): a stalled upstream never holds a client,
/// or the requests waiting on its load, for longer. A cut body is not
/// stored; the cache counts it as an origin failure.
pub type UpstreamStream = Silences<Incoming>;

/// A copy of `req` to send again if its connection fails under it: a GET
/// or a HEAD without a body (safe to repeat, and nothing to replay).
fn resendable(req: &Request<Body>) -> Option<Request<Body>> {
    let safe = req.method() == http::Method::GET || req.method() == http::Method::HEAD;
    if !safe || hyper::body::Body::size_hint(req.body()).exact() != Some(0) {
        return None;
    }
    let mut copy = Request::new(Body::empty());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Fields that tell an upstream the client's address (the proxy sets
/// `X-Forwarded-For` itself; a client's own would be believed).
pub const CLIENT_ADDRESS: [&str; 8] = [
    "x-forwarded-for",
    "x-real-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "client-ip",
];

/// Whether `name` is one of [`CLIENT_ADDRESS`], in any spelling (case
/// blind, `_` read as `-`, as WSGI servers fold them).
pub fn is_client_address(name: &str) -> bool {
    CLIENT_ADDRESS.iter().any(|c| same_name(c, name))
}

/// The scheme and host of `upstream`, if it is something the proxy can
/// forward to: `http://`, a host, and no path or query (requests keep their
/// own; a base path would be dropped silently).
pub(crate) fn check_upstream(upstream: &Uri) -> Result<(Scheme, Authority), String> {
    let scheme = upstream.scheme().cloned().unwrap_or(Scheme::HTTP);
    if scheme != Scheme::HTTP {
        return Err(format!(
            "upstream `{upstream}`: only http:// upstreams are supported"
        ));
    }
    let Some(authority) = upstream.authority().cloned() else {
        return Err(format!(
            "upstream `{upstream}` has no host: write http://HOST:PORT"
        ));
    };
    if !matches!(upstream.path(), "" | "/") || upstream.query().is_some() {
        return Err(format!(
            "upstream `{upstream}`: a path or query is not supported (each request keeps its own): write http://HOST:PORT"
        ));
    }
    Ok((scheme, authority))
}

/// Removes the fields a client names in `Connection` (RFC 9110 §7.6.1)
/// before the cache sees the request. They are this hop's, and the
/// forwarder never sends them on: a key or `Vary` variant built on one
/// would store the upstream's answer to its absence for every client that
/// sends it. Kept: `Host` (the forwarder sends the keyed host whatever
/// `Connection` says), the framing fields (hyper frames the body itself),
/// `TE` (the forwarder passes on `trailers`) and `Upgrade` (the cache
/// bypasses a request asking to switch protocols).
pub(crate) fn drop_connection_options(headers: &mut http::HeaderMap) {
    use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING, UPGRADE};
    if !headers.contains_key(CONNECTION) {
        return;
    }
    let kept = [HOST, CONTENT_LENGTH, TRANSFER_ENCODING, TE, UPGRADE];
    for name in connection_options(headers) {
        if !kept.contains(&name) {
            headers.remove(name);
        }
    }
}

/// Forwards each request to `upstream`, as a reverse proxy should: hop-by-hop
/// fields (and those named in `Connection`) removed both ways, `Host` the
/// host the cache keyed on, `X-Forwarded-For/Host/Proto` set by the proxy
/// itself (what a client sent in them is discarded, as are the other fields
/// a client could steer an upstream with, unless the route keys on them),
/// `Via` added, bodies streamed. An unreachable upstream, or an answer
/// that could not be read, is a 502; a
/// request that came back to this proxy (its own `Via`) a 508.
#[derive(Debug, Clone)]
pub struct Forward {
    client: Client<StampingConnector, Body>,
    scheme: Scheme,
    authority: Authority,
    /// How long the upstream may take to send its head, and then may go
    /// quiet between two reads of its body.
    timeout: Duration,
    /// Request fields the route keys on: passed on as the client sent them.
    keyed: Arc<[HeaderName]>,
    /// This process's `Via` entry (`1.1 tiercache-` and a random id).
    via: HeaderValue,
    /// Requests at the upstream at once, when capped (see
    /// [`max_connections`](Self::max_connections)).
    slots: Option<Arc<tokio::sync::Semaphore>>,
    /// The room all answers read ahead of their clients share: with a
    /// cap only.
    ahead: Option<Rooms>,
    /// How long an idle pooled connection is kept.
    idle: Duration,
    /// The answers it gives itself for the upstream, counted.
    failures: Failures,
}

/// The longest head an upstream's answer is sure to be read with, and the
/// bound on its connection's read buffer. hyper's bound is loose: it is
/// checked only when a head comes up short, and a read fills whatever room
/// the buffer has, so reading bodies the buffer reaches 64 KiB, and
/// reading heads under 128 KiB (a head that long may then pass).
pub const MAX_UPSTREAM_HEAD: usize = 32 * 1024;

/// A client whose idle connections are kept for `idle` (none for zero), at
/// most `max_idle` of them.
fn pool(idle: Duration, max_idle: usize) -> Client<StampingConnector, Body> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let mut builder = Client::builder(TokioExecutor::new());
    builder.pool_timer(hyper_util::rt::TokioTimer::new());
    // hyper's read buffer grows to ~400 KiB on a large body, and a pooled
    // connection keeps it (434 KiB an idle connection after a 1 MiB body;
    // bounded, 81 KiB). The bound is the head's too: 32 KiB, Varnish's
    // `http_resp_size` (nginx's `proxy_buffer_size` is 4 or 8 KiB), past
    // it a 502. Loosely (see `MAX_UPSTREAM_HEAD`): hyper-util's client
    // does not set hyper's exact head bound.
    builder.http1_max_buf_size(MAX_UPSTREAM_HEAD);
    if idle.is_zero() {
        builder.pool_max_idle_per_host(0);
    } else {
        builder
            .pool_idle_timeout(idle)
            .pool_max_idle_per_host(max_idle);
    }
    builder.build(StampingConnector(connector))
}

impl Forward {
    /// How long an idle connection to the upstream is kept for the next
    /// request by default: 60 s, as nginx's upstream `keepalive_timeout`.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

    /// A forwarder to `upstream` (`http://host:port`; see `check_upstream`).
    pub fn new(upstream: &Uri) -> Result<Self, String> {
        Self::with_idle_timeout(upstream, Self::DEFAULT_IDLE_TIMEOUT)
    }

    /// A forwarder to `upstream` whose idle connections are closed after
    /// `idle` (none kept for zero), or, when the upstream's answers name
    /// its own keep-alive timeout (`Keep-Alive: timeout=N`, as Node and
    /// Apache send), a second (half of it, under two seconds) before that
    /// timeout ends, counted from the connection's last read. For one that
    /// does not, keep it below that timeout (uvicorn's 5 s, gunicorn's
    /// 2 s): a request sent on a connection the upstream is closing fails
    /// (a GET or HEAD is sent once more; another method answers 502).
    pub fn with_idle_timeout(upstream: &Uri, idle: Duration) -> Result<Self, String> {
        let (scheme, authority) = check_upstream(upstream)?;
        let client = pool(idle, usize::MAX);
        // Random per process: a chain of tiercache proxies is no loop.
        let id = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        let via = HeaderValue::try_from(format!("1.1 tiercache-{:08x}", id as u32)).expect("ASCII");
        Ok(Self {
            client,
            scheme,
            authority,
            keyed: Arc::from([]),
            via,
            timeout: crate::ProxyConfig::DEFAULT_ORIGIN_TIMEOUT,
            slots: None,
            ahead: None,
            idle,
            failures: Failures::default(),
        })
    }

    /// Counts the answers it gives itself for the upstream in `recorder`.
    pub(crate) fn counting_failures(mut self, recorder: &dyn metrics::Recorder) -> Self {
        self.failures = Failures::registered(recorder);
        self
    }

    /// Sends at most `n` requests to the upstream at once, background
    /// refreshes included, and keeps at most `n` idle connections; a
    /// request finds its slot within the origin timeout or is answered 503
    /// (a failure: stale-if-error applies). A slot is held until the
    /// answer's body ends; an answer is read ahead of its client (see
    /// [`ReadAhead`](crate::read_ahead::ReadAhead)), `n` answers' room at once, so a slow client holds
    /// one only for an answer past the room, or past what all answers
    /// hold. Unlimited by default.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.slots = Some(Arc::new(tokio::sync::Semaphore::new(n)));
        self.ahead = Some(Rooms::new(n));
        self.client = pool(self.idle, n);
        self
    }

    /// Sets how long the upstream may take to send its head before the
    /// answer is a 504 of the proxy's own, and how long it may then send
    /// nothing of its body before the body is cut (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether a request with these fields came back to this proxy (its
    /// own `Via` entry among them).
    pub(crate) fn came_back(&self, headers: &http::HeaderMap) -> bool {
        headers.get_all(VIA).iter().any(|v| {
            v.as_bytes()
                .split(|&b| b == b',')
                .any(|hop| hop.trim_ascii() == self.via.as_bytes())
        })
    }

    /// Passes `names` (the fields a route keys on) to the upstream as the
    /// client sent them, an `X-Forwarded-*` among them included.
    pub fn keyed(mut self, names: Vec<HeaderName>) -> Self {
        self.keyed = names.into();
        self
    }

    fn upstream_request(&self, req: Request<Body>) -> Request<Body> {
        let (mut parts, body) = req.into_parts();
        let client_ip = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip().to_string());
        // The host the cache keyed the request on: the target's authority
        // when it has one (HTTP/2's `:authority`, which comes with no `Host`
        // field; an absolute-form target, whose authority replaces `Host`,
        // RFC 9112 §3.2.2), else `Host`. Userinfo is no part of a host.
        let host = parts
            .uri
            .authority()
            .map(|a| a.as_str().rsplit_once('@').map_or(a.as_str(), |(_, h)| h))
            .and_then(|a| HeaderValue::from_str(a).ok())
            .or_else(|| parts.headers.get(HOST).cloned());
        // `TE` is this hop's: of it the proxy passes on the one token it
        // honours itself, `trailers` (it relays them).
        let trailers = parts.headers.get_all(TE).iter().any(|v| {
            v.as_bytes().split(|&b| b == b',').any(|t| {
                let name = t.split(|&b| b == b';').next().unwrap_or_default();
                name.trim_ascii().eq_ignore_ascii_case(b"trailers")
            })
        });
        strip_hop_by_hop(&mut parts.headers);
        if trailers {
            parts
                .headers
                .insert(TE, HeaderValue::from_static("trailers"));
            // RFC 9110 §10.1.4: `TE` comes with its connection option.
            parts
                .headers
                .insert(CONNECTION, HeaderValue::from_static("te"));
        }
        // Fields a client could steer the upstream with (its address, the
        // scheme, host, port and path frameworks build links from) go, on
        // every request (the cache drops them only from those it may
        // store), unless the route keys on them: those pass as sent.
        // Only the very name keyed passes: another spelling is not in the key
        // (`x-legacy` beside a keyed `x_legacy`, which such servers read as
        // one). Nor does any name with `_` (as nginx's default): WSGI and
        // Rack servers read `X_Tenant` as `X-Tenant`, a value the cache
        // keyed on (or varied by) as absent.
        let keyed = |name: &str| self.keyed.iter().any(|k| k.as_str() == name);
        let spelled_apart = |name: &str| self.keyed.iter().any(|k| same_name(k.as_str(), name));
        let doomed: Vec<HeaderName> = parts
            .headers
            .keys()
            .filter(|n| {
                let n = n.as_str();
                is_unkeyed(n) || is_client_address(n) || n.contains('_') || spelled_apart(n)
            })
            .filter(|n| !keyed(n.as_str()))
            .cloned()
            .collect();
        for name in doomed {
            parts.headers.remove(name);
        }
        join_cookies(&mut parts.headers);
        if let Some(host) = host {
            parts.headers.insert(HOST, host.clone());
            if !keyed(X_FORWARDED_HOST.as_str()) {
                parts.headers.insert(X_FORWARDED_HOST, host);
            }
        }
        if let Some(ip) = client_ip.and_then(|ip| HeaderValue::try_from(ip).ok())
            && !keyed(X_FORWARDED_FOR.as_str())
        {
            parts.headers.insert(X_FORWARDED_FOR, ip);
        }
        if !keyed(X_FORWARDED_PROTO.as_str()) {
            parts
                .headers
                .insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        }
        parts.headers.append(VIA, self.via.clone());
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        // The upstream speaks HTTP/1.1, whatever the client spoke to the
        // proxy (an h2c prior-knowledge client's version would be a 502).
        parts.version = http::Version::HTTP_11;
        parts.uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .expect("scheme, authority and path are each valid");
        Request::from_parts(parts, body)
    }
}

impl tower::Service<Request<Body>> for Forward {
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let head = req.method() == http::Method::HEAD;
        // Sent round to this proxy again (an upstream that is the proxy
        // itself): refused, not forwarded until sockets run out.
        if self.came_back(req.headers()) {
            let text = "tiercache-proxy: this request came back to the proxy (its upstream is the proxy itself?)\n";
            return Box::pin(async move {
                Ok(own_answer(StatusCode::LOOP_DETECTED, text.into(), head))
            });
        }
        // RFC 9112 §3.2: a server answers 400 to more than one `Host`
        // (the proxy's dispatch refuses it first; here for `Forward` alone).
        if req.headers().get_all(HOST).iter().nth(1).is_some() {
            let text = "tiercache-proxy: a request may carry one Host field\n";
            return Box::pin(
                async move { Ok(own_answer(StatusCode::BAD_REQUEST, text.into(), head)) },
            );
        }
        if let Some(refused) = crate::in_flight::not_forwarded(&req, head) {
            return Box::pin(async move { Ok(refused) });
        }
        let upstream = self.upstream_request(req);
        let again = resendable(&upstream);
        let timeout = self.timeout;
        // An upload's own time is not the upstream's: `timeout` starts once
        // the upstream has the whole request, and bounds each silence of
        // the upload before that.
        let (upstream, uploaded) = Silences::upload(upstream, timeout);
        let client = self.client.clone();
        let slots = self.slots.clone();
        let ahead = self.ahead.clone();
        let failures = self.failures.clone();
        Box::pin(async move {
            let slot = match slots {
                Some(slots) => match tokio::time::timeout(timeout, slots.acquire_owned()).await {
                    Ok(Ok(slot)) => Some(slot),
                    _ => {
                        failures.busy.increment(1);
                        let text = format!(
                            "tiercache-proxy: every upstream connection stayed in use for {timeout:?}\n"
                        );
                        return Ok(own_answer(StatusCode::SERVICE_UNAVAILABLE, text, head));
                    }
                },
                None => None,
            };
            let sent = std::time::Instant::now();
            let mut response = std::pin::pin!(client.request(upstream));
            let mut answered = match uploaded {
                Some(uploaded) => tokio::select! {
                    biased;
                    // Answered before the upload ended (an early refusal).
                    answered = &mut response => Ok(answered),
                    _ = uploaded => tokio::time::timeout(timeout, &mut response).await,
                },
                None => tokio::time::timeout(timeout, &mut response).await,
            };
            // A GET or HEAD sent on a pooled connection the upstream closed
            // as it arrived (an upstream keeps idle connections for less
            // time than the pool does): sent once more, on a new one, as
            // nginx does. hyper-util resends only what it had not begun
            // to write. On a connection opened for it, the upstream took
            // the request and dropped it: once more would be a second
            // origin call.
            if let (Ok(Err(e)), Some(again)) = (&answered, again)
                && worth_sending_again(e, sent)
            {
                answered = tokio::time::timeout(timeout, client.request(again)).await;
            }
            let Ok(answered) = answered else {
                failures.timeout.increment(1);
                let text = format!("tiercache-proxy: upstream sent no answer within {timeout:?}\n");
                return Ok(own_answer(StatusCode::GATEWAY_TIMEOUT, text, head));
            };
            match answered {
                Ok(res) => {
                    let (mut parts, body) = res.into_parts();
                    // Its `Keep-Alive` (hop-by-hop) read before it goes.
                    let lease = parts.extensions.get::<Arc<Lease>>().cloned();
                    if let Some(lease) = &lease {
                        lease.answered(&parts.headers);
                    }
                    strip_hop_by_hop_but_trailer(&mut parts.headers);
                    let body = Silences::new(body, timeout, "the upstream")
                        .holding(slot)
                        .answering(lease);
                    // A slow client would hold the slot until it read the
                    // last byte: an answer that fits the room gives it
                    // back when the upstream is done.
                    let body = match ahead {
                        Some(rooms) => rooms.read_ahead(body),
                        None => Err(body),
                    };
                    let body = match body {
                        Ok(ahead) => http_body_util::Either::Right(Body::new(ahead)),
                        Err(body) => http_body_util::Either::Left(body),
                    };
                    Ok(Response::from_parts(parts, body))
                }
                Err(e) => {
                    failures.unreachable.increment(1);
                    let text = failure_text(&e);
                    Ok(own_answer(StatusCode::BAD_GATEWAY, text, head))
                }
            }
        })
    }
}

/// Cookies split over several fields (as HTTP/2 allows, RFC 9113 §8.2.3)
/// joined into one with `; ` for the HTTP/1.1 upstream: as separate lines,
/// servers join them with `,`, and one cookie's value runs into the next.
fn join_cookies(headers: &mut HeaderMap) {
    let mut fields = headers.get_all(COOKIE).iter();
    if fields.nth(1).is_none() {
        return;
    }
    let joined: Vec<&[u8]> = headers
        .get_all(COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if let Ok(one) = HeaderValue::from_bytes(&joined.join(&b"; "[..])) {
        headers.insert(COOKIE, one);
    }
}
