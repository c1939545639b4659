//! The accept loop: what `axum::serve` does (HTTP/1 and h2c on one port,
//! the client's address as `ConnectInfo`), plus a timer, so a client that
//! sends its head slowly, or nothing at all, is cut off instead of holding a
//! connection for ever (`axum::serve` sets no timer, so hyper has none).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// How long a client may take to send a request's head (hyper's default
/// once a timer is set; nginx's `client_header_timeout` is 60 s), and a new
/// connection its first byte.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, app: Router) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new());
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it
                // was accepted: wait a little rather than spin.
                eprintln!("tiercache-proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = app.clone().map_request(move |req: Request<Incoming>| {
            let mut req = req.map(Body::new);
            req.extensions_mut()
                .insert(ConnectInfo::<SocketAddr>(remote));
            req
        });
        let builder = builder.clone();
        tokio::spawn(async move {
            // hyper's timer starts at a head's first byte: a connection
            // that sends none is bounded here (`peek`, not `readable`,
            // which may report readiness before any byte has come).
            let mut first = [0u8; 1];
            match tokio::time::timeout(HEADER_READ_TIMEOUT, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let io = TokioIo::new(stream);
            let service = TowerToHyperService::new(service);
            // A connection's error (a reset, a timeout) is that client's.
            let _ = builder.serve_connection_with_upgrades(io, service).await;
        });
    }
}
