//! The per-thread table in front of moka answers only for exactly what
//! L1 holds: every change under a key, on any thread, is seen.

use super::front::FEEDBACK_EVERY;
use super::*;
use crate::{CacheKey, SystemClock, Times, Value};

fn l1(capacity: u64) -> L1 {
    L1::new(capacity, Arc::new(SystemClock), Arc::default())
}

fn entry(body: &str) -> Entry {
    let now = SystemTime::now();
    Entry::new(
        "k".into(),
        Default::default(),
        Value::from_body(body.to_owned()),
        Times::fresh(now, now + Duration::from_secs(60)),
        Duration::ZERO,
    )
}

fn hash(key: &str) -> KeyHash {
    CacheKey::new(key).hash()
}

/// Reads `hash` on another thread: `rounds` reads, the last one's id.
fn read_elsewhere(
    l1: &L1,
    hash: KeyHash,
    after: impl FnOnce() + Send,
    rounds: usize,
) -> (Option<u64>, Option<u64>) {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let now = SystemTime::now();
            let mut before = None;
            for _ in 0..rounds {
                before = l1.get(&hash, now).map(|e| e.id());
            }
            done_tx.send(()).unwrap();
            // An error: the change panicked; the reader just ends.
            let _ = rx.recv();
            (before, l1.get(&hash, now).map(|e| e.id()))
        });
        // Moved in: a panicking change drops it, so the reader ends.
        let tx = tx;
        done_rx.recv().unwrap();
        after();
        tx.send(()).unwrap();
        reader.join().unwrap()
    })
}

#[test]
fn a_store_on_another_thread_is_read_at_once() {
    let l1 = l1(1 << 20);
    let (old, new) = (entry("old"), entry("new"));
    l1.insert(hash("a"), old.clone());
    let seen = read_elsewhere(
        &l1,
        hash("a"),
        || {
            l1.insert(hash("a"), new.clone());
        },
        3,
    );
    assert_eq!(seen, (Some(old.id()), Some(new.id())));
}

#[test]
fn a_removal_on_another_thread_is_read_at_once() {
    type Change = fn(&L1);
    let changes: [(&str, Change); 4] = [
        ("invalidate", |l1| l1.invalidate(&hash("a"))),
        ("clear", |l1| l1.clear()),
        ("remove_where", |l1| l1.remove_where(|_| true)),
        ("remove_if", |l1| {
            assert!(l1.remove_if(&hash("a"), |_| true));
        }),
    ];
    for (name, change) in changes {
        let l1 = l1(1 << 20);
        let stored = entry("v");
        l1.insert(hash("a"), stored.clone());
        let seen = read_elsewhere(&l1, hash("a"), || change(&l1), 3);
        assert_eq!(seen, (Some(stored.id()), None), "{name}");
    }
}

/// A removal decided on the fill it read (a read past the hard expiry, a
/// sweep) took whatever L1 held when it landed: a fill stored on another
/// thread meanwhile went with it (a miss more, counted as expired). A
/// store waits for a removal under its key being decided.
#[test]
fn a_removal_decided_on_an_old_fill_spares_a_fill_stored_meanwhile() {
    let l1 = l1(1 << 20);
    let (old, new) = (entry("old"), entry("new"));
    l1.insert(hash("a"), old.clone());
    std::thread::scope(|s| {
        let (l1, new) = (&l1, &new);
        let (stored_tx, stored_rx) = std::sync::mpsc::channel();
        let removed = l1.remove_if(&hash("a"), |live| {
            s.spawn(move || {
                l1.insert(hash("a"), new.clone());
                let _ = stored_tx.send(());
            });
            // The store lands now, unless it waits for this removal.
            let _ = stored_rx.recv_timeout(Duration::from_millis(200));
            live.ptr_eq(&old)
        });
        assert!(removed, "the old fill went");
    });
    assert_eq!(
        l1.get(&hash("a"), SystemTime::now()).map(|e| e.id()),
        Some(new.id()),
        "the fill stored meanwhile went with it"
    );
}

#[test]
fn an_entry_moka_evicts_is_not_answered_from_a_threads_table() {
    // Room for a few entries: filling it evicts the one read first.
    let l1 = l1(64 * 1024);
    let first = entry("first");
    l1.insert(hash("first"), first.clone());
    let evict = || {
        let now = SystemTime::now();
        for i in 0..200 {
            // Asked for often, so moka's admission prefers them.
            let filler = hash(&format!("filler{i}"));
            (0..8).for_each(|_| assert!(l1.get(&filler, now).is_none()));
            l1.insert(filler, entry(&"x".repeat(1000)));
        }
        // moka may stop a pass early on a loaded machine.
        for _ in 0..100 {
            l1.run_pending_tasks();
        }
        assert!(!l1.contains(&hash("first")), "evicted");
    };
    let seen = read_elsewhere(&l1, hash("first"), evict, 3);
    assert_eq!(seen, (Some(first.id()), None));
}

#[test]
fn a_threads_table_never_answers_for_another_l1() {
    let (a, b) = (l1(1 << 20), l1(1 << 20));
    let (in_a, in_b) = (entry("a"), entry("b"));
    a.insert(hash("k"), in_a.clone());
    b.insert(hash("k"), in_b.clone());
    let now = SystemTime::now();
    for _ in 0..3 {
        assert_eq!(a.get(&hash("k"), now).unwrap().id(), in_a.id());
        assert_eq!(b.get(&hash("k"), now).unwrap().id(), in_b.id());
    }
    b.invalidate(&hash("k"));
    assert_eq!(a.get(&hash("k"), now).unwrap().id(), in_a.id());
    assert!(b.get(&hash("k"), now).is_none());
}

#[test]
fn one_read_in_sixteen_of_a_hot_key_still_goes_to_moka() {
    let epochs = Epochs::new();
    let hot = entry("v");
    let stamp = epochs.stamp(&hash("hot"));
    epochs.keep(&hash("hot"), stamp, &hot);
    for _ in 1..FEEDBACK_EVERY {
        assert!(epochs.lookup(&hash("hot")).unwrap().ptr_eq(&hot));
    }
    // moka's turn: the caller reads it there and keeps it again.
    assert_eq!(epochs.lookup(&hash("hot")).unwrap_err(), stamp);
}

#[test]
fn a_hot_key_outlives_a_flood_of_keys_read_less() {
    let l1 = l1(64 * 1024);
    let now = SystemTime::now();
    l1.insert(hash("hot"), entry("hot"));
    // Read all along, as hot keys are: by this thread's table, but for
    // one read in sixteen.
    for i in 0..300 {
        for _ in 0..8 {
            assert!(l1.get(&hash("hot"), now).is_some(), "after {i}");
        }
        let filler = hash(&format!("filler{i}"));
        (0..3).for_each(|_| assert!(l1.get(&filler, now).is_none()));
        l1.insert(filler, entry(&"x".repeat(1000)));
        l1.run_pending_tasks();
    }
    assert!(l1.contains(&hash("hot")), "moka saw the hot key read");
}

#[test]
fn a_threads_table_never_keeps_what_l1_dropped_alive() {
    let l1 = l1(1 << 20);
    let stored = entry(&"x".repeat(10_000));
    let weak = stored.downgrade();
    l1.insert(hash("a"), stored);
    let now = SystemTime::now();
    for _ in 0..3 {
        assert!(l1.get(&hash("a"), now).is_some());
    }
    l1.invalidate(&hash("a"));
    l1.run_pending_tasks();
    assert!(weak.upgrade().is_none(), "body freed");
}
