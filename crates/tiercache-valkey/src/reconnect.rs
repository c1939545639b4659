//! The subscriber's connection: what each (re)connection does (subscribe
//! again, read the prefix bans, drop L1 when messages may have been
//! missed), the heartbeat that finds a connection swallowing traffic, and
//! the watchdog that reopens the tier's own client when Valkey has stayed
//! out for long.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::prelude::{ClientLike, PubsubInterface};
use tokio::sync::broadcast;

use crate::bus::{Ban, Bus};
use crate::tier::Inner;

/// How long the breaker stays open, every probe failing, before the
/// tier's own client is made to reconnect.
pub(crate) const REOPEN_AFTER: Duration = Duration::from_secs(5);

/// On every (re)connection of the subscriber: subscribe again, reload the
/// bans, and (after the first) drop L1, since messages sent while it was
/// away were missed. `reload` reads the bans from Valkey.
pub(crate) async fn on_reconnect<F, Fut>(
    bus: Weak<Bus>,
    mut rx: broadcast::Receiver<fred::prelude::Server>,
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
    loop {
        let event = rx.recv().await;
        let Some(live) = bus.upgrade() else {
            return;
        };
        let first = match event {
            Ok(server) if live.subscriber.is_clustered() => seen.insert(server),
            Ok(server) => seen.is_empty() && seen.insert(server),
            Err(broadcast::error::RecvError::Lagged(_)) => false,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let _ = live.subscriber.resubscribe_all().await;
        // Whether this instance served before it could hear: only a
        // subscription that went through settles it.
        let mut served_unheard = false;
        if live
            .subscriber
            .subscribe(live.channel.clone())
            .await
            .is_ok()
        {
            served_unheard = live.hearing.heard();
            live.subscribed.send_replace(true);
        }
        drop(live);
        // The first connection counts too when the instance has served
        // without hearing (Valkey was down when it started).
        let resync = !first || served_unheard;
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
            continue;
        }
        // Not read (a new instance's subscriber up before the client that
        // reads them, a slow moment): L1 goes now all the same, and the
        // read is retried; until it lands, copies a prefix invalidation
        // banned may be promoted, so what the bans match leaves L1 once it
        // does.
        // The retry runs apart, so later reconnects are not held up.
        if resync && let Some(live) = bus.upgrade() {
            live.resync();
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

/// Makes the tier's own client reconnect when the breaker has stayed open
/// [`REOPEN_AFTER`] (and again each `REOPEN_AFTER` while it stays open): a
/// connection gone silent (open, no reset, nothing through: one a NAT or
/// firewall forgot) times every command out, and fred keeps it until the
/// kernel gives up on it, ~15 minutes on Linux. Its own unresponsive check
/// would not find it: every probe sent on it counts as fresh traffic. On a
/// server that is down this is one more attempt in fred's reconnection
/// loop. (On a cluster fred keeps the connections it thinks open: there it
/// does not help; see `docs/NOTES.md`.)
pub(crate) async fn watchdog(tier: Weak<Inner>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut forced: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let open = inner.breaker.open_for();
        if open.is_none_or(|open| open < REOPEN_AFTER)
            || forced.is_some_and(|at| at.elapsed() < REOPEN_AFTER)
        {
            continue;
        }
        forced = Some(tokio::time::Instant::now());
        let client = inner.client.clone();
        drop(inner);
        let _ = tokio::time::timeout(REOPEN_AFTER, client.force_reconnection()).await;
    }
}

/// Pings the subscriber every `every`: a connection that swallows traffic
/// (no reset, no answer) is closed and reopened, which counts as a resync.
/// On a cluster every node it is connected to is pinged: fred sends a
/// plain `PING` to one node of its choosing, and the invalidation
/// channel's subscription lives on another (the node of the slot fred
/// derives from the client's name), so a silent connection there would
/// never be found.
pub(crate) async fn heartbeat(bus: Weak<Bus>, every: Duration, timeout: Duration) {
    // fred's unresponsive check counts from a connection's last write: a
    // ping sent again before `timeout` has passed would hide the silence.
    let mut tick = tokio::time::interval(every.max(2 * timeout));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(bus) = bus.upgrade() else {
            return;
        };
        if !bus.subscriber.is_connected() {
            continue;
        }
        let nodes = if bus.subscriber.is_clustered() {
            bus.subscriber.active_connections()
        } else {
            Vec::new()
        };
        let mut answered = true;
        if nodes.is_empty() {
            answered = answers(&bus.subscriber, None, timeout).await;
        }
        for node in nodes {
            if !answers(&bus.subscriber, Some(node), timeout).await {
                answered = false;
                break;
            }
        }
        if !answered {
            let _ = tokio::time::timeout(timeout, bus.subscriber.force_reconnection()).await;
        }
    }
}

/// Whether `node` (or the client's own pick, for `None`) answers a `PING`
/// on the subscriber's connection within `timeout`.
async fn answers(
    subscriber: &fred::clients::SubscriberClient,
    node: Option<fred::prelude::Server>,
    timeout: Duration,
) -> bool {
    let options = fred::prelude::Options {
        cluster_node: node,
        ..Default::default()
    };
    let subscriber = subscriber.with_options(&options);
    let ping = subscriber.ping::<fred::prelude::Value>(None);
    matches!(tokio::time::timeout(timeout, ping).await, Ok(Ok(_)))
}
