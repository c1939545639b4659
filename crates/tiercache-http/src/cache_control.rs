//! `Cache-Control` directive lookup, RFC 9111 §5.2 syntax.

use std::borrow::Cow;

use http::header::{AsHeaderName, CACHE_CONTROL};
use http::{HeaderMap, HeaderName, HeaderValue};

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

/// `headers` with the first valid targeted field (RFC 9213) of `targets`
/// standing in for `Cache-Control`; `headers` itself when none is.
///
/// A targeted field is a Structured Field Dictionary (RFC 9651): one that
/// does not parse is ignored, as if absent, and so is a member whose value
/// has the wrong type (`max-age="60"`, a string, is no lifetime).
///
/// ```
/// use http::{HeaderMap, HeaderName, HeaderValue};
/// use tiercache_http::cache_control::{directive_value, has_directive, targeted};
///
/// let mut h = HeaderMap::new();
/// h.insert("cache-control", "no-store".parse().unwrap());
/// h.insert("cdn-cache-control", "max-age=60".parse().unwrap());
/// let cdn = [HeaderName::from_static("cdn-cache-control")];
/// assert!(!has_directive(&targeted(&h, &cdn), "no-store"));
/// assert!(has_directive(&targeted(&h, &[]), "no-store"));
///
/// // Not a Structured Field: ignored, `Cache-Control` rules.
/// h.insert("cdn-cache-control", "max-age=60,,".parse().unwrap());
/// assert!(has_directive(&targeted(&h, &cdn), "no-store"));
/// // A lifetime given as a string is no lifetime.
/// h.insert("cdn-cache-control", "max-age=\"60\", public".parse().unwrap());
/// assert_eq!(directive_value(&targeted(&h, &cdn), "max-age"), None);
/// ```
pub fn targeted<'a>(headers: &'a HeaderMap, targets: &[HeaderName]) -> Cow<'a, HeaderMap> {
    for field in targets.iter().filter(|t| headers.contains_key(*t)) {
        let Some(value) = dictionary_as_cache_control(headers, field) else {
            continue;
        };
        let mut out = headers.clone();
        // Both set aside for the targeted field (RFC 9213 §2.2).
        out.remove(CACHE_CONTROL);
        out.remove(http::header::EXPIRES);
        if let Ok(value) = HeaderValue::try_from(value) {
            out.insert(CACHE_CONTROL, value);
        }
        return Cow::Owned(out);
    }
    Cow::Borrowed(headers)
}

/// A targeted field, parsed as a Structured Field Dictionary, written back
/// as `Cache-Control` directives: integers as `name=N`, `true` as `name`;
/// `private`, `no-cache` and `no-store` with any other value (field names:
/// a string, a token or an inner list) as the bare directive, which is
/// stricter; other members are dropped. `None` when it does not parse.
fn dictionary_as_cache_control(headers: &HeaderMap, field: &HeaderName) -> Option<String> {
    let mut joined = Vec::new();
    for (i, v) in headers.get_all(field).iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    let dictionary = sfv::Parser::parse_dictionary(&joined).ok()?;
    let mut out = String::new();
    for (name, member) in dictionary {
        let directive = match member {
            sfv::ListEntry::Item(sfv::Item {
                bare_item: sfv::BareItem::Integer(n),
                ..
            }) if n >= 0 => format!("{name}={n}"),
            sfv::ListEntry::Item(sfv::Item {
                bare_item: sfv::BareItem::Boolean(true),
                ..
            }) => name,
            // Dropping `private="set-cookie"` would store and share what
            // the origin kept private.
            sfv::ListEntry::Item(sfv::Item {
                bare_item: sfv::BareItem::Boolean(false),
                ..
            }) => continue,
            _ if matches!(name.as_str(), "private" | "no-cache" | "no-store") => name,
            _ => continue,
        };
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&directive);
    }
    Some(out)
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
/// The members of a comma-separated list, split outside quoted strings
/// (an `If-None-Match` entity-tag may hold a comma), trimmed, empty ones
/// skipped.
pub(crate) fn list_items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    items(value)
        .map(<[u8]>::trim_ascii)
        .filter(|i| !i.is_empty())
}

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

/// Index of the comma that ends the first item (or the length), skipping
/// quoted strings. A quote never closed quotes nothing: the item ends at
/// the first comma after it, so a malformed value cannot hide the
/// directives that follow (`x="a, private` is still `private`).
fn item_end(s: &[u8]) -> usize {
    let mut quoted = false;
    let mut escaped = false;
    let mut first_quoted_comma = None;
    for (i, &b) in s.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b',' if !quoted => return i,
            b',' => {
                first_quoted_comma.get_or_insert(i);
            }
            _ => {}
        }
    }
    match first_quoted_comma {
        Some(i) if quoted => i,
        _ => s.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_outside_quotes() {
        let names: Vec<_> = directives(br#"no-cache="a, b", max-age=3 ,  , Public"#).collect();
        assert_eq!(names, vec![&b"no-cache"[..], b"max-age", b"Public"]);
    }

    /// A quote never closed does not hide the directives after it (a
    /// malformed field is read as the caches beside us read it: nginx and
    /// Varnish match the names anywhere).
    #[test]
    fn an_unclosed_quote_hides_nothing() {
        let names: Vec<_> = directives(br#"max-age=600, x-note="beta, private"#).collect();
        assert_eq!(names, vec![&b"max-age"[..], b"x-note", b"private"]);
        let names: Vec<_> = directives(br#"x="a\", no-store, max-age=1"#).collect();
        assert_eq!(names, vec![&b"x"[..], b"no-store", b"max-age"]);
    }

    #[test]
    fn escaped_quotes_stay_inside() {
        let names: Vec<_> = directives(br#"x="a\", private", s-maxage=1"#).collect();
        assert_eq!(names, vec![&b"x"[..], b"s-maxage"]);
    }
}
