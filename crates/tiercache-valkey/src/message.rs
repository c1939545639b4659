//! The invalidation channel's messages: ASCII, space separated, nothing
//! from a URL in the clear. `FROM K HASH…` (keys), `FROM T TAGHEX HASH…` (a
//! tag), `FROM P PATTERNHEX MILLIS` (a prefix ban), `FROM D HASH…` (drop L1
//! copies), `FROM R HASH MILLIS…` (drop L1 copies of given fills).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tiercache_core::{Invalidation, KeyHash, KeyPattern};

/// One message on the invalidation channel.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Message {
    /// The sending instance (its own messages are not applied twice).
    pub(crate) from: String,
    pub(crate) invalidation: Invalidation,
    /// For a prefix: when the ban was recorded.
    pub(crate) at: Option<SystemTime>,
}

/// `FROM K HASH…`, `FROM T TAGHEX HASH…`, `FROM P PATTERNHEX MILLIS`: ASCII,
/// space separated, nothing from a URL in the clear.
pub(crate) fn encode(message: &Message) -> String {
    let hashes = |h: &[KeyHash]| h.iter().map(|h| format!(" {h}")).collect::<String>();
    match &message.invalidation {
        Invalidation::Keys(h) => format!("{} K{}", message.from, hashes(h)),
        Invalidation::Tag(tag, h) => format!("{} T {}{}", message.from, hex(tag), hashes(h)),
        Invalidation::Prefix(p) => format!(
            "{} P {} {}",
            message.from,
            hex(&p.to_bytes()),
            millis(message.at.unwrap_or(UNIX_EPOCH))
        ),
        _ => format!("{} ?", message.from),
    }
}

/// `FROM D HASH…`: drop L1's copies of these keys, and nothing else (see
/// [`InvalidationSink::drop_copies`](tiercache_core::InvalidationSink::drop_copies)); sent by the script that deleted an
/// overtaken fill again. Instances that predate it ignore it.
pub(crate) fn encode_drop(from: &str, hashes: &[KeyHash]) -> String {
    let mut text = format!("{from} D");
    for hash in hashes {
        text.push_str(&format!(" {hash}"));
    }
    text
}

/// Reads [`encode_drop`]'s output; `None` for anything else.
pub(crate) fn decode_drop(text: &str) -> Option<Vec<KeyHash>> {
    let mut words = text.split(' ');
    let (_from, kind) = (words.next()?, words.next()?);
    if kind != "D" {
        return None;
    }
    words.map(KeyHash::from_hex).collect()
}

/// `FROM R HASH MILLIS…`: drop L1's copies of this key created at one of
/// the MILLIS, and nothing else (see
/// [`InvalidationSink::drop_fill`](tiercache_core::InvalidationSink::drop_fill));
/// sent by the script that refused a renewal (the fill it read), and by
/// the one that stored a late fill over an earlier load's (the fill it
/// replaced).
/// Instances that predate it ignore it.
pub(crate) fn encode_stale_fill(from: &str, hash: KeyHash, created_ms: &[u64]) -> String {
    let mut text = format!("{from} R {hash}");
    for ms in created_ms {
        text.push_str(&format!(" {ms}"));
    }
    text
}

/// Reads [`encode_stale_fill`]'s output; `None` for anything else.
pub(crate) fn decode_stale_fill(text: &str) -> Option<(KeyHash, Vec<SystemTime>)> {
    let mut words = text.split(' ');
    let (_from, kind) = (words.next()?, words.next()?);
    if kind != "R" {
        return None;
    }
    let hash = KeyHash::from_hex(words.next()?)?;
    let created = words
        .map(|w| Some(UNIX_EPOCH + Duration::from_millis(w.parse().ok()?)))
        .collect::<Option<Vec<_>>>()?;
    (!created.is_empty()).then_some((hash, created))
}

/// Reads [`encode`]'s output; `None` for anything else.
pub(crate) fn decode(text: &str) -> Option<Message> {
    let mut words = text.split(' ');
    let from = words.next()?.to_owned();
    let kind = words.next()?;
    let hashes = |words: std::str::Split<'_, char>| -> Option<Vec<KeyHash>> {
        words.map(KeyHash::from_hex).collect()
    };
    let (invalidation, at) = match kind {
        "K" => (Invalidation::Keys(hashes(words)?), None),
        "T" => {
            let tag = Bytes::from(unhex(words.next()?)?);
            (Invalidation::Tag(tag, hashes(words)?), None)
        }
        "P" => {
            let pattern = KeyPattern::from_bytes(&unhex(words.next()?)?)?;
            let at = UNIX_EPOCH + Duration::from_millis(words.next()?.parse().ok()?);
            if words.next().is_some() {
                return None;
            }
            (Invalidation::Prefix(pattern), Some(at))
        }
        _ => return None,
    };
    Some(Message {
        from,
        invalidation,
        at,
    })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

pub(crate) fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiercache_core::CacheKey;

    /// A drop message is read back as one, and never as an invalidation
    /// (which would refuse loads in flight and delete fills again).
    #[test]
    fn drop_messages_are_not_invalidations() {
        let hashes = vec![CacheKey::new("a").hash(), CacheKey::new("b").hash()];
        let text = encode_drop("me", &hashes);
        assert_eq!(decode_drop(&text), Some(hashes.clone()));
        assert!(decode(&text).is_none());
        let keys = encode(&Message {
            from: "me".into(),
            invalidation: Invalidation::Keys(hashes),
            at: None,
        });
        assert!(decode_drop(&keys).is_none());
        assert!(decode_drop("me D zz").is_none(), "not a hash");
        let hash = CacheKey::new("c").hash();
        let text = encode_stale_fill("me", hash, &[1_800_000_000_123, 7]);
        let at = |ms| UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(
            decode_stale_fill(&text),
            Some((hash, vec![at(1_800_000_000_123), at(7)]))
        );
        assert!(decode(&text).is_none() && decode_drop(&text).is_none());
        assert!(decode_stale_fill(&format!("{text} x")).is_none());
        assert!(decode_stale_fill(&format!("me R {hash}")).is_none());
    }

    #[test]
    fn messages_round_trip() {
        let h = |s: &str| CacheKey::new(s).hash();
        let at = UNIX_EPOCH + Duration::from_millis(1_800_000_000_123);
        for invalidation in [
            Invalidation::Keys(vec![h("a"), h("b")]),
            Invalidation::Keys(vec![]),
            Invalidation::Tag(Bytes::from_static(b"product 7 {x}"), vec![h("c")]),
            Invalidation::Prefix(KeyPattern::new().part(b"GET").any().prefix(b"/p {")),
        ] {
            let at = matches!(invalidation, Invalidation::Prefix(_)).then_some(at);
            let message = Message {
                from: "0123abcd".into(),
                invalidation,
                at,
            };
            let text = encode(&message);
            assert!(text.is_ascii() && !text.contains('{'), "{text}");
            assert_eq!(decode(&text), Some(message));
        }
    }

    #[test]
    fn foreign_messages_are_ignored() {
        for text in [
            "",
            "x",
            "x K zz",
            "x T 0",
            "x P 00 1",
            "x P 3d 12 extra",
            "x Q",
        ] {
            assert_eq!(decode(text), None, "{text:?}");
        }
    }
}
