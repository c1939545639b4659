//! [`StoredOnly`]: a request answered from storage or not at all, asked by
//! the server in front rather than by the client.

/// A request extension: answer this request from storage or not at all,
/// as `Cache-Control: only-if-cached` asks (RFC 9111 §5.2.1.7), without
/// that field reaching anyone. [`Anywhere`](Self::Anywhere) reads L1, then
/// L2; [`L1`](Self::L1) answers on the spot or not at all (no wait on
/// Valkey). Nothing stored answering it, the cache answers 504 itself,
/// marked [`NothingStored`], and never calls the inner service for it. A
/// stale L1 entry within its stale-while-revalidate window is answered,
/// and the refresh it starts (which goes to the origin) runs without the
/// mark.
///
/// A server at its bound on requests in flight sets it to answer the hits
/// it holds while it refuses the rest (the proxy's
/// `--max-requests-in-flight` sets `L1`). A GET or HEAD the cache bypasses
/// (a cookie, credentials, a body) is answered as nothing stored. A
/// request the cache does not look up at all (a method other than GET and
/// HEAD, a path a [`PathLayer`](crate::PathLayer) does not cache, a layer
/// with no route) reaches the inner service still carrying it, for that
/// service to refuse.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use tiercache_core::{Policy, TieredCache};
/// use tiercache_http::{NothingStored, ResponseCacheLayer, StoredOnly};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cache = ResponseCacheLayer::new(TieredCache::builder().build()?)
///     .route(Policy::ttl(Duration::from_secs(30)))?;
/// let origin = service_fn(|_: http::Request<String>| async {
///     Ok::<_, Infallible>(http::Response::new("report".to_string()))
/// });
/// let service = cache.layer(origin);
/// let ask = |stored_only: Option<StoredOnly>| {
///     let mut req = http::Request::get("http://example.com/report").body(String::new()).unwrap();
///     if let Some(mark) = stored_only {
///         req.extensions_mut().insert(mark);
///     }
///     req
/// };
/// // Nothing stored yet: a 504, the origin never asked.
/// let answer = service.clone().oneshot(ask(Some(StoredOnly::L1))).await?;
/// assert_eq!(answer.status(), 504);
/// assert!(answer.extensions().get::<NothingStored>().is_some());
/// // Stored by a request of its own, then answered from storage.
/// service.clone().oneshot(ask(None)).await?;
/// let answer = service.oneshot(ask(Some(StoredOnly::Anywhere))).await?;
/// assert_eq!(answer.status(), 200);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredOnly {
    /// From L1, then L2 (as `only-if-cached`).
    Anywhere,
    /// From L1 alone: answered on the spot, or the 504 at once.
    L1,
}

/// A response extension on the cache's own 504 to a request asked from
/// storage only (`only-if-cached`, or [`StoredOnly`]) that nothing stored
/// answers: the server in front may replace it with its own answer. (The
/// proxy's upstream forwarder puts it on its 503 to a marked request it
/// does not send, for the same reason.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NothingStored;

/// The [`StoredOnly`] mark `parts` carries, if any (a map lookup: kept off
/// the hit path).
pub(crate) fn stored_only(parts: &http::request::Parts) -> Option<StoredOnly> {
    parts.extensions.get::<StoredOnly>().copied()
}
