//! Header values built once and shared by every hit.
//!
//! A hit must not allocate what a shared static could give: the hit ratio
//! (10,001 possible values), `age` below an hour and the L1 `cache-status`
//! for a ttl below an hour are cut from strings built once per process
//! (about 0.4 MiB all told), and cloned as `HeaderValue::from_static`
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
///
/// Every value is six bytes, so each is found by arithmetic in one string
/// (60 KB) rather than kept as a `HeaderValue` of its own: a table of those
/// cost 400 KB more, built by the first response of a process.
pub(crate) fn hit_ratio(ratio: f64) -> HeaderValue {
    hit_ratio_at(hit_ratio_step(ratio))
}

/// `ratio` in `0.0..=1.0` as the step of 0.0001 it rounds to (`0..=10_000`):
/// two ratios of one step share their `x-cache-hit-ratio`.
pub(crate) fn hit_ratio_step(ratio: f64) -> u16 {
    // `+ 0.5` then truncation rounds a non-negative value without a call
    // to libm's `round`; NaN casts to 0.
    ((ratio.clamp(0.0, 1.0) * 10_000.0 + 0.5) as u16).min(10_000)
}

/// `x-cache-hit-ratio` for a [`hit_ratio_step`].
pub(crate) fn hit_ratio_at(step: u16) -> HeaderValue {
    const WIDTH: usize = "0.0000".len();
    static ALL: OnceLock<&'static str> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        let mut all = String::with_capacity(10_001 * WIDTH);
        for i in 0..=10_000 {
            let _ = write!(all, "{}.{:04}", i / 10_000, i % 10_000);
        }
        Box::leak(all.into_boxed_str())
    });
    let i = usize::from(step.min(10_000));
    HeaderValue::from_static(&all[i * WIDTH..(i + 1) * WIDTH])
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

/// `cache-status` of a plain L1 hit with `ttl` seconds left: from the table
/// below an hour, else from a small per-thread table of the last ones built.
pub(crate) fn l1_hit_status(ttl: u64) -> HeaderValue {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    if let Some(i) = usize::try_from(ttl).ok().filter(|&i| i < TABLE_SECONDS) {
        let table = TABLE.get_or_init(|| {
            table(
                |i, s| {
                    let _ = write!(s, "tiercache; hit; ttl={i}; detail=l1");
                },
                TABLE_SECONDS,
            )
        });
        return table[i].clone();
    }
    // Longer ttls (a day is common) are built once a second per thread: a
    // hot entry's hits within that second share the value.
    thread_local! {
        static LONG: std::cell::RefCell<[Option<(u64, HeaderValue)>; 8]> =
            const { std::cell::RefCell::new([const { None }; 8]) };
    }
    let slot = (ttl % 8) as usize;
    LONG.try_with(|long| {
        let mut long = long.borrow_mut();
        match &long[slot] {
            Some((at, value)) if *at == ttl => value.clone(),
            _ => {
                let value = long_ttl_status(ttl);
                long[slot] = Some((ttl, value.clone()));
                value
            }
        }
    })
    .unwrap_or_else(|_| long_ttl_status(ttl))
}

/// `cache-status` of a plain L1 hit with `ttl` seconds left, written out
/// by hand (no `fmt` machinery, which cost ~500 instructions a hit).
fn long_ttl_status(ttl: u64) -> HeaderValue {
    const HEAD: &[u8] = b"tiercache; hit; ttl=";
    const TAIL: &[u8] = b"; detail=l1";
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = ttl;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut out = bytes::BytesMut::with_capacity(HEAD.len() + (digits.len() - at) + TAIL.len());
    out.extend_from_slice(HEAD);
    out.extend_from_slice(&digits[at..]);
    out.extend_from_slice(TAIL);
    // Digits and fixed text always make a valid value.
    HeaderValue::from_maybe_shared(out.freeze())
        .unwrap_or_else(|_| HeaderValue::from_static("tiercache; hit; detail=l1"))
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
        assert_eq!(l1_hit_status(37), "tiercache; hit; ttl=37; detail=l1");
        assert_eq!(l1_hit_status(0), "tiercache; hit; ttl=0; detail=l1");
        assert_eq!(l1_hit_status(3600), "tiercache; hit; ttl=3600; detail=l1");
        assert_eq!(
            l1_hit_status(u64::MAX),
            format!("tiercache; hit; ttl={}; detail=l1", u64::MAX)
        );
        assert_eq!(hit_ratio(0.000_05), "0.0001", "half rounds up");
        assert_eq!(hit_ratio(-1.0), "0.0000");
    }

    #[test]
    fn long_ttls_share_slots_without_mixing_values() {
        // 3600 + 8k all land in one slot: each must still read its own ttl.
        for round in 0..2 {
            for ttl in (0..5).map(|k| 3600 + 8 * k).chain([86_400, 86_399]) {
                assert_eq!(
                    l1_hit_status(ttl),
                    format!("tiercache; hit; ttl={ttl}; detail=l1"),
                    "round {round}"
                );
            }
        }
    }
}
