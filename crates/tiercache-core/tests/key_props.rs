//! Cache keys are injective: two different part lists never build the same
//! full key, nor (but by a 128-bit collision) the same hash; and a pattern
//! matches exactly the keys it describes.
//!
//! Longer: `PROPTEST_CASES=200000 cargo test -p tiercache-core --test key_props --release`.

use proptest::prelude::*;
use tiercache_core::{CacheKey, KeyPattern};

fn parts() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..6)
}

fn build(parts: &[Vec<u8>]) -> CacheKey {
    parts
        .iter()
        .fold(CacheKey::builder(), |b, p| b.part(p))
        .finish()
}

proptest! {
    #[test]
    fn different_parts_never_share_a_key(a in parts(), b in parts()) {
        let (ka, kb) = (build(&a), build(&b));
        prop_assert_eq!(a == b, ka == kb);
        prop_assert_eq!(a == b, ka.hash() == kb.hash());
    }

    #[test]
    fn concatenation_cannot_forge_a_key(a in parts(), split in 0usize..12) {
        // Moving bytes between adjacent parts changes the key.
        if a.len() >= 2 && !a[0].is_empty() {
            let mut b = a.clone();
            let cut = split.min(b[0].len() - 1);
            let moved = b[0].split_off(cut);
            b[1].splice(0..0, moved);
            prop_assert_ne!(build(&a), build(&b));
        }
    }

    #[test]
    fn an_exact_pattern_matches_only_its_key(a in parts(), b in parts()) {
        let pattern = a.iter().fold(KeyPattern::new(), |p, part| p.part(part));
        // Exact parts match a key that starts with them.
        prop_assert!(pattern.matches(&build(&a)));
        let starts_with = b.len() >= a.len() && b[..a.len()] == a[..];
        prop_assert_eq!(pattern.matches(&build(&b)), starts_with);
        // And the pattern survives its trip between instances.
        let back = KeyPattern::from_bytes(&pattern.to_bytes()).unwrap();
        prop_assert_eq!(back, pattern);
    }
}
