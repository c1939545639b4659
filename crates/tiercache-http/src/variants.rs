//! The `Vary` variants stored per URL, capped.
//!
//! The entry at a URL's primary key is its latest response; each variant is
//! also stored under its own key (the primary key plus the variant), so
//! `Accept-Encoding: gzip` and `br` clients both hit. This process remembers
//! which variant keys it stored per URL, to cap them (a request header
//! with endless values cannot grow the cache without bound) and to
//! invalidate them all.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tiercache_core::{CacheKey, KeyHash};

/// Variant keys per primary key.
#[derive(Debug, Clone)]
pub(crate) struct Variants {
    by_primary: moka::sync::Cache<KeyHash, Arc<Mutex<Vec<CacheKey>>>>,
}

impl Variants {
    /// Most bytes of variant bookkeeping kept (its own bound, beside L1's):
    /// past it the least used URLs' lists are forgotten (their variants
    /// then expire by their ttl, and a new list starts empty; invalidation
    /// still reaches them, by the URL's family tag).
    pub(crate) const MAX_BUDGET: u64 = 16 * 1024 * 1024;
    /// What one tracked key costs, beyond its bytes (the key's `Bytes` and
    /// its slot in the vector).
    const PER_KEY: u32 = 96;
    /// What one URL's list costs (moka's node, the shared list and its
    /// vector's spare room; a flood of 1 KiB responses with `Vary` held
    /// ~520 bytes a URL with one variant).
    const PER_LIST: u32 = 400;

    /// The bookkeeping for an L1 of `l1_capacity` bytes: a 32nd of it
    /// (between 64 KiB and 16 MiB), so with `Vary` the process still holds
    /// about its L1 budget (a fixed 16 MiB was half again a 32 MiB budget).
    pub(crate) fn for_l1(l1_capacity: u64) -> Self {
        Self::new((l1_capacity / 32).clamp(64 * 1024, Self::MAX_BUDGET))
    }

    pub(crate) fn new(budget: u64) -> Self {
        Self {
            by_primary: moka::sync::Cache::builder()
                .max_capacity(budget)
                // Weighed when stored: an empty list, then re-weighed on
                // each admit (by re-inserting), so the budget holds.
                .weigher(|_, set: &Arc<Mutex<Vec<CacheKey>>>| {
                    let set = set.lock().unwrap_or_else(|e| e.into_inner());
                    set.iter()
                        .map(|k| k.full().len() as u32 + Self::PER_KEY)
                        .sum::<u32>()
                        .saturating_add(Self::PER_LIST)
                })
                .time_to_idle(Duration::from_secs(3600))
                .build(),
        }
    }

    /// Whether `variant` may be stored for `primary`: it is known already, or
    /// fewer than `cap` of the variants are still alive (`alive` tells: a
    /// variant whose entry expired or was evicted frees its slot).
    /// Admitted variants are remembered.
    pub(crate) fn admit(
        &self,
        primary: &CacheKey,
        variant: &CacheKey,
        cap: usize,
        alive: impl Fn(&CacheKey) -> bool,
    ) -> bool {
        let list = self.by_primary.get_with(primary.hash(), Default::default);
        {
            let mut set = list.lock().unwrap_or_else(|e| e.into_inner());
            if set.contains(variant) {
                return true;
            }
            if set.len() >= cap {
                set.retain(|k| alive(k));
            }
            if set.len() >= cap {
                return false;
            }
            set.push(variant.clone());
        }
        // Re-weighed with its new member.
        self.by_primary.insert(primary.hash(), list);
        true
    }

    /// Forgets and returns the variant keys stored for `primary`.
    pub(crate) fn take(&self, primary: &CacheKey) -> Vec<CacheKey> {
        match self.by_primary.remove(&primary.hash()) {
            Some(set) => std::mem::take(&mut *set.lock().unwrap_or_else(|e| e.into_inner())),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_new_variants_but_readmits_known_ones() {
        let variants = Variants::new(Variants::MAX_BUDGET);
        let page = CacheKey::new("/page");
        let v = |i: u32| page.with_part(&i.to_le_bytes());
        let alive = |_: &CacheKey| true;
        assert!((0..3).all(|i| variants.admit(&page, &v(i), 3, alive)));
        assert!(!variants.admit(&page, &v(3), 3, alive));
        assert!(variants.admit(&page, &v(1), 3, alive));
        assert_eq!(variants.take(&page).len(), 3);
        assert!(variants.admit(&page, &v(3), 3, alive));
    }

    /// Layers built apart on one engine (a proxy's routes, an app's
    /// routers) keep one bookkeeping within one bound: each had its own,
    /// a 32nd of L1's budget apiece against the one 32nd carved out.
    #[test]
    fn layers_built_apart_on_one_engine_share_one_bookkeeping() {
        let engine = tiercache_core::TieredCache::builder()
            .sweep_interval(None)
            .build()
            .unwrap();
        let a = crate::ResponseCacheLayer::new(engine.clone());
        let b = crate::ResponseCacheLayer::new(engine);
        let page = CacheKey::new("/page");
        assert!(
            a.variants
                .admit(&page, &page.with_part(b"gzip"), 3, |_| true)
        );
        assert_eq!(b.variants.take(&page).len(), 1, "b knows what a stored");
        let other = tiercache_core::TieredCache::builder()
            .sweep_interval(None)
            .build()
            .unwrap();
        let c = crate::ResponseCacheLayer::new(other);
        assert!(a.variants.admit(&page, &page.with_part(b"br"), 3, |_| true));
        assert!(c.variants.take(&page).is_empty(), "another engine's own");
    }

    #[test]
    fn variants_whose_entries_are_gone_free_their_slots() {
        let variants = Variants::new(Variants::MAX_BUDGET);
        let page = CacheKey::new("/page");
        let v = |i: u32| page.with_part(&i.to_le_bytes());
        assert!((0..3).all(|i| variants.admit(&page, &v(i), 3, |_| true)));
        // v(0) expired: its slot goes to the newcomer.
        let gone = v(0);
        assert!(variants.admit(&page, &v(3), 3, |k| *k != gone));
        assert!(!variants.admit(&page, &v(4), 3, |_| true));
    }
}
