//! The cache's response headers (`x-cache`, `x-cache-tier`, `x-cache-hit-ratio`,
//! `cache-status`, `age`) and the conversion between stored values and responses.

use std::fmt::Write as _;
use std::time::SystemTime;

use http::header::{
    ACCEPT_ENCODING, AGE, CACHE_CONTROL, CONNECTION, CONTENT_LOCATION, DATE, ETAG, EXPIRES,
    LAST_MODIFIED, VARY,
};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tiercache_core::{Entry, Freshness, Source};

use crate::body::CacheBody;
use crate::cacheable::Reason;
use crate::values;

mod labelled;
mod stored;
mod view;
pub use stored::{NEVER_STORED, to_value};
pub(crate) use view::{HeadView, coding_refused, view};

/// `x-cache`: `HIT`, `MISS`, `STALE`, `BYPASS`.
pub const X_CACHE: HeaderName = HeaderName::from_static("x-cache");
/// `x-cache-tier`: `l1`, `l2`, `origin`.
pub const X_CACHE_TIER: HeaderName = HeaderName::from_static("x-cache-tier");
/// `x-cache-hit-ratio`: this instance's hit ratio so far, `0.0000`..`1.0000`.
pub const X_CACHE_HIT_RATIO: HeaderName = HeaderName::from_static("x-cache-hit-ratio");
/// `x-cache-invalidation` on a successful unsafe request: `done` (every
/// tier), or `queued` (this instance's L1; the shared tier retried until it
/// lands).
pub const X_CACHE_INVALIDATION: HeaderName = HeaderName::from_static("x-cache-invalidation");
/// RFC 9211 `cache-status`.
pub const CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");

/// The cache name in `cache-status`.
pub const CACHE_NAME: &str = "tiercache";

/// What the cache did for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Answered from a tier; `collapsed` when it waited on another request's load.
    Hit {
        /// `l1` or `l2`.
        tier: Source,
        /// Fresh seconds left.
        ttl: u64,
        /// Whether it waited on another request's load.
        collapsed: bool,
    },
    /// Answered by the origin; `stored` tells whether the response was cached,
    /// `reason` why not.
    Miss {
        /// Whether the response was stored.
        stored: bool,
        /// Why it was not stored.
        reason: Option<Reason>,
        /// Whether it waited on another request's load.
        collapsed: bool,
        /// The shared tier was unavailable (its circuit breaker open), so it
        /// was not asked: `detail=l2-down` when no other reason is given.
        l2_down: bool,
    },
    /// A stale entry answered (stale-while-revalidate, or the origin failed or was slow).
    Stale {
        /// The tier the stale copy came from (L2: a first load found
        /// another instance's copy inside its stale-while-revalidate window).
        tier: Source,
        /// Its freshness left, negative: stale by this many seconds
        /// (rounded away from zero, so a copy stale at all says so).
        ttl: i64,
        /// Whether it came with another request's load (a follower's).
        collapsed: bool,
        /// Why, when not stale-while-revalidate: `origin-error`, `origin-timeout`.
        detail: Option<&'static str>,
    },
    /// The cache was skipped.
    Bypass(Reason),
    /// The request asked for a stored response only (`only-if-cached`) and
    /// nothing stored answers it: a 504, the origin not asked.
    NotCached,
}

impl Outcome {
    /// Records the outcome and tier on the current `tiercache` span (a
    /// no-op when tracing is off or the span has no such fields).
    pub(crate) fn trace(&self) {
        let span = tracing::Span::current();
        if !span.is_disabled() {
            span.record("outcome", self.x_cache());
            span.record("tier", self.tier().map_or("none", |tier| tier.as_str()));
        }
    }

    fn x_cache(&self) -> &'static str {
        match self {
            Outcome::Hit { .. } => "HIT",
            Outcome::Miss { .. } => "MISS",
            Outcome::Stale { .. } => "STALE",
            Outcome::Bypass(_) => "BYPASS",
            Outcome::NotCached => "MISS",
        }
    }

    /// The tier that answered; none for a request nothing answered.
    fn tier(&self) -> Option<Source> {
        match self {
            Outcome::Hit { tier, .. } => Some(*tier),
            Outcome::Stale { tier, .. } => Some(*tier),
            Outcome::NotCached => None,
            _ => Some(Source::Origin),
        }
    }

    /// The RFC 9211 `cache-status` value (never the key).
    pub fn cache_status(&self) -> String {
        let mut s = String::with_capacity(48);
        s.push_str(CACHE_NAME);
        match self {
            Outcome::Hit {
                tier,
                ttl,
                collapsed,
            } => {
                let _ = write!(s, "; hit; ttl={ttl}; detail={}", tier.as_str());
                if *collapsed {
                    s.push_str("; collapsed");
                }
            }
            Outcome::Miss {
                stored,
                reason,
                collapsed,
                l2_down,
            } => {
                s.push_str("; fwd=miss");
                if *stored {
                    s.push_str("; stored");
                }
                if *collapsed {
                    s.push_str("; collapsed");
                }
                match reason {
                    Some(r) => {
                        let _ = write!(s, "; detail={}", r.as_str());
                    }
                    None if *l2_down => s.push_str("; detail=l2-down"),
                    None => {}
                }
            }
            // Inside stale-while-revalidate the request was answered from
            // the cache, not forwarded (the refresh is not its own): a
            // hit, whose negative ttl says it is stale (RFC 9211 §2.1).
            Outcome::Stale {
                tier,
                ttl,
                collapsed,
                detail: None,
            } => {
                let _ = write!(s, "; hit; ttl={ttl}; detail={}", tier.as_str());
                if *collapsed {
                    s.push_str("; collapsed");
                }
            }
            // Forwarded because stale, and answered stale as the origin
            // failed or was slow.
            Outcome::Stale {
                detail: Some(d), ..
            } => {
                let _ = write!(s, "; fwd=stale; detail={d}");
            }
            Outcome::Bypass(reason) => {
                let _ = write!(s, "; fwd=bypass; detail={}", reason.as_str());
            }
            // Neither a hit nor forwarded (RFC 9211 has no parameter for it).
            Outcome::NotCached => s.push_str("; detail=only-if-cached"),
        }
        s
    }
}

/// The `ttl` of a copy whose freshness ended at `fresh_until`, seen at
/// `now`: negative, rounded away from zero (a copy stale by 0.4 s is -1).
pub(crate) fn stale_ttl(fresh_until: std::time::SystemTime, now: std::time::SystemTime) -> i64 {
    let past = now.duration_since(fresh_until).unwrap_or_default();
    let whole = i64::try_from(past.as_secs()).unwrap_or(i64::MAX - 1);
    -(whole + i64::from(past.subsec_nanos() > 0))
}

/// Writes the cache headers for `outcome` into `headers`.
pub fn apply(headers: &mut HeaderMap, outcome: &Outcome, hit_ratio: f64) {
    let names = [X_CACHE, X_CACHE_TIER, X_CACHE_HIT_RATIO, CACHE_STATUS];
    for (name, value) in names.into_iter().zip(own_values(outcome, hit_ratio)) {
        if let Some(value) = value {
            set(headers, name, value);
        }
    }
}

/// `x-cache`, `x-cache-tier`, `x-cache-hit-ratio` and `cache-status` for
/// `outcome` (the last from a static table for the common L1 hit).
fn own_values(outcome: &Outcome, hit_ratio: f64) -> [Option<HeaderValue>; 4] {
    let tabled = match outcome {
        Outcome::Hit {
            tier: Source::L1,
            ttl,
            collapsed: false,
        } => Some(values::l1_hit_status(*ttl)),
        _ => None,
    };
    [
        Some(HeaderValue::from_static(outcome.x_cache())),
        outcome
            .tier()
            .map(|tier| HeaderValue::from_static(tier.as_str())),
        Some(values::hit_ratio(hit_ratio)),
        tabled.or_else(|| HeaderValue::try_from(outcome.cache_status()).ok()),
    ]
}

/// Sets this cache's own fields in a map built from an entry's view, where
/// each is a single placeholder, normally its last fields in this order: no
/// hashed look-ups (five of those cost more than the rest of the response).
/// Each slot's name is checked (a cheap compare, not a hash), and a map
/// whose tail is not the placeholders, in whatever order the `http` crate
/// iterates it, is set by name instead: correctness never rests on an
/// order the crate calls unspecified. `None` leaves a placeholder.
fn set_own_fields(headers: &mut HeaderMap, mut own: [Option<HeaderValue>; 5]) {
    let skip = headers.len().saturating_sub(OWN_FIELDS.len());
    if headers.len() >= OWN_FIELDS.len() {
        // One pass: each tail slot is set while its name checks out; at a
        // mismatch the values not yet placed are set by name below (the
        // placed ones are taken, so they are not set twice).
        let mut in_place = true;
        let tail = headers.iter_mut().skip(skip).zip(&OWN_FIELDS).zip(&mut own);
        for (((name, value), own_name), v) in tail {
            if name != own_name {
                in_place = false;
                break;
            }
            if let Some(v) = v.take() {
                *value = v;
            }
        }
        if in_place {
            return;
        }
    }
    for (name, v) in OWN_FIELDS.iter().zip(own) {
        if let Some(v) = v {
            set(headers, name.clone(), v);
        }
    }
}

/// Sets a single-valued field in place when it is there once (a hit's map
/// is a clone with placeholders and no spare room: `insert` would regrow it).
/// A field with several values (an upstream's own) is replaced whole.
fn set(headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
    let mut values = headers.get_all(&name).iter();
    let single = values.next().is_some() && values.next().is_none();
    if single && let Some(slot) = headers.get_mut(&name) {
        *slot = value;
        return;
    }
    headers.insert(name, value);
}

/// The hop-by-hop fields (RFC 9110 §7.6.1), never stored or forwarded.
pub const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
];

/// The field names `Connection` lists (RFC 9110 §7.6.1), in every field.
pub fn connection_options(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter_map(|n| HeaderName::from_bytes(n.trim_ascii()).ok())
        .collect()
}

/// Removes hop-by-hop fields, `upgrade`, and every field named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_options(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(http::header::UPGRADE);
}

/// [`strip_hop_by_hop`], keeping the `Trailer` field: it is end to end
/// (RFC 9110 §6.6.2), and without it hyper sends an HTTP/1 client no
/// trailers.
pub fn strip_hop_by_hop_but_trailer(headers: &mut HeaderMap) {
    let declared: Vec<HeaderValue> = headers
        .get_all(http::header::TRAILER)
        .iter()
        .cloned()
        .collect();
    strip_hop_by_hop(headers);
    for value in declared {
        headers.append(http::header::TRAILER, value);
    }
}

/// Whether `Accept-Encoding` in `request` names `coding` (or `*`) with a
/// non-zero weight. A request without the field gets no coded entry: it may
/// be a client that cannot decode it.
pub fn accepts_encoding(request: &HeaderMap, coding: &[u8]) -> bool {
    let coding = coding.trim_ascii();
    let same = |c: &[u8]| {
        c.eq_ignore_ascii_case(coding)
            || (c.eq_ignore_ascii_case(b"x-gzip") && coding.eq_ignore_ascii_case(b"gzip"))
            || (c.eq_ignore_ascii_case(b"gzip") && coding.eq_ignore_ascii_case(b"x-gzip"))
    };
    let mut star = false;
    for item in request
        .get_all(ACCEPT_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
    {
        let (name, zero) = crate::key::coding_of(item);
        if same(name) {
            return !zero;
        }
        if name == b"*" {
            star = !zero;
        }
    }
    star
}

/// The fields the cache writes on a hit: `age` and the four `emit_headers` ones.
// A static, not a const: a const array is built (and dropped) at every use.
static OWN_FIELDS: [HeaderName; 5] = [AGE, X_CACHE, X_CACHE_TIER, X_CACHE_HIT_RATIO, CACHE_STATUS];

/// The fields a 304 carries from the stored response (RFC 9110 §15.4.5).
static NOT_MODIFIED_FIELDS: [HeaderName; 7] = [
    CACHE_CONTROL,
    CONTENT_LOCATION,
    DATE,
    ETAG,
    EXPIRES,
    VARY,
    LAST_MODIFIED,
];

/// The fields a 304 carries from the full response (RFC 9110 §15.4.5).
pub(crate) fn not_modified_fields(full: &HeaderMap) -> HeaderMap {
    let mut head = HeaderMap::with_capacity(NOT_MODIFIED_FIELDS.len());
    for name in &NOT_MODIFIED_FIELDS {
        for v in full.get_all(name) {
            head.append(name.clone(), v.clone());
        }
    }
    head
}

/// A response from a stored entry, with `age` as of `now`, and the cache's
/// own fields labelled by `outcome` (or left out when `None`). `head` leaves
/// the body out (the headers, `Content-Length` included, stay those of the
/// GET); `not_modified` answers a client's matching validator with a 304.
pub(crate) fn from_entry<B>(
    entry: &Entry,
    view: &HeadView,
    now: SystemTime,
    head: bool,
    not_modified: bool,
    label: Option<(&Outcome, f64)>,
) -> Response<CacheBody<B>> {
    let body = if head || not_modified {
        CacheBody::empty()
    } else {
        CacheBody::full(entry.value().body.clone())
    };
    let age = entry.age(now);
    // A plain L1 hit: a hot entry's finished head is kept per thread.
    let stamp = match label {
        Some((
            &Outcome::Hit {
                tier: Source::L1,
                ttl,
                collapsed: false,
            },
            hit_ratio,
        )) if !not_modified && view.keepable => Some(labelled::Stamp {
            entry: entry.id(),
            age,
            ttl,
            ratio: values::hit_ratio_step(hit_ratio),
        }),
        _ => None,
    };
    let keep = match stamp.map(labelled::recall) {
        Some(labelled::Remembered::Head(headers)) => {
            return response(body, view.status, headers);
        }
        Some(labelled::Remembered::Build(keep)) => keep,
        None => false,
    };
    let (status, mut headers) = if not_modified {
        let mut headers = HeaderMap::with_capacity(NOT_MODIFIED_FIELDS.len() + OWN_FIELDS.len());
        for name in NOT_MODIFIED_FIELDS.iter().chain(&OWN_FIELDS) {
            for v in view.headers.get_all(name) {
                headers.append(name.clone(), v.clone());
            }
        }
        (StatusCode::NOT_MODIFIED, headers)
    } else {
        (view.status, view.headers.clone())
    };
    let age = Some(values::age(age));
    match label {
        Some((outcome, hit_ratio)) => {
            let [x_cache, tier, ratio, status] = own_values(outcome, hit_ratio);
            set_own_fields(&mut headers, [age, x_cache, tier, ratio, status]);
        }
        None => {
            set_own_fields(&mut headers, [age, None, None, None, None]);
            for name in &OWN_FIELDS[1..] {
                headers.remove(name);
            }
        }
    }
    if let Some(stamp) = stamp.filter(|_| keep) {
        labelled::keep(stamp, &headers);
    }
    response(body, status, headers)
}

/// A response of these parts.
fn response<B>(
    body: CacheBody<B>,
    status: StatusCode,
    headers: HeaderMap,
) -> Response<CacheBody<B>> {
    let mut res = Response::new(body);
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res
}

/// Fresh seconds left in `entry` as of `now` (0 once stale).
pub fn ttl_left(entry: &Entry, now: SystemTime) -> u64 {
    match entry.freshness(now) {
        Freshness::Fresh(left) => left.as_secs(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests;
