//! Stored entries: a response-shaped value plus the times that decide its freshness.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;

/// A response-shaped value: status, headers and body, with no HTTP types.
///
/// Header names and values are raw bytes; the HTTP layer validates them when
/// it turns a value back into a response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Value {
    /// Status code (200 for programmatic values).
    pub status: u16,
    /// Header `(name, value)` pairs, in order.
    pub headers: Vec<(Bytes, Bytes)>,
    /// The body.
    pub body: Bytes,
}

impl Value {
    /// A 200 value with a body and no headers, for programmatic use.
    pub fn from_body(body: impl Into<Bytes>) -> Self {
        Self {
            status: 200,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Bytes this value holds, used by the L1 weigher: the body (a large
    /// one in whole pages, see [`crate::body`]), and each field's bytes plus
    /// what holding it costs (310 bytes, measured).
    pub fn weight(&self) -> usize {
        crate::body::stored_size(self.body.len())
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len() + FIELD_OVERHEAD)
                .sum::<usize>()
    }
}

/// Where a value came from when it answered a request (the `x-cache-tier` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The in-process cache.
    L1,
    /// The shared tier (Valkey).
    L2,
    /// The origin, just now.
    Origin,
}

impl Source {
    /// The name used in headers and metrics: `l1`, `l2`, `origin`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::L1 => "l1",
            Source::L2 => "l2",
            Source::Origin => "origin",
        }
    }
}

/// How fresh an entry is at a given instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Inside its fresh lifetime, with this much left.
    Fresh(Duration),
    /// Past its fresh lifetime, inside stale-while-revalidate: answer it and refresh.
    Stale,
    /// Past stale-while-revalidate, inside stale-if-error: answer it only if the origin fails.
    StaleIfError,
    /// Past every window, kept a while for its validators only: never
    /// answered, but the origin is asked with them, and a 304 renews it.
    Expired,
    /// Past its hard expiry: must not be served.
    Dead,
}

/// The times stored with an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Times {
    /// When the origin generated the response (the `Age` anchor: the time it
    /// answered, less any `Age` it reported).
    pub created_at: SystemTime,
    /// End of the (jittered) fresh lifetime.
    pub fresh_until: SystemTime,
    /// End of the stale-while-revalidate window (`fresh_until` when none).
    pub stale_until: SystemTime,
    /// End of the stale-if-error window (`fresh_until` when none).
    pub error_until: SystemTime,
    /// Hard expiry, the latest of all: past it the entry is dead in every
    /// tier. Past the windows above and before it, the entry is kept only
    /// for its validators ([`Freshness::Expired`]).
    pub hard_until: SystemTime,
}

impl Times {
    /// Times with no stale windows: fresh until `fresh_until`, then dead.
    pub fn fresh(created_at: SystemTime, fresh_until: SystemTime) -> Self {
        Self {
            created_at,
            fresh_until,
            stale_until: fresh_until,
            error_until: fresh_until,
            hard_until: fresh_until,
        }
    }

    /// Every time capped at `until` (promotion from L2 under the server's TTL).
    pub fn capped(self, until: SystemTime) -> Self {
        Self {
            created_at: self.created_at.min(until),
            fresh_until: self.fresh_until.min(until),
            stale_until: self.stale_until.min(until),
            error_until: self.error_until.min(until),
            hard_until: self.hard_until.min(until),
        }
    }
}

/// A cached entry; cheap to clone (one shared allocation).
#[derive(Debug, Clone)]
pub struct Entry(Arc<EntryInner>);

#[derive(Debug)]
struct EntryInner {
    /// See [`Entry::id`].
    id: u64,
    key: Bytes,
    variant: Bytes,
    value: Value,
    times: Times,
    origin_latency: Duration,
    /// The tags it was stored under (see [`Entry::with_tags`]).
    tags: Box<[Bytes]>,
    /// See [`Entry::load`].
    load: u64,
    /// A representation of the value built once by a reader and reused on
    /// every later hit (the HTTP layer keeps a ready `HeaderMap` here).
    view: OnceLock<Box<dyn Any + Send + Sync>>,
}

/// `t` since the Unix epoch (zero before it).
fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default()
}

/// `t` in milliseconds since the Unix epoch, as a shared tier keeps it.
pub(crate) fn millis(t: SystemTime) -> u128 {
    since_epoch(t).as_millis()
}

/// Per-entry memory beyond its bytes (see [`Entry::weight`]), with the
/// ~64 bytes of L1's slot for it (`l1::Held`).
const BOOKKEEPING: usize = 1864;
/// Per tag an entry is recorded under, beyond the tag's bytes: its share of
/// the engine's tag index, which follows L1 but is not in it (a tag of its
/// own costs a 40-byte slot of the index, ~70 with the map's spare room;
/// a key in a shared tag's set, ~40; either with its handle on the fill,
/// which keeps L1's ~64-byte slot until the record is pruned, and the
/// stale records a prune has not reached yet, up to a quarter more).
pub(crate) const TAG_ALLOWANCE: usize = 250;
/// Per-entry memory of a reader's view beyond its fields (see [`Entry::weight`]).
const VIEW_ALLOWANCE: usize = 240;
/// Per stored field, beyond its bytes: the pair and its two allocations,
/// and the field's slot (and a custom name's copy) in a reader's view.
/// Measured: a flood through the layer of responses with 13 fields costs
/// ~350 bytes a field more than one with a single field
/// (`FLOOD_FIELDS=12 TIERCACHE_BENCH_CASE=flood`, `cargo bench --bench engine`).
const FIELD_OVERHEAD: usize = 310;

impl Entry {
    /// Builds an entry. `key` is the full key (see [`crate::CacheKey::full`]);
    /// `variant` is opaque bytes a reader must match (the HTTP layer puts the
    /// values of the `Vary`'d request headers there); `origin_latency` is the
    /// time the origin took (XFetch's δ).
    pub fn new(
        key: Bytes,
        variant: Bytes,
        value: Value,
        times: Times,
        origin_latency: Duration,
    ) -> Self {
        // Relaxed: the number only has to be unique, not ordered.
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self(Arc::new(EntryInner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            key,
            variant,
            value,
            times,
            origin_latency,
            tags: Box::default(),
            load: 0,
            view: OnceLock::new(),
        }))
    }

    /// This entry, stored under `tags`: they travel with it (to L2 and
    /// back, and when it is renewed), so that wherever it lands it is
    /// recorded under them, and it weighs their records in the tag index.
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use tiercache_core::{Entry, Times, Value};
    /// # let now = SystemTime::now();
    /// # let times = Times::fresh(now, now);
    /// let entry = Entry::new("k".into(), Default::default(), Value::from_body("v"), times, Duration::ZERO);
    /// let tagged = entry.clone().with_tags(&["reports".into()]);
    /// assert!(entry.tags().is_empty());
    /// assert_eq!(tagged.tags(), ["reports"]);
    /// assert!(tagged.weight() > entry.weight());
    /// ```
    pub fn with_tags(mut self, tags: &[Bytes]) -> Self {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => {
                inner.tags = tags.into();
                self
            }
            // Shared: a new entry (a new id) with the same parts.
            None => self.rebuilt(self.times()).with_tags(tags),
        }
    }

    /// A new entry (a new id) with this one's parts and tags and `times`
    /// (a copy promoted from L2, a renewed one).
    pub(crate) fn with_times(&self, times: Times) -> Entry {
        self.rebuilt(times).with_tags(self.tags())
    }

    /// A new entry with this one's parts and load, untagged, and `times`.
    fn rebuilt(&self, times: Times) -> Entry {
        Entry::new(
            self.key().clone(),
            self.variant().clone(),
            self.value().clone(),
            times,
            self.origin_latency(),
        )
        .loaded_by(self.load())
    }

    /// This entry, the answer of the load numbered `load` (see
    /// [`Entry::load`]).
    pub(crate) fn loaded_by(mut self, load: u64) -> Self {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => {
                inner.load = load;
                self
            }
            None => self
                .rebuilt(self.times())
                .with_tags(self.tags())
                .loaded_by(load),
        }
    }

    /// The number of the load this entry answers: the engine numbers its
    /// loads as they start, and a fill gives way to an entry in L1 of a
    /// later load (an older, slower load does not replace a newer answer).
    /// `0` when not known (a copy read from the shared tier).
    pub(crate) fn load(&self) -> u64 {
        self.0.load
    }

    /// The tags this entry was stored under.
    pub fn tags(&self) -> &[Bytes] {
        &self.0.tags
    }

    /// A reader's view of this entry, built by `init` on first use and shared
    /// by every later hit. `None` when another reader already stored a view
    /// of a different type (the caller then builds its own each time).
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use tiercache_core::{Entry, Times, Value};
    /// # let now = SystemTime::now();
    /// # let times = Times::fresh(now, now);
    /// let entry = Entry::new("k".into(), Default::default(), Value::from_body("v"), times, Duration::ZERO);
    /// let len = entry.view(|e| e.value().body.len());
    /// assert_eq!(len, Some(&1));
    /// ```
    pub fn view<T: Any + Send + Sync>(&self, init: impl FnOnce(&Entry) -> T) -> Option<&T> {
        self.0
            .view
            .get_or_init(|| Box::new(init(self)))
            .downcast_ref::<T>()
    }

    /// A number no other entry of this process has had or will have: it
    /// tells entries apart where an address could not (an entry dropped
    /// and another built in its memory), for a reader remembering what it
    /// built from one.
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use tiercache_core::{Entry, Times, Value};
    /// # let now = SystemTime::now();
    /// # let times = Times::fresh(now, now);
    /// let a = Entry::new("k".into(), Default::default(), Value::from_body("v"), times, Duration::ZERO);
    /// let b = Entry::new("k".into(), Default::default(), Value::from_body("v"), times, Duration::ZERO);
    /// assert_ne!(a.id(), b.id());
    /// assert_eq!(a.id(), a.clone().id());
    /// ```
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The full key this entry was stored under.
    pub fn key(&self) -> &Bytes {
        &self.0.key
    }

    /// The variant bytes.
    pub fn variant(&self) -> &Bytes {
        &self.0.variant
    }

    /// The stored value.
    pub fn value(&self) -> &Value {
        &self.0.value
    }

    /// The stored times.
    pub fn times(&self) -> Times {
        self.0.times
    }

    /// The origin time of the fill that produced this entry.
    pub fn origin_latency(&self) -> Duration {
        self.0.origin_latency
    }

    /// Whole seconds since the origin answered, as of `now`.
    pub fn age(&self, now: SystemTime) -> u64 {
        now.duration_since(self.0.times.created_at)
            .unwrap_or_default()
            .as_secs()
    }

    /// Freshness as of `now`.
    pub fn freshness(&self, now: SystemTime) -> Freshness {
        let t = &self.0.times;
        if now < t.fresh_until {
            Freshness::Fresh(t.fresh_until.duration_since(now).unwrap_or_default())
        } else if now < t.stale_until {
            Freshness::Stale
        } else if now < t.error_until {
            Freshness::StaleIfError
        } else if now < t.hard_until {
            Freshness::Expired
        } else {
            Freshness::Dead
        }
    }

    /// Time left until hard expiry, as of `now` (zero when dead).
    pub fn remaining_hard(&self, now: SystemTime) -> Duration {
        self.0
            .times
            .hard_until
            .duration_since(now)
            .unwrap_or_default()
    }

    /// Bytes this entry holds in L1: key, headers, body, bookkeeping, room
    /// for a reader's [view](Self::view), and its records in the engine's
    /// tag index when it was stored under tags (250 bytes a tag and the
    /// tag's bytes).
    ///
    /// Both allowances were measured, not guessed (`cargo bench --bench
    /// engine`, and the proxy flood of `crates/tiercache-proxy/tests/memory.rs`).
    /// The bookkeeping (1,800 bytes; 1,152 undercounted small entries by
    /// ~650 bytes each, 1.25× the budget with 60-byte bodies): moka's node, the expiry index
    /// and the allocator's overhead under churn. The view (240 bytes, plus
    /// each field's slot in the per-field allowance): what the HTTP layer's
    /// prebuilt head adds once the entry has answered a request. Both are
    /// counted from the start (moka weighs an entry only when it is stored),
    /// so an entry no reader ever views is over-counted by its view.
    pub fn weight(&self) -> u32 {
        let w = self.0.key.len()
            + self.0.variant.len()
            + self.0.value.weight()
            + BOOKKEEPING
            + VIEW_ALLOWANCE
            + self.tags_weight();
        u32::try_from(w).unwrap_or(u32::MAX)
    }

    /// Its share of the tag index (see [`TAG_ALLOWANCE`]).
    fn tags_weight(&self) -> usize {
        self.0.tags.iter().map(|t| t.len() + TAG_ALLOWANCE).sum()
    }

    /// Whether `other` is of the same fill (a copy of it, or a renewal
    /// that kept its creation): the same key, variant and creation time (to
    /// the millisecond when one of them was read back from a shared tier,
    /// which keeps no more).
    pub(crate) fn same_fill(&self, other: &Entry) -> bool {
        let (a, b) = (self.times().created_at, other.times().created_at);
        // To the millisecond only when one side knows no more than that (a
        // copy read back from Valkey): two fills made here in one
        // millisecond stay two.
        let whole_ms = |t: SystemTime| since_epoch(t).subsec_nanos().is_multiple_of(1_000_000);
        let same_time =
            a == b || (self.created_ms() == other.created_ms() && (whole_ms(a) || whole_ms(b)));
        same_time && self.key() == other.key() && self.variant() == other.variant()
    }

    /// When it was created, to the millisecond: as precise as a copy read
    /// back from a shared tier (Valkey's envelope) knows it.
    pub(crate) fn created_ms(&self) -> u128 {
        millis(self.times().created_at)
    }

    /// Whether two handles share one allocation.
    pub fn ptr_eq(&self, other: &Entry) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// A handle that does not keep the entry's parts alive.
    pub(crate) fn downgrade(&self) -> WeakEntry {
        WeakEntry(Arc::downgrade(&self.0))
    }
}

/// L1's hold on an [`Entry`], which L1 lets go of the moment the entry
/// leaves it ([`HeldEntry::release`], from moka's removal listener).
///
/// moka frees what it removed only when every thread has left the epoch
/// it was removed in (crossbeam's deferred reclamation): one thread
/// descheduled inside a cache call holds back every removal made
/// meanwhile. With the entry in that record, a 64 KiB body evicted stayed
/// allocated until then (100-180 bodies held at once for a 4 MiB budget
/// of 64, in a loaded test run); now the record keeps only this slot.
pub(crate) struct HeldEntry(arc_swap::ArcSwapOption<EntryInner>);

impl HeldEntry {
    pub(crate) fn new(entry: Entry) -> Self {
        Self(arc_swap::ArcSwapOption::new(Some(entry.0)))
    }

    /// The entry, unless L1 let go of it.
    #[inline]
    pub(crate) fn entry(&self) -> Option<Entry> {
        self.0.load_full().map(Entry)
    }

    /// Drops L1's hold: the entry lives on only in what still holds it
    /// (a response in flight).
    pub(crate) fn release(&self) {
        self.0.store(None);
    }

    /// Whether L1 let go of it.
    pub(crate) fn released(&self) -> bool {
        self.0.load().is_none()
    }
}

/// An [`Entry`] that may have been dropped everywhere else: it keeps only
/// the entry's fixed-size record, not its body or head.
pub(crate) struct WeakEntry(Weak<EntryInner>);

impl WeakEntry {
    /// The entry, if anything else still holds it.
    pub(crate) fn upgrade(&self) -> Option<Entry> {
        self.0.upgrade().map(Entry)
    }
}
