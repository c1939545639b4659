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
    /// `path` on each spelling of the target's origin (see [`spellings`]),
    /// as absolute URIs; none for a host no cacheable request may name
    /// (nothing is stored under it, and a pattern carrying it would be the
    /// client's size).
    pub(crate) fn uris_of<'a>(&'a self, path: &'a str) -> impl Iterator<Item = http::Uri> + 'a {
        spellings(self).filter_map(move |authority| self.uri_on(authority, path))
    }

    fn uri_on(&self, authority: &[u8], path: &str) -> Option<http::Uri> {
        if authority.len() > crate::cacheable::MAX_HOST {
            return None;
        }
        let authority = std::str::from_utf8(authority).ok()?;
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
    let mut keys = spellings(&target)
        .map(|authority| {
            uri_key(
                &target.scheme,
                authority,
                parts.uri.path(),
                parts.uri.query(),
            )
            .finish()
        })
        .collect::<Vec<_>>();
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
                for authority in spellings(target) {
                    let key = uri_key(&target.scheme, authority, &path, query.as_deref()).finish();
                    if !keys.contains(&key) {
                        keys.push(key);
                    }
                }
            }
        }
    }
    keys
}

/// The target's authority as the request spelled it, then, when that
/// names the scheme's default port (`site.example:80`), the same origin
/// without it (RFC 9110 §4.2.3): two keys, each holding what its own
/// spelling was answered (an application may build links from `Host` as
/// sent, so they are not made one), and a write through the rare spelling
/// invalidates the common one too. The other way round (a write through
/// `site.example` leaving what `site.example:80` stored) is left: it
/// would send every write's invalidation twice over the fleet, for a
/// spelling clients seldom send.
fn spellings(target: &Target) -> impl Iterator<Item = &[u8]> + '_ {
    std::iter::once(&target.authority[..])
        .chain(without_default_port(&target.scheme, &target.authority))
}

/// `authority` without its scheme's default port; `None` for another
/// port, another scheme, or no host.
fn without_default_port<'a>(scheme: &str, authority: &'a [u8]) -> Option<&'a [u8]> {
    let default: &[u8] = match scheme {
        "http" => b":80",
        "https" => b":443",
        _ => return None,
    };
    // The host ends at its port's colon, past an IPv6 literal's brackets.
    let host_end = match authority.first() {
        Some(b'[') => authority.iter().position(|&b| b == b']')? + 1,
        _ => authority.iter().position(|&b| b == b':')?,
    };
    let (host, port) = authority.split_at(host_end);
    (!host.is_empty() && port == default).then_some(host)
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
        get_on("shop.example", uri)
    }

    fn get_on(host: &str, uri: &str) -> CacheKey {
        let p = Request::get(uri)
            .header("host", host)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        request_key(&p)
    }

    fn post_to(host: &str) -> request::Parts {
        Request::post("/doc")
            .header("host", host)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    /// `site.example` and `site.example:80` are one origin (RFC 9110
    /// §4.2.3) with two keys: a write through the spelling with the port
    /// invalidates what the other stored (it missed it before).
    #[test]
    fn a_write_reaches_the_other_spelling_of_its_origin() {
        let config = HttpConfig::default();
        for (host, other) in [("site.example:80", "site.example"), ("[::1]:80", "[::1]")] {
            let (keys, _) = invalidation_keys(&post_to(host), &config);
            assert_eq!(
                keys,
                vec![get_on(host, "/doc"), get_on(other, "/doc")],
                "{host}"
            );
        }
        for alone in [
            "site.example",
            "[::1]",
            "site.example:8080",
            "site.example:443",
            "",
        ] {
            let (keys, _) = invalidation_keys(&post_to(alone), &config);
            assert_eq!(keys, vec![get_on(alone, "/doc")], "{alone}");
        }
        let https = Request::post("https://site.example:443/doc")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let (keys, target) = invalidation_keys(&https, &config);
        // The key of `path` on both spellings of the https origin.
        let both = |path: &str| {
            ["site.example:443", "site.example"].map(|authority| {
                let uri = format!("https://{authority}{path}");
                request_key(&Request::get(uri).body(()).unwrap().into_parts().0)
            })
        };
        assert_eq!(keys, both("/doc"));
        // A route's path-prefix invalidation covers both spellings too.
        let prefixes: Vec<String> = target.uris_of("/docs/").map(|u| u.to_string()).collect();
        assert_eq!(
            prefixes,
            [
                "https://site.example:443/docs/",
                "https://site.example/docs/"
            ]
        );
        let mut res = HeaderMap::new();
        res.append(LOCATION, "/next".parse().unwrap());
        assert_eq!(location_keys(&res, &target), both("/next"));
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
        let want: Vec<CacheKey> = [
            "/cart",
            "/cart/https",
            "/cart/summary",
            "/cart/checkout/done?x=2",
            "/account",
            "/cart/items/7",
        ]
        .into_iter()
        .map(get)
        .collect();
        assert_eq!(keys, want);
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
