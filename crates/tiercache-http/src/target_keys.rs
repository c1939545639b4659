//! Each thread's recently built keys of request targets.
//!
//! A target's key (six length-prefixed parts in an allocation of their
//! own, then a digest) cost ~1,000 instructions a hit, about as much as
//! L1's look-up. It is a pure function of the scheme, authority, path and
//! query, so a thread keeps the keys it built last and hands out a clone
//! (a shared allocation, no copy) when a request names a target it built
//! lately. A slot answers only when its key's parts are, byte for byte,
//! the parts the request's key would have: a kept key is never stale.

use std::cell::RefCell;
use std::hash::BuildHasher;

use tiercache_core::CacheKey;

use crate::key::{TARGET_HEAD, take_part};

/// Slots in each thread's table (a power of two).
const SLOTS: usize = 64;
/// Longer keys are built every time: rare, and a few slots must not hold much.
const MAX_KEY: usize = 256;

thread_local! {
    static KEYS: RefCell<[Option<CacheKey>; SLOTS]> =
        const { RefCell::new([const { None }; SLOTS]) };
}

/// The parts of a request's target, as they come.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'a> {
    pub(crate) scheme: &'a str,
    pub(crate) authority: &'a [u8],
    pub(crate) path: &'a str,
    pub(crate) query: Option<&'a str>,
}

/// `target`'s key: a clone of the one this thread kept, or `build`'s (kept
/// unless longer than [`MAX_KEY`]).
pub(crate) fn key_of(target: Target<'_>, build: impl FnOnce() -> CacheKey) -> CacheKey {
    let slot = foldhash::fast::FixedState::default().hash_one((
        target.path,
        target.query,
        target.authority,
    )) as usize
        % SLOTS;
    let kept = KEYS
        .try_with(|keys| {
            keys.borrow()[slot]
                .as_ref()
                .filter(|key| is_key_of(key.full(), &target))
                .cloned()
        })
        .ok()
        .flatten();
    if let Some(key) = kept {
        return key;
    }
    let key = build();
    if key.full().len() <= MAX_KEY {
        // A thread being torn down has no table any more: nothing to keep.
        let _ = KEYS.try_with(|keys| keys.borrow_mut()[slot] = Some(key.clone()));
    }
    key
}

/// Whether `full` is the key `target` builds: the fixed head, then the
/// scheme and authority lower-cased (a kept key's are, so comparing them
/// without case is comparing with the request's lower-cased), the path,
/// and the query's part (`?` and the query, or empty), and nothing more.
fn is_key_of(full: &[u8], target: &Target<'_>) -> bool {
    let Some(mut rest) = full.strip_prefix(TARGET_HEAD) else {
        return false;
    };
    let mut next = || take_part(&mut rest);
    let query_fits = |part: &[u8]| match target.query {
        Some(q) => part.strip_prefix(b"?") == Some(q.as_bytes()),
        None => part.is_empty(),
    };
    // Exact first: most requests' are lower-case already, and a compare
    // without case costs ~15 instructions a byte.
    let folded = |p: &[u8], given: &[u8]| p == given || p.eq_ignore_ascii_case(given);
    next().is_some_and(|p| folded(p, target.scheme.as_bytes()))
        && next().is_some_and(|p| folded(p, target.authority))
        && next() == Some(target.path.as_bytes())
        && next().is_some_and(query_fits)
        && rest.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::uri_key;

    fn built(t: Target<'_>) -> CacheKey {
        uri_key(t.scheme, t.authority, t.path, t.query).finish()
    }

    fn target(
        scheme: &'static str,
        authority: &'static str,
        path: &'static str,
        query: Option<&'static str>,
    ) -> Target<'static> {
        Target {
            scheme,
            authority: authority.as_bytes(),
            path,
            query,
        }
    }

    #[test]
    fn a_kept_key_answers_only_the_targets_that_build_it() {
        let base = target("http", "Shop.example", "/p/7", Some("x=1"));
        let variants = [
            base,
            target("http", "shop.example", "/p/7", Some("x=1")),
            target("HTTP", "SHOP.EXAMPLE", "/p/7", Some("x=1")),
            target("https", "shop.example", "/p/7", Some("x=1")),
            target("http", "shop.example:80", "/p/7", Some("x=1")),
            target("http", "shop.example", "/P/7", Some("x=1")),
            target("http", "shop.example", "/p/7", Some("X=1")),
            target("http", "shop.example", "/p/7", Some("")),
            target("http", "shop.example", "/p/7", None),
            target("http", "shop.example", "/p/7?x=1", None),
            target("http", "", "/p/7", Some("x=1")),
        ];
        // Twice round: the second time every key may come from the table.
        for round in 0..2 {
            for t in variants {
                assert_eq!(key_of(t, || built(t)), built(t), "round {round}: {t:?}");
            }
        }
        // A kept key is handed out whole: every other target's check fails.
        let kept = built(base);
        for t in &variants[3..] {
            assert!(!is_key_of(kept.full(), t), "{t:?}");
        }
        assert!(is_key_of(kept.full(), &variants[1]));
        assert!(is_key_of(kept.full(), &variants[2]));
    }

    #[test]
    fn a_key_with_more_parts_is_not_a_targets_key() {
        let t = target("http", "h", "/a", None);
        let longer = built(t).with_part(b"alice");
        assert!(!is_key_of(longer.full(), &t));
        assert!(is_key_of(built(t).full(), &t));
    }

    #[test]
    fn long_keys_are_built_every_time() {
        let path: &'static str = Box::leak(format!("/{}", "a".repeat(MAX_KEY)).into_boxed_str());
        // How many of three asks for `t`'s key built it.
        let builds = |t: Target<'_>| {
            let mut builds = 0;
            for _ in 0..3 {
                key_of(t, || {
                    builds += 1;
                    built(t)
                });
            }
            builds
        };
        assert_eq!(builds(target("http", "h", path, None)), 3);
        assert_eq!(builds(target("http", "h", "/short", None)), 1);
    }
}
