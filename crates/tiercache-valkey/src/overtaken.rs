//! Fills that another instance's invalidation overtook on their way to Valkey.
//!
//! The engine's journal keeps a fill out of both tiers once an invalidation
//! covers it, but only up to the moment it is stored: the L2 write then
//! waits in the write queue and crosses the network. If instance B
//! invalidates a key meanwhile, B's `DEL` can land before A's `SET`, and
//! the old version would sit in L2 for the whole fleet until its `PX`. B's
//! message reaches A a moment later, so A settles it:
//!
//! - a fill still queued when the message arrives is never sent;
//! - a fill in flight then is deleted again once its pipeline is answered;
//! - a fill sent within [`GRACE`] before the message arrives (its `SET`
//!   may have landed between B's `DEL` and B's message) is deleted again.
//!
//! A prefix invalidation needs none of this: its ban outlives any fill
//! older than it, on every read. A resync (messages may have been missed)
//! covers every fill. (Memcache's leases solve the same race on the server;
//! Valkey has no such thing without a script on every fill.)

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tiercache_core::KeyHash;
use tokio::sync::mpsc;

use crate::writer::{Command, Write};

/// How long after it was sent a fill can still be overtaken by a message:
/// the message left after the `DEL` that preceded the `SET`, so it trails
/// the `SET`'s landing by a message's delivery (far below this, unless the
/// subscription lags, which the heartbeat turns into a resync).
pub(crate) const GRACE: Duration = Duration::from_secs(2);
/// Most invalidations remembered for the queued fills; a fill queued before
/// the oldest is held back (it only costs L2 a copy).
const HEARD_CAP: usize = 1024;
/// Most sent fills remembered (~120 bytes each); under a flood the oldest
/// are forgotten before [`GRACE`] is up.
const SENT_CAP: usize = 4096;

/// What one invalidation heard from another instance covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    /// These keys.
    Keys(Vec<KeyHash>),
    /// Entries stored with this tag (its set's Valkey key), and these keys.
    Tag(String, Vec<KeyHash>),
    /// Everything (a resync).
    Everything,
}

impl Scope {
    /// Whether it covers the fill of `hash` stored with the tag sets `tags`.
    fn covers(&self, hash: &KeyHash, tags: &[String]) -> bool {
        match self {
            Scope::Keys(hashes) => hashes.contains(hash),
            Scope::Tag(tag, hashes) => hashes.contains(hash) || tags.contains(tag),
            Scope::Everything => true,
        }
    }
}

/// A fill as this module sees it: which key, under which Valkey key, with
/// which tag sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) hash: KeyHash,
    pub(crate) key: String,
    pub(crate) tags: Vec<String>,
}

#[derive(Default)]
struct State {
    /// How many invalidations have been heard: a fill notes it when queued,
    /// a pipeline when sent, and checks what was heard after.
    heard: u64,
    /// The last invalidations heard, oldest first, each with its number.
    log: VecDeque<(u64, Scope)>,
    /// Fills sent lately, oldest first.
    sent: VecDeque<(Instant, Target)>,
}

impl State {
    /// Whether an invalidation heard after number `since` covers `fill`
    /// (or may have: the log no longer reaches back that far).
    fn overtaken_since(&self, since: u64, hash: &KeyHash, tags: &[String]) -> bool {
        let forgotten = self
            .log
            .front()
            .is_some_and(|(first, _)| *first > since + 1);
        forgotten
            || self
                .log
                .iter()
                .rev()
                .take_while(|(n, _)| *n > since)
                .any(|(_, scope)| scope.covers(hash, tags))
    }
}

/// The invalidations other instances sent lately and the fills this one
/// sent lately; see the module's doc.
pub(crate) struct Overtaken {
    state: Mutex<State>,
    /// Where deletes of fills that landed go (behind what is queued).
    writes: mpsc::Sender<Write>,
}

impl Overtaken {
    pub(crate) fn new(writes: mpsc::Sender<Write>) -> Self {
        Self {
            state: Mutex::default(),
            writes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The number of the last invalidation heard, for a fill being queued.
    pub(crate) fn mark(&self) -> u64 {
        self.lock().heard
    }

    /// Another instance invalidated `scope`: fills sent within [`GRACE`]
    /// that it covers are deleted again (queued behind the writes before).
    pub(crate) fn heard(&self, scope: Scope, now: Instant) {
        let again: Vec<String> = {
            let mut state = self.lock();
            state.heard += 1;
            let n = state.heard;
            if state.log.len() == HEARD_CAP {
                state.log.pop_front();
            }
            while state
                .sent
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > GRACE)
            {
                state.sent.pop_front();
            }
            let again = state
                .sent
                .iter()
                .filter(|(_, fill)| scope.covers(&fill.hash, &fill.tags))
                .map(|(_, fill)| fill.key.clone())
                .collect();
            state.log.push_back((n, scope));
            again
        };
        if again.is_empty() {
            return;
        }
        let delete = Write::Command(Command::Delete(again));
        if let Err(mpsc::error::TrySendError::Full(delete)) = self.writes.try_send(delete) {
            // A full queue must not lose a delete: wait for room off the
            // subscriber's task.
            let writes = self.writes.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = writes.send(delete).await;
                });
            }
        }
    }

    /// The writer is about to send `fills`; `target` gives each one's mark
    /// when it was queued, its key's hash and its tag sets (`None`: not a
    /// fill). Those an invalidation heard since covers are taken out of
    /// `fills` and returned, never to be sent; the number returned is the
    /// mark the rest are sent under (see [`Self::sent`]).
    pub(crate) fn hold_back<T>(
        &self,
        fills: &mut Vec<T>,
        target: impl Fn(&T) -> Option<(u64, KeyHash, &[String])>,
    ) -> (u64, Vec<T>) {
        let state = self.lock();
        if state.log.is_empty() {
            return (state.heard, Vec::new());
        }
        let mut held = Vec::new();
        let mut kept = Vec::with_capacity(fills.len());
        for fill in fills.drain(..) {
            match target(&fill) {
                Some((since, hash, tags)) if state.overtaken_since(since, &hash, tags) => {
                    held.push(fill)
                }
                _ => kept.push(fill),
            }
        }
        *fills = kept;
        (state.heard, held)
    }

    /// Fills sent under mark `since` have been answered (or timed out, and
    /// may land yet): remembered for [`GRACE`], and those an invalidation
    /// heard while they were in flight covers are returned, to delete again.
    pub(crate) fn sent(&self, since: u64, fills: Vec<Target>, now: Instant) -> Vec<String> {
        let mut state = self.lock();
        let again = fills
            .iter()
            .filter(|fill| state.overtaken_since(since, &fill.hash, &fill.tags))
            .map(|fill| fill.key.clone())
            .collect();
        for fill in fills {
            if state.sent.len() == SENT_CAP {
                state.sent.pop_front();
            }
            state.sent.push_back((now, fill));
        }
        again
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiercache_core::CacheKey;

    fn target(name: &str, tags: &[&str]) -> Target {
        Target {
            hash: CacheKey::new(name).hash(),
            key: format!("e:{name}"),
            tags: tags.iter().map(|t| t.to_string()).collect(),
        }
    }

    fn overtaken() -> (Overtaken, mpsc::Receiver<Write>) {
        let (tx, rx) = mpsc::channel(16);
        (Overtaken::new(tx), rx)
    }

    fn deletes(rx: &mut mpsc::Receiver<Write>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(Write::Command(Command::Delete(keys))) = rx.try_recv() {
            out.extend(keys);
        }
        out
    }

    #[test]
    fn a_queued_fill_an_invalidation_covers_is_held_back() {
        let (o, _rx) = overtaken();
        let now = Instant::now();
        let queued_at = o.mark();
        o.heard(Scope::Keys(vec![target("a", &[]).hash]), now);
        o.heard(Scope::Tag("t".into(), vec![]), now);
        let mut fills = vec![
            (queued_at, target("a", &[])),
            (queued_at, target("b", &["t"])),
            (queued_at, target("c", &["u"])),
            (o.mark(), target("a", &[])),
        ];
        let (_, held) = o.hold_back(&mut fills, |(m, t)| Some((*m, t.hash, t.tags.as_slice())));
        let names = |v: &[(u64, Target)]| v.iter().map(|(_, t)| t.key.clone()).collect::<Vec<_>>();
        assert_eq!(names(&held), ["e:a", "e:b"]);
        // "c" is not covered; the later "a" was queued after the message.
        assert_eq!(names(&fills), ["e:c", "e:a"]);
    }

    #[test]
    fn a_fill_in_flight_when_the_message_came_is_deleted_after_its_answer() {
        let (o, mut rx) = overtaken();
        let now = Instant::now();
        let mut fills = vec![(o.mark(), target("a", &[]))];
        let (sent_under, held) =
            o.hold_back(&mut fills, |(m, t)| Some((*m, t.hash, t.tags.as_slice())));
        assert!(held.is_empty());
        o.heard(Scope::Keys(vec![target("a", &[]).hash]), now);
        // Not sent yet as far as the module knows: nothing to delete now…
        assert!(deletes(&mut rx).is_empty());
        // …but once the pipeline is answered, delete it again.
        let again = o.sent(sent_under, vec![target("a", &[])], now);
        assert_eq!(again, ["e:a"]);
    }

    #[test]
    fn a_fill_that_landed_just_before_the_message_is_deleted_again() {
        let (o, mut rx) = overtaken();
        let t0 = Instant::now();
        assert!(
            o.sent(o.mark(), vec![target("a", &[]), target("b", &["t"])], t0)
                .is_empty()
        );
        o.heard(Scope::Keys(vec![target("z", &[]).hash]), t0);
        assert!(deletes(&mut rx).is_empty(), "covers neither");
        o.heard(
            Scope::Tag("t".into(), vec![]),
            t0 + Duration::from_millis(5),
        );
        assert_eq!(deletes(&mut rx), ["e:b"]);
        // Past the grace, a message no longer reaches what was sent.
        o.heard(Scope::Everything, t0 + GRACE + Duration::from_millis(1));
        assert!(deletes(&mut rx).is_empty());
    }

    #[test]
    fn a_fill_queued_before_the_remembered_invalidations_is_held_back() {
        let (o, _rx) = overtaken();
        let now = Instant::now();
        let queued_at = o.mark();
        for _ in 0..HEARD_CAP + 1 {
            o.heard(Scope::Keys(Vec::new()), now);
        }
        let mut fills = vec![(queued_at, target("a", &[]))];
        let (_, held) = o.hold_back(&mut fills, |(m, t)| Some((*m, t.hash, t.tags.as_slice())));
        assert_eq!(held.len(), 1, "the log no longer reaches back: held back");
    }
}
