//! Cacheability: pure functions that say whether a request may use the cache
//! and whether a response may be stored, with the reason when not.

use http::header::{AUTHORIZATION, CONTENT_LENGTH, COOKIE, SET_COOKIE, VARY};
use http::{HeaderMap, Method, StatusCode, request, response};

use crate::cache_control::has_directive;

/// Why a request skipped the cache, or a response was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// Not GET or HEAD.
    Method,
    /// The request carries `Authorization`.
    Authorization,
    /// The request carries `Cookie`.
    Cookie,
    /// The request says `Cache-Control: no-store`.
    RequestNoStore,
    /// The key's last response could not be shared (hit-for-miss).
    HitForMiss,
    /// A status a shared cache may not store by default (e.g. 5xx).
    Status,
    /// The response sets a cookie.
    SetCookie,
    /// `Cache-Control: private`.
    Private,
    /// `Cache-Control: no-store`.
    NoStore,
    /// `Vary: *`.
    VaryStar,
    /// The body is larger than `max_body`.
    TooLarge,
    /// The body failed or carried trailers while it was being read.
    Body,
    /// `Cache-Control: no-cache` (stored-but-revalidated is not supported yet).
    NoCache,
    /// The origin declared it already stale (`max-age=0`, an `Age` past its lifetime).
    NotFresh,
}

impl Reason {
    /// The token used in `cache-status` `detail=` and in the stats.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Method => "method",
            Reason::Authorization => "authorization",
            Reason::Cookie => "cookie",
            Reason::RequestNoStore => "request-no-store",
            Reason::HitForMiss => "hit-for-miss",
            Reason::Status => "status",
            Reason::SetCookie => "set-cookie",
            Reason::Private => "private",
            Reason::NoStore => "no-store",
            Reason::VaryStar => "vary-star",
            Reason::TooLarge => "too-large",
            Reason::Body => "body",
            Reason::NoCache => "no-cache",
            Reason::NotFresh => "not-fresh",
        }
    }
}

/// Whether a request may be answered from, and fill, the cache.
///
/// ```
/// use http::Request;
/// use tiercache_http::cacheable::{Reason, request_cacheable};
///
/// let req = Request::get("/").header("authorization", "Bearer x").body(()).unwrap();
/// assert_eq!(request_cacheable(&req.into_parts().0), Err(Reason::Authorization));
/// ```
pub fn request_cacheable(req: &request::Parts) -> Result<(), Reason> {
    if req.method != Method::GET && req.method != Method::HEAD {
        return Err(Reason::Method);
    }
    if req.headers.contains_key(AUTHORIZATION) {
        return Err(Reason::Authorization);
    }
    if req.headers.contains_key(COOKIE) {
        return Err(Reason::Cookie);
    }
    if has_directive(&req.headers, "no-store") {
        return Err(Reason::RequestNoStore);
    }
    Ok(())
}

/// The statuses a shared cache may store without explicit freshness
/// (RFC 9110 §15.1 "heuristically cacheable"), which tiercache stores under the route ttl.
pub fn status_storable(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200 | 203 | 204 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

/// Whether a response may be stored and shared.
pub fn response_storable(res: &response::Parts) -> Result<(), Reason> {
    if !status_storable(res.status) {
        return Err(Reason::Status);
    }
    if res.headers.contains_key(SET_COOKIE) {
        return Err(Reason::SetCookie);
    }
    if has_directive(&res.headers, "no-store") {
        return Err(Reason::NoStore);
    }
    if has_directive(&res.headers, "private") {
        return Err(Reason::Private);
    }
    if vary_star(&res.headers) {
        return Err(Reason::VaryStar);
    }
    Ok(())
}

/// Whether `Vary` lists `*`, in any field or position.
pub fn vary_star(headers: &HeaderMap) -> bool {
    headers.get_all(VARY).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|n| n.trim_ascii() == b"*")
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

#[cfg(test)]
mod tests {
    use super::*;
    use http::Response;

    fn parts(
        build: impl FnOnce(http::response::Builder) -> http::response::Builder,
    ) -> response::Parts {
        build(Response::builder()).body(()).unwrap().into_parts().0
    }

    #[test]
    fn refuses_what_may_not_be_shared() {
        let cases = [
            (parts(|b| b.status(500)), Reason::Status),
            (parts(|b| b.status(206)), Reason::Status),
            (parts(|b| b.header("set-cookie", "a=b")), Reason::SetCookie),
            (
                parts(|b| b.header("cache-control", "max-age=60, No-Store")),
                Reason::NoStore,
            ),
            (
                parts(|b| b.header("cache-control", "private=\"x\"")),
                Reason::Private,
            ),
            (parts(|b| b.header("vary", "accept, *")), Reason::VaryStar),
        ];
        for (p, reason) in cases {
            assert_eq!(response_storable(&p), Err(reason));
        }
        assert_eq!(response_storable(&parts(|b| b.status(404))), Ok(()));
        assert_eq!(
            response_storable(&parts(|b| b.header("cache-control", "public, max-age=5"))),
            Ok(())
        );
    }

    #[test]
    fn only_get_and_head_without_credentials() {
        let req = |m: Method, h: Option<(&str, &str)>| {
            let mut b = http::Request::builder().method(m).uri("/");
            if let Some((n, v)) = h {
                b = b.header(n, v);
            }
            b.body(()).unwrap().into_parts().0
        };
        assert_eq!(request_cacheable(&req(Method::GET, None)), Ok(()));
        assert_eq!(request_cacheable(&req(Method::HEAD, None)), Ok(()));
        assert_eq!(
            request_cacheable(&req(Method::POST, None)),
            Err(Reason::Method)
        );
        assert_eq!(
            request_cacheable(&req(Method::GET, Some(("cookie", "s=1")))),
            Err(Reason::Cookie)
        );
        assert_eq!(
            request_cacheable(&req(Method::GET, Some(("cache-control", "no-store")))),
            Err(Reason::RequestNoStore)
        );
    }
}
