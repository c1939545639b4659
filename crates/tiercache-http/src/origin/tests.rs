use super::tags::header_tags;
use super::*;

/// A header naming more tags than are kept, some twice, with runs of
/// spaces: the first ones are kept once each, in its order, and hold
/// exactly their own bytes (slices of the whole value held it all,
/// though the entry's weight counted only the kept tags).
#[test]
fn header_tags_hold_only_the_bytes_of_the_tags_kept() {
    let named: Vec<String> = (0..40).map(|i| format!("tag-{i}")).collect();
    let value = format!("tag-0   {}  tag-1", named.join("  "));
    let mut headers = HeaderMap::new();
    headers.insert(SURROGATE_KEY, value.parse().unwrap());
    let tags = header_tags(&headers, 32);
    let expected: Vec<&str> = named.iter().take(32).map(String::as_str).collect();
    let kept: Vec<&str> = tags
        .iter()
        .map(|t| std::str::from_utf8(t).unwrap())
        .collect();
    assert_eq!(kept, expected);
    let start = tags.iter().map(|t| t.as_ptr() as usize).min().unwrap();
    let end = tags
        .iter()
        .map(|t| t.as_ptr() as usize + t.len())
        .max()
        .unwrap();
    let own: usize = tags.iter().map(Bytes::len).sum();
    assert_eq!(end - start, own, "the tags share more than their bytes");
}

/// A request asked again after a 304 that named another version: the same
/// head without conditionals, with an empty body of the service's type when
/// the layer can make one; none for a body type it cannot make.
#[test]
fn a_request_is_asked_again_without_its_conditionals() {
    fn conditional<B>(body: B) -> Request<B> {
        Request::get("http://t/p")
            .header("if-none-match", "\"v1\"")
            .header("if-modified-since", "Thu, 01 Jan 2026 00:00:00 GMT")
            .header("accept", "text/html")
            .extension(7u32)
            .body(body)
            .unwrap()
    }
    let again = renew::asked_again(&conditional(axum::body::Body::empty())).unwrap();
    assert_eq!(again.uri(), "http://t/p");
    assert!(!again.headers().contains_key("if-none-match"));
    assert!(!again.headers().contains_key("if-modified-since"));
    assert_eq!(again.headers()["accept"], "text/html");
    assert_eq!(again.extensions().get::<u32>(), Some(&7));
    assert!(renew::asked_again(&conditional(String::new())).is_some());
    assert!(renew::asked_again(&conditional(http_body_util::Empty::<Bytes>::new())).is_some());
    /// A body type the layer does not know.
    struct Stream;
    assert!(renew::asked_again(&conditional(Stream)).is_none());
}
