//! The admin address: the dashboard at `/`, `/stats`, `/metrics` and
//! `POST /invalidate`.

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock};

use http::header::{AUTHORIZATION, ORIGIN, WWW_AUTHENTICATE};
use http::{HeaderValue, Uri};
use tiercache_http::ResponseCacheLayer;

use crate::AdminToken;

/// What the admin endpoints work on.
#[derive(Clone)]
pub(crate) struct Admin {
    pub(crate) prometheus: metrics_exporter_prometheus::PrometheusHandle,
    /// What the last start or reload set.
    pub(crate) live: Arc<RwLock<AdminLive>>,
}

/// What a reload changes under the admin endpoints.
#[derive(Clone)]
pub(crate) struct AdminLive {
    /// The defaults' layer (`POST /invalidate` keys as it does).
    pub(crate) layer: ResponseCacheLayer,
    /// What `POST /invalidate` asks for (none: loopback clients only).
    pub(crate) token: Option<AdminToken>,
}

impl Admin {
    fn live(&self) -> AdminLive {
        self.live.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The admin endpoints over `admin`'s layer, and the dashboard.
pub(crate) fn router(admin: Admin) -> Router {
    let dashboard = tiercache_dashboard::router(admin.live().layer.engine());
    Router::new()
        .route(
            "/stats",
            get(|State(admin): State<Admin>| async move {
                axum::Json(admin.live().layer.engine().stats())
            }),
        )
        .route(
            "/metrics",
            get(|State(admin): State<Admin>| async move {
                admin.live().layer.publish_metrics();
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
/// answer is `202 queued`. Only for a client [`allowed`] to.
async fn invalidate(
    State(admin): State<Admin>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>,
    headers: http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<InvalidateQuery>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let AdminLive { layer, token } = admin.live();
    // A browser page on this machine can send a simple cross-site POST to
    // a loopback address: a request from a page is never "this machine".
    let from_a_page = headers.contains_key(ORIGIN);
    let peer = peer.ip();
    if let Err(refused) = allowed(
        peer,
        from_a_page,
        headers.get(AUTHORIZATION),
        token.as_ref(),
    ) {
        return refused.into_response();
    }
    run_invalidation(layer, q).await.into_response()
}

/// Why a client may not invalidate.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// A token is set, and the client did not send it (401).
    NoToken,
    /// No token is set, and the client is on another machine, or is a
    /// browser's page (403).
    NotLocal,
}

impl axum::response::IntoResponse for Refused {
    fn into_response(self) -> axum::response::Response {
        match self {
            Refused::NoToken => (
                http::StatusCode::UNAUTHORIZED,
                [(WWW_AUTHENTICATE, r#"Bearer realm="tiercache-admin""#)],
                "POST /invalidate needs `Authorization: Bearer` and the admin token\n",
            )
                .into_response(),
            Refused::NotLocal => (
                http::StatusCode::FORBIDDEN,
                "POST /invalidate from another machine, or from a browser's page, needs an admin token (set TIERCACHE_ADMIN_TOKEN, or admin_token in the config file)\n",
            )
                .into_response(),
        }
    }
}

/// Whether a client at `peer` sending `authorization` may invalidate: with
/// a `token`, whoever sends it as a bearer credential; without one, a
/// client on this machine that is not a browser's page (`from_a_page`: it
/// sent `Origin`). Behind a proxy or sidecar on the same machine, every
/// client looks local: set a token there.
fn allowed(
    peer: IpAddr,
    from_a_page: bool,
    authorization: Option<&HeaderValue>,
    token: Option<&AdminToken>,
) -> Result<(), Refused> {
    match token {
        Some(token) => {
            // The scheme's name is case blind (RFC 9110 §11.1).
            let given = authorization.map(HeaderValue::as_bytes).and_then(|v| {
                let (scheme, rest) = v.split_at_checked(7)?;
                scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
            });
            if given.is_some_and(|given| token.matches(given.trim_ascii())) {
                Ok(())
            } else {
                Err(Refused::NoToken)
            }
        }
        None if peer.to_canonical().is_loopback() && !from_a_page => Ok(()),
        None => Err(Refused::NotLocal),
    }
}

/// Runs the invalidation `q` names.
async fn run_invalidation(
    layer: ResponseCacheLayer,
    q: InvalidateQuery,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> AdminToken {
        AdminToken::new("0123456789abcdef-token").unwrap()
    }

    fn status(result: Result<(), Refused>) -> u16 {
        use axum::response::IntoResponse;
        result.map_or_else(|r| r.into_response().status().as_u16(), |()| 200)
    }

    #[test]
    fn without_a_token_only_this_machine_may_invalidate() {
        let here: IpAddr = "127.0.0.1".parse().unwrap();
        let here_v6: IpAddr = "::1".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let elsewhere: IpAddr = "10.0.0.7".parse().unwrap();
        assert_eq!(status(allowed(here, false, None, None)), 200);
        assert_eq!(status(allowed(here_v6, false, None, None)), 200);
        assert_eq!(status(allowed(mapped, false, None, None)), 200);
        assert_eq!(status(allowed(elsewhere, false, None, None)), 403);
        // A page in a browser on this machine (a cross-site POST).
        assert_eq!(status(allowed(here, true, None, None)), 403);
    }

    #[test]
    fn with_a_token_everyone_must_send_it() {
        let token = token();
        let elsewhere: IpAddr = "10.0.0.7".parse().unwrap();
        let here: IpAddr = "127.0.0.1".parse().unwrap();
        let right = HeaderValue::from_static("Bearer 0123456789abcdef-token");
        let wrong = HeaderValue::from_static("Bearer 0123456789abcdef-tokeX");
        let longer = HeaderValue::from_static("Bearer 0123456789abcdef-token2");
        let basic = HeaderValue::from_static("Basic 0123456789abcdef-token");
        let shouted = HeaderValue::from_static("BEARER 0123456789abcdef-token");
        assert_eq!(
            status(allowed(here, true, Some(&shouted), Some(&token))),
            200
        );
        assert_eq!(
            status(allowed(elsewhere, false, Some(&right), Some(&token))),
            200
        );
        assert_eq!(status(allowed(here, false, None, Some(&token))), 401);
        for refused in [&wrong, &longer, &basic] {
            assert_eq!(
                status(allowed(elsewhere, false, Some(refused), Some(&token))),
                401
            );
        }
    }
}
