use super::*;

/// Every engine counter in `Stats` that says something went wrong or
/// was held back reaches the exporter.
#[test]
fn deferred_refreshes_and_cancelled_fills_are_published() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let metrics = EngineMetrics::new(Sink::default());
    let mut stats = Stats::default();
    stats.refreshes_deferred = 2;
    stats.fills_cancelled = 3;
    stats.l2.reconnects_forced = 4;
    stats.l2.connection_errors = 6;
    metrics::with_local_recorder(&recorder, || metrics.publish(&stats, 0, 0));
    let text = handle.render();
    assert!(
        text.contains("tiercache_refreshes_deferred_total 2"),
        "{text}"
    );
    assert!(text.contains("tiercache_fills_cancelled_total 3"), "{text}");
    assert!(
        text.contains("tiercache_l2_reconnects_forced_total 4")
            && text.contains("tiercache_l2_connection_errors_total 6"),
        "{text}"
    );
}

/// A recorder is told what each metric counts once, not at every
/// publish (the Prometheus exporter logs each description until its
/// next render: unscraped, it grew every second); a new one is told.
#[test]
fn each_recorder_is_told_once() {
    use std::sync::atomic::AtomicUsize;
    #[derive(Default)]
    struct Told(AtomicUsize);
    impl Recorder for Told {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
            self.0.fetch_add(1, Relaxed);
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }
    let metrics = EngineMetrics::new(Sink::default());
    let (first, second) = (Told::default(), Told::default());
    for _ in 0..3 {
        metrics::with_local_recorder(&first, || metrics.publish(&Stats::default(), 0, 0));
    }
    metrics::with_local_recorder(&second, || metrics.publish(&Stats::default(), 0, 0));
    let counters = HELP
        .iter()
        .filter(|(_, kind, _)| matches!(kind, Kind::Counter))
        .count();
    assert_eq!(
        (first.0.load(Relaxed), second.0.load(Relaxed)),
        (counters, counters)
    );
}

/// Each metric a scrape shows says what it counts (`# HELP`).
#[test]
fn every_metric_is_described() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let metrics = EngineMetrics::new(Sink::default());
    let route = RouteMetrics::new("r", Sink::default());
    metrics::with_local_recorder(&recorder, || {
        metrics.publish(&Stats::default(), 0, 0);
        route.lock_wait(Duration::from_millis(1));
        route.lock_timeout();
    });
    let text = handle.render();
    let described = |name: &str| text.contains(&format!("# HELP {name} "));
    let shown: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert!(shown.len() > 20, "{text}");
    for name in shown {
        assert!(described(name), "{name} has no # HELP:\n{text}");
    }
}

/// Large bodies' page mappings are a process resource: their count and
/// the bodies that fell back to the heap are published with the rest.
#[test]
fn the_body_mappings_are_published() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let metrics = EngineMetrics::new(Sink::default());
    let held = body::copy(&vec![1; 64 * 1024]);
    metrics::with_local_recorder(&recorder, || metrics.publish(&Stats::default(), 0, 0));
    let text = handle.render();
    let mappings: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tiercache_body_mappings "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no tiercache_body_mappings in {text}"));
    assert!(mappings >= 1.0, "{text}");
    assert!(
        text.contains("tiercache_body_heap_fallbacks_total "),
        "{text}"
    );
    drop(held);
}
