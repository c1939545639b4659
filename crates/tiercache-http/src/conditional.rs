//! A client's validators (`If-None-Match`, `If-Modified-Since`): taken off
//! a cacheable request and answered from the stored entry (RFC 9111
//! §4.3.2), so the origin sends a full response the cache can store.

use std::time::SystemTime;

use http::HeaderMap;
use http::header::{IF_MODIFIED_SINCE, IF_NONE_MATCH};

use crate::freshness::parse_http_date;

/// The client's validators, taken off the request before it goes to the
/// origin (which then sends a full response the cache can store) and
/// answered from the entry.
#[derive(Debug, Default, Clone)]
pub(crate) struct Conditional {
    if_none_match: Option<Vec<u8>>,
    if_modified_since: Option<SystemTime>,
}

impl Conditional {
    pub(crate) fn take(headers: &mut HeaderMap) -> Self {
        let mut if_none_match: Option<Vec<u8>> = None;
        for v in headers.get_all(IF_NONE_MATCH) {
            let list = if_none_match.get_or_insert_with(Vec::new);
            if !list.is_empty() {
                list.push(b',');
            }
            list.extend_from_slice(v.as_bytes());
        }
        let if_modified_since = headers
            .get(IF_MODIFIED_SINCE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_http_date);
        headers.remove(IF_NONE_MATCH);
        headers.remove(IF_MODIFIED_SINCE);
        Self {
            if_none_match,
            if_modified_since,
        }
    }

    /// Whether the client's copy is current (RFC 9110 §13.2.2): `If-None-Match`
    /// by weak comparison with `etag`, else `If-Modified-Since` against
    /// `last_modified`.
    pub(crate) fn not_modified(
        &self,
        etag: Option<&[u8]>,
        last_modified: Option<SystemTime>,
    ) -> bool {
        if let Some(list) = &self.if_none_match {
            if list.trim_ascii() == b"*" {
                return true;
            }
            let Some(etag) = etag else { return false };
            let ours = opaque(etag);
            // A list of entity-tags, split outside their quotes: an opaque
            // tag may hold a comma (`"a,b"`).
            return crate::cache_control::list_items(list).any(|tag| opaque(tag) == ours);
        }
        match (self.if_modified_since, last_modified) {
            (Some(since), Some(modified)) => modified <= since,
            _ => false,
        }
    }

    /// Whether the client sent a validator at all (the hit path skips the check otherwise).
    pub(crate) fn is_empty(&self) -> bool {
        self.if_none_match.is_none() && self.if_modified_since.is_none()
    }
}

/// An entity tag without its weakness prefix.
pub(crate) fn opaque(tag: &[u8]) -> &[u8] {
    let tag = tag.trim_ascii();
    tag.strip_prefix(b"W/").unwrap_or(tag)
}
