//! RFC 9111 behaviours a conformance suite checks, through the layer and
//! through the proxy, each against a real Valkey.

use std::time::Duration;

use axum::http::StatusCode;

use super::harness::*;

#[tokio::test]
async fn a_single_range_is_cut_from_the_stored_response() {
    for h in Harness::both().await {
        let target = "/ranged?size=100&etag=%22r1%22&cc=max-age%3D60";
        let r = h.get_with(target, &[("range", "bytes=10-19")]).await;
        assert_eq!(r.status, StatusCode::PARTIAL_CONTENT, "{}", h.name);
        assert_eq!(r.h("content-range"), "bytes 10-19/100", "{}", h.name);
        assert_eq!(r.body, big_body(100)[10..20], "{}", h.name);
        let r = h
            .get_with(target, &[("range", "bytes=-5"), ("if-range", "\"r1\"")])
            .await;
        assert_eq!(
            (r.status, r.x_cache()),
            (StatusCode::PARTIAL_CONTENT, "HIT"),
            "{}",
            h.name
        );
        assert_eq!(r.body, big_body(100)[95..], "{}", h.name);
        let r = h.get_with(target, &[("range", "bytes=100-")]).await;
        assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE, "{}", h.name);
        assert_eq!(r.h("content-range"), "bytes */100", "{}", h.name);
        assert_eq!(h.calls(), 1, "{}: the origin sent the whole once", h.name);
    }
}

#[tokio::test]
async fn client_validators_are_answered_on_passed_responses() {
    for h in Harness::both().await {
        let target = "/passed?etag=%22p1%22&cc=private";
        let r = h.get_with(target, &[("if-none-match", "\"p1\"")]).await;
        assert_eq!(r.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        assert!(r.body.is_empty(), "{}", h.name);
        assert_eq!(r.h("etag"), "\"p1\"", "{}", h.name);
    }
}

#[tokio::test]
async fn an_expired_entry_is_revalidated_with_its_validator() {
    for h in Harness::both().await {
        let target = "/doc?etag=%22d1%22&cc=max-age%3D1";
        let first = h.get(target).await;
        assert_eq!(first.status, StatusCode::OK, "{}", h.name);
        // Past its lifetime (the proxy's clock is the wall clock).
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let again = h.get(target).await;
        assert_eq!(again.status, StatusCode::OK, "{}", h.name);
        assert_eq!(
            again.text(),
            first.text(),
            "{}: the 304 renewed the entry",
            h.name
        );
        let seen = h.origin.validators.lock().unwrap().clone();
        assert_eq!(
            seen,
            vec![None, Some("\"d1\"".to_owned())],
            "{}: the second call carried the entry's validator",
            h.name
        );
    }
}

#[tokio::test]
async fn proxy_specific_fields_are_never_replayed() {
    for h in Harness::both().await {
        let target = "/pai?pai=nextnonce%3D%22abc%22&cc=max-age%3D60";
        h.get(target).await;
        let hit = h.get(target).await;
        assert_eq!(hit.x_cache(), "HIT", "{}", h.name);
        assert_eq!(hit.h("proxy-authentication-info"), "", "{}", h.name);
    }
}

#[tokio::test]
async fn a_location_with_dot_segments_invalidates_its_target() {
    for h in Harness::both().await {
        let target = "/shop/cart?cc=max-age%3D60";
        h.get(target).await;
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
        let post = h
            .request("POST", "/shop/items/7")
            .header("x-respond-location", "/shop/items/../cart?cc=max-age%3D60")
            .body(axum::body::Body::empty())
            .unwrap();
        h.send(post).await;
        assert_ne!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
    }
}

#[tokio::test]
async fn only_if_cached_answers_from_storage_or_504_without_the_origin() {
    for h in Harness::both().await {
        let target = "/kept?cc=max-age%3D60&vary=accept-language";
        let ask = |language: &'static str| {
            [
                ("cache-control", "only-if-cached"),
                ("accept-language", language),
            ]
        };
        // Nothing stored: 504, and the origin is never asked.
        let r = h.get_with(target, &ask("fr")).await;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", h.name);
        // Neither a hit nor forwarded, and no tier answered.
        assert_eq!(
            (r.h("cache-status"), r.x_cache(), r.h("x-cache-tier")),
            ("tiercache; detail=only-if-cached", "MISS", ""),
            "{}",
            h.name
        );
        let only = |method| {
            h.request(method, target)
                .header("cache-control", "only-if-cached")
                .body(axum::body::Body::empty())
                .unwrap()
        };
        let head = h.send(only("HEAD")).await;
        assert_eq!(
            (head.status, head.body.len()),
            (StatusCode::GATEWAY_TIMEOUT, 0),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 0, "{}", h.name);
        // Another safe method is no read of storage: it goes on as before.
        let options = h.send(only("OPTIONS")).await;
        assert_eq!(options.status, StatusCode::OK, "{}", h.name);
        let before = h.calls();

        // Stored: answered, for the variant stored only.
        h.get_with(target, &[("accept-language", "fr")]).await;
        let r = h.get_with(target, &ask("fr")).await;
        assert_eq!(
            (r.status, r.x_cache()),
            (StatusCode::OK, "HIT"),
            "{}",
            h.name
        );
        let r = h.get_with(target, &ask("en")).await;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", h.name);
        // A request that skips the cache has nothing stored either.
        let mut skipping = ask("fr").to_vec();
        skipping.push(("if-match", "\"v1\""));
        let r = h.get_with(target, &skipping).await;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", h.name);
        // With `no-cache` too (ignored unless the route honours it).
        let r = h
            .get_with(
                target,
                &[
                    ("cache-control", "no-cache, only-if-cached"),
                    ("accept-language", "fr"),
                ],
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", h.name);
        assert_eq!(h.calls(), before + 1, "{}", h.name);

        // Another instance (its own L1) answers from L2.
        h.stored_in_valkey().await;
        let calls = h.calls();
        let sibling = h.sibling().await;
        let r = sibling.get_with(target, &ask("fr")).await;
        assert_eq!(
            (r.status, r.h("x-cache-tier")),
            (StatusCode::OK, "l2"),
            "{}",
            h.name
        );
        let r = sibling.get_with(target, &ask("en")).await;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", h.name);
        assert_eq!(h.calls(), calls, "{}", h.name);
    }
}
