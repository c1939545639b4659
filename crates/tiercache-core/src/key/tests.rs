use super::*;

#[test]
fn part_boundaries_matter() {
    let ab_c = CacheKey::builder().part(b"ab").part(b"c").finish();
    let a_bc = CacheKey::builder().part(b"a").part(b"bc").finish();
    let abc = CacheKey::builder().part(b"abc").finish();
    assert_ne!(ab_c, a_bc);
    assert_ne!(ab_c, abc);
    assert_ne!(ab_c.hash(), a_bc.hash());
}

#[test]
fn hex_has_no_hash_tag_braces() {
    let k = CacheKey::new("/x{evil}");
    let hex = k.hash().to_hex();
    assert_eq!(hex.len(), 32);
    assert_eq!(KeyHash::from_hex(&hex), Some(k.hash()));
    assert_eq!(KeyHash::from_hex("zz"), None);
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
}

#[test]
fn patterns_match_whole_parts_and_round_trip() {
    let key = CacheKey::builder()
        .part(b"a")
        .part(b"bc")
        .part(b"d")
        .finish();
    assert!(KeyPattern::new().matches(&key));
    assert!(KeyPattern::new().part(b"a").any().matches(&key));
    assert!(
        KeyPattern::new()
            .part(b"a")
            .prefix(b"b")
            .part(b"d")
            .matches(&key)
    );
    assert!(!KeyPattern::new().prefix(b"ab").matches(&key));
    assert!(!KeyPattern::new().part(b"a").part(b"b").matches(&key));
    let long = KeyPattern::new().any().any().any().any();
    assert!(!long.matches(&key), "more parts than the key has");
    let p = KeyPattern::new().part(b"x").any().prefix(b"/p{");
    assert_eq!(KeyPattern::from_bytes(&p.to_bytes()), Some(p));
    assert_eq!(KeyPattern::from_bytes(b"?garbage"), None);
    assert_eq!(KeyPattern::from_bytes(b"=\xff\xff\xff\xffx"), None);
}

#[test]
fn remembered_digests_answer_only_for_their_own_bytes() {
    // Enough keys to share slots: each must still get its own digest,
    // first and second time, and a key over the size bound too.
    let keys: Vec<Bytes> = (0..4 * RECENT_SLOTS)
        .map(|i| Bytes::from(format!("/p/{i}")))
        .chain([Bytes::from(vec![b'x'; RECENT_MAX_KEY + 1])])
        .collect();
    for _ in 0..2 {
        for key in &keys {
            assert_eq!(CacheKey::from_full(key.clone()).hash(), digest(key));
        }
    }
}

/// A key may be a slice of an L2 read's buffer (the whole payload):
/// the table of recent digests keeps a copy, never a share of it.
#[test]
fn a_remembered_digest_holds_no_share_of_its_keys_buffer() {
    let payload = Bytes::from(vec![b'k'; 64 * 1024]);
    let key = CacheKey::from_full(payload.slice(..40));
    drop(key);
    assert!(payload.is_unique(), "the digest table pins the payload");
    assert_eq!(
        CacheKey::from_full(payload.slice(..40)).hash(),
        digest(&payload[..40])
    );
}

#[test]
fn concat_equals_one_part() {
    let mut a = CacheKey::builder();
    a.push_concat(&[b"ab", b"cd"]);
    assert_eq!(a.finish(), CacheKey::new("abcd"));
}
