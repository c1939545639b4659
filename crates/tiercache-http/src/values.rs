//! Header values built once and shared by every hit.
//!
//! A hit must not allocate what a shared static could give: the hit ratio
//! (10,001 possible values), `age` below an hour and the L1 `cache-status`
//! for a ttl below an hour are cut from strings built once per process
//! (about 0.8 MiB all told), and cloned as `HeaderValue::from_static`
//! values, which costs no allocation and no atomic.

use std::fmt::Write as _;
use std::sync::OnceLock;

use http::HeaderValue;

/// Ages and ttls below this many seconds come from a table.
const TABLE_SECONDS: usize = 3600;

fn table(build: impl Fn(usize, &mut String), n: usize) -> Vec<HeaderValue> {
    let mut all = String::new();
    let mut ends = Vec::with_capacity(n);
    for i in 0..n {
        build(i, &mut all);
        ends.push(all.len());
    }
    let all: &'static str = Box::leak(all.into_boxed_str());
    let mut start = 0;
    ends.into_iter()
        .map(|end| {
            let value = HeaderValue::from_static(&all[start..end]);
            start = end;
            value
        })
        .collect()
}

/// `x-cache-hit-ratio` for `ratio` in `0.0..=1.0`, four decimals.
pub(crate) fn hit_ratio(ratio: f64) -> HeaderValue {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        table(
            |i, s| {
                let _ = write!(s, "{}.{:04}", i / 10_000, i % 10_000);
            },
            10_001,
        )
    });
    let i = (ratio.clamp(0.0, 1.0) * 10_000.0).round() as usize;
    table[i.min(10_000)].clone()
}

/// `age` in whole seconds.
pub(crate) fn age(seconds: u64) -> HeaderValue {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    match usize::try_from(seconds) {
        Ok(i) if i < TABLE_SECONDS => TABLE.get_or_init(|| {
            table(
                |i, s| {
                    let _ = write!(s, "{i}");
                },
                TABLE_SECONDS,
            )
        })[i]
            .clone(),
        _ => HeaderValue::from(seconds),
    }
}

/// `cache-status` of a plain L1 hit with `ttl` seconds left, when tabled.
pub(crate) fn l1_hit_status(ttl: u64) -> Option<HeaderValue> {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    let i = usize::try_from(ttl).ok().filter(|&i| i < TABLE_SECONDS)?;
    let table = TABLE.get_or_init(|| {
        table(
            |i, s| {
                let _ = write!(s, "tiercache; hit; ttl={i}; detail=l1");
            },
            TABLE_SECONDS,
        )
    });
    Some(table[i].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_match_formatting() {
        assert_eq!(hit_ratio(0.0), "0.0000");
        assert_eq!(hit_ratio(0.5), "0.5000");
        assert_eq!(hit_ratio(0.123_44), "0.1234");
        assert_eq!(hit_ratio(0.999_99), "1.0000");
        assert_eq!(hit_ratio(1.0), "1.0000");
        assert_eq!(hit_ratio(f64::NAN), "0.0000");
        assert_eq!(age(0), "0");
        assert_eq!(age(3599), "3599");
        assert_eq!(age(86_400), "86400");
        assert_eq!(
            l1_hit_status(37).unwrap(),
            "tiercache; hit; ttl=37; detail=l1"
        );
        assert!(l1_hit_status(3600).is_none());
    }
}
