//! An instance's own echo through the invalidation channel: the proof that
//! its subscription carries messages. fred answers `Ok` to a `SUBSCRIBE`
//! the server refused (a user whose ACL lacks `subscribe` or the channel):
//! such an instance believed it heard the fleet and answered its L1 copies
//! after another instance's acknowledged write. The heartbeat sends an
//! echo when a subscription lands (`connect` waits, within its bound, for
//! the first one's verdict), every [`ECHO_EVERY`], and each beat while the
//! instance is deaf. Two in a row not back, or a `PUBLISH`
//! refused `NOPERM`, make the instance deaf until one comes back (then the
//! bans are read and L1 dropped, as after a reconnection), and it
//! subscribes again. A new subscription's first echo follows a ping on the
//! subscriber's connection: its answer says the `SUBSCRIBE` before it was
//! taken (fred answers `SUBSCRIBE` before it is even sent; on a cluster
//! the echo, published on another node, could pass it).
//!
//! `FROM E NONCE` on the channel: the other instances (and those that
//! predate it, to which the kind is unknown) ignore it. Cost: one
//! `PUBLISH` an instance every ten seconds, delivered to every instance
//! (each beat while deaf).

use std::sync::Weak;
use std::time::Duration;

use fred::prelude::PubsubInterface;
use tokio::time::Instant;

use crate::bus::Bus;
use crate::tier::Inner;

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

/// What the heartbeat keeps of its echoes.
pub(crate) struct Echoes {
    nonce: u64,
    /// Echoes in a row that did not come back.
    misses: u32,
    last: Instant,
}

/// What became of one echo.
enum Echo {
    Back,
    /// Its `PUBLISH` went through; it did not come back in time.
    Missed,
    /// Its `PUBLISH` was refused (`NOPERM`).
    Refused,
    /// Its `PUBLISH` timed out or failed otherwise: it says nothing of
    /// the subscription.
    Undecided,
}

impl Echoes {
    pub(crate) fn new() -> Self {
        Self {
            nonce: 0,
            misses: 0,
            last: Instant::now(),
        }
    }

    /// Whether an echo is due at a beat whose ping was answered.
    pub(crate) fn due(&self, bus: &Bus) -> bool {
        bus.is_deaf() || self.misses > 0 || self.last.elapsed() >= ECHO_EVERY
    }

    /// Sends an echo and judges the subscription by it (see the module).
    /// True when it subscribed again: fred matches a refusal's error to the
    /// subscriber's next command, so nothing else may follow for a beat.
    pub(crate) async fn send(&mut self, tier: &Weak<Inner>, bus: &Bus, timeout: Duration) -> bool {
        let Some(client) = tier.upgrade().map(|inner| inner.client()) else {
            return false;
        };
        self.nonce += 1;
        let mut heard = bus.echoes.subscribe();
        let text = encode(&bus.instance, self.nonce);
        let echo =
            match tokio::time::timeout(timeout, client.publish::<i64, _, _>(&bus.channel, text))
                .await
            {
                Err(_) => Echo::Undecided,
                Ok(Err(e)) if e.details().contains("NOPERM") => Echo::Refused,
                Ok(Err(_)) => Echo::Undecided,
                Ok(Ok(_)) => {
                    // Two timeouts (a second at least): the subscriber's ping
                    // was just answered, and a false refusal costs L1.
                    let back = heard.wait_for(|heard| *heard >= self.nonce);
                    match tokio::time::timeout(2 * timeout, back).await {
                        Ok(Ok(_)) => Echo::Back,
                        _ => Echo::Missed,
                    }
                }
            };
        match echo {
            Echo::Undecided => return false,
            Echo::Back => {
                self.misses = 0;
                self.last = Instant::now();
                // Messages were missed: the bans first (a copy promoted
                // after L1 goes is checked against them), then L1. Not read,
                // it stays deaf, and tries again at the next beat.
                if bus.is_refused() {
                    let Some(bans) = crate::bans::load_bans(tier.clone()).await else {
                        return false;
                    };
                    bus.merge_bans(bans, crate::bans::BAN_RETENTION);
                    bus.resync();
                }
                bus.confirmed();
                return false;
            }
            Echo::Missed => {
                self.misses += 1;
                self.last = Instant::now();
                // A second chance: a slow moment must not cost L1.
                if self.misses < 2 {
                    return false;
                }
            }
            Echo::Refused => self.last = Instant::now(),
        }
        bus.refused();
        let subscribe = bus.subscriber.subscribe(bus.channel.clone());
        if let Ok(Ok(())) = tokio::time::timeout(timeout, subscribe).await {
            bus.subscribed.send_replace(true);
        }
        true
    }
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
