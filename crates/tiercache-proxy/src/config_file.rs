//! `tiercache-proxy --config tiercache.toml`: the proxy's settings in a file,
//! with per-path rules.
//!
//! ```toml
//! upstream = "http://127.0.0.1:9000"
//! listen   = "127.0.0.1:8080"
//! admin    = "127.0.0.1:8081"
//! admin_token = "…"                         # POST /invalidate from other hosts (else loopback only)
//! valkey   = "redis://127.0.0.1:6379"      # optional
//! valkey_timeout = "50ms"                   # one Valkey command at most
//! origin_timeout = "60s"                    # for the head (else 504), and each silence in a body
//! upstream_max_connections = 64             # requests at the upstream at once (default: no cap)
//! upstream_idle_timeout = "4s"              # below the upstream's keep-alive timeout (default 60s)
//! client_timeout = "75s"                    # a client's head, its idle keep-alive connection, an unread answer
//! max_connections = 10000                   # client connections at once; past it new ones wait
//! max_requests_in_flight = 10000            # requests waiting at once; past it L1 hits or a 503
//! l1_capacity = "256MiB"
//!
//! [defaults]                                # any policy field or safety option
//! ttl = "10s"
//! jitter = 0.1
//!
//! [[route]]                                 # first match wins; glob on the path
//! path = "/static/*"
//! ttl = "1h"
//!
//! [[route]]
//! path = "/api/cart/*"
//! cache = false                             # pass through, untouched
//! ```
//!
//! A bad file is refused whole, naming the file, the line and the field and
//! saying what is allowed; unknown keys are errors. Durations are written
//! `250ms`, `10s`, `5m`, `1h` (or seconds); sizes `512`, `64KiB`, `8MiB`.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use toml::Spanned;

use crate::routes::{Glob, Route, Settings};
use crate::{ProxyConfig, ProxyError};

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    /// Read by hand: derived (`untagged`), a wrong type was told only
    /// "data did not match any variant of untagged enum".
    struct Size(u64);
    impl<'de> Deserialize<'de> for Size {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl serde::de::Visitor<'_> for Visitor {
                type Value = Size;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a size: text such as \"8MiB\" or \"512KiB\", or a number of bytes")
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Size, E> {
                    crate::units::parse_size(v).map(Size).map_err(E::custom)
                }
                fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Size, E> {
                    Ok(Size(v))
                }
                fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Size, E> {
                    u64::try_from(v)
                        .map(Size)
                        .map_err(|_| E::custom(format!("{v} is not a size in bytes")))
                }
            }
            d.deserialize_any(Visitor)
        }
    }
    Ok(Option::<Size>::deserialize(d)?.map(|Size(n)| n))
}

/// `[defaults]` or one `[[route]]`: every setting a route may set.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    /// Routes only: the path glob.
    path: Option<String>,
    /// Routes only: `false` passes through untouched.
    cache: Option<bool>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    ttl: Option<Duration>,
    jitter: Option<f64>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    stale_while_revalidate: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    stale_if_error: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    negative_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    origin_soft_timeout: Option<Duration>,
    xfetch_beta: Option<f64>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    lock_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    hit_for_miss_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    keep_for_revalidation: Option<Duration>,
    override_origin: Option<bool>,
    tags: Option<Vec<String>>,
    ignore_cookies: Option<bool>,
    key_cookies: Option<Vec<String>>,
    key_headers: Option<Vec<String>>,
    targeted_fields: Option<Vec<String>>,
    #[serde(default, deserialize_with = "size")]
    max_body: Option<u64>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    max_error_ttl: Option<Duration>,
    honor_client_no_cache: Option<bool>,
    max_variants: Option<usize>,
    canonical_authority: Option<String>,
}

impl Table {
    fn settings(&self) -> Settings {
        Settings {
            ttl: self.ttl,
            jitter: self.jitter,
            stale_while_revalidate: self.stale_while_revalidate,
            stale_if_error: self.stale_if_error,
            negative_ttl: self.negative_ttl,
            origin_soft_timeout: self.origin_soft_timeout,
            xfetch_beta: self.xfetch_beta,
            lock_timeout: self.lock_timeout,
            hit_for_miss_ttl: self.hit_for_miss_ttl,
            keep_for_revalidation: self.keep_for_revalidation,
            override_origin: self.override_origin,
            tags: self.tags.clone(),
            ignore_cookies: self.ignore_cookies,
            key_cookies: self.key_cookies.clone(),
            key_headers: self.key_headers.clone(),
            targeted_fields: self.targeted_fields.clone(),
            max_body: self.max_body,
            max_error_ttl: self.max_error_ttl,
            honor_client_no_cache: self.honor_client_no_cache,
            max_variants: self.max_variants,
            canonical_authority: self.canonical_authority.clone(),
        }
    }
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    upstream: Option<String>,
    listen: Option<SocketAddr>,
    admin: Option<SocketAddr>,
    admin_token: Option<String>,
    valkey: Option<String>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    valkey_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    origin_timeout: Option<Duration>,
    upstream_max_connections: Option<usize>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    upstream_idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "tiercache_core::deserialize_duration")]
    client_timeout: Option<Duration>,
    max_connections: Option<usize>,
    max_requests_in_flight: Option<usize>,
    #[serde(default, deserialize_with = "size")]
    l1_capacity: Option<u64>,
    max_refreshes: Option<usize>,
    defaults: Option<Spanned<Table>>,
    #[serde(default, rename = "route")]
    routes: Vec<Spanned<Table>>,
}

/// What a config file gave: the settings, and whether it named the upstream
/// (else the command line must).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FileConfig {
    /// The settings, the file's over the defaults.
    pub config: ProxyConfig,
    /// Whether the file set `upstream`.
    pub has_upstream: bool,
}

/// Reads and validates the file at `path` into the proxy's settings (the
/// command line then overrides what it sets).
pub fn load(path: &Path) -> Result<FileConfig, ProxyError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ProxyError::Config(format!(
            "cannot read the config file {}: {e}",
            path.display()
        ))
    })?;
    parse(&text, &path.display().to_string())
}

/// Parses a config file's `text` (`name` is how errors name the file).
///
/// ```
/// let config = tiercache_proxy::config_file::parse(
///     "upstream = \"http://127.0.0.1:9000\"\n[defaults]\nttl = \"10s\"\n[[route]]\npath = \"/static/*\"\nttl = \"1h\"\n",
///     "tiercache.toml",
/// ).unwrap();
/// assert_eq!(config.config.routes.len(), 1);
///
/// let err = tiercache_proxy::config_file::parse("[defaults]\nttl = \"10s\"\njitter = 0.7\n", "tiercache.toml").unwrap_err();
/// assert!(err.to_string().contains("tiercache.toml, line 3"), "{err}");
/// assert!(err.to_string().contains("`jitter` is 0.7, but must be 0.0..=0.5"), "{err}");
/// ```
pub fn parse(text: &str, name: &str) -> Result<FileConfig, ProxyError> {
    // The line of `field` inside a table spanning `span` (else the table's).
    let field_line = |span: std::ops::Range<usize>, field: &str| {
        // The table runs to the next table header (its span may cover only
        // its own header).
        let start = span.start.min(text.len());
        let end = text[start..]
            .char_indices()
            .skip(1)
            .find(|(i, c)| *c == '[' && text[..start + i].ends_with('\n'))
            .map_or(text.len(), |(i, _)| start + i)
            .max(span.end.min(text.len()));
        let at = text[start..end]
            .match_indices(field)
            .find(|(i, _)| {
                let before = text[..start + i].chars().last();
                let after = text[start + i + field.len()..].trim_start();
                matches!(before, None | Some('\n') | Some(' ') | Some('\t'))
                    && after.starts_with('=')
            })
            .map_or(start, |(i, _)| start + i);
        text[..at].matches('\n').count() + 1
    };
    let file: File = toml::from_str(text)
        .map_err(|e| ProxyError::Config(format!("{name}: {}", e.to_string().trim_end())))?;
    let line =
        |span: std::ops::Range<usize>| text[..span.start.min(text.len())].matches('\n').count() + 1;
    let upstream = file
        .upstream
        .as_deref()
        .unwrap_or("http://127.0.0.1:80")
        .parse()
        .map_err(|e| ProxyError::Config(format!("{name}: `upstream`: {e}")))?;
    let mut config = ProxyConfig::new(upstream);
    if let Some(listen) = file.listen {
        config.listen = listen;
    }
    config.admin = file.admin;
    config.admin_token = file
        .admin_token
        .map(crate::AdminToken::new)
        .transpose()
        .map_err(|e| ProxyError::Config(format!("{name}: {e}")))?;
    config.valkey = file.valkey;
    if let Some(timeout) = file.valkey_timeout {
        config.valkey_timeout = timeout;
    }
    if let Some(timeout) = file.client_timeout {
        config.client_timeout = timeout;
    }
    if let Some(n) = file.max_connections {
        config.max_connections = n;
    }
    if let Some(n) = file.max_requests_in_flight {
        config.max_requests_in_flight = n;
    }
    if let Some(timeout) = file.origin_timeout {
        config.origin_timeout = timeout;
    }
    config.upstream_max_connections = file.upstream_max_connections;
    if let Some(idle) = file.upstream_idle_timeout {
        config.upstream_idle_timeout = idle;
    }
    if let Some(bytes) = file.l1_capacity {
        config.l1_capacity = bytes;
    }
    if let Some(n) = file.max_refreshes {
        config.max_refreshes = n;
    }
    if let Some(defaults) = &file.defaults {
        let table = defaults.get_ref();
        let at = line(defaults.span());
        if table.path.is_some() || table.cache.is_some() {
            return Err(ProxyError::Config(format!(
                "{name}, line {at}: [defaults] takes no `path` or `cache`: those belong to a [[route]]"
            )));
        }
        config = config.with(&table.settings());
        config.policy().map_err(|e| {
            let at = field_line(defaults.span(), e.field);
            ProxyError::Config(format!("{name}, line {at}: [defaults]: {e}"))
        })?;
    }
    for route in &file.routes {
        let table = route.get_ref();
        let at = line(route.span());
        let path = table.path.clone().ok_or_else(|| {
            ProxyError::Config(format!(
                "{name}, line {at}: a [[route]] needs `path` (a glob such as \"/static/*\")"
            ))
        })?;
        if !path.starts_with('/') {
            return Err(ProxyError::Config(format!(
                "{name}, line {at}: [[route]] path `{path}` must start with /"
            )));
        }
        let settings = table.settings();
        config.with(&settings).policy().map_err(|e| {
            let at = field_line(route.span(), e.field);
            ProxyError::Config(format!(
                "{name}, line {at}: [[route]] path = \"{path}\": {e}"
            ))
        })?;
        config.routes.push(Route {
            path: Glob::new(path),
            cache: table.cache.unwrap_or(true),
            settings,
        });
    }
    Ok(FileConfig {
        config,
        has_upstream: file.upstream.is_some(),
    })
}
