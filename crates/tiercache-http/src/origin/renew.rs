//! A revalidation: the request that asks it, whether the origin's 304
//! renews the stored response (RFC 9111 §4.3.4), the head it leaves when it
//! does, and the request asked again when it names another version.

use std::time::Duration;

use bytes::Bytes;
use http::header::{
    ETAG, HeaderName, HeaderValue, IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE,
    IF_UNMODIFIED_SINCE, LAST_MODIFIED,
};
use http::{HeaderMap, Request, Response, StatusCode, response};
use tiercache_core::{CacheKey, Entry, Fill, Lifetime, Loaded, Value};

use super::{Load, Passed, fill_for, tags_for};
use crate::body::CacheBody;
use crate::cache_control::targeted;
use crate::cacheable::{Reason, response_storable};
use crate::freshness::OriginFreshness;
use crate::headers::{self, strip_hop_by_hop};
use crate::key::family_of;
use crate::request::opaque;
use crate::route::Route;

impl Load<'_> {
    /// A 304 to a revalidation of `stale`. It renews the stored response
    /// only when its validators select it (RFC 9111 §4.3.4), and the merged
    /// head is judged as any response is: one that sets a cookie, or says
    /// `private`, `no-store` or `Vary: *`, answers this request alone
    /// (with the stored body) and is never stored or shared. When it does
    /// not renew, the stored response is outdated and dropped everywhere.
    pub(super) async fn renewed<ResB>(
        &self,
        mut parts: response::Parts,
        stale: &Entry,
    ) -> Loaded<Passed<ResB>> {
        let route = self.route;
        // Asked without validators (the stored response has none): the
        // 304 answers nothing, and renews nothing.
        if !has_validator(stale.value()) {
            return self.unasked_not_modified(true);
        }
        if !selects(&parts.headers, stale.value()) {
            // This request could not be sent again without its
            // validators (see `asked_again`).
            return self.not_selected(stale).await;
        }
        let merged = merge_not_modified(stale.value(), &parts.headers);
        let status = StatusCode::from_u16(stale.value().status).unwrap_or(StatusCode::OK);
        let cache_control = targeted(&merged, &route.config.targets);
        let storable = response_storable(status, &merged, &cache_control, self.credentialed);
        drop(cache_control);
        if let Err(reason) = storable {
            self.drop_outdated(stale).await;
            parts.status = status;
            parts.headers = merged;
            let body = CacheBody::full(stale.value().body.clone());
            // (`pass` counts the origin's time.)
            return self.pass(parts, body, reason);
        }
        route.metrics.origin(self.started.elapsed());
        Loaded::Store(renew(route, stale, merged))
    }

    /// A 304 that renews nothing: the origin's current version is
    /// another, whose body the cache does not have, and neither body may
    /// answer under the other's validator. The stored response is dropped
    /// and the request answered 502.
    pub(super) async fn not_selected<ResB>(&self, stale: &Entry) -> Loaded<Passed<ResB>> {
        self.drop_outdated(stale).await;
        let mut res = Response::new(CacheBody::full(Bytes::from_static(
            b"the origin answered 304 Not Modified for a version the cache does not have\n",
        )));
        *res.status_mut() = StatusCode::BAD_GATEWAY;
        self.route.metrics.origin(self.started.elapsed());
        self.route.metrics.not_stored(Reason::Status);
        Loaded::Pass {
            output: (res, Reason::Status),
            failed: false,
            uncacheable: false,
        }
    }

    /// A 304 to a load that carried no validators (the client's are taken
    /// off, and the cache adds only a stored response's own: none without
    /// one, or for one that has none, or to a request asked again) answers
    /// nothing (RFC 9110 §15.4.5): a 502, shared with the requests
    /// waiting, so an origin that answers 304 to everything is asked once,
    /// not by each of them. `failed`: a failure a stale copy may stand in
    /// for (not the copy asked again for: that one is outdated).
    pub(super) fn unasked_not_modified<ResB>(&self, failed: bool) -> Loaded<Passed<ResB>> {
        self.route.metrics.origin(self.started.elapsed());
        self.route.metrics.not_stored(Reason::Status);
        let mut value = Value::from_body(Bytes::from_static(
            b"the origin answered 304 Not Modified to a request without validators\n",
        ));
        value.status = StatusCode::BAD_GATEWAY.as_u16();
        Loaded::Share { value, failed }
    }

    /// Drops a stored response a 304 did not renew, everywhere: under its
    /// own key and, for a `Vary` variant, under the URL's key too, where the
    /// same fill may have stored it.
    pub(super) async fn drop_outdated(&self, stale: &Entry) {
        let outdated = CacheKey::from_full(stale.key().clone());
        let _ = self.route.engine.invalidate(&outdated).await;
        if outdated.full() != self.primary.full() {
            let _ = self.route.engine.invalidate(self.primary).await;
        }
    }
}

/// The stored response's field `name`, if it has one.
fn stored_field<'a>(stored: &'a Value, name: &HeaderName) -> Option<&'a Bytes> {
    stored
        .headers
        .iter()
        .find(|(n, _)| n.as_ref() == name.as_str().as_bytes())
        .map(|(_, v)| v)
}

/// Whether a stored response has a validator (`ETag`, `Last-Modified`).
fn has_validator(stored: &Value) -> bool {
    stored_field(stored, &ETAG).is_some() || stored_field(stored, &LAST_MODIFIED).is_some()
}

/// Whether a 304's validators select the stored response (RFC 9111
/// §4.3.4): its `ETag` matches the stored one (weak comparison); without
/// one, its `Last-Modified` is the stored one; a 304 with neither selects it.
pub(super) fn selects(not_modified: &HeaderMap, stored: &Value) -> bool {
    if let Some(etag) = not_modified.get(ETAG) {
        return stored_field(stored, &ETAG).is_some_and(|s| opaque(s) == opaque(etag.as_bytes()));
    }
    if let Some(modified) = not_modified.get(LAST_MODIFIED) {
        return stored_field(stored, &LAST_MODIFIED)
            .is_some_and(|s| s.trim_ascii() == modified.as_bytes().trim_ascii());
    }
    true
}

/// `req` once more, without the client's conditionals, to send when the
/// origin's 304 to a revalidation names another version than the stored
/// one (RFC 9111 §4.3.4: the cache may ask again without validators). Only
/// for request bodies the layer can make empty again (axum's `Body`, an
/// `http-body-util` `Empty` or `Full`, `String`, `Bytes`, `()`): a cached
/// request has none (a GET with a body is not cached), but the type is the
/// service's own. For another (hyper's `Incoming`), the 304 answers 502.
pub(super) fn asked_again<B: 'static>(req: &Request<B>) -> Option<Request<B>> {
    let body = empty_body::<B>()?;
    let mut again = Request::new(body);
    *again.method_mut() = req.method().clone();
    *again.uri_mut() = req.uri().clone();
    *again.version_mut() = req.version();
    *again.headers_mut() = req.headers().clone();
    *again.extensions_mut() = req.extensions().clone();
    unconditional(again.headers_mut());
    Some(again)
}

/// An empty body of type `B`, for the body types the layer knows.
fn empty_body<B: 'static>() -> Option<B> {
    use std::any::Any;
    let mut slot: Option<B> = None;
    let any: &mut dyn Any = &mut slot;
    if let Some(slot) = any.downcast_mut::<Option<axum::body::Body>>() {
        *slot = Some(axum::body::Body::empty());
    } else if let Some(slot) = any.downcast_mut::<Option<http_body_util::Empty<Bytes>>>() {
        *slot = Some(http_body_util::Empty::new());
    } else if let Some(slot) = any.downcast_mut::<Option<http_body_util::Full<Bytes>>>() {
        *slot = Some(http_body_util::Full::default());
    } else if let Some(slot) = any.downcast_mut::<Option<String>>() {
        *slot = Some(String::new());
    } else if let Some(slot) = any.downcast_mut::<Option<Bytes>>() {
        *slot = Some(Bytes::new());
    } else if let Some(slot) = any.downcast_mut::<Option<()>>() {
        *slot = Some(());
    }
    slot
}

/// The request with the client's conditionals replaced by the stale entry's
/// validators, so a 304 can renew it without a body.
pub(super) fn with_validators<B>(req: Request<B>, stale: &Entry) -> Request<B> {
    let (mut parts, body) = req.into_parts();
    unconditional(&mut parts.headers);
    let stored = |name: &HeaderName| {
        stored_field(stale.value(), name)
            .and_then(|v| HeaderValue::from_maybe_shared(v.clone()).ok())
    };
    if let Some(etag) = stored(&ETAG) {
        parts.headers.insert(IF_NONE_MATCH, etag);
    }
    if let Some(modified) = stored(&LAST_MODIFIED) {
        parts.headers.insert(IF_MODIFIED_SINCE, modified);
    }
    Request::from_parts(parts, body)
}

/// `headers` without the client's conditionals (the load's own decide).
pub(super) fn unconditional(headers: &mut HeaderMap) {
    for name in [
        IF_NONE_MATCH,
        IF_MODIFIED_SINCE,
        IF_MATCH,
        IF_UNMODIFIED_SINCE,
        IF_RANGE,
    ] {
        headers.remove(name);
    }
}

/// The stored head updated from a 304's (RFC 9111 §4.3.4): each field the
/// 304 carries replaces the stored one; framing fields are kept.
fn merge_not_modified(old: &Value, not_modified: &HeaderMap) -> HeaderMap {
    let mut merged = HeaderMap::with_capacity(old.headers.len());
    for (n, v) in &old.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n),
            HeaderValue::from_maybe_shared(v.clone()),
        ) {
            merged.append(n, v);
        }
    }
    let mut update = not_modified.clone();
    strip_hop_by_hop(&mut update);
    for framing in [http::header::CONTENT_LENGTH, http::header::CONTENT_ENCODING] {
        update.remove(framing);
    }
    for name in update.keys() {
        merged.remove(name);
    }
    for (n, v) in update.iter() {
        merged.append(n.clone(), v.clone());
    }
    merged
}

/// A 304 renews `stale` with `merged`, its head updated from the 304's
/// (already checked as storable), its body unchanged, a new lifetime drawn.
fn renew(route: &Route, stale: &Entry, merged: HeaderMap) -> Fill {
    let old = stale.value();
    let status = StatusCode::from_u16(old.status).unwrap_or(StatusCode::OK);
    let value = headers::to_value(status, &merged, old.body.clone());
    let cache_control = targeted(&merged, &route.config.targets);
    let fill = match fill_for(route, &cache_control, status) {
        Ok(plan) => plan.fill(value),
        // No freshness left: kept for its validators, under the stale rules
        // its head states (`must-revalidate` forbids stale answers; without
        // them the route's windows would serve it stale).
        Err(_) => {
            let origin = OriginFreshness::parse(&cache_control, route.engine.now());
            Fill::new(value)
                .lifetime(Lifetime::Declared(Duration::from_millis(1)))
                .stale_windows(origin.stale_while_revalidate, origin.stale_if_error)
                // A 4xx/5xx never stale (see `Plan::error`).
                .no_stale(origin.no_stale || status.is_client_error() || status.is_server_error())
        }
    };
    drop(cache_control);
    // Renewed where it was stored (its primary or its variant key).
    let key = CacheKey::from_full(stale.key().clone());
    // In its URL's family as when it was filled (see `family_of`).
    let family = family_of(&key, !stale.variant().is_empty());
    let tags = tags_for(route, &merged, family.as_ref());
    let validator = merged.contains_key(ETAG) || merged.contains_key(LAST_MODIFIED);
    fill.variant(stale.variant().clone())
        .tags(tags)
        .validator(validator)
        .store_under(key)
}
