//! The response head an entry answers with, built once per entry and
//! shared by every hit (see [`Entry::view`]).

use std::time::SystemTime;

use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, DATE, ETAG, LAST_MODIFIED};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tiercache_core::Entry;

use super::{OWN_FIELDS, accepts_encoding};
use crate::cache_control::{has_directive, targeted};
use crate::cacheable::varies_on;
use crate::freshness::parse_http_date;
use crate::key::known_coding;
use crate::request::Conditional;

/// A stored value as a response head, built once per entry (see
/// [`Entry::view`]), with what the cache needs to know about it.
pub(crate) struct HeadView {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    /// `no-cache`: revalidate before every reuse.
    pub(crate) revalidate: bool,
    /// A `Content-Encoding` the entry was not varied on: only clients that
    /// accept it may get this entry.
    pub(crate) encoding: Option<HeaderValue>,
    etag: Option<HeaderValue>,
    /// `Last-Modified`, else `Date`, else when it was stored: what
    /// `If-Modified-Since` is weighed against.
    last_modified: Option<SystemTime>,
    /// Small enough for a thread to keep its finished head (see `labelled`).
    pub(super) keepable: bool,
}

impl HeadView {
    /// Whether a request with these headers may get this entry, as far as
    /// the entry's content coding goes.
    pub(crate) fn encoding_fits(&self, request: &HeaderMap) -> bool {
        match &self.encoding {
            None => true,
            Some(coding) => accepts_encoding(request, coding.as_bytes()),
        }
    }

    /// Whether `conditional` is answered with a 304 (only a stored 200 is).
    pub(crate) fn not_modified(&self, conditional: &Conditional) -> bool {
        self.status == StatusCode::OK
            && !conditional.is_empty()
            && conditional
                .not_modified(self.etag.as_ref().map(|v| v.as_bytes()), self.last_modified)
    }
}

/// Whether `response`, varied on `Accept-Encoding`, is in a known coding
/// its `request` did not accept (an origin that reads `gzip;q=0` as
/// `gzip`): a hit on such an entry is not checked against the coding (its
/// variant is taken to settle it), so it must not be stored for that
/// variant, which clients that cannot decode it share.
pub(crate) fn coding_refused(request: &HeaderMap, response: &HeaderMap) -> bool {
    response.get(CONTENT_ENCODING).is_some_and(|coding| {
        let coding = coding.as_bytes().trim_ascii();
        known_coding(coding)
            && varies_on(response, b"accept-encoding")
            && !accepts_encoding(request, coding)
    })
}

/// The view of `entry`, built on first use with `targets` (RFC 9213 fields).
// On every L1 hit: inlined into the application's crate too.
#[inline]
pub(crate) fn view<'a>(entry: &'a Entry, targets: &[HeaderName]) -> ViewRef<'a> {
    match entry.view(|e| head_view(e, targets)) {
        Some(view) => ViewRef::Shared(view),
        None => ViewRef::Owned(Box::new(head_view(entry, targets))),
    }
}

/// A [`HeadView`] borrowed from the entry, or built for one use.
pub(crate) enum ViewRef<'a> {
    Shared(&'a HeadView),
    Owned(Box<HeadView>),
}

impl std::ops::Deref for ViewRef<'_> {
    type Target = HeadView;
    fn deref(&self) -> &HeadView {
        match self {
            ViewRef::Shared(v) => v,
            ViewRef::Owned(v) => v,
        }
    }
}

fn head_view(entry: &Entry, targets: &[HeaderName]) -> HeadView {
    let value = entry.value();
    let mut headers = HeaderMap::with_capacity(value.headers.len() + 1 + OWN_FIELDS.len());
    for (name, v) in &value.headers {
        // Stored values were valid header fields when they were stored; one
        // that is not (a foreign or damaged entry) is dropped, not emitted.
        if let (Ok(name), Ok(v)) = (
            HeaderName::from_bytes(name),
            HeaderValue::from_maybe_shared(v.clone()),
        ) {
            headers.append(name, v);
        }
    }
    let revalidate = has_directive(&targeted(&headers, targets), "no-cache");
    let varied_on_encoding = varies_on(&headers, b"accept-encoding");
    // The coding decides who may get the entry, unless its variant already
    // does: a known coding varied on `Accept-Encoding`. Unknown codings
    // share one variant (so a client cannot mint variants), so theirs is
    // checked still.
    let encoding = headers
        .get(CONTENT_ENCODING)
        .filter(|c| {
            let c = c.as_bytes().trim_ascii();
            let settled_by_variant = varied_on_encoding && known_coding(c);
            !c.eq_ignore_ascii_case(b"identity") && !settled_by_variant
        })
        .cloned();
    let etag = headers.get(ETAG).cloned();
    let time = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_http_date)
    };
    // What `If-Modified-Since` is weighed against: `Last-Modified`, else
    // the stored `Date`, else the time it was stored (RFC 9111 §4.3.2).
    let last_modified = time(LAST_MODIFIED)
        .or_else(|| time(DATE))
        .or(Some(entry.times().created_at));
    // The body is stored whole, so its length is known: framing the answer
    // here spares the server inserting it into the cloned map on every hit
    // (which, with no spare room in a clone, regrows the map). A stored
    // length that disagrees with the body is replaced.
    headers.insert(CONTENT_LENGTH, HeaderValue::from(value.body.len()));
    // Placeholders for the cache's own fields: a hit then overwrites values in
    // place instead of regrowing the cloned map (a clone has no spare room).
    // Removed first (an upstream cache's `x-cache`, say), so that they are the
    // map's last fields, in order (see `set_own_fields`).
    for name in &OWN_FIELDS {
        headers.remove(name);
    }
    for name in &OWN_FIELDS {
        headers.insert(name.clone(), HeaderValue::from_static(""));
    }
    let head_bytes: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    HeadView {
        keepable: head_bytes <= super::labelled::MAX_HEAD_BYTES
            && headers.len() <= super::labelled::MAX_HEAD_FIELDS,
        status: StatusCode::from_u16(value.status).unwrap_or(StatusCode::OK),
        // A clone holds no spare room: the view lives as long as its entry,
        // and a map sized for growth cost ~700 bytes more per entry.
        headers: headers.clone(),
        revalidate,
        encoding,
        etag,
        last_modified,
    }
}
