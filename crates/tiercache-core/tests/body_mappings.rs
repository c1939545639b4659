//! Large bodies live in page mappings of their own: given back to the
//! system when dropped (after a while as spares for the next body of the
//! same size), never more of them than [`MAX_MAPPINGS`]. One test, in a
//! binary of its own: the counts are process-wide.

use bytes::Bytes;
use tiercache_core::body::{
    BodyBuilder, MAX_MAPPINGS, SPARE_BYTES, copy, heap_fallbacks, mapped_from, mappings,
    trim_spares,
};

/// A field of `/proc/self/status`, in bytes.
fn status(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .expect("RssAnon")
        * 1024
}

#[test]
fn large_bodies_take_mappings_that_are_reused_then_released() {
    // 64 KiB on 4 KiB pages; four times the threshold wherever pages are larger.
    let large = 4 * mapped_from();
    assert_eq!(mappings(), 0);
    let small = copy(&vec![1; mapped_from() - 1]);
    assert_eq!(mappings(), 0, "a small body is on the heap");

    let a = copy(&vec![1; large]);
    let b = copy(&vec![2; large]);
    assert_eq!(mappings(), 2);
    drop(a);
    assert_eq!(mappings(), 2, "a dropped body's mapping is kept as a spare");
    let c = copy(&vec![3; large]);
    assert_eq!(mappings(), 2, "the next body of its size reuses it");
    assert!(c.iter().all(|&x| x == 3));
    drop((b, c));
    trim_spares();
    assert_eq!(mappings(), 2, "a spare was reused since the last trim");
    trim_spares();
    assert_eq!(mappings(), 0, "idle spares are released on the next tick");

    // Spares are bounded.
    let many: Vec<Bytes> = (0..64).map(|_| copy(&vec![0; large])).collect();
    assert_eq!(mappings(), 64);
    drop(many);
    assert_eq!(mappings(), SPARE_BYTES / large);
    trim_spares();
    assert_eq!(mappings(), 0);

    // Their pages go back to the system: 64 MiB of bodies, dropped.
    let before = status("RssAnon:");
    let held: Vec<Bytes> = (0..(64 << 20) / large)
        .map(|i| copy(&vec![i as u8; large]))
        .collect();
    let grown = status("RssAnon:").saturating_sub(before);
    assert!(
        grown >= 60 << 20,
        "64 MiB of bodies: RSS grew {grown} bytes"
    );
    drop(held);
    trim_spares();
    let left = status("RssAnon:").saturating_sub(before);
    assert!(
        left <= 4 << 20,
        "64 MiB of bodies dropped: {left} bytes still resident"
    );

    // A body's announced length is not taken on trust: 8 MiB announced,
    // one byte sent, reserves 1 MiB at most.
    let before = status("VmSize:");
    let held: Vec<BodyBuilder> = (0..16)
        .map(|_| {
            let mut body = BodyBuilder::with_capacity(8 << 20);
            body.push(b"x");
            body
        })
        .collect();
    let reserved = status("VmSize:").saturating_sub(before);
    assert!(
        reserved <= 17 << 20,
        "16 bodies announcing 8 MiB reserved {reserved} bytes"
    );
    assert!(held.into_iter().all(|b| b.finish() == "x"));
    trim_spares();
    trim_spares();
    assert_eq!(mappings(), 0);

    // Past the cap, bodies go to the heap (each mapping faulted in as it
    // is made: 256 MiB for a moment).
    let held: Vec<BodyBuilder> = (0..MAX_MAPPINGS + 10)
        .map(|_| BodyBuilder::with_capacity(mapped_from()))
        .collect();
    assert_eq!(mappings(), MAX_MAPPINGS);
    let fallbacks = heap_fallbacks();
    let stored = copy(&vec![5; mapped_from() + 100]);
    assert_eq!(mappings(), MAX_MAPPINGS, "past the cap: on the heap");
    assert_eq!(heap_fallbacks(), fallbacks + 1, "counted once");
    assert!(stored.len() == mapped_from() + 100 && stored.iter().all(|&b| b == 5));
    // Bytes of a length worked out first (an L2 envelope), refused a
    // mapping, stay where they were written: not copied to ask again.
    let len = mapped_from() + 100;
    let mut envelope = BodyBuilder::exact(len);
    envelope.push(&vec![6; len]);
    let written = envelope.as_slice().as_ptr();
    let stored = envelope.finish();
    assert_eq!(
        stored.as_ptr(),
        written,
        "copied again to ask for a mapping"
    );
    assert_eq!(heap_fallbacks(), fallbacks + 2, "counted once");
    assert_eq!(mappings(), MAX_MAPPINGS);
    drop(held);
    trim_spares();
    assert_eq!(mappings(), 0);
    assert_eq!(small.len(), mapped_from() - 1);
}
