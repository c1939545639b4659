//! Reads: L1 with its freshness and XFetch, L2 with promotion under the
//! server's remaining TTL.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime};

use rand::Rng;

use super::TieredCache;
use super::journal::Footprint;
use crate::stats::bump;
use crate::{Answer, CacheKey, Entry, Freshness, Policy, Select, Served, Source};

/// What L1 holds for a request.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// A fresh entry: answer it (`refresh`: XFetch fired).
    Fresh {
        entry: Entry,
        remaining: Duration,
        refresh: bool,
    },
    /// Stale, inside stale-while-revalidate: answer it and refresh.
    Stale { entry: Entry },
    /// Fresh, but it must be revalidated before any use (`no-cache`).
    Revalidate { entry: Entry },
    /// Nothing to answer with. `fallback`: a stale entry inside
    /// stale-if-error, or one to revalidate.
    Miss { fallback: Option<Entry> },
}

impl TieredCache {
    /// The L1 entry under `key` that `select` accepts, whatever its
    /// freshness (dead ones excepted), without counting anything.
    pub(crate) fn peek(&self, key: &CacheKey, now: SystemTime) -> Option<Entry> {
        self.inner
            .l1
            .get(&key.hash(), now)
            .filter(|e| e.key() == key.full())
    }

    /// Looks `key` up in L1 as of `now`. A dead entry is removed (lazy
    /// expiry). An entry `select` refuses is a miss. A fresh entry is an L1
    /// hit (counted), with `refresh` set when XFetch fires; a stale one
    /// inside stale-while-revalidate is [`Lookup::Stale`]; past that but
    /// inside stale-if-error it comes back as the miss's fallback.
    pub(crate) fn lookup_at(
        &self,
        key: &CacheKey,
        now: SystemTime,
        policy: &Policy,
        select: &impl Select,
    ) -> Lookup {
        let Some(entry) = self.peek(key, now) else {
            return Lookup::Miss { fallback: None };
        };
        if !select.accepts(&entry) {
            return Lookup::Miss { fallback: None };
        }
        match entry.freshness(now) {
            // Deaf (see `InvalidationSink::deaf`): read again from the
            // tier, which holds what this instance may not have heard.
            Freshness::Fresh(_) | Freshness::Stale if self.deaf_to_the_fleet() => Lookup::Miss {
                fallback: Some(entry),
            },
            Freshness::Fresh(_) if select.must_revalidate(&entry) => Lookup::Revalidate { entry },
            Freshness::Fresh(remaining) => {
                bump(&self.inner.counters.hits_l1);
                let refresh = self.xfetch_fires(&entry, remaining, policy.beta());
                Lookup::Fresh {
                    entry,
                    remaining,
                    refresh,
                }
            }
            Freshness::Stale => Lookup::Stale { entry },
            // Inside stale-if-error it may stand in for a failing origin;
            // expired, it only lends its validators to the origin call.
            Freshness::StaleIfError | Freshness::Expired => Lookup::Miss {
                fallback: Some(entry),
            },
            Freshness::Dead => Lookup::Miss { fallback: None },
        }
    }

    /// Whether this instance cannot hear the fleet's invalidations while
    /// the shared tier still answers: an L1 copy may be one another
    /// instance's acknowledged write replaced. With the tier not answering
    /// either (its breaker open), L1 answers on: a write elsewhere then
    /// waits for Valkey too, and `unheard` bounds what is missed.
    #[inline]
    pub(super) fn deaf_to_the_fleet(&self) -> bool {
        self.inner.deaf.load(Relaxed) && self.inner.l2.as_ref().is_some_and(|l2| l2.available())
    }

    /// A fresh L1 entry under `key` that `select` accepts as it is, as an
    /// L1 hit (counted) for a request that waited on a flight: one joining
    /// again, whose key another request may have stored meanwhile.
    pub(crate) fn l1_answer(
        &self,
        key: &CacheKey,
        policy: &Policy,
        select: &impl Select,
    ) -> Option<Answer> {
        match self.lookup_at(key, self.now(), policy, select) {
            Lookup::Fresh { entry, .. } => Some(Answer {
                entry,
                source: Source::L1,
                served: Served::Hit,
                collapsed: true,
            }),
            _ => None,
        }
    }

    /// XFetch (Vattani et al., VLDB 2015): fire when `δ·β·(−ln u) ≥ remaining`,
    /// `u` uniform in (0, 1]. The probability is `exp(−remaining/(δβ))`; far
    /// from expiry it is below 1e-17 and no random number is drawn.
    fn xfetch_fires(&self, entry: &Entry, remaining: Duration, beta: f64) -> bool {
        let scale = entry.origin_latency().as_secs_f64() * beta;
        if scale <= 0.0 || remaining.as_secs_f64() > 40.0 * scale {
            return false;
        }
        let u: f64 = 1.0
            - self
                .inner
                .rng
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .random::<f64>();
        scale * -u.ln() >= remaining.as_secs_f64()
    }

    /// Reads `key` from the shared tier, if there is one; a fresh hit that
    /// `accept` agrees with is promoted to L1 for no longer than the tier's
    /// remaining TTL, unless an invalidation since `epoch` covers it. Tier
    /// errors are counted and read as a miss.
    pub(crate) async fn lookup_l2(
        &self,
        key: &CacheKey,
        epoch: u64,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Option<Entry> {
        self.lookup_l2_within(key, epoch, accept, false).await
    }

    /// [`lookup_l2`](Self::lookup_l2), also taking a copy inside its
    /// stale-while-revalidate window when `stale_ok`.
    pub(crate) async fn lookup_l2_within(
        &self,
        key: &CacheKey,
        epoch: u64,
        accept: impl FnOnce(&Entry) -> bool,
        stale_ok: bool,
    ) -> Option<Entry> {
        let l2 = self.inner.l2.as_ref()?;
        let hit = match l2.get(key).await {
            Ok(Some(hit)) => hit,
            Ok(None) => return None,
            Err(e) => {
                bump(&self.inner.counters.l2_errors);
                if e.is_timeout() {
                    bump(&self.inner.counters.l2_timeouts);
                }
                return None;
            }
        };
        let now = self.now();
        let usable = match hit.entry.freshness(now) {
            Freshness::Fresh(_) => true,
            Freshness::Stale => stale_ok,
            _ => false,
        };
        if hit.entry.key() != key.full()
            || !usable
            || !accept(&hit.entry)
            // Invalidated here, and the shared tier has not heard yet.
            || self
                .inner
                .outbox
                .covers(key, hit.entry.times().created_at, hit.entry.tags())
        {
            return None;
        }
        let until = now
            .checked_add(hit.remaining)
            .unwrap_or(hit.entry.times().hard_until);
        // Numbered as a load ending now: a slower load of this instance
        // still in flight does not replace it (see `Entry::load`).
        let promoted = hit
            .entry
            .with_times(hit.entry.times().capped(until))
            .loaded_by(self.inner.journal.next_load());
        let hashes = [key.hash()];
        let fulls = [key.full().as_ref()];
        // Not by its tags: a fleet waiter reads with its fill's epoch, from
        // before its wait, and an invalidation of a route-wide tag during
        // the wait would refuse the entry the holder just stored. A pending
        // tag invalidation is checked by the outbox above (by tag).
        let footprint = Footprint {
            hashes: &hashes,
            fulls: &fulls,
            tags: &[],
        };
        // Read before an invalidation landed: the copy may be the one it
        // removed. Recorded under its tags, as a fill is: this instance's
        // own tag invalidations then reach it too, Valkey down or not.
        // Only over nothing fresh: L1 had nothing fresh when it was asked
        // (else no read), so a fresh entry there now was stored while the
        // read was on its way, and is as new as its answer or newer.
        self.inner
            .journal
            .unless_overtaken(epoch, &footprint, || {
                let mut old = None;
                // Nor over a stale one created after it (a fill stale from
                // its start, or stored stale from a refresh's failure).
                let unfresh = |live: Option<&Entry>| {
                    old = live.cloned();
                    live.is_none_or(|live| {
                        !matches!(live.freshness(now), Freshness::Fresh(_))
                            && live.created_ms() <= promoted.created_ms()
                    })
                };
                if let Some(holding) = self.inner.l1.replace(key.hash(), promoted.clone(), unfresh)
                {
                    let tags = promoted.tags();
                    self.inner.retag(key.hash(), &holding, old.as_ref(), tags);
                }
            })
            .ok()?;
        self.inner.prune_tags_if_due();
        Some(promoted)
    }

    /// The L2 entry that may answer a request: under `key`; when that is
    /// another variant, under the key its variant names give (the latest
    /// under `key` is promoted either way, so the next request finds the
    /// names in L1).
    pub(crate) async fn read_l2(
        &self,
        requested: &CacheKey,
        flight: &CacheKey,
        epoch: u64,
        select: &impl Select,
        stale_ok: bool,
    ) -> Option<Entry> {
        if flight != requested {
            return self
                .lookup_l2_within(flight, epoch, |e| select.accepts(e), stale_ok)
                .await;
        }
        let latest = self
            .lookup_l2_within(requested, epoch, |_| true, stale_ok)
            .await?;
        if select.accepts(&latest) {
            return Some(latest);
        }
        let key = select.variant_key(requested, &latest)?;
        self.lookup_l2_within(&key, epoch, |e| select.accepts(e), stale_ok)
            .await
    }
}
