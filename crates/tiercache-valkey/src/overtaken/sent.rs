//! The log of fills sent lately (see the parent module): each is deleted
//! again if an invalidation heard within the grace covers it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Scope, Target, Undo};

/// Most sent fills remembered, and most bytes they may hold (their keys:
/// a URL's length is the client's to choose); under a flood the oldest are
/// forgotten before the grace is up.
const SENT_CAP: usize = 4096;
pub(super) const SENT_BYTES: usize = 2 * 1024 * 1024;

impl Target {
    /// Bytes held for it in the log (its keys, and a slot's worth).
    pub(super) fn size(&self) -> usize {
        self.full.len() + self.key.len() + self.tags.iter().map(String::len).sum::<usize>() + 96
    }
}

/// The fills sent within the grace, oldest first, within [`SENT_CAP`] and
/// [`SENT_BYTES`].
#[derive(Default)]
pub(super) struct SentLog {
    pub(super) fills: VecDeque<(Instant, Target)>,
    pub(super) bytes: usize,
}

impl SentLog {
    pub(super) fn push(&mut self, at: Instant, fill: Target) {
        self.bytes += fill.size();
        self.fills.push_back((at, fill));
        while self.fills.len() > SENT_CAP || self.bytes > SENT_BYTES {
            self.pop_front();
        }
    }

    /// Forgets the fills sent more than `grace` before `now`.
    pub(super) fn age(&mut self, now: Instant, grace: Duration) {
        while self
            .fills
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > grace)
        {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some((_, fill)) = self.fills.pop_front() {
            self.bytes -= fill.size();
        }
    }

    /// Takes out the fills `scope` covers.
    pub(super) fn take_covered(&mut self, scope: &Scope) -> Vec<Undo> {
        let mut taken = Vec::new();
        let mut freed = 0;
        self.fills.retain(|(_, fill)| {
            let hit = fill.covered_by(scope);
            if hit {
                freed += fill.size();
                taken.push((fill.key.clone(), fill.stamp.clone(), fill.hash));
            }
            !hit
        });
        self.bytes -= freed;
        taken
    }
}
