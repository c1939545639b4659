//! The stored form of a response's head: what of it is kept, in one
//! allocation.

use bytes::Bytes;
use http::header::AGE;
use http::{HeaderMap, StatusCode};
use tiercache_core::Value;

use super::strip_hop_by_hop;
use crate::one_copy::OneCopy;

/// Fields a cache must not store (RFC 9111 §3.1), besides the hop-by-hop
/// ones: they belong to one proxy's exchange with one client.
pub const NEVER_STORED: [&str; 3] = [
    "proxy-authenticate",
    "proxy-authentication-info",
    "proxy-authorization",
];

/// The stored form of a response's head and body: hop-by-hop fields, the
/// proxy-specific fields of RFC 9111 §3.1 and `Age` (recomputed on every
/// hit) left out, every other field byte-exact.
///
/// The fields' names and values are slices of one allocation of exactly
/// their bytes, as a copy read from L2 is: two allocations a field, each
/// with its shared handle made on the first clone, were ~30 small
/// allocations kept per entry among the fill's short-lived ones, pages
/// the allocator could not give back (a 32 MiB L1 of tagged responses
/// held 1.32× its budget).
pub fn to_value(status: StatusCode, headers: &HeaderMap, body: Bytes) -> Value {
    let mut kept = headers.clone();
    strip_hop_by_hop(&mut kept);
    kept.remove(AGE);
    for name in NEVER_STORED {
        kept.remove(name);
    }
    let size = kept.iter().map(|(n, v)| n.as_str().len() + v.len()).sum();
    let mut room = OneCopy::with_capacity(size);
    let headers = kept
        .iter()
        .map(|(name, value)| {
            (
                room.copy(name.as_str().as_bytes()),
                room.copy(value.as_bytes()),
            )
        })
        .collect();
    Value {
        status: status.as_u16(),
        headers,
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn a_stored_head_is_one_allocation_of_its_bytes() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        h.insert("surrogate-key", HeaderValue::from_static("a b c"));
        h.append("x-many", HeaderValue::from_static("one"));
        h.append("x-many", HeaderValue::from_static("second"));
        h.insert("connection", HeaderValue::from_static("close"));
        let stored = to_value(StatusCode::OK, &h, Bytes::from_static(b"x"));
        let fields: Vec<(&[u8], &[u8])> = stored
            .headers
            .iter()
            .map(|(n, v)| (n.as_ref(), v.as_ref()))
            .collect();
        assert_eq!(
            fields,
            [
                (&b"content-type"[..], &b"text/plain"[..]),
                (b"surrogate-key", b"a b c"),
                (b"x-many", b"one"),
                (b"x-many", b"second"),
            ]
        );
        // Each name and value starts where the one before it ends.
        let parts: Vec<&Bytes> = stored.headers.iter().flat_map(|(n, v)| [n, v]).collect();
        for pair in parts.windows(2) {
            let end = pair[0].as_ptr().wrapping_add(pair[0].len());
            assert_eq!(end, pair[1].as_ptr(), "{:?} then {:?}", pair[0], pair[1]);
        }
    }
}
