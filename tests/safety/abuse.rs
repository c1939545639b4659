//! Large bodies and floods stay within bounds.

use super::harness::*;

#[tokio::test]
async fn a_20_mb_body_streams_through_intact_and_unstored() {
    for h in Harness::both().await {
        let target = "/big?size=20000000&cc=max-age%3D60";
        for _ in 0..2 {
            let r = h.get(target).await;
            assert_eq!(r.body.len(), 20_000_000, "{}", h.name);
            assert!(r.body == big_body(20_000_000), "{}: bytes changed", h.name);
            // Too large; the second time the key is known uncacheable.
            let status = r.h("cache-status");
            assert!(
                status.contains("too-large") || status.contains("hit-for-miss"),
                "{status}"
            );
        }
        assert_eq!(h.calls(), 2, "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn a_flood_of_unique_urls_keeps_l1_in_its_budget() {
    let budget = 256 * 1024;
    let settings = Settings {
        l1_capacity: budget,
        ..Settings::default()
    };
    for h in [
        Harness::layer(settings.clone()).await,
        Harness::proxy(settings).await,
    ] {
        for i in 0..1500 {
            h.get(&format!("/flood/{i}?size=1000&cc=max-age%3D60"))
                .await;
        }
        let engine = h.engine();
        assert!(
            engine.l1_weighted_size() <= budget,
            "{}: {} bytes",
            h.name,
            engine.l1_weighted_size()
        );
        assert!(engine.l1_entry_count() < 1500, "{}", h.name);
        assert_eq!(engine.in_flight(), 0, "{}", h.name);
        assert!(engine.stats().evicted > 0, "{}", h.name);
    }
}
