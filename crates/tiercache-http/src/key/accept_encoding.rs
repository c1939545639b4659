//! `Accept-Encoding` as a `Vary`'d field: reduced to what decides the
//! answer, so a client cannot mint a variant per request.

use http::HeaderMap;
use http::header::ACCEPT_ENCODING;

/// The content codings a cache can answer with, in a fixed order.
const CODINGS: [&[u8]; 5] = [b"br", b"deflate", b"gzip", b"zstd", b"*"];

/// Whether `coding` (a `Content-Encoding`) is one [`normalized_accept_encoding`]
/// tells apart, so a variant on `Accept-Encoding` settles who may get it.
pub(crate) fn known_coding(coding: &[u8]) -> bool {
    let coding = coding.trim_ascii();
    coding.eq_ignore_ascii_case(b"x-gzip")
        || CODINGS[..4].iter().any(|c| c.eq_ignore_ascii_case(coding))
}

/// One `Accept-Encoding` member (`gzip;q=0.5`): its coding, trimmed, and
/// whether its weight refuses it (`q=0`).
pub(crate) fn coding_of(item: &[u8]) -> (&[u8], bool) {
    let mut params = item.split(|&b| b == b';');
    let coding = params.next().unwrap_or_default().trim_ascii();
    let refused = params.any(|p| {
        let p = p.trim_ascii();
        p.len() >= 2
            && p[..2].eq_ignore_ascii_case(b"q=")
            && std::str::from_utf8(&p[2..])
                .ok()
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
    });
    (coding, refused)
}

/// `Accept-Encoding` reduced to what decides the answer (as Varnish does):
/// the known codings the client accepts (q > 0), in a fixed order, and
/// when it takes any (`*`) those it refuses by name (`-gzip`), which `*`
/// alone would offer it. Junk values, orderings, spacing, weights and case
/// all collapse, so a client cannot mint a variant per request and lock a
/// URL's variant slots.
pub fn normalized_accept_encoding(headers: &HeaderMap) -> Vec<u8> {
    let mut accepted = [false; CODINGS.len()];
    let mut refused = [false; CODINGS.len()];
    for value in headers.get_all(ACCEPT_ENCODING) {
        for item in value.as_bytes().split(|&b| b == b',') {
            let (coding, is_refused) = coding_of(item);
            // `x-gzip` is gzip (RFC 9110 §8.4.1.3): one variant for both.
            let coding = if coding.eq_ignore_ascii_case(b"x-gzip") {
                &b"gzip"[..]
            } else {
                coding
            };
            if let Some(i) = CODINGS.iter().position(|c| c.eq_ignore_ascii_case(coding)) {
                if is_refused {
                    refused[i] = true;
                } else {
                    accepted[i] = true;
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut add = |sign: &[u8], coding: &[u8]| {
        if !out.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(sign);
        out.extend_from_slice(coding);
    };
    for (coding, _) in CODINGS.iter().zip(accepted).filter(|(_, on)| *on) {
        add(b"", coding);
    }
    if accepted[CODINGS.len() - 1] {
        for (i, coding) in CODINGS[..CODINGS.len() - 1].iter().enumerate() {
            if refused[i] && !accepted[i] {
                add(b"-", coding);
            }
        }
    }
    if out.is_empty() {
        // Every coding refused: a mark, not the empty value, on which an
        // entry stored before a request without the field had its own
        // variant was keyed (it may hold a coded body: it matches no
        // request now).
        return b"-".to_vec();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The normalised form of an `Accept-Encoding: v` request.
    fn ae(v: &str) -> Vec<u8> {
        let mut h = HeaderMap::new();
        h.insert(ACCEPT_ENCODING, v.parse().unwrap());
        normalized_accept_encoding(&h)
    }

    /// `x-gzip` is gzip: it took the variant of a client that accepts
    /// nothing, so neither shared the gzip clients' copy.
    #[test]
    fn x_gzip_shares_the_gzip_variant() {
        assert_eq!(ae("x-gzip"), ae("gzip"));
        assert_eq!(ae("X-GZIP, br"), ae("br, gzip"));
        assert_ne!(ae("x-gzip"), normalized_accept_encoding(&HeaderMap::new()));
        assert_eq!(
            ae("x-gzip;q=0"),
            normalized_accept_encoding(&HeaderMap::new())
        );
    }

    /// A coding refused by name beside `*` is refused: such a client may
    /// not share the copy stored for one that takes anything (RFC 9110
    /// §12.5.3), which could be in that very coding. Without `*`, a refusal
    /// is the same as not naming it.
    #[test]
    fn a_coding_refused_beside_the_wildcard_is_its_own_variant() {
        assert_ne!(ae("gzip;q=0, *"), ae("*"));
        assert_ne!(ae("*, gzip;q=0"), ae("*"));
        assert_eq!(ae("*, gzip;q=0"), ae("x-gzip;Q=0.0, *"));
        assert_ne!(ae("*, br;q=0"), ae("*, gzip;q=0"));
        assert_eq!(ae("gzip;q=0, br"), ae("br"));
        assert_eq!(ae("gzip, *;q=0"), ae("gzip"));
    }
}
