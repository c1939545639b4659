//! `Cache-Control` directive lookup, RFC 9111 §5.2 syntax.

use http::HeaderMap;
use http::header::{AsHeaderName, CACHE_CONTROL};

/// Whether any `Cache-Control` field in `headers` carries directive `name`
/// (case-insensitive; arguments, quoted strings and unknown directives ignored).
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use tiercache_http::cache_control::has_directive;
///
/// let mut h = HeaderMap::new();
/// h.append("cache-control", HeaderValue::from_static("max-age=60, PRIVATE=\"set-cookie, x\""));
/// assert!(has_directive(&h, "private"));
/// assert!(!has_directive(&h, "x"));
/// ```
pub fn has_directive(headers: &HeaderMap, name: &str) -> bool {
    has_directive_in(headers, CACHE_CONTROL, name)
}

/// Like [`has_directive`], for any list-valued field of that grammar.
pub fn has_directive_in(headers: &HeaderMap, field: impl AsHeaderName, name: &str) -> bool {
    headers
        .get_all(field)
        .iter()
        .any(|v| directives(v.as_bytes()).any(|d| d.eq_ignore_ascii_case(name.as_bytes())))
}

/// The directive names of one field value, in order.
pub fn directives(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = value;
    std::iter::from_fn(move || {
        loop {
            if rest.is_empty() {
                return None;
            }
            let end = item_end(rest);
            let item = &rest[..end];
            rest = rest.get(end + 1..).unwrap_or(&[]);
            let name = item
                .split(|&b| b == b'=')
                .next()
                .unwrap_or(&[])
                .trim_ascii();
            if !name.is_empty() {
                return Some(name);
            }
        }
    })
}

/// Index of the comma that ends the first item (or the length), skipping quoted strings.
fn item_end(s: &[u8]) -> usize {
    let mut quoted = false;
    let mut escaped = false;
    for (i, &b) in s.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b',' if !quoted => return i,
            _ => {}
        }
    }
    s.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_outside_quotes() {
        let names: Vec<_> = directives(br#"no-cache="a, b", max-age=3 ,  , Public"#).collect();
        assert_eq!(names, vec![&b"no-cache"[..], b"max-age", b"Public"]);
    }

    #[test]
    fn escaped_quotes_stay_inside() {
        let names: Vec<_> = directives(br#"x="a\", private", s-maxage=1"#).collect();
        assert_eq!(names, vec![&b"x"[..], b"s-maxage"]);
    }
}
