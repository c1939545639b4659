use super::*;
use bytes::Bytes;

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
    // Stale while revalidating: answered from the cache, a hit; stale
    // because the origin failed: forwarded.
    let stale = |detail| Outcome::Stale {
        tier: Source::L2,
        ttl: -3,
        collapsed: false,
        detail,
    };
    assert_eq!(
        stale(None).cache_status(),
        "tiercache; hit; ttl=-3; detail=l2"
    );
    let followed = Outcome::Stale {
        tier: Source::L2,
        ttl: -3,
        collapsed: true,
        detail: None,
    };
    assert_eq!(
        followed.cache_status(),
        "tiercache; hit; ttl=-3; detail=l2; collapsed"
    );
    assert_eq!(
        stale(Some("origin-error")).cache_status(),
        "tiercache; fwd=stale; detail=origin-error"
    );
}

#[test]
fn a_stale_copys_ttl_is_negative_and_rounded_away_from_zero() {
    let fresh_until = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(100);
    let at = |ms: u64| fresh_until + std::time::Duration::from_millis(ms);
    assert_eq!(super::stale_ttl(fresh_until, at(0)), 0);
    assert_eq!(super::stale_ttl(fresh_until, at(400)), -1);
    assert_eq!(super::stale_ttl(fresh_until, at(2000)), -2);
    assert_eq!(super::stale_ttl(fresh_until, at(2001)), -3);
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

/// A plain L1 hit's head is kept per thread (see `labelled`): whatever was
/// kept, each response is the one its own entry, age, ttl and hit ratio
/// build, as a response built without the table would be.
#[test]
fn a_kept_head_answers_only_its_own_entry_and_values() {
    use std::time::Duration;
    use tiercache_core::{Times, Value};

    let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let entry = |version: &'static str| {
        let value = Value {
            status: 200,
            headers: vec![("x-version".into(), version.into())],
            body: "body".into(),
        };
        let times = Times::fresh(created, created + Duration::from_secs(600));
        Entry::new("k".into(), Bytes::new(), value, times, Duration::ZERO)
    };
    let respond = |entry: &Entry, age: u64, ttl: u64, ratio: f64| {
        let view = view(entry, &[]);
        let now = created + Duration::from_secs(age);
        let outcome = Outcome::Hit {
            tier: Source::L1,
            ttl,
            collapsed: false,
        };
        from_entry::<()>(entry, &view, now, false, false, Some((&outcome, ratio)))
    };
    let (old, new) = (entry("old"), entry("new"));
    // Each case three times: built, built and kept, then from the table.
    for (entry, version, age, ttl, ratio) in [
        (&old, "old", 5, 595, 0.5),
        (&new, "new", 5, 595, 0.5),
        (&old, "old", 6, 595, 0.5),
        (&old, "old", 6, 594, 0.5),
        (&old, "old", 6, 594, 0.75),
        (&new, "new", 6, 594, 0.75),
    ] {
        for round in 0..3 {
            let res = respond(entry, age, ttl, ratio);
            let h = res.headers();
            let case = format!("{version} age {age} ttl {ttl} ratio {ratio}, round {round}");
            assert_eq!(h["x-version"], version, "{case}");
            assert_eq!(h[AGE], age.to_string().as_str(), "{case}");
            assert_eq!(h[X_CACHE], "HIT", "{case}");
            assert_eq!(h[X_CACHE_TIER], "l1", "{case}");
            assert_eq!(
                h[X_CACHE_HIT_RATIO],
                format!("{ratio:.4}").as_str(),
                "{case}"
            );
            assert_eq!(
                h[CACHE_STATUS],
                format!("tiercache; hit; ttl={ttl}; detail=l1").as_str(),
                "{case}"
            );
            assert_eq!(h.get_all(X_CACHE).iter().count(), 1, "{case}");
        }
    }
    // With a head kept for these values: a HEAD gets it and no body, a
    // matching validator a 304 of its own fields.
    let outcome = Outcome::Hit {
        tier: Source::L1,
        ttl: 594,
        collapsed: false,
    };
    let now = created + Duration::from_secs(6);
    let view = view(&new, &[]);
    let label = Some((&outcome, 0.75));
    let head = from_entry::<http_body_util::Empty<Bytes>>(&new, &view, now, true, false, label);
    assert_eq!(head.status(), StatusCode::OK);
    assert_eq!(head.headers()["x-version"], "new");
    assert_eq!(head.headers()[AGE], "6");
    assert_eq!(head.headers()[http::header::CONTENT_LENGTH], "4");
    assert_eq!(http_body::Body::size_hint(head.body()).exact(), Some(0));
    let not_modified = from_entry::<()>(&new, &view, now, false, true, label);
    assert_eq!(not_modified.status(), StatusCode::NOT_MODIFIED);
    assert!(not_modified.headers().get("x-version").is_none());
    assert!(
        not_modified
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .is_none()
    );
    assert_eq!(not_modified.headers()[AGE], "6");
    assert_eq!(not_modified.headers()[X_CACHE], "HIT");
}

/// `If-Modified-Since` against a stored response without `Last-Modified`
/// is weighed against its `Date`, else the time it was stored (RFC 9111
/// §4.3.2): a client whose copy is that recent gets a 304.
#[test]
fn if_modified_since_without_last_modified_weighs_the_stored_date() {
    use std::time::Duration;
    use tiercache_core::{Times, Value};

    let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let stored = |date: Option<SystemTime>, created: SystemTime| {
        let headers = date
            .map(|d| ("date".into(), crate::freshness::format_http_date(d).into()))
            .into_iter()
            .collect();
        let value = Value {
            status: 200,
            headers,
            body: "body".into(),
        };
        let times = Times::fresh(created, created + Duration::from_secs(60));
        Entry::new("k".into(), Bytes::new(), value, times, Duration::ZERO)
    };
    let since = |at: SystemTime| {
        let mut h = HeaderMap::new();
        let v = crate::freshness::format_http_date(at);
        h.insert(http::header::IF_MODIFIED_SINCE, v.parse().unwrap());
        crate::request::Conditional::take(&mut h)
    };
    let second = Duration::from_secs(1);
    // With a Date (stored a little after it).
    let dated = stored(Some(t), t + 3 * second);
    assert!(view(&dated, &[]).not_modified(&since(t)));
    assert!(view(&dated, &[]).not_modified(&since(t + second)));
    assert!(!view(&dated, &[]).not_modified(&since(t - second)));
    // Without one: the time it was stored.
    let undated = stored(None, t);
    assert!(view(&undated, &[]).not_modified(&since(t)));
    assert!(!view(&undated, &[]).not_modified(&since(t - second)));
}
