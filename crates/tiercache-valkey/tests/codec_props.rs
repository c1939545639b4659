//! Properties of the L2 envelope, whose bytes anyone with write access to
//! Valkey can place: what is encoded decodes to itself, and no bytes at all
//! (random, truncated, or one byte changed) make the decoder panic or hand
//! back something other than what was encoded.
//!
//! A short run is part of `cargo test`; a longer one:
//! `PROPTEST_CASES=200000 cargo test -p tiercache-valkey --test codec_props --release`.

use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use proptest::prelude::*;
use tiercache_core::{Entry, Times, Value};
use tiercache_valkey::codec::{decode, encode};

fn header_name() -> impl Strategy<Value = Vec<u8>> {
    proptest::string::string_regex("[a-z][a-z0-9-]{0,20}")
        .unwrap()
        .prop_map(String::into_bytes)
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(0x20u8..0x7f, 0..40)
}

prop_compose! {
    fn entries()(
        status in 100u16..=999,
        headers in proptest::collection::vec((header_name(), header_value()), 0..8),
        body in proptest::collection::vec(any::<u8>(), 0..512),
        key in proptest::collection::vec(any::<u8>(), 0..64),
        variant in proptest::collection::vec(any::<u8>(), 0..32),
        created in 0u64..4_000_000_000_000,
        gaps in proptest::collection::vec(0u64..1_000_000_000, 3),
        latency_us in 0u64..10_000_000,
        tags in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..24), 0..4),
    ) -> Entry {
        // The order every entry the engine builds has (and the decoder checks).
        let t = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        let fresh = created + gaps[0];
        let (stale, error) = (fresh + gaps[1], fresh + gaps[2]);
        let times = Times {
            created_at: t(created),
            fresh_until: t(fresh),
            stale_until: t(stale),
            error_until: t(error),
            hard_until: t(stale.max(error)),
        };
        let value = Value {
            status,
            headers: headers
                .into_iter()
                .map(|(n, v)| (Bytes::from(n), Bytes::from(v)))
                .collect(),
            body: Bytes::from(body),
        };
        let tags: Vec<Bytes> = tags.into_iter().map(Bytes::from).collect();
        Entry::new(Bytes::from(key), Bytes::from(variant), value, times, Duration::from_micros(latency_us))
            .with_tags(&tags)
    }
}

fn same(a: &Entry, b: &Entry) -> bool {
    a.key() == b.key()
        && a.variant() == b.variant()
        && a.value() == b.value()
        && a.times() == b.times()
        && a.origin_latency() == b.origin_latency()
        && a.tags() == b.tags()
}

proptest! {
    #[test]
    fn decode_of_encode_is_the_entry(entry in entries()) {
        let back = decode(encode(&entry)).expect("an encoded entry decodes");
        prop_assert!(same(&back, &entry));
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(Bytes::from(bytes));
    }

    #[test]
    fn a_changed_or_cut_envelope_is_refused(
        entry in entries(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        cut in any::<prop::sample::Index>(),
    ) {
        let good = encode(&entry).to_vec();
        let mut bad = good.clone();
        let i = at.index(bad.len());
        bad[i] ^= flip;
        // A flipped byte is caught (checksum, length, magic, version).
        match decode(Bytes::from(bad)) {
            Err(_) => {}
            Ok(back) => prop_assert!(same(&back, &entry), "a changed envelope decoded to another entry"),
        }
        let short = &good[..cut.index(good.len())];
        prop_assert!(decode(Bytes::copy_from_slice(short)).is_err());
    }
}
