use bytes::{BufMut, BytesMut};

use super::*;

fn entry() -> Entry {
    let t = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let value = Value {
        status: 404,
        headers: vec![
            ("content-type".into(), "text/plain; charset=utf-8".into()),
            ("x-odd".into(), Bytes::from_static(b"caf\xc3\xa9 \t x")),
        ],
        body: Bytes::from(vec![7u8; 5000]),
    };
    let times = Times {
        created_at: t,
        fresh_until: t + Duration::from_secs(30),
        stale_until: t + Duration::from_secs(60),
        error_until: t + Duration::from_secs(90),
        hard_until: t + Duration::from_secs(90),
    };
    Entry::new(
        "k".into(),
        "v".into(),
        value,
        times,
        Duration::from_micros(1234),
    )
}

/// [`entry`] with a body of `len` bytes.
fn entry_with_body(len: usize) -> Entry {
    let e = entry();
    let mut value = e.value().clone();
    value.body = vec![7u8; len].into();
    Entry::new(
        e.key().clone(),
        e.variant().clone(),
        value,
        e.times(),
        e.origin_latency(),
    )
}

#[test]
fn round_trips_byte_exact() {
    let e = entry();
    let back = decode(encode(&e)).unwrap();
    assert_eq!(back.value(), e.value());
    assert_eq!(back.times(), e.times());
    assert_eq!(back.key(), e.key());
    assert_eq!(back.variant(), e.variant());
    assert_eq!(back.origin_latency(), e.origin_latency());
}

/// A large entry's envelope lies in a page mapping of its own, as a
/// large body in L1 does, not on the allocator's heap (where a flood's
/// envelopes of many sizes left pages of each class partly used); a
/// small one is one heap block of its exact size. Either is as long
/// as [`encoded_len`] says, and reads back.
#[test]
fn a_large_envelope_lies_in_pages_of_its_own() {
    // A mapping starts on a page, and pages are 4 KiB or a multiple.
    let page = 4096;
    let from = tiercache_core::body::mapped_from();
    for body in [from, from + from / 2 + 333, 2 << 20] {
        let e = entry_with_body(body);
        let encoded = encode(&e);
        assert_eq!(encoded.len(), encoded_len(&e));
        assert_eq!(
            encoded.as_ptr() as usize % page,
            0,
            "a {body}-byte body's envelope is not at a page's start"
        );
        assert_eq!(decode(encoded).unwrap().value(), e.value());
    }
    let small = entry();
    assert_eq!(encode(&small).len(), encoded_len(&small));
}

#[test]
fn tags_round_trip() {
    let e = entry().with_tags(&["reports".into(), "family:/p".into()]);
    let encoded = encode(&e);
    let back = decode(encoded.clone()).unwrap();
    assert_eq!(back.tags(), e.tags());
    assert_eq!(back.value(), e.value());
    // The tags hold no share of the payload (the index keeps them past
    // the entry).
    let tags = back.tags().to_vec();
    drop(back);
    assert!(encoded.is_unique(), "decoded tags pin the envelope");
    assert_eq!(tags, e.tags());
    assert!(decode(encode(&entry())).unwrap().tags().is_empty());
}

/// A reply is a slice of the connection's read buffer (fred decodes in
/// place): an entry holding slices of it would keep the whole buffer
/// alive as long as the entry stays in L1.
#[test]
fn a_decoded_entry_holds_no_share_of_the_reply() {
    for body in [60, 64 * 1024] {
        let e = entry_with_body(body).with_tags(&["t".into()]);
        // On the heap, as fred's read buffer is (an envelope made here
        // may be in a mapping, which `is_unique` cannot tell).
        let reply = Bytes::copy_from_slice(&encode(&e));
        let back = decode(reply.clone()).unwrap();
        assert!(reply.is_unique(), "the decoded entry pins the reply");
        assert_eq!(back.value(), e.value());
        assert_eq!(back.key(), e.key());
        assert_eq!(back.variant(), e.variant());
    }
}

/// An envelope of the build before (version 2: no tags) still reads.
#[test]
fn a_version_2_envelope_reads_with_no_tags() {
    let e = entry();
    let v3 = encode(&e);
    // Version 3 less its tag count (two zero bytes), relabelled.
    let payload = &v3[HEADER_LEN..v3.len() - CHECKSUM_LEN - 2];
    let mut v2 = BytesMut::new();
    v2.put_slice(MAGIC);
    v2.put_u8(2);
    v2.put_u32_le(payload.len() as u32);
    v2.put_slice(payload);
    v2.put_u32_le(crc32fast::hash(payload));
    let back = decode(v2.freeze()).unwrap();
    assert_eq!(back.value(), e.value());
    assert_eq!(back.times(), e.times());
    assert!(back.tags().is_empty());
}

#[test]
fn every_damage_is_an_error_never_a_panic() {
    let good = encode(&entry());
    assert_eq!(
        decode(Bytes::from_static(b"hello world, not ours")).err(),
        Some(DecodeError::Foreign)
    );
    assert_eq!(decode(Bytes::new()).err(), Some(DecodeError::Foreign));
    for version in [1, VERSION + 1] {
        let mut other = good.to_vec();
        other[3] = version;
        assert_eq!(
            decode(other.into()).err(),
            Some(DecodeError::Version(version))
        );
    }
    for cut in [9, good.len() / 2, good.len() - 1] {
        assert!(decode(good.slice(..cut)).is_err(), "truncated at {cut}");
    }
    let mut padded = good.to_vec();
    padded.push(0);
    assert_eq!(decode(padded.into()).err(), Some(DecodeError::Length));
    // Flip every byte of the payload in turn: the checksum catches each.
    for i in HEADER_LEN..good.len() - CHECKSUM_LEN {
        let mut bad = good.to_vec();
        bad[i] ^= 0x40;
        assert!(decode(bad.into()).is_err(), "flip at {i} decoded");
    }
}

#[test]
fn invalid_header_fields_are_refused_even_with_a_good_checksum() {
    let t = UNIX_EPOCH + Duration::from_secs(1);
    let times = Times::fresh(t, t);
    for (name, value) in [
        ("bad name", "v"),
        ("x-ok", "line\r\nInjected: 1"),
        ("", "v"),
    ] {
        let v = Value {
            status: 200,
            headers: vec![(name.into(), value.into())],
            body: Bytes::new(),
        };
        let e = Entry::new("k".into(), Bytes::new(), v, times, Duration::ZERO);
        assert!(
            matches!(decode(encode(&e)), Err(DecodeError::Field(_))),
            "{name:?} {value:?}"
        );
    }
}
