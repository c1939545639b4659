//! Test helpers shared by tiercache's integration tests and benches.
//!
//! - [`Counter`]: counts calls and lets a test wait until a count is reached;
//! - [`Gate`]: holds origin handlers until the test opens it;
//! - [`Server`]: an axum app on a free loopback port, stopped on drop;
//! - [`eventually`]: waits for a condition with a deadline, yielding, never sleeping;
//! - [`valkey`]: real `valkey-server` processes, provisioned with no manual step;
//! - [`cluster`]: a real loopback Valkey Cluster, formed without `valkey-cli`;
//! - [`sentinel`]: a real Sentinel group (primary, replica, Sentinel);
//! - [`http`]: one request through an axum app, read whole;
//! - [`fault`]: a TCP fault proxy (latency, blackhole, reset).

pub mod cluster;
pub mod fault;
pub mod http;
pub mod sentinel;
pub mod valkey;

pub use cluster::ValkeyCluster;
pub use fault::{Fault, FaultProxy};
pub use sentinel::ValkeySentinel;
pub use valkey::ValkeyServer;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;

/// A call counter a test can wait on.
#[derive(Debug, Clone)]
pub struct Counter {
    tx: std::sync::Arc<watch::Sender<usize>>,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            tx: std::sync::Arc::new(watch::channel(0).0),
        }
    }
}

impl Counter {
    /// A counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one and returns the new count.
    pub fn bump(&self) -> usize {
        let mut now = 0;
        self.tx.send_modify(|n| {
            *n += 1;
            now = *n;
        });
        now
    }

    /// The count.
    pub fn get(&self) -> usize {
        *self.tx.borrow()
    }

    /// Waits until the count reaches `n` (panics after 30 s, naming the count).
    pub async fn reached(&self, n: usize) {
        let mut rx = self.tx.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|c| *c >= n)).await;
        assert!(
            waited.is_ok(),
            "counter stayed at {} waiting for {n}",
            self.get()
        );
    }
}

/// Holds handlers until opened; once open it stays open.
#[derive(Debug, Clone)]
pub struct Gate {
    tx: std::sync::Arc<watch::Sender<bool>>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            tx: std::sync::Arc::new(watch::channel(false).0),
        }
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens the gate for every current and future waiter.
    pub fn open(&self) {
        self.tx.send_replace(true);
    }

    /// Waits until the gate is open.
    pub async fn passed(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

/// Waits until `cond` holds, yielding to other tasks between checks; panics
/// with `what` after 30 s. For conditions no event announces (engine stats).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::task::yield_now().await;
    }
}

/// An axum app served on a free loopback port; aborted on drop.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Serves `app` on `127.0.0.1:0`.
    pub async fn start(app: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, task }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs `fut` to completion with a 60 s bound, naming `what` on timeout.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(60), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within 60 s"),
    }
}
