//! The engine's tag index: it follows L1, stays within its room, and
//! reaches every live key under a tag.

use crate::tests::{TTL, engine};
use crate::*;

/// The key of the `i`th entry a test stores.
fn key(i: u32) -> CacheKey {
    CacheKey::new(i.to_le_bytes())
}

/// A policy of the test's ttl under `tag` alone.
fn own_tag(tag: &str) -> Policy {
    Policy::ttl(TTL).tag(tag.to_owned()).build().unwrap()
}

/// Stores `n` entries in turn (the `i`th under `policy(i)`), with at most
/// `live` of them in L1 at once: the older ones leave it (evicted or
/// expired; here dropped by hand).
fn churn(cache: &TieredCache, n: u32, live: u32, policy: impl Fn(u32) -> Policy) {
    for i in 0..n {
        cache.put(&key(i), Value::from_body("v"), &policy(i));
        if i >= live {
            cache.forget_local(&key(i - live));
        }
    }
}

/// A tag stored with many keys reaches every one of them.
#[tokio::test]
async fn a_tag_past_the_index_bound_still_reaches_every_key() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let tagged = Policy::ttl(TTL).tag("wide").build().unwrap();
    let keys: Vec<CacheKey> = (0..200).map(key).collect();
    for key in &keys {
        cache.put(key, Value::from_body("v"), &tagged);
    }
    cache.invalidate_tag("wide").await.unwrap();
    assert!(keys.iter().all(|k| !cache.l1_contains(k)));
}

/// A tag's index kept the keys of entries L1 had dropped: past a bound
/// (64 then) the tag was marked overflowed, and its next invalidation
/// dropped all of L1, though only a few of its keys were still alive.
#[tokio::test]
async fn a_tag_whose_keys_left_l1_does_not_overflow_into_dropping_all_of_l1() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let tagged = Policy::ttl(TTL).tag("route").build().unwrap();
    let plain = Policy::ttl(TTL).build().unwrap();
    let home = CacheKey::new("home");
    cache.put(&home, Value::from_body("home"), &plain);
    // 300 keys stored under the tag over time, at most 40 alive at once.
    churn(&cache, 300, 40, |_| tagged.clone());
    cache.invalidate_tag("route").await.unwrap();
    assert!(
        (260..300).all(|i| !cache.l1_contains(&key(i))),
        "a live tagged key survived"
    );
    assert!(
        cache.l1_contains(&home),
        "the tag's invalidation dropped all of L1"
    );
}

/// Every `Vary`ing URL has a tag of its own: a crawl of unique URLs grew
/// the tag index by one tag each, outside the L1 budget, until its bound
/// pushed tags out and the next tag invalidation dropped all of L1. Tags
/// whose keys left L1 leave the index.
#[tokio::test]
async fn the_tag_index_follows_l1_through_a_crawl_of_unique_tags() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    // L1 holds 100 of them at a time.
    churn(&cache, 5_000, 100, |i| own_tag(&format!("url-{i}")));
    let inner = cache.inner_for_tests();
    let tags = inner.tags.len();
    assert!(
        tags <= 100 + 100 / 4 + 1024,
        "{tags} tags held for 100 live entries"
    );
    // The live ones are still reached by their tags.
    cache.invalidate_tag("url-4999").await.unwrap();
    assert!(!cache.l1_contains(&key(4_999)));
    assert!(cache.l1_contains(&key(4_998)));
}

/// Stale records (of keys L1 had dropped) could use up the room all tags
/// share before a prune came (it came at a quarter past the last live
/// count, which may be past the room): every tag recorded then was marked
/// overflowed, and its invalidation dropped all of L1. Prunes come before
/// the room runs out.
#[tokio::test]
async fn stale_tag_records_never_use_up_the_room_of_live_ones() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let plain = Policy::ttl(TTL).build().unwrap();
    let home = CacheKey::new("home");
    cache.put(&home, Value::from_body("home"), &plain);
    // 850 live at a time, each under a tag of its own.
    churn(&cache, 5_000, 850, |i| own_tag(&format!("t{i}")));
    cache.invalidate_tag("t4999").await.unwrap();
    assert!(!cache.l1_contains(&key(4_999)));
    assert!(
        cache.l1_contains(&key(4_998)),
        "a live key of another tag went"
    );
    assert!(
        cache.l1_contains(&home),
        "the tag's invalidation dropped all of L1"
    );
}

/// A tag with more live keys than one tag's set used to keep (64 here) was
/// marked overflowed, and its invalidation dropped all of L1, the entries
/// of every other tag with it. A tag's set holds all its live keys (each
/// weighed in L1), so the invalidation drops those and nothing else.
#[tokio::test]
async fn a_tag_with_many_live_keys_drops_only_its_own() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let plain = Policy::ttl(TTL).build().unwrap();
    let home = CacheKey::new("home");
    cache.put(&home, Value::from_body("home"), &plain);
    churn(&cache, 200, 200, |_| own_tag("wide"));
    cache.invalidate_tag("wide").await.unwrap();
    assert!((0..200).all(|i| !cache.l1_contains(&key(i))));
    assert!(
        cache.l1_contains(&home),
        "the tag's invalidation dropped all of L1"
    );
}

/// The records all tags share had a fixed room (1,000 here, 1 M in a
/// release build), less than L1 can hold: with L1 holding more tagged
/// entries than that, each tag first seen was marked overflowed, and never
/// pruned, so its invalidation dropped all of L1 long after. The room
/// follows L1's budget (every record is weighed there).
#[tokio::test]
async fn a_tag_recorded_while_l1_holds_many_tagged_entries_drops_only_its_own() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let plain = Policy::ttl(TTL).build().unwrap();
    let home = CacheKey::new("home");
    cache.put(&home, Value::from_body("home"), &plain);
    // 1,500 tagged entries alive at once, each under a tag of its own.
    churn(&cache, 1_500, 1_500, |i| own_tag(&format!("t{i}")));
    let late = CacheKey::new("late");
    cache.put(&late, Value::from_body("late"), &own_tag("late"));
    // They all leave L1, and the index is pruned.
    (0..1_500).for_each(|i| cache.forget_local(&key(i)));
    cache.sweep();
    cache.invalidate_tag("late").await.unwrap();
    assert!(!cache.l1_contains(&late));
    assert!(
        cache.l1_contains(&home),
        "the tag's invalidation dropped all of L1"
    );
}

/// The tag index follows L1 but lies outside it: a `Vary`ing URL's two
/// entries share a tag of their own (~500 bytes in the index), and a flood
/// of them held 1.20x a 32 MiB budget. An entry stored under tags weighs
/// its records there too.
#[tokio::test]
async fn an_entry_stored_under_tags_weighs_its_records_in_the_tag_index() {
    let clock = MockClock::new();
    let plain = engine(&clock);
    let tagged = engine(&clock);
    let key = CacheKey::new("k");
    plain.put(
        &key,
        Value::from_body("v"),
        &Policy::ttl(TTL).build().unwrap(),
    );
    let policy = Policy::ttl(TTL).tag("a").tag("bb").build().unwrap();
    tagged.put(&key, Value::from_body("v"), &policy);
    let more = tagged.l1_weighted_size() - plain.l1_weighted_size();
    assert_eq!(more, 2 * 250 + 1 + 2, "{more} bytes more for two tags");
}

/// Two engines sharing an in-memory L2 (one writes, the other reads).
fn sharing_l2() -> (TieredCache, TieredCache) {
    let build = crate::tests::on_shared_l2(&MockClock::new());
    (build(), build())
}

/// A copy promoted from L2 is recorded under the tags it was stored with,
/// as a fill of this instance's own is: its own invalidation of one of
/// them drops it from L1. (The tag's set is in the shared tier, which may
/// not answer: then only this index reaches the copy.)
#[tokio::test]
async fn a_promoted_copy_is_reached_by_this_instances_own_tag_invalidation() {
    let (writer, reader) = sharing_l2();
    let (tagged, untagged) = (key(1), key(2));
    writer.put(&tagged, Value::from_body("v"), &own_tag("reports"));
    writer.put(&untagged, Value::from_body("v"), &own_tag("other"));
    assert!(reader.get(&tagged).await.is_some(), "promoted");
    assert!(reader.get(&untagged).await.is_some(), "promoted");
    reader.invalidate_tag("reports").await.unwrap();
    assert!(
        reader.get(&tagged).await.is_none(),
        "the promoted copy outlived its tag's invalidation in this instance"
    );
    assert!(
        reader.get(&untagged).await.is_some(),
        "another tag's copy stays"
    );
}

/// `touch` stores the entry again with its lifetime renewed: under every
/// tag it had (a fill's own, not only the policy's), so a copy another
/// instance promotes is still reached by their invalidation.
#[tokio::test]
async fn a_touched_entry_keeps_its_fills_own_tags() {
    let (writer, reader) = sharing_l2();
    let plain = Policy::ttl(TTL).build().unwrap();
    let k = key(1);
    let fill = crate::Fill::new(Value::from_body("v")).tags(vec!["surrogate".into()]);
    writer.store_now(&k, fill, &plain);
    assert!(writer.touch(&k, &plain).await, "a fresh value to touch");
    assert!(reader.get(&k).await.is_some(), "promoted");
    reader.invalidate_tag("surrogate").await.unwrap();
    assert!(
        reader.get(&k).await.is_none(),
        "the touched copy lost its fill's tag"
    );
}

/// The policy's tags apply to whatever the engine stores under it: a value
/// `get_or_load` loaded, as well as one `put` stored.
#[tokio::test]
async fn a_loaded_value_carries_the_policys_tags() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let policy = own_tag("products");
    let loaded = cache
        .get_or_load(&key(1), &policy, || async {
            Ok::<_, std::convert::Infallible>(Value::from_body("v"))
        })
        .await
        .unwrap();
    assert_eq!(loaded.body, "v");
    assert!(cache.exists(&key(1)).await);
    cache.invalidate_tag("products").await.unwrap();
    assert!(
        !cache.exists(&key(1)).await,
        "the tag's invalidation missed a loaded value"
    );
}

/// A key stored again under other tags (an origin's surrogate keys that
/// name a version) stayed recorded under its old ones as long as it lived:
/// an invalidation of an old tag dropped the new entry, and the records,
/// weighed by no entry, grew with every new tag.
#[tokio::test]
async fn a_key_stored_again_under_other_tags_leaves_its_old_ones() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let k = key(1);
    for version in 0..100 {
        cache.put(&k, Value::from_body("v"), &own_tag(&format!("v{version}")));
    }
    cache.invalidate_tag("v0").await.unwrap();
    assert!(
        cache.l1_contains(&k),
        "an old tag's invalidation dropped it"
    );
    cache.sweep();
    let inner = cache.inner_for_tests();
    assert_eq!(inner.tags.len(), 1, "records left under old tags");
    cache.invalidate_tag("v99").await.unwrap();
    assert!(!cache.l1_contains(&k));
}

/// A key whose entry died (removed on a read past its hard expiry) and was
/// stored again under another tag kept its record under the old one, and
/// an invalidation of the old tag dropped the new entry. A tag's
/// invalidation drops only entries that carry it.
#[tokio::test]
async fn a_tag_invalidation_spares_a_refill_under_other_tags() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let k = key(1);
    let short = Policy::ttl(TTL).jitter(0.0).tag("old").build().unwrap();
    cache.put(&k, Value::from_body("v1"), &short);
    clock.advance(TTL * 2);
    assert!(
        cache.get(&k).await.is_none(),
        "dead, and removed on the read"
    );
    cache.put(&k, Value::from_body("v2"), &own_tag("new"));
    cache.invalidate_tag("old").await.unwrap();
    assert_eq!(
        cache.get(&k).await.map(|v| v.body),
        Some("v2".into()),
        "the old tag's invalidation dropped the refill"
    );
}

/// A key whose entry died before each refill (removed on a read past its
/// hard expiry), stored each time under a tag of its own (a surrogate key
/// naming a version): its records under the old tags stayed while the key
/// lived (a prune kept a record whose key L1 held), one more a cycle.
#[tokio::test]
async fn a_key_refilled_after_its_entry_died_leaves_no_records_under_old_tags() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let k = key(1);
    for version in 0..50 {
        let policy = Policy::ttl(TTL)
            .jitter(0.0)
            .tag(format!("v{version}"))
            .build()
            .unwrap();
        cache.put(&k, Value::from_body("v"), &policy);
        clock.advance(TTL * 2);
        assert!(cache.get(&k).await.is_none(), "dead, removed on the read");
    }
    cache.put(&k, Value::from_body("v"), &own_tag("now"));
    cache.sweep();
    let inner = cache.inner_for_tests();
    assert_eq!(inner.tags.len(), 1, "records left under old tags");
    cache.invalidate_tag("now").await.unwrap();
    assert!(!cache.l1_contains(&k));
}

/// A record names the fill it was made for: a key stored again under the
/// same tag (a refill, a touch) must move its record to the new fill, or
/// a prune takes the record with the old fill and the tag's invalidation
/// misses the live entry.
#[tokio::test]
async fn a_key_stored_again_under_the_same_tag_stays_reached_by_it() {
    let clock = MockClock::new();
    let cache = engine(&clock);
    let (refilled, touched) = (key(1), key(2));
    let tagged = own_tag("t");
    for k in [&refilled, &touched] {
        cache.put(k, Value::from_body("v1"), &tagged);
    }
    cache.put(&refilled, Value::from_body("v2"), &tagged);
    assert!(cache.touch(&touched, &tagged).await);
    cache.sweep();
    cache.invalidate_tag("t").await.unwrap();
    assert!(!cache.l1_contains(&refilled), "the refill was missed");
    assert!(!cache.l1_contains(&touched), "the touched entry was missed");
}
