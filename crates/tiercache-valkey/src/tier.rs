//! [`ValkeyTier`]: the shared tier on Valkey (or Redis) through fred.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fred::prelude::{
    Builder, Client, ClientLike, EventInterface, HashesInterface, KeysInterface, LuaInterface,
    PubsubInterface, ReconnectPolicy, Value,
};
use rand::Rng;
use tiercache_core::{
    BoxFuture, CacheKey, Entry, Invalidation, InvalidationSink, KeyHash, LockAttempt, LockToken,
    Tier, TierError, TierHit, TierReport, Unlocked,
};
use tokio::sync::mpsc;

use crate::bans::{BAN_RETENTION, bans_key};
use crate::breaker::Breaker;
use crate::bus::{self, Ban, Bus};
use crate::codec;
use crate::config::{ValkeyConfig, ValkeyError};
use crate::lock::{LOCK_SCRIPT, Release, read_unlock_message, release_until_done, unlock_message};
use crate::writer::{Command, Write, writer};

/// The L2 tier on Valkey. Cheap to clone.
///
/// Reads are one round trip (`GET` and `PTTL` pipelined); writes go through a
/// bounded queue to a background task (`SET key value PX ttl`); every
/// operation is bounded by the command timeout, and a circuit breaker stops
/// a dead server from costing a timeout per request. Valkey absent at start
/// is not an error: the tier reconnects in the background and fails open.
#[derive(Clone)]
pub struct ValkeyTier {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) bus: Arc<Bus>,
    pub(crate) fill_locks: bool,
    pub(crate) prefix: String,
    pub(crate) command_timeout: Duration,
    pub(crate) breaker: Breaker,
    pub(crate) writes: mpsc::Sender<Write>,
    pub(crate) write_drops: AtomicU64,
    /// Bytes the queued fills hold, and their bound.
    pub(crate) queued_bytes: std::sync::atomic::AtomicUsize,
    pub(crate) queue_bytes_bound: usize,
    pub(crate) write_errors: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) skipped: AtomicU64,
    /// Tokens of locks this instance released whose release has not landed yet.
    pub(crate) releasing: std::sync::Mutex<std::collections::HashSet<Bytes>>,
    /// Locks this instance holds, and when each expires by its `PX`.
    pub(crate) held: std::sync::Mutex<std::collections::HashMap<Bytes, tokio::time::Instant>>,
    /// Lock releases sent again after a failure.
    pub(crate) release_retries: AtomicU64,
}

/// How long a lock's re-checks must keep failing before its waiter gives
/// up on Valkey and goes to the origin itself.
const FAIL_OPEN_AFTER: Duration = Duration::from_millis(500);

impl Inner {
    /// A release is done (or was never queued): the token is no longer ours.
    pub(crate) fn released(&self, token: &Bytes) {
        self.releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(token);
    }
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
            queued_bytes: Default::default(),
            queue_bytes_bound: config.write_queue_bytes,
            write_errors: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            releasing: Default::default(),
            held: Default::default(),
            release_retries: AtomicU64::new(0),
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

    /// Where a lock's holder leaves an answer it shared unstored:
    /// `PREFIX:{HASH}:shared:TOKEN`, for [`SHARED_ANSWER_TTL`]. Named by
    /// the holder's token, so only the requests that waited on that holder
    /// read it; the next flight goes to the origin again.
    fn shared_key(&self, key: &CacheKey, holder: &LockToken) -> String {
        let token = String::from_utf8_lossy(&holder.0);
        slot_key(&self.inner.prefix, &key.hash(), &format!("shared:{token}"))
    }

    /// How a lock found gone ended: filled (the entry is there), shared (its
    /// holder left its answer), or gone without a word.
    async fn gone(
        &self,
        key: &CacheKey,
        holder: Option<&LockToken>,
    ) -> Result<Unlocked, TierError> {
        let pipe = self.inner.client.pipeline();
        let queued: Result<(), _> = pipe.exists(self.entry_key(key)).await;
        queued.map_err(fred_error)?;
        if let Some(holder) = holder {
            let queued: Result<(), _> = pipe.get(self.shared_key(key, holder)).await;
            queued.map_err(fred_error)?;
        }
        let mut replies: Vec<Value> = pipe.all().await.map_err(fred_error)?;
        let shared = replies
            .pop()
            .and_then(|v| v.as_bytes().map(read_unlock_message));
        let filled = replies.pop().and_then(|v| v.as_i64()).unwrap_or(0) > 0;
        Ok(match shared {
            _ if filled => Unlocked::Filled,
            Some(shared @ Unlocked::Shared(..)) => shared,
            _ => Unlocked::Gone,
        })
    }

    fn done_channel(&self, key: &CacheKey) -> String {
        slot_key(&self.inner.prefix, &key.hash(), "done")
    }

    /// The Valkey sorted set of the keys stored with `tag`: `PREFIX:{TAGHASH}:tags`.
    ///
    /// A sorted set: each member (a key's hash) scored by when its entry
    /// expires, trimmed of expired members on every write, so a tag that
    /// every response carries stays the size of what is alive.
    pub fn tag_key(&self, tag: &[u8]) -> String {
        let hash = CacheKey::builder().part(b"tag").part(tag).finish().hash();
        slot_key(&self.inner.prefix, &hash, "tags")
    }

    /// The plain set the previous version kept a tag's keys in (read once
    /// by an invalidation, during a rolling upgrade).
    pub(crate) fn legacy_tag_key(&self, tag: &[u8]) -> String {
        let hash = CacheKey::builder().part(b"tag").part(tag).finish().hash();
        slot_key(&self.inner.prefix, &hash, "tag")
    }

    pub(crate) fn entry_key_of(&self, hash: &KeyHash) -> String {
        slot_key(&self.inner.prefix, hash, "e")
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

pub(crate) fn fred_error(e: fred::error::Error) -> TierError {
    if matches!(e.kind(), fred::error::ErrorKind::Timeout) {
        TierError::timeout(e.to_string())
    } else {
        TierError::new(e.to_string(), Some(Box::new(e)))
    }
}

impl ValkeyTier {
    /// A lock attempt got no answer: if the script ran after all, this
    /// instance holds a lock nobody knows of. Release it by its token when
    /// Valkey answers again (announcing only if it was there).
    fn release_possibly_held(&self, key: &CacheKey, token: &Bytes, ttl: Duration) {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token.clone());
        let release = Release {
            lock: self.lock_key(key),
            channel: self.done_channel(key),
            shared: String::new(),
            token: token.clone(),
            message: Bytes::from_static(b"0"),
            until: tokio::time::Instant::now() + ttl,
            announce: false,
        };
        tokio::spawn(release_until_done(Arc::downgrade(&self.inner), release));
    }

    /// Whether `key`'s fill lock exists.
    async fn lock_held(&self, key: &CacheKey) -> Result<bool, TierError> {
        let lock = self.lock_key(key);
        let held: i64 = self
            .bounded(async {
                let r: Result<i64, _> = self.inner.client.exists(lock).await;
                r.map_err(fred_error)
            })
            .await?;
        Ok(held > 0)
    }

    fn is_releasing(&self, holder: &LockToken) -> bool {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&holder.0)
    }

    /// One run of the lock script.
    async fn lock_once(
        &self,
        key: &CacheKey,
        token: &Bytes,
        px: i64,
    ) -> Result<LockAttempt, TierError> {
        {
            let lock = self.lock_key(key);
            let reply: Vec<Value> = self
                .bounded(async {
                    let r: Result<Vec<Value>, _> = self
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
            let ms = reply.first().and_then(Value::as_i64).unwrap_or(0);
            let holder = reply
                .get(1)
                .and_then(Value::as_bytes)
                .filter(|t| !t.is_empty())
                .map(|t| LockToken(Bytes::copy_from_slice(t)));
            Ok(match ms {
                -10 => {
                    self.inner.bus.locks_acquired.fetch_add(1, Relaxed);
                    LockAttempt::Acquired(LockToken(token.clone()))
                }
                ms if ms > 0 => LockAttempt::Held {
                    left: Duration::from_millis(ms as u64),
                    holder,
                },
                // Gone between SET and PTTL, or no expiry (not ours to judge).
                _ => LockAttempt::Held {
                    left: Duration::ZERO,
                    holder,
                },
            })
        }
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
        let value = codec::encode(entry);
        let size = value.len();
        let queued = &self.inner.queued_bytes;
        let before = queued.fetch_add(size, Relaxed);
        if before > 0 && before + size > self.inner.queue_bytes_bound {
            queued.fetch_sub(size, Relaxed);
            self.inner.write_drops.fetch_add(1, Relaxed);
            return;
        }
        let write = Write::Command(Command::Set {
            key: self.entry_key(key),
            value,
            px,
            tags: tags.iter().map(|t| self.tag_key(t)).collect(),
            member: key.hash().to_hex(),
        });
        if self.inner.writes.try_send(write).is_err() {
            queued.fetch_sub(size, Relaxed);
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
            let mut attempt = match self.lock_once(key, &token, px).await {
                Ok(attempt) => attempt,
                Err(e) => {
                    // The script may still run once Valkey reads it: treat
                    // the lock as possibly held, and release it by its token
                    // when Valkey answers again.
                    self.release_possibly_held(key, &token, ttl);
                    return Err(e);
                }
            };
            // Held by this instance's own finished flight, whose release is
            // still in the write queue: let it land and try again, rather
            // than wait on (or answer with) a flight that is over.
            if let LockAttempt::Held {
                holder: Some(holder),
                ..
            } = &attempt
                && self.is_releasing(holder)
            {
                self.flush().await;
                attempt = match self.lock_once(key, &token, px).await {
                    Ok(attempt) => attempt,
                    Err(e) => {
                        self.release_possibly_held(key, &token, ttl);
                        return Err(e);
                    }
                };
            }
            if let LockAttempt::Acquired(_) = &attempt {
                self.inner
                    .held
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(token, tokio::time::Instant::now() + ttl);
            }
            Ok(attempt)
        })
    }

    fn unlock(&self, key: &CacheKey, token: &LockToken, how: Unlocked) {
        self.inner
            .releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token.0.clone());
        let until = self
            .inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token.0)
            .unwrap_or_else(tokio::time::Instant::now);
        let release = Release {
            lock: self.lock_key(key),
            channel: self.done_channel(key),
            shared: self.shared_key(key, token),
            token: token.0.clone(),
            message: unlock_message(&how),
            until,
            announce: true,
        };
        // After the writes queued before it (a fill's `SET` lands first); a
        // full queue does not drop it: it goes out on its own at once.
        let queued = self
            .inner
            .writes
            .try_send(Write::Command(Command::Unlock(release)));
        if let Err(full) = queued
            && let Write::Command(Command::Unlock(release)) = full.into_inner()
        {
            tokio::spawn(release_until_done(Arc::downgrade(&self.inner), release));
        }
    }

    fn wait_unlock<'a>(
        &'a self,
        key: &'a CacheKey,
        holder: Option<&'a LockToken>,
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
            // no lock behind. The notification is not relied on alone: the
            // lock is re-checked on a short backoff (50, 100, 200 ms), so a
            // lost release or notification costs one step, not the lock's
            // whole life.
            // Failed re-checks are a blip (a slow moment under load) until
            // they have failed for `FAIL_OPEN_AFTER`: then Valkey is gone,
            // and the wait fails open (the request goes to the origin).
            let deadline = tokio::time::Instant::now() + timeout;
            let mut step = Duration::from_millis(50);
            let mut failing_since = None;
            loop {
                match self.lock_held(key).await {
                    Ok(false) => return self.bounded(self.gone(key, holder)).await,
                    Ok(true) => failing_since = None,
                    Err(e) => {
                        let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                        if since.elapsed() >= FAIL_OPEN_AFTER {
                            return Err(e);
                        }
                    }
                }
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Ok(Unlocked::TimedOut);
                }
                match tokio::time::timeout(step.min(left), waiter.rx.wait_for(Option::is_some))
                    .await
                {
                    Ok(Ok(how)) => return Ok(how.clone().unwrap_or(Unlocked::Gone)),
                    Ok(Err(_)) => return Ok(Unlocked::Gone),
                    Err(_) => step = (step * 2).min(Duration::from_millis(200)),
                }
            }
        })
    }

    fn available(&self) -> bool {
        !self.inner.breaker.is_open()
    }

    fn report(&self) -> TierReport {
        let i = &self.inner;
        let mut report = TierReport::default();
        report.write_queue = (i.writes.max_capacity() - i.writes.capacity()) as u64;
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
        report.release_retries = i.release_retries.load(Relaxed);
        report
    }
}

/// `PREFIX:{HASH}:SUFFIX`: the hash tag puts everything about one key (its
/// entry, lock and wake-up channel) on one cluster slot.
pub(crate) fn slot_key(prefix: &str, hash: &KeyHash, suffix: &str) -> String {
    format!("{prefix}:{{{hash}}}:{suffix}")
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
