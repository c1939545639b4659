//! The stampede made visible: jitter, XFetch and their effect on origin load,
//! replayed on the real engine with a mock clock.
//!
//! ```text
//! cargo run --release --example stampede [-- OUT.svg]
//! ```
//!
//! Prints each histogram in the terminal and writes them all as one SVG
//! (default `target/stampede.svg`; the README shows `docs/stampede.svg`).

#[path = "support/stampede.rs"]
mod stampede;

fn main() -> std::io::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/stampede.svg".to_owned());
    let histograms = stampede::all();
    for h in &histograms {
        println!("{}", stampede::ascii(h, 41, 50));
    }
    println!("{}", stampede::summary(&histograms));
    std::fs::write(&out, stampede::svg(&histograms))?;
    println!("wrote {out}");
    Ok(())
}
