//! Answers that are not documents, through the layer and through the proxy:
//! a live stream is passed on as it comes, and a protocol upgrade is the
//! origin's to answer.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use http_body_util::BodyExt;

use super::harness::*;

/// The next event of a live stream, within a bound.
async fn next_event(body: &mut Body) -> String {
    let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("an event within 5 s")
        .expect("the stream goes on")
        .expect("the stream does not fail");
    String::from_utf8_lossy(frame.data_ref().expect("a data frame")).into_owned()
}

/// Server-sent events never end, so a cache that reads an answer whole
/// before passing it on never passed on the first event (nor its head),
/// and every other client of the URL waited on that read. Each client now
/// gets its own stream from the origin as it comes, none stored.
#[tokio::test]
async fn server_sent_events_are_passed_on_as_they_come() {
    for h in Harness::both().await {
        let open = || async {
            let req = h.request("GET", "/events?events").body(Body::empty());
            let head = h.send_for_head(req.unwrap());
            let head = tokio::time::timeout(Duration::from_secs(5), head).await;
            head.expect("the head within 5 s")
        };
        let (first, mut first_body) = open().await;
        assert_eq!(first.status, StatusCode::OK, "{}", h.name);
        assert_eq!(
            next_event(&mut first_body).await,
            "data: 0\n\n",
            "{}",
            h.name
        );
        // A second client while the first still reads: its own stream.
        let (second, mut second_body) = open().await;
        assert_eq!(
            next_event(&mut second_body).await,
            "data: 0\n\n",
            "{}",
            h.name
        );
        assert_eq!(
            next_event(&mut first_body).await,
            "data: 1\n\n",
            "{}",
            h.name
        );
        let status = |parts: &http::response::Parts| parts.headers["cache-status"].clone();
        assert!(
            status(&first).to_str().unwrap().ends_with("detail=stream"),
            "{}",
            h.name
        );
        // Its own stream too, the URL not marked (it may answer JSON to
        // others).
        let second = status(&second);
        assert!(
            second.to_str().unwrap().ends_with("detail=stream"),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 2, "{}: one origin call per client", h.name);
    }
}

/// A request to switch protocols (a WebSocket's handshake) asks the origin
/// for a connection of its own: a stored answer for the URL is no answer
/// to it. `Upgrade: h2c`, which no server here switches to, is an ordinary
/// request.
#[tokio::test]
async fn an_upgrade_request_is_never_answered_from_storage() {
    for h in Harness::both().await {
        let target = "/live?cc=max-age%3D60";
        assert_eq!(h.get(target).await.x_cache(), "MISS", "{}", h.name);
        assert_eq!(h.get(target).await.x_cache(), "HIT", "{}", h.name);
        let h2c = [("connection", "upgrade"), ("upgrade", "h2c")];
        assert_eq!(
            h.get_with(target, &h2c).await.x_cache(),
            "HIT",
            "{}",
            h.name
        );
        let websocket = [
            ("connection", "upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("sec-websocket-version", "13"),
        ];
        let r = h.get_with(target, &websocket).await;
        assert_eq!(r.x_cache(), "BYPASS", "{}", h.name);
        assert!(
            r.h("cache-status").ends_with("fwd=bypass; detail=upgrade"),
            "{}",
            h.name
        );
        assert_eq!(h.calls(), 2, "{}: the upgrade reached the origin", h.name);
    }
}

/// Sends `request` on a new connection to `addr`; the connection and the
/// answer's head.
async fn exchange(addr: std::net::SocketAddr, request: &str) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = socket.read_u8().await.expect("a whole head");
        head.push(byte);
    }
    (socket, String::from_utf8(head).unwrap())
}

/// What a WebSocket's handshake needs from the layer, over a real socket:
/// a URL whose page is stored still hands the handshake to its handler,
/// with the connection, however many arrive at once.
#[tokio::test]
async fn a_websocket_handshake_through_the_layer_gets_its_connection() {
    use axum::http::{Request, Response};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn live(mut req: Request<Body>) -> Response<Body> {
        if !req.headers().contains_key("upgrade") {
            let page = Response::builder().header("cache-control", "max-age=60");
            return page.body(Body::from("the page")).unwrap();
        }
        let upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let mut io = hyper_util::rt::TokioIo::new(upgrade.await.expect("upgraded"));
            let mut hello = [0; 5];
            io.read_exact(&mut hello).await.unwrap();
            io.write_all(&hello).await.unwrap();
        });
        let switching = Response::builder().status(StatusCode::SWITCHING_PROTOCOLS);
        let switching = switching.header("upgrade", "websocket");
        switching
            .header("connection", "upgrade")
            .body(Body::empty())
            .unwrap()
    }
    let engine = tiercache::TieredCache::builder().build().unwrap();
    let route = tiercache::ResponseCacheLayer::new(engine).route(tiercache::Policy::ttl(TTL));
    let app = axum::Router::new().route("/live", axum::routing::get(live).layer(route.unwrap()));
    let server = tiercache_testkit::Server::start(app).await;
    let page = "GET /live HTTP/1.1\r\nhost: shop.test\r\n\r\n";
    for expected in ["x-cache: MISS", "x-cache: HIT"] {
        let (_, head) = exchange(server.addr(), page).await;
        assert!(head.contains(expected), "{head}");
    }
    let handshakes: Vec<_> = (0..3)
        .map(|_| {
            let addr = server.addr();
            tokio::spawn(async move {
                let handshake = "GET /live HTTP/1.1\r\nhost: shop.test\r\n\
                    connection: upgrade\r\nupgrade: websocket\r\n\
                    sec-websocket-version: 13\r\n\
                    sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
                let (mut socket, head) = exchange(addr, handshake).await;
                assert!(head.starts_with("HTTP/1.1 101"), "{head}");
                socket.write_all(b"hello").await.unwrap();
                let mut echo = [0; 5];
                socket.read_exact(&mut echo).await.unwrap();
                assert_eq!(&echo, b"hello", "the handler has the connection");
            })
        })
        .collect();
    for handshake in handshakes {
        let handshake = tokio::time::timeout(Duration::from_secs(10), handshake);
        handshake.await.expect("within 10 s").unwrap();
    }
}
