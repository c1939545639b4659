//! What a cacheable request brings: its key, and the head the origin gets.
//!
//! Preparing a request turns a GET or HEAD into the request a shared cache may send
//! on: the inputs that are not in the key are taken out (so they cannot shape
//! a stored response), the client's own validators are kept aside (the cache
//! answers them, RFC 9111 §4.3.2), and what the route keys on is pushed into
//! the key (credentials and cookies only as fingerprints).

use http::header::{AUTHORIZATION, CACHE_CONTROL, COOKIE, HOST, PRAGMA, TE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, request};
use tiercache_core::key::fingerprint;
use tiercache_core::{CacheKey, KeyBuilder};

use crate::cache_control::{directive_value, has_directive, list_items};
use crate::cacheable::{Reason, Scan, cacheable_scanned};
pub(crate) use crate::conditional::{Conditional, opaque};
use crate::config::{Cookies, HttpConfig};
use crate::key::{request_key, target_key};

/// Request fields a cache does not key on and an origin may still act on
/// to build links, rewrite paths or change the method: the whole family
/// frameworks read for scheme, host, port, prefix, path and method (Rack,
/// Rails, Django, Symfony, Spring, ASP.NET, IIS, Flask and Puma among them).
/// Removed from every cacheable request unless the route keys on them
/// ([`key_header`](crate::ResponseCacheLayer::key_header)), in every
/// spelling: names are compared case-blind and with `_` read as `-`, since
/// Puma and WSGI servers fold `X_Forwarded_Host` into `X-Forwarded-Host`.
pub const UNKEYED: [&str; 34] = [
    // host
    "x-forwarded-host",
    "x-forwarded-server",
    "x-host",
    "x-original-host",
    "x-original-forwarded-host",
    "x-http-host-override",
    "forwarded",
    // scheme
    "x-forwarded-proto",
    "x-forwarded-scheme",
    "x-forwarded-protocol",
    "x-forwarded-ssl",
    "x-scheme",
    "x-url-scheme",
    "front-end-https",
    "x-forwarded-https",
    "x-original-proto",
    "cloudfront-forwarded-proto",
    // port
    "x-forwarded-port",
    // prefix and path
    "x-forwarded-prefix",
    "x-forwarded-pathbase",
    "x-forwarded-base",
    "x-original-prefix",
    "x-envoy-original-path",
    "x-forwarded-path",
    "x-forwarded-uri",
    "x-original-url",
    "x-original-uri",
    "x-rewrite-url",
    "script-name",
    "x-script-name",
    // method
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-method",
];

/// Whether `name` is one of [`UNKEYED`] in any spelling (case, `-` or `_`).
pub fn is_unkeyed(name: &str) -> bool {
    // Most names start elsewhere: one byte settles them (and for `c`, the
    // one such name's length: `cookie`, `cache-control` and `connection`
    // are in every other request).
    match name.as_bytes().first() {
        Some(b'x' | b'f' | b's') => UNKEYED.iter().any(|u| same_name(u, name)),
        Some(b'c') => same_name("cloudfront-forwarded-proto", name),
        _ => false,
    }
}

/// Header names compared case-blind, with `_` and `-` alike.
pub fn same_name(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes().zip(b.bytes()).all(|(x, y)| {
            let fold = |c: u8| {
                if c == b'_' {
                    b'-'
                } else {
                    c.to_ascii_lowercase()
                }
            };
            fold(x) == fold(y)
        })
}

/// A cacheable request, ready for the cache.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) key: CacheKey,
    pub(crate) head: bool,
    pub(crate) conditional: Conditional,
    /// The request carried `Authorization` (the key holds its fingerprint).
    pub(crate) credentialed: bool,
    /// The client asked for a fresh copy and the layer honours that.
    pub(crate) reload: bool,
    /// The client asked for a stored response or none (`only-if-cached`).
    pub(crate) only_if_cached: bool,
    /// One byte range, cut from the stored full response.
    pub(crate) range: Option<crate::range::RangeAsk>,
}

/// Checks `parts` and rewrites its head for the origin; the error is why the
/// request bypasses the cache (the head is then untouched).
// On every L1 hit: inlined into the application's crate too.
#[inline]
pub(crate) fn prepare(parts: &mut request::Parts, config: &HttpConfig) -> Result<Prepared, Reason> {
    let scan = Scan::of(&parts.headers);
    cacheable_scanned(parts, &scan)?;
    if scan.cookie && config.cookies == Cookies::Bypass {
        return Err(Reason::Cookie);
    }
    // Before anything changes the head: a `Range` the cache does not answer
    // sends the request to the origin as it came (validators, cookies).
    // Range is defined for GET only: a HEAD's is ignored.
    let range = if scan.range {
        let taken =
            crate::range::RangeAsk::take(&mut parts.headers).map_err(|()| Reason::Precondition)?;
        taken.filter(|_| parts.method == Method::GET)
    } else {
        None
    };
    let keyed = scan.authorization
        || matches!(config.cookies, Cookies::Key(_))
        || !config.keyed_headers.is_empty();
    // A request keyed on its target alone (the common case) takes its key
    // from this thread's recent ones (see `target_keys`); a keyed one's is
    // built on, part by part.
    let mut key = Key::of(parts, keyed);
    lower_host(parts);
    let headers = &mut parts.headers;
    let mut credentialed = false;
    if scan.authorization {
        // Every field: an origin may read any of them.
        for credential in headers.get_all(AUTHORIZATION) {
            if !credentialed {
                key.push(b"authorization");
                credentialed = true;
            }
            key.push_secret(credential.as_bytes());
        }
    }
    match &config.cookies {
        Cookies::Bypass => {}
        Cookies::Ignore if !scan.cookie => {}
        Cookies::Ignore => {
            headers.remove(COOKIE);
        }
        Cookies::Key(names) => {
            let kept = named_cookies(headers, names);
            key.push(b"cookies");
            key.push_secret(kept.as_bytes());
            match HeaderValue::try_from(kept) {
                Ok(v) if !v.is_empty() => {
                    headers.insert(COOKIE, v);
                }
                _ => {
                    headers.remove(COOKIE);
                }
            }
        }
    }
    // Most requests carry no unkeyed field and remove nothing.
    if scan.unkeyed {
        let doomed: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_unkeyed(n.as_str()))
            // Only the very name keyed: another spelling (`X_Forwarded_Proto`,
            // which WSGI servers fold into the same variable) is not in
            // the key, so it goes.
            .filter(|n| !config.keyed_headers.iter().any(|k| k == *n))
            .cloned()
            .collect();
        for name in doomed {
            headers.remove(name);
        }
    }
    for name in &config.keyed_headers {
        key.push(b"header");
        key.push(name.as_str().as_bytes());
        for v in headers.get_all(name) {
            key.push(v.as_bytes());
        }
    }
    // A response the cache may store goes to every client, and a stored
    // body keeps no trailers: the origin is not asked for them (asked, it
    // may send them, and an answer with trailers is not stored).
    if scan.te {
        headers.remove(TE);
    }
    let conditional = if scan.conditional {
        Conditional::take(headers)
    } else {
        Conditional::default()
    };
    let only_if_cached = scan.cache_control && asks_only_if_cached(headers);
    let reload = config.honor_client_no_cache && scan.cache_control && asks_reload(headers);
    Ok(Prepared {
        key: key.finish(),
        head: parts.method == Method::HEAD,
        conditional,
        credentialed,
        reload,
        only_if_cached,
        range,
    })
}

/// Lower-cases the host the origin gets, `Host` and the target's
/// authority, as the key holds it (RFC 3986 §6.2.2.1): an answer built
/// from the host as sent (a case-sensitive redirect to the canonical
/// host) would otherwise be stored for every spelling of it.
#[inline]
fn lower_host(parts: &mut request::Parts) {
    let upper = |bytes: &[u8]| bytes.iter().any(u8::is_ascii_uppercase);
    if let Some(host) = parts.headers.get(HOST)
        && upper(host.as_bytes())
        && let Ok(lower) = HeaderValue::from_bytes(&host.as_bytes().to_ascii_lowercase())
    {
        parts.headers.insert(HOST, lower);
    }
    if let Some(authority) = parts.uri.authority()
        && upper(authority.as_str().as_bytes())
    {
        // Userinfo is no part of the host (and the proxy refuses it).
        let host_at = authority.as_str().rfind('@').map_or(0, |at| at + 1);
        let mut lower = authority.as_str().to_owned();
        lower[host_at..].make_ascii_lowercase();
        let mut uri = parts.uri.clone().into_parts();
        uri.authority = http::uri::Authority::try_from(lower).ok();
        if let Ok(uri) = http::Uri::from_parts(uri) {
            parts.uri = uri;
        }
    }
}

/// A request's key while [`prepare`] builds it.
enum Key {
    /// A keyed request's: its target's parts, more to follow.
    Building(KeyBuilder),
    /// The target's alone.
    Target(CacheKey),
}

impl Key {
    fn of(parts: &request::Parts, keyed: bool) -> Self {
        if keyed {
            // Room for what follows the target (a credential's or cookies'
            // digest takes 4 + 16 bytes after its 4 + name).
            Key::Building(target_key(parts, 96))
        } else {
            Key::Target(request_key(parts))
        }
    }

    /// Appends a part. A key of the target alone takes it as one more part
    /// (a copy; `prepare` never does this: such requests are not keyed).
    fn push(&mut self, part: &[u8]) {
        match self {
            Key::Building(key) => key.push(part),
            Key::Target(key) => *key = key.with_part(part),
        }
    }

    fn push_secret(&mut self, part: &[u8]) {
        self.push(&fingerprint(part));
    }

    fn finish(self) -> CacheKey {
        match self {
            Key::Building(key) => key.finish(),
            Key::Target(key) => key,
        }
    }
}

/// `Cache-Control: only-if-cached` (RFC 9111 §5.2.1.7): answer from
/// storage, or 504 without asking the origin.
pub(crate) fn asks_only_if_cached(headers: &HeaderMap) -> bool {
    has_directive(headers, "only-if-cached")
}

/// Removes `only-if-cached` from the request's `Cache-Control` (its other
/// directives stay), for the refresh an answer to it started: the refresh
/// goes to the origin, which a cache upstream would answer with a 504.
pub(crate) fn drop_only_if_cached(headers: &mut HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(CACHE_CONTROL)
        .iter()
        .flat_map(|v| list_items(v.as_bytes()))
        .filter(|item| {
            let name = item.split(|&b| b == b'=').next().unwrap_or(&[]);
            !name.trim_ascii().eq_ignore_ascii_case(b"only-if-cached")
        })
        .map(|item| String::from_utf8_lossy(item).into_owned())
        .collect();
    headers.remove(CACHE_CONTROL);
    if let Ok(value) = HeaderValue::try_from(kept.join(", "))
        && !value.is_empty()
    {
        headers.insert(CACHE_CONTROL, value);
    }
}

/// `Cache-Control: no-cache` or `max-age=0`, or `Pragma: no-cache` without `Cache-Control`.
fn asks_reload(headers: &HeaderMap) -> bool {
    if headers.contains_key(CACHE_CONTROL) {
        return has_directive(headers, "no-cache")
            || directive_value(headers, "max-age").is_some_and(|v| v.trim() == "0");
    }
    headers
        .get_all(PRAGMA)
        .iter()
        .any(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"no-cache"))
}

/// The cookies named by the route, in the route's order, as one `Cookie` value.
fn named_cookies(headers: &HeaderMap, names: &[String]) -> String {
    let mut out = String::new();
    for name in names {
        for pair in headers
            .get_all(COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
        {
            let pair = pair.trim();
            if let Some((n, _)) = pair.split_once('=')
                && n.trim() == name
            {
                if !out.is_empty() {
                    out.push_str("; ");
                }
                out.push_str(pair);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::freshness::parse_http_date;
    use http::Request;
    use http::header::IF_NONE_MATCH;

    fn config() -> HttpConfig {
        HttpConfig::default()
    }

    fn parts(headers: &[(&str, &str)]) -> request::Parts {
        let mut b = Request::get("/p").header("host", "example.com");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn unkeyed_inputs_are_removed() {
        let mut p = parts(&[
            ("x-forwarded-host", "evil.example"),
            ("X-HTTP-Method-Override", "DELETE"),
            ("forwarded", "host=evil"),
            ("accept", "text/html"),
        ]);
        let plain = prepare(&mut parts(&[]), &config()).unwrap();
        let got = prepare(&mut p, &config()).unwrap();
        assert_eq!(got.key, plain.key);
        assert_eq!(p.headers.len(), 2, "{:?}", p.headers);
        assert!(p.headers.contains_key("accept"));
    }

    #[test]
    fn a_keyed_header_is_kept_and_keyed() {
        let mut config = config();
        config
            .keyed_headers
            .push(HeaderName::from_static("x-forwarded-proto"));
        let mut https = parts(&[("x-forwarded-proto", "https")]);
        let a = prepare(&mut https, &config).unwrap();
        let b = prepare(&mut parts(&[("x-forwarded-proto", "http")]), &config).unwrap();
        assert_ne!(a.key, b.key);
        assert_eq!(https.headers["x-forwarded-proto"], "https");
    }

    #[test]
    fn credentials_key_by_fingerprint() {
        let alice = prepare(&mut parts(&[("authorization", "Bearer alice")]), &config()).unwrap();
        let bob = prepare(&mut parts(&[("authorization", "Bearer bob")]), &config()).unwrap();
        let anonymous = prepare(&mut parts(&[]), &config()).unwrap();
        assert!(alice.credentialed);
        assert_ne!(alice.key, bob.key);
        assert_ne!(alice.key, anonymous.key);
        let full = alice.key.full();
        assert!(!full.windows(5).any(|w| w == b"alice"));
    }

    #[test]
    fn cookie_modes() {
        let mut p = parts(&[("cookie", "session=s1; lang=fr")]);
        assert_eq!(prepare(&mut p, &config()).unwrap_err(), Reason::Cookie);
        let mut ignore = config();
        ignore.cookies = Cookies::Ignore;
        let got = prepare(&mut p, &ignore).unwrap();
        assert!(!p.headers.contains_key("cookie"));
        assert_eq!(got.key, prepare(&mut parts(&[]), &ignore).unwrap().key);

        let mut keyed = config();
        keyed.cookies = Cookies::Key(vec!["lang".into()]);
        let mut fr = parts(&[("cookie", "session=s1; lang=fr")]);
        let fr_key = prepare(&mut fr, &keyed).unwrap().key;
        assert_eq!(
            fr.headers["cookie"], "lang=fr",
            "the session cookie never reaches the origin"
        );
        let other_session =
            prepare(&mut parts(&[("cookie", "lang=fr; session=s2")]), &keyed).unwrap();
        assert_eq!(fr_key, other_session.key);
        let en = prepare(&mut parts(&[("cookie", "session=s1; lang=en")]), &keyed).unwrap();
        assert_ne!(fr_key, en.key);
    }

    #[test]
    fn validators_are_taken_and_answered() {
        let mut p = parts(&[("if-none-match", "W/\"v1\", \"v2\"")]);
        let got = prepare(&mut p, &config()).unwrap();
        assert!(!p.headers.contains_key("if-none-match"));
        assert!(got.conditional.not_modified(Some(b"\"v1\""), None));
        assert!(got.conditional.not_modified(Some(b"W/\"v2\""), None));
        assert!(!got.conditional.not_modified(Some(b"\"v3\""), None));
        assert!(!got.conditional.not_modified(None, None));

        let mut p = parts(&[("if-modified-since", "Sun, 06 Nov 1994 08:49:37 GMT")]);
        let got = prepare(&mut p, &config()).unwrap();
        let at = parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        let mut quoted = HeaderMap::new();
        quoted.insert(IF_NONE_MATCH, HeaderValue::from_static("\"x\", W/\"a,b\""));
        let tags = Conditional::take(&mut quoted);
        assert!(
            tags.not_modified(Some(b"\"a,b\""), None),
            "a comma inside a tag"
        );
        assert!(!tags.not_modified(Some(b"\"a\""), None));
        assert!(!tags.not_modified(Some(b"b\""), None));
        assert!(got.conditional.not_modified(None, Some(at)));
        assert!(
            !got.conditional
                .not_modified(None, Some(at + std::time::Duration::from_secs(1)))
        );
    }

    #[test]
    fn client_reload_is_ignored_unless_honoured() {
        let mut honour = config();
        honour.honor_client_no_cache = true;
        for h in [
            ("cache-control", "no-cache"),
            ("cache-control", "max-age=0"),
            ("pragma", "no-cache"),
        ] {
            assert!(!prepare(&mut parts(&[h]), &config()).unwrap().reload);
            assert!(prepare(&mut parts(&[h]), &honour).unwrap().reload, "{h:?}");
        }
        let both = [("cache-control", "max-age=5"), ("pragma", "no-cache")];
        assert!(!prepare(&mut parts(&both), &honour).unwrap().reload);
    }
}
