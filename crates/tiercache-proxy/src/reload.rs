//! What a start and a reload build from a config (the route table, each
//! route's cache layer), and the [`Reloader`] that swaps them in.

use std::sync::Arc;

use tiercache_core::{Policy, TieredCache};
use tiercache_http::ResponseCacheLayer;

use crate::forward::{self, Forward};
use crate::{ProxyConfig, ProxyError, SharedRecorder, admin, routes};

/// Reloads a running proxy's routes and admin token; see
/// [`Proxy::reloader`](crate::Proxy::reloader).
#[derive(Clone)]
pub struct Reloader {
    /// One reload at a time: two at once could leave one's routes with
    /// the other's token.
    pub(crate) reloading: Arc<std::sync::Mutex<()>>,
    /// The routes in force (every request reads them).
    pub(crate) table: Arc<std::sync::RwLock<Arc<routes::Table>>>,
    /// The admin endpoints' layer and token.
    pub(crate) admin_live: Arc<std::sync::RwLock<admin::AdminLive>>,
    pub(crate) engine: TieredCache,
    pub(crate) forward: Forward,
    pub(crate) recorder: SharedRecorder,
    /// The settings the proxy started with (what a reload cannot change).
    pub(crate) started: Arc<ProxyConfig>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reloader")
    }
}

impl Reloader {
    /// Replaces the routes and the admin token with `config`'s; on an
    /// error what is in force stays. The names of `config`'s settings left
    /// unapplied until a restart (see [`ProxyConfig::kept_until_restart`]).
    pub fn reload(&self, config: &ProxyConfig) -> Result<Vec<&'static str>, ProxyError> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        config.check()?;
        let (table, layer) = route_table(config, &self.engine, &self.forward, &self.recorder)?;
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        *self.admin_live.write().unwrap_or_else(|e| e.into_inner()) = admin::AdminLive {
            layer,
            token: config.admin_token.clone(),
        };
        Ok(self.started.kept_until_restart(config))
    }
}

/// The routes `config` describes, each a service over `forward`, and the
/// defaults' layer (the admin endpoints invalidate through it).
pub(crate) fn route_table(
    config: &ProxyConfig,
    engine: &TieredCache,
    forward: &Forward,
    recorder: &SharedRecorder,
) -> Result<(routes::Table, ResponseCacheLayer), ProxyError> {
    // The fields a route keys on (or names, passing through) reach the
    // upstream as sent; names the layer refuses never get here.
    let keyed_forward = |config: &ProxyConfig| {
        let keyed = config
            .key_headers
            .iter()
            .filter_map(|n| http::HeaderName::from_bytes(n.as_bytes()).ok())
            .collect();
        forward.clone().keyed(keyed)
    };
    let cached = |name: &str,
                  config: &ProxyConfig|
     -> Result<(routes::RouteService, ResponseCacheLayer), ProxyError> {
        let policy = config
            .policy()
            .map_err(|e| ProxyError::Config(format!("{name}: {e}")))?;
        let layer = http_layer(config, engine.clone(), policy, name, recorder)?;
        let service = tower::Layer::layer(&layer, keyed_forward(config));
        Ok((routes::RouteService::new(service), layer))
    };
    // Untouched: the upstream's answer as is, no cache fields.
    let pass = |config: &ProxyConfig| {
        routes::RouteService::new(tower::ServiceExt::map_response(
            keyed_forward(config),
            |res: http::Response<forward::UpstreamBody>| res.map(tiercache_http::CacheBody::stream),
        ))
    };
    let (default, layer) = cached("proxy", config)?;
    let mut table = routes::Table {
        routes: Vec::new(),
        default,
        looped: pass(config),
        forward: forward.clone(),
    };
    for route in &config.routes {
        let service = if route.cache {
            cached(route.path.as_str(), &config.with(&route.settings))?.0
        } else {
            pass(&config.with(&route.settings))
        };
        // Matched against the path as sent, and lower-cased against the
        // path as resolved (see `routes::resolved_path`).
        let folded = routes::Glob::new(route.path.as_str().to_ascii_lowercase());
        table.routes.push((route.path.clone(), folded, service));
    }
    Ok((table, layer))
}

/// The cache layer the settings describe; a bad header name is named in the error.
fn http_layer(
    config: &ProxyConfig,
    engine: TieredCache,
    policy: Policy,
    name: &str,
    recorder: &SharedRecorder,
) -> Result<ResponseCacheLayer, ProxyError> {
    let header = |flag: &str, name: &str| {
        http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| ProxyError::Config(format!("{flag} `{name}`: not a header name")))
    };
    let mut base = ResponseCacheLayer::new(engine);
    if let Some(authority) = &config.canonical_authority {
        authority.parse::<http::uri::Authority>().map_err(|e| {
            ProxyError::Config(format!(
                "canonical authority `{authority}`: not a host[:port] ({e})"
            ))
        })?;
        base = base.canonical_authority(authority);
    }
    let mut layer = base
        .metrics_recorder(recorder.clone())
        .max_body(usize::try_from(config.max_body).unwrap_or(usize::MAX))
        .max_error_ttl(config.max_error_ttl)
        .honor_client_no_cache(config.honor_client_no_cache)
        .route_named(name, policy)
        .map_err(|e| ProxyError::Config(e.to_string()))?;
    if config.ttl.is_none() {
        layer = layer.explicit_freshness_only();
    }
    if let Some(n) = config.max_variants {
        layer = layer.max_variants(n);
    }
    match (config.ignore_cookies, config.key_cookies.is_empty()) {
        (true, false) => {
            return Err(ProxyError::Config(
                "--ignore-cookies and --key-cookie exclude each other".into(),
            ));
        }
        (true, true) => layer = layer.ignore_cookies(),
        (false, false) => layer = layer.key_cookies(config.key_cookies.iter().cloned()),
        (false, true) => {}
    }
    for name in &config.key_headers {
        layer = layer.key_header(header("--key-header", name)?);
    }
    let targets = config
        .targets
        .iter()
        .map(|t| header("--target", t))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(layer.targeted_fields(targets))
}
