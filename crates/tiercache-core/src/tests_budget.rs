//! L1's byte budget: what it holds stays within it, evicted bodies are
//! freed at once, and its bookkeeping follows the entries.

use std::sync::Arc;

use crate::tests::{TTL, fill};
use crate::*;

#[tokio::test]
async fn byte_budget_evicts_and_counts_it() {
    let cache = TieredCache::builder()
        .l1_capacity(1024 * 1024)
        .sweep_interval(None)
        .build()
        .unwrap();
    let body = "x".repeat(10 * 1024);
    for i in 0..1_000u32 {
        cache.store_now(
            &CacheKey::new(i.to_le_bytes()),
            fill(&body),
            &Policy::ttl(TTL).build().unwrap(),
        );
    }
    assert!(cache.l1_weighted_size() <= 1024 * 1024);
    let stats = cache.stats();
    assert!(stats.evicted > 0, "{stats:?}");
    assert_eq!(stats.expired, 0);
}

/// Counts the stored bodies still alive (each drops its count with it).
struct CountedBody {
    bytes: Vec<u8>,
    live: Arc<std::sync::atomic::AtomicUsize>,
}

impl AsRef<[u8]> for CountedBody {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        self.live.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Stores 400 bodies of 64 KiB, one by one, in an L1 of a 4 MiB budget;
/// asserts the bodies alive at once never weighed past the budget (and a
/// sixteenth).
fn store_bodies_within_the_budget() {
    const BUDGET: u64 = 4 * 1024 * 1024;
    const BODY: usize = 64 * 1024;
    let cache = TieredCache::builder()
        .l1_capacity(BUDGET)
        .sweep_interval(None)
        .build()
        .unwrap();
    let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let policy = Policy::ttl(TTL).build().unwrap();
    let mut most = 0;
    for i in 0..400u32 {
        live.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let body = bytes::Bytes::from_owner(CountedBody {
            bytes: vec![b'x'; BODY],
            live: live.clone(),
        });
        cache.store_now(
            &CacheKey::new(i.to_le_bytes()),
            Fill::new(Value::from_body(body)),
            &policy,
        );
        most = most.max(live.load(std::sync::atomic::Ordering::SeqCst));
    }
    let held = (most * BODY) as u64;
    assert!(
        held <= BUDGET + BUDGET / 16,
        "up to {most} bodies of {BODY} B were held at once for a {BUDGET} B budget"
    );
}

#[tokio::test]
async fn large_bodies_never_pile_up_past_the_budget_between_evictions() {
    // moka evicts only when it runs its housekeeping, after 64 or more
    // writes on its own: with 64 KiB bodies that held up to twice this
    // budget at once, and the allocator keeps such a peak as RSS.
    store_bodies_within_the_budget();
}

#[tokio::test]
async fn evicted_bodies_are_freed_while_another_thread_is_inside_the_cache() {
    // moka frees a removed record only once every thread has left the
    // epoch it was removed in: a thread descheduled inside any moka call
    // (here: pinned for the whole run) held back every body evicted
    // meanwhile, 400 bodies of 64 KiB for a budget of 64.
    let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let parked = std::thread::spawn(move || {
        let _inside = crossbeam_epoch::pin();
        pinned_tx.send(()).unwrap();
        let _ = done_rx.recv();
    });
    pinned_rx.recv().unwrap();
    // Let go of the pinned thread even when the assertion fails.
    let stored = std::panic::catch_unwind(store_bodies_within_the_budget);
    done_tx.send(()).unwrap();
    parked.join().unwrap();
    if let Err(failed) = stored {
        std::panic::resume_unwind(failed);
    }
}

#[tokio::test]
async fn a_flood_of_unique_keys_keeps_l1_and_its_index_bounded() {
    // A clock apart from the machine's: only then does L1 keep an index.
    let cache = TieredCache::builder()
        .clock(MockClock::new())
        .l1_capacity(4 * 1024 * 1024)
        .sweep_interval(None)
        .build()
        .unwrap();
    let policy = Policy::ttl(TTL).build().unwrap();
    let body = "x".repeat(1000);
    for i in 0..200_000u32 {
        cache.store_now(&CacheKey::new(i.to_le_bytes()), fill(&body), &policy);
    }
    assert!(cache.l1_weighted_size() <= 4 * 1024 * 1024);
    let entries = cache.l1_entry_count() as usize;
    assert!(cache.l1_index_records() > 0, "the index is kept");
    assert!(
        cache.l1_index_records() <= 2 * entries + 4096 + 1,
        "{} records for {entries} entries",
        cache.l1_index_records()
    );
}

/// The hit-for-miss marks share the budget: a flood of keys that may not
/// be stored leaves at most a 32nd of it in marks (they had a count of
/// their own, 100,000 marks of ~330 bytes: a whole 32 MiB budget beside a
/// full L1), and L1 gets the rest.
#[test]
fn hit_for_miss_marks_hold_a_32nd_of_the_budget() {
    let budget = 32 * 1024 * 1024;
    let cache = TieredCache::builder()
        .l1_capacity(budget)
        .sweep_interval(None)
        .build()
        .unwrap();
    let policy = Policy::ttl(TTL).build().unwrap();
    for i in 0..20_000 {
        cache.mark_uncacheable(&CacheKey::new(format!("/private/{i}")), &policy);
    }
    let marks = &cache.inner_for_tests().uncacheable;
    marks.run_pending_tasks();
    let held = marks.weighted_size();
    assert!(held <= budget / 32, "marks hold {held} bytes");
    assert!(
        marks.entry_count() >= 3_000,
        "a 32nd holds ~3,100 marks: {}",
        marks.entry_count()
    );
    assert_eq!(cache.l1_capacity(), budget);
    assert!(cache.inner_for_tests().l1.capacity() + held <= budget);
}
