//! An instance's own echo through the invalidation channel: the proof that
//! its subscription carries messages. fred answers `Ok` to a `SUBSCRIBE`
//! the server refused (a user whose ACL lacks `subscribe`): such an
//! instance believed it heard the fleet and answered its L1 copies after
//! another instance's acknowledged write. The heartbeat sends an echo
//! after each subscription, every [`ECHO_EVERY`], and every beat while the
//! instance is deaf; one that does not come back makes it deaf
//! (`Bus::refused`) and subscribes again, one that does ends it.
//!
//! `FROM E NONCE` on the channel: the other instances (and those that
//! predate it, to which the kind is unknown) ignore it. Cost: one
//! `PUBLISH` an instance every ten seconds, delivered to every instance.

use std::time::Duration;

use fred::error::ErrorKind;
use fred::prelude::{Client, PubsubInterface};

use crate::bus::Bus;

/// How often an instance that hears sends its echo.
pub(crate) const ECHO_EVERY: Duration = Duration::from_secs(10);

fn encode(from: &str, nonce: u64) -> String {
    format!("{from} E {nonce}")
}

fn decode(text: &str) -> Option<(&str, u64)> {
    let mut words = text.split(' ');
    let (from, kind, nonce) = (words.next()?, words.next()?, words.next()?);
    if kind != "E" || words.next().is_some() {
        return None;
    }
    Some((from, nonce.parse().ok()?))
}

/// Whether `text` is an echo; this instance's own is recorded as heard.
pub(crate) fn hear(bus: &Bus, text: &str) -> bool {
    let Some((from, nonce)) = decode(text) else {
        return false;
    };
    if from == bus.instance {
        bus.echoes.send_if_modified(|heard| {
            let later = nonce > *heard;
            *heard = (*heard).max(nonce);
            later
        });
    }
    true
}

/// Sends echo `nonce` through `client` and waits for it on the
/// subscription: back, the instance hears (`Bus::confirmed`); not back, or
/// refused by the server, it is deaf (`Bus::refused`) and subscribes again.
/// A `PUBLISH` that timed out or met a broken connection decides nothing.
pub(crate) async fn send(bus: &Bus, client: &Client, nonce: u64, timeout: Duration) {
    let since = bus.losses();
    let mut heard = bus.echoes.subscribe();
    let publish = client.publish::<i64, _, _>(&bus.channel, encode(&bus.instance, nonce));
    match tokio::time::timeout(timeout, publish).await {
        Err(_) => return,
        Ok(Err(e)) if undecided(e.kind()) => return,
        Ok(Err(_)) => {}
        Ok(Ok(_)) => {
            // Two timeouts (a second at least): the subscriber's ping was
            // just answered, and a false refusal costs L1's resync.
            let back = heard.wait_for(|heard| *heard >= nonce);
            if let Ok(Ok(_)) = tokio::time::timeout(2 * timeout, back).await {
                bus.confirmed(since);
                return;
            }
        }
    }
    bus.refused();
    let subscribe = bus.subscriber.subscribe(bus.channel.clone());
    if let Ok(Ok(())) = tokio::time::timeout(timeout, subscribe).await {
        bus.subscribed.send_replace(true);
    }
}

/// A failure that says nothing of the subscription (a slow or broken
/// connection, which the heartbeat and fred's reconnection handle).
fn undecided(kind: &ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::Timeout
            | ErrorKind::IO
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Cluster
            | ErrorKind::Backpressure
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_is_read_back_and_no_other_message_reads_as_one() {
        let text = encode("abc", 7);
        assert_eq!(decode(&text), Some(("abc", 7)));
        assert_eq!(decode("abc E 7 8"), None);
        assert_eq!(decode("abc K 0123"), None);
        // Instances that predate it ignore it: no other decoder reads it.
        assert_eq!(crate::message::decode(&text), None);
        assert_eq!(crate::message::decode_drop(&text), None);
        assert_eq!(crate::message::decode_stale_fill(&text), None);
    }
}
