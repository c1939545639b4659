//! A small TCP fault proxy (Toxiproxy is not to be had here): sits between a
//! client and a server on loopback and can add latency, swallow traffic
//! (blackhole) or reset every connection.

use std::net::SocketAddr;
use std::sync::Arc;
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
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(connection(client, upstream, rx.clone()));
            }
        });
        Self { addr, fault, task }
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
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connection(client: TcpStream, upstream: SocketAddr, mut fault: watch::Receiver<Fault>) {
    if *fault.borrow() == Fault::Reset {
        return reset(client);
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = pump(&mut cr, &mut sw, fault.clone());
    let down = pump(&mut sr, &mut cw, fault.clone());
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
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
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
