//! A 304 to a revalidation: whether it renews the stored response (RFC
//! 9111 §4.3.4), and the head it leaves when it does.

use std::time::Duration;

use bytes::Bytes;
use http::header::{ETAG, HeaderName, HeaderValue, LAST_MODIFIED};
use http::{HeaderMap, Response, StatusCode, response};
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
        let outdated = CacheKey::from_full(stale.key().clone());
        if !selects(&parts.headers, stale.value()) {
            // The origin's current version is another, whose body the
            // cache does not have: neither body may answer under the
            // other's validator.
            self.drop_outdated(&outdated).await;
            let mut res = Response::new(CacheBody::full(Bytes::from_static(
                b"the origin answered 304 Not Modified with a validator the cache did not send\n",
            )));
            *res.status_mut() = StatusCode::BAD_GATEWAY;
            route.metrics.origin(self.started.elapsed());
            route.metrics.not_stored(Reason::Status);
            return Loaded::Pass {
                output: (res, Reason::Status),
                failed: false,
                uncacheable: false,
            };
        }
        let merged = merge_not_modified(stale.value(), &parts.headers);
        let status = StatusCode::from_u16(stale.value().status).unwrap_or(StatusCode::OK);
        let cache_control = targeted(&merged, &route.config.targets);
        let storable = response_storable(status, &merged, &cache_control, self.credentialed);
        drop(cache_control);
        if let Err(reason) = storable {
            self.drop_outdated(&outdated).await;
            parts.status = status;
            parts.headers = merged;
            let body = CacheBody::full(stale.value().body.clone());
            // (`pass` counts the origin's time.)
            return self.pass(parts, body, reason);
        }
        route.metrics.origin(self.started.elapsed());
        Loaded::Store(renew(route, stale, merged))
    }

    /// Drops a stored response a 304 did not renew, everywhere: under its
    /// own key and, for a `Vary` variant, under the URL's key too, where the
    /// same fill may have stored it.
    async fn drop_outdated(&self, outdated: &CacheKey) {
        let _ = self.route.engine.invalidate(outdated).await;
        if outdated.full() != self.primary.full() {
            let _ = self.route.engine.invalidate(self.primary).await;
        }
    }
}

/// Whether a 304's validators select the stored response (RFC 9111
/// §4.3.4): its `ETag` matches the stored one (weak comparison); without
/// one, its `Last-Modified` is the stored one; a 304 with neither selects it.
fn selects(not_modified: &HeaderMap, stored: &Value) -> bool {
    let stored_field = |name: &HeaderName| {
        stored
            .headers
            .iter()
            .find(|(n, _)| n.as_ref() == name.as_str().as_bytes())
            .map(|(_, v)| v.as_ref())
    };
    if let Some(etag) = not_modified.get(ETAG) {
        return stored_field(&ETAG).is_some_and(|s| opaque(s) == opaque(etag.as_bytes()));
    }
    if let Some(modified) = not_modified.get(LAST_MODIFIED) {
        return stored_field(&LAST_MODIFIED)
            .is_some_and(|s| s.trim_ascii() == modified.as_bytes().trim_ascii());
    }
    true
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
                .no_stale(origin.no_stale)
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
