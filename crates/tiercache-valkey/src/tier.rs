//! [`ValkeyTier`]: the shared tier on Valkey (or Redis) through fred.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use fred::prelude::{
    Builder, Client, ClientLike, Config, Expiration, KeysInterface, ReconnectPolicy, Value,
};
use tiercache_core::{BoxFuture, CacheKey, Entry, Tier, TierError, TierHit, TierReport};
use tokio::sync::mpsc;

use crate::breaker::Breaker;
use crate::codec;

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
    fred: Config,
    prefix: String,
    command_timeout: Duration,
    connect_timeout: Duration,
    write_queue: usize,
    breaker_failures: u32,
    breaker_interval: Duration,
}

impl ValkeyConfig {
    /// Default command timeout: 50 ms.
    pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(50);
    /// Default connect timeout: 500 ms.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
    /// Default write-queue capacity.
    pub const DEFAULT_WRITE_QUEUE: usize = 4096;
    /// Default consecutive failures that open the breaker.
    pub const DEFAULT_BREAKER_FAILURES: u32 = 3;
    /// Default time the breaker stays open before one probe.
    pub const DEFAULT_BREAKER_INTERVAL: Duration = Duration::from_millis(500);

    /// A standalone server from `redis://[user:pass@]host:port[/db]`, or
    /// `rediss://` for TLS (also `valkey://`, `valkeys://`).
    pub fn from_url(url: &str) -> Result<Self, ValkeyError> {
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
            breaker_failures: Self::DEFAULT_BREAKER_FAILURES,
            breaker_interval: Self::DEFAULT_BREAKER_INTERVAL,
        }
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

    /// Consecutive failures that open the breaker (default 3), and how long
    /// it stays open before one probe (default 500 ms).
    pub fn breaker(mut self, failures: u32, interval: Duration) -> Self {
        self.breaker_failures = failures;
        self.breaker_interval = interval;
        self
    }

    fn validate(&self) -> Result<(), ValkeyError> {
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
        if self.breaker_failures == 0 || self.breaker_interval.is_zero() {
            return bad(
                "breaker",
                "at least 1 failure and an interval greater than 0",
            );
        }
        Ok(())
    }
}

/// The L2 tier on Valkey. Cheap to clone.
///
/// Reads are one round trip (`GET` and `PTTL` pipelined); writes go through a
/// bounded queue to a background task (`SET key value PX ttl`); every
/// operation is bounded by the command timeout, and a circuit breaker stops
/// a dead server from costing a timeout per request. Valkey absent at start
/// is not an error: the tier reconnects in the background and fails open.
#[derive(Clone)]
pub struct ValkeyTier {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    prefix: String,
    command_timeout: Duration,
    breaker: Breaker,
    writes: mpsc::Sender<Write>,
    write_drops: AtomicU64,
    write_errors: AtomicU64,
    corrupt: AtomicU64,
    skipped: AtomicU64,
}

struct Write {
    key: String,
    value: Bytes,
    px: i64,
}

impl fmt::Debug for ValkeyTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValkeyTier")
            .field("prefix", &self.inner.prefix)
            .field("breaker_open", &self.inner.breaker.is_open())
            .finish()
    }
}

impl ValkeyTier {
    /// Builds the client and connects, waiting at most the connect timeout:
    /// when Valkey is down the tier is returned anyway and keeps reconnecting
    /// in the background (requests meanwhile go to the origin).
    pub async fn connect(config: ValkeyConfig) -> Result<Self, ValkeyError> {
        config.validate()?;
        let mut fred = config.fred.clone();
        // Keep retrying a server that is down at start instead of failing.
        fred.fail_fast = false;
        let client = Builder::from_config(fred)
            .with_connection_config(|c| {
                c.connection_timeout = config.connect_timeout;
                c.internal_command_timeout = config.command_timeout.max(Duration::from_millis(500));
                c.max_command_attempts = 1;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = config.command_timeout;
            })
            // Retry forever, never more than 250 ms apart: a server that comes back
            // is in use again within the breaker interval plus this.
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 250, 2))
            .build()
            .map_err(|e| ValkeyError::Client(e.to_string()))?;
        let connect_timeout = config.connect_timeout;
        let tier = Self::from_client(client, config)?;
        let _ = tokio::time::timeout(connect_timeout, tier.inner.client.wait_for_connect()).await;
        Ok(tier)
    }

    /// Wraps a fred client the caller built (the escape hatch: any fred
    /// configuration). Connects it if it is not connected yet.
    pub fn from_client(client: Client, config: ValkeyConfig) -> Result<Self, ValkeyError> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ValkeyError::NoRuntime)?;
        let _guard = runtime.enter();
        if !client.is_connected() {
            let _connection = client.connect();
        }
        let (tx, rx) = mpsc::channel(config.write_queue);
        let inner = Arc::new(Inner {
            client,
            prefix: config.prefix,
            command_timeout: config.command_timeout,
            breaker: Breaker::new(config.breaker_failures, config.breaker_interval),
            writes: tx,
            write_drops: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
        });
        runtime.spawn(writer(Arc::downgrade(&inner), rx));
        Ok(Self { inner })
    }

    /// The Valkey key an entry is stored under: `PREFIX:{HASH}:e`. The hash
    /// tag keeps an entry and its lock on one cluster slot, and no URL byte
    /// reaches the key.
    pub fn entry_key(&self, key: &CacheKey) -> String {
        format!("{}:{{{}}}:e", self.inner.prefix, key.hash())
    }

    /// The fred client, for callers that need the server directly.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    async fn read(&self, key: &str) -> Result<(Option<Bytes>, i64), TierError> {
        let pipe = self.inner.client.pipeline();
        let queued: Result<(), _> = pipe.get(key).await;
        queued.map_err(fred_error)?;
        let queued: Result<(), _> = pipe.pttl(key).await;
        queued.map_err(fred_error)?;
        let mut replies: Vec<Value> = pipe.all().await.map_err(fred_error)?;
        if replies.len() != 2 {
            return Err(TierError::new("unexpected reply to GET+PTTL", None));
        }
        let pttl = replies.pop().and_then(|v| v.as_i64()).unwrap_or(-2);
        let value = replies
            .pop()
            .filter(|v| !v.is_null())
            .and_then(Value::into_bytes);
        Ok((value, pttl))
    }

    fn bounded<'a, T: Send + 'a>(
        &'a self,
        op: impl std::future::Future<Output = Result<T, TierError>> + Send + 'a,
    ) -> impl std::future::Future<Output = Result<T, TierError>> + Send + 'a {
        let inner = &self.inner;
        async move {
            let result = match tokio::time::timeout(inner.command_timeout, op).await {
                Ok(result) => result,
                Err(_) => Err(TierError::timeout(format!(
                    "no answer within {:?}",
                    inner.command_timeout
                ))),
            };
            match &result {
                Ok(_) => inner.breaker.success(),
                Err(_) => inner.breaker.failure(),
            }
            result
        }
    }
}

fn fred_error(e: fred::error::Error) -> TierError {
    if matches!(e.kind(), fred::error::ErrorKind::Timeout) {
        TierError::timeout(e.to_string())
    } else {
        TierError::new(e.to_string(), Some(Box::new(e)))
    }
}

impl Tier for ValkeyTier {
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<Option<TierHit>, TierError>> {
        Box::pin(async move {
            if !self.inner.breaker.allow() {
                self.inner.skipped.fetch_add(1, Relaxed);
                return Ok(None);
            }
            let vkey = self.entry_key(key);
            let (value, pttl) = self.bounded(self.read(&vkey)).await?;
            let Some(bytes) = value else {
                return Ok(None);
            };
            let entry = match codec::decode(bytes) {
                Ok(entry) if entry.key() == key.full() => entry,
                // Corrupt, foreign, another version, or another key under
                // this hash: a miss; the next fill overwrites it.
                _ => {
                    self.inner.corrupt.fetch_add(1, Relaxed);
                    return Ok(None);
                }
            };
            let remaining = match pttl {
                // No expiry on the server: the entry's own times decide.
                -1 => Duration::MAX,
                ms if ms > 0 => Duration::from_millis(ms as u64),
                // Expired or deleted between GET and PTTL.
                _ => return Ok(None),
            };
            Ok(Some(TierHit { entry, remaining }))
        })
    }

    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration) {
        let px = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        let write = Write {
            key: self.entry_key(key),
            value: codec::encode(entry),
            px,
        };
        if self.inner.writes.try_send(write).is_err() {
            self.inner.write_drops.fetch_add(1, Relaxed);
        }
    }

    fn delete<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async move {
            let vkey = self.entry_key(key);
            self.bounded(async {
                let deleted: Result<i64, _> = self.inner.client.del(&vkey).await;
                deleted.map(drop).map_err(fred_error)
            })
            .await
        })
    }

    fn report(&self) -> TierReport {
        let i = &self.inner;
        let mut report = TierReport::default();
        report.write_drops = i.write_drops.load(Relaxed);
        report.write_errors = i.write_errors.load(Relaxed);
        report.corrupt = i.corrupt.load(Relaxed);
        report.skipped = i.skipped.load(Relaxed);
        report.breaker_trips = i.breaker.trips.load(Relaxed);
        report.breaker_open = i.breaker.is_open();
        report
    }
}

/// Drains the write queue; ends when the tier is dropped.
async fn writer(tier: std::sync::Weak<Inner>, mut rx: mpsc::Receiver<Write>) {
    while let Some(write) = rx.recv().await {
        let Some(inner) = tier.upgrade() else {
            return;
        };
        if !inner.breaker.allow() {
            inner.skipped.fetch_add(1, Relaxed);
            continue;
        }
        let set = inner.client.set::<(), _, _>(
            write.key,
            write.value,
            Some(Expiration::PX(write.px)),
            None,
            false,
        );
        match tokio::time::timeout(inner.command_timeout, set).await {
            Ok(Ok(())) => inner.breaker.success(),
            _ => {
                inner.write_errors.fetch_add(1, Relaxed);
                inner.breaker.failure();
            }
        }
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
