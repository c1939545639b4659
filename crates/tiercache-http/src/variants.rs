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
    /// URLs whose variants are tracked; past that the least used are forgotten.
    const TRACKED: u64 = 65_536;

    pub(crate) fn new() -> Self {
        Self {
            by_primary: moka::sync::Cache::builder()
                .max_capacity(Self::TRACKED)
                .time_to_idle(Duration::from_secs(3600))
                .build(),
        }
    }

    /// Whether `variant` may be stored for `primary`: it is known already, or
    /// fewer than `cap` are. Admitted variants are remembered.
    pub(crate) fn admit(&self, primary: &CacheKey, variant: &CacheKey, cap: usize) -> bool {
        let set = self.by_primary.get_with(primary.hash(), Default::default);
        let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
        if set.contains(variant) {
            return true;
        }
        if set.len() >= cap {
            return false;
        }
        set.push(variant.clone());
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
        let variants = Variants::new();
        let page = CacheKey::new("/page");
        let v = |i: u32| page.with_part(&i.to_le_bytes());
        assert!((0..3).all(|i| variants.admit(&page, &v(i), 3)));
        assert!(!variants.admit(&page, &v(3), 3));
        assert!(variants.admit(&page, &v(1), 3));
        assert_eq!(variants.take(&page).len(), 3);
        assert!(variants.admit(&page, &v(3), 3));
    }
}
