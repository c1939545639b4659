//! The invalidation bus and the fill-lock wake-ups, over Valkey pub/sub.
//!
//! Invalidations go out on one channel per prefix (`PREFIX:inv`, plain
//! `PUBLISH`, which a cluster forwards to every node). A released fill lock
//! is announced on the key's own shard channel (`PREFIX:{HASH}:done`,
//! `SPUBLISH`, in the key's slot), to which only the instances waiting on
//! it subscribe. Every reconnect of the subscriber, and any lag in reading
//! its messages, counts as missed messages: the engine drops its L1.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, SystemTime};

use fred::clients::SubscriberClient;
use fred::prelude::{ClientLike, PubsubInterface};
use tiercache_core::{Invalidation, InvalidationSink, Unlocked};
use tokio::sync::{broadcast, watch};

pub(crate) use crate::bans::Ban;
pub(crate) use crate::deaf::Hearing;
use crate::deaf::{Deafness, Losses};
pub(crate) use crate::message::{
    Message, decode, decode_drop, decode_stale_fill, encode, encode_drop, encode_stale_fill, hex,
    millis, unhex,
};
use crate::overtaken::{Overtaken, Scope};

/// The subscriber side of one tier.
pub(crate) struct Bus {
    pub(crate) subscriber: SubscriberClient,
    /// This instance's random id.
    pub(crate) instance: String,
    pub(crate) channel: String,
    prefix: String,
    /// Told of every invalidation heard (see [`crate::overtaken`]).
    overtaken: Arc<Overtaken>,
    waiters: Mutex<HashMap<String, Arc<watch::Sender<Option<Unlocked>>>>>,
    sink: Mutex<Option<Weak<dyn InvalidationSink>>>,
    bans: RwLock<Vec<Ban>>,
    /// The most bans held (see [`crate::bans::fold`]).
    max_bans: usize,
    pub(crate) received: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    pub(crate) locks_acquired: AtomicU64,
    /// Lock attempts the key's failing mark answered.
    pub(crate) failing_marks: AtomicU64,
    /// Moves of a held lock that did not land.
    pub(crate) locks_lost: AtomicU64,
    /// Whether the invalidation channel has been subscribed once.
    pub(crate) subscribed: watch::Sender<bool>,
    /// Whether the instance began serving before it could hear.
    pub(crate) hearing: Hearing,
    /// Whether the subscription is lost (see [`Bus::lost`]); a lock, so
    /// the sink is told in the order the state changes.
    deaf: Mutex<Deafness>,
    /// The latest of this instance's own echoes heard back (see
    /// [`crate::echo`]).
    pub(crate) echoes: watch::Sender<u64>,
    /// Asks the heartbeat for an echo now (a subscription just landed).
    pub(crate) echo_soon: Arc<tokio::sync::Notify>,
    /// Whether an echo has come back or been refused (`connect` waits).
    echo_decided: watch::Sender<bool>,
}

impl Bus {
    /// The bus of the tier under `prefix` (its channel is `PREFIX:inv`).
    pub(crate) fn new(
        subscriber: SubscriberClient,
        instance: String,
        prefix: String,
        overtaken: Arc<Overtaken>,
        max_bans: usize,
    ) -> Self {
        Self {
            subscriber,
            instance,
            channel: format!("{prefix}:inv"),
            prefix,
            overtaken,
            waiters: Mutex::default(),
            sink: Mutex::default(),
            bans: RwLock::default(),
            max_bans,
            received: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            locks_acquired: AtomicU64::new(0),
            failing_marks: AtomicU64::new(0),
            locks_lost: AtomicU64::new(0),
            subscribed: watch::channel(false).0,
            hearing: Hearing::default(),
            deaf: Mutex::default(),
            echoes: watch::channel(0).0,
            echo_soon: Arc::default(),
            echo_decided: watch::channel(false).0,
        }
    }

    /// The subscription is lost (its connection failed or went silent):
    /// what is published until it lands again may be missed, so the
    /// engine answers no L1 copy as fresh meanwhile (see
    /// `InvalidationSink::deaf`).
    pub(crate) fn lost(&self) {
        self.change_deafness(Deafness::lose);
    }

    /// The subscriber's ping went unanswered: deaf as [`lost`](Self::lost),
    /// until a ping is answered on the same connection (a slow moment,
    /// nothing missed) or a new one is subscribed.
    pub(crate) fn silent(&self) {
        self.change_deafness(Deafness::go_silent);
    }

    /// The subscriber's ping was answered.
    pub(crate) fn answered(&self) {
        self.change_deafness(Deafness::answer);
    }

    /// A (re)connection of the subscriber begins: the losses so far, which
    /// [`found`](Self::found) then ends.
    pub(crate) fn connecting(&self) -> Losses {
        self.deaf
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .connect()
    }

    /// Subscribed again, and L1 resynced, since the losses counted when the
    /// connection began (`since`): L1 answers again, unless another loss
    /// came meanwhile.
    pub(crate) fn found(&self, since: Losses) {
        self.change_deafness(|d| d.find(since));
    }

    /// This instance's own echo did not come back through its
    /// subscription (see [`crate::echo`]): deaf as [`lost`](Self::lost),
    /// until one does.
    pub(crate) fn refused(&self) {
        self.change_deafness(Deafness::refuse);
        self.echo_decided.send_replace(true);
    }

    /// An echo came back: the subscription carries messages (after a
    /// refusal, the caller read the bans and dropped L1 first).
    pub(crate) fn confirmed(&self) {
        self.change_deafness(Deafness::confirm);
        self.echo_decided.send_replace(true);
    }

    pub(crate) fn is_refused(&self) -> bool {
        self.deaf
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .refused()
    }

    pub(crate) fn is_deaf(&self) -> bool {
        self.deaf.lock().unwrap_or_else(|e| e.into_inner()).deaf()
    }

    fn change_deafness(&self, change: impl FnOnce(&mut Deafness)) {
        let mut state = self.deaf.lock().unwrap_or_else(|e| e.into_inner());
        let was = state.deaf();
        change(&mut state);
        if state.deaf() != was
            && let Some(sink) = self.sink()
        {
            sink.deaf(!was);
        }
    }

    /// Waits, until `deadline` at most, for the invalidation channel's
    /// first subscription: a message published before it is missed, and
    /// the first connection is no reconnect, so nothing would drop L1.
    /// Then for its echo's verdict (within the same bound): a refused
    /// subscription then serves deaf from the start.
    pub(crate) async fn until_subscribed(&self, deadline: tokio::time::Instant) {
        let mut subscribed = self.subscribed.subscribe();
        if tokio::time::timeout_at(deadline, subscribed.wait_for(|s| *s))
            .await
            .is_err()
        {
            self.serving_unheard();
            return;
        }
        let mut decided = self.echo_decided.subscribe();
        let _ = tokio::time::timeout_at(deadline, decided.wait_for(|d| *d)).await;
    }

    /// The instance serves from now on, subscribed or not: a subscription
    /// still to come drops L1 when it lands.
    pub(crate) fn serving_unheard(&self) {
        self.hearing.give_up();
    }

    pub(crate) fn set_sink(&self, sink: Weak<dyn InvalidationSink>) {
        // Under the deafness lock: a loss before the engine listened is
        // told to it now, and one after it, by `change_deafness`.
        let state = self.deaf.lock().unwrap_or_else(|e| e.into_inner());
        if state.deaf()
            && let Some(sink) = sink.upgrade()
        {
            sink.deaf(true);
        }
        *self.sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    pub(crate) fn sink(&self) -> Option<Arc<dyn InvalidationSink>> {
        self.sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
    }

    /// Copies promoted while the bans were unknown may be banned: the ones
    /// a ban covers (its pattern, created at or before it) leave L1. Not a
    /// resync (no message was missed: L1's other entries, the loads in
    /// flight and this instance's recent fills in L2 stay), and nothing at
    /// all when no ban was read.
    pub(crate) fn drop_banned(&self, bans: &[Ban]) {
        let Some(sink) = self.sink() else {
            return;
        };
        if !bans.is_empty() {
            let bans: Vec<_> = bans.iter().map(|b| (b.pattern.clone(), b.at)).collect();
            sink.drop_banned(&bans);
        }
    }

    /// Messages are being missed (the subscriber cannot hear): every L1
    /// entry must ask the origin again (see
    /// [`InvalidationSink::unheard`]). Counted as a resync.
    pub(crate) fn unheard(&self) {
        if let Some(sink) = self.sink() {
            sink.unheard();
        }
        self.resyncs.fetch_add(1, Relaxed);
    }

    /// Messages may have been missed: drop L1.
    pub(crate) fn resync(&self) {
        if let Some(sink) = self.sink() {
            sink.resync();
        }
        self.overtaken
            .heard(Scope::Everything, std::time::Instant::now());
        // Counted once L1 is dropped: whoever sees the count sees it done.
        self.resyncs.fetch_add(1, Relaxed);
    }

    /// Whether a ban covers an entry of this full key created at `created`.
    pub(crate) fn banned(&self, full: &[u8], created: SystemTime) -> bool {
        let bans = self.bans.read().unwrap_or_else(|e| e.into_inner());
        bans.iter()
            .any(|ban| created <= ban.at && ban.pattern.matches_full(full))
    }

    pub(crate) fn add_ban(&self, ban: Ban, retention: Duration) {
        let mut bans = self.bans.write().unwrap_or_else(|e| e.into_inner());
        let now = SystemTime::now();
        // One ban a pattern, at the later time of the two: an earlier one
        // (a purge of everything heard late) must not shorten a fold's.
        let mut ban = ban;
        bans.retain(|b| {
            let same = b.pattern == ban.pattern;
            if same {
                ban.at = ban.at.max(b.at);
            }
            b.at + retention > now && !same
        });
        bans.push(ban);
        crate::bans::fold(&mut bans, self.max_bans);
    }

    /// Adds the bans read from Valkey to those held (a ban heard while
    /// they were being read is kept), the later of two for one pattern.
    pub(crate) fn merge_bans(&self, loaded: Vec<Ban>, retention: Duration) {
        let mut bans = self.bans.write().unwrap_or_else(|e| e.into_inner());
        let now = SystemTime::now();
        let mut held: HashMap<tiercache_core::KeyPattern, usize> = bans
            .iter()
            .enumerate()
            .map(|(i, b)| (b.pattern.clone(), i))
            .collect();
        for ban in loaded {
            match held.get(&ban.pattern) {
                Some(&i) => bans[i].at = bans[i].at.max(ban.at),
                None => {
                    held.insert(ban.pattern.clone(), bans.len());
                    bans.push(ban);
                }
            }
        }
        bans.retain(|b| b.at + retention > now);
        crate::bans::fold(&mut bans, self.max_bans);
    }

    /// Registers interest in `channel`'s next message; the first waiter for
    /// a channel must subscribe to it (`first`).
    pub(crate) fn wait_on(self: &Arc<Self>, channel: &str) -> Waiter {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let (tx, first) = match waiters.get(channel) {
            Some(tx) => (tx.clone(), false),
            None => {
                let tx = Arc::new(watch::channel(None).0);
                waiters.insert(channel.to_owned(), tx.clone());
                (tx, true)
            }
        };
        Waiter {
            rx: tx.subscribe(),
            bus: self.clone(),
            channel: channel.to_owned(),
            first,
        }
    }

    /// Unsubscribes the shard channels the subscriber holds that nobody
    /// waits on. An unsubscribe that could not go out (Valkey down, a
    /// timeout) left its channel subscribed, and fred subscribes every
    /// channel it holds again on each reconnection: for good, each later
    /// release on it sent here too. (A wait that starts meanwhile may lose
    /// its subscription to this: it re-checks the lock on a short backoff.)
    pub(crate) async fn unsubscribe_strays(&self, timeout: Duration) {
        let strays: Vec<_> = {
            let waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            self.subscriber
                .tracked_shard_channels()
                .into_iter()
                .filter(|channel| !waiters.contains_key(&**channel))
                .collect()
        };
        for channel in strays {
            // Not past a first failure: the heartbeat's spacing is counted
            // on (the rest wait for its next beat).
            let unsubscribed =
                tokio::time::timeout(timeout, self.subscriber.sunsubscribe(channel)).await;
            if !matches!(unsubscribed, Ok(Ok(()))) {
                return;
            }
        }
    }

    fn wake(&self, channel: &str, how: Unlocked) {
        let waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = waiters.get(channel) {
            tx.send_replace(Some(how));
        }
    }

    fn on_message(&self, message: fred::types::Message) {
        let channel: &str = &message.channel;
        if channel != self.channel {
            let how = match &message.value {
                fred::types::Value::Integer(1) => Unlocked::Filled,
                value => value
                    .as_bytes()
                    .map_or(Unlocked::Passed, crate::lock::read_unlock_message),
            };
            self.wake(channel, how);
            return;
        }
        let Some(text) = message.value.as_str() else {
            return;
        };
        if crate::echo::hear(self, &text) {
            return;
        }
        // This instance's own too: one of its requests may have read the
        // copy from L2 before the delete.
        if let Some(hashes) = decode_drop(&text) {
            if let Some(sink) = self.sink() {
                sink.drop_copies(&hashes);
            }
            return;
        }
        if let Some((hash, created)) = decode_stale_fill(&text) {
            if let Some(sink) = self.sink() {
                sink.drop_fill(hash, &created);
            }
            return;
        }
        let Some(decoded) = decode(&text) else {
            return;
        };
        if decoded.from == self.instance {
            return;
        }
        if let (Invalidation::Prefix(pattern), Some(at)) = (&decoded.invalidation, decoded.at) {
            self.add_ban(
                Ban {
                    pattern: pattern.clone(),
                    at,
                },
                crate::bans::BAN_RETENTION,
            );
        }
        if let Some(sink) = self.sink() {
            sink.apply(&decoded.invalidation);
        }
        // After the engine's journal has it: a fill whose journal check came
        // first was queued before this (see `crate::overtaken`).
        if let Some(scope) = Scope::of(&decoded.invalidation, &self.prefix) {
            self.overtaken.heard(scope, std::time::Instant::now());
        }
        // Counted once applied: whoever sees the count sees it done.
        self.received.fetch_add(1, Relaxed);
    }
}

/// One wait on a shard channel; unsubscribes when the last waiter goes.
pub(crate) struct Waiter {
    pub(crate) rx: watch::Receiver<Option<Unlocked>>,
    bus: Arc<Bus>,
    channel: String,
    pub(crate) first: bool,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut waiters = self.bus.waiters.lock().unwrap_or_else(|e| e.into_inner());
        // The map's sender and this receiver's: nobody else waits.
        if waiters
            .get(&self.channel)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            waiters.remove(&self.channel);
            // Not while it reconnects: fred would hold the command until
            // it is back (the heartbeat unsubscribes what is left).
            if !self.bus.subscriber.is_connected() {
                return;
            }
            let subscriber = self.bus.subscriber.clone();
            let channel = self.channel.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = subscriber.sunsubscribe(channel).await;
                });
            }
        }
    }
}

/// Reads the subscriber's messages until the bus is gone; a lag is a resync.
pub(crate) async fn dispatch(bus: Weak<Bus>, mut rx: broadcast::Receiver<fred::types::Message>) {
    loop {
        let received = rx.recv().await;
        let Some(bus) = bus.upgrade() else {
            return;
        };
        match received {
            Ok(message) => bus.on_message(message),
            Err(broadcast::error::RecvError::Lagged(_)) => bus.resync(),
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}
