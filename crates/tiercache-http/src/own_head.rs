//! A request's head copied out of its connection's read buffer, for a
//! request kept while a load runs.
//!
//! hyper parses a head into slices of the buffer it read it in: the URI,
//! every field value (and axum's `OriginalUri`, a clone of the URI). A
//! request kept while its load runs, or while it waits on another's, pins
//! that buffer, and hyper, reading on to see whether the client went,
//! reads into a new one: 8 KiB more for each request in flight. Copied
//! once (one allocation for the field values), the head lets hyper reuse
//! its buffer. A hit answers before hyper reads again: it copies nothing,
//! unless it starts a refresh, which keeps the request.

use axum::extract::OriginalUri;
use http::request::Parts;
use http::{HeaderValue, Uri};

use crate::one_copy::OneCopy;
use crate::service::InnerUri;

/// Copies `parts`' URI (and the URIs kept beside it) and field values
/// into storage of their own.
pub(crate) fn own_head(parts: &mut Parts) {
    let owned = owned_uri(&parts.uri);
    let read = std::mem::replace(&mut parts.uri, owned);
    if let Some(OriginalUri(uri)) = parts.extensions.get_mut::<OriginalUri>() {
        // Most often a clone of the URI itself (axum's): cloned again.
        *uri = if *uri == read {
            parts.uri.clone()
        } else {
            owned_uri(uri)
        };
    }
    if let Some(InnerUri(uri)) = parts.extensions.get_mut::<InnerUri>() {
        *uri = owned_uri(uri);
    }
    let size = parts.headers.values().map(HeaderValue::len).sum();
    let mut room = OneCopy::with_capacity(size);
    // One pass: each value copied as it is replaced (no order of the
    // map's two iterators relied on).
    for value in parts.headers.values_mut() {
        // The same bytes, valid as they were.
        if let Ok(mut owned) = HeaderValue::from_maybe_shared(room.copy(value.as_bytes())) {
            owned.set_sensitive(value.is_sensitive());
            *value = owned;
        }
    }
}

/// `uri` in storage of its own, exactly its size (as it is, should it not
/// parse again).
fn owned_uri(uri: &Uri) -> Uri {
    let text = uri.to_string();
    Uri::from_maybe_shared(bytes::Bytes::copy_from_slice(text.as_bytes()))
        .unwrap_or_else(|_| uri.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_the_same_in_storage_of_its_own() {
        let read = bytes::Bytes::from_static(b"/a/b?c=d secret text/html");
        let uri = Uri::from_maybe_shared(read.slice(0..8)).unwrap();
        let mut req = http::Request::get(uri.clone()).body(()).unwrap();
        let mut token = HeaderValue::from_maybe_shared(read.slice(9..15)).unwrap();
        token.set_sensitive(true);
        req.headers_mut().insert("authorization", token);
        req.headers_mut().append(
            "accept",
            HeaderValue::from_maybe_shared(read.slice(16..)).unwrap(),
        );
        req.headers_mut()
            .append("accept", HeaderValue::from_static("*/*"));
        req.extensions_mut().insert(OriginalUri(uri));
        let (mut parts, ()) = req.into_parts();
        let before = (parts.uri.clone(), parts.headers.clone());
        own_head(&mut parts);
        assert_eq!((parts.uri.clone(), parts.headers.clone()), before);
        assert!(parts.headers["authorization"].is_sensitive());
        let OriginalUri(original) = parts.extensions.get::<OriginalUri>().unwrap();
        assert_eq!(original, &before.0);
        // Nothing points into the bytes read any more.
        let range = read.as_ptr_range();
        let within = |p: *const u8| range.contains(&p);
        assert!(!within(parts.uri.path().as_ptr()));
        assert!(!within(original.path().as_ptr()));
        assert!(
            parts
                .headers
                .values()
                .all(|v| !within(v.as_bytes().as_ptr()))
        );
    }
}
