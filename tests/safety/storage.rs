//! What is stored and reused, and what never is.

use super::harness::*;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tiercache::{ResponseCacheLayer, TieredCache};
use tower::ServiceExt;

#[tokio::test]
async fn set_cookie_responses_reach_the_origin_every_time_and_are_never_stored() {
    for h in Harness::both().await {
        for _ in 0..2 {
            let r = h.get("/login?set_cookie=session%3Dalice").await;
            assert_eq!(r.h("set-cookie"), "session=alice", "{}", h.name);
            assert_ne!(r.x_cache(), "HIT", "{}", h.name);
        }
        assert_eq!(h.calls(), 2, "{}: both requests reach the origin", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn bob_never_sees_alices_authorization_response() {
    for h in Harness::both().await {
        let alice = [("authorization", "Bearer alice")];
        let bob = [("authorization", "Bearer bob")];
        // Not marked shareable: every credentialed request goes to the origin.
        let a = h.get_with("/me", &alice).await;
        assert!(a.text().contains("Bearer alice"), "{}", h.name);
        let b = h.get_with("/me", &bob).await;
        assert!(b.text().contains("Bearer bob"), "{}", h.name);
        assert!(!b.text().contains("alice"), "{}: {}", h.name, b.text());
        let a2 = h.get_with("/me", &alice).await;
        assert!(a2.text().contains("call=3"), "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);

        // `public` lets a credentialed response be stored (RFC 9111 §3.5),
        // for that credential only.
        let target = "/me-public?cc=public%2C%20max-age%3D60";
        let a = h.get_with(target, &alice).await;
        let a2 = h.get_with(target, &alice).await;
        assert_eq!((a.x_cache(), a2.x_cache()), ("MISS", "HIT"), "{}", h.name);
        assert_eq!(a.body, a2.body);
        let b = h.get_with(target, &bob).await;
        assert_ne!(b.x_cache(), "HIT", "{}", h.name);
        assert!(b.text().contains("Bearer bob") && !b.text().contains("alice"));
        let anonymous = h.get(target).await;
        assert!(!anonymous.text().contains("Bearer"), "{}", h.name);
        assert_eq!(h.calls(), 6, "{}", h.name);
    }
}

#[tokio::test]
async fn bob_never_sees_alices_cookie_response() {
    for h in Harness::both().await {
        let a = h.get_with("/cart", &[("cookie", "session=alice")]).await;
        let b = h.get_with("/cart", &[("cookie", "session=bob")]).await;
        assert_eq!(a.x_cache(), "BYPASS", "{}", h.name);
        assert!(a.text().contains("session=alice"));
        assert!(b.text().contains("session=bob") && !b.text().contains("alice"));
        assert_eq!(h.calls(), 2, "{}", h.name);
    }
}

#[tokio::test]
async fn cookie_opt_ins_ignore_or_key_on_named_cookies() {
    let h = Harness::layer(Settings::default()).await;
    // Ignored: the origin never sees the cookie, so one answer fits everyone.
    let a = h
        .get_with("/ignore/logo", &[("cookie", "session=alice")])
        .await;
    let b = h
        .get_with("/ignore/logo", &[("cookie", "session=bob")])
        .await;
    assert!(!a.text().contains("session"), "{}", a.text());
    assert_eq!((a.x_cache(), b.x_cache()), ("MISS", "HIT"));
    assert_eq!(h.calls(), 1);

    // Keyed on `lang`: the origin sees only that cookie; languages stay apart.
    let fr_alice = h
        .get_with("/lang/home", &[("cookie", "session=alice; lang=fr")])
        .await;
    assert!(
        fr_alice.text().contains("cookie: lang=fr\n"),
        "{}",
        fr_alice.text()
    );
    assert!(!fr_alice.text().contains("alice"));
    let fr_bob = h
        .get_with("/lang/home", &[("cookie", "lang=fr; session=bob")])
        .await;
    assert_eq!(fr_bob.x_cache(), "HIT");
    let en = h.get_with("/lang/home", &[("cookie", "lang=en")]).await;
    assert_eq!(en.x_cache(), "MISS");
    assert!(en.text().contains("cookie: lang=en\n"));
    assert_eq!(h.calls(), 3);
}

#[tokio::test]
async fn private_and_no_store_are_never_stored() {
    for h in Harness::both().await {
        let refused = [
            "/p1?cc=private",
            "/p2?cc=private%3D%22x-user%22%2C%20max-age%3D60",
            "/p3?cc=no-store%2C%20max-age%3D60",
            "/p4?cc=NO-STORE",
            "/p5?cc=public%2C%20max-age%3D60%2C%20No-Store",
            // A quote never closed: the directive after it still counts.
            "/p7?cc=max-age%3D60%2C%20x-note%3D%22beta%2C%20private",
        ];
        for target in refused {
            for _ in 0..2 {
                let r = h.get(target).await;
                assert_ne!(r.x_cache(), "HIT", "{} {target}", h.name);
            }
        }
        // A request's own `no-store` keeps a storable response out too.
        for _ in 0..2 {
            let r = h
                .get_with("/p6?cc=max-age%3D60", &[("cache-control", "no-store")])
                .await;
            assert_eq!(r.x_cache(), "BYPASS", "{}", h.name);
        }
        assert_eq!(h.calls(), 14, "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}: nothing private or no-store in Valkey (SCAN)",
            h.name
        );
    }
}

#[tokio::test]
async fn vary_variants_stay_apart_in_l1_and_l2() {
    for h in Harness::both().await {
        let target = "/news?vary=accept-language&cc=max-age%3D60";
        let en = [("accept-language", "en")];
        let fr = [("accept-language", "fr")];
        let r_en = h.get_with(target, &en).await;
        let r_fr = h.get_with(target, &fr).await;
        assert!(r_en.text().contains("accept-language: en"), "{}", h.name);
        assert!(r_fr.text().contains("accept-language: fr"), "{}", h.name);
        assert_eq!(h.calls(), 2, "{}", h.name);
        // Both variants are kept, each answers only its own requests.
        let again_en = h.get_with(target, &en).await;
        let again_fr = h.get_with(target, &fr).await;
        assert_eq!(
            (again_en.x_cache(), again_fr.x_cache()),
            ("HIT", "HIT"),
            "{}",
            h.name
        );
        assert_eq!(
            (again_en.body.clone(), again_fr.body.clone()),
            (r_en.body.clone(), r_fr.body.clone())
        );
        let none = h.get(target).await;
        assert_ne!(none.x_cache(), "HIT", "{}", h.name);
        assert!(
            !none.text().contains("accept-language:"),
            "{}: {}",
            h.name,
            none.text()
        );
        assert_eq!(h.calls(), 3, "{}", h.name);

        // Another instance finds each variant in L2.
        let sibling = h.sibling().await;
        let s_fr = sibling.get_with(target, &fr).await;
        let s_en = sibling.get_with(target, &en).await;
        assert_eq!(
            (s_fr.h("x-cache-tier"), s_en.h("x-cache-tier")),
            ("l2", "l2"),
            "{}",
            h.name
        );
        assert_eq!((s_fr.body, s_en.body), (r_fr.body, r_en.body), "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);
    }
}

#[tokio::test]
async fn vary_star_is_never_reused_in_any_spelling() {
    for h in Harness::both().await {
        for (i, vary) in ["*", "accept%2C%20*", "Accept-Language%2C*%2Caccept"]
            .iter()
            .enumerate()
        {
            let target = format!("/star{i}?vary={vary}&cc=max-age%3D60");
            for _ in 0..2 {
                assert_ne!(h.get(&target).await.x_cache(), "HIT", "{} {vary}", h.name);
            }
        }
        assert_eq!(h.calls(), 6, "{}", h.name);
    }
}

#[tokio::test]
async fn a_vary_explosion_stops_at_the_cap() {
    for h in Harness::both().await {
        let target = "/explode?vary=x-tenant&cc=max-age%3D60";
        for i in 0..40 {
            let r = h.get_with(target, &[("x-tenant", &format!("t{i}"))]).await;
            assert_eq!(r.x_cache(), "MISS", "{}", h.name);
        }
        assert_eq!(h.calls(), 40);
        // The first 32 were stored and stay; the rest were not.
        for i in 0..32 {
            let r = h.get_with(target, &[("x-tenant", &format!("t{i}"))]).await;
            assert_eq!(r.x_cache(), "HIT", "{} t{i}", h.name);
            assert!(r.text().contains(&format!("x-tenant: t{i}\n")));
        }
        let past = h.get_with(target, &[("x-tenant", "t35")]).await;
        assert_eq!(past.x_cache(), "MISS", "{}", h.name);
        assert!(
            past.h("cache-status").contains("detail=vary-limit"),
            "{}",
            past.h("cache-status")
        );
        assert_eq!(h.calls(), 41, "{}", h.name);
    }
}

#[tokio::test]
async fn a_coded_body_without_vary_goes_only_to_clients_that_accept_it() {
    for h in Harness::both().await {
        let target = "/asset?ce=gzip&cc=max-age%3D60";
        let gzip = [("accept-encoding", "gzip, br")];
        h.get_with(target, &gzip).await;
        assert_eq!(
            h.get_with(target, &gzip).await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 1);
        for refuses in [
            &[][..],
            &[("accept-encoding", "br")],
            &[("accept-encoding", "gzip;q=0")],
        ] {
            let r = h.get_with(target, refuses).await;
            assert_ne!(r.x_cache(), "HIT", "{} {refuses:?}", h.name);
        }
        assert_eq!(h.calls(), 4, "{}", h.name);
    }
}

/// A body in a coding the cache does not know, varied on `Accept-Encoding`:
/// such codings share a variant (so a client cannot mint variants), and the
/// entry's own coding still decides who may get it: never a client that
/// does not accept it.
#[tokio::test]
async fn a_varied_body_in_an_unknown_coding_goes_only_to_clients_that_accept_it() {
    for h in Harness::both().await {
        let target = "/packed?ce=compress&vary=accept-encoding&cc=max-age%3D60";
        let compress = [("accept-encoding", "compress")];
        h.get_with(target, &compress).await;
        let again = h.get_with(target, &compress).await;
        assert_eq!(again.x_cache(), "HIT", "{}", h.name);
        for refuses in [&[][..], &[("accept-encoding", "x-custom")]] {
            let r = h.get_with(target, refuses).await;
            assert_ne!(r.x_cache(), "HIT", "{} {refuses:?}", h.name);
        }
        assert_eq!(h.calls(), 3, "{}", h.name);
    }
}

#[tokio::test]
async fn no_cache_responses_are_stored_and_revalidated_before_each_reuse() {
    for h in Harness::both().await {
        let target = "/rev?cc=no-cache&etag=%22v1%22";
        let first = h.get(target).await;
        assert_eq!(first.status, StatusCode::OK);
        for n in 2..=3 {
            let r = h.get(target).await;
            assert_eq!(r.status, StatusCode::OK, "{}", h.name);
            assert_eq!(
                r.body, first.body,
                "{}: the stored body, renewed by a 304",
                h.name
            );
            assert_eq!(h.calls(), n, "{}: revalidated on every reuse", h.name);
        }
        assert_eq!(
            h.origin.validators(),
            vec![None, Some("\"v1\"".into()), Some("\"v1\"".into())],
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn validators_are_answered_from_the_cache_with_304() {
    for h in Harness::both().await {
        let lm = "Sun, 06 Nov 1994 08:49:37 GMT";
        let target =
            "/doc?cc=max-age%3D60&etag=%22v1%22&lm=Sun%2C%2006%20Nov%201994%2008%3A49%3A37%20GMT";
        // Cold: the origin gets no validator (its 200 is stored), the client its 304.
        let cold = h.get_with(target, &[("if-none-match", "\"v1\"")]).await;
        assert_eq!(cold.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        assert_eq!(h.origin.validators(), vec![None], "{}", h.name);
        assert!(cold.body.is_empty());
        assert_eq!(cold.h("etag"), "\"v1\"");

        let other = h.get_with(target, &[("if-none-match", "\"v0\"")]).await;
        assert_eq!(
            (other.status, other.x_cache()),
            (StatusCode::OK, "HIT"),
            "{}",
            h.name
        );
        assert!(other.text().contains("call=1"));
        let weak = h
            .get_with(target, &[("if-none-match", "\"v0\", W/\"v1\"")])
            .await;
        assert_eq!(
            (weak.status, weak.x_cache()),
            (StatusCode::NOT_MODIFIED, "HIT")
        );
        assert_eq!(weak.h("cache-control"), "max-age=60");
        let since = h.get_with(target, &[("if-modified-since", lm)]).await;
        assert_eq!(since.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        let before = h
            .get_with(
                target,
                &[("if-modified-since", "Sat, 05 Nov 1994 08:49:37 GMT")],
            )
            .await;
        assert_eq!(before.status, StatusCode::OK, "{}", h.name);
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

#[tokio::test]
async fn age_counts_the_origins_age_and_the_time_stored() {
    for h in Harness::both().await {
        let target = "/aged?cc=max-age%3D60&age=10";
        h.get(target).await;
        let hit = h.get(target).await;
        assert_eq!((hit.x_cache(), hit.h("age")), ("HIT", "10"), "{}", h.name);
        let ttl = hit.h("cache-status");
        assert!(
            ttl.contains("ttl=4") || ttl.contains("ttl=5"),
            "{}: 60 s − 10 s, jittered down: {ttl}",
            h.name
        );
    }
}

#[tokio::test]
async fn headers_round_trip_byte_exact_through_l1_and_l2_without_hop_by_hop_ones() {
    for h in Harness::both().await {
        let target = "/fields?cc=max-age%3D60&hop";
        h.get(target).await;
        let l1 = h.get(target).await;
        let l2 = h.sibling().await.get(target).await;
        for (tier, r) in [("l1", &l1), ("l2", &l2)] {
            assert_eq!(r.h("x-cache-tier"), tier, "{}", h.name);
            assert_eq!(r.h("x-case"), "MiXeD;Value=\"1\"", "{} {tier}", h.name);
            let multi: Vec<_> = r.headers.get_all("x-multi").iter().collect();
            assert_eq!(multi, ["a", "b"], "{} {tier}", h.name);
            assert_eq!(
                r.headers.get("x-empty").map(|v| v.as_bytes()),
                Some(&b""[..])
            );
            assert!(
                !r.headers.contains_key("x-hop"),
                "{} {tier}: named in Connection",
                h.name
            );
            assert!(!r.headers.contains_key("keep-alive"), "{} {tier}", h.name);
            assert_eq!(r.body, l1.body);
        }
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

#[tokio::test]
async fn targeted_cache_control_wins_for_this_cache() {
    for h in Harness::both().await {
        let stored = "/cdn1?cc=no-store&cdn=max-age%3D60";
        h.get(stored).await;
        assert_eq!(h.get(stored).await.x_cache(), "HIT", "{}", h.name);
        for refused in [
            "/cdn2?cc=max-age%3D60&cdn=no-store",
            "/cdn3?cc=max-age%3D60&cdn=private",
            // Qualified, as RFC 9111 allows: no less private.
            "/cdn4?cc=max-age%3D60&cdn=private%3D%22set-cookie%22%2C%20max-age%3D60",
            "/cdn5?cc=max-age%3D60&cdn=no-cache%3D%22set-cookie%22%2C%20max-age%3D60",
        ] {
            h.get(refused).await;
            assert_ne!(
                h.get(refused).await.x_cache(),
                "HIT",
                "{} {refused}",
                h.name
            );
        }
        assert_eq!(h.calls(), 9, "{}", h.name);
    }
}

#[tokio::test]
async fn a_client_cannot_push_load_onto_the_origin_unless_allowed() {
    for h in Harness::both().await {
        let target = "/busy?cc=max-age%3D60";
        h.get(target).await;
        for ask in [
            ("cache-control", "no-cache"),
            ("cache-control", "max-age=0"),
            ("pragma", "no-cache"),
            ("cache-control", "no-cache, x-unknown-directive=1"),
        ] {
            assert_eq!(
                h.get_with(target, &[ask]).await.x_cache(),
                "HIT",
                "{} {ask:?}",
                h.name
            );
        }
        assert_eq!(h.calls(), 1, "{}", h.name);
    }

    // Opted in: a reload goes to the origin and refreshes the entry.
    let origin = Origin::default();
    let engine = TieredCache::builder().sweep_interval(None).build().unwrap();
    let layer = ResponseCacheLayer::new(engine).honor_client_no_cache(true);
    let app = origin_app(&origin, Some(&layer));
    let send = |headers: &'static [(&'static str, &'static str)]| {
        let app = app.clone();
        async move {
            let mut b = Request::get("/busy").header("host", HOST);
            for (n, v) in headers {
                b = b.header(*n, *v);
            }
            let res = app.oneshot(b.body(Body::empty()).unwrap()).await.unwrap();
            String::from_utf8_lossy(&res.into_body().collect().await.unwrap().to_bytes())
                .into_owned()
        }
    };
    send(&[]).await;
    let reloaded = send(&[("cache-control", "no-cache")]).await;
    assert!(reloaded.contains("call=2"), "{reloaded}");
    assert!(
        send(&[]).await.contains("call=2"),
        "the reload refreshed the entry"
    );
    // A reload that may not reach the origin: nothing stored answers it.
    let neither = send(&[("cache-control", "no-cache, only-if-cached")]).await;
    assert!(neither.starts_with("nothing stored answers"), "{neither}");
    assert!(
        send(&[("cache-control", "only-if-cached")])
            .await
            .contains("call=2")
    );
    assert_eq!(origin.calls.get(), 2);
}

#[tokio::test]
async fn errors_are_stored_only_with_explicit_freshness_and_never_long() {
    for h in Harness::both().await {
        for status in [400, 403, 405, 414, 501, 500, 502, 503] {
            let target = format!("/err{status}?status={status}");
            h.get(&target).await;
            assert_ne!(h.get(&target).await.x_cache(), "HIT", "{} {status}", h.name);
        }
        assert_eq!(h.calls(), 16, "{}", h.name);
        // 404 is the route's negative cache; 4xx with max-age is capped at 60 s.
        h.get("/gone?status=404").await;
        assert_eq!(
            h.get("/gone?status=404").await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        let target = "/forbidden?status=403&cc=max-age%3D86400";
        h.get(target).await;
        let hit = h.get(target).await;
        assert_eq!(hit.x_cache(), "HIT", "{}", h.name);
        let ttl: u64 = hit
            .h("cache-status")
            .split("ttl=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ttl <= 60, "{}: an error kept {ttl} s", h.name);
        // 5xx with explicit freshness: stored, capped like any error (RFC
        // 9111 allows it; Traffic Server, httpd and nginx do it).
        let target = "/down?status=503&cc=max-age%3D86400";
        h.get(target).await;
        let second = h.get(target).await;
        assert_eq!(second.x_cache(), "HIT", "{}", h.name);
        assert!(!second.h("cache-status").contains("ttl=86"), "{}", h.name);
        assert_eq!(h.calls(), 19, "{}", h.name);
    }
}

#[tokio::test]
async fn the_proxy_without_ttl_stores_only_explicit_freshness() {
    let h = Harness::proxy(Settings {
        ttl: None,
        ..Settings::default()
    })
    .await;
    for target in ["/plain", "/missing?status=404", "/moved?status=301"] {
        h.get(target).await;
        assert_ne!(h.get(target).await.x_cache(), "HIT", "{target}");
    }
    assert_eq!(h.calls(), 6);
    for target in ["/fresh?cc=max-age%3D60", "/cdn?cdn=s-maxage%3D60"] {
        h.get(target).await;
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{target}");
    }
    assert_eq!(h.calls(), 8);
}

/// Two `Authorization` fields: the origin may read either, so the key holds
/// both; a request with only the first never gets that answer.
#[tokio::test]
async fn every_authorization_field_is_in_the_key() {
    for h in Harness::both().await {
        let target = "/two-auth?cc=public%2C%20max-age%3D60";
        let both = [
            ("authorization", "Bearer alice"),
            ("authorization", "Bearer mallory"),
        ];
        h.get_with(target, &both).await;
        assert_eq!(
            h.get_with(target, &both).await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        let alice = h
            .get_with(target, &[("authorization", "Bearer alice")])
            .await;
        assert_eq!(alice.x_cache(), "MISS", "{}", h.name);
    }
}

/// A response passed for its `Set-Cookie` still answers the client's
/// validator with a 304, and that 304 keeps the cookie: it is this
/// client's (a black-box audit saw it dropped, the user's session lost).
#[tokio::test]
async fn a_304_cut_from_a_passed_response_keeps_its_cookie() {
    for h in Harness::both().await {
        let target = "/doc?cc=max-age%3D60&etag=%22v1%22&set_cookie=s%3D1";
        let r = h.get_with(target, &[("if-none-match", "\"v1\"")]).await;
        assert_eq!(r.status, StatusCode::NOT_MODIFIED, "{}", h.name);
        assert_eq!(r.h("set-cookie"), "s=1", "{}", h.name);
    }
}

/// A request for a key known not to be stored (hit-for-miss: here its
/// responses set cookies; a body over `max_body` is the common case) goes
/// to the origin alone and as sent: its `Range` and `If-Range` reach the
/// origin, which answers the range (a black-box audit saw every range
/// request for a large file answered with the whole body).
#[tokio::test]
async fn a_range_for_a_key_not_stored_reaches_the_origin() {
    for h in Harness::both().await {
        let target = "/file?cc=max-age%3D60&set_cookie=s%3D1";
        h.get(target).await;
        let r = h
            .get_with(target, &[("range", "bytes=0-3"), ("if-range", "\"v1\"")])
            .await;
        let seen = r.text();
        assert!(seen.contains("range: bytes=0-3"), "{}: {seen}", h.name);
        assert!(seen.contains("if-range: \"v1\""), "{}: {seen}", h.name);
    }
}

/// A request the cache does not answer for its `Range` (several ranges)
/// goes to the origin as it came: with its validators (so it can be
/// answered 304) and with the cookie a route that ignores cookies would
/// have taken off a request it answers.
#[tokio::test]
async fn a_range_the_cache_does_not_answer_reaches_the_origin_as_sent() {
    for h in Harness::both().await {
        let fields = [("range", "bytes=0-1,5-6"), ("if-none-match", "\"v9\"")];
        let r = h.get_with("/multi?cc=max-age%3D60", &fields).await;
        assert_eq!(r.x_cache(), "BYPASS", "{}", h.name);
        let seen = r.text();
        assert!(seen.contains("range: bytes=0-1,5-6"), "{}: {seen}", h.name);
        assert!(seen.contains("if-none-match: \"v9\""), "{}: {seen}", h.name);
    }
    let h = Harness::layer(Settings::default()).await;
    let fields = [("range", "bytes=0-1,5-6"), ("cookie", "session=alice")];
    let r = h.get_with("/ignore/multi", &fields).await;
    assert!(r.text().contains("cookie: session=alice"), "{}", r.text());
}
