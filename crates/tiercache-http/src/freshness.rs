//! What the origin says about a response's lifetime (RFC 9111 §4.2, RFC 5861).

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use http::header::{AGE, DATE, EXPIRES};

use crate::cache_control::has_directive;

/// The freshness information in a response's headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OriginFreshness {
    /// The declared lifetime (`s-maxage` > `max-age` > `Expires` − `Date`), if any.
    pub lifetime: Option<Duration>,
    /// The `Age` the origin (or a cache before it) reported.
    pub age: Duration,
    /// `stale-while-revalidate=N`.
    pub stale_while_revalidate: Option<Duration>,
    /// `stale-if-error=N`.
    pub stale_if_error: Option<Duration>,
    /// `must-revalidate`, `proxy-revalidate` or `no-cache`: never serve it stale.
    pub no_stale: bool,
}

impl OriginFreshness {
    /// Reads `headers` as of `now` (the fallback when `Date` is missing).
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use http::HeaderMap;
    /// use tiercache_http::freshness::OriginFreshness;
    ///
    /// let mut h = HeaderMap::new();
    /// h.insert("cache-control", "max-age=60, s-maxage=30, stale-if-error=600".parse().unwrap());
    /// h.insert("age", "10".parse().unwrap());
    /// let f = OriginFreshness::parse(&h, SystemTime::now());
    /// assert_eq!(f.lifetime, Some(Duration::from_secs(30)));
    /// assert_eq!(f.remaining(), Some(Duration::from_secs(20)));
    /// assert_eq!(f.stale_if_error, Some(Duration::from_secs(600)));
    /// ```
    pub fn parse(headers: &HeaderMap, now: SystemTime) -> Self {
        let seconds = |name: &str| directive_seconds(headers, name);
        let lifetime = seconds("s-maxage")
            .or_else(|| seconds("max-age"))
            .or_else(|| expires_lifetime(headers, now));
        Self {
            lifetime,
            age: age(headers),
            stale_while_revalidate: seconds("stale-while-revalidate"),
            stale_if_error: seconds("stale-if-error"),
            // `s-maxage` implies `proxy-revalidate` for a shared cache
            // (RFC 9111 §5.2.2.10): never served stale.
            no_stale: has_directive(headers, "must-revalidate")
                || has_directive(headers, "proxy-revalidate")
                || has_directive(headers, "no-cache")
                || has_directive(headers, "s-maxage"),
        }
    }

    /// What is left of the declared lifetime after the reported age.
    pub fn remaining(&self) -> Option<Duration> {
        self.lifetime.map(|l| l.saturating_sub(self.age))
    }
}

/// `Age` (RFC 9111 §5.1): of a list, the first member; an invalid value is
/// ignored.
fn age(headers: &HeaderMap) -> Duration {
    headers
        .get(AGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .and_then(delta_seconds)
        .map(|s| Duration::from_secs(s.min(365 * 24 * 3600 * 10)))
        .unwrap_or_default()
}

/// `name=N` in `Cache-Control`, in seconds (the first occurrence, found
/// outside quoted strings; a bad value reads as 0, RFC 9111 §4.2.1's
/// "invalid is stale").
fn directive_seconds(headers: &HeaderMap, name: &str) -> Option<Duration> {
    let arg = crate::cache_control::directive_value(headers, name)?;
    let secs = delta_seconds(&arg).unwrap_or(0).min(365 * 24 * 3600);
    Some(Duration::from_secs(secs))
}

/// RFC 9111 §1.2.2 delta-seconds: one or more digits (no sign, no space
/// inside), `None` otherwise; a value too large to represent is the
/// largest there is, not an error.
fn delta_seconds(text: &str) -> Option<u64> {
    let digits = text.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(digits.parse().unwrap_or(u64::MAX))
}

fn expires_lifetime(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let mut all = headers.get_all(EXPIRES).iter();
    let expires = all.next()?;
    // An invalid Expires (e.g. "0", a malformed date, or more than one
    // field) means already expired (RFC 9111 §5.3).
    if all.next().is_some() {
        return Some(Duration::ZERO);
    }
    let Some(expires) = expires.to_str().ok().and_then(parse_http_date) else {
        return Some(Duration::ZERO);
    };
    let date = headers
        .get(DATE)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_http_date)
        .unwrap_or(now);
    Some(expires.duration_since(date).unwrap_or_default())
}

/// Parses an HTTP date (RFC 9110 §5.6.7): the IMF-fixdate senders must
/// use (`Sun, 06 Nov 1994 08:49:37 GMT`), and the obsolete RFC 850
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime (`Sun Nov  6 08:49:37
/// 1994`) forms recipients must accept; names in any letter case, and a
/// weekday that is not the date's (only the date counts; not in an RFC 850
/// date, whose two-digit year leaves the weekday the only word on the
/// century), as nginx, Squid and Traffic Server read them. Anything else
/// (another zone, a missing comma, doubled spaces, a one-digit hour) is
/// not a date. The one parser of the crate (`httpdate`, which is strict
/// about both).
pub fn parse_http_date(text: &str) -> Option<SystemTime> {
    let text = text.trim();
    httpdate::parse_http_date(text)
        .ok()
        .or_else(|| leniently(text))
}

const WEEKDAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];

/// A date the strict parser refused, with its names in their canonical
/// case and, if it names a weekday that is not its date's, the right one
/// (found by trying each: only a date that parses with one of them).
fn leniently(text: &str) -> Option<SystemTime> {
    if !text.is_ascii() || text.len() > 40 {
        return None;
    }
    let cased = canonical_case(text);
    // The weekday: before the comma (IMF-fixdate, RFC 850), else the
    // first three letters (asctime).
    let (weekday, rest) = cased.split_at(cased.find(',').unwrap_or(3.min(cased.len())));
    // Not in an RFC 850 date (a long weekday): its two-digit year leaves
    // the weekday the only word on the century (`Wednesday, 01-Jan-69`
    // means 1969, read as 2069 it would be fresh for decades).
    if !WEEKDAYS.contains(&weekday) {
        return httpdate::parse_http_date(&cased).ok();
    }
    WEEKDAYS
        .iter()
        .find_map(|name| httpdate::parse_http_date(&format!("{name}{rest}")).ok())
}

/// `text` with each run of letters capitalised (`thu` → `Thu`, `AUG` →
/// `Aug`), the zone that ends it in capitals (`GMT`).
fn canonical_case(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_word = false;
    for c in text.chars() {
        out.push(if in_word {
            c.to_ascii_lowercase()
        } else {
            c.to_ascii_uppercase()
        });
        in_word = c.is_ascii_alphabetic();
    }
    match out.strip_suffix("Gmt") {
        Some(date) => format!("{date}GMT"),
        None => out,
    }
}

/// Formats `t` as an IMF-fixdate.
pub fn format_http_date(t: SystemTime) -> String {
    httpdate::fmt_http_date(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn precedence_and_age() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        let f = OriginFreshness::parse(&headers(&[("cache-control", "max-age=60")]), now);
        assert_eq!(f.lifetime, Some(Duration::from_secs(60)));
        let f = OriginFreshness::parse(
            &headers(&[
                ("expires", "Sun, 06 Nov 1994 08:50:37 GMT"),
                ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ]),
            now,
        );
        assert_eq!(f.lifetime, Some(Duration::from_secs(60)));
        let f = OriginFreshness::parse(
            &headers(&[
                ("expires", "Sun, 06 Nov 1994 08:50:37 GMT"),
                ("cache-control", "max-age=5"),
            ]),
            now,
        );
        assert_eq!(
            f.lifetime,
            Some(Duration::from_secs(5)),
            "max-age beats Expires"
        );
        let f = OriginFreshness::parse(&headers(&[("expires", "0")]), now);
        assert_eq!(f.lifetime, Some(Duration::ZERO));
        let f = OriginFreshness::parse(
            &headers(&[("cache-control", "max-age=10"), ("age", "30")]),
            now,
        );
        assert_eq!(f.remaining(), Some(Duration::ZERO));
        let f = OriginFreshness::parse(
            &headers(&[("cache-control", "public, Must-Revalidate")]),
            now,
        );
        assert!(f.no_stale && f.lifetime.is_none());
    }

    #[test]
    fn invalid_expires_and_age_lists() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        let date = ("date", "Sun, 06 Nov 1994 08:49:37 GMT");
        // Two Expires fields, or a malformed one: already expired.
        for expires in [
            &[
                ("expires", "Sun, 06 Nov 1994 09:49:37 GMT"),
                ("expires", "Sun, 06 Nov 1994 09:49:37 GMT"),
            ][..],
            &[("expires", "Sun 06 Nov 1994 09:49:37 GMT")][..],
        ] {
            let mut pairs = expires.to_vec();
            pairs.push(date);
            let f = OriginFreshness::parse(&headers(&pairs), now);
            assert_eq!(f.lifetime, Some(Duration::ZERO), "{pairs:?}");
        }
        // An obsolete-form Expires is a date.
        let f = OriginFreshness::parse(
            &headers(&[("expires", "Sunday, 06-Nov-94 09:49:37 GMT"), date]),
            now,
        );
        assert_eq!(f.lifetime, Some(Duration::from_secs(3600)));
        // `Age: 7200, 0`: the first member counts.
        let f = OriginFreshness::parse(
            &headers(&[("cache-control", "max-age=3600"), ("age", "7200, 0")]),
            now,
        );
        assert_eq!(f.remaining(), Some(Duration::ZERO));
        // A directive inside another's quoted argument is not a directive.
        let f = OriginFreshness::parse(
            &headers(&[("cache-control", "no-cache=\"x, max-age=999\", max-age=10")]),
            now,
        );
        assert_eq!(f.lifetime, Some(Duration::from_secs(10)));
        // s-maxage forbids stale answers in a shared cache.
        let f = OriginFreshness::parse(
            &headers(&[("cache-control", "s-maxage=60, stale-if-error=600")]),
            now,
        );
        assert!(f.no_stale);
    }

    /// Delta-seconds are digits alone (RFC 9111 §1.2.2): a value too large
    /// to represent is the largest (so a huge `Age` is stale, a huge
    /// `max-age` a long lifetime, not none); a sign makes it invalid.
    #[test]
    fn delta_seconds_are_digits_and_saturate() {
        let now = SystemTime::now();
        let year = Duration::from_secs(365 * 24 * 3600);
        let f = |pairs: &[(&str, &str)]| OriginFreshness::parse(&headers(pairs), now);
        let huge = "99999999999999999999";
        let max_age = format!("max-age={huge}");
        assert_eq!(f(&[("cache-control", &max_age)]).lifetime, Some(year));
        let stale = f(&[("cache-control", "max-age=3600"), ("age", huge)]);
        assert_eq!(
            stale.remaining(),
            Some(Duration::ZERO),
            "a huge Age is stale"
        );
        assert_eq!(
            f(&[("cache-control", "max-age=+60")]).lifetime,
            Some(Duration::ZERO),
            "a signed max-age is invalid: stale"
        );
        let signed_age = f(&[("cache-control", "max-age=60"), ("age", "+30")]);
        assert_eq!(
            signed_age.remaining(),
            Some(Duration::from_secs(60)),
            "ignored"
        );
        let swr = format!("max-age=1, stale-while-revalidate={huge}");
        assert_eq!(
            f(&[("cache-control", &swr)]).stale_while_revalidate,
            Some(year)
        );
    }

    /// With a valid targeted field, `Cache-Control` and `Expires` are both
    /// ignored (RFC 9213 §2.2): a far `Expires` lends no lifetime.
    #[test]
    fn a_targeted_field_sets_expires_aside_too() {
        let now = SystemTime::now();
        let far = format_http_date(now + Duration::from_secs(365 * 24 * 3600));
        let past = format_http_date(now - Duration::from_secs(60));
        let cdn = [http::HeaderName::from_static("cdn-cache-control")];
        for expires in [far, past] {
            let h = headers(&[
                ("cdn-cache-control", "public"),
                ("cache-control", "max-age=10"),
                ("expires", &expires),
            ]);
            let targeted = crate::cache_control::targeted(&h, &cdn);
            assert_eq!(
                OriginFreshness::parse(&targeted, now).lifetime,
                None,
                "{expires}"
            );
        }
    }

    #[test]
    fn http_dates_round_trip() {
        let t = parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs(),
            784_111_777
        );
        assert_eq!(format_http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
        // The obsolete forms recipients must accept (RFC 9110 §5.6.7).
        assert_eq!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"), Some(t));
        assert_eq!(parse_http_date("Sun Nov  6 08:49:37 1994"), Some(t));
        // Malformed IMF-fixdates are not dates.
        for bad in [
            "Sun 06 Nov 1994 08:49:37 GMT",
            "Sun,  06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 8:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:37",
            "0",
        ] {
            assert!(parse_http_date(bad).is_none(), "{bad}");
        }
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_233_063);
        assert_eq!(parse_http_date(&format_http_date(now)), Some(now));
    }

    /// Names in another letter case and a weekday that is not the date's
    /// are read as meant (the cache test suite's optimal cases, which
    /// nginx, Squid and Traffic Server pass); every form the suite requires
    /// to be refused still is.
    #[test]
    fn dates_with_odd_case_or_a_wrong_weekday_are_read_as_meant() {
        let t = parse_http_date("Thu, 18 Aug 2050 02:01:18 GMT").unwrap();
        for odd in [
            "THU, 18 Aug 2050 02:01:18 GMT",
            "Thu, 18 AUG 2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02:01:18 gMT",
            "thursday, 18-aug-50 02:01:18 gmt",
            "Mon, 18 Aug 2050 02:01:18 GMT",
            "Sun Aug 18 02:01:18 2050",
        ] {
            assert_eq!(parse_http_date(odd), Some(t), "{odd}");
        }
        // The suite's own asctime case names the wrong weekday for its date.
        assert_eq!(
            parse_http_date("Thu Aug  8 02:01:18 2050"),
            Some(t - Duration::from_secs(10 * 24 * 3600))
        );
        for bad in [
            "Thu, 18 Aug 2050 02:01:18 UTC",
            "Thu, 18 Aug 2050 02:01:18 AEST",
            "Thu, 18 Aug 50 02:01:18 GMT",
            "Thu 18 Aug 2050 02:01:18 GMT",
            "Thu, 18  Aug  2050 02:01:18 GMT",
            "Thu, 18-Aug-2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02.01.18 GMT",
            "Thu, 18 Aug 2050 2:01:18 GMT",
            "Xyz, 18 Aug 2050 02:01:18 GMT",
            // An RFC 850 date's weekday is the only word on its century.
            "Monday, 18-Aug-50 02:01:18 GMT",
            "Wednesday, 01-Jan-69 00:00:00 GMT",
            "Thu, 31 Feb 2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02:01:18 GMT\u{e9}",
        ] {
            assert!(parse_http_date(bad).is_none(), "{bad}");
        }
    }
}
