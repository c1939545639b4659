//! Bodies being read whole to be stored hold a bound per engine: a pool of
//! a sixteenth of L1's budget, and room outside it for one read as large as
//! `max_body`. Past it a body streams through unstored (`detail=busy`), a
//! refusal of the moment: the URL is not marked, and the requests waiting
//! on that load try again (one of them loads) instead of each calling the
//! origin. Before, only their count bounded them: up to 1,024 fills whose
//! clients had left could each hold a whole `max_body` (8 MiB).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::BodyExt;
use tiercache::{Policy, ResponseCacheLayer, TieredCache};
use tiercache_testkit::{Counter, bounded, eventually};
use tokio::sync::mpsc;
use tower::ServiceExt;

/// A body sent frame by frame from a channel, open until its sender goes.
struct Frames(mpsc::Receiver<Bytes>);

impl futures_core::Stream for Frames {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

/// An origin at `/{item}`: an item's next call answers with the body fed
/// through the channel queued for it, or with `whole` once none is left.
#[derive(Clone, Default)]
struct Origin {
    queued: Arc<Mutex<HashMap<String, Vec<mpsc::Receiver<Bytes>>>>>,
    calls: Arc<Mutex<HashMap<String, Counter>>>,
}

impl Origin {
    /// Queues a body for `item`'s next call; frames sent on the returned
    /// sender are taken one at a time, so a send returns once the frame
    /// before it was read.
    fn feed(&self, item: &str) -> mpsc::Sender<Bytes> {
        let (tx, rx) = mpsc::channel(1);
        let mut queued = self.queued.lock().unwrap();
        queued.entry(item.to_owned()).or_default().insert(0, rx);
        tx
    }

    fn calls(&self, item: &str) -> Counter {
        let mut calls = self.calls.lock().unwrap();
        calls.entry(item.to_owned()).or_default().clone()
    }

    /// The app, cached on an engine whose L1 is 16 MiB (a 1 MiB pool).
    fn app(&self) -> (Router, TieredCache) {
        let engine = TieredCache::builder()
            .sweep_interval(None)
            .l1_capacity(16 << 20)
            .build()
            .unwrap();
        let layer = ResponseCacheLayer::new(engine.clone());
        let origin = self.clone();
        let handler = move |Path(item): Path<String>| {
            let origin = origin.clone();
            async move {
                origin.calls(&item).bump();
                let queued = origin
                    .queued
                    .lock()
                    .unwrap()
                    .get_mut(&item)
                    .and_then(Vec::pop);
                match queued {
                    Some(rx) => Response::new(Body::from_stream(Frames(rx))),
                    None => Response::new(Body::from("whole")),
                }
            }
        };
        let policy = Policy::ttl(Duration::from_secs(60));
        let app = Router::new().route("/{item}", get(handler).layer(layer.route(policy).unwrap()));
        (app, engine)
    }
}

fn kib(n: usize) -> Bytes {
    Bytes::from(vec![b'x'; n << 10])
}

/// Sends `frames` in turn, then two more bytes. A send returns once the
/// frame before it was taken from the channel, and the reader takes the
/// next only once it has held the one before: once the last byte is sent,
/// every frame in `frames` was read (and held).
async fn feed_and_hold(tx: &mpsc::Sender<Bytes>, frames: &[Bytes]) {
    let trailing = [Bytes::from_static(b"x"), Bytes::from_static(b"y")];
    for frame in frames.iter().cloned().chain(trailing) {
        bounded("a frame to be taken", tx.send(frame))
            .await
            .unwrap();
    }
}

fn get_req(uri: &str) -> Request<Body> {
    Request::get(uri)
        .header("host", "shop.test")
        .body(Body::empty())
        .unwrap()
}

async fn send(app: &Router, uri: &str) -> (StatusCode, HeaderMap, Bytes) {
    let res = app.clone().oneshot(get_req(uri)).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

/// Starts a request for `uri` in a task of its own.
fn spawn_send(app: &Router, uri: &'static str) -> Sent {
    let app = app.clone();
    tokio::spawn(async move { send(&app, uri).await })
}

type Sent = tokio::task::JoinHandle<(StatusCode, HeaderMap, Bytes)>;

/// A holds 800 KiB of the 1 MiB pool and B 700 KiB outside it, both
/// stalled: their senders and their requests.
async fn pool_and_outside_taken(origin: &Origin, app: &Router) -> [(mpsc::Sender<Bytes>, Sent); 2] {
    let (a_tx, b_tx) = (origin.feed("a"), origin.feed("b"));
    let a = spawn_send(app, "/a");
    feed_and_hold(&a_tx, &[kib(800)]).await;
    let b = spawn_send(app, "/b");
    feed_and_hold(&b_tx, &[kib(700)]).await;
    [(a_tx, a), (b_tx, b)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_bound_a_body_streams_through_unstored_and_its_url_stays_cacheable() {
    let origin = Origin::default();
    let (app, _) = origin.app();
    let held = pool_and_outside_taken(&origin, &app).await;
    // C's 700 KiB fit neither: C is answered at once, streaming, while its
    // origin still sends.
    let c_tx = origin.feed("c");
    c_tx.send(kib(700)).await.unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), app.clone().oneshot(get_req("/c")))
        .await
        .expect("C waited to be read whole past the bound")
        .unwrap();
    assert_eq!(
        h(c.headers(), "cache-status"),
        "tiercache; fwd=miss; detail=busy"
    );
    drop(c_tx);
    let c_body = c.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(c_body.len(), 700 << 10, "C's body intact");
    // A and B end: both were read whole, and stored.
    for ((tx, request), (uri, len)) in held.into_iter().zip([("/a", 800), ("/b", 700)]) {
        drop(tx);
        let (status, headers, body) = bounded("an answer read whole", request).await.unwrap();
        assert_eq!((status, body.len()), (StatusCode::OK, (len << 10) + 2));
        assert_eq!(h(&headers, "x-cache"), "MISS");
        assert_eq!(h(&send(&app, uri).await.1, "x-cache"), "HIT", "{uri}");
    }
    // C is not marked uncacheable: its next answer is stored.
    let (_, headers, body) = send(&app, "/c").await;
    assert_eq!((h(&headers, "x-cache"), &body[..]), ("MISS", &b"whole"[..]));
    assert_eq!(h(&send(&app, "/c").await.1, "x-cache"), "HIT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_waiting_on_a_busy_load_try_again_and_one_calls_the_origin() {
    let origin = Origin::default();
    let (app, engine) = origin.app();
    let _held = pool_and_outside_taken(&origin, &app).await;
    let coalesced = engine.stats().coalesced;
    // C's leader waits on its first frame; two more requests wait on it.
    let c_tx = origin.feed("c");
    let leader = spawn_send(&app, "/c");
    eventually("C's origin called", || origin.calls("c").get() == 1).await;
    let followers = [spawn_send(&app, "/c"), spawn_send(&app, "/c")];
    eventually("two requests wait on C's load", || {
        engine.stats().coalesced == coalesced + 2
    })
    .await;
    // 300 KiB do not fit the pool's room: the leader streams its body, the
    // followers try again and one of them loads (C's second answer,
    // `whole`, is small), the other answered with it.
    c_tx.send(kib(300)).await.unwrap();
    drop(c_tx);
    let (_, headers, body) = bounded("the leader's answer", leader).await.unwrap();
    assert_eq!(
        (h(&headers, "cache-status"), body.len()),
        ("tiercache; fwd=miss; detail=busy", 300 << 10)
    );
    for follower in followers {
        let (_, _, body) = bounded("a follower's answer", follower).await.unwrap();
        assert_eq!(&body[..], b"whole");
    }
    assert_eq!(
        origin.calls("c").get(),
        2,
        "each request waiting on a busy load called the origin"
    );
}
