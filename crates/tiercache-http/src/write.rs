//! Unsafe methods: the request passes through, and when it succeeds the
//! URLs it names are invalidated everywhere (RFC 9111 §4.4).

use std::sync::Arc;

use http::{HeaderValue, Response};

use crate::body::CacheBody;
use crate::cacheable::Reason;
use crate::headers::{Outcome, X_CACHE_INVALIDATION};
use crate::invalidate::{Target, location_keys};
use crate::key::{family_tag, path_prefix_pattern};
use crate::paths::Invalidate;
use crate::route::Route;
use tiercache_core::CacheKey;

/// Awaits the origin's answer to an unsafe request; when it succeeds (2xx,
/// 3xx) the target URI and any same-origin `Location` / `Content-Location`
/// are invalidated in L1 and L2 before the response is returned, with
/// whatever `also` names. Loads of
/// those URLs already in flight are not stored (the engine's journal).
///
/// What the response waits for: this instance's L1, always; the shared
/// tier, within its bound (a few command timeouts). When that bound passes
/// the invalidation is queued and retried until it lands, this instance
/// stops answering from the L2 copies it covers, and the response says
/// `x-cache-invalidation: queued` (else `done`).
pub(crate) async fn write_through<F, ResB, E>(
    route: Arc<Route>,
    future: F,
    mut keys: Vec<CacheKey>,
    request: Target,
    also: Vec<Invalidate>,
) -> Result<Response<CacheBody<ResB>>, E>
where
    F: std::future::Future<Output = Result<Response<ResB>, E>>,
{
    let res = future.await?;
    let mut invalidated = None;
    if res.status().is_success() || res.status().is_redirection() {
        keys.extend(location_keys(res.headers(), &request));
        // In a task of its own: a client that goes away while these are
        // sent must not leave the rest undone (here and everywhere).
        let work = invalidate_all(route.clone(), keys, request, also);
        let queued = tiercache_core::outliving_the_caller(work, true).await;
        invalidated = Some(if queued { "queued" } else { "done" });
    }
    let mut res = res.map(CacheBody::stream);
    route.label(res.headers_mut(), &Outcome::Bypass(Reason::Method));
    if route.config.emit_headers
        && let Some(how) = invalidated
    {
        res.headers_mut()
            .insert(X_CACHE_INVALIDATION, HeaderValue::from_static(how));
    }
    Ok(res)
}

/// Invalidates what a write names: each URL (one message per URL: its key
/// and the variants this instance knows, with its family tag, under which
/// the shared tier recorded the variants other instances stored), then
/// `also`. Whether any was queued rather than landed.
async fn invalidate_all(
    route: Arc<Route>,
    keys: Vec<CacheKey>,
    request: Target,
    also: Vec<Invalidate>,
) -> bool {
    let mut queued = false;
    for key in keys {
        let mut known = route.variants.take(&key);
        let tag = family_tag(&key);
        known.push(key);
        queued |= route
            .engine
            .invalidate_tag_and_keys(tag, &known)
            .await
            .is_err();
    }
    for what in also {
        let done = match what {
            Invalidate::Tag(tag) => route.engine.invalidate_tag(tag).await,
            // On each spelling of the target's origin, as its URL.
            Invalidate::PathPrefix(prefix) => {
                let mut done = Ok(());
                for uri in request.uris_of(&prefix) {
                    let landed = route
                        .engine
                        .invalidate_prefix(path_prefix_pattern(&uri))
                        .await;
                    done = done.and(landed);
                }
                done
            }
        };
        queued |= done.is_err();
    }
    queued
}
