//! Single byte ranges (RFC 9110 §14), answered from a stored full response.
//!
//! A GET with one `Range: bytes=…` is cached like any GET: the origin is
//! asked for the whole representation (within `max_body`), which is stored,
//! and the range is cut from it: `206` with `Content-Range`, or `416` when
//! it cannot be satisfied. `If-Range` is honoured (a strong `ETag` match, or
//! an exact `Last-Modified`; otherwise the whole `200`). Several ranges in
//! one request bypass the cache.

use std::time::SystemTime;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_RANGE, DATE, ETAG, IF_RANGE, LAST_MODIFIED, RANGE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::body::CacheBody;
use crate::freshness::parse_http_date;

/// One byte range asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteRange {
    /// `first-last` (`last` may be past the end).
    FromTo(u64, u64),
    /// `first-`: from `first` to the end.
    From(u64),
    /// `-n`: the last `n` bytes.
    Last(u64),
}

/// What a request's `Range` asks of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeAsk {
    range: ByteRange,
    /// The `If-Range` validator, if any.
    if_range: Option<Vec<u8>>,
    /// The fields as sent, for a request that goes to the origin alone.
    sent: (HeaderValue, Option<HeaderValue>),
}

/// Parses a `Range` field value: `Some` for exactly one valid byte range,
/// `None` for anything else (several ranges, another unit, a malformed one).
///
/// ```
/// use tiercache_http::range::{ByteRange, parse_range};
///
/// assert_eq!(parse_range("bytes=0-99"), Some(ByteRange::FromTo(0, 99)));
/// assert_eq!(parse_range("bytes=100-"), Some(ByteRange::From(100)));
/// assert_eq!(parse_range("bytes=-5"), Some(ByteRange::Last(5)));
/// assert_eq!(parse_range("BYTES=0-3"), Some(ByteRange::FromTo(0, 3)));
/// assert_eq!(parse_range("bytes=0-1,5-6"), None);
/// assert_eq!(parse_range("bytes=9-3"), None);
/// assert_eq!(parse_range("items=0-1"), None);
/// ```
pub fn parse_range(value: &str) -> Option<ByteRange> {
    // Range units are case-insensitive (RFC 9110 §14.1).
    let value = value.trim();
    let unit = value.get(..6)?;
    if !unit.eq_ignore_ascii_case("bytes=") {
        return None;
    }
    let spec = value[6..].trim();
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let number = |s: &str| {
        let s = s.trim();
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    match (first.trim().is_empty(), last.trim().is_empty()) {
        (true, false) => number(last).filter(|n| *n > 0).map(ByteRange::Last),
        (false, true) => number(first).map(ByteRange::From),
        (false, false) => {
            let (a, b) = (number(first)?, number(last)?);
            (a <= b).then_some(ByteRange::FromTo(a, b))
        }
        (true, true) => None,
    }
}

/// Whether `value` asks for one range in bytes that is malformed (not
/// one whose positions pass `u64`: that goes to the origin as it did).
fn one_bytes_range(value: &str) -> bool {
    let value = value.trim();
    let too_long = value
        .split(|c: char| !c.is_ascii_digit())
        .any(|digits| digits.len() > 19);
    value
        .get(..6)
        .is_some_and(|unit| unit.eq_ignore_ascii_case("bytes="))
        && !value.contains(',')
        && !too_long
}

impl RangeAsk {
    /// Takes `Range` and `If-Range` off a request (the origin is asked for
    /// the whole representation). `Err(())` for a `Range` the cache does not
    /// answer (several ranges, another unit): the request bypasses. One
    /// byte range that is malformed (`bytes=abc`, `bytes=4-2`) is ignored,
    /// as RFC 9110 §14.2 lets a server: the whole representation answers,
    /// from the cache (it bypassed it, one origin call each).
    pub(crate) fn take(headers: &mut HeaderMap) -> Result<Option<Self>, ()> {
        let Some(value) = headers.get(RANGE) else {
            headers.remove(IF_RANGE);
            return Ok(None);
        };
        let text = value.to_str().ok();
        let Some(range) = text.and_then(parse_range) else {
            if text.is_some_and(one_bytes_range) {
                headers.remove(RANGE);
                headers.remove(IF_RANGE);
                return Ok(None);
            }
            return Err(());
        };
        let if_range = headers.get(IF_RANGE).map(|v| v.as_bytes().to_vec());
        // Copies: kept with a request in flight, a value as hyper parsed
        // it would pin the connection's read buffer (see `own_head`).
        let owned = |v: &HeaderValue| HeaderValue::from_bytes(v.as_bytes()).unwrap_or(v.clone());
        let sent = (owned(value), headers.get(IF_RANGE).map(owned));
        headers.remove(RANGE);
        headers.remove(IF_RANGE);
        Ok(Some(Self {
            range,
            if_range,
            sent,
        }))
    }

    /// Puts the fields back as sent: a request that goes to the origin
    /// alone (its key is not stored) lets the origin answer the range.
    pub(crate) fn restore(&self, headers: &mut HeaderMap) {
        let (range, if_range) = &self.sent;
        headers.insert(RANGE, range.clone());
        if let Some(if_range) = if_range {
            headers.insert(IF_RANGE, if_range.clone());
        }
    }

    /// Whether `If-Range` lets the range apply to a response with these
    /// validators: a strong `ETag` equal, or `Last-Modified` the same date
    /// and strong, that is at least a second before the response's `Date`
    /// (RFC 9110 §13.1.5, §8.8.2.2: within the second it was modified, a
    /// resource may have changed again under the same date).
    fn applies(&self, headers: &HeaderMap) -> bool {
        let (etag, last_modified) = (headers.get(ETAG), headers.get(LAST_MODIFIED));
        let Some(cond) = &self.if_range else {
            return true;
        };
        let cond = cond.trim_ascii();
        if cond.starts_with(b"\"") || cond.starts_with(b"W/") {
            return !cond.starts_with(b"W/")
                && etag.is_some_and(|e| !e.as_bytes().starts_with(b"W/") && e.as_bytes() == cond);
        }
        let time = |v: Option<&HeaderValue>| -> Option<SystemTime> {
            v.and_then(|v| v.to_str().ok()).and_then(parse_http_date)
        };
        let asked = std::str::from_utf8(cond).ok().and_then(parse_http_date);
        let modified = time(last_modified);
        let strong = match (modified, time(headers.get(DATE))) {
            (Some(modified), Some(date)) => date
                .duration_since(modified)
                .is_ok_and(|d| d.as_secs() >= 1),
            _ => false,
        };
        asked.is_some() && asked == modified && strong
    }

    /// Cuts the range from a full `200` answer whose body is `body`: a `206`,
    /// a `416`, or the `200` unchanged (`If-Range` did not match, or a
    /// suffix range of an empty body).
    pub(crate) fn answer<B>(
        &self,
        res: Response<CacheBody<B>>,
        body: &Bytes,
    ) -> Response<CacheBody<B>> {
        if res.status() != StatusCode::OK || !self.applies(res.headers()) {
            return res;
        }
        let len = body.len() as u64;
        // Satisfiable, yet no `206` can name the bytes of nothing.
        if len == 0 && matches!(self.range, ByteRange::Last(_)) {
            return res;
        }
        let span = match self.range {
            ByteRange::FromTo(a, b) if a < len => Some((a, b.min(len - 1))),
            ByteRange::From(a) if a < len => Some((a, len - 1)),
            ByteRange::Last(n) => Some((len - n.min(len), len - 1)),
            _ => None,
        };
        let (mut parts, _) = res.into_parts();
        let (status, content_range, piece) = match span {
            Some((a, b)) => (
                StatusCode::PARTIAL_CONTENT,
                format!("bytes {a}-{b}/{len}"),
                body.slice(a as usize..=b as usize),
            ),
            None => (
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!("bytes */{len}"),
                Bytes::new(),
            ),
        };
        parts.status = status;
        if let Ok(v) = HeaderValue::try_from(content_range) {
            parts.headers.insert(CONTENT_RANGE, v);
        }
        parts
            .headers
            .insert(CONTENT_LENGTH, HeaderValue::from(piece.len()));
        Response::from_parts(parts, CacheBody::full(piece))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(etag: &str) -> Response<CacheBody<()>> {
        let mut res = Response::new(CacheBody::full(Bytes::from_static(b"0123456789")));
        res.headers_mut()
            .insert(ETAG, HeaderValue::from_str(etag).unwrap());
        res
    }

    fn ask(range: &str, if_range: Option<&str>) -> RangeAsk {
        let mut h = HeaderMap::new();
        h.insert(RANGE, HeaderValue::from_str(range).unwrap());
        if let Some(c) = if_range {
            h.insert(IF_RANGE, HeaderValue::from_str(c).unwrap());
        }
        RangeAsk::take(&mut h).unwrap().unwrap()
    }

    #[test]
    fn ranges_are_cut_and_refused() {
        let body = Bytes::from_static(b"0123456789");
        let res = ask("bytes=2-4", None).answer(full("\"a\""), &body);
        assert_eq!(res.status(), StatusCode::PARTIAL_CONTENT);
        assert_eq!(res.headers()[CONTENT_RANGE], "bytes 2-4/10");
        assert_eq!(res.headers()[CONTENT_LENGTH], "3");
        let res = ask("bytes=-3", None).answer(full("\"a\""), &body);
        assert_eq!(res.headers()[CONTENT_RANGE], "bytes 7-9/10");
        let res = ask("bytes=5-100", None).answer(full("\"a\""), &body);
        assert_eq!(res.headers()[CONTENT_RANGE], "bytes 5-9/10");
        let res = ask("bytes=10-", None).answer(full("\"a\""), &body);
        assert_eq!(res.status(), StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(res.headers()[CONTENT_RANGE], "bytes */10");
    }

    /// An empty representation: a suffix range is satisfiable (RFC 9110
    /// §14.1.1: the only form that is), but no `206` can name its bytes,
    /// so the whole (empty) `200` answers; any other range is a `416`. A
    /// suffix range was refused with a `416`.
    #[test]
    fn an_empty_body_answers_a_suffix_range_whole() {
        let empty = Bytes::new();
        let none = || Response::new(CacheBody::<()>::full(Bytes::new()));
        let res = ask("bytes=-5", None).answer(none(), &empty);
        assert_eq!(res.status(), StatusCode::OK);
        assert!(!res.headers().contains_key(CONTENT_RANGE));
        let res = ask("bytes=0-", None).answer(none(), &empty);
        assert_eq!(res.status(), StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(res.headers()[CONTENT_RANGE], "bytes */0");
    }

    #[test]
    fn if_range_needs_a_strong_match() {
        let body = Bytes::from_static(b"0123456789");
        let partial = ask("bytes=0-1", Some("\"a\"")).answer(full("\"a\""), &body);
        assert_eq!(partial.status(), StatusCode::PARTIAL_CONTENT);
        let whole = ask("bytes=0-1", Some("\"b\"")).answer(full("\"a\""), &body);
        assert_eq!(whole.status(), StatusCode::OK);
        let weak = ask("bytes=0-1", Some("W/\"a\"")).answer(full("W/\"a\""), &body);
        assert_eq!(weak.status(), StatusCode::OK);
    }

    #[test]
    fn if_range_with_a_date_needs_a_strong_last_modified() {
        let body = Bytes::from_static(b"0123456789");
        let t = "Sat, 04 Dec 2027 10:00:00 GMT";
        let with = |date: Option<&str>| {
            let mut res = full("\"a\"");
            res.headers_mut()
                .insert(LAST_MODIFIED, HeaderValue::from_static(t));
            if let Some(date) = date {
                res.headers_mut()
                    .insert(DATE, HeaderValue::from_str(date).unwrap());
            }
            res
        };
        let status = |date| ask("bytes=0-1", Some(t)).answer(with(date), &body).status();
        let later = Some("Sat, 04 Dec 2027 10:00:01 GMT");
        assert_eq!(status(later), StatusCode::PARTIAL_CONTENT);
        assert_eq!(
            status(Some(t)),
            StatusCode::OK,
            "modified within its Date's second"
        );
        assert_eq!(status(None), StatusCode::OK, "no Date: a weak validator");
        let other = ask("bytes=0-1", Some("Sat, 04 Dec 2027 09:00:00 GMT"));
        assert_eq!(other.answer(with(later), &body).status(), StatusCode::OK);
    }

    #[test]
    fn several_ranges_bypass() {
        let mut h = HeaderMap::new();
        h.insert(RANGE, HeaderValue::from_static("bytes=0-1, 4-5"));
        assert!(RangeAsk::take(&mut h).is_err());
    }
}
