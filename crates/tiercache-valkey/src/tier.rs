//! [`ValkeyTier`]: the shared tier on Valkey (or Redis) through fred.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fred::prelude::{
    Builder, Client, ClientLike, Config, EventInterface, Expiration, HashesInterface,
    KeysInterface, LuaInterface, PubsubInterface, ReconnectPolicy, SetsInterface, Value,
};
use fred::types::ExpireOptions;
use rand::Rng;
use tiercache_core::{
    BoxFuture, CacheKey, Entry, Invalidation, InvalidationSink, KeyHash, LockAttempt, LockToken,
    Tier, TierError, TierHit, TierReport, Unlocked,
};
use tokio::sync::mpsc;

use crate::breaker::Breaker;
use crate::bus::{self, Ban, Bus};
use crate::codec;

/// How long a prefix ban is kept: entries it covers that outlive it (ttl
/// plus stale windows longer than this) could be read from L2 again.
pub const BAN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Takes the lock (`SET NX PX`) or tells how long it is still held.
const LOCK_SCRIPT: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return -10 else return redis.call('PTTL', KEYS[1]) end";

/// Deletes the lock only if it still holds this owner's token.
const UNLOCK_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('DEL', KEYS[1]) else return 0 end";

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
    fill_locks: bool,
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
            fill_locks: true,
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
    bus: Arc<Bus>,
    fill_locks: bool,
    prefix: String,
    command_timeout: Duration,
    breaker: Breaker,
    writes: mpsc::Sender<Write>,
    write_drops: AtomicU64,
    write_errors: AtomicU64,
    corrupt: AtomicU64,
    skipped: AtomicU64,
}

/// What the writer task does, in queue order.
enum Write {
    /// Sends a command (skipped while the breaker is open).
    Command(Command),
    /// Answers once every write queued before it is done.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// A queued command.
enum Command {
    /// `SET key value PX px`, then the key's hash into each tag set.
    Set {
        key: String,
        value: Bytes,
        px: i64,
        tags: Vec<String>,
        member: String,
    },
    /// Release a fill lock and announce how the fill ended, after the
    /// writes queued before it.
    Unlock {
        lock: String,
        channel: String,
        token: Bytes,
        filled: bool,
    },
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
        let mut perf = client.perf_config();
        // A burst of invalidations must not overrun the message stream (a
        // lag is read as missed messages: the whole L1 would be dropped).
        perf.broadcast_channel_capacity = perf.broadcast_channel_capacity.max(4096);
        let subscriber = Builder::from_config(client.client_config())
            .set_connection_config(client.connection_config().clone())
            .set_performance_config(perf)
            .set_policy(
                client
                    .client_reconnect_policy()
                    .unwrap_or(ReconnectPolicy::new_exponential(0, 50, 250, 2)),
            )
            .build_subscriber_client()
            .map_err(|e| ValkeyError::Client(e.to_string()))?;
        let instance = bus::hex(&rand::rng().random::<[u8; 16]>());
        let bus = Arc::new(Bus::new(
            subscriber.clone(),
            instance,
            format!("{}:inv", config.prefix),
        ));
        runtime.spawn(bus::dispatch(Arc::downgrade(&bus), subscriber.message_rx()));
        let (tx, rx) = mpsc::channel(config.write_queue);
        let inner = Arc::new(Inner {
            client,
            bus: bus.clone(),
            fill_locks: config.fill_locks,
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
        let weak = Arc::downgrade(&inner);
        runtime.spawn(bus::on_reconnect(
            Arc::downgrade(&bus),
            subscriber.reconnect_rx(),
            move || load_bans(weak.clone()),
        ));
        runtime.spawn(bus::heartbeat(
            Arc::downgrade(&bus),
            Duration::from_secs(1),
            config.command_timeout.max(Duration::from_millis(500)),
        ));
        let _connection = subscriber.connect();
        Ok(Self { inner })
    }

    /// The Valkey key of `key`'s fill lock: `PREFIX:{HASH}:lock`, in the entry's slot.
    pub fn lock_key(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "lock")
    }

    fn done_channel(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "done")
    }

    /// The Valkey set of the keys stored with `tag`: `PREFIX:{TAGHASH}:tag`.
    pub fn tag_key(&self, tag: &[u8]) -> String {
        let hash = CacheKey::builder().part(b"tag").part(tag).finish().hash();
        slot_key(&self.inner.prefix, &hash, "tag")
    }

    fn entry_key_of(&self, hash: &KeyHash) -> String {
        slot_key(&self.inner.prefix, hash, "e")
    }

    /// Deletes `keys` and announces `invalidation`, in one pipeline (one
    /// key per `DEL`: in a cluster the entries live on many slots).
    async fn delete_and_publish(
        &self,
        keys: Vec<String>,
        invalidation: Invalidation,
        at: Option<SystemTime>,
    ) -> Result<(), TierError> {
        let text = bus::encode(&bus::Message {
            from: self.inner.bus.instance.clone(),
            invalidation,
            at,
        });
        let pipe = self.inner.client.pipeline();
        for key in keys {
            let queued: Result<(), _> = pipe.del(key).await;
            queued.map_err(fred_error)?;
        }
        let queued: Result<(), _> = pipe.publish(&self.inner.bus.channel, text).await;
        queued.map_err(fred_error)?;
        let _: Value = pipe.all().await.map_err(fred_error)?;
        Ok(())
    }

    /// Waits (at most two command timeouts) until the writes queued so far
    /// are done: before a delete, so an earlier fill's `SET` cannot land
    /// after it, and before a graceful shutdown.
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.inner.writes.try_send(Write::Flush(tx)).is_ok() {
            let _ = tokio::time::timeout(self.inner.command_timeout * 2, rx).await;
        }
    }

    async fn apply_invalidation(&self, invalidation: Invalidation) -> Result<(), TierError> {
        self.flush().await;
        match invalidation {
            Invalidation::Keys(hashes) => {
                let keys = hashes.iter().map(|h| self.entry_key_of(h)).collect();
                self.delete_and_publish(keys, Invalidation::Keys(hashes), None)
                    .await
            }
            Invalidation::Tag(tag, mut hashes) => {
                let set = self.tag_key(&tag);
                let members: Vec<String> =
                    self.inner.client.smembers(&set).await.map_err(fred_error)?;
                hashes.extend(members.iter().filter_map(|m| KeyHash::from_hex(m)));
                hashes.sort_unstable();
                hashes.dedup();
                // This instance's L1 too: it may hold copies promoted from L2,
                // which its own tag index never saw.
                if let Some(sink) = self.inner.bus.sink() {
                    sink.apply(&Invalidation::Keys(hashes.clone()));
                }
                let mut keys: Vec<String> = hashes.iter().map(|h| self.entry_key_of(h)).collect();
                keys.push(set);
                self.delete_and_publish(keys, Invalidation::Tag(tag, hashes), None)
                    .await
            }
            Invalidation::Prefix(pattern) => {
                let at = SystemTime::now();
                let field = bus::hex(&pattern.to_bytes());
                let recorded: Result<i64, _> = self
                    .inner
                    .client
                    .hset(
                        bans_key(&self.inner.prefix),
                        (field, bus::millis(at).to_string()),
                    )
                    .await;
                recorded.map_err(fred_error)?;
                let ttl = BAN_RETENTION.as_millis() as i64;
                let kept: Result<i64, _> = self
                    .inner
                    .client
                    .pexpire(bans_key(&self.inner.prefix), ttl, None)
                    .await;
                kept.map_err(fred_error)?;
                self.inner.bus.add_ban(
                    Ban {
                        pattern: pattern.clone(),
                        at,
                    },
                    BAN_RETENTION,
                );
                self.delete_and_publish(Vec::new(), Invalidation::Prefix(pattern), Some(at))
                    .await
            }
            other => self.delete_and_publish(Vec::new(), other, None).await,
        }
    }

    /// The Valkey key an entry is stored under: `PREFIX:{HASH}:e`. The hash
    /// tag keeps an entry and its lock on one cluster slot, and no URL byte
    /// reaches the key.
    pub fn entry_key(&self, key: &CacheKey) -> String {
        self.entry_key_of(&key.hash())
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
            // Covered by a prefix invalidation: gone, like a deleted key.
            if self.inner.bus.banned(entry.key(), entry.times().created_at) {
                return Ok(None);
            }
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

    fn put(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[Bytes]) {
        let px = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        let write = Write::Command(Command::Set {
            key: self.entry_key(key),
            value: codec::encode(entry),
            px,
            tags: tags.iter().map(|t| self.tag_key(t)).collect(),
            member: key.hash().to_hex(),
        });
        if self.inner.writes.try_send(write).is_err() {
            self.inner.write_drops.fetch_add(1, Relaxed);
        }
    }

    fn invalidate<'a>(
        &'a self,
        invalidation: Invalidation,
    ) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async move {
            // A few round trips (a tag's members, deletes, the message):
            // bounded by a few command timeouts, not one.
            let bound = self.inner.command_timeout * 6;
            let op = self.apply_invalidation(invalidation);
            let result = match tokio::time::timeout(bound, op).await {
                Ok(result) => result,
                Err(_) => Err(TierError::timeout(format!(
                    "invalidation took over {bound:?}"
                ))),
            };
            match &result {
                Ok(()) => self.inner.breaker.success(),
                Err(_) => self.inner.breaker.failure(),
            }
            result
        })
    }

    fn listen(&self, sink: Weak<dyn InvalidationSink>) {
        self.inner.bus.set_sink(sink);
    }

    fn try_lock<'a>(
        &'a self,
        key: &'a CacheKey,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        Box::pin(async move {
            if !self.inner.fill_locks {
                return Ok(LockAttempt::Unsupported);
            }
            if !self.inner.breaker.allow() {
                self.inner.skipped.fetch_add(1, Relaxed);
                return Ok(LockAttempt::Unsupported);
            }
            let token = Bytes::from(bus::hex(&rand::rng().random::<[u8; 16]>()));
            let px = ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
            let lock = self.lock_key(key);
            let reply: i64 = self
                .bounded(async {
                    let r: Result<i64, _> = self
                        .inner
                        .client
                        .eval(
                            LOCK_SCRIPT,
                            vec![lock],
                            vec![Value::from(token.clone()), px.into()],
                        )
                        .await;
                    r.map_err(fred_error)
                })
                .await?;
            Ok(match reply {
                -10 => {
                    self.inner.bus.locks_acquired.fetch_add(1, Relaxed);
                    LockAttempt::Acquired(LockToken(token))
                }
                ms if ms > 0 => LockAttempt::Held(Duration::from_millis(ms as u64)),
                // Gone between SET and PTTL, or no expiry (not ours to judge).
                _ => LockAttempt::Held(Duration::ZERO),
            })
        })
    }

    fn unlock(&self, key: &CacheKey, token: &LockToken, filled: bool) {
        let write = Write::Command(Command::Unlock {
            lock: self.lock_key(key),
            channel: self.done_channel(key),
            token: token.0.clone(),
            filled,
        });
        if self.inner.writes.try_send(write).is_err() {
            // The lock expires by its PX; waiters read L2 then.
            self.inner.write_drops.fetch_add(1, Relaxed);
        }
    }

    fn wait_unlock<'a>(
        &'a self,
        key: &'a CacheKey,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Unlocked, TierError>> {
        Box::pin(async move {
            self.inner.bus.lock_waits.fetch_add(1, Relaxed);
            let channel = self.done_channel(key);
            let mut waiter = self.inner.bus.wait_on(&channel);
            if waiter.first {
                let subscriber = self.inner.bus.subscriber.clone();
                self.bounded(async {
                    subscriber
                        .ssubscribe(channel.clone())
                        .await
                        .map_err(fred_error)
                })
                .await?;
            }
            // Subscribed: a release from now on is heard. One before it left
            // no lock behind.
            let lock = self.lock_key(key);
            let held: i64 = self
                .bounded(async {
                    let r: Result<i64, _> = self.inner.client.exists(lock).await;
                    r.map_err(fred_error)
                })
                .await?;
            if held == 0 {
                return Ok(Unlocked::Gone);
            }
            match tokio::time::timeout(timeout, waiter.rx.wait_for(Option::is_some)).await {
                Ok(Ok(how)) => Ok(how.unwrap_or(Unlocked::Gone)),
                Ok(Err(_)) => Ok(Unlocked::Gone),
                Err(_) => Ok(Unlocked::TimedOut),
            }
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
        report.invalidations_received = i.bus.received.load(Relaxed);
        report.resyncs = i.bus.resyncs.load(Relaxed);
        report.locks_acquired = i.bus.locks_acquired.load(Relaxed);
        report.lock_waits = i.bus.lock_waits.load(Relaxed);
        report
    }
}

/// `PREFIX:{HASH}:SUFFIX`: the hash tag puts everything about one key (its
/// entry, lock and wake-up channel) on one cluster slot.
fn slot_key(prefix: &str, hash: &KeyHash, suffix: &str) -> String {
    format!("{prefix}:{{{hash}}}:{suffix}")
}

/// The hash of recorded prefix bans: `PREFIX:bans`.
fn bans_key(prefix: &str) -> String {
    format!("{prefix}:bans")
}

/// Reads the recorded prefix bans (on every reconnect).
async fn load_bans(tier: Weak<Inner>) -> Option<Vec<Ban>> {
    let inner = tier.upgrade()?;
    let key = bans_key(&inner.prefix);
    let read = inner
        .client
        .hgetall::<std::collections::HashMap<String, String>, _>(key);
    let fields = tokio::time::timeout(inner.command_timeout * 4, read)
        .await
        .ok()?
        .ok()?;
    let now = SystemTime::now();
    Some(
        fields
            .into_iter()
            .filter_map(|(pattern, at)| {
                let pattern = tiercache_core::KeyPattern::from_bytes(&bus::unhex(&pattern)?)?;
                let at = std::time::UNIX_EPOCH + Duration::from_millis(at.parse().ok()?);
                (at + BAN_RETENTION > now).then_some(Ban { pattern, at })
            })
            .collect(),
    )
}

/// Drains the write queue in order; ends when the tier is dropped.
async fn writer(tier: std::sync::Weak<Inner>, mut rx: mpsc::Receiver<Write>) {
    while let Some(write) = rx.recv().await {
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let command = match write {
            Write::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Write::Command(command) => command,
        };
        if !inner.breaker.allow() {
            inner.skipped.fetch_add(1, Relaxed);
            continue;
        }
        let done = tokio::time::timeout(inner.command_timeout, apply(&inner, command)).await;
        match done {
            Ok(Ok(())) => inner.breaker.success(),
            _ => {
                inner.write_errors.fetch_add(1, Relaxed);
                inner.breaker.failure();
            }
        }
    }
}

async fn apply(inner: &Inner, command: Command) -> Result<(), fred::error::Error> {
    let client = &inner.client;
    match command {
        Command::Set {
            key,
            value,
            px,
            tags,
            member,
        } => {
            client
                .set::<(), _, _>(key, value, Some(Expiration::PX(px)), None, false)
                .await?;
            for set in tags {
                // The set lives as long as its longest-lived member.
                client.sadd::<i64, _, _>(&set, member.as_str()).await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::NX))
                    .await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::GT))
                    .await?;
            }
            Ok(())
        }
        Command::Unlock {
            lock,
            channel,
            token,
            filled,
        } => {
            client
                .eval::<i64, _, _, _>(UNLOCK_SCRIPT, vec![lock], vec![Value::from(token)])
                .await?;
            let word = if filled { "1" } else { "0" };
            client.spublish::<i64, _, _>(channel, word).await?;
            Ok(())
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
