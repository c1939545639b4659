use super::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

const TTL: Duration = Duration::from_secs(300);

#[test]
fn each_bad_field_is_named() {
    let cases = [
        (Policy::ttl(Duration::ZERO), "ttl"),
        (Policy::ttl(MAX_TTL + Duration::from_secs(1)), "ttl"),
        (Policy::ttl(TTL).jitter(0.7), "jitter"),
        (Policy::ttl(TTL).jitter(-0.1), "jitter"),
        (Policy::ttl(TTL).jitter(f64::NAN), "jitter"),
        (Policy::ttl(TTL).additive_jitter(TTL * 2), "jitter"),
        (
            Policy::ttl(TTL).lock_timeout(Duration::ZERO),
            "lock_timeout",
        ),
        (
            Policy::ttl(TTL).lock_timeout(Duration::from_secs(601)),
            "lock_timeout",
        ),
        (
            Policy::ttl(TTL).hit_for_miss_ttl(MAX_TTL * 2),
            "hit_for_miss_ttl",
        ),
        (
            Policy::ttl(TTL).stale_while_revalidate(MAX_TTL * 2),
            "stale_while_revalidate",
        ),
        (
            Policy::ttl(TTL).stale_if_error(MAX_TTL * 2),
            "stale_if_error",
        ),
        (
            Policy::ttl(TTL).negative_ttl(Duration::ZERO),
            "negative_ttl",
        ),
        (Policy::ttl(TTL).negative_ttl(TTL * 2), "negative_ttl"),
        (Policy::ttl(TTL).xfetch_beta(-1.0), "xfetch_beta"),
        (Policy::ttl(TTL).xfetch_beta(f64::INFINITY), "xfetch_beta"),
        (
            Policy::ttl(TTL).origin_soft_timeout(Duration::ZERO),
            "origin_soft_timeout",
        ),
    ];
    for (policy, field) in cases {
        let err = policy.validate().unwrap_err();
        assert_eq!(err.field, field, "{policy:?}");
        assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
    }
    assert!(Policy::ttl(TTL).jitter(0.5).validate().is_ok());
    assert!(Policy::ttl(TTL).jitter(0.0).validate().is_ok());
}

fn histogram(policy: &Policy, draws: usize, buckets: usize) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(7);
    let (lo, hi) = policy.band();
    let width = (hi - lo).as_secs_f64();
    let mut counts = vec![0; buckets];
    for _ in 0..draws {
        let ttl = policy.draw_ttl(&mut rng);
        assert!(ttl >= lo && ttl <= hi, "{ttl:?} outside {lo:?}..={hi:?}");
        let i = (((ttl - lo).as_secs_f64() / width) * buckets as f64) as usize;
        counts[i.min(buckets - 1)] += 1;
    }
    counts
}

#[test]
fn symmetric_draws_fill_the_band() {
    let counts = histogram(&Policy::ttl(TTL).jitter(0.1).build().unwrap(), 10_000, 20);
    assert!(counts.iter().all(|&c| c > 0), "{counts:?}");
}

#[test]
fn additive_draws_fill_the_band() {
    let policy = Policy::ttl(TTL)
        .additive_jitter(Duration::from_secs(60))
        .build()
        .unwrap();
    assert_eq!(policy.band(), (TTL, TTL + Duration::from_secs(60)));
    let counts = histogram(&policy, 10_000, 20);
    assert!(counts.iter().all(|&c| c > 0), "{counts:?}");
}

#[test]
fn jitter_only_shortens_an_origin_lifetime() {
    let mut rng = StdRng::seed_from_u64(3);
    let declared = Duration::from_secs(100);
    let policy = Policy::ttl(TTL).jitter(0.5).build().unwrap();
    let (mut lo, mut hi) = (declared, Duration::ZERO);
    for _ in 0..10_000 {
        let d = policy.draw_origin_ttl(declared, &mut rng);
        assert!(d >= declared / 2 && d <= declared, "{d:?}");
        lo = lo.min(d);
        hi = hi.max(d);
    }
    assert!(lo < Duration::from_secs(52) && hi > Duration::from_secs(98));
}

#[test]
fn zero_jitter_is_exactly_ttl() {
    let mut rng = StdRng::seed_from_u64(1);
    for policy in [
        Policy::ttl(TTL).jitter(0.0).build().unwrap(),
        Policy::ttl(TTL)
            .additive_jitter(Duration::ZERO)
            .build()
            .unwrap(),
    ] {
        for _ in 0..1000 {
            assert_eq!(policy.draw_ttl(&mut rng), TTL);
        }
    }
}
