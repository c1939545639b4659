//! Properties of the parsers that read what any client or origin sends:
//! `Cache-Control` (and its targeted fields), HTTP dates, `Accept-Encoding`
//! and the request key. Beyond "no panic": a directive hidden in another's
//! quoted argument is never seen, dates round-trip and malformed ones are
//! refused, normalisation is order- and case-blind, and two different
//! requests never build the same key.
//!
//! Longer: `PROPTEST_CASES=100000 cargo test -p tiercache-http --test parser_props --release`.

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue, Request};
use proptest::prelude::*;
use tiercache_http::cache_control::{directive_value, directives, has_directive, targeted};
use tiercache_http::freshness::{OriginFreshness, format_http_date, parse_http_date};
use tiercache_http::key::{normalized_accept_encoding, request_key};
use tiercache_http::range::{ByteRange, parse_range};

fn token() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-z][a-z0-9-]{0,10}").unwrap()
}

/// A quoted-string argument that hides commas, `=` and other directives.
fn quoted() -> impl Strategy<Value = String> {
    proptest::string::string_regex(r#"[a-z0-9 ,=-]{0,20}"#)
        .unwrap()
        .prop_map(|s| format!("\"{s}\""))
}

proptest! {
    #[test]
    fn cache_control_sees_its_directives_and_nothing_inside_quotes(
        list in proptest::collection::vec((token(), prop::option::of(prop_oneof![token(), quoted()])), 0..6),
        hidden in token(),
    ) {
        let text = list
            .iter()
            .map(|(n, v)| match v { Some(v) => format!("{n}={v}"), None => n.clone() })
            .chain(std::iter::once(format!("zz-hide=\"a, {hidden}, b\"")))
            .collect::<Vec<_>>()
            .join(", ");
        let mut h = HeaderMap::new();
        h.insert("cache-control", HeaderValue::from_str(&text).unwrap());
        let seen: Vec<String> = directives(text.as_bytes())
            .map(|d| String::from_utf8_lossy(d).into_owned())
            .collect();
        let mut expected: Vec<String> = list.iter().map(|(n, _)| n.clone()).collect();
        expected.push("zz-hide".into());
        prop_assert_eq!(&seen, &expected);
        if hidden != "zz-hide" && !list.iter().any(|(n, _)| n == &hidden) {
            prop_assert!(!has_directive(&h, &hidden), "{} found in a quoted argument of {}", hidden, text);
        }
        for (n, v) in &list {
            if list.iter().find(|(m, _)| m == n).map(|(_, v)| v) == Some(v) && let Some(v) = v {
                prop_assert_eq!(directive_value(&h, n), Some(v.trim_matches('"').to_owned()));
            }
        }
    }

    #[test]
    fn any_bytes_in_cache_control_or_a_targeted_field_never_panic(
        cc in proptest::collection::vec(0x20u8..0x7f, 0..80),
        target in proptest::collection::vec(0x20u8..0x7f, 0..80),
    ) {
        let mut h = HeaderMap::new();
        h.insert("cache-control", HeaderValue::from_bytes(&cc).unwrap());
        h.insert("cdn-cache-control", HeaderValue::from_bytes(&target).unwrap());
        let cdn = [HeaderName::from_static("cdn-cache-control")];
        let t = targeted(&h, &cdn);
        let _ = OriginFreshness::parse(&t, UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        // A targeted field that stands in is always valid Cache-Control.
        if let std::borrow::Cow::Owned(map) = &t
            && let Some(v) = map.get("cache-control")
        {
            for d in directives(v.as_bytes()) {
                prop_assert!(d.iter().all(|b| b.is_ascii_graphic()));
            }
        }
    }

    #[test]
    fn dates_round_trip_and_malformed_ones_are_refused(secs in 0u64..253_402_300_799, cut in 1usize..29, junk in 0x20u8..0x7f) {
        let t = UNIX_EPOCH + Duration::from_secs(secs);
        let text = format_http_date(t);
        prop_assert_eq!(parse_http_date(&text), Some(t));
        // The IMF-fixdate grammar is fixed-width: a character removed,
        // or a doubled space, is no date.
        let mut short = text.clone();
        short.remove(cut);
        prop_assert_eq!(parse_http_date(&short), None, "{}", short);
        let doubled = text.replacen(' ', "  ", 1);
        prop_assert_eq!(parse_http_date(&doubled), None);
        let mut changed = text.into_bytes();
        changed[cut] = junk;
        // Any single change is refused, or is still the same kind of date.
        if let Ok(changed) = String::from_utf8(changed) && let Some(other) = parse_http_date(&changed) {
            prop_assert_eq!(format_http_date(other).len(), 29);
        }
    }

    #[test]
    fn accept_encoding_normalises_order_case_and_junk(
        codings in proptest::collection::vec(prop_oneof![
            Just("gzip"), Just("br"), Just("zstd"), Just("deflate"), Just("x-junk"), Just("identity")
        ], 0..6),
        upper in any::<bool>(),
    ) {
        let list = codings.join(", ");
        let mut reversed = codings.clone();
        reversed.reverse();
        let other = reversed.join(",");
        let other = if upper { other.to_ascii_uppercase() } else { other };
        let a = headers("accept-encoding", &list);
        let b = headers("accept-encoding", &other);
        prop_assert_eq!(normalized_accept_encoding(&a), normalized_accept_encoding(&b));
        let normal = String::from_utf8(normalized_accept_encoding(&a)).unwrap();
        prop_assert!(!normal.contains("junk") && !normal.contains("identity"));
    }

    #[test]
    fn different_requests_never_share_a_key(
        a in ("[a-z]{1,6}(\\.[a-z]{1,4})?(:[0-9]{1,4})?", "/[a-z0-9/{}%._-]{0,12}", prop::option::of("[a-z0-9=&{}]{0,8}")),
        b in ("[a-z]{1,6}(\\.[a-z]{1,4})?(:[0-9]{1,4})?", "/[a-z0-9/{}%._-]{0,12}", prop::option::of("[a-z0-9=&{}]{0,8}")),
    ) {
        let key = |(host, path, query): &(String, String, Option<String>)| {
            let uri = match query { Some(q) => format!("{path}?{q}"), None => path.clone() };
            let req = Request::get(uri).header("host", host.as_str()).body(()).unwrap();
            request_key(&req.into_parts().0)
        };
        prop_assert_eq!(a == b, key(&a) == key(&b));
    }
}

proptest! {
    #[test]
    fn ranges_parse_exactly_the_grammar(a in 0u64..1_000_000, b in 0u64..1_000_000, junk in "[ -~]{0,16}") {
        prop_assert_eq!(parse_range(&format!("bytes={a}-{b}")), (a <= b).then_some(ByteRange::FromTo(a, b)));
        prop_assert_eq!(parse_range(&format!("bytes={a}-")), Some(ByteRange::From(a)));
        prop_assert_eq!(parse_range(&format!("bytes=-{b}")), (b > 0).then_some(ByteRange::Last(b)));
        // Several ranges, other units, signs and junk are never one range.
        prop_assert_eq!(parse_range(&format!("bytes={a}-{b},{a}-")), None);
        prop_assert_eq!(parse_range(&format!("items={a}-{b}")), None);
        prop_assert_eq!(parse_range(&format!("bytes=+{a}-{b}")), None);
        if let Some(r) = parse_range(&junk) {
            let text = match r {
                ByteRange::FromTo(x, y) => format!("{x}-{y}"),
                ByteRange::From(x) => format!("{x}-"),
                ByteRange::Last(n) => format!("-{n}"),
            };
            prop_assert!(junk.trim().starts_with("bytes="), "{junk} -> {text}");
        }
    }
}

fn headers(name: &'static str, value: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(name, HeaderValue::from_str(value).unwrap());
    h
}
