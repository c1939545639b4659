//! No request can shape what another client is answered with.

use super::harness::*;

use std::net::SocketAddr;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, Request, StatusCode};
use tiercache::http::request::UNKEYED;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn unkeyed_headers_never_reach_a_victim() {
    for h in Harness::both().await {
        for (i, name) in UNKEYED.iter().enumerate() {
            let target = format!("/page{i}?cc=max-age%3D60");
            // Every spelling frameworks fold into the same name.
            let underscored = name.replace('-', "_").to_ascii_uppercase();
            let attacker = h
                .get_with(
                    &target,
                    &[(name, "evil.example"), (&underscored, "evil.example")],
                )
                .await;
            assert!(
                !attacker.text().contains("evil.example"),
                "{} {name}: reached the origin",
                h.name
            );
            let victim = h.get(&target).await;
            assert_eq!(victim.x_cache(), "HIT", "{} {name}", h.name);
            assert!(!victim.text().contains("evil.example"), "{} {name}", h.name);
        }
        assert_eq!(h.calls(), UNKEYED.len(), "{}", h.name);
    }
}

#[tokio::test]
async fn a_get_with_a_body_bypasses_the_cache() {
    for h in Harness::both().await {
        let target = "/search?cc=max-age%3D60";
        let fat = h
            .request("GET", target)
            .body(Body::from("evil-body"))
            .unwrap();
        let attacker = h.send(fat).await;
        assert_eq!(attacker.x_cache(), "BYPASS", "{}", h.name);
        let victim = h.get(target).await;
        assert!(!victim.text().contains("evil-body"), "{}", h.name);
        assert_eq!(h.get(target).await.body, victim.body);
        assert_eq!(h.calls(), 2, "{}", h.name);
    }
}

#[tokio::test]
async fn requests_that_make_the_origin_fail_poison_nothing() {
    for h in Harness::both().await {
        let target = "/fragile?cc=max-age%3D60";
        let bad = h.get_with(target, &[("x-bad", "1")]).await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        let huge = "a".repeat(6000);
        let big = h.get_with(target, &[("x-huge", &huge)]).await;
        assert_eq!(big.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        let victim = h.get(target).await;
        assert_eq!(victim.status, StatusCode::OK, "{}", h.name);
        // And caching was not switched off for the URL (no hit-for-miss).
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
        assert_eq!(h.calls(), 3, "{}", h.name);
    }
}

#[tokio::test]
async fn query_host_port_and_case_are_keyed_exactly() {
    for h in Harness::both().await {
        h.get("/q?cc=max-age%3D60&utm=evil").await;
        let victim = h.get("/q?cc=max-age%3D60").await;
        assert!(!victim.text().contains("evil"), "{}", h.name);
        assert_eq!(h.calls(), 2);

        let other_port = h
            .send(
                h.request_to("GET", "/hp?cc=max-age%3D60")
                    .header("host", "shop.test:8443")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        let victim = h.get("/hp?cc=max-age%3D60").await;
        assert_ne!(victim.body, other_port.body, "{}", h.name);
        let upper = h
            .send(
                h.request_to("GET", "/hp?cc=max-age%3D60")
                    .header("host", "SHOP.TEST")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(
            (upper.x_cache(), &upper.body),
            ("HIT", &victim.body),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 4, "{}", h.name);
        // Two `Host` fields: which one the origin reads is anyone's guess.
        // The layer bypasses; the proxy, a server, refuses it (RFC 9112
        // §3.2) before its cache sees it.
        let doubled = h
            .send(
                h.request("GET", "/hp?cc=max-age%3D60")
                    .header("host", "evil.example")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        if h.name == "proxy" {
            assert_eq!(doubled.status, StatusCode::BAD_REQUEST, "{}", h.name);
        } else {
            assert_eq!(doubled.x_cache(), "BYPASS", "{}", h.name);
        }
        assert_eq!(h.get("/hp?cc=max-age%3D60").await.body, victim.body);
    }
}

#[tokio::test]
async fn an_absolute_form_target_naming_another_host_bypasses() {
    for h in Harness::both().await {
        let attacker = match &h.via {
            Via::Layer { .. } => {
                h.send(
                    Request::get("http://shop.test/abs?cc=max-age%3D60")
                        .header("host", "evil.example")
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
            }
            Via::Proxy { proxy, .. } => raw_absolute_form(proxy.addr()).await,
        };
        assert_eq!(attacker.x_cache(), "BYPASS", "{}", h.name);
        let victim = h.get("/abs?cc=max-age%3D60").await;
        assert!(!victim.text().contains("evil"), "{}", h.name);
        assert_eq!(victim.x_cache(), "MISS", "{}", h.name);
    }
}

/// `GET http://shop.test/abs` with `Host: evil.example`, as raw HTTP/1.1.
async fn raw_absolute_form(addr: SocketAddr) -> Reply {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        b"GET http://shop.test/abs?cc=max-age%3D60 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse::<u16>()
        .unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (n, v) = line.split_once(':').unwrap();
        headers.append(
            HeaderName::from_bytes(n.trim().as_bytes()).unwrap(),
            v.trim().parse().unwrap(),
        );
    }
    Reply {
        status: StatusCode::from_u16(status).unwrap(),
        headers,
        body: Bytes::from(body.to_owned()),
    }
}

#[tokio::test]
async fn path_confusion_never_makes_a_private_page_cacheable() {
    for h in Harness::both().await {
        let confusing = [
            "/account/x.css",
            "/account;x.css",
            "/account/..%2fstatic/app.js",
            "//account",
            "/static/%2e%2e/account/x.png",
        ];
        for target in confusing {
            let alice = h.get_with(target, &[("x-user", "alice")]).await;
            assert_eq!(alice.h("cache-control"), "private", "{} {target}", h.name);
            let bob = h.get(target).await;
            assert!(!bob.text().contains("alice"), "{} {target}", h.name);
        }
        assert_eq!(h.calls(), 2 * confusing.len(), "{}", h.name);
        assert_eq!(
            h.stored_in_valkey().await,
            Vec::<String>::new(),
            "{}",
            h.name
        );
    }
}

#[tokio::test]
async fn different_requests_never_share_a_key_and_braces_do_not_steer_slots() {
    for h in Harness::both().await {
        let targets = [
            "/k/a?b=c",
            "/k/a%3Fb=c",
            "/k/a?b%3Dc",
            "/k/%7Bslot%7D",
            "/k/%7bslot%7d",
            "/k/x?{tag}=1",
        ];
        let mut bodies = Vec::new();
        for t in targets {
            let target = format!(
                "{t}{}cc=max-age%3D60",
                if t.contains('?') { "&" } else { "?" }
            );
            bodies.push(h.get(&target).await.body);
        }
        assert_eq!(
            h.calls(),
            targets.len(),
            "{}: each a key of its own",
            h.name
        );
        let keys = h.stored_in_valkey().await;
        assert_eq!(keys.len(), targets.len(), "{}", h.name);
        for key in keys {
            let hash = key
                .strip_prefix("tc:{")
                .and_then(|k| k.strip_suffix("}:e"))
                .unwrap_or("");
            assert!(
                hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                "{key}"
            );
        }
    }
}

#[tokio::test]
async fn cache_status_never_emits_the_key() {
    for h in Harness::both().await {
        let target = "/secret-path-xyz?token=abc123&cc=max-age%3D60";
        for r in [h.get(target).await, h.get(target).await] {
            let status = r.h("cache-status");
            assert!(status.starts_with("tiercache;"), "{status}");
            assert!(
                !status.contains("secret") && !status.contains("abc123") && !status.contains(HOST),
                "{status}"
            );
        }
    }
}

#[tokio::test]
async fn head_never_poisons_get() {
    for h in Harness::both().await {
        let target = "/h?cc=max-age%3D60";
        let head = h
            .send(h.request("HEAD", target).body(Body::empty()).unwrap())
            .await;
        assert!(head.body.is_empty());
        let get = h.get(target).await;
        assert_eq!(
            get.x_cache(),
            "HIT",
            "{}: the HEAD loaded the GET entry",
            h.name
        );
        assert!(
            get.text().contains("method=GET"),
            "{}: {}",
            h.name,
            get.text()
        );
        assert_eq!(h.calls(), 1, "{}", h.name);
    }
}

/// 32 requests with junk `Accept-Encoding` values do not fill a URL's
/// variant slots: the header is reduced to the codings that matter before
/// it keys anything, so real clients still get their variant.
#[tokio::test]
async fn junk_accept_encodings_cannot_lock_a_url_out() {
    for h in Harness::both().await {
        let target = "/ae?vary=accept-encoding&cc=max-age%3D60";
        for i in 0..40 {
            let junk = format!("x-junk-{i};q=0.{}", i % 9 + 1);
            h.get_with(target, &[("accept-encoding", &junk)]).await;
        }
        assert_eq!(h.calls(), 1, "{}: every junk value is one variant", h.name);
        for (i, real) in ["gzip, br", "br;q=1.0, GZIP", "gzip"].iter().enumerate() {
            let r = h.get_with(target, &[("accept-encoding", real)]).await;
            assert!(!r.h("cache-status").contains("vary-limit"), "{}", h.name);
            // "gzip, br" and its reordering are one variant; "gzip" another.
            let expected = if i == 1 { "HIT" } else { "MISS" };
            assert_eq!(r.x_cache(), expected, "{} {real}", h.name);
        }
    }
}

/// A field the client names in `Connection` is this hop's (RFC 9110
/// §7.6.1): the proxy never sends it on. Keyed or varied on as sent, the
/// origin's answer to its absence was stored for everyone who sends it
/// (`Accept-Language: fr` clients got the English page).
#[tokio::test]
async fn a_field_named_in_connection_never_keys_what_the_origin_did_not_see() {
    for h in Harness::both().await {
        let target = "/hello?vary=accept-language&cc=max-age%3D60";
        let french = [("accept-language", "fr")];
        let hidden = [("accept-language", "fr"), ("connection", "accept-language")];
        h.get_with(target, &hidden).await;
        let victim = h.get_with(target, &french).await;
        assert!(
            victim.text().contains("accept-language: fr"),
            "{}: a French client got an answer made without its language ({})",
            h.name,
            victim.x_cache()
        );
    }
}

/// The key holds the host lower-cased; the origin must get it so too, or
/// an answer built from the host as sent (a redirect to the canonical,
/// lower-case host, from an origin that compares case-blind nowhere) is
/// stored for every client of the URL.
#[tokio::test]
async fn the_origin_gets_the_host_as_it_was_keyed() {
    for h in Harness::both().await {
        let target = "/canonical?cc=max-age%3D60";
        let upper = h.request_to("GET", target).header("host", "SHOP.TEST");
        let stored = h.send(upper.body(Body::empty()).unwrap()).await;
        assert!(
            !stored.text().contains("SHOP.TEST"),
            "{}: {}",
            h.name,
            stored.text()
        );
        assert!(stored.text().contains("host: shop.test"), "{}", h.name);
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
    }
}

/// An origin that gzips whatever the client said (`gzip;q=0` read as
/// `gzip`, as Django's middleware does): its answer is not stored under a
/// variant that refuses the coding, which `identity` clients share.
#[tokio::test]
async fn a_coding_the_request_refused_is_not_stored_for_its_variant() {
    for h in Harness::both().await {
        let target = "/coded?ce=gzip&vary=accept-encoding&cc=max-age%3D60";
        h.get_with(target, &[("accept-encoding", "gzip;q=0")]).await;
        let plain = h.get_with(target, &[("accept-encoding", "identity")]).await;
        assert_ne!(
            plain.x_cache(),
            "HIT",
            "{}: a gzip body for identity",
            h.name
        );
        assert!(
            plain.h("cache-status").ends_with("detail=encoding"),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 2, "{}", h.name);
        // A client that accepts the coding stores it for its variant.
        h.get_with(target, &[("accept-encoding", "gzip")]).await;
        let again = h.get_with(target, &[("accept-encoding", "gzip")]).await;
        assert_eq!(again.x_cache(), "HIT", "{}", h.name);
    }
}

/// The proxy's rules are chosen on the path as the upstream resolves it:
/// matched as sent, other spellings of a `cache = false` path (an encoded
/// letter, a doubled slash, a dot segment, upper case, a `;` parameter)
/// escaped the rule and were stored, though the upstream answered each
/// as the page the rule keeps out of the cache.
#[tokio::test]
async fn a_pass_rule_holds_for_every_spelling_of_its_paths() {
    let origin = Origin::default();
    let server = tiercache_testkit::Server::start(origin_app(&origin, None)).await;
    let mut config = tiercache_proxy::ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    config.ttl = Some(TTL);
    config.routes = vec![tiercache_proxy::routes::Route::pass("/api/cart/*")];
    let proxy = tiercache_proxy::Proxy::start(config).await.unwrap();
    let get = |path: &str| {
        let req = Request::get(format!("http://{}{path}", proxy.addr()));
        req.header("host", HOST).body(Body::empty()).unwrap()
    };
    let spellings = [
        "/api/cart/items",
        "/api/%63art/items",
        "/api//cart/items",
        "/api/./cart/items",
        "/api/x/../cart/items",
        "/API/Cart/items",
        "/api/cart;x/items",
        "/api%2fcart/items",
        // Spellings that resolve out of the rule: the upstream may serve
        // them as the cart all the same.
        "/api/cart/x/..%2f..%2fitems",
        "/api/cart/x/..;/..;/items",
        "/api/cart/.",
    ];
    for (i, path) in spellings.iter().enumerate() {
        for _ in 0..2 {
            let res =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<Body>()
                    .request(get(path))
                    .await
                    .unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{path}");
            assert!(!res.headers().contains_key("x-cache"), "{path}: cached");
        }
        assert_eq!(
            origin.calls.get(),
            2 * (i + 1),
            "{path}: answered from storage"
        );
    }
    // Another path is cached as ever.
    for expected in ["MISS", "HIT"] {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Body>();
        let res = client.request(get("/api/items")).await.unwrap();
        assert_eq!(res.headers()["x-cache"], expected);
    }
}
