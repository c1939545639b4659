//! A real Valkey Sentinel group on loopback: a primary, a replica, and one
//! Sentinel (quorum 1) watching them, all from the same `valkey-server`
//! binary (`valkey-server sentinel.conf --sentinel`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::valkey::{
    ValkeyServer, answers_as, command, on_free_port, target_dir, valkey_server_binary,
};

/// The name the Sentinel monitors the primary under.
pub const SERVICE: &str = "mymaster";

/// A primary, its replica and a Sentinel; all stopped on drop.
#[derive(Debug)]
pub struct ValkeySentinel {
    primary: ValkeyServer,
    replica: ValkeyServer,
    sentinel: Child,
    port: u16,
    dir: PathBuf,
}

impl ValkeySentinel {
    /// Starts the group and waits until the Sentinel knows the replica.
    /// A primary down for 1 s is failed over (`down-after-milliseconds 1000`).
    pub fn start() -> Self {
        let binary = valkey_server_binary();
        let primary = ValkeyServer::start();
        let replica = ValkeyServer::start_with(
            binary.clone(),
            &["--replicaof", "127.0.0.1", &primary.port().to_string()],
        );
        wait_until("the replica to sync", || {
            replica
                .cmd(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let (sentinel, port, dir) = start_sentinel(&binary, primary.port());
        let group = Self {
            primary,
            replica,
            sentinel,
            port,
            dir,
        };
        wait_until("the Sentinel to see the replica", || {
            command(port, &["SENTINEL", "REPLICAS", SERVICE])
                .is_ok_and(|r| r.contains(&group.replica.port().to_string()))
        });
        group
    }

    /// `redis-sentinel://127.0.0.1:PORT?sentinelServiceName=mymaster`.
    pub fn url(&self) -> String {
        format!(
            "redis-sentinel://127.0.0.1:{}?sentinelServiceName={SERVICE}",
            self.port
        )
    }

    /// The primary at start, to kill or pause.
    pub fn primary_mut(&mut self) -> &mut ValkeyServer {
        &mut self.primary
    }

    /// The replica at start.
    pub fn replica(&self) -> &ValkeyServer {
        &self.replica
    }

    /// The port the Sentinel names as the primary now.
    pub fn primary_port(&self) -> Option<u16> {
        let reply = command(self.port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]).ok()?;
        reply.lines().nth(1)?.parse().ok()
    }
}

impl Drop for ValkeySentinel {
    fn drop(&mut self) {
        let _ = self.sentinel.kill();
        let _ = self.sentinel.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a Sentinel watching the primary on `primary_port`, on a free
/// port; as the servers are, started again on a new one when the port was
/// taken between its pick and the Sentinel's bind. Returns the process,
/// its port and its folder.
fn start_sentinel(binary: &Path, primary_port: u16) -> (Child, u16, PathBuf) {
    on_free_port("the Sentinel", |port| {
        let dir = target_dir()
            .join("valkey-data")
            .join(format!("sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the Sentinel's folder");
        let conf = dir.join("sentinel.conf");
        let log = dir.join("sentinel.log");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nlogfile {}\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n\
                 sentinel down-after-milliseconds {SERVICE} 1000\n\
                 sentinel failover-timeout {SERVICE} 5000\n",
                dir.display(),
                log.display(),
            ),
        )
        .expect("write sentinel.conf");
        let mut sentinel = Command::new(binary)
            .arg(&conf)
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Sentinel");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !answers_as(port, sentinel.id()) {
            if let Ok(Some(status)) = sentinel.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(format!("({status})\n{log}"));
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinel on port {port} did not answer INFO within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((sentinel, port, dir))
    })
}

fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "the Sentinel group did not reach {what} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
