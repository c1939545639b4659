//! What a fill becomes: its lifetime drawn from the policy, an entry in L1
//! and (queued) in L2, recorded under its tags; unless an invalidation
//! overtook it.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::TieredCache;
use super::journal::{Footprint, Start};
use crate::{CacheKey, Entry, KeyHash, Policy, Times, Value};

/// Where a fill's fresh lifetime comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// The route's ttl, jittered both ways.
    Route,
    /// The route's negative ttl (404, 410), jittered both ways.
    Negative,
    /// Declared by the origin (what is left of it): jitter only shortens it.
    Declared(Duration),
}

/// A value to store, with what the engine needs besides the policy.
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::{Fill, Lifetime, Value};
///
/// let fill = Fill::new(Value::from_body("report"))
///     .lifetime(Lifetime::Declared(Duration::from_secs(60)))
///     .origin_latency(Duration::from_millis(40))
///     .tags(vec!["reports".into()]);
/// # let _ = fill;
/// ```
#[derive(Debug, Clone)]
pub struct Fill {
    pub(crate) value: Value,
    variant: Bytes,
    origin_latency: Duration,
    lifetime: Lifetime,
    stale_while_revalidate: Option<Duration>,
    stale_if_error: Option<Duration>,
    no_stale: bool,
    initial_age: Duration,
    spent: Duration,
    tags: Vec<Bytes>,
    under: Vec<CacheKey>,
    validator: bool,
}

impl Fill {
    /// A fill of `value`, no variant, zero origin latency, the route's ttl.
    pub fn new(value: Value) -> Self {
        Self {
            value,
            variant: Bytes::new(),
            origin_latency: Duration::ZERO,
            lifetime: Lifetime::Route,
            stale_while_revalidate: None,
            stale_if_error: None,
            no_stale: false,
            initial_age: Duration::ZERO,
            spent: Duration::ZERO,
            tags: Vec::new(),
            under: Vec::new(),
            validator: false,
        }
    }

    /// Tags (surrogate keys) to record the entry under, for
    /// [`TieredCache::invalidate_tag`].
    pub fn tags(mut self, tags: Vec<Bytes>) -> Self {
        self.tags = tags;
        self
    }

    /// Where the fresh lifetime comes from (default: the route's ttl).
    pub fn lifetime(mut self, lifetime: Lifetime) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The origin's own stale windows (RFC 5861), overriding the policy's.
    pub fn stale_windows(
        mut self,
        while_revalidate: Option<Duration>,
        if_error: Option<Duration>,
    ) -> Self {
        self.stale_while_revalidate = while_revalidate;
        self.stale_if_error = if_error;
        self
    }

    /// The value carries a validator (an HTTP `ETag` or `Last-Modified`):
    /// once every window has passed it is kept for the policy's
    /// [`revalidation window`](crate::Policy::revalidation_window), never
    /// answered, so the origin can be asked with it (a 304 renews it).
    pub fn validator(mut self, on: bool) -> Self {
        self.validator = on;
        self
    }

    /// Never serve this entry stale (the origin said `must-revalidate`,
    /// `proxy-revalidate` or `no-cache`).
    pub fn no_stale(mut self, on: bool) -> Self {
        self.no_stale = on;
        self
    }

    /// The age the origin reported (`Age`), so stored ages count from its answer.
    pub fn initial_age(mut self, age: Duration) -> Self {
        self.initial_age = age;
        self
    }

    /// What of a route lifetime ([`Lifetime::Route`], [`Lifetime::Negative`])
    /// the response has spent already: the entry lives what is left of the
    /// one drawn. The HTTP layer gives a response without freshness of its
    /// own its `Age` here (RFC 9111 §4.2: a heuristic lifetime counts from
    /// the origin's answer too), and refuses one past the band's floor.
    pub fn spent(mut self, spent: Duration) -> Self {
        self.spent = spent;
        self
    }

    /// The variant bytes a reader must match (see [`Entry::variant`]).
    pub fn variant(mut self, variant: Bytes) -> Self {
        self.variant = variant;
        self
    }

    /// How long the origin took to produce the value (δ).
    pub fn origin_latency(mut self, took: Duration) -> Self {
        self.origin_latency = took;
        self
    }

    /// Stores the entry under `key` instead of the key that was fetched;
    /// called again, under each key given (the HTTP layer keeps a `Vary`
    /// variant under the URL's key and under its own). The first is the
    /// entry that answers.
    pub fn store_under(mut self, key: CacheKey) -> Self {
        self.under.push(key);
        self
    }

    /// Adds `tags` to the fill's own (once each).
    pub(crate) fn add_tags(mut self, tags: &[Bytes]) -> Self {
        for tag in tags {
            if !self.tags.contains(tag) {
                self.tags.push(tag.clone());
            }
        }
        self
    }

    pub(crate) fn origin_latency_unset(&self) -> bool {
        self.origin_latency.is_zero()
    }

    /// The value.
    pub fn value(&self) -> &Value {
        &self.value
    }
}

impl From<Value> for Fill {
    fn from(value: Value) -> Self {
        Fill::new(value)
    }
}

/// The latest time the engine stores: far past any lifetime a validated
/// policy or a clamped origin lifetime reaches, and inside `SystemTime`.
pub(super) fn later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d)
        .unwrap_or_else(|| SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 40))
}

impl TieredCache {
    /// Stores `fill`, the answer of a load that started at `start`, under
    /// `key` (or the keys it names, see [`Fill::store_under`]) in L1 and,
    /// queued, in L2, with the policy's tags added to the fill's own;
    /// unless an invalidation recorded since covers it, and under each key
    /// only if L1 holds no answer of a later load there (see
    /// [`Entry::load`]). Returns the entry under `key`, and `Ok(true)`
    /// when it was stored there, `Ok(false)` when a later load's answer
    /// stays there (the fill may still be stored under its other keys), or
    /// the sequence of the invalidation that overtook it (see
    /// [`Journal::unless_overtaken`](super::journal::Journal::unless_overtaken)).
    /// The fresh lifetime is drawn now from the policy's jitter band (or,
    /// for a lifetime the origin declared, from below it); the stale
    /// windows follow it; L2's `PX` is the whole hard lifetime.
    pub(crate) fn store_since(
        &self,
        key: &CacheKey,
        fill: Fill,
        policy: &Policy,
        start: Start,
    ) -> (Entry, Result<bool, u64>) {
        // Whatever stores under a policy (a load, a `put`, a `touch`)
        // carries its tags.
        let fill = fill.add_tags(policy.tags());
        let now = self.now();
        let (times, l2_ttl) = self.times_for(&fill, policy, now);
        let entry = |key: &CacheKey| {
            Entry::new(
                key.full().clone(),
                fill.variant.clone(),
                fill.value.clone(),
                times,
                fill.origin_latency,
            )
            .with_tags(&fill.tags)
            .loaded_by(start.load)
        };
        let mut under = fill.under.iter();
        let key = under.next().unwrap_or(key);
        let main = entry(key);
        let extra: Vec<(CacheKey, Entry)> = under
            .filter(|k| *k != key)
            .map(|k| (k.clone(), entry(k)))
            .collect();
        let hashes: Vec<KeyHash> = std::iter::once(key.hash())
            .chain(extra.iter().map(|(k, _)| k.hash()))
            .collect();
        let fulls: Vec<&[u8]> = std::iter::once(key.full().as_ref())
            .chain(extra.iter().map(|(k, _)| k.full().as_ref()))
            .collect();
        let footprint = Footprint {
            hashes: &hashes,
            fulls: &fulls,
            tags: &fill.tags,
        };
        let stored = self
            .inner
            .journal
            .unless_overtaken(start.epoch, &footprint, || {
                let late = start.late.as_ref();
                for (k, e) in &extra {
                    self.insert(k, e.clone(), (l2_ttl, late), &fill.tags);
                }
                self.insert(key, main.clone(), (l2_ttl, late), &fill.tags)
            });
        self.inner.prune_tags_if_due();
        (main, stored)
    }

    /// Stores `fill` now, whatever came before (the programmatic `put`).
    pub(crate) fn store_now(&self, key: &CacheKey, fill: Fill, policy: &Policy) -> Entry {
        let start = self.inner.journal.start();
        self.store_since(key, fill, policy, start).0
    }

    /// An answer that is shared but not stored: fresh for no time.
    pub(crate) fn transient(&self, key: &CacheKey, value: Value, took: Duration) -> Entry {
        let now = self.now();
        Entry::new(
            key.full().clone(),
            Bytes::new(),
            value,
            Times::fresh(now, now),
            took,
        )
    }

    pub(crate) fn times_for(
        &self,
        fill: &Fill,
        policy: &Policy,
        now: SystemTime,
    ) -> (Times, Duration) {
        let fresh = {
            let mut rng = self.inner.rng.lock().unwrap_or_else(|e| e.into_inner());
            // Only what is left of a route lifetime (see `Fill::spent`).
            match fill.lifetime {
                super::Lifetime::Route => policy.draw_ttl(&mut *rng).saturating_sub(fill.spent),
                super::Lifetime::Negative => policy
                    .draw_negative_ttl(&mut *rng)
                    .saturating_sub(fill.spent),
                // An origin may declare any lifetime; no entry outlives a year.
                super::Lifetime::Declared(d) => {
                    policy.draw_origin_ttl(d.min(crate::MAX_TTL), &mut *rng)
                }
            }
        };
        // A negative entry is not served stale on the route's say-so: the
        // resource may exist by now. Only the origin's own windows apply
        // (the HTTP layer gives a 4xx/5xx none).
        let (route_swr, route_sie) = match fill.lifetime {
            super::Lifetime::Negative => (Duration::ZERO, Duration::ZERO),
            _ => (policy.swr_window(), policy.sie_window()),
        };
        let (swr, sie) = if fill.no_stale {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (
                fill.stale_while_revalidate
                    .unwrap_or(route_swr)
                    .min(crate::MAX_TTL),
                fill.stale_if_error.unwrap_or(route_sie).min(crate::MAX_TTL),
            )
        };
        let keep = if fill.validator {
            policy.revalidation_window()
        } else {
            Duration::ZERO
        };
        let fresh_until = later(now, fresh);
        let hard = swr.max(sie).max(keep);
        let times = Times {
            created_at: now.checked_sub(fill.initial_age).unwrap_or(now),
            fresh_until,
            stale_until: later(fresh_until, swr),
            error_until: later(fresh_until, sie),
            hard_until: later(fresh_until, hard),
        };
        (times, fresh + hard)
    }

    /// Puts `entry` in L1 and (queued) in L2 under `key` for `l2_ttl`,
    /// records it under `tags`, and clears any hit-for-miss mark; unless L1
    /// holds a fresh answer of a later load there (see [`Entry::load`]),
    /// which stays, in both tiers. The answer of a load that outlived its
    /// fleet lock (`late`: when it began, and the lock's token) gives way in
    /// L2 to the fill of a load begun since, or under way (see
    /// [`Tier::put_unless_newer`](crate::Tier::put_unless_newer)). Whether
    /// it went in. Callers hold the journal's lock (see
    /// [`store_since`](Self::store_since)).
    pub(crate) fn insert(
        &self,
        key: &CacheKey,
        entry: Entry,
        (l2_ttl, late): (Duration, Option<&crate::LateFill>),
        tags: &[Bytes],
    ) -> bool {
        let mut old = None;
        let (load, now) = (entry.load(), self.now());
        // A later answer past its fresh time gives way: it answers no one
        // as it is.
        let older = |live: Option<&Entry>| {
            old = live.cloned();
            live.is_none_or(|live| {
                live.load() <= load || !matches!(live.freshness(now), crate::Freshness::Fresh(_))
            })
        };
        // In L1 before its tags record it: a prune that finds a record's
        // fill gone from L1 then knows it is not this one.
        let Some(holding) = self.inner.l1.replace(key.hash(), entry.clone(), older) else {
            return false;
        };
        self.inner.uncacheable.invalidate(&key.hash());
        match (&self.inner.l2, late) {
            (Some(l2), Some(late)) => l2.put_unless_newer(key, &entry, l2_ttl, tags, late),
            (Some(l2), None) => l2.put(key, &entry, l2_ttl, tags),
            (None, _) => {}
        }
        self.inner.retag(key.hash(), &holding, old.as_ref(), tags);
        true
    }

    /// Stores `entry`, a renewal of `read`, under its own tags: in L1 only
    /// while it holds `read`'s fill, in L2 only while the tier holds that
    /// fill (see
    /// [`Tier::put_over`](crate::Tier::put_over)). A fill stored meanwhile,
    /// here or by another instance, stays. Whether L1 took it.
    pub(crate) fn insert_over(
        &self,
        key: &CacheKey,
        entry: Entry,
        l2_ttl: Duration,
        read: &Entry,
    ) -> bool {
        let hash = key.hash();
        let mut old = None;
        // Never over nothing: an entry gone meanwhile may have been taken
        // out (a delete again's drop is no journal record). Over another
        // fill, nowhere: it is newer than what was read.
        let mut other_fill = false;
        let unchanged = |live: Option<&Entry>| {
            old = live.cloned();
            let same = live.map(|live| live.same_fill(read));
            other_fill = same == Some(false);
            same == Some(true)
        };
        let in_l1 = self.inner.l1.replace(hash, entry.clone(), unchanged);
        if other_fill {
            return false;
        }
        // L1 holding nothing (moka refused or evicted the copy) still
        // renews the shared tier's fill, which never sets over nothing.
        if let Some(l2) = &self.inner.l2 {
            l2.put_over(key, &entry, l2_ttl, entry.tags(), read);
        }
        let Some(holding) = in_l1 else {
            return false;
        };
        self.inner.uncacheable.invalidate(&hash);
        self.inner.retag(hash, &holding, old.as_ref(), entry.tags());
        true
    }
}
