//! Whether an instance can hear the fleet's invalidations: the state the
//! bus keeps of its subscription's failures, silences and refusals (see
//! `Bus::lost`, `crate::echo`), and whether it served before its first
//! subscription.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// The losses counted when a (re)subscription began: what it ends when it
/// lands (a loss after it began is not ended by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Losses {
    failures: u64,
    silences: u64,
}

/// Whether an instance began serving before its invalidation channel was
/// subscribed: `connect` gives up waiting at its bound and the instance
/// serves (and fills L1) unheard, so the subscription that lands later
/// must drop L1. One atomic state, so a subscription that lands while
/// `connect` is giving up is seen by exactly one side: either `connect`
/// finds the instance heard (nothing was served unheard), or the
/// subscription finds it unheard and resyncs.
#[derive(Debug, Default)]
pub(crate) struct Hearing(AtomicU8);

impl Hearing {
    const WAITING: u8 = 0;
    const HEARD: u8 = 1;
    const UNHEARD: u8 = 2;

    /// `connect` stopped waiting; false when the subscription landed first.
    pub(crate) fn give_up(&self) -> bool {
        self.0
            .compare_exchange(Self::WAITING, Self::UNHEARD, Relaxed, Relaxed)
            .is_ok()
    }

    /// The channel is subscribed; true when the instance served unheard
    /// before it (once: later subscriptions find it heard).
    pub(crate) fn heard(&self) -> bool {
        self.0.swap(Self::HEARD, Relaxed) == Self::UNHEARD
    }
}

/// Why the invalidation channel may not be heard.
#[derive(Debug, Default)]
pub(crate) struct Deafness {
    /// Its connection failed: until a subscription lands and L1 is
    /// resynced.
    failed: bool,
    /// Its ping went unanswered on this connection (numbered as
    /// `connections` counts them): until one is answered on it, or as
    /// `failed`.
    silent: Option<u64>,
    /// An echo did not come back (or its `PUBLISH` was refused): what was
    /// published meanwhile was missed, until one comes back and L1 is
    /// resynced. A subscription landing does not end it.
    refused: bool,
    /// Failures and silences so far: a resubscription that began before
    /// one does not end it (and a silence does not keep a failure on).
    failures: u64,
    silences: u64,
    /// Connections the subscriber has had.
    connections: u64,
}

impl Deafness {
    pub(crate) fn deaf(&self) -> bool {
        self.failed || self.silent.is_some() || self.refused
    }

    pub(crate) fn refused(&self) -> bool {
        self.refused
    }

    pub(crate) fn lose(&mut self) {
        self.failed = true;
        self.failures += 1;
    }

    pub(crate) fn go_silent(&mut self) {
        self.silent = Some(self.connections);
        self.silences += 1;
    }

    pub(crate) fn answer(&mut self) {
        if self.silent == Some(self.connections) {
            self.silent = None;
        }
    }

    pub(crate) fn refuse(&mut self) {
        self.refused = true;
    }

    pub(crate) fn connect(&mut self) -> Losses {
        self.connections += 1;
        Losses {
            failures: self.failures,
            silences: self.silences,
        }
    }

    /// A subscription begun at `since` landed (and L1 was resynced): ends
    /// the failures and silences since, not what an echo decides (fred's
    /// `Ok` is no proof).
    pub(crate) fn find(&mut self, since: Losses) {
        if self.failures == since.failures {
            self.failed = false;
        }
        if self.silences == since.silences {
            self.silent = None;
        }
    }

    /// An echo came back (and L1 was resynced, if it was refused): the
    /// subscription carries messages. Ends a refusal; not a failure or a
    /// silence, which the reconnection and the ping end (the heartbeat
    /// sends echoes, and judges them, one at a time).
    pub(crate) fn confirm(&mut self) {
        self.refused = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subscription_after_connect_gave_up_resyncs_once() {
        let hearing = Hearing::default();
        assert!(hearing.give_up());
        assert!(hearing.heard(), "the instance served unheard");
        assert!(!hearing.heard(), "a later subscription is no first hearing");
    }

    #[test]
    fn deafness_ends_only_with_a_subscription_begun_after_the_last_loss() {
        let mut d = Deafness::default();
        let before = d.connect();
        d.lose();
        // A subscription that began before the loss does not end it (its
        // failure was seen after the reconnection's event).
        d.find(before);
        assert!(d.deaf());
        let after = d.connect();
        d.find(after);
        assert!(!d.deaf());
    }

    #[test]
    fn a_silence_during_a_subscription_leaves_the_failure_it_ends_ended() {
        let mut d = Deafness::default();
        d.lose();
        let since = d.connect();
        d.go_silent();
        d.find(since);
        assert!(d.deaf(), "the silence came after the subscription began");
        d.answer();
        assert!(!d.deaf(), "the failure was ended by the subscription");
    }

    #[test]
    fn a_ping_answered_on_the_same_connection_ends_a_silence() {
        let mut d = Deafness::default();
        let first = d.connect();
        d.go_silent();
        d.answer();
        assert!(!d.deaf(), "a slow moment: nothing was missed on it");
        d.go_silent();
        // Reconnected meanwhile: the new connection's ping says nothing of
        // what the old one missed; its subscription and resync do.
        let second = d.connect();
        d.answer();
        assert!(d.deaf());
        d.find(first);
        assert!(d.deaf(), "a subscription older than the silence");
        d.find(second);
        assert!(!d.deaf());
    }

    #[test]
    fn a_refusal_ends_only_with_an_echo() {
        let mut d = Deafness::default();
        let since = d.connect();
        d.find(since);
        assert!(!d.deaf());
        d.refuse();
        assert!(d.deaf());
        let later = d.connect();
        d.find(later);
        assert!(d.deaf(), "fred's Ok to a SUBSCRIBE ends no refusal");
        d.confirm();
        assert!(!d.deaf());
        d.lose();
        d.confirm();
        assert!(d.deaf(), "an echo ends no failure");
    }

    #[test]
    fn a_subscription_that_lands_while_connect_gives_up_resyncs_nothing_later() {
        // The subscription lands after the wait timed out but before
        // connect recorded it: nothing was served yet, so nothing is owed,
        // and no flag may linger to drop L1 on some later subscription.
        let hearing = Hearing::default();
        assert!(!hearing.heard());
        assert!(!hearing.give_up(), "connect finds the instance heard");
        assert!(!hearing.heard());
    }
}
