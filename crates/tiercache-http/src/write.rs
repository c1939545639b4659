//! Unsafe methods: the request passes through, and when it succeeds the
//! URLs it names are invalidated everywhere (RFC 9111 §4.4).

use std::sync::Arc;

use http::Response;

use crate::body::CacheBody;
use crate::cacheable::Reason;
use crate::headers::Outcome;
use crate::invalidate::{Target, location_keys};
use crate::key::family_tag;
use crate::route::Route;
use tiercache_core::CacheKey;

/// Awaits the origin's answer to an unsafe request; when it succeeds (2xx,
/// 3xx) the target URI and any same-origin `Location` / `Content-Location`
/// are invalidated in L1 and L2 before the response is returned. Loads of
/// those URLs already in flight are not stored (the engine's journal).
pub(crate) async fn write_through<F, ResB, E>(
    route: Arc<Route>,
    future: F,
    mut keys: Vec<CacheKey>,
    request: Target,
) -> Result<Response<CacheBody<ResB>>, E>
where
    F: std::future::Future<Output = Result<Response<ResB>, E>>,
{
    let res = future.await?;
    if res.status().is_success() || res.status().is_redirection() {
        keys.extend(location_keys(res.headers(), &request));
        // One message per URL: its key and the variants this instance knows,
        // with its family tag, under which the shared tier recorded the
        // variants other instances stored.
        for key in keys {
            let mut known = route.variants.take(&key);
            let tag = family_tag(&key);
            known.push(key);
            route.engine.invalidate_tag_and_keys(tag, &known).await;
        }
    }
    let mut res = res.map(CacheBody::stream);
    route.label(res.headers_mut(), &Outcome::Bypass(Reason::Method));
    Ok(res)
}
