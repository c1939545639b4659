use super::*;

/// A map whose last fields are not the cache's own (in whatever order
/// the `http` crate iterates) gets them set by name, and no other field
/// is touched.
#[test]
fn own_fields_never_land_on_another_field() {
    let own = || {
        [
            Some(HeaderValue::from_static("7")),
            Some(HeaderValue::from_static("HIT")),
            Some(HeaderValue::from_static("l1")),
            Some(HeaderValue::from_static("0.5000")),
            Some(HeaderValue::from_static("tiercache; hit")),
        ]
    };
    let placeholder = HeaderValue::from_static("");
    // The view's shape, with one field appended after the placeholders.
    let mut shifted = HeaderMap::new();
    shifted.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    for name in &OWN_FIELDS {
        shifted.insert(name.clone(), placeholder.clone());
    }
    shifted.insert(ETAG, HeaderValue::from_static("\"v1\""));
    // Too short to hold the placeholders at all.
    let mut short = HeaderMap::new();
    short.insert(ETAG, HeaderValue::from_static("\"v1\""));
    for mut map in [shifted, short] {
        set_own_fields(&mut map, own());
        assert_eq!(map[ETAG], "\"v1\"");
        assert_eq!(map[AGE], "7");
        assert_eq!(map[X_CACHE], "HIT");
        assert_eq!(map[X_CACHE_TIER], "l1");
        assert_eq!(map[X_CACHE_HIT_RATIO], "0.5000");
        assert_eq!(map[CACHE_STATUS], "tiercache; hit");
    }
}

#[test]
fn cache_status_forms() {
    let hit = Outcome::Hit {
        tier: Source::L1,
        ttl: 37,
        collapsed: false,
    };
    assert_eq!(hit.cache_status(), "tiercache; hit; ttl=37; detail=l1");
    let miss = Outcome::Miss {
        stored: true,
        reason: None,
        collapsed: false,
        l2_down: false,
    };
    assert_eq!(miss.cache_status(), "tiercache; fwd=miss; stored");
    let down = Outcome::Miss {
        stored: true,
        reason: None,
        collapsed: false,
        l2_down: true,
    };
    assert_eq!(
        down.cache_status(),
        "tiercache; fwd=miss; stored; detail=l2-down"
    );
    assert_eq!(
        Outcome::Bypass(Reason::Authorization).cache_status(),
        "tiercache; fwd=bypass; detail=authorization"
    );
}

#[test]
fn accept_encoding_weights() {
    let req = |v: &str| {
        let mut h = HeaderMap::new();
        h.insert(ACCEPT_ENCODING, v.parse().unwrap());
        h
    };
    assert!(accepts_encoding(&req("gzip, br"), b"gzip"));
    assert!(accepts_encoding(&req("br;q=1, GZIP;q=0.5"), b"gzip"));
    assert!(!accepts_encoding(&req("gzip;q=0, br"), b"gzip"));
    assert!(accepts_encoding(&req("*"), b"br"));
    assert!(!accepts_encoding(&req("*, br;q=0"), b"br"));
    assert!(accepts_encoding(&req("x-gzip"), b"gzip"));
    assert!(!accepts_encoding(&req("identity"), b"gzip"));
    assert!(!accepts_encoding(&HeaderMap::new(), b"gzip"));
}

#[test]
fn connection_listed_fields_are_stripped() {
    let mut h = HeaderMap::new();
    h.insert("connection", "x-secret, close".parse().unwrap());
    h.insert("x-secret", "1".parse().unwrap());
    h.insert("transfer-encoding", "chunked".parse().unwrap());
    h.insert("etag", "\"a\"".parse().unwrap());
    strip_hop_by_hop(&mut h);
    assert_eq!(h.len(), 1);
    assert!(h.contains_key("etag"));
}

#[test]
fn proxy_specific_fields_are_never_stored() {
    let mut h = HeaderMap::new();
    h.insert(
        "proxy-authentication-info",
        HeaderValue::from_static("nextnonce=\"abc\""),
    );
    h.insert("proxy-authenticate", HeaderValue::from_static("Basic"));
    h.insert("content-type", HeaderValue::from_static("text/plain"));
    let stored = to_value(StatusCode::OK, &h, Bytes::from_static(b"x"));
    let names: Vec<&[u8]> = stored.headers.iter().map(|(n, _)| n.as_ref()).collect();
    assert_eq!(names, vec![&b"content-type"[..]]);
}
