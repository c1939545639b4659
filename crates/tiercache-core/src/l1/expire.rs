//! An instance that cannot hear the fleet: every entry must ask the origin
//! again, what stale-if-error and validators keep stays.

use std::time::SystemTime;

use moka::ops::compute::{CompResult, Op};

use super::{Held, Holding, L1};
use crate::{Entry, KeyHash};

impl L1 {
    /// Makes every entry need the origin again as of `now`: its fresh and
    /// stale-while-revalidate windows end now, and what its stale-if-error
    /// window and validators keep stays (a scan of the whole cache). Each
    /// rewritten entry is a new fill to the tag index: returned with its
    /// holding, for the caller to record (under the journal's lock, which
    /// keeps an invalidation from landing between a read and its put).
    pub(crate) fn expire_all(&self, now: SystemTime) -> Vec<(KeyHash, Holding, Entry)> {
        let mut rewritten = Vec::new();
        for (hash, held) in self.cache.iter() {
            let Some(entry) = held.entry() else {
                continue;
            };
            let old = entry.times();
            let mut times = old;
            if times.stale_until <= now {
                continue;
            }
            // Only the entry seen: a newer fill under the key stays.
            let seen = |live: Option<&Entry>| live.is_some_and(|live| live.ptr_eq(&entry));
            if old.hard_until <= old.fresh_until {
                // No window past its fresh time: nothing left to keep.
                self.remove_if(&hash, |live| seen(Some(live)));
                continue;
            }
            times.fresh_until = old.fresh_until.min(now);
            times.stale_until = now;
            // Without a stale-if-error window of its own (none asked, or
            // the origin forbade stale answers), it gets none now either.
            if old.error_until <= old.fresh_until {
                times.error_until = times.fresh_until;
            }
            // Put as a compute, not through `put_if`: the weight and the
            // hard expiry are the entry's own, so neither the budget's
            // settling nor the expiry index has anything new to count.
            let held = Held::new(entry.with_times(times));
            let holding = held.holding();
            let result = self.cache.entry(*hash).and_compute_with(|live| {
                if seen(live.and_then(|live| live.value().entry()).as_ref()) {
                    Op::Put(held)
                } else {
                    Op::Nop
                }
            });
            if matches!(result, CompResult::ReplacedWith(_)) {
                rewritten.push((*hash, holding, entry));
            }
        }
        self.epochs.moved_all();
        rewritten
    }
}
