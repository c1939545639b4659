//! [`ValkeyTier`]: the shared tier on Valkey (or Redis) through fred.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use fred::prelude::{Builder, Client, ClientLike, EventInterface, KeysInterface, Value};
use rand::Rng;
use tiercache_core::{
    BoxFuture, CacheKey, Entry, Invalidation, InvalidationSink, LateFill, LockAttempt, LockLapse,
    LockToken, Tier, TierError, TierHit, TierReport, Unlocked,
};
use tokio::sync::mpsc;

use crate::breaker::Breaker;
use crate::bus::{self, Bus};
use crate::codec;
use crate::config::{ValkeyConfig, ValkeyError};
use crate::guard::Guard;
use crate::overtaken::Overtaken;
use crate::writer::{Write, writer};

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
    /// Replaced by a new one when fred's connection task dies (see
    /// `reconnect::keep_client_connected`): read it through [`Inner::client`].
    client: std::sync::RwLock<Client>,
    pub(crate) bus: Arc<Bus>,
    pub(crate) fill_locks: bool,
    /// See [`ValkeyConfig::max_prefix_bans`].
    pub(crate) max_prefix_bans: usize,
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
    /// Other instances' invalidations and this one's fills, lately.
    pub(crate) overtaken: Arc<Overtaken>,
    pub(crate) fills_overtaken: AtomicU64,
    /// The watchdog's forced reconnections (`reconnect::watchdog`).
    pub(crate) reconnects_forced: AtomicU64,
    /// What the connections failed with, for an operator.
    pub(crate) failures: Arc<crate::failures::Failures>,
}

impl Inner {
    /// The fred client in use now.
    pub(crate) fn client(&self) -> Client {
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts `client` in place of the one in use.
    pub(crate) fn replace_client(&self, client: Client) {
        *self.client.write().unwrap_or_else(|e| e.into_inner()) = client;
    }

    /// A release is done (or was never queued): the token is no longer ours.
    pub(crate) fn released(&self, token: &Bytes) {
        self.releasing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(token);
    }

    /// Whether a command may go out: only once the client is connected.
    /// fred keeps a command sent while it reconnects in its queue, with no
    /// bound, until Valkey is back, long after its caller gave up on it:
    /// an outage of hours kept every invalidation, write probe and release
    /// retry of those hours, fills' bytes included. (fred's per-command
    /// `fail_fast` is this check, for commands sent `with_options` only.)
    /// While the breaker is closed, a connection under way gets the
    /// command's own time to land first (fred's reconnections are 50-250 ms
    /// apart, and three failures open the breaker), so a short
    /// reconnection, or a client built by the caller and still connecting,
    /// costs a wait, not an open breaker. With it open (Valkey found down:
    /// a probe, an invalidation, the writer's batch) nothing waits.
    pub(crate) async fn connected(&self) -> Result<(), TierError> {
        let client = self.client();
        if client.is_connected() {
            return Ok(());
        }
        // Not waited for with the breaker open (Valkey found down, fred
        // reconnecting in the background): the probe held a request the
        // whole command timeout about once a breaker interval, and each
        // invalidation (to the outbox after) as long. The next probe finds
        // the connection once it is back.
        if self.breaker.open_for().is_some() {
            return Err(TierError::new(
                "Valkey is not connected (reconnecting; the breaker is open)",
                None,
            ));
        }
        let _ = tokio::time::timeout(self.command_timeout, client.wait_for_connect()).await;
        // Asked again: the client may have been replaced meanwhile.
        if self.client().is_connected() {
            Ok(())
        } else {
            Err(TierError::new(
                "Valkey is not connected (reconnecting)",
                None,
            ))
        }
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
                // A peer gone without a word (a NAT or firewall that forgot
                // the connection and drops what follows) is found by the
                // kernel: keepalive probes on an idle connection, and
                // data unacknowledged this long, close it (fred then
                // reconnects), where retransmissions took ~15 minutes. The
                // subscriber takes the same settings.
                c.tcp.keepalive = Some(
                    socket2::TcpKeepalive::new()
                        .with_time(Duration::from_secs(30))
                        .with_interval(Duration::from_secs(10))
                        .with_retries(3),
                );
                c.tcp.user_timeout = Some(Duration::from_secs(30));
            })
            .with_performance_config(|p| {
                p.default_command_timeout = config.command_timeout;
            })
            .set_policy(crate::reconnect::retry_forever())
            .build()
            .map_err(|e| ValkeyError::Client(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + config.connect_timeout;
        let tier = Self::build(client, config)?;
        let _ = tokio::time::timeout_at(deadline, tier.inner.client().wait_for_connect()).await;
        // Serve only once invalidations are heard (within the same bound):
        // one published before the subscription would go unheard, and the
        // entry it names would stay in L1 until its ttl.
        tier.inner.bus.until_subscribed(deadline).await;
        Ok(tier)
    }

    /// Wraps a fred client the caller built (the escape hatch: any fred
    /// configuration). Connects it if it is not connected yet.
    ///
    /// Returns at once, before the invalidation channel is subscribed:
    /// until it is, this instance does not hear the others' invalidations,
    /// so the subscription, when it lands, drops L1 (what was filled
    /// meanwhile may be stale). [`connect`](Self::connect) waits instead.
    pub fn from_client(client: Client, config: ValkeyConfig) -> Result<Self, ValkeyError> {
        let tier = Self::build(client, config)?;
        tier.inner.bus.serving_unheard();
        Ok(tier)
    }

    fn build(client: Client, config: ValkeyConfig) -> Result<Self, ValkeyError> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ValkeyError::NoRuntime)?;
        let _guard = runtime.enter();
        // Heard from before it connects: a first connection refused counts.
        let failures = Arc::new(crate::failures::Failures::default());
        failures.watch(&client);
        // Ours to keep running when this tier connects it (see
        // `reconnect::keep_client_connected`).
        let task = (!client.is_connected()).then(|| client.connect());
        // A heartbeat's ping unanswered for this long finds a connection
        // gone silent (see `reconnect::heartbeat`).
        let heartbeat_timeout = config.command_timeout.max(Duration::from_millis(500));
        let unheard_l1_for = config.unheard_l1_for;
        let subscriber = crate::reconnect::subscriber(&client, heartbeat_timeout)
            .map_err(|e| ValkeyError::Client(e.to_string()))?;
        failures.watch(&subscriber);
        let instance = bus::hex(&rand::rng().random::<[u8; 16]>());
        let (tx, rx) = mpsc::channel(config.write_queue);
        // The heartbeat finds a silent subscription within its spacing,
        // its timeout, fred's check and a reconnection: a message later
        // than that is a resync anyway.
        let grace = crate::reconnect::heartbeat_every(heartbeat_timeout)
            + 2 * heartbeat_timeout
            + Duration::from_secs(1);
        let overtaken = Arc::new(Overtaken::new(tx.clone(), grace, config.prefix.clone()));
        let bus = Arc::new(Bus::new(
            subscriber.clone(),
            instance,
            config.prefix.clone(),
            overtaken.clone(),
            config.max_prefix_bans,
        ));
        runtime.spawn(bus::dispatch(Arc::downgrade(&bus), subscriber.message_rx()));
        let inner = Arc::new(Inner {
            client: std::sync::RwLock::new(client),
            bus: bus.clone(),
            fill_locks: config.fill_locks,
            max_prefix_bans: config.max_prefix_bans,
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
            overtaken,
            fills_overtaken: AtomicU64::new(0),
            reconnects_forced: AtomicU64::new(0),
            failures,
        });
        runtime.spawn(writer(Arc::downgrade(&inner), rx));
        runtime.spawn(crate::reconnect::watchdog(
            Arc::downgrade(&inner),
            heartbeat_timeout,
        ));
        let weak = Arc::downgrade(&inner);
        runtime.spawn(crate::reconnect::on_reconnect(
            Arc::downgrade(&bus),
            subscriber.reconnect_rx(),
            subscriber.error_rx(),
            move || crate::bans::load_bans(weak.clone()),
        ));
        runtime.spawn(crate::reconnect::heartbeat(
            Arc::downgrade(&bus),
            Arc::downgrade(&inner),
            heartbeat_timeout,
            unheard_l1_for,
        ));
        let tier = Arc::downgrade(&inner);
        // Not kept running: started again on the same client, its writes
        // go out late (see `reconnect::keep_client_connected`), and a new
        // subscriber would need its streams' tasks rewired. Its heartbeat
        // finds it deaf, and L1 then asks the origin again.
        let _subscribed = subscriber.connect();
        if let Some(task) = task {
            runtime.spawn(crate::reconnect::keep_client_connected(task, tier));
        }
        Ok(Self { inner })
    }

    /// The fred client, for callers that need the server directly (the
    /// tier may replace it: ask again rather than keep it).
    pub fn client(&self) -> Client {
        self.inner.client()
    }

    /// Whether the tier's own client and its subscriber are both connected
    /// now (what fred believes: a connection gone silent still counts).
    pub fn is_connected(&self) -> bool {
        self.inner.client().is_connected() && self.inner.bus.subscriber.is_connected()
    }

    async fn read(&self, key: &str) -> Result<(Option<Bytes>, i64), TierError> {
        let pipe = self.inner.client().pipeline();
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

    pub(crate) fn bounded<'a, T: Send + 'a>(
        &'a self,
        op: impl std::future::Future<Output = Result<T, TierError>> + Send + 'a,
    ) -> impl std::future::Future<Output = Result<T, TierError>> + Send + 'a {
        let inner = &self.inner;
        async move {
            // The wait for a connection under way counts in the bound.
            let op = async {
                inner.connected().await?;
                op.await
            };
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
            // Deaf: a prefix invalidation (a ban) made meanwhile was not
            // heard; the bans are read from Valkey, after this read's own
            // request (a ban acknowledged before it is seen), and a copy
            // they cannot be read for is a miss.
            if self.inner.bus.is_deaf() {
                let weak = Arc::downgrade(&self.inner);
                let read = crate::bans::load_bans(weak);
                let Ok(Some(bans)) = tokio::time::timeout(self.inner.command_timeout, read).await
                else {
                    return Ok(None);
                };
                self.inner.bus.merge_bans(bans, crate::bans::BAN_RETENTION);
            }
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
        self.queue_fill(key, entry, ttl, tags, None);
    }

    fn put_over(&self, key: &CacheKey, entry: &Entry, ttl: Duration, tags: &[Bytes], read: &Entry) {
        let guard = Guard::Over(codec::created_at(read));
        self.queue_fill(key, entry, ttl, tags, Some(guard));
    }

    fn put_unless_newer(
        &self,
        key: &CacheKey,
        entry: &Entry,
        ttl: Duration,
        tags: &[Bytes],
        late: &LateFill,
    ) {
        let guard = Guard::unless_newer_than(late);
        self.queue_fill(key, entry, ttl, tags, Some(guard));
    }

    fn invalidate<'a>(
        &'a self,
        invalidation: Invalidation,
    ) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(async move {
            // A few round trips (a tag's members, deletes, the message):
            // bounded by a few command timeouts, not one.
            let bound = self.inner.command_timeout * 6;
            let op = async {
                self.inner.connected().await?;
                self.apply_invalidation(invalidation).await
            };
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
        Box::pin(self.acquire_lock(key, ttl, false))
    }

    fn try_lock_unless_failing<'a>(
        &'a self,
        key: &'a CacheKey,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LockAttempt, TierError>> {
        Box::pin(self.acquire_lock(key, ttl, true))
    }

    fn unlock(&self, key: &CacheKey, token: &LockToken, how: Unlocked) {
        self.release_lock(key, token, how, None);
    }

    fn unlock_failing(&self, key: &CacheKey, token: &LockToken, how: Unlocked, mark: Duration) {
        self.release_lock(key, token, how, Some(mark));
    }

    fn extend_lock(&self, key: &CacheKey, token: &LockToken, ttl: Duration, lapse: LockLapse) {
        self.move_lock_on(key, token, ttl, lapse);
    }

    fn wait_unlock<'a>(
        &'a self,
        key: &'a CacheKey,
        holder: Option<&'a LockToken>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Unlocked, TierError>> {
        Box::pin(self.wait_for_release(key, holder, timeout))
    }

    fn available(&self) -> bool {
        !self.inner.breaker.is_open()
    }

    fn report(&self) -> TierReport {
        self.inner.report()
    }

    fn last_failure(&self) -> Option<tiercache_core::TierFailure> {
        self.inner.failures.last()
    }
}
