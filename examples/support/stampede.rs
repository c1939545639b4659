//! The stampede experiments, on the real engine with a mock clock. Shared by
//! `examples/stampede.rs` and `benches/stampede.rs`.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tiercache::core::{Begin, CacheKey, Clock, Fill, Hit, MockClock, Value};
use tiercache::{Policy, TieredCache};

/// A labelled series of bucket counts.
pub(crate) struct Histogram {
    pub(crate) title: String,
    pub(crate) x_label: String,
    /// Bucket start (in the x unit) and count.
    pub(crate) buckets: Vec<(f64, f64)>,
}

impl Histogram {
    pub(crate) fn peak(&self) -> f64 {
        self.buckets.iter().map(|b| b.1).fold(0.0, f64::max)
    }
}

fn engine(clock: &MockClock, seed: u64) -> TieredCache {
    TieredCache::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .rng_seed(seed)
        .l1_capacity(1 << 30)
        .build()
        .expect("engine")
}

/// Experiment 1: 200 keys filled at one instant with ttl 300 s; their
/// expiries in 1-second buckets.
pub(crate) fn cohort(jitter: f64) -> Histogram {
    let clock = MockClock::new();
    let cache = engine(&clock, 1);
    let t0 = clock.now();
    let policy = Policy::ttl(Duration::from_secs(300))
        .jitter(jitter)
        .build()
        .unwrap();
    let mut counts = std::collections::BTreeMap::<u64, f64>::new();
    for i in 0..200u32 {
        let entry = cache.put(
            &CacheKey::new(i.to_le_bytes()),
            Fill::new(Value::from_body("v")),
            &policy,
        );
        let secs = entry
            .times()
            .fresh_until
            .duration_since(t0)
            .unwrap()
            .as_secs();
        *counts.entry(secs).or_default() += 1.0;
    }
    let buckets = (260..=340)
        .map(|s| (s as f64, counts.get(&s).copied().unwrap_or(0.0)))
        .collect();
    Histogram {
        title: format!("200 keys filled together, ttl 300 s, jitter {jitter}: expiries per second"),
        x_label: "seconds after the fill".into(),
        buckets,
    }
}

/// Experiment 2: the XFetch fire rate of a fresh hit, by distance from
/// expiry, for δ = 5 s and β = 1, measured over `draws` lookups each.
pub(crate) fn xfetch_rate(draws: usize) -> Histogram {
    let delta = Duration::from_secs(5);
    let mut buckets = Vec::new();
    for before in (0..=300).step_by(10).map(|b: u64| b.max(1)) {
        let clock = MockClock::new();
        let cache = engine(&clock, before);
        let key = CacheKey::new("hot");
        let policy = Policy::ttl(Duration::from_secs(300))
            .jitter(0.0)
            .build()
            .unwrap();
        cache.put(
            &key,
            Fill::new(Value::from_body("v")).origin_latency(delta),
            &policy,
        );
        clock.advance(Duration::from_secs(300 - before));
        let fired = (0..draws)
            .filter(|_| {
                matches!(
                    cache.begin(&key, &policy, &()),
                    Begin::Hit(Hit {
                        early_refresh: true,
                        ..
                    })
                )
            })
            .count();
        buckets.push((before as f64, fired as f64 / draws as f64));
    }
    Histogram {
        title: "XFetch: share of hits that refresh early, δ = 5 s, β = 1 (formula exp(−t/δβ))"
            .into(),
        x_label: "seconds before expiry".into(),
        buckets,
    }
}

/// Experiment 3: 10,000 keys filled together (ttl 300 s), each requested
/// `rate` times a second (Poisson), with a 1 s origin time; origin calls per
/// 100 ms from 260 s to 340 s after the fill.
pub(crate) fn expiry_wave(label: &str, jitter: f64, beta: f64, rate: f64) -> Histogram {
    const KEYS: u32 = 10_000;
    let clock = MockClock::new();
    let cache = engine(&clock, 7);
    let policy = Policy::ttl(Duration::from_secs(300))
        .jitter(jitter)
        .xfetch_beta(beta)
        .build()
        .unwrap();
    let delta = Duration::from_secs(1);
    let keys: Vec<CacheKey> = (0..KEYS).map(|i| CacheKey::new(i.to_le_bytes())).collect();
    let fill = || Fill::new(Value::from_body("v")).origin_latency(delta);
    for key in &keys {
        cache.put(key, fill(), &policy);
    }
    // Poisson arrivals per key over the window, merged in time order.
    let (start, end) = (260.0f64, 340.0f64);
    let mut rng = SmallRng::seed_from_u64(11);
    let mut events: Vec<(f64, u32)> = Vec::new();
    for k in 0..KEYS {
        let mut t = start;
        loop {
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            if t >= end {
                break;
            }
            events.push((t, k));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut counts = vec![0.0; ((end - start) * 10.0) as usize];
    let mut now = 0.0f64;
    for (t, k) in events {
        clock.advance(Duration::from_secs_f64(t - now));
        now = t;
        let key = &keys[k as usize];
        let load = match cache.begin(key, &policy, &()) {
            Begin::Hit(hit) => hit.early_refresh,
            Begin::Miss(_) => true,
        };
        if load {
            counts[((t - start) * 10.0) as usize] += 1.0;
            cache.put(key, fill(), &policy);
        }
    }
    Histogram {
        title: format!("{label}: origin calls per 100 ms, 10,000 keys at {rate} req/s each"),
        x_label: "seconds after the fill".into(),
        buckets: counts
            .into_iter()
            .enumerate()
            .map(|(i, c)| (start + i as f64 / 10.0, c))
            .collect(),
    }
}

/// The one-line figures: peaks and rates the README quotes.
pub(crate) fn summary(hs: &[Histogram]) -> String {
    let rate_at = |secs: f64| {
        hs[2]
            .buckets
            .iter()
            .find(|b| b.0 == secs)
            .map(|b| b.1)
            .unwrap_or(f64::NAN)
    };
    format!(
        "cohort of 200: tallest 1-s expiry bucket {} without jitter, {} with jitter 0.1\n\
         XFetch (δ 5 s, β 1): fires on {:.1}% of hits 10 s before expiry (formula {:.1}%), {:.4}% at 290 s (formula {:.1e})\n\
         10,000 keys: peak origin calls per 100 ms: fixed TTL {}, jitter {}, jitter + XFetch {}",
        hs[0].peak(),
        hs[1].peak(),
        rate_at(10.0) * 100.0,
        (-2.0f64).exp() * 100.0,
        rate_at(290.0) * 100.0,
        (-58.0f64).exp(),
        hs[3].peak(),
        hs[4].peak(),
        hs[5].peak(),
    )
}

/// All experiments, in the order the example prints them.
pub(crate) fn all() -> Vec<Histogram> {
    vec![
        cohort(0.0),
        cohort(0.1),
        xfetch_rate(10_000),
        expiry_wave("fixed TTL", 0.0, 0.0, 2.0),
        expiry_wave("jitter 0.1", 0.1, 0.0, 2.0),
        expiry_wave("jitter 0.1 + XFetch", 0.1, 1.0, 2.0),
    ]
}

/// A terminal bar chart, `width` characters at the peak, at most `rows` rows
/// (buckets merged by summing, or by max for rates).
pub(crate) fn ascii(h: &Histogram, rows: usize, width: usize) -> String {
    let group = h.buckets.len().div_ceil(rows).max(1);
    let merged: Vec<(f64, f64)> = h
        .buckets
        .chunks(group)
        .map(|c| (c[0].0, c.iter().map(|b| b.1).fold(0.0, f64::max)))
        .collect();
    let peak = merged
        .iter()
        .map(|b| b.1)
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE);
    let mut out = format!(
        "{}\n  (peak {}; each row the max of {group} bucket(s))\n",
        h.title,
        fmt_num(h.peak())
    );
    for (x, v) in merged {
        let n = ((v / peak) * width as f64).round() as usize;
        out.push_str(&format!(
            "{x:>7.1} | {:<width$} {}\n",
            "#".repeat(n),
            fmt_num(v)
        ));
    }
    out
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

/// The histograms as one SVG document of stacked bar charts.
pub(crate) fn svg(hs: &[Histogram]) -> String {
    let (w, panel, pad) = (900.0, 180.0, 40.0);
    let height = hs.len() as f64 * (panel + pad * 1.5) + pad;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, h) in hs.iter().enumerate() {
        let top = pad + i as f64 * (panel + pad * 1.5);
        let (left, plot_w) = (60.0, w - 80.0);
        let peak = h.peak().max(f64::MIN_POSITIVE);
        let n = h.buckets.len() as f64;
        s.push_str(&format!(
            "<text x=\"{left}\" y=\"{}\" font-weight=\"bold\">{}</text>\n",
            top - 8.0,
            escape(&h.title)
        ));
        s.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{y}\" x2=\"{x2}\" y2=\"{y}\" stroke=\"#444\"/>\n<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{y}\" stroke=\"#444\"/>\n",
            y = top + panel,
            x2 = left + plot_w
        ));
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            left - 4.0,
            top + 10.0,
            fmt_num(h.peak())
        ));
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\n",
            left - 4.0,
            top + panel
        ));
        let bar_w = plot_w / n;
        for (j, (_, v)) in h.buckets.iter().enumerate() {
            if *v > 0.0 {
                let bh = v / peak * panel;
                s.push_str(&format!(
                    "<rect x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"#3b6ea8\"/>\n",
                    left + j as f64 * bar_w,
                    top + panel - bh,
                    (bar_w * 0.9).max(0.5),
                    bh
                ));
            }
        }
        let (first, last) = (h.buckets[0].0, h.buckets[h.buckets.len() - 1].0);
        s.push_str(&format!(
            "<text x=\"{left}\" y=\"{}\">{first}</text>\n",
            top + panel + 14.0
        ));
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{last}</text>\n",
            left + plot_w,
            top + panel + 14.0
        ));
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            left + plot_w / 2.0,
            top + panel + 14.0,
            escape(&h.x_label)
        ));
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
