//! The tags a stored response is recorded under (its route's, its
//! `Surrogate-Key` header's, its `Vary` family's).

use bytes::Bytes;
use http::HeaderMap;
use http::header::HeaderName;
use tiercache_core::CacheKey;

use crate::key::family_tag;
use crate::one_copy::OneCopy;
use crate::route::Route;

/// The tags a response is recorded under: the route's, those its
/// `Surrogate-Key` header lists (space separated, see [`header_tags`]),
/// and for a `Vary`ing URL its family tag.
pub(super) fn tags_for(
    route: &Route,
    headers: &HeaderMap,
    family: Option<&CacheKey>,
) -> Vec<Bytes> {
    let mut tags: Vec<Bytes> = route.policy.tags().to_vec();
    let room = MAX_TAGS.saturating_sub(tags.len());
    tags.extend(header_tags(headers, room));
    tags.extend(family.map(family_tag));
    tags.sort_unstable();
    tags.dedup();
    tags
}

/// The first `room` tags `Surrogate-Key` names, in its order, each once,
/// sharing one copy of exactly their bytes: a tag each object has of its
/// own is recorded for as long as the entry lives, where 32 small copies
/// cost more than the tags' bytes, and a copy of the whole value would
/// hold what the entry's weight does not count (tags past the cap,
/// repeats, spaces).
pub(super) fn header_tags(headers: &HeaderMap, room: usize) -> Vec<Bytes> {
    let mut named: Vec<&[u8]> = Vec::new();
    for value in headers.get_all(SURROGATE_KEY) {
        for tag in value.as_bytes().split(|b| b.is_ascii_whitespace()) {
            if !tag.is_empty() && named.len() < room && !named.contains(&tag) {
                named.push(tag);
            }
        }
    }
    let mut room = OneCopy::with_capacity(named.iter().map(|t| t.len()).sum());
    named.iter().map(|tag| room.copy(tag)).collect()
}

/// The response header naming an entry's tags (surrogate keys).
pub const SURROGATE_KEY: HeaderName = HeaderName::from_static("surrogate-key");
/// Most tags one response is recorded under (each costs a write to L2).
const MAX_TAGS: usize = 32;
