//! An L2 hit through the engine vs a raw fred `GET` of the same bytes, on a
//! real Valkey started by the testkit.
//!
//! Run: `cargo bench --bench l2`
//!
//! The engine's L2 hit is `GET`+`PTTL` pipelined in one round trip, the
//! envelope decoded (checksum included) and the entry promoted into L1. The
//! last section alternates raw and engine rounds (A B A B …, 15 rounds of
//! 2,000 reads) and prints the median ratio with its min–max.
//!
//! The write queue: 2,000 fills, each with its fleet lock's release behind
//! it, queued then flushed, against raw fred pipelines of the same commands
//! in the same run (the last line printed). Measured 2026-12-03: 60.7 ms,
//! 32,927 fills/s, 1.45x raw; before releases joined the fills' pipelines
//! 954 ms, 2,095 fills/s, 22.1x.
//!
//! Last measured (2 cores, shared machine, 2026-12-03, CRC-32 envelope):
//! criterion raw GET 114 µs, engine L2 hit 137 µs; alternating ratio median
//! 1.16 (min 1.06, max 1.24). The day before, with the BLAKE3 checksum: raw
//! 87 µs, engine 97 µs, ratio median 1.17 (min 1.05, max 3.15).

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use fred::prelude::KeysInterface;
use tiercache::core::{CacheKey, Fill, Value};
use tiercache::valkey::{ValkeyConfig, ValkeyTier};
use tiercache::{Policy, TieredCache};
use tiercache_testkit::ValkeyServer;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = ValkeyServer::start();
    let key = CacheKey::new("bench:product:7");
    let (engine, tier, vkey) = rt.block_on(async {
        let config = ValkeyConfig::from_url(&server.url())
            .unwrap()
            .command_timeout(Duration::from_secs(1));
        let tier = ValkeyTier::connect(config).await.unwrap();
        let engine = TieredCache::builder()
            .l2(tier.clone())
            .sweep_interval(None)
            .build()
            .unwrap();
        let value = Value {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from(vec![b'x'; 2048]),
        };
        engine.put(
            &key,
            Fill::new(value),
            &Policy::ttl(Duration::from_secs(3600)).build().unwrap(),
        );
        let vkey = tier.entry_key(&key);
        for _ in 0..200 {
            engine.forget_local(&key);
            if engine.get(&key).await.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (engine, tier, vkey)
    });
    let raw = || async {
        let v: Option<Bytes> = tier.client().get(&vkey).await.unwrap();
        v.unwrap().len()
    };
    let hit = || async {
        // L1 dropped first, so the read goes to L2 (and promotes again).
        engine.forget_local(&key);
        engine.get(&key).await.unwrap().body.len()
    };
    rt.block_on(async { assert!(raw().await > 2048 && hit().await == 2048) });

    let mut group = c.benchmark_group("l2");
    group.bench_function("raw_fred_get", |b| {
        b.to_async(&rt).iter(|| async { black_box(raw().await) })
    });
    group.bench_function("engine_l2_hit", |b| {
        b.to_async(&rt).iter(|| async { black_box(hit().await) })
    });
    group.finish();

    const ROUNDS: usize = 15;
    const PER_ROUND: u32 = 2_000;
    let mut ratios = Vec::with_capacity(ROUNDS);
    rt.block_on(async {
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for _ in 0..PER_ROUND {
                black_box(raw().await);
            }
            let raw_t = t.elapsed();
            let t = Instant::now();
            for _ in 0..PER_ROUND {
                black_box(hit().await);
            }
            ratios.push(t.elapsed().as_secs_f64() / raw_t.as_secs_f64());
        }
    });
    ratios.sort_by(f64::total_cmp);
    println!(
        "ratio engine_l2_hit / raw_fred_get: median {:.3} (min {:.3}, max {:.3}) over {ROUNDS} alternating rounds",
        ratios[ROUNDS / 2],
        ratios[0],
        ratios[ROUNDS - 1]
    );
    write_queue(&rt, &server);
}

/// How fast the write queue drains a burst of misses: `FILLS` fills, each
/// with its fleet lock's release behind it (what every miss of a fleet
/// queues), from the first `put` to `flush`; against raw fred pipelines of
/// the same commands (`SET PX`, the unlock `EVAL`, `SPUBLISH`), 64 fills a
/// round trip, in the same run.
fn write_queue(rt: &tokio::runtime::Runtime, server: &ValkeyServer) {
    use fred::prelude::{ClientLike, PubsubInterface};
    use fred::types::{ClusterHash, CustomCommand, Expiration};
    use tiercache::core::{Entry, LockAttempt, Tier, Times, Unlocked};

    const FILLS: usize = 2_000;
    rt.block_on(async {
        let config = ValkeyConfig::from_url(&server.url())
            .unwrap()
            .command_timeout(Duration::from_secs(5));
        let tier = ValkeyTier::connect(config).await.unwrap();
        let now = std::time::SystemTime::now();
        let times = Times::fresh(now, now + Duration::from_secs(60));
        let body = Bytes::from(vec![b'x'; 2048]);
        let mut locked = Vec::with_capacity(FILLS);
        for i in 0..FILLS {
            let key = CacheKey::new(format!("bench:queue:{i}"));
            match tier.try_lock(&key, Duration::from_secs(30)).await.unwrap() {
                LockAttempt::Acquired(token) => locked.push((key, token)),
                _ => panic!("a fresh key's lock is free"),
            }
        }
        let t = Instant::now();
        for (key, token) in &locked {
            let entry = Entry::new(
                key.full().clone(),
                Bytes::new(),
                Value::from_body(body.clone()),
                times,
                Duration::ZERO,
            );
            tier.put(key, &entry, Duration::from_secs(60), &[]);
            tier.unlock(key, token, Unlocked::Filled);
        }
        tier.flush().await;
        let queued = t.elapsed();
        let report = tier.report();
        assert_eq!(report.write_drops, 0, "the burst fits the queue");

        let client = tier.client();
        let t = Instant::now();
        for chunk in (0..FILLS).collect::<Vec<_>>().chunks(64) {
            let pipe = client.pipeline();
            for i in chunk {
                let key = format!("bench:raw:{i}");
                let _: () = pipe
                    .set(&key, body.clone(), Some(Expiration::PX(60_000)), None, false)
                    .await
                    .unwrap();
                let eval = CustomCommand::new_static("EVAL", ClusterHash::Offset(2), false);
                let script = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
                let args: Vec<fred::prelude::Value> =
                    vec![script.into(), 1.into(), format!("{key}:lock").into(), "t".into()];
                let _: () = pipe.custom(eval, args).await.unwrap();
                let _: () = pipe.spublish(format!("{key}:done"), "1").await.unwrap();
            }
            let _: Vec<fred::prelude::Value> = pipe.all().await.unwrap();
        }
        let raw = t.elapsed();
        println!(
            "write queue: {FILLS} fills with their lock releases, queued then flushed: {:.1} ms; raw pipelines of the same commands {:.1} ms (ratio {:.2}); {:.0} fills/s",
            queued.as_secs_f64() * 1e3,
            raw.as_secs_f64() * 1e3,
            queued.as_secs_f64() / raw.as_secs_f64(),
            FILLS as f64 / queued.as_secs_f64()
        );
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
