//! The subscriber's connection: what each (re)connection does (subscribe
//! again, read the prefix bans, drop L1 when messages may have been
//! missed), the heartbeat that finds a connection swallowing traffic, and
//! the watchdog that reopens the tier's own client when Valkey has stayed
//! out for long.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::{
    Builder, Client, ClientLike, ClusterInterface, PubsubInterface, ReconnectPolicy, Server,
};
use fred::types::ClusterHash;
use fred::types::config::UnresponsiveConfig;
use tokio::sync::broadcast;

use crate::bus::{Ban, Bus};
use crate::tier::Inner;

/// How long the breaker stays open, every probe failing, before the
/// tier's own client is made to reconnect.
pub(crate) const REOPEN_AFTER: Duration = Duration::from_secs(5);

/// How often the heartbeat pings a subscriber whose ping may take
/// `timeout`: every second, but never sooner than two timeouts apart, for
/// fred's unresponsive check counts from a connection's last write (a ping
/// sent again sooner would hide the silence).
pub(crate) fn heartbeat_every(timeout: Duration) -> Duration {
    Duration::from_secs(1).max(2 * timeout)
}

/// On every (re)connection of the subscriber: subscribe again, reload the
/// bans, and (after the first) drop L1, since messages sent while it was
/// away were missed. `reload` reads the bans from Valkey. Each failure of
/// its connection (`errors`) makes the instance deaf until a subscription
/// lands again and L1 is dropped: another instance's write acknowledged
/// meanwhile is not heard here.
pub(crate) async fn on_reconnect<F, Fut>(
    bus: Weak<Bus>,
    mut rx: broadcast::Receiver<fred::prelude::Server>,
    mut errors: broadcast::Receiver<(fred::error::Error, Option<Server>)>,
    reload: F,
) where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Option<Vec<Ban>>> + Send,
{
    // A retry of the bans' read running (at most one: when it lands it
    // serves every reconnect since).
    let retrying = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A server's first connection is no reconnect: nothing was missed on
    // it (a cluster connects to each node in turn). Without a cluster there
    // is one connection: any after the first is a reconnect, also to a
    // server never seen (the new primary after a Sentinel failover).
    let mut seen = std::collections::HashSet::new();
    // On a cluster, the primaries it had when the subscriber first
    // connected: each one's first connection is no reconnection.
    let mut at_start: Option<std::collections::HashSet<Server>> = None;
    let mut errors_open = true;
    loop {
        let event = tokio::select! {
            // First: a failure sent before a reconnection is seen before it.
            biased;
            error = errors.recv(), if errors_open => {
                match (error, bus.upgrade()) {
                    (Err(broadcast::error::RecvError::Closed), _) => errors_open = false,
                    (_, Some(live)) => live.lost(),
                    (_, None) => return,
                }
                continue;
            }
            event = rx.recv() => event,
        };
        let Some(live) = bus.upgrade() else {
            return;
        };
        let first = match event {
            // A node first seen later is no first connection: the
            // replica promoted in place of the node that held the
            // subscription is one (what was published meanwhile was
            // missed), as is a node added since.
            Ok(server) if live.subscriber.is_clustered() => {
                let at_start = at_start.get_or_insert_with(|| {
                    live.subscriber
                        .cached_cluster_state()
                        .map(|state| state.unique_primary_nodes().into_iter().collect())
                        .unwrap_or_default()
                });
                at_start.remove(&server) && seen.insert(server)
            }
            Ok(server) => seen.is_empty() && seen.insert(server),
            Err(broadcast::error::RecvError::Lagged(_)) => false,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        // Whether this instance served before it could hear: only a
        // subscription that went through settles it.
        let mut served_unheard = false;
        let was_deaf = live.is_deaf();
        let since = live.connecting();
        let subscribed = live
            .subscriber
            .subscribe(live.channel.clone())
            .await
            .is_ok();
        if subscribed {
            served_unheard = live.hearing.heard();
            live.subscribed.send_replace(true);
            // fred's `Ok` is no proof that the server took it.
            live.echo_soon.notify_one();
        }
        // The lock channels after, apart: a round trip per slot group must
        // not hold the invalidation channel, nor the resync.
        tokio::spawn(resubscribe(live.subscriber.clone()));
        drop(live);
        // The first connection counts too when the instance has served
        // without hearing (Valkey was down when it started), or was deaf.
        let resync = !first || served_unheard || was_deaf;
        // The bans first, then L1 goes: a copy promoted in between is
        // checked against them.
        if let Some(bans) = reload().await {
            let Some(live) = bus.upgrade() else {
                return;
            };
            // `connect` returned once subscribed, before this read: a copy
            // promoted meanwhile was checked against no bans. Merged first,
            // so a read that checks them after the scan refuses the copy.
            let dropped = (!resync && !bans.is_empty()).then(|| bans.clone());
            live.merge_bans(bans, crate::bans::BAN_RETENTION);
            if let Some(bans) = dropped {
                live.drop_banned(&bans);
            }
            if resync {
                live.resync();
            }
            if subscribed {
                live.found(since);
            }
            continue;
        }
        // Not read (a new instance's subscriber up before the client that
        // reads them, a slow moment): L1 goes now all the same, and the
        // read is retried; until it lands, copies a prefix invalidation
        // banned may be promoted, so what the bans match leaves L1 once it
        // does.
        // The retry runs apart, so later reconnects are not held up.
        if let Some(live) = bus.upgrade() {
            if resync {
                live.resync();
            }
            if subscribed {
                live.found(since);
            }
        }
        if retrying.swap(true, Relaxed) {
            continue;
        }
        let (bus, reload, retrying) = (bus.clone(), reload.clone(), retrying.clone());
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(50);
            let bans = loop {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                if bus.strong_count() == 0 {
                    return;
                }
                if let Some(bans) = reload().await {
                    break bans;
                }
            };
            retrying.store(false, Relaxed);
            if let Some(live) = bus.upgrade() {
                // Merged first: a read after the scan checks them.
                live.merge_bans(bans.clone(), crate::bans::BAN_RETENTION);
                live.drop_banned(&bans);
            }
        });
    }
}

/// The subscriber beside `client`: its servers, connection and
/// reconnection settings; a message stream that a burst of invalidations
/// does not overrun (a lag is read as missed messages: the whole L1 would
/// be dropped); and fred's unresponsive check at the heartbeat's `timeout`,
/// unless the caller's client chose its own: on a cluster fred's forced
/// reconnection keeps a connection it still thinks open, so the check is
/// what closes the one whose ping went unanswered (a reconnection follows,
/// which counts as a resync).
pub(crate) fn subscriber(
    client: &Client,
    timeout: Duration,
) -> Result<SubscriberClient, fred::error::Error> {
    let mut perf = client.perf_config();
    perf.broadcast_channel_capacity = perf.broadcast_channel_capacity.max(4096);
    let mut connection = client.connection_config().clone();
    if connection.unresponsive.max_timeout.is_none() {
        connection.unresponsive = UnresponsiveConfig {
            max_timeout: Some(timeout),
            interval: (timeout / 4).max(Duration::from_millis(50)),
        };
    }
    Builder::from_config(client.client_config())
        .set_connection_config(connection)
        .set_performance_config(perf)
        .set_policy(
            client
                .client_reconnect_policy()
                .unwrap_or_else(retry_forever),
        )
        .build_subscriber_client()
}

/// Subscribes again to the lock channels the subscriber holds (the
/// invalidation channel is subscribed by the caller). Not fred's
/// `resubscribe_all`: it sends `SUBSCRIBE` and `PSUBSCRIBE` even with
/// nothing to name, which the server refuses with an error, counted in
/// its `errorstats` on every connection and reconnection.
async fn resubscribe(subscriber: SubscriberClient) {
    let held = subscriber.tracked_shard_channels();
    if held.is_empty() {
        return;
    }
    let Ok(by_slot) = fred::util::group_by_hash_slot(held) else {
        return;
    };
    for (_, channels) in by_slot {
        let _ = subscriber.ssubscribe(channels).await;
    }
}

/// Keeps the tier's own fred client's connection task running. fred 10.1 ends that
/// task for good on an error it takes as fatal, while the client still
/// says it is connected: on a cluster one `-ASK` reply (a read of a key a
/// slot migration has already moved), with the single command attempt the
/// tier gives each command, makes `process_ask` fail the whole task, which
/// closes every connection and leaves the command queue unread. Every
/// later command then waits out its timeout, and neither
/// `force_reconnection` nor a new socket reaches it. A task that ended in
/// an error is replaced, counted in `reconnects_forced`: 250 ms after, and
/// twice as long after each end that came soon after its start (an error
/// that ends every start, a bad configuration, is not retried four times
/// a second), up to 10 s. One that ended because the client quit (also
/// while it was reconnecting: fred cancels it then), or whose tier is
/// gone, is not replaced.
///
/// Replaced by a new client (same settings) rather than started again: a
/// task that dies leaves fred's count of queued commands too high (`drain_command_rx`
/// does not take the commands it cancels off it), and a client started
/// again flushes a write only when that count reads zero, so its
/// commands went out late, as others timed out (a rerun from outside:
/// L2 stayed off in three runs of four).
pub(crate) async fn keep_client_connected(mut task: fred::types::ConnectHandle, tier: Weak<Inner>) {
    const FIRST: Duration = Duration::from_millis(250);
    let mut pause = FIRST;
    loop {
        let started = tokio::time::Instant::now();
        let ended = task.await;
        let Some(inner) = tier.upgrade() else {
            return;
        };
        match ended {
            Ok(Ok(())) => return,
            Ok(Err(e)) if *e.kind() == fred::error::ErrorKind::Canceled => return,
            _ => {}
        }
        inner.reconnects_forced.fetch_add(1, Relaxed);
        drop(inner);
        if started.elapsed() >= Duration::from_secs(10) {
            pause = FIRST;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(10));
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let old = inner.client();
        task = match rebuilt(&old) {
            Ok(new) => {
                inner.failures.watch(&new);
                let task = new.connect();
                inner.replace_client(new);
                task
            }
            Err(_) => old.connect(),
        };
    }
}

/// A new client with `old`'s settings.
fn rebuilt(old: &Client) -> Result<Client, fred::error::Error> {
    Builder::from_config(old.client_config())
        .set_connection_config(old.connection_config().clone())
        .set_performance_config(old.perf_config())
        .set_policy(old.client_reconnect_policy().unwrap_or_else(retry_forever))
        .build()
}

/// The reconnection policy of a client built here, and of one built from
/// a caller's client that has none: retry forever, never more than 250 ms
/// apart, so a server that comes back is in use again within the breaker
/// interval plus this.
pub(crate) fn retry_forever() -> ReconnectPolicy {
    ReconnectPolicy::new_exponential(0, 50, 250, 2)
}

/// Once the breaker has stayed open [`REOPEN_AFTER`] (and each
/// `REOPEN_AFTER` after while it stays open), pings Valkey on the tier's
/// own client: an answer closes the breaker (an idle instance sends no
/// probe of its own); none makes the client reconnect, if fred thinks it
/// connected. A connection gone silent (open, no reset, nothing through:
/// one a NAT or firewall forgot) times every command out, and fred keeps
/// it until the kernel gives up on it, ~15 minutes on Linux; its own
/// unresponsive check would not find it, since every probe sent on it
/// counts as fresh traffic. While fred is reconnecting already nothing is
/// asked of it (a request would wait in its queue, and pile up). On a
/// cluster fred keeps the connections it thinks open: there it does not
/// help; see `docs/NOTES.md`.
pub(crate) async fn watchdog(tier: Weak<Inner>, timeout: Duration) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checked: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let Some(inner) = tier.upgrade() else {
            return;
        };
        if inner
            .breaker
            .open_for()
            .is_none_or(|open| open < REOPEN_AFTER)
            || checked.is_some_and(|at| at.elapsed() < REOPEN_AFTER)
        {
            continue;
        }
        checked = Some(tokio::time::Instant::now());
        if !inner.client().is_connected() {
            continue;
        }
        let client = inner.client();
        drop(inner);
        let answered = answers(&client, None, timeout).await;
        let Some(inner) = tier.upgrade() else {
            return;
        };
        if answered {
            inner.breaker.success();
            continue;
        }
        // Not if the ping's failure was a connection fred is reconnecting
        // already, or a request's probe closed the breaker meanwhile.
        if !client.is_connected() || inner.breaker.open_for().is_none() {
            continue;
        }
        inner.reconnects_forced.fetch_add(1, Relaxed);
        drop(inner);
        let _ = tokio::time::timeout(REOPEN_AFTER, client.force_reconnection()).await;
    }
}

/// Pings the subscriber every [`heartbeat_every`]: a connection that
/// swallows traffic (no reset, no answer) is closed and reopened, which
/// counts as a resync. While the instance cannot hear (no connection, or
/// no answer), every L1 entry is made to need the origin again once
/// `unheard_for` has passed, and again each `unheard_for` after, until a
/// ping is answered: a write another instance makes meanwhile is missed
/// here, and must not be answered around for as long as the outage lasts
/// (the stale copies stay for stale-if-error). On a cluster the ping goes where the invalidation
/// channel's subscription lives, the node of the slot fred derives from
/// the client's name and routes its plain `SUBSCRIBE` by (a plain `PING`
/// goes to a node of fred's choosing, so a silent connection there was
/// never found); no other node's stall is taken for it.
///
/// It also sends the instance's echo (see [`crate::echo`]) through the
/// tier's client: when a subscription lands, every
/// [`ECHO_EVERY`](crate::echo::ECHO_EVERY), and each beat while the
/// instance is deaf. An instance that answers its pings but is deaf (its
/// echo not back) is unheard as one that does not answer.
pub(crate) async fn heartbeat(
    bus: Weak<Bus>,
    tier: Weak<Inner>,
    timeout: Duration,
    unheard_for: Duration,
) {
    let Some(echo_soon) = bus.upgrade().map(|bus| bus.echo_soon.clone()) else {
        return;
    };
    let mut tick = tokio::time::interval(heartbeat_every(timeout));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When this instance was found unable to hear (or L1 last dropped for it).
    let mut unheard_since: Option<tokio::time::Instant> = None;
    let mut echoes = crate::echo::Echoes::new();
    loop {
        // A subscription that just landed is echoed at once (after a ping
        // that says it was taken); the next ping waits a beat (pinged sooner, a silence would hide,
        // and fred would match a refused `SUBSCRIBE`'s error to it).
        let soon = tokio::select! {
            _ = tick.tick() => false,
            _ = echo_soon.notified() => true,
        };
        let Some(bus) = bus.upgrade() else {
            return;
        };
        let subscribed = *bus.subscribed.borrow();
        let subscription = bus.subscriber.is_clustered().then(|| {
            ClusterHash::Custom(fred::util::redis_keyslot(bus.subscriber.id().as_bytes()))
        });
        if soon {
            // The ping's answer says the `SUBSCRIBE` before it was taken.
            if subscribed
                && bus.subscriber.is_connected()
                && answers(&bus.subscriber, subscription.clone(), timeout).await
            {
                echoes.send(&tier, &bus, timeout).await;
            }
            tick.reset();
            continue;
        }
        // Sent fills past their grace go even when nothing is sent or heard.
        if let Some(inner) = tier.upgrade() {
            inner.overtaken.age(std::time::Instant::now());
        }
        if bus.subscriber.is_connected() {
            if answers(&bus.subscriber, subscription, timeout).await {
                bus.answered();
                bus.unsubscribe_strays(timeout).await;
                if subscribed && echoes.due(&bus) && echoes.send(&tier, &bus, timeout).await {
                    tick.reset();
                }
                if !bus.is_deaf() {
                    unheard_since = None;
                    continue;
                }
                // Answered but deaf (its echo not back): what others
                // write is missed, as below.
            } else {
                // Deaf from now: what is published while it reconnects is
                // missed (the reconnection's resync ends it).
                if subscribed {
                    bus.silent();
                }
                let _ = tokio::time::timeout(timeout, bus.subscriber.force_reconnection()).await;
            }
        } else if subscribed {
            bus.lost();
        }
        let since = *unheard_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() >= unheard_for {
            bus.unheard();
            unheard_since = Some(tokio::time::Instant::now());
        }
    }
}

/// Whether `client` answers a `PING` within `timeout`, on a cluster from
/// the node `route` picks (fred's own pick for `None`).
async fn answers(client: &impl ClientLike, route: Option<ClusterHash>, timeout: Duration) -> bool {
    let options = fred::prelude::Options {
        cluster_hash: route,
        ..Default::default()
    };
    let client = client.with_options(&options);
    let ping = client.ping::<fred::prelude::Value>(None);
    matches!(tokio::time::timeout(timeout, ping).await, Ok(Ok(_)))
}
