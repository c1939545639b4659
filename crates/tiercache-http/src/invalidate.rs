//! Invalidation by unsafe methods (RFC 9111 §4.4): which keys a successful
//! POST, PUT, PATCH, DELETE (or unknown method) makes stale.

use http::header::{CONTENT_LENGTH, CONTENT_LOCATION, HOST, LOCATION, TRANSFER_ENCODING};
use http::{HeaderMap, Method, request};
use tiercache_core::CacheKey;

use crate::config::HttpConfig;
use crate::key::uri_key;
use crate::request::prepare;

/// GET, HEAD, OPTIONS and TRACE change nothing; every other method may.
pub fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// The origin of an unsafe request's target, to resolve the response's
/// `Location` and `Content-Location` against.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    scheme: String,
    authority: Vec<u8>,
    path: String,
}

impl Target {
    /// `path` on the target's origin, as an absolute URI; `None` for a host
    /// no cacheable request may name (nothing is stored under it, and a
    /// pattern carrying it would be the client's size).
    pub(crate) fn uri_of(&self, path: &str) -> Option<http::Uri> {
        if self.authority.len() > crate::cacheable::MAX_HOST {
            return None;
        }
        let authority = std::str::from_utf8(&self.authority).ok()?;
        format!("{}://{authority}{path}", self.scheme).parse().ok()
    }
}

/// The keys of the request's target: the anonymous entry, and the one this
/// request's own credentials or keyed cookies and headers would read.
pub(crate) fn invalidation_keys(
    parts: &request::Parts,
    config: &HttpConfig,
) -> (Vec<CacheKey>, Target) {
    let authority = parts
        .uri
        .authority()
        .map(|a| a.as_str().as_bytes().to_vec())
        .or_else(|| parts.headers.get(HOST).map(|h| h.as_bytes().to_vec()))
        .unwrap_or_default();
    let target = Target {
        scheme: parts
            .uri
            .scheme_str()
            .unwrap_or("http")
            .to_ascii_lowercase(),
        authority,
        path: parts.uri.path().to_owned(),
    };
    let mut keys = vec![
        uri_key(
            &target.scheme,
            &target.authority,
            parts.uri.path(),
            parts.uri.query(),
        )
        .finish(),
    ];
    let mut as_get = parts.clone();
    as_get.method = Method::GET;
    for framing in [CONTENT_LENGTH, TRANSFER_ENCODING] {
        as_get.headers.remove(framing);
    }
    if let Ok(own) = prepare(&mut as_get, config)
        && own.key != keys[0]
    {
        keys.push(own.key);
    }
    (keys, target)
}

/// The keys of a response's `Location` and `Content-Location`, when they
/// are on the request's own origin (a cross-origin one is never touched:
/// it would let one site purge another's entries). The same host over the
/// other of `http`/`https` (default ports) counts as the request's own: a
/// cache behind a TLS terminator sees `http` requests, and applications
/// there redirect to `https://` URLs of their own host.
pub(crate) fn location_keys(headers: &HeaderMap, target: &Target) -> Vec<CacheKey> {
    let mut keys = Vec::new();
    for name in [LOCATION, CONTENT_LOCATION] {
        for value in headers.get_all(&name) {
            let Ok(text) = value.to_str() else { continue };
            let text = text.trim().split('#').next().unwrap_or("");
            if let Some((path, query)) = resolve(text, target) {
                let key =
                    uri_key(&target.scheme, &target.authority, &path, query.as_deref()).finish();
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
        }
    }
    keys
}

/// A `Location`-style reference resolved against the request's target (RFC
/// 3986 §5: `..` and `.` segments removed, relative paths joined to the
/// target's directory), as a path and query on the target's origin; `None`
/// when it names another origin or does not parse.
fn resolve(text: &str, target: &Target) -> Option<(String, Option<String>)> {
    let authority = std::str::from_utf8(&target.authority).ok()?;
    let base = url::Url::parse(&format!("{}://{authority}{}", target.scheme, target.path)).ok()?;
    let resolved = base.join(text).ok()?;
    let web = |u: &url::Url| matches!(u.scheme(), "http" | "https") && u.port().is_none();
    let same_host = web(&resolved) && web(&base) && resolved.host() == base.host();
    if resolved.origin() != base.origin() && !same_host {
        return None;
    }
    Some((
        resolved.path().to_owned(),
        resolved.query().map(str::to_owned),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::request_key;
    use http::Request;

    fn get(uri: &str) -> CacheKey {
        let p = Request::get(uri)
            .header("host", "shop.example")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        request_key(&p)
    }

    #[test]
    fn the_target_and_same_origin_locations() {
        let post = Request::post("/cart/items?x=1")
            .header("host", "shop.example")
            .header("content-length", "3")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let (keys, target) = invalidation_keys(&post, &HttpConfig::default());
        assert_eq!(keys, vec![get("/cart/items?x=1")]);

        let mut res = HeaderMap::new();
        res.append(LOCATION, "/cart".parse().unwrap());
        res.append(
            CONTENT_LOCATION,
            "http://SHOP.example/cart/items/7".parse().unwrap(),
        );
        res.append(LOCATION, "http://other.example/cart".parse().unwrap());
        res.append(LOCATION, "https://other.example/cart".parse().unwrap());
        res.append(LOCATION, "http://shop.example:8080/cart".parse().unwrap());
        // The same host over https (a TLS terminator in front): its own.
        res.append(LOCATION, "https://shop.example/cart/https".parse().unwrap());
        res.append(LOCATION, "summary".parse().unwrap());
        // Dot segments are resolved (RFC 3986 §5.2.4), so the target is hit.
        res.append(
            LOCATION,
            "/cart/items/../checkout/./done?x=2".parse().unwrap(),
        );
        res.append(LOCATION, "../account".parse().unwrap());
        let keys = location_keys(&res, &target);
        assert_eq!(
            keys,
            vec![
                get("/cart"),
                get("/cart/https"),
                get("/cart/summary"),
                get("/cart/checkout/done?x=2"),
                get("/account"),
                get("/cart/items/7"),
            ]
        );
    }

    #[test]
    fn safe_methods() {
        for m in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
            assert!(is_safe(&m));
        }
        for m in ["POST", "PUT", "PATCH", "DELETE", "PURGE", "BREW"] {
            assert!(!is_safe(&Method::from_bytes(m.as_bytes()).unwrap()), "{m}");
        }
    }
}
