//! Unsafe methods invalidate what they name, and nothing else.

use super::harness::*;

use axum::body::Body;
use axum::http::StatusCode;

#[tokio::test]
async fn successful_unsafe_methods_invalidate_the_target_in_l1_and_l2() {
    for h in Harness::both().await {
        for (i, method) in ["POST", "PUT", "PATCH", "DELETE", "PURGE"]
            .iter()
            .enumerate()
        {
            let target = format!("/item{i}?cc=max-age%3D60");
            h.get(&target).await;
            assert_eq!(h.get(&target).await.x_cache(), "HIT");
            let before = h.calls();
            let write = h
                .send(h.request(method, &target).body(Body::from("x")).unwrap())
                .await;
            assert_eq!(write.status, StatusCode::OK);
            let after = h.get(&target).await;
            assert_eq!(after.x_cache(), "MISS", "{} {method}", h.name);
            assert_eq!(h.calls(), before + 2, "{} {method}", h.name);
        }
        // A redirect is a success too (the classic POST → 303 See Other).
        let target = "/form?cc=max-age%3D60";
        h.get(target).await;
        let see_other = h
            .request("POST", target)
            .header("x-respond-status", "303")
            .body(Body::empty())
            .unwrap();
        assert_eq!(h.send(see_other).await.status, StatusCode::SEE_OTHER);
        assert_eq!(
            h.get(target).await.x_cache(),
            "MISS",
            "{} after a 303",
            h.name
        );
        // L2 too: an instance that never saw it finds nothing stale there.
        let target = "/item9?cc=max-age%3D60";
        h.get(target).await;
        h.stored_in_valkey().await;
        h.send(h.request("POST", target).body(Body::empty()).unwrap())
            .await;
        let fresh_eyes = h.sibling().await.get(target).await;
        assert_eq!(fresh_eyes.h("x-cache-tier"), "origin", "{}", h.name);
    }
}

#[tokio::test]
async fn failed_writes_and_cross_origin_locations_invalidate_nothing() {
    for h in Harness::both().await {
        let target = "/stock?cc=max-age%3D60";
        h.get(target).await;
        for status in ["500", "404", "403"] {
            let failed = h
                .request("POST", target)
                .header("x-respond-status", status)
                .body(Body::empty())
                .unwrap();
            h.send(failed).await;
            assert_eq!(
                h.get(target).await.x_cache(),
                "HIT",
                "{} after a {status}",
                h.name
            );
        }

        let elsewhere = "/list?cc=max-age%3D60";
        h.get(elsewhere).await;
        let foreign = h
            .request("POST", "/orders")
            .header("x-respond-status", "201")
            .header(
                "x-respond-location",
                "http://other.example/list?cc=max-age%3D60",
            )
            .body(Body::empty())
            .unwrap();
        h.send(foreign).await;
        assert_eq!(
            h.get(elsewhere).await.x_cache(),
            "HIT",
            "{}: cross-origin",
            h.name
        );
        let same = h
            .request("POST", "/orders")
            .header("x-respond-status", "201")
            .header("x-respond-location", "/list?cc=max-age%3D60")
            .body(Body::empty())
            .unwrap();
        h.send(same).await;
        assert_eq!(
            h.get(elsewhere).await.x_cache(),
            "MISS",
            "{}: same origin",
            h.name
        );
        // Its own host over https: what an application behind a TLS
        // terminator redirects to.
        assert_eq!(h.get(elsewhere).await.x_cache(), "HIT", "{}", h.name);
        let secure = h
            .request("POST", "/orders")
            .header("x-respond-status", "303")
            .header(
                "x-respond-location",
                format!("https://{HOST}/list?cc=max-age%3D60"),
            )
            .body(Body::empty())
            .unwrap();
        h.send(secure).await;
        assert_eq!(
            h.get(elsewhere).await.x_cache(),
            "MISS",
            "{}: its own host over https",
            h.name
        );
    }
}

/// RFC 9111 §4.4: a write invalidates the target URI, which is every
/// response stored for it, not only the anonymous one and the writer's own:
/// copies kept per credential (`public` responses to `Authorization`) go too,
/// and so does what an invalidation by URL names, on another instance too.
#[tokio::test]
async fn a_write_invalidates_every_users_copy_of_its_target() {
    for h in Harness::both().await {
        let alice = [("authorization", "Bearer alice")];
        let bob = [("authorization", "Bearer bob")];
        let target = "/shared?cc=public%2C%20max-age%3D60";
        for who in [&alice, &bob] {
            h.get_with(target, who).await;
            assert_eq!(h.get_with(target, who).await.x_cache(), "HIT", "{}", h.name);
        }
        let write = h.request("POST", target).body(Body::from("x")).unwrap();
        assert_eq!(h.send(write).await.status, StatusCode::OK);
        for who in [&alice, &bob] {
            let after = h.get_with(target, who).await;
            assert_eq!(after.x_cache(), "MISS", "{}: {who:?}", h.name);
        }
        // L2 too: the copies another instance stored are reached by tag.
        let target = "/shared2?cc=public%2C%20max-age%3D60";
        h.get_with(target, &alice).await;
        h.stored_in_valkey().await;
        h.send(h.request("POST", target).body(Body::empty()).unwrap())
            .await;
        let fresh_eyes = h.sibling().await.get_with(target, &alice).await;
        assert_eq!(fresh_eyes.h("x-cache-tier"), "origin", "{}", h.name);
    }
}
