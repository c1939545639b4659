//! `Cache-Control` directive lookup, RFC 9111 §5.2 syntax.

use std::borrow::Cow;

use http::header::{AsHeaderName, CACHE_CONTROL};
use http::{HeaderMap, HeaderName};

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

/// `headers` with the first targeted field (RFC 9213) of `targets` present
/// standing in for `Cache-Control`; `headers` itself when none is.
///
/// ```
/// use http::{HeaderMap, HeaderName};
/// use tiercache_http::cache_control::{has_directive, targeted};
///
/// let mut h = HeaderMap::new();
/// h.insert("cache-control", "no-store".parse().unwrap());
/// h.insert("cdn-cache-control", "max-age=60".parse().unwrap());
/// let cdn = [HeaderName::from_static("cdn-cache-control")];
/// assert!(!has_directive(&targeted(&h, &cdn), "no-store"));
/// assert!(has_directive(&targeted(&h, &[]), "no-store"));
/// ```
pub fn targeted<'a>(headers: &'a HeaderMap, targets: &[HeaderName]) -> Cow<'a, HeaderMap> {
    let Some(field) = targets.iter().find(|t| headers.contains_key(*t)) else {
        return Cow::Borrowed(headers);
    };
    let mut out = headers.clone();
    out.remove(CACHE_CONTROL);
    for v in headers.get_all(field) {
        out.append(CACHE_CONTROL, v.clone());
    }
    Cow::Owned(out)
}

/// Like [`has_directive`], for any list-valued field of that grammar.
pub fn has_directive_in(headers: &HeaderMap, field: impl AsHeaderName, name: &str) -> bool {
    headers
        .get_all(field)
        .iter()
        .any(|v| directives(v.as_bytes()).any(|d| d.eq_ignore_ascii_case(name.as_bytes())))
}

/// The argument of the first directive `name` in any `Cache-Control` field
/// (quotes removed; empty for a directive without one).
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use tiercache_http::cache_control::directive_value;
///
/// let mut h = HeaderMap::new();
/// h.append("cache-control", HeaderValue::from_static("public, Max-Age=\"60\""));
/// assert_eq!(directive_value(&h, "max-age").as_deref(), Some("60"));
/// assert_eq!(directive_value(&h, "public").as_deref(), Some(""));
/// ```
pub fn directive_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get_all(CACHE_CONTROL).iter().find_map(|v| {
        items(v.as_bytes()).find_map(|item| {
            let (n, arg) = match item.iter().position(|&b| b == b'=') {
                Some(i) => (&item[..i], &item[i + 1..]),
                None => (item, &[][..]),
            };
            n.trim_ascii()
                .eq_ignore_ascii_case(name.as_bytes())
                .then(|| {
                    let arg = arg.trim_ascii();
                    let arg = arg
                        .strip_prefix(b"\"")
                        .and_then(|a| a.strip_suffix(b"\""))
                        .unwrap_or(arg);
                    String::from_utf8_lossy(arg).into_owned()
                })
        })
    })
}

/// The items (`name[=arg]`) of one field value, in order, split outside quotes.
fn items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = value;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = item_end(rest);
        let item = &rest[..end];
        rest = rest.get(end + 1..).unwrap_or(&[]);
        Some(item)
    })
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
