use super::*;

#[test]
fn a_body_is_stored_as_pushed_whatever_its_size() {
    let big = mapped_from();
    for len in [
        0,
        1,
        60,
        big - 1,
        big,
        big + 1,
        64 * 1024 + 7,
        3 * FIRST_MAPPING + 5,
    ] {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // Announced right, announced short (it moves on), not announced,
        // announced long (a body shorter than its Content-Length).
        for announced in [len, len / 2, 0, len * 3 + big] {
            let mut body = BodyBuilder::with_capacity(announced);
            for chunk in data.chunks(5000) {
                body.push(chunk);
            }
            assert_eq!(body.len(), len);
            assert_eq!(body.finish(), data, "{len} bytes, {announced} announced");
        }
        assert_eq!(copy(&data), data);
    }
}

#[test]
fn large_bodies_are_weighed_by_their_mapping_at_most_an_eighth_over() {
    let page = page_size();
    assert_eq!(stored_size(100), 100);
    assert_eq!(stored_size(mapped_from() - 1), mapped_from() - 1);
    assert_eq!(stored_size(mapped_from()), mapped_from());
    assert_eq!(stored_size(64 * 1024), 64 * 1024);
    let mut classes = std::collections::BTreeSet::new();
    for len in (mapped_from()..8 << 20).step_by(997) {
        let size = stored_size(len);
        assert!(size >= len && size.is_multiple_of(page), "{len}: {size}");
        assert!(size - len <= (len / 8).max(page), "{len}: {size}");
        classes.insert(size);
    }
    // Few sizes, so a freed mapping fits the next body of about its size.
    assert!(classes.len() < 80, "{} classes", classes.len());
}

#[test]
fn what_was_read_is_replayed_as_it_lies() {
    let mut body = BodyBuilder::with_capacity(0);
    body.push(b"partial ");
    body.push(b"read");
    assert_eq!(body.into_bytes(), "partial read");
    let mut body = BodyBuilder::with_capacity(mapped_from() * 2);
    body.push(b"short");
    assert_eq!(body.into_bytes(), "short");
}

/// `exact` trusts the length it is given: past the 1 MiB an announced
/// length reserves, its bytes never move (no growth, no copy at the end).
#[test]
fn an_exact_builder_reserves_its_whole_length_once() {
    for len in [100, mapped_from() + 5, 3 * FIRST_MAPPING + 7] {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut body = BodyBuilder::exact(len);
        body.push(&data[..1]);
        let start = body.as_slice().as_ptr();
        for chunk in data[1..].chunks(5000) {
            body.push(chunk);
        }
        assert_eq!(body.as_slice().as_ptr(), start, "{len} bytes moved");
        let stored = body.finish();
        assert_eq!(stored.as_ptr(), start, "{len} bytes copied at the end");
        assert_eq!(stored, data);
    }
}
