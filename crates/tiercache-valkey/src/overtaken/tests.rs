use super::*;
use tiercache_core::CacheKey;

const GRACE: Duration = Duration::from_secs(2);

const PREFIX: &str = "tc";

fn cache_key(name: &str) -> CacheKey {
    CacheKey::builder()
        .part(b"shop")
        .part(name.as_bytes())
        .finish()
}

/// The entry's Valkey key, as the tier names it.
fn key(name: &str) -> String {
    crate::keys::entry_key_in(PREFIX, &cache_key(name).hash())
}

fn target(name: &str, tags: &[&str]) -> Target {
    let cache_key = cache_key(name);
    Target {
        hash: cache_key.hash(),
        full: cache_key.full().clone(),
        key: key(name),
        tags: tags.iter().map(|t| t.to_string()).collect(),
        stamp: Stamp::of(name.as_bytes()),
    }
}

fn overtaken() -> (Overtaken, mpsc::Receiver<Write>) {
    let (tx, rx) = mpsc::channel(16);
    (Overtaken::new(tx, GRACE, PREFIX.into()), rx)
}

fn deletes(rx: &mut mpsc::Receiver<Write>) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(Write::Command(Command::Delete(undo))) = rx.try_recv() {
        out.extend(undo.into_iter().map(|(key, ..)| key));
    }
    out
}

fn hold_back(o: &Overtaken, fills: &mut Vec<(u64, Target)>) -> Vec<String> {
    let (_, held) = o.hold_back(fills, |(m, t)| {
        Some((*m, t.hash, &t.full[..], t.tags.as_slice()))
    });
    held.into_iter().map(|(_, t)| t.key).collect()
}

#[test]
fn a_queued_fill_an_invalidation_covers_is_held_back() {
    let (o, _rx) = overtaken();
    let now = Instant::now();
    let queued_at = o.mark();
    o.heard(Scope::Keys(vec![target("a", &[]).hash]), now);
    o.heard(Scope::Tag("t".into(), vec![]), now);
    o.heard(
        Scope::Prefix(KeyPattern::new().part(b"shop").prefix(b"p")),
        now,
    );
    let mut fills = vec![
        (queued_at, target("a", &[])),
        (queued_at, target("b", &["t"])),
        (queued_at, target("c", &["u"])),
        (queued_at, target("pen", &[])),
        (o.mark(), target("a", &[])),
    ];
    assert_eq!(hold_back(&o, &mut fills), [key("a"), key("b"), key("pen")]);
    // "c" is not covered; the later "a" was queued after the message.
    let left: Vec<_> = fills.iter().map(|(_, t)| t.key.as_str()).collect();
    assert_eq!(left, [key("c"), key("a")]);
}

#[test]
fn a_fill_in_flight_when_the_message_came_is_deleted_after_its_answer() {
    let (o, mut rx) = overtaken();
    let now = Instant::now();
    let mut fills = vec![(o.mark(), target("a", &[]))];
    let (sent_under, held) = o.hold_back(&mut fills, |(m, t)| {
        Some((*m, t.hash, &t.full[..], t.tags.as_slice()))
    });
    assert!(held.is_empty());
    o.heard(Scope::Keys(vec![target("a", &[]).hash]), now);
    // Not sent yet as far as the module knows: nothing to delete now…
    assert!(deletes(&mut rx).is_empty());
    // …but once the pipeline is answered, delete it again, once.
    let again = o.sent(sent_under, vec![target("a", &[])], now);
    let a = target("a", &[]);
    assert_eq!(again, [(key("a"), a.stamp, a.hash)]);
    o.heard(Scope::Everything, now);
    assert!(deletes(&mut rx).is_empty(), "not remembered as sent");
}

#[test]
fn a_fill_that_landed_just_before_the_message_is_deleted_again_once() {
    let (o, mut rx) = overtaken();
    let t0 = Instant::now();
    let fills = vec![target("a", &[]), target("b", &["t"])];
    assert!(o.sent(o.mark(), fills, t0).is_empty());
    o.heard(Scope::Keys(vec![target("z", &[]).hash]), t0);
    assert!(deletes(&mut rx).is_empty(), "covers neither");
    o.heard(
        Scope::Tag("t".into(), vec![]),
        t0 + Duration::from_millis(5),
    );
    assert_eq!(deletes(&mut rx), [key("b")]);
    o.heard(
        Scope::Tag("t".into(), vec![]),
        t0 + Duration::from_millis(6),
    );
    assert!(deletes(&mut rx).is_empty(), "already deleted again");
    // Past the grace, a message no longer reaches what was sent.
    o.heard(Scope::Everything, t0 + GRACE + Duration::from_millis(1));
    assert!(deletes(&mut rx).is_empty());
}

/// The sent log pinned each fill's full key until an invalidation came:
/// with none heard, 4,096 long keys (a URL's length is the client's)
/// stayed for good. It ages on every send and holds a byte bound.
#[test]
fn the_sent_log_ages_without_invalidations_and_holds_its_byte_bound() {
    let (o, _rx) = overtaken();
    let t0 = Instant::now();
    let long = "q".repeat(32 * 1024);
    let fills = (0..4096)
        .map(|i| target(&format!("{long}{i}"), &[]))
        .collect();
    assert!(o.sent(o.mark(), fills, t0).is_empty());
    let held = o.lock().sent.held();
    assert!(held <= SENT_BYTES, "{held} bytes of sent keys held");
    assert!(o.lock().sent.len() >= SENT_BYTES / (2 * 32 * 1024) - 1);
    // Past the grace, the next send forgets the rest.
    let later = t0 + GRACE + Duration::from_millis(1);
    assert!(o.sent(o.mark(), vec![target("a", &[])], later).is_empty());
    assert_eq!(o.lock().sent.len(), 1);
    assert_eq!(o.lock().sent.held(), target("a", &[]).size());
}

#[test]
fn a_big_page_of_keys_is_matched_like_a_small_one() {
    let (o, mut rx) = overtaken();
    let now = Instant::now();
    let fills = (0..40).map(|i| target(&format!("k{i}"), &[])).collect();
    assert!(o.sent(o.mark(), fills, now).is_empty());
    let page = (30..100)
        .map(|i| target(&format!("k{i}"), &[]).hash)
        .collect();
    o.heard(Scope::Tag("other".into(), page), now);
    assert_eq!(deletes(&mut rx).len(), 10);
}

/// The log is bounded by the key hashes its records hold too (a tag
/// page names thousands), not by their count alone.
#[test]
fn the_log_holds_a_bounded_number_of_hashes() {
    let (o, _rx) = overtaken();
    let now = Instant::now();
    let queued_at = o.mark();
    let hash = CacheKey::new("k").hash();
    let big = || Scope::Keys(vec![hash; HEARD_HASHES / 2 + 1]);
    o.heard(big(), now);
    o.heard(big(), now);
    assert!(o.lock().hashes <= HEARD_HASHES);
    let mut fills = vec![(queued_at, target("a", &[]))];
    assert_eq!(
        hold_back(&o, &mut fills).len(),
        1,
        "the log no longer reaches back"
    );
}

#[test]
fn a_fill_queued_before_the_remembered_invalidations_is_held_back() {
    let (o, _rx) = overtaken();
    let now = Instant::now();
    let queued_at = o.mark();
    for _ in 0..HEARD_CAP + 1 {
        o.heard(Scope::Keys(Vec::new()), now);
    }
    let mut fills = vec![(queued_at, target("a", &[]))];
    assert_eq!(
        hold_back(&o, &mut fills).len(),
        1,
        "the log no longer reaches back"
    );
}

/// After a flood the log held its last 4,096 fills' records for good: their
/// slots (~700 KB), a key string each and each full key pinned, ~2–3 MiB of
/// a proxy's resident memory at a 32 MiB budget. Once they have aged out
/// nothing is kept past the heartbeat's next tick (a log emptied by what
/// it hears keeps its room until then: under a flood it fills again).
#[test]
fn an_aged_out_sent_log_gives_its_memory_back() {
    let (o, _rx) = overtaken();
    let t0 = Instant::now();
    let fills = (0..4096).map(|i| target(&format!("k{i}"), &[])).collect();
    assert!(o.sent(o.mark(), fills, t0).is_empty());
    assert_eq!(o.lock().sent.len(), 4096);
    let later = t0 + GRACE + Duration::from_millis(1);
    o.heard(Scope::Keys(Vec::new()), later);
    assert_eq!(o.lock().sent.len(), 0);
    o.age(later);
    assert_eq!(o.lock().sent.capacity(), 0, "slots or bytes kept");
}

/// The log's one buffer under churn: fills sent over time, some taken out
/// from the middle (by key, tag and prefix), the oldest aged out, the
/// buffer's front dropped on the way. Each fill left is still matched by
/// its own key, tags and full key, and deleted again under its own key,
/// once.
#[test]
fn fills_kept_in_the_logs_buffer_are_matched_after_churn() {
    let (o, mut rx) = overtaken();
    let t0 = Instant::now();
    let name = |i: usize| format!("{}{i}", if i.is_multiple_of(3) { "p" } else { "k" });
    let tags = |i: usize| match i % 4 {
        0 => vec![],
        1 => vec!["red"],
        2 => vec!["red", "blue"],
        _ => vec!["green"],
    };
    let mut live: Vec<(usize, Instant)> = Vec::new();
    for round in 0..40 {
        let now = t0 + Duration::from_millis(100 * round as u64);
        let fills: Vec<_> = (round * 50..round * 50 + 50).collect();
        let sent = fills.iter().map(|&i| target(&name(i), &tags(i))).collect();
        assert!(o.sent(o.mark(), sent, now).is_empty());
        live.extend(fills.iter().map(|&i| (i, now)));
        live.retain(|(_, at)| now.saturating_duration_since(*at) <= GRACE);
        // In turn: a key from the middle, a tag, a prefix.
        let (scope, covered): (Scope, Box<dyn Fn(usize) -> bool>) = match round % 3 {
            0 => {
                let i = live[live.len() / 2].0;
                let hash = target(&name(i), &[]).hash;
                (Scope::Keys(vec![hash]), Box::new(move |j| j == i))
            }
            1 => (
                Scope::Tag("blue".into(), vec![]),
                Box::new(move |j| tags(j).contains(&"blue")),
            ),
            _ => (
                Scope::Prefix(KeyPattern::new().part(b"shop").prefix(b"p")),
                Box::new(move |j| name(j).starts_with('p')),
            ),
        };
        o.heard(scope, now);
        let mut expected: Vec<_> = live
            .iter()
            .filter(|(j, _)| covered(*j))
            .map(|(j, _)| key(&name(*j)))
            .collect();
        live.retain(|(j, _)| !covered(*j));
        let mut got = deletes(&mut rx);
        expected.sort();
        got.sort();
        assert_eq!(got, expected, "round {round}");
        assert!(o.lock().sent.held() <= SENT_BYTES);
    }
    let end = t0 + Duration::from_millis(100 * 39);
    o.heard(Scope::Everything, end);
    let mut expected: Vec<_> = live.iter().map(|(j, _)| key(&name(*j))).collect();
    let mut got = deletes(&mut rx);
    expected.sort();
    got.sort();
    assert_eq!(got, expected);
}

/// An instance that sends nothing and hears nothing still forgets what
/// it sent, on its heartbeat's tick.
#[test]
fn an_idle_instance_forgets_its_sent_fills_on_its_own() {
    let (o, _rx) = overtaken();
    let t0 = Instant::now();
    let fills = (0..100).map(|i| target(&format!("k{i}"), &["t"])).collect();
    assert!(o.sent(o.mark(), fills, t0).is_empty());
    o.age(t0 + GRACE / 2);
    assert_eq!(o.lock().sent.len(), 100, "within the grace");
    o.age(t0 + GRACE + Duration::from_millis(1));
    assert_eq!(o.lock().sent.len(), 0);
    assert_eq!(o.lock().sent.capacity(), 0);
}

/// Fills taken out of the middle left their bytes in the buffer, and the
/// bound counted them: with one old fill at the front, the log then
/// forgot fills within their grace while the fills in it held far less
/// than its bound. Only the fills in the log count.
#[test]
fn fills_taken_out_do_not_count_against_the_bound() {
    let (o, mut rx) = overtaken();
    let t0 = Instant::now();
    let long = "q".repeat(32 * 1024);
    let first = target("first", &[]);
    let mut kept = first.size();
    assert!(o.sent(o.mark(), vec![first], t0).is_empty());
    for round in 0..4 {
        let mut fills: Vec<_> = (0..40)
            .map(|i| target(&format!("{long}{round}-{i}"), &["gone"]))
            .collect();
        // One kept behind them, so what they leave is a gap.
        let behind = target(&format!("behind{round}"), &["kept"]);
        kept += behind.size();
        fills.push(behind);
        assert!(o.sent(o.mark(), fills, t0).is_empty());
        o.heard(Scope::Tag("gone".into(), vec![]), t0);
        assert_eq!(deletes(&mut rx).len(), 40);
        assert_eq!(o.lock().sent.held(), kept);
    }
    // Matched by their bytes, which the gaps' removal moved.
    let first_by_prefix = KeyPattern::new().part(b"shop").prefix(b"fir");
    o.heard(Scope::Prefix(first_by_prefix), t0);
    assert_eq!(
        deletes(&mut rx),
        [key("first")],
        "the first fill was forgotten"
    );
    o.heard(Scope::Tag("kept".into(), vec![]), t0);
    assert_eq!(deletes(&mut rx).len(), 4, "the fills behind");
}

/// A log shrunk after a lull doubled its slots again past the cap when a
/// flood came back (a room of 2,000 doubled to 4,000, then 8,000): its
/// slots stay within the cap.
#[test]
fn the_logs_slots_stay_within_its_cap_after_a_lull() {
    let (o, _rx) = overtaken();
    let t0 = Instant::now();
    let names = |from: usize, n: usize| (from..from + n).map(|i| target(&format!("k{i}"), &[]));
    assert!(o.sent(o.mark(), names(0, 3000).collect(), t0).is_empty());
    let t1 = t0 + GRACE / 2;
    assert!(o.sent(o.mark(), names(3000, 1000).collect(), t1).is_empty());
    // The first 3,000 age out: 1,000 left in a room of 4,096.
    o.age(t0 + GRACE + Duration::from_millis(1));
    assert_eq!(o.lock().sent.len(), 1000);
    assert!(o.lock().sent.slots() < 4096, "not shrunk");
    for chunk in 0..8 {
        let fills = names(10_000 + chunk * 512, 512).collect();
        assert!(o.sent(o.mark(), fills, t1).is_empty());
    }
    assert_eq!(o.lock().sent.len(), 4096);
    assert!(
        o.lock().sent.slots() <= 4096,
        "{} slots",
        o.lock().sent.slots()
    );
}

/// An invalidation that took all but one fill under a flood shrank the
/// log's room on the writer's path, and the flood grew it back under the
/// lock the writer shares: the room is given back on the heartbeat's tick.
#[test]
fn a_log_nearly_emptied_under_a_flood_keeps_its_room_until_the_heartbeat() {
    let (o, mut rx) = overtaken();
    let t0 = Instant::now();
    let mut fills: Vec<_> = (0..4000)
        .map(|i| target(&format!("k{i}"), &["hot"]))
        .collect();
    fills.push(target("cold", &[]));
    assert!(o.sent(o.mark(), fills, t0).is_empty());
    let room = o.lock().sent.slots();
    o.heard(Scope::Tag("hot".into(), vec![]), t0);
    assert_eq!(deletes(&mut rx).len(), 4000);
    assert!(o.sent(o.mark(), vec![target("next", &[])], t0).is_empty());
    assert_eq!(
        o.lock().sent.slots(),
        room,
        "room given back on the writer's path"
    );
    o.age(t0);
    assert!(o.lock().sent.slots() < room, "not given back on the tick");
}
