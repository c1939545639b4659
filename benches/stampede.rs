//! Origin protection around an expiry wave: the stampede experiments as a bench.
//!
//! Run: `cargo bench --bench stampede`
//!
//! Replays `examples/stampede.rs` on the real engine with a mock clock and
//! prints the figures the README quotes: the tallest expiry bucket of a
//! 200-key cohort with and without jitter, the XFetch fire rate near and far
//! from expiry against the formula, and the peak origin calls per 100 ms
//! around the expiry of 10,000 keys filled together (fixed TTL, jitter,
//! jitter + XFetch), plus how long each replay took.
//!
//! Last measured (2 cores, 2026-12-02): tallest bucket 200 vs 8; XFetch formula 13.5 %
//! at 10 s (formula 13.5 %), 0 at 290 s; peak origin calls per 100 ms 1810
//! (fixed), 33 (jitter), 34 (jitter + XFetch).

#[path = "../examples/support/stampede.rs"]
#[allow(dead_code)]
mod stampede;

fn main() {
    let started = std::time::Instant::now();
    let histograms = stampede::all();
    println!("{}", stampede::summary(&histograms));
    println!("replayed in {:?}", started.elapsed());
}
