//! The invalidation journal: "invalidation wins" over fills in flight.
//!
//! Every invalidation (by key, tag, prefix, or a resync after missed
//! messages; local or from another instance) is recorded with a sequence
//! number before it drops anything. A fill notes the sequence when it starts
//! (before it reads L2 or calls the origin) and, when it is about to store,
//! checks the records since: if one covers the fill, its answer still goes to
//! the requests waiting on it but is not stored, in L1 or L2. The check and
//! the store happen under the journal's lock, and so do the record and the
//! L1 drop, so an invalidation is either seen by the fill or removes what it
//! stored: there is no order in which the older answer survives. (Memcache's
//! leases do the same with a token per key.)
//!
//! The journal keeps the last [`Journal::CAP`] records; a fill older than
//! the oldest is treated as overtaken (not stored), which only costs a miss.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::{KeyHash, KeyPattern};

/// What one invalidation covered.
#[derive(Debug, Clone)]
pub(crate) enum Scope {
    /// These keys.
    Keys(Vec<KeyHash>),
    /// Entries stored with this tag, and these keys.
    Tag(Bytes, Vec<KeyHash>),
    /// Keys the pattern matches.
    Prefix(KeyPattern),
    /// Everything (a resync after missed messages).
    All,
}

/// What a fill is about to store: its keys, full keys and tags.
#[derive(Debug)]
pub(crate) struct Footprint<'a> {
    pub(crate) hashes: &'a [KeyHash],
    pub(crate) fulls: &'a [&'a [u8]],
    pub(crate) tags: &'a [Bytes],
}

impl Scope {
    /// What it holds, in key hashes (16 bytes): its hashes, and its tag's
    /// or pattern's bytes (a caller picks those: a 60 KB prefix must not
    /// weigh as nothing).
    fn hashes(&self) -> usize {
        match self {
            Scope::Keys(hashes) => hashes.len(),
            Scope::Tag(tag, hashes) => hashes.len() + crate::key::in_hashes(tag.len()),
            Scope::Prefix(pattern) => pattern.in_hashes(),
            Scope::All => 0,
        }
    }

    fn covers(&self, fill: &Footprint<'_>) -> bool {
        match self {
            Scope::Keys(hashes) => hashes.iter().any(|h| fill.hashes.contains(h)),
            Scope::Tag(tag, hashes) => {
                fill.tags.contains(tag) || hashes.iter().any(|h| fill.hashes.contains(h))
            }
            Scope::Prefix(pattern) => fill.fulls.iter().any(|full| pattern.matches_full(full)),
            Scope::All => true,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// The sequence number the next record gets.
    next: u64,
    /// Records before this sequence number were dropped.
    forgotten: u64,
    records: VecDeque<(u64, Scope)>,
    /// The key hashes the records hold together.
    hashes: usize,
}

/// Where a fill starts: the journal's epoch (an invalidation recorded
/// from it on overtakes the fill) and the load's number (loads are
/// numbered as they start: a fill gives way to an entry a later load
/// stored meanwhile, see [`Entry::load`](crate::Entry)); and, for a load
/// whose fill is a late one (its fleet lock lapsed, see `FleetLock::late`),
/// when it began and the lock's token (in the shared tier, it gives way to
/// the fill of a load begun since, or on its way, and replaces an earlier
/// one for the fleet: see
/// [`Tier::put_unless_newer`](crate::Tier::put_unless_newer)).
#[derive(Debug, Clone)]
pub(crate) struct Start {
    pub(crate) epoch: u64,
    pub(crate) load: u64,
    pub(crate) late: Option<crate::LateFill>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    state: Mutex<State>,
    /// The number the last load started took.
    loads: AtomicU64,
}

impl Journal {
    /// Records kept; past it the oldest go, and fills older than them are
    /// not stored.
    pub(crate) const CAP: usize = 16_384;

    /// Most key hashes the records hold together (16 bytes each: 16 MiB; a
    /// tag's invalidation names up to 100,000; tags and patterns count by
    /// their bytes): past it the oldest records go, as past
    /// [`CAP`](Self::CAP) (the newest always stays).
    pub(crate) const MAX_HASHES: usize = 1 << 20;

    /// The sequence a fill starting now notes.
    pub(crate) fn epoch(&self) -> u64 {
        self.lock().next
    }

    /// Where a fill starting now starts: the epoch, and a load number
    /// above every earlier one's (`0` is no load's).
    pub(crate) fn start(&self) -> Start {
        Start {
            epoch: self.epoch(),
            load: self.next_load(),
            late: None,
        }
    }

    /// A load number above every earlier one's: a load's, or a copy's
    /// promoted from L2 now (stored there by a load that ended before).
    pub(crate) fn next_load(&self) -> u64 {
        self.loads.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Records `scope` and runs `apply` (the L1 drop) under the journal's lock.
    pub(crate) fn record<R>(&self, scope: Scope, apply: impl FnOnce() -> R) -> R {
        let mut state = self.lock();
        let seq = state.next;
        state.next += 1;
        state.hashes += scope.hashes();
        state.records.push_back((seq, scope));
        while state.records.len() > Self::CAP
            || (state.hashes > Self::MAX_HASHES && state.records.len() > 1)
        {
            let Some((dropped, old)) = state.records.pop_front() else {
                break;
            };
            state.hashes -= old.hashes();
            state.forgotten = dropped + 1;
        }
        apply()
    }

    /// Runs `store` unless an invalidation recorded since `epoch` covers
    /// `fill`; when one does (the fill was overtaken), the sequence of the
    /// first that did (`epoch` itself when the records since were dropped):
    /// a request that noted a later [`epoch`](Self::epoch) came after it.
    pub(crate) fn unless_overtaken<R>(
        &self,
        epoch: u64,
        fill: &Footprint<'_>,
        store: impl FnOnce() -> R,
    ) -> Result<R, u64> {
        let state = self.lock();
        if epoch < state.forgotten {
            return Err(epoch);
        }
        let first = state
            .records
            .iter()
            .rev()
            .take_while(|(seq, _)| *seq >= epoch)
            .filter(|(_, scope)| scope.covers(fill))
            .last();
        match first {
            Some((seq, _)) => Err(*seq),
            None => Ok(store()),
        }
    }

    /// The key hashes the records hold.
    #[cfg(test)]
    fn hashes_held(&self) -> usize {
        self.lock().hashes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheKey;

    fn footprint<'a>(
        hashes: &'a [KeyHash],
        fulls: &'a [&'a [u8]],
        tags: &'a [Bytes],
    ) -> Footprint<'a> {
        Footprint {
            hashes,
            fulls,
            tags,
        }
    }

    #[test]
    fn an_invalidation_after_the_epoch_overtakes_the_fill() {
        let journal = Journal::default();
        let key = CacheKey::new("a");
        let other = CacheKey::new("b");
        let epoch = journal.epoch();
        journal.record(Scope::Keys(vec![other.hash()]), || ());
        let hashes = [key.hash()];
        let fulls = [key.full().as_ref()];
        let fill = footprint(&hashes, &fulls, &[]);
        assert_eq!(journal.unless_overtaken(epoch, &fill, || 1), Ok(1));
        let first = journal.epoch();
        journal.record(Scope::Keys(vec![key.hash()]), || ());
        journal.record(Scope::Keys(vec![key.hash()]), || ());
        // Overtaken, by the first record that covers it.
        assert_eq!(journal.unless_overtaken(epoch, &fill, || 1), Err(first));
        // A fill that started after it is not affected.
        assert_eq!(
            journal.unless_overtaken(journal.epoch(), &fill, || 1),
            Ok(1)
        );
    }

    #[test]
    fn tags_prefixes_and_resyncs_overtake_too() {
        let key = CacheKey::new("/products/7");
        let hashes = [key.hash()];
        let fulls = [key.full().as_ref()];
        let tags = [Bytes::from_static(b"products")];
        let fill = footprint(&hashes, &fulls, &tags);
        for scope in [
            Scope::Tag(Bytes::from_static(b"products"), Vec::new()),
            Scope::Prefix(KeyPattern::new().prefix(b"/products/")),
            Scope::All,
        ] {
            let journal = Journal::default();
            let epoch = journal.epoch();
            journal.record(scope.clone(), || ());
            assert_eq!(
                journal.unless_overtaken(epoch, &fill, || ()),
                Err(epoch),
                "{scope:?}"
            );
        }
    }

    /// A tag's invalidation names up to 100,000 keys: the records are
    /// bounded by the hashes they hold too, not by their count alone.
    #[test]
    fn the_records_hold_a_bounded_number_of_hashes() {
        let journal = Journal::default();
        let epoch = journal.epoch();
        let big = || Scope::Keys(vec![KeyHash::MIN; Journal::MAX_HASHES / 2 + 1]);
        journal.record(big(), || ());
        journal.record(big(), || ());
        assert!(journal.hashes_held() <= Journal::MAX_HASHES);
        // The first went: a fill that started before it is not stored.
        let fill = footprint(&[], &[], &[]);
        assert_eq!(journal.unless_overtaken(epoch, &fill, || ()), Err(epoch));
    }

    /// A prefix or a tag is as long as its caller makes it (an admin purge
    /// of a 60 KB path): the records weigh their bytes, so 16,384 of those
    /// do not hold a gigabyte.
    #[test]
    fn long_prefixes_and_tags_weigh_their_bytes() {
        let journal = Journal::default();
        let long = vec![b'p'; 60_000];
        for i in 0..2_000 {
            let scope = if i % 2 == 0 {
                Scope::Prefix(KeyPattern::new().prefix(&long))
            } else {
                Scope::Tag(Bytes::from(long.clone()), Vec::new())
            };
            journal.record(scope, || ());
        }
        assert!(journal.hashes_held() <= Journal::MAX_HASHES);
        assert!(journal.hashes_held() * 16 >= 60_000, "the newest stays");
    }

    #[test]
    fn a_fill_older_than_the_journal_is_not_stored() {
        let journal = Journal::default();
        let epoch = journal.epoch();
        for _ in 0..=Journal::CAP {
            journal.record(Scope::Keys(Vec::new()), || ());
        }
        let fill = footprint(&[], &[], &[]);
        assert_eq!(journal.unless_overtaken(epoch, &fill, || ()), Err(epoch));
        assert_eq!(
            journal.unless_overtaken(journal.epoch(), &fill, || ()),
            Ok(())
        );
    }
}
