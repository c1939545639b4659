//! L1: the in-process moka cache, bounded by bytes, with an expiry index for the sweeper.
//!
//! moka's per-entry expiry is set to each entry's hard lifetime and serves
//! as the memory bound (its clock is its own). Freshness is decided from the
//! entry's stored times on the engine's clock, on every read (lazy expiry) and
//! by [`L1::sweep`], which runs moka's housekeeping (its timer wheel drops
//! what is dead on its clock) and, for an engine clock that runs apart from
//! the machine's, walks an index ordered by hard expiry, so an idle cache
//! still gives its memory back.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use moka::Expiry;
use moka::notification::RemovalCause;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;

use crate::entry::HeldEntry;
use crate::stats::{Counters, bump};
use crate::{Clock, Entry, Freshness, KeyHash};
use front::Epochs;

mod expire;
mod front;

/// Hard expiry, insertion number and key, in expiry order: 40 bytes a
/// record in the tree's nodes (a map of expiry to a `Vec` of keys cost
/// ~120, one allocation per distinct expiry, and jittered expiries are
/// nearly all distinct). The insertion number keeps a cohort that shares
/// an expiry in the order it was stored, so a sweep walks moka's memory in
/// order rather than by digest (0.24-0.27 M entries a second against 0.15 M by
/// digest, `cargo bench --bench engine`).
#[derive(Default)]
struct Index {
    records: BTreeSet<(SystemTime, u64, KeyHash)>,
    inserted: u64,
}

impl Index {
    fn record(&mut self, hard: SystemTime, hash: KeyHash) {
        self.inserted += 1;
        self.records.insert((hard, self.inserted, hash));
    }
}

/// Keys are already BLAKE3 digests; hashing them again for moka's table
/// needs only a fast seeded mix, not SipHash (~200 fewer instructions a hit).
type KeyHasher = foldhash::fast::RandomState;

/// What moka holds under a key: the entry, which its removal listener lets
/// go of at once (see [`HeldEntry`]), and what moka asks of it.
#[derive(Clone)]
struct Held(Arc<HeldParts>);

struct HeldParts {
    entry: HeldEntry,
    weight: u32,
    hard_until: SystemTime,
}

impl Held {
    fn new(entry: Entry) -> Self {
        Self(Arc::new(HeldParts {
            weight: entry.weight(),
            hard_until: entry.times().hard_until,
            entry: HeldEntry::new(entry),
        }))
    }

    /// The entry, unless it left L1 while this was being read.
    #[inline]
    fn entry(&self) -> Option<Entry> {
        self.0.entry.entry()
    }

    /// A handle on this fill that does not keep it.
    fn holding(&self) -> Holding {
        Holding(Arc::downgrade(&self.0))
    }
}

/// One fill of a key as L1 took it, without keeping it: whether L1 still
/// holds that fill (the tag index's records, so a key filled again after
/// its entry left L1 is not taken for the fill its tags recorded).
#[derive(Debug, Clone)]
pub(crate) struct Holding(Weak<HeldParts>);

impl Holding {
    /// A fill L1 never held.
    #[cfg(test)]
    pub(crate) fn never() -> Self {
        Self(Weak::new())
    }

    /// Whether L1 still holds this fill: until moka removes it (past its
    /// hard expiry or cleared, moka hides it from reads before that).
    pub(crate) fn held(&self) -> bool {
        self.0.upgrade().is_some_and(|held| !held.entry.released())
    }
}

pub(crate) struct L1 {
    cache: Cache<KeyHash, Held, KeyHasher>,
    /// Hard expiry → keys stored with it, for a clock that runs apart from
    /// moka's (`None` otherwise: moka's own expiry is on time). Records go
    /// stale when an entry is replaced or evicted; the sweep checks the
    /// live entry before removing.
    index: Option<Mutex<Index>>,
    /// Bytes inserted since moka last ran its housekeeping (see `insert`).
    unsettled: AtomicU64,
    /// Change counters for the per-thread table in front of moka.
    epochs: Arc<Epochs>,
    clock: Arc<dyn Clock>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for L1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1")
            .field("entries", &self.cache.entry_count())
            .field("bytes", &self.cache.weighted_size())
            .finish()
    }
}

struct HardExpiry(Arc<dyn Clock>);

impl HardExpiry {
    fn bound(&self, held: &Held) -> Option<Duration> {
        // Never zero: moka treats it as "expire now", which is what a dead entry
        // deserves anyway, but a 1 ms floor keeps the arithmetic obvious.
        Some(
            held.0
                .hard_until
                .duration_since(self.0.now())
                .unwrap_or_default()
                .max(Duration::from_millis(1)),
        )
    }
}

impl Expiry<KeyHash, Held> for HardExpiry {
    fn expire_after_create(&self, _: &KeyHash, value: &Held, _: Instant) -> Option<Duration> {
        self.bound(value)
    }

    fn expire_after_update(
        &self,
        _: &KeyHash,
        value: &Held,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        self.bound(value)
    }
}

impl L1 {
    pub(crate) fn new(capacity_bytes: u64, clock: Arc<dyn Clock>, counters: Arc<Counters>) -> Self {
        let listener_counters = counters.clone();
        let epochs = Arc::new(Epochs::new());
        let listener_epochs = epochs.clone();
        let cache = Cache::builder()
            .max_capacity(capacity_bytes)
            .weigher(|_: &KeyHash, held: &Held| held.0.weight)
            .expire_after(HardExpiry(clock.clone()))
            .eviction_listener(move |hash: Arc<KeyHash>, held: Held, cause| {
                // Not when moka's deferred reclamation gets to it: now.
                held.0.entry.release();
                listener_epochs.moved(&hash);
                match cause {
                    RemovalCause::Size => bump(&listener_counters.evicted),
                    RemovalCause::Expired => bump(&listener_counters.expired),
                    RemovalCause::Explicit | RemovalCause::Replaced => {}
                }
            })
            .build_with_hasher(KeyHasher::default());
        Self {
            cache,
            index: (!clock.keeps_machine_time()).then(Mutex::default),
            unsettled: AtomicU64::new(0),
            epochs,
            clock,
            counters,
        }
    }

    /// The live entry for `hash`, or `None`; a dead one is removed on the way (lazy expiry).
    // On every L1 hit: inlined into the application's crate too.
    #[inline]
    pub(crate) fn get(&self, hash: &KeyHash, now: SystemTime) -> Option<Entry> {
        let entry = match self.epochs.lookup(hash) {
            Ok(entry) => entry,
            Err(stamp) => {
                let entry = self.cache.get(hash)?.entry()?;
                self.epochs.keep(hash, stamp, &entry);
                entry
            }
        };
        if entry.freshness(now) != Freshness::Dead {
            return Some(entry);
        }
        if self.remove_if(hash, |live| live.ptr_eq(&entry)) {
            bump(&self.counters.expired);
        }
        None
    }

    /// Puts `entry` in under `hash`, whatever L1 holds there; this fill's
    /// [`Holding`] (the engine stores with [`replace`](Self::replace)).
    #[cfg(test)]
    pub(crate) fn insert(&self, hash: KeyHash, entry: Entry) -> Holding {
        let held = Held::new(entry);
        let holding = held.holding();
        // A compute, not `insert`: moka runs computes under one key one at
        // a time, and `insert` does not wait for them, so a removal decided
        // on the fill it read (`remove_if`) took a fill stored meanwhile.
        self.put_if(hash, held, |_| true);
        holding
    }

    /// The entry held under `hash`, live or not, as moka has it.
    #[cfg(test)]
    pub(crate) fn held(&self, hash: &KeyHash) -> Option<Entry> {
        self.cache.get(hash)?.entry()
    }

    /// Inserts `entry` only if `unchanged` says so of what L1 holds under
    /// `hash` now: a promotion checks that L1 holds nothing fresh; a
    /// renewal, the fill it read; a store, that L1 holds no later load's
    /// answer. Never from inside a compute's closure under the same key
    /// (moka's computes under one key wait for each other: it would wait
    /// for itself). moka runs it atomically against other
    /// computes under `hash` (stores and removals by `remove_if` are
    /// computes too), not against `invalidate`; the engine's fills,
    /// promotions and renewals all write under the journal's lock. The
    /// fill's [`Holding`] if `entry` went in.
    pub(crate) fn replace(
        &self,
        hash: KeyHash,
        entry: Entry,
        unchanged: impl FnOnce(Option<&Entry>) -> bool,
    ) -> Option<Holding> {
        let held = Held::new(entry);
        let holding = held.holding();
        self.put_if(hash, held, unchanged).then_some(holding)
    }

    /// Puts `held` in under `hash` if `unchanged` says so of what L1
    /// holds there, in one compute; whether it went in.
    fn put_if(
        &self,
        hash: KeyHash,
        held: Held,
        unchanged: impl FnOnce(Option<&Entry>) -> bool,
    ) -> bool {
        let (hard, weight) = (held.0.hard_until, u64::from(held.0.weight));
        let result = self.cache.entry(hash).and_compute_with(|live| {
            if unchanged(live.and_then(|live| live.value().entry()).as_ref()) {
                Op::Put(held)
            } else {
                Op::Nop
            }
        });
        let put = matches!(
            result,
            CompResult::Inserted(_) | CompResult::ReplacedWith(_)
        );
        if put {
            self.inserted(hash, hard, weight);
        }
        put
    }

    /// After an entry of `weight` expiring at `hard` went in under `hash`.
    fn inserted(&self, hash: KeyHash, hard: SystemTime, weight: u64) {
        self.epochs.moved(&hash);
        // moka evicts only when it runs its housekeeping: on its own, after
        // 64 to 384 writes, which for 64 KiB bodies is 4 to 25 MiB held
        // past the budget, and the allocator keeps that peak as resident
        // memory. Settle once a 256th of the budget has come in (one
        // thread does, with what every thread added).
        let settle_every = (self.capacity() / 256).max(64 * 1024);
        if self.unsettled.fetch_add(weight, Relaxed) + weight >= settle_every
            && self.unsettled.swap(0, Relaxed) >= settle_every
        {
            // With an eviction listener moka stops a pass after a time
            // budget (2 ms), which a loaded machine spends before the
            // evictions are done: a few more passes while over the budget.
            for _ in 0..4 {
                self.cache.run_pending_tasks();
                if self.cache.weighted_size() <= self.capacity() {
                    break;
                }
            }
        }
        let Some(index) = &self.index else {
            return;
        };
        let mut index = index.lock().unwrap();
        index.record(hard, hash);
        // Evicted and replaced entries leave records behind; a flood of unique
        // keys must not grow the index past the cache. Rebuild it from the
        // live entries when it holds twice as many records (amortised O(1)).
        if index.records.len() > 2 * self.cache.entry_count() as usize + 4096 {
            // Dropped first: the old and the new index never coexist.
            index.records.clear();
            for (key, live) in self.cache.iter() {
                index.record(live.0.hard_until, *key);
            }
        }
    }

    /// Expiry-index records held (live entries plus stale records).
    pub(crate) fn index_records(&self) -> usize {
        self.index
            .as_ref()
            .map_or(0, |index| index.lock().unwrap().records.len())
    }

    /// Drops every entry `doomed` picks (a scan of the whole cache).
    pub(crate) fn remove_where(&self, doomed: impl Fn(&Entry) -> bool) {
        for (hash, held) in self.cache.iter() {
            let Some(entry) = held.entry() else {
                continue;
            };
            if doomed(&entry) {
                // Only the entry seen: a newer fill under the key stays.
                self.remove_if(&hash, |live| live.ptr_eq(&entry));
            }
        }
        self.epochs.moved_all();
    }

    /// Drops every entry.
    pub(crate) fn clear(&self) {
        self.cache.invalidate_all();
        self.epochs.moved_all();
    }

    /// Stops every thread's table answering from what it holds: for a
    /// change whose keys were chosen by what moka shows, which hides an
    /// entry past its own expiry before its housekeeping removes it (and
    /// only then does the listener move the entry's shard).
    pub(crate) fn forget_thread_copies(&self) {
        self.epochs.moved_all();
    }

    /// Whether L1 holds an entry under `hash` (live or not yet reclaimed).
    #[cfg(test)]
    pub(crate) fn contains(&self, hash: &KeyHash) -> bool {
        self.cache.contains_key(hash)
    }

    /// Drops the entry under `hash` if it carries `tag`; whether L1 holds
    /// one under `hash` without it (stored again under other tags since
    /// the tag recorded the key), which stays.
    pub(crate) fn invalidate_tagged(&self, hash: &KeyHash, tag: &[u8]) -> bool {
        let mut spared = false;
        let result = self.cache.entry(*hash).and_compute_with(|live| {
            match live.and_then(|live| live.value().entry()) {
                // An entry with no tags at all (a copy of an envelope that
                // could not carry them) is not told apart: it goes.
                Some(live) if !live.tags().is_empty() && !live.tags().iter().any(|t| t == tag) => {
                    spared = true;
                    Op::Nop
                }
                Some(_) => Op::Remove,
                None => Op::Nop,
            }
        });
        if matches!(result, CompResult::Removed(_)) {
            self.epochs.moved(hash);
        }
        spared
    }

    pub(crate) fn invalidate(&self, hash: &KeyHash) {
        self.cache.invalidate(hash);
        self.epochs.moved(hash);
    }

    /// Removes every entry whose hard expiry has passed on the engine clock, then
    /// lets moka finish its own housekeeping. Returns how many were reclaimed.
    pub(crate) fn sweep(&self) -> u64 {
        // moka first: its timer wheel drops, in bulk, every entry whose
        // memory bound (the hard lifetime, on moka's clock) has passed, and
        // its listener counts them as expired.
        let expired_before = self.counters.expired.load(Relaxed);
        self.cache.run_pending_tasks();
        let by_moka = self.counters.expired.load(Relaxed) - expired_before;
        let now = self.clock.now();
        let Some(index) = &self.index else {
            return by_moka;
        };
        let due = {
            let mut index = index.lock().unwrap();
            let later = index.records.split_off(&(now, 0, KeyHash::MIN));
            std::mem::replace(&mut index.records, later)
        };
        // Then what is dead on the engine's clock and still held (a clock
        // that ran ahead of moka's, as a mock clock does).
        let mut removed = 0;
        for (_, _, hash) in due {
            if self.remove_if(&hash, |live| live.freshness(now) == Freshness::Dead) {
                removed += 1;
            }
        }
        if removed > 0 {
            self.counters.expired.fetch_add(removed, Relaxed);
            self.cache.run_pending_tasks();
        }
        by_moka + removed
    }

    /// Removes `hash` if its live entry satisfies `dead`; counts it as expired.
    /// Removes the live entry under `hash` if `doomed` picks it, atomically
    /// (a fill that replaced it meanwhile stays); the caller counts why.
    pub(crate) fn remove_if(&self, hash: &KeyHash, doomed: impl FnOnce(&Entry) -> bool) -> bool {
        let result = self.cache.entry(*hash).and_compute_with(|live| {
            match live.and_then(|live| live.value().entry()) {
                Some(live) if doomed(&live) => Op::Remove,
                _ => Op::Nop,
            }
        });
        let removed = matches!(result, CompResult::Removed(_));
        if removed {
            self.epochs.moved(hash);
        }
        removed
    }

    /// The byte budget.
    pub(crate) fn capacity(&self) -> u64 {
        self.cache.policy().max_capacity().unwrap_or(0)
    }

    /// How many entries go stale in each of the next `seconds` seconds after
    /// `now`, from at most `limit` of them (moka's iteration order is its
    /// hash order: a fair sample), scaled up to every entry when sampled.
    pub(crate) fn horizon(&self, now: SystemTime, seconds: usize, limit: usize) -> crate::Horizon {
        let mut buckets = vec![0u64; seconds];
        let (mut examined, mut stale) = (0u64, 0u64);
        for entry in self
            .cache
            .iter()
            .filter_map(|(_, held)| held.entry())
            .take(limit)
        {
            examined += 1;
            match entry.times().fresh_until.duration_since(now) {
                Ok(left) => {
                    if let Some(slot) = buckets.get_mut(left.as_secs() as usize) {
                        *slot += 1;
                    }
                }
                Err(_) => stale += 1,
            }
        }
        let entries = self.cache.entry_count().max(examined);
        let scaled = (examined as usize) == limit && entries > examined;
        if scaled {
            let factor = entries as f64 / examined as f64;
            let scale = |n: &mut u64| *n = (*n as f64 * factor).round() as u64;
            buckets.iter_mut().for_each(scale);
            scale(&mut stale);
        }
        crate::Horizon {
            buckets,
            already_stale: stale,
            examined,
            entries,
            scaled,
        }
    }

    pub(crate) fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    pub(crate) fn weighted_size(&self) -> u64 {
        self.cache.weighted_size()
    }

    pub(crate) fn run_pending_tasks(&self) {
        self.cache.run_pending_tasks();
    }
}

#[cfg(test)]
mod tests;
