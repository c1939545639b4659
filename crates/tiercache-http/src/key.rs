//! HTTP cache keys and `Vary` variants.
//!
//! The primary key is built from length-prefixed parts: a schema version, the
//! method class (HEAD shares GET's entry), scheme, lower-cased authority, raw
//! path and raw query. The `Vary`'d request header values are not in the
//! primary key: they form the entry's *variant*, stored with it and compared
//! on every read, so a request with other values never gets that response.

use bytes::{BufMut, Bytes, BytesMut};
use http::Uri;
use http::header::{ACCEPT_ENCODING, HOST, VARY};
use http::{HeaderMap, HeaderName, request};
use tiercache_core::key::fingerprint;
use tiercache_core::{CacheKey, Entry, KeyBuilder, KeyPattern};

use crate::target_keys::{self, Target};

mod accept_encoding;
pub use accept_encoding::normalized_accept_encoding;
pub(crate) use accept_encoding::{coding_of, known_coding};

/// Builds the cache key of a request: its target, GET and HEAD alike.
///
/// ```
/// use http::Request;
/// use tiercache_http::key::request_key;
///
/// let a = Request::get("/p?x=1").header("host", "Example.com").body(()).unwrap().into_parts().0;
/// let b = Request::head("/p?x=1").header("host", "example.com").body(()).unwrap().into_parts().0;
/// assert_eq!(request_key(&a), request_key(&b));
/// ```
pub fn request_key(req: &request::Parts) -> CacheKey {
    let target = target_of(req);
    target_keys::key_of(target, || target_key(req, 0).finish())
}

/// The parts of a request's target that its key is built from.
fn target_of(req: &request::Parts) -> Target<'_> {
    Target {
        scheme: req.uri.scheme_str().unwrap_or("http"),
        authority: req
            .uri
            .authority()
            .map(|a| a.as_str().as_bytes())
            .or_else(|| req.headers.get(HOST).map(|h| h.as_bytes()))
            .unwrap_or_default(),
        path: req.uri.path(),
        query: req.uri.query(),
    }
}

/// The key parts of a request's target, with room for `more` bytes of
/// parts to follow (credentials, keyed cookies and headers, each section
/// tagged).
pub(crate) fn target_key(req: &request::Parts, more: usize) -> KeyBuilder {
    let Target {
        scheme,
        authority,
        path,
        query,
    } = target_of(req);
    let size = uri_key_len(scheme, authority, path, query) + more;
    push_uri(
        CacheKey::builder_with_capacity(size),
        scheme,
        authority,
        path,
        query,
    )
}

/// The key parts of a target given piecewise (for invalidating a `Location`).
pub(crate) fn uri_key(
    scheme: &str,
    authority: &[u8],
    path: &str,
    query: Option<&str>,
) -> KeyBuilder {
    // Sized to the parts, so a key of the target alone needs one allocation.
    let key = CacheKey::builder_with_capacity(uri_key_len(scheme, authority, path, query));
    push_uri(key, scheme, authority, path, query)
}

/// The first two parts of every target's key (`http/v1`, `GET`), as bytes.
pub(crate) const TARGET_HEAD: &[u8] = b"\x07\x00\x00\x00http/v1\x03\x00\x00\x00GET";

fn push_uri(
    mut key: KeyBuilder,
    scheme: &str,
    authority: &[u8],
    path: &str,
    query: Option<&str>,
) -> KeyBuilder {
    key.push(b"http/v1");
    // GET and HEAD share one entry; only they are stored.
    key.push(b"GET");
    if scheme.bytes().any(|b| b.is_ascii_uppercase()) {
        key.push(scheme.to_ascii_lowercase().as_bytes());
    } else {
        key.push(scheme.as_bytes());
    }
    if authority.iter().any(u8::is_ascii_uppercase) {
        key.push(&authority.to_ascii_lowercase());
    } else {
        key.push(authority);
    }
    key.push(path.as_bytes());
    match query {
        // `/a?` and `/a` differ; the leading byte keeps them apart.
        Some(q) => key.push_concat(&[b"?", q.as_bytes()]),
        None => key.push(b""),
    }
    key
}

/// The length of [`uri_key`]'s parts: six, each with its 4-byte length.
fn uri_key_len(scheme: &str, authority: &[u8], path: &str, query: Option<&str>) -> usize {
    let parts = b"http/v1".len() + b"GET".len() + scheme.len() + authority.len() + path.len();
    6 * 4 + parts + query.map_or(0, |q| 1 + q.len())
}

/// Every cached response of `uri` (all its `Vary` variants and keyed copies
/// too): of that scheme and host when `uri` is absolute, of any when it is
/// a path (`/products/7?x=1`). For [`TieredCache::invalidate_prefix`](tiercache_core::TieredCache::invalidate_prefix).
///
/// ```
/// use http::Request;
/// use tiercache_http::key::{request_key, url_pattern};
///
/// let req = Request::get("/p/7?x=1").header("host", "shop.example").body(()).unwrap().into_parts().0;
/// assert!(url_pattern(&"/p/7?x=1".parse().unwrap()).matches(&request_key(&req)));
/// assert!(url_pattern(&"http://SHOP.example/p/7?x=1".parse().unwrap()).matches(&request_key(&req)));
/// assert!(!url_pattern(&"/p/7".parse().unwrap()).matches(&request_key(&req)));
/// assert!(!url_pattern(&"http://other.example/p/7?x=1".parse().unwrap()).matches(&request_key(&req)));
/// ```
pub fn url_pattern(uri: &Uri) -> KeyPattern {
    let query = match uri.query() {
        Some(q) => format!("?{q}"),
        None => String::new(),
    };
    origin_pattern(uri)
        .part(uri.path().as_bytes())
        .part(query.as_bytes())
}

/// Every cached response whose path starts with `uri`'s path (of that
/// scheme and host when `uri` is absolute, of any when it is a path).
///
/// ```
/// use http::Request;
/// use tiercache_http::key::{path_prefix_pattern, request_key};
///
/// let req = Request::get("/products/7").header("host", "shop.example").body(()).unwrap().into_parts().0;
/// assert!(path_prefix_pattern(&"/products/".parse().unwrap()).matches(&request_key(&req)));
/// assert!(!path_prefix_pattern(&"/users/".parse().unwrap()).matches(&request_key(&req)));
/// ```
pub fn path_prefix_pattern(uri: &Uri) -> KeyPattern {
    origin_pattern(uri).prefix(uri.path().as_bytes())
}

fn origin_pattern(uri: &Uri) -> KeyPattern {
    let pattern = KeyPattern::new().part(b"http/v1").part(b"GET");
    match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => pattern
            .part(scheme.to_ascii_lowercase().as_bytes())
            .part(authority.as_str().to_ascii_lowercase().as_bytes()),
        _ => pattern.any().any(),
    }
}

/// The parts of a URL's own key (see [`uri_key`]); a request keyed on more
/// (credentials, cookies, headers) or a `Vary` variant adds parts after them.
const URL_PARTS: usize = 6;

/// The URL key whose family `key` belongs to when `key` is not that URL key
/// itself, or when `varied` (a `Vary`ing URL's primary entry joins its
/// family too): invalidating the URL reaches the family by its tag (see
/// [`family_tag`]), whichever instance stored it. `None` for a plain URL
/// key, which is invalidated by itself.
pub(crate) fn family_of(key: &CacheKey, varied: bool) -> Option<CacheKey> {
    let url = key.first_parts(URL_PARTS)?;
    (varied || url != *key).then_some(url)
}

/// The internal tag every response stored for a URL under a key other than
/// the URL's own (its `Vary` variants, copies kept per credential, cookie or
/// header) is stored under, with a `Vary`ing URL's primary entry, so
/// invalidating the URL reaches what other instances stored too.
pub(crate) fn family_tag(primary: &CacheKey) -> Bytes {
    Bytes::from(format!("tc-url:{}", primary.hash()))
}

/// The variant a response with these headers has for this request: the
/// names in its `Vary` and a fingerprint of the request's values for them
/// (a `Vary: Authorization` or `Cookie` keeps no credential in the entry).
pub fn variant_for(response: &HeaderMap, request: &HeaderMap) -> Bytes {
    let mut names: Vec<HeaderName> = Vec::new();
    for value in response.get_all(VARY) {
        for name in value.as_bytes().split(|&b| b == b',') {
            if let Ok(name) = HeaderName::from_bytes(name.trim_ascii())
                && !names.contains(&name)
            {
                names.push(name);
            }
        }
    }
    if names.is_empty() {
        return Bytes::new();
    }
    let mut out = BytesMut::new();
    for name in &names {
        put_part(&mut out, name.as_str().as_bytes());
        put_part(&mut out, &fingerprint(&joined(request, name)));
    }
    out.freeze()
}

/// The variant `request` would have under the `Vary` names `entry` was stored
/// with: the key suffix of the entry that may answer it.
pub fn request_variant(entry: &Entry, request: &HeaderMap) -> Bytes {
    let mut rest = &entry.variant()[..];
    let mut out = BytesMut::with_capacity(rest.len());
    while !rest.is_empty() {
        let (Some(name), Some(_)) = (take_part(&mut rest), take_part(&mut rest)) else {
            break;
        };
        let Ok(name) = HeaderName::from_bytes(name) else {
            break;
        };
        put_part(&mut out, name.as_str().as_bytes());
        put_part(&mut out, &fingerprint(&joined(request, &name)));
    }
    out.freeze()
}

/// The key of the variant `variant` of the entry at `primary`.
pub fn variant_key(primary: &CacheKey, variant: &[u8]) -> CacheKey {
    primary.with_part(&[b"vary:".as_slice(), variant].concat())
}

/// Whether `entry` was stored for requests with the same `Vary`'d values as `request`.
pub fn variant_matches(entry: &Entry, request: &HeaderMap) -> bool {
    let mut rest = &entry.variant()[..];
    while !rest.is_empty() {
        let (Some(name), Some(value)) = (take_part(&mut rest), take_part(&mut rest)) else {
            return false;
        };
        let Ok(name) = HeaderName::from_bytes(name) else {
            return false;
        };
        if fingerprint(&joined(request, &name)) != value {
            return false;
        }
    }
    true
}

/// All values of `name`, joined by `", "` (RFC 9110 §5.3 field
/// combination); `Accept-Encoding` normalised first (see
/// [`normalized_accept_encoding`]). A field the request does not carry is
/// a byte no field value holds, so it never matches one carried empty
/// (RFC 9111 §4.1); for `Accept-Encoding` that also keeps a client that
/// names no coding (any is acceptable, RFC 9110 §12.5.3) apart from one
/// that refuses every coding it knows.
fn joined(headers: &HeaderMap, name: &HeaderName) -> Vec<u8> {
    if !headers.contains_key(name) {
        return vec![0];
    }
    if name == ACCEPT_ENCODING {
        return normalized_accept_encoding(headers);
    }
    let mut out = Vec::new();
    for (i, v) in headers.get_all(name).iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
    out
}

fn put_part(out: &mut BytesMut, part: &[u8]) {
    out.put_u32_le(part.len() as u32);
    out.put_slice(part);
}

pub(crate) fn take_part<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let part = rest.get(4..4 + len)?;
    *rest = &rest[4 + len..];
    Some(part)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;
    use std::time::{Duration, SystemTime};
    use tiercache_core::{Times, Value};

    #[test]
    fn every_target_key_starts_with_the_fixed_head() {
        let key = uri_key("http", b"h", "/", None).finish();
        assert!(key.full().starts_with(TARGET_HEAD));
        assert_eq!(
            &key.full()[..TARGET_HEAD.len()],
            CacheKey::builder()
                .part(b"http/v1")
                .part(b"GET")
                .finish()
                .full()
        );
    }

    #[test]
    fn a_target_key_is_built_in_an_allocation_of_its_size() {
        for (scheme, authority, path, query) in [
            ("http", &b"example.com"[..], "/p", None),
            ("HTTPS", &b"Example.COM:8443"[..], "/a/b", Some("x=1&y=2")),
            ("http", &b""[..], "/", Some("")),
        ] {
            let key = uri_key(scheme, authority, path, query).finish();
            assert_eq!(
                key.full().len(),
                uri_key_len(scheme, authority, path, query),
                "{scheme}://{authority:?}{path}?{query:?}"
            );
        }
    }

    fn parts(uri: &str, host: &str) -> request::Parts {
        Request::get(uri)
            .header("host", host)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn query_path_and_host_are_keyed() {
        let base = request_key(&parts("/a?x=1", "h"));
        assert_ne!(base, request_key(&parts("/a?x=2", "h")));
        assert_ne!(base, request_key(&parts("/a", "h")));
        assert_ne!(
            request_key(&parts("/a", "h")),
            request_key(&parts("/a?", "h"))
        );
        assert_ne!(base, request_key(&parts("/a?x=1", "h:8080")));
        assert_ne!(base, request_key(&parts("/b?x=1", "h")));
        assert_eq!(base, request_key(&parts("/a?x=1", "H")));
    }

    fn entry_with(variant: Bytes) -> Entry {
        let now = SystemTime::now();
        let t = Times::fresh(now, now);
        Entry::new(Bytes::new(), variant, Value::default(), t, Duration::ZERO)
    }

    /// Naming no coding is taking any (RFC 9110 §12.5.3): a copy stored
    /// for such a client is not for one that refuses them all.
    #[test]
    fn a_client_naming_no_coding_keys_apart_from_one_refusing_them_all() {
        let mut res = HeaderMap::new();
        res.insert(VARY, "accept-encoding".parse().unwrap());
        let entry = entry_with(variant_for(&res, &HeaderMap::new()));
        let mut refusing = HeaderMap::new();
        refusing.insert(ACCEPT_ENCODING, "gzip;q=0".parse().unwrap());
        assert!(!variant_matches(&entry, &refusing));
        assert!(variant_matches(&entry, &HeaderMap::new()));
    }

    /// A field the request does not carry is not the same as one it
    /// carries empty (RFC 9111 §4.1).
    #[test]
    fn an_absent_field_is_not_an_empty_one() {
        let mut res = HeaderMap::new();
        res.insert(VARY, "x-flag".parse().unwrap());
        let mut empty = HeaderMap::new();
        empty.insert("x-flag", "".parse().unwrap());
        let entry = entry_with(variant_for(&res, &empty));
        assert!(variant_matches(&entry, &empty));
        assert!(!variant_matches(&entry, &HeaderMap::new()));
        let entry = entry_with(variant_for(&res, &HeaderMap::new()));
        assert!(variant_matches(&entry, &HeaderMap::new()));
        assert!(!variant_matches(&entry, &empty));
    }

    #[test]
    fn variants_compare_the_named_request_headers() {
        let mut res = HeaderMap::new();
        res.insert(VARY, "Accept-Language, accept-language".parse().unwrap());
        let mut en = HeaderMap::new();
        en.insert("accept-language", "en".parse().unwrap());
        let mut fr = HeaderMap::new();
        fr.insert("accept-language", "fr".parse().unwrap());
        let entry = entry_with(variant_for(&res, &en));
        assert!(variant_matches(&entry, &en));
        assert!(!variant_matches(&entry, &fr));
        assert!(!variant_matches(&entry, &HeaderMap::new()));
        assert!(variant_matches(&entry_with(Bytes::new()), &fr));
    }
}
