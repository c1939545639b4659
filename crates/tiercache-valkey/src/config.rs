//! [`ValkeyConfig`]: how to reach Valkey and how to behave when it
//! misbehaves; [`ValkeyError`]: why the tier could not be set up.

use std::fmt;
use std::time::Duration;

use fred::prelude::Config;

/// How to reach Valkey and how to behave when it misbehaves.
///
/// ```
/// use std::time::Duration;
/// use tiercache_valkey::ValkeyConfig;
///
/// let config = ValkeyConfig::from_url("redis://127.0.0.1:6379")?
///     .prefix("shop")
///     .command_timeout(Duration::from_millis(30));
/// # Ok::<(), tiercache_valkey::ValkeyError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ValkeyConfig {
    pub(crate) fred: Config,
    pub(crate) prefix: String,
    pub(crate) command_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) write_queue: usize,
    pub(crate) write_queue_bytes: usize,
    pub(crate) breaker_failures: u32,
    pub(crate) breaker_interval: Duration,
    pub(crate) fill_locks: bool,
    pub(crate) max_prefix_bans: usize,
    pub(crate) unheard_l1_for: Duration,
}

impl ValkeyConfig {
    /// Default command timeout: 50 ms.
    pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(50);
    /// Default connect timeout: 500 ms.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
    /// Default write-queue capacity.
    pub const DEFAULT_WRITE_QUEUE: usize = 4096;
    /// Default byte bound of the write queue: 16 MiB.
    pub const DEFAULT_WRITE_QUEUE_BYTES: usize = 16 * 1024 * 1024;
    /// Default consecutive failures that open the breaker.
    pub const DEFAULT_BREAKER_FAILURES: u32 = 3;
    /// Default time the breaker stays open before one probe.
    pub const DEFAULT_BREAKER_INTERVAL: Duration = Duration::from_millis(500);
    /// Default bound on the prefix bans held: 1024.
    pub const DEFAULT_MAX_PREFIX_BANS: usize = 1024;
    /// Default for [`unheard_l1_for`](Self::unheard_l1_for).
    pub const DEFAULT_UNHEARD_L1_FOR: Duration = Duration::from_secs(5);

    /// A standalone server from `redis://[user:pass@]host:port[/db]`, or
    /// `rediss://` for TLS (also `valkey://`, `valkeys://`).
    pub fn from_url(url: &str) -> Result<Self, ValkeyError> {
        // fred reads any other scheme (`http://`) as a plain server: refuse
        // it rather than guess what was meant. Its own: `redis`, `rediss`,
        // `valkey`, `valkeys`, each also with `-cluster` or `-sentinel`,
        // and `redis+unix`, `valkey+unix`.
        let known = url.split_once("://").is_some_and(|(scheme, _)| {
            let base = scheme
                .strip_suffix("-cluster")
                .or_else(|| scheme.strip_suffix("-sentinel"))
                .unwrap_or(scheme);
            matches!(base, "redis" | "rediss" | "valkey" | "valkeys")
                || matches!(scheme, "redis+unix" | "valkey+unix")
        });
        if !known {
            return Err(ValkeyError::Url {
                url: url.to_owned(),
                reason: "the scheme must be redis:// or rediss:// (or valkey://, valkeys://)"
                    .into(),
            });
        }
        // fred ignores a query parameter it does not know: `?tls_cert=…`
        // would connect without the certificate, and say nothing.
        if let Some(unknown) = unknown_parameter(url) {
            return Err(ValkeyError::Url {
                url: url.to_owned(),
                reason: format!(
                    "unknown parameter `{unknown}` (known: {}; anything else, a client certificate included, goes in fred's own Config, given with ValkeyConfig::from_fred)",
                    URL_PARAMETERS.join(", ")
                ),
            });
        }
        let normalised = url
            .strip_prefix("valkeys://")
            .map(|rest| format!("rediss://{rest}"))
            .or_else(|| {
                url.strip_prefix("valkey://")
                    .map(|rest| format!("redis://{rest}"))
            })
            .unwrap_or_else(|| url.to_owned());
        let fred = Config::from_url(&normalised).map_err(|e| ValkeyError::Url {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self::from_fred(fred))
    }

    /// fred's own configuration, for Sentinel, Cluster or anything a URL cannot say.
    pub fn from_fred(config: Config) -> Self {
        Self {
            fred: config,
            prefix: "tc".to_owned(),
            command_timeout: Self::DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            write_queue: Self::DEFAULT_WRITE_QUEUE,
            write_queue_bytes: Self::DEFAULT_WRITE_QUEUE_BYTES,
            breaker_failures: Self::DEFAULT_BREAKER_FAILURES,
            breaker_interval: Self::DEFAULT_BREAKER_INTERVAL,
            fill_locks: true,
            max_prefix_bans: Self::DEFAULT_MAX_PREFIX_BANS,
            unheard_l1_for: Self::DEFAULT_UNHEARD_L1_FOR,
        }
    }

    /// Whether instances take fleet-wide fill locks (default on): one origin
    /// load per key across every instance on this Valkey. Off, each
    /// instance loads on its own (its local single flight still applies).
    pub fn fill_locks(mut self, on: bool) -> Self {
        self.fill_locks = on;
        self
    }

    /// The key prefix (default `tc`): caches with different prefixes on one
    /// server never read each other's entries.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bound on each read, write and delete (default 50 ms).
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Bound on each connection attempt (default 500 ms).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Capacity of the write queue (default 4096); a full queue drops writes.
    pub fn write_queue(mut self, capacity: usize) -> Self {
        self.write_queue = capacity;
        self
    }

    /// Most bytes the queued writes may hold (default 16 MiB): each fill
    /// waits there as its encoded copy, so a flood faster than Valkey must
    /// not grow memory by the queue's length times the body size. A write
    /// that would pass the bound is dropped and counted (one larger than the
    /// bound goes through when the queue is empty).
    pub fn write_queue_bytes(mut self, bytes: usize) -> Self {
        self.write_queue_bytes = bytes;
        self
    }

    /// Consecutive failures that open the breaker (default 3), and how long
    /// it stays open before one probe (default 500 ms).
    pub fn breaker(mut self, failures: u32, interval: Duration) -> Self {
        self.breaker_failures = failures;
        self.breaker_interval = interval;
        self
    }

    /// Most prefix bans kept (default 1024), in this instance and in
    /// Valkey's `PREFIX:bans` hash. Each prefix invalidation records one for
    /// a day, and each L2 read checks them all: past the bound, the oldest
    /// half fold into one ban of every key at the latest of their times, so
    /// L2 copies older than that are misses (never a banned copy read). A
    /// fleet should share one bound.
    pub fn max_prefix_bans(mut self, bans: usize) -> Self {
        self.max_prefix_bans = bans;
        self
    }

    /// How long an instance that cannot hear the fleet's invalidations (its
    /// subscriber's connection lost, or silent past the heartbeat's ping)
    /// goes on answering from its L1 as it is (default 5 s, at least 1 s):
    /// then every L1 entry must ask the origin again (it is no longer
    /// fresh, nor answered while it revalidates; stale-if-error and its
    /// validators still have it), and again each such while until the
    /// instance hears again, so a write made on another instance meanwhile shows here
    /// within about this long and two heartbeats (1 s apart, or twice the
    /// command timeout past 500 ms), not only once the
    /// subscriber is back (when L1 is dropped). The price, while Valkey is
    /// out of this instance's reach: each key it serves costs an origin
    /// call (a revalidation where it has validators) that often.
    /// `Duration::MAX` keeps L1 as it is until the instance hears again.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_valkey::ValkeyConfig;
    ///
    /// let config = ValkeyConfig::from_url("redis://127.0.0.1:6379")
    ///     .unwrap()
    ///     .unheard_l1_for(Duration::from_secs(2));
    /// assert!(config.validate().is_ok());
    /// ```
    pub fn unheard_l1_for(mut self, bound: Duration) -> Self {
        self.unheard_l1_for = bound;
        self
    }

    /// Checks every setting, as [`ValkeyTier::connect`](crate::ValkeyTier::connect)
    /// does before it connects (for a configuration check that connects to
    /// nothing).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_valkey::ValkeyConfig;
    ///
    /// let config = ValkeyConfig::from_url("redis://127.0.0.1:6379").unwrap();
    /// assert!(config.clone().validate().is_ok());
    /// let err = config.command_timeout(Duration::ZERO).validate().unwrap_err();
    /// assert!(err.to_string().contains("command_timeout"));
    /// ```
    pub fn validate(&self) -> Result<(), ValkeyError> {
        let bad = |field: &'static str, allowed: &'static str| {
            Err(ValkeyError::Config { field, allowed })
        };
        if self.prefix.is_empty() || self.prefix.contains(['{', '}']) {
            return bad("prefix", "non-empty, without `{` or `}`");
        }
        if self.command_timeout.is_zero() || self.command_timeout > Duration::from_secs(60) {
            return bad("command_timeout", "greater than 0 and at most 60 s");
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout", "greater than 0");
        }
        if self.write_queue == 0 {
            return bad("write_queue", "at least 1");
        }
        if self.write_queue_bytes == 0 {
            return bad("write_queue_bytes", "at least 1");
        }
        if self.breaker_failures == 0 || self.breaker_interval.is_zero() {
            return bad(
                "breaker",
                "at least 1 failure and an interval greater than 0",
            );
        }
        if self.max_prefix_bans < 2 {
            return bad("max_prefix_bans", "at least 2");
        }
        if self.unheard_l1_for < Duration::from_secs(1) {
            return bad("unheard_l1_for", "at least 1 s");
        }
        Ok(())
    }
}

/// The Valkey tier could not be set up.
#[derive(Debug)]
#[non_exhaustive]
pub enum ValkeyError {
    /// The URL does not parse.
    Url {
        /// The URL as given.
        url: String,
        /// fred's reason.
        reason: String,
    },
    /// A setting is out of range.
    Config {
        /// The setting.
        field: &'static str,
        /// What it accepts.
        allowed: &'static str,
    },
    /// fred refused the configuration.
    Client(String),
    /// Not called inside a Tokio runtime.
    NoRuntime,
}

impl fmt::Display for ValkeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValkeyError::Url { url, reason } => write!(
                f,
                "invalid Valkey URL `{url}`: {reason} (write redis://[user:password@]host:port[/db], or rediss:// for TLS)"
            ),
            ValkeyError::Config { field, allowed } => {
                write!(f, "invalid Valkey setting `{field}`: must be {allowed}")
            }
            ValkeyError::Client(e) => write!(f, "cannot build the Valkey client: {e}"),
            ValkeyError::NoRuntime => f.write_str(
                "the Valkey tier needs a Tokio runtime: create it inside one (e.g. in #[tokio::main])",
            ),
        }
    }
}

impl std::error::Error for ValkeyError {}

/// The query parameters fred reads from a URL.
const URL_PARAMETERS: [&str; 4] = [
    "node",
    "sentinelServiceName",
    "sentinelUsername",
    "sentinelPassword",
];

/// The first query parameter of `url` fred would ignore.
fn unknown_parameter(url: &str) -> Option<&str> {
    let query = url.split_once('?')?.1;
    let query = query.split_once('#').map_or(query, |(query, _)| query);
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').map_or(pair, |(name, _)| name))
        .find(|name| !URL_PARAMETERS.contains(name))
}
