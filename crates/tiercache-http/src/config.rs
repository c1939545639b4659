//! The layer's HTTP settings ([`HttpConfig`]), shared by the layer, the
//! request preparation and the origin.

use std::time::Duration;

use http::HeaderName;

/// The layer's HTTP settings; a route's layer carries its own copy.
#[derive(Debug, Clone)]
pub(crate) struct HttpConfig {
    pub(crate) max_body: usize,
    pub(crate) emit_headers: bool,
    pub(crate) cookies: Cookies,
    pub(crate) keyed_headers: Vec<HeaderName>,
    pub(crate) targets: Vec<HeaderName>,
    pub(crate) max_error_ttl: Duration,
    pub(crate) heuristic: bool,
    pub(crate) honor_client_no_cache: bool,
    pub(crate) max_variants: usize,
    /// The authority every request is keyed on (and sent on with), in
    /// place of its own `Host`.
    pub(crate) canonical_authority: Option<http::uri::Authority>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body: crate::ResponseCacheLayer::DEFAULT_MAX_BODY,
            emit_headers: true,
            cookies: Cookies::Bypass,
            keyed_headers: Vec::new(),
            targets: Vec::new(),
            max_error_ttl: crate::ResponseCacheLayer::DEFAULT_MAX_ERROR_TTL,
            heuristic: true,
            honor_client_no_cache: false,
            max_variants: crate::ResponseCacheLayer::DEFAULT_MAX_VARIANTS,
            canonical_authority: None,
        }
    }
}

/// What a route does with requests that carry `Cookie`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cookies {
    /// Bypass the cache (the default).
    Bypass,
    /// Drop the cookies: the origin never sees them, the key ignores them.
    Ignore,
    /// Key on these cookies' values; the origin sees only them.
    Key(Vec<String>),
}
