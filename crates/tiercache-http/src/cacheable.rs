//! Cacheability: pure functions that say whether a request may use the cache
//! and whether a response may be stored, with the reason when not.

use http::header::{
    AUTHORIZATION, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, COOKIE, HOST, IF_MATCH,
    IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, PRAGMA, RANGE, SET_COOKIE, TE,
    TRANSFER_ENCODING, UPGRADE, VARY,
};
use http::{HeaderMap, Method, StatusCode, request};

use crate::cache_control::has_directive;

/// Why a request skipped the cache, or a response was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// Not GET or HEAD.
    Method,
    /// A response to a request with `Authorization` that does not say it may
    /// be shared (`public`, `s-maxage`, `must-revalidate`; RFC 9111 §3.5).
    Authorization,
    /// The request carries `Cookie` and the route does not opt in to cookies.
    Cookie,
    /// The request says `Cache-Control: no-store`.
    RequestNoStore,
    /// A GET or HEAD with a body ("fat GET"): the body is not keyed.
    RequestBody,
    /// `Range`, `If-Range`, `If-Match` or `If-Unmodified-Since`: answered by the origin.
    Precondition,
    /// `Upgrade` (a WebSocket's handshake): a request to switch protocols
    /// on this connection, which only the origin can answer. `Upgrade: h2c`
    /// alone is not one (no server here switches to it; it answers as
    /// usual).
    Upgrade,
    /// More than one `Host`, or an absolute-form target naming another host
    /// than `Host`: which one the origin uses is not knowable. Or a host
    /// longer than any DNS name with a port ([`MAX_HOST`]).
    Host,
    /// The key's last response could not be shared (hit-for-miss).
    HitForMiss,
    /// A status that is never stored (206, 304, 500, 502, 503, 504, 1xx).
    Status,
    /// No explicit freshness, and the status (an error) or the configuration
    /// (explicit freshness only) rules out the route's ttl.
    NoFreshness,
    /// The response sets a cookie.
    SetCookie,
    /// `Cache-Control: private`.
    Private,
    /// `Cache-Control: no-store`.
    NoStore,
    /// `Vary: *`.
    VaryStar,
    /// The key already has the most variants allowed.
    VaryLimit,
    /// The body is larger than `max_body`.
    TooLarge,
    /// The body carried trailers, which are not stored.
    Body,
    /// The body broke off while it was being read (the upstream reset it,
    /// or stalled past its timeout): an origin failure, so stale-if-error
    /// answers for it and the key is not remembered as uncacheable.
    BodyFailed,
    /// The origin declared it already stale (`max-age=0`, an `Age` past its
    /// lifetime), or its body took longer to come than it would stay usable.
    NotFresh,
    /// Other bodies being read to be stored held their bound (a pool of a
    /// sixteenth of L1's budget, and the one place outside it): this one
    /// streamed through unstored. Of the moment, not of the resource: the
    /// key is not remembered as uncacheable, and the requests waiting on
    /// this load try again.
    Busy,
    /// Varied on `Accept-Encoding`, in a content coding the request did
    /// not accept (an origin that reads `gzip;q=0` as `gzip`): stored, it
    /// would answer that variant's clients, who cannot decode it.
    Encoding,
    /// A live stream (`text/event-stream`, `multipart/x-mixed-replace`):
    /// it has no end to wait for, so it is passed on as it comes, to its
    /// own client only. The key is not marked: a URL that answers JSON or
    /// events by `Accept` goes on caching its JSON.
    Stream,
}

impl Reason {
    /// Every reason, in declaration order.
    pub const ALL: [Reason; 23] = [
        Reason::Method,
        Reason::Authorization,
        Reason::Cookie,
        Reason::RequestNoStore,
        Reason::RequestBody,
        Reason::Precondition,
        Reason::Upgrade,
        Reason::Host,
        Reason::HitForMiss,
        Reason::Status,
        Reason::NoFreshness,
        Reason::SetCookie,
        Reason::Private,
        Reason::NoStore,
        Reason::VaryStar,
        Reason::VaryLimit,
        Reason::TooLarge,
        Reason::Body,
        Reason::BodyFailed,
        Reason::NotFresh,
        Reason::Busy,
        Reason::Encoding,
        Reason::Stream,
    ];

    /// The token used in `cache-status` `detail=` and in the stats.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Method => "method",
            Reason::Authorization => "authorization",
            Reason::Cookie => "cookie",
            Reason::RequestNoStore => "request-no-store",
            Reason::RequestBody => "request-body",
            Reason::Precondition => "precondition",
            Reason::Upgrade => "upgrade",
            Reason::Host => "host",
            Reason::HitForMiss => "hit-for-miss",
            Reason::Status => "status",
            Reason::NoFreshness => "no-freshness",
            Reason::SetCookie => "set-cookie",
            Reason::Private => "private",
            Reason::NoStore => "no-store",
            Reason::VaryStar => "vary-star",
            Reason::VaryLimit => "vary-limit",
            Reason::TooLarge => "too-large",
            Reason::Body => "body",
            Reason::BodyFailed => "body-failed",
            Reason::NotFresh => "not-fresh",
            Reason::Busy => "busy",
            Reason::Encoding => "encoding",
            Reason::Stream => "stream",
        }
    }

    /// Whether the reason belongs to the resource rather than to one
    /// request: only then is the key remembered as uncacheable (hit-for-miss),
    /// so an attacker's odd request that makes the origin fail cannot switch
    /// caching off for everyone.
    pub fn marks_key(&self) -> bool {
        matches!(
            self,
            Reason::SetCookie
                | Reason::Private
                | Reason::NoStore
                | Reason::VaryStar
                | Reason::TooLarge
                | Reason::Body
        )
    }
}

/// Whether a request's method and head let it use the cache at all.
///
/// Cookies, credentials and conditionals are the route's business (see
/// `request::prepare`); this checks what no setting changes.
///
/// ```
/// use http::Request;
/// use tiercache_http::cacheable::{Reason, request_cacheable};
///
/// let req = Request::get("/").header("content-length", "5").body(()).unwrap();
/// assert_eq!(request_cacheable(&req.into_parts().0), Err(Reason::RequestBody));
/// ```
pub fn request_cacheable(req: &request::Parts) -> Result<(), Reason> {
    cacheable_scanned(req, &Scan::of(&req.headers))
}

/// Which fields a request carries that the cache must look at, found in one
/// pass over its (few) field names instead of a hashed look-up per field.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Scan {
    pub(crate) framing: bool,
    pub(crate) precondition: bool,
    pub(crate) cache_control: bool,
    pub(crate) cookie: bool,
    pub(crate) authorization: bool,
    pub(crate) conditional: bool,
    pub(crate) unkeyed: bool,
    pub(crate) range: bool,
    pub(crate) te: bool,
    pub(crate) upgrade: bool,
}

impl Scan {
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let mut scan = Self::default();
        for name in headers.keys() {
            if name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
                scan.framing = true;
            } else if name == RANGE || name == IF_RANGE {
                scan.range = true;
            } else if name == IF_MATCH || name == IF_UNMODIFIED_SINCE {
                scan.precondition = true;
            } else if name == CACHE_CONTROL || name == PRAGMA {
                scan.cache_control = true;
            } else if name == COOKIE {
                scan.cookie = true;
            } else if name == AUTHORIZATION {
                scan.authorization = true;
            } else if name == IF_NONE_MATCH || name == IF_MODIFIED_SINCE {
                scan.conditional = true;
            } else if name == TE {
                scan.te = true;
            } else if name == UPGRADE {
                scan.upgrade = true;
            } else {
                scan.unkeyed |= crate::request::is_unkeyed(name.as_str());
            }
        }
        scan
    }
}

/// [`request_cacheable`] with the fields already scanned.
pub(crate) fn cacheable_scanned(req: &request::Parts, scan: &Scan) -> Result<(), Reason> {
    if req.method != Method::GET && req.method != Method::HEAD {
        return Err(Reason::Method);
    }
    if scan.framing
        && (content_length(&req.headers).is_some_and(|n| n > 0)
            || req.headers.contains_key(TRANSFER_ENCODING)
            || (req.headers.contains_key(CONTENT_LENGTH) && content_length(&req.headers).is_none()))
    {
        return Err(Reason::RequestBody);
    }
    if scan.precondition {
        return Err(Reason::Precondition);
    }
    if scan.upgrade && asks_to_switch(&req.headers) {
        return Err(Reason::Upgrade);
    }
    if scan.cache_control && has_directive(&req.headers, "no-store") {
        return Err(Reason::RequestNoStore);
    }
    let mut hosts = req.headers.get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(Reason::Host);
    }
    // No real host is longer, and the client chooses it: keys, and the
    // invalidations built from it, would carry it for as long as they live.
    if host.is_some_and(|h| h.len() > MAX_HOST)
        || req
            .uri
            .authority()
            .is_some_and(|a| a.as_str().len() > MAX_HOST)
    {
        return Err(Reason::Host);
    }
    if let (Some(host), Some(authority)) = (host, req.uri.authority())
        && !host
            .as_bytes()
            .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return Err(Reason::Host);
    }
    Ok(())
}

/// Whether `Upgrade` names a protocol other than `h2c` (RFC 9110 §7.8: a
/// list of `protocol[/version]`), which the origin may switch the
/// connection to: hyper's server hands such a request the connection
/// whatever `Connection` says.
fn asks_to_switch(headers: &HeaderMap) -> bool {
    headers
        .get_all(UPGRADE)
        .iter()
        .flat_map(|value| {
            value
                .as_bytes()
                .split(|&b| b == b',')
                .map(<[u8]>::trim_ascii)
        })
        .any(|protocol| !protocol.is_empty() && !protocol.eq_ignore_ascii_case(b"h2c"))
}

/// Whether a response is a live stream, one whose end never comes:
/// server-sent events, or a multipart stream that replaces itself.
///
/// ```
/// use http::{HeaderMap, HeaderValue, header::CONTENT_TYPE};
/// use tiercache_http::cacheable::is_live_stream;
///
/// let mut headers = HeaderMap::new();
/// headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
/// assert!(is_live_stream(&headers));
/// ```
pub fn is_live_stream(headers: &HeaderMap) -> bool {
    headers.get_all(CONTENT_TYPE).iter().any(|value| {
        let essence = value.as_bytes().split(|&b| b == b';').next().unwrap_or(b"");
        let essence = essence.trim_ascii();
        essence.eq_ignore_ascii_case(b"text/event-stream")
            || essence.eq_ignore_ascii_case(b"multipart/x-mixed-replace")
    })
}

/// The longest host a cacheable request may name: a DNS name (253 bytes),
/// a colon and a port.
pub const MAX_HOST: usize = 253 + 6;

/// The statuses stored under the route's ttl when the origin declares no
/// freshness: RFC 9110 §15.1's heuristically cacheable ones that are not
/// errors. (404 and 410 get the negative ttl; other errors need explicit
/// freshness.)
pub fn status_heuristic(status: StatusCode) -> bool {
    matches!(status.as_u16(), 200 | 203 | 204 | 300 | 301 | 308)
}

/// Statuses never stored, whatever the headers: partial content, 304,
/// interim responses, and the errors a request can provoke on its own
/// (400, 413, 414, 416, 431: one oversized header, or one odd `Range`,
/// must not give everyone a cached error). Origin failures (500, 502, 503, 504) are stored only with
/// explicit freshness, capped by `max_error_ttl`, as Traffic Server, httpd
/// and nginx do.
pub fn status_never_stored(status: StatusCode) -> bool {
    // 416 answers one request's `Range` (sent on for a key not stored).
    matches!(status.as_u16(), 206 | 304 | 400 | 413 | 414 | 416 | 431) || status.is_informational()
}

/// Whether a response may be stored and shared. `cache_control` is the
/// response's headers with the targeted field (RFC 9213), when one applies,
/// standing in for `Cache-Control`; `credentialed` tells that the request
/// carried `Authorization`.
pub fn response_storable(
    status: StatusCode,
    headers: &HeaderMap,
    cache_control: &HeaderMap,
    credentialed: bool,
) -> Result<(), Reason> {
    if status_never_stored(status) {
        return Err(Reason::Status);
    }
    if headers.contains_key(SET_COOKIE) {
        return Err(Reason::SetCookie);
    }
    if has_directive(cache_control, "no-store") {
        return Err(Reason::NoStore);
    }
    if has_directive(cache_control, "private") {
        return Err(Reason::Private);
    }
    if vary_star(headers) {
        return Err(Reason::VaryStar);
    }
    if credentialed
        && !["public", "s-maxage", "must-revalidate"]
            .iter()
            .any(|d| has_directive(cache_control, d))
    {
        return Err(Reason::Authorization);
    }
    Ok(())
}

/// Whether an origin error that is not stored may still answer the
/// requests that waited on the same load: a 5xx made for no one in
/// particular (no `Set-Cookie`, `private` or `no-store`, no `Vary`, and a
/// request without credentials). Sharing it saves a failing origin one
/// call per waiting request; anything else would be one client's answer
/// given to another.
pub fn response_shareable(
    status: StatusCode,
    headers: &HeaderMap,
    cache_control: &HeaderMap,
    credentialed: bool,
) -> bool {
    status.is_server_error()
        && !credentialed
        && !headers.contains_key(SET_COOKIE)
        && !headers.contains_key(VARY)
        && !has_directive(cache_control, "no-store")
        && !has_directive(cache_control, "private")
}

/// Whether `Vary` lists `*`, in any field or position.
pub fn vary_star(headers: &HeaderMap) -> bool {
    varies_on(headers, b"*")
}

/// Whether `Vary` lists `name` (case-blind), in any field or position.
pub(crate) fn varies_on(headers: &HeaderMap, name: &[u8]) -> bool {
    headers.get_all(VARY).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|n| n.trim_ascii().eq_ignore_ascii_case(name))
    })
}

/// The declared `Content-Length`, if valid.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// 500, 502, 503, 504: the statuses stale-if-error answers for (RFC 5861 §4).
pub(crate) fn is_origin_error(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 500 | 502 | 503 | 504)
}

#[cfg(test)]
mod tests;
