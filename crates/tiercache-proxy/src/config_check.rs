//! [`ProxyConfig::check`]: every setting checked without binding or
//! connecting, each refusal naming the flag and the config file's key.

use std::time::Duration;

use tokio::sync::Semaphore;

use crate::{ProxyConfig, ProxyError};

impl ProxyConfig {
    /// Checks every setting without binding or connecting (what
    /// `--check-config` and [`Proxy::start`](crate::Proxy::start) refuse),
    /// with a message that names the setting.
    pub fn check(&self) -> Result<(), ProxyError> {
        self.policy()
            .map_err(|e| ProxyError::Config(e.to_string()))?;
        crate::forward::check_upstream(&self.upstream).map_err(ProxyError::Config)?;
        if self.origin_timeout.is_zero() || self.origin_timeout > Duration::from_secs(86_400) {
            return Err(ProxyError::Config(
                "`--origin-timeout` (`origin_timeout` in a config file): greater than 0, at most 1 day".into(),
            ));
        }
        if let Some(n) = self.upstream_max_connections {
            permits(n, "--upstream-max-connections", "upstream_max_connections")?;
        }
        if self.upstream_idle_timeout > Duration::from_secs(86_400) {
            return Err(ProxyError::Config(
                "`--upstream-idle-timeout` (`upstream_idle_timeout` in a config file): at most 1 day".into(),
            ));
        }
        // Keyed, a field passes to the upstream as the client sent it: for
        // the client's address, that would be believed.
        let keyed = self.key_headers.iter().chain(
            self.routes
                .iter()
                .filter_map(|r| r.settings.key_headers.as_ref())
                .flatten(),
        );
        for name in keyed {
            if crate::forward::is_client_address(name) {
                return Err(ProxyError::Config(format!(
                    "`--key-header` `{name}` (`key_headers` in a config file): the client's address is set by the proxy; keyed, a client's own value would reach the upstream"
                )));
            }
        }
        // What the engine's build refuses, so `--check-config` says so too.
        if self.l1_capacity == 0 {
            return Err(ProxyError::Config(
                "`--l1-capacity` (`l1_capacity` in a config file): at least 1 byte".into(),
            ));
        }
        permits(self.max_refreshes, "--max-refreshes", "max_refreshes")?;
        if self.client_timeout.is_zero() || self.client_timeout > Duration::from_secs(86_400) {
            return Err(ProxyError::Config(
                "`--client-timeout` (`client_timeout` in a config file): greater than 0, at most 1 day".into(),
            ));
        }
        if self.max_connections == 0 {
            return Err(ProxyError::Config(
                "`--max-connections` (`max_connections` in a config file): at least 1".into(),
            ));
        }
        permits(
            self.max_requests_in_flight,
            "--max-requests-in-flight",
            "max_requests_in_flight",
        )?;
        // What building the cache layer refuses, for the defaults and each
        // cached route, so `--check-config` says so too.
        self.check_layer().map_err(ProxyError::Config)?;
        for route in self.routes.iter().filter(|r| r.cache) {
            let here = |e: String| {
                ProxyError::Config(format!("{e}; here: route `{}`", route.path.as_str()))
            };
            let settings = self.with(&route.settings);
            // With the flags laid over the file (which checked each
            // route's policy before them): `--negative-ttl 1m` over a
            // route's `ttl = "30s"`.
            settings.policy().map_err(|e| here(e.to_string()))?;
            settings.check_layer().map_err(here)?;
        }
        self.valkey_config()?;
        Ok(())
    }

    /// The settings the cache layer takes (the body bound, header and
    /// cookie keys, targets, the canonical authority, the variants' bound),
    /// as one route has them.
    fn check_layer(&self) -> Result<(), String> {
        if self.max_body == 0 {
            return Err("`--max-body` (`max_body` in a config file's `[defaults]` or a route): at least 1 byte (0 would store no body at all)".into());
        }
        let header = |flag: &str, key: &str, name: &str| {
            http::HeaderName::from_bytes(name.as_bytes())
                .map(drop)
                .map_err(|_| {
                    format!("`{flag}` `{name}` (`{key}` in a config file): not a header name")
                })
        };
        for name in &self.key_headers {
            header("--key-header", "key_headers", name)?;
        }
        for name in &self.targets {
            header("--target", "targeted_fields", name)?;
        }
        if self.ignore_cookies && !self.key_cookies.is_empty() {
            return Err("`--ignore-cookies` and `--key-cookie` (`ignore_cookies`, `key_cookies` in a config file) exclude each other".into());
        }
        if let Some(authority) = &self.canonical_authority
            && !crate::host::is_host_and_port(authority.as_bytes())
        {
            return Err(format!(
                "`--canonical-authority` `{authority}` (`canonical_authority` in a config file): not a host and an optional port (`shop.example`, `shop.example:8443`: no user, a port up to 65535)"
            ));
        }
        if self.max_variants == Some(0) {
            return Err("`max_variants` (in a config file): at least 1".into());
        }
        Ok(())
    }
}

/// A count of things at once, held by a semaphore: at least 1, and within
/// what tokio's holds (past it, the start panicked).
fn permits(n: usize, flag: &str, key: &str) -> Result<(), ProxyError> {
    if (1..=Semaphore::MAX_PERMITS).contains(&n) {
        return Ok(());
    }
    Err(ProxyError::Config(format!(
        "`{flag}` (`{key}` in a config file): at least 1, at most {}",
        Semaphore::MAX_PERMITS
    )))
}
