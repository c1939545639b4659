//! Whether an instance can hear the fleet's invalidations: the state the
//! bus keeps of its subscription's failures and silences (see
//! `Bus::lost`).

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
    /// Failures and silences so far: a resubscription that began before
    /// one does not end it (and a silence does not keep a failure on).
    failures: u64,
    silences: u64,
    /// Connections the subscriber has had.
    connections: u64,
}

impl Deafness {
    pub(crate) fn deaf(&self) -> bool {
        self.failed || self.silent.is_some()
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

    pub(crate) fn connect(&mut self) -> (u64, u64) {
        self.connections += 1;
        (self.failures, self.silences)
    }

    pub(crate) fn find(&mut self, (failures, silences): (u64, u64)) {
        if self.failures == failures {
            self.failed = false;
        }
        if self.silences == silences {
            self.silent = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
