//! What the origin says about a response's lifetime (RFC 9111 §4.2, RFC 5861).

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use http::header::{AGE, CACHE_CONTROL, DATE, EXPIRES};

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
            age: headers
                .get(AGE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs)
                .unwrap_or_default(),
            stale_while_revalidate: seconds("stale-while-revalidate"),
            stale_if_error: seconds("stale-if-error"),
            no_stale: has_directive(headers, "must-revalidate")
                || has_directive(headers, "proxy-revalidate")
                || has_directive(headers, "no-cache"),
        }
    }

    /// What is left of the declared lifetime after the reported age.
    pub fn remaining(&self) -> Option<Duration> {
        self.lifetime.map(|l| l.saturating_sub(self.age))
    }
}

/// `name=N` in `Cache-Control`, in seconds (the first occurrence; a bad
/// value reads as 0, RFC 9111 §4.2.1's "invalid is stale").
fn directive_seconds(headers: &HeaderMap, name: &str) -> Option<Duration> {
    for value in headers.get_all(CACHE_CONTROL) {
        let Ok(text) = value.to_str() else { continue };
        for item in text.split(',') {
            let mut parts = item.splitn(2, '=');
            let key = parts.next().unwrap_or("").trim();
            if key.eq_ignore_ascii_case(name) {
                let arg = parts.next().unwrap_or("").trim().trim_matches('"');
                let secs = arg.parse::<u64>().unwrap_or(0).min(365 * 24 * 3600);
                return Some(Duration::from_secs(secs));
            }
        }
    }
    None
}

fn expires_lifetime(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let expires = headers.get(EXPIRES)?;
    // An invalid Expires (e.g. "0") means already expired.
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

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the form RFC 9110
/// requires senders to use.
pub fn parse_http_date(text: &str) -> Option<SystemTime> {
    let mut it = text.trim().split_ascii_whitespace();
    let _weekday = it.next()?;
    let day: u64 = it.next()?.parse().ok()?;
    let month = match it.next()? {
        "Jan" => 1,
        "Feb" => 2,
        "Mar" => 3,
        "Apr" => 4,
        "May" => 5,
        "Jun" => 6,
        "Jul" => 7,
        "Aug" => 8,
        "Sep" => 9,
        "Oct" => 10,
        "Nov" => 11,
        "Dec" => 12,
        _ => return None,
    };
    let year: i64 = it.next()?.parse().ok()?;
    let mut hms = it.next()?.split(':').map(|p| p.parse::<u64>().ok());
    let (h, m, s) = (hms.next()??, hms.next()??, hms.next()??);
    if it.next()? != "GMT" || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day as i64);
    let secs = days.checked_mul(86_400)? + (h * 3600 + m * 60 + s) as i64;
    u64::try_from(secs)
        .ok()
        .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
}

/// Formats `t` as an IMF-fixdate.
pub fn format_http_date(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, mo, d) = civil_from_days(days);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][days.rem_euclid(7) as usize];
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][(mo - 1) as usize];
    format!(
        "{weekday}, {d:02} {month} {y} {:02}:{:02}:{:02} GMT",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

// Howard Hinnant's days-from-civil and its inverse.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
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
    fn http_dates_round_trip() {
        let t = parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs(),
            784_111_777
        );
        assert_eq!(format_http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT").is_none());
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_233_063);
        assert_eq!(parse_http_date(&format_http_date(now)), Some(now));
    }
}
