//! The admin address: the dashboard at `/`, `/stats`, `/metrics` and
//! `POST /invalidate`.

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use http::Uri;
use tiercache_http::ResponseCacheLayer;

/// What the admin endpoints work on.
#[derive(Clone)]
pub(crate) struct Admin {
    pub(crate) layer: ResponseCacheLayer,
    pub(crate) prometheus: metrics_exporter_prometheus::PrometheusHandle,
}

/// The admin endpoints over `admin`'s layer, and the dashboard.
pub(crate) fn router(admin: Admin) -> Router {
    let dashboard = tiercache_dashboard::router(admin.layer.engine());
    Router::new()
        .route(
            "/stats",
            get(|State(admin): State<Admin>| async move {
                axum::Json(admin.layer.engine().stats())
            }),
        )
        .route(
            "/metrics",
            get(|State(admin): State<Admin>| async move {
                admin.layer.publish_metrics();
                (
                    [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    admin.prometheus.render(),
                )
            }),
        )
        .route("/invalidate", axum::routing::post(invalidate))
        .with_state(admin)
        // `/` (the page), `/api/stats`, `/api/horizon`.
        .merge(dashboard)
}

/// What `POST /invalidate` takes: exactly one of them.
#[derive(Debug, serde::Deserialize)]
struct InvalidateQuery {
    /// A URL (`http://host/path?q`) or a path (`/path?q`, any host).
    key: Option<String>,
    /// A tag (surrogate key).
    tag: Option<String>,
    /// A path prefix (`/products/`), or an absolute URL prefix.
    prefix: Option<String>,
}

/// `POST /invalidate?key=URL|tag=TAG|prefix=PATH`: drops the matching
/// entries from L1, Valkey and every instance's L1 before answering `200
/// invalidated`; when Valkey cannot be reached in time, this instance's L1
/// is clean, the invalidation is queued and retried until it lands, and the
/// answer is `202 queued`.
async fn invalidate(
    State(Admin { layer, .. }): State<Admin>,
    axum::extract::Query(q): axum::extract::Query<InvalidateQuery>,
) -> (http::StatusCode, String) {
    let bad = |msg: String| (http::StatusCode::BAD_REQUEST, msg + "\n");
    let uri = |name: &str, value: &str| {
        value
            .parse::<Uri>()
            .ok()
            .filter(|u| u.path().starts_with('/'))
            .ok_or_else(|| {
                bad(format!(
                    "{name}=`{value}` is not a URL or a path starting with /"
                ))
            })
    };
    let done = match (q.key, q.tag, q.prefix) {
        (Some(key), None, None) => match uri("key", &key) {
            Ok(u) => layer.invalidate_url(&u).await,
            Err(e) => return e,
        },
        (None, Some(tag), None) if !tag.is_empty() => layer.invalidate_tag(tag).await,
        (None, None, Some(prefix)) => match uri("prefix", &prefix) {
            Ok(u) => layer.invalidate_path_prefix(&u).await,
            Err(e) => return e,
        },
        _ => return bad("give exactly one of key=URL, tag=TAG, prefix=PATH".into()),
    };
    match done {
        Ok(()) => (http::StatusCode::OK, "invalidated\n".into()),
        Err(queued) => (http::StatusCode::ACCEPTED, format!("queued: {queued}\n")),
    }
}
