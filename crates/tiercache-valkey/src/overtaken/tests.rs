use super::*;
use tiercache_core::CacheKey;

const GRACE: Duration = Duration::from_secs(2);

fn target(name: &str, tags: &[&str]) -> Target {
    let key = CacheKey::builder()
        .part(b"shop")
        .part(name.as_bytes())
        .finish();
    Target {
        hash: key.hash(),
        full: key.full().clone(),
        key: format!("e:{name}"),
        tags: tags.iter().map(|t| t.to_string()).collect(),
        stamp: Stamp::of(name.as_bytes()),
    }
}

fn overtaken() -> (Overtaken, mpsc::Receiver<Write>) {
    let (tx, rx) = mpsc::channel(16);
    (Overtaken::new(tx, GRACE), rx)
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
    assert_eq!(hold_back(&o, &mut fills), ["e:a", "e:b", "e:pen"]);
    // "c" is not covered; the later "a" was queued after the message.
    let left: Vec<_> = fills.iter().map(|(_, t)| t.key.as_str()).collect();
    assert_eq!(left, ["e:c", "e:a"]);
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
    assert_eq!(again, [("e:a".to_owned(), a.stamp, a.hash)]);
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
    assert_eq!(deletes(&mut rx), ["e:b"]);
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
    let held = o.lock().sent.bytes;
    assert!(held <= SENT_BYTES, "{held} bytes of sent keys held");
    assert!(o.lock().sent.fills.len() >= SENT_BYTES / (2 * 32 * 1024) - 1);
    // Past the grace, the next send forgets the rest.
    let later = t0 + GRACE + Duration::from_millis(1);
    assert!(o.sent(o.mark(), vec![target("a", &[])], later).is_empty());
    assert_eq!(o.lock().sent.fills.len(), 1);
    assert_eq!(o.lock().sent.bytes, target("a", &[]).size());
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
