//! Loads outside any flight: a key marked uncacheable (hit-for-miss), or a
//! follower whose leader's answer could not be shared.

use std::future::Future;
use std::pin::Pin;

use tokio::time::Instant;

use super::TieredCache;
use super::fetch::Keys;
use crate::stats::bump;
use crate::{
    Answer, Entry, FetchError, Fetched, Loaded, Origin, Policy, Served, Source, StaleReason,
};

/// What a fetch with origin `O` ends in.
type FetchResult<O> = Result<Fetched<<O as Origin>::Output>, FetchError<<O as Origin>::Error>>;

impl TieredCache {
    /// One origin call outside any flight (hit-for-miss, or a follower whose
    /// leader's answer could not be shared); what may be stored still is,
    /// and a usable stale `fallback` answers for a failing origin.
    ///
    /// Boxed: the origin's load is most of its future, which inline would
    /// take that room in every request's future, the followers' too.
    pub(super) fn load_alone<'a, O: Origin>(
        &'a self,
        keys: &'a Keys,
        policy: &'a Policy,
        origin: O,
        fallback: Option<Entry>,
        collapsed: bool,
        hit_for_miss: bool,
    ) -> Pin<Box<impl Future<Output = FetchResult<O>> + 'a>> {
        Box::pin(self.alone(keys, policy, origin, fallback, collapsed, hit_for_miss))
    }

    /// [`load_alone`](Self::load_alone)'s work, unboxed.
    async fn alone<O: Origin>(
        &self,
        keys: &Keys,
        policy: &Policy,
        origin: O,
        fallback: Option<Entry>,
        collapsed: bool,
        hit_for_miss: bool,
    ) -> Result<Fetched<O::Output>, FetchError<O::Error>> {
        let usable = fallback.filter(|e| self.stale_usable(e));
        let start = self.inner.journal.start();
        let (started, began) = (Instant::now(), self.now());
        let loaded = origin.load(None).await;
        let took = started.elapsed();
        let delta = self.delta_since(began, took);
        self.inner.counters.origin_load(took);
        // This request's own load: not another's answer reused, even
        // after a wait (RFC 9211's `collapsed`).
        let answer = |entry, stored| {
            let answer = Answer {
                entry,
                source: Source::Origin,
                served: Served::Miss { stored },
                collapsed: false,
            };
            bump(&self.inner.counters.misses);
            Fetched::Entry(answer)
        };
        let loaded = match (loaded, usable) {
            (Err(_), Some(stale))
            | (Ok(Loaded::Share { failed: true, .. }), Some(stale))
            | (Ok(Loaded::Pass { failed: true, .. }), Some(stale))
            | (Ok(Loaded::Busy { failed: true, .. }), Some(stale))
            | (Ok(Loaded::Failed { .. }), Some(stale)) => {
                return Ok(self.answered_stale(stale, StaleReason::OriginError, collapsed));
            }
            (loaded, _) => loaded,
        };
        match loaded.map_err(FetchError::Origin)? {
            Loaded::Store(mut fill) => {
                if fill.origin_latency_unset() {
                    fill = fill.origin_latency(delta);
                }
                let (entry, stored) = self.store_since(&keys.flight, fill, policy, start);
                Ok(answer(entry, stored == Ok(true)))
            }
            Loaded::Share { value, .. } => {
                let mut fetched = answer(self.transient(&keys.flight, value, took), false);
                if let Fetched::Entry(answer) = &mut fetched {
                    answer.served = Served::Shared;
                }
                Ok(fetched)
            }
            Loaded::Pass {
                output,
                uncacheable,
                ..
            } => {
                if uncacheable {
                    self.mark_uncacheable(&keys.requested, policy);
                }
                Ok(self.passed_alone(output, collapsed, hit_for_miss))
            }
            // Of the moment: the key is not marked.
            Loaded::Busy { output, .. } | Loaded::Failed { output } => {
                Ok(self.passed_alone(output, collapsed, hit_for_miss))
            }
        }
    }

    /// An answer loaded outside any flight that is the caller's alone.
    fn passed_alone<T>(&self, output: T, collapsed: bool, hit_for_miss: bool) -> Fetched<T> {
        if !hit_for_miss {
            bump(&self.inner.counters.misses);
        }
        Fetched::Passed {
            output,
            collapsed,
            hit_for_miss,
        }
    }
}
