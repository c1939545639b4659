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
