//! A small TCP fault proxy (Toxiproxy is not to be had here): sits between a
//! client and a server on loopback and can add latency, swallow traffic
//! (blackhole) or reset every connection, or swallow one connection's
//! traffic (one the server names by its peer address, as `CLIENT LIST`
//! shows it: a connection a NAT dropped silently).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward untouched.
    Pass,
    /// Delay every chunk, both ways.
    Latency(Duration),
    /// Accept and read, never forward or answer.
    Blackhole,
    /// Close every connection, open or new, with a TCP reset.
    Reset,
}

/// A running fault proxy; stops on drop.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    fault: Arc<watch::Sender<Fault>>,
    connections: Connections,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Proxies a loopback port to `upstream`, passing traffic until told otherwise.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fault proxy");
        let addr = listener.local_addr().expect("local addr");
        let fault = Arc::new(watch::channel(Fault::Pass).0);
        let rx = fault.subscribe();
        let connections = Connections::default();
        let to_swallow = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (rx, to_swallow) = (rx.clone(), to_swallow.clone());
                tokio::spawn(connection(client, upstream, rx, to_swallow));
            }
        });
        Self {
            addr,
            fault,
            connections,
            task,
        }
    }

    /// The address clients should use.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://ADDR`, for a Valkey behind the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Switches the fault, for open connections too.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Connections open through the proxy now (a `Reset` closes them as
    /// their tasks get to it: wait for 0 to know every one is closed).
    pub fn open_connections(&self) -> usize {
        self.connections.0.lock().unwrap().len()
    }

    /// From now on swallows, both ways, the traffic of the open connection
    /// the server sees coming from `peer` (the `addr=` of its `CLIENT
    /// LIST`): it stays open and silent, no reset, as a connection a NAT
    /// or firewall forgot. Other connections pass, and so do new ones,
    /// even one that reuses the port once this one has closed. Whether an
    /// open connection through this proxy comes from `peer`.
    pub fn swallow(&self, peer: SocketAddr) -> bool {
        let open = self.connections.0.lock().unwrap();
        let silent = open.get(&peer);
        if let Some(silent) = silent {
            silent.store(true, Relaxed);
        }
        silent.is_some()
    }
}

/// The open connections by their server-side peer address (the proxy's
/// own end towards the server), each with whether it is swallowed.
#[derive(Debug, Clone, Default)]
struct Connections(Arc<Mutex<HashMap<SocketAddr, Arc<AtomicBool>>>>);

impl Connections {
    /// Registers the connection from `peer` while the guard lives.
    fn open(&self, peer: Option<SocketAddr>) -> OpenConnection {
        let silent = Arc::new(AtomicBool::new(false));
        if let Some(peer) = peer {
            self.0.lock().unwrap().insert(peer, silent.clone());
        }
        OpenConnection {
            open: self.clone(),
            peer,
            silent,
        }
    }
}

struct OpenConnection {
    open: Connections,
    peer: Option<SocketAddr>,
    silent: Arc<AtomicBool>,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        let Some(peer) = self.peer else { return };
        let mut open = self.open.0.lock().unwrap();
        // Only this connection's record: a new one may hold the port now.
        if open
            .get(&peer)
            .is_some_and(|s| Arc::ptr_eq(s, &self.silent))
        {
            open.remove(&peer);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    mut fault: watch::Receiver<Fault>,
    connections: Connections,
) {
    if *fault.borrow() == Fault::Reset {
        return reset(client);
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let open = connections.open(server.local_addr().ok());
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let silent = open.silent.clone();
    let swallowing = move || silent.load(Relaxed);
    let up = pump(&mut cr, &mut sw, fault.clone(), swallowing.clone());
    let down = pump(&mut sr, &mut cw, fault.clone(), swallowing);
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = fault.wait_for(|f| *f == Fault::Reset) => {}
    }
    if let (Ok(client), Ok(_)) = (cr.reunite(cw), sr.reunite(sw)) {
        reset(client);
    }
}

fn reset(stream: TcpStream) {
    // Linger 0: close with RST, not FIN.
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    fault: watch::Receiver<Fault>,
    swallowing: impl Fn() -> bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if swallowing() {
            continue;
        }
        let now = *fault.borrow();
        match now {
            Fault::Pass => {}
            Fault::Latency(d) => tokio::time::sleep(d).await,
            Fault::Blackhole => continue,
            Fault::Reset => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
