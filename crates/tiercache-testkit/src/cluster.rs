//! A real Valkey Cluster on loopback (primaries with one replica each),
//! formed without `valkey-cli`: `CLUSTER SET-CONFIG-EPOCH`,
//! `CLUSTER ADDSLOTSRANGE`, `CLUSTER MEET host port busport`,
//! `CLUSTER REPLICATE`, then a wait for `cluster_state:ok` everywhere.

use std::time::{Duration, Instant};

use crate::valkey::{ValkeyServer, free_port, valkey_server_binary};

/// Hash slots in a cluster.
pub const SLOTS: u16 = 16384;

/// A running cluster; every node is stopped on drop.
#[derive(Debug)]
pub struct ValkeyCluster {
    nodes: Vec<ValkeyServer>,
    primaries: usize,
}

impl ValkeyCluster {
    /// Starts `primaries` primaries (slots split evenly) and one replica
    /// each, with `cluster-node-timeout 2000` so a dead primary's replica
    /// takes over in a few seconds. Panics with the reason when the cluster
    /// does not form within 30 s.
    pub fn start(primaries: usize) -> Self {
        assert!(primaries >= 1);
        let binary = valkey_server_binary();
        let nodes: Vec<ValkeyServer> = (0..primaries * 2)
            .map(|_| {
                ValkeyServer::start_on_free_port(binary.clone(), || {
                    // The bus port is given: port + 10000 may not exist.
                    let bus = free_port().to_string();
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        "--cluster-port",
                        &bus,
                        "--cluster-replica-validity-factor",
                        "0",
                    ]
                    .map(String::from)
                    .to_vec()
                })
            })
            .collect();
        let cluster = Self { nodes, primaries };
        cluster.form();
        cluster
    }

    fn form(&self) {
        let per = SLOTS as usize / self.primaries;
        for (i, node) in self.nodes[..self.primaries].iter().enumerate() {
            node.cmd(&["CLUSTER", "SET-CONFIG-EPOCH", &(i + 1).to_string()]);
            let first = i * per;
            let last = if i + 1 == self.primaries {
                SLOTS as usize - 1
            } else {
                first + per - 1
            };
            node.cmd(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &first.to_string(),
                &last.to_string(),
            ]);
        }
        let first = &self.nodes[0];
        let buses: Vec<String> = self.nodes[1..]
            .iter()
            .map(|node| {
                let bus = node.cmd(&["CONFIG", "GET", "cluster-port"]);
                bus.lines().nth(1).expect("cluster-port value").to_string()
            })
            .collect();
        // A handshake that does not finish within the node timeout is
        // dropped without a word (a loaded machine, many clusters forming at
        // once), and the node then never joins: meet again, every second,
        // whoever the first node does not know yet.
        let last_meet = std::cell::Cell::new(None::<Instant>);
        wait_until("every node to know every other", || {
            if last_meet
                .get()
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
            {
                last_meet.set(Some(Instant::now()));
                let known = first.try_cmd(&["CLUSTER", "NODES"]).unwrap_or_default();
                for (node, bus) in self.nodes[1..].iter().zip(&buses) {
                    if !known.contains(&format!("127.0.0.1:{}@", node.port())) {
                        let port = node.port().to_string();
                        let _ = first.try_cmd(&["CLUSTER", "MEET", "127.0.0.1", &port, bus]);
                    }
                }
            }
            self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                let nodes = n.cmd(&["CLUSTER", "NODES"]);
                nodes.lines().count() == self.nodes.len() && !nodes.contains("handshake")
            })
        });
        for (replica, primary) in self.nodes[self.primaries..].iter().zip(&self.nodes) {
            let id = primary.cmd(&["CLUSTER", "MYID"]);
            replica.cmd(&["CLUSTER", "REPLICATE", &id]);
        }
        self.wait("cluster_state:ok", |n| {
            n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
        });
        for replica in &self.nodes[self.primaries..] {
            wait_until("replicas in sync", || {
                replica
                    .cmd(&["INFO", "replication"])
                    .contains("master_link_status:up")
            });
        }
    }

    fn wait(&self, what: &str, ok: impl Fn(&ValkeyServer) -> bool) {
        wait_until(what, || {
            self.nodes.iter().filter(|n| n.is_running()).all(&ok)
        });
    }

    /// A `redis-cluster://` URL naming every node as a seed.
    pub fn url(&self) -> String {
        let mut nodes = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port()));
        let first = nodes.next().expect("a node");
        let rest: Vec<String> = nodes.map(|n| format!("node={n}")).collect();
        format!("redis-cluster://{first}?{}", rest.join("&"))
    }

    /// Has node `i` announce `ports[i]` to clients (`CONFIG SET
    /// cluster-announce-port`: `CLUSTER SLOTS` and redirects name it, so a
    /// cluster client connects there, a [`FaultProxy`](crate::FaultProxy)
    /// in front of the node, say), and waits until every running node
    /// names every node by its announced port. The cluster bus stays
    /// direct.
    pub fn announce_ports(&self, ports: &[u16]) {
        assert_eq!(ports.len(), self.nodes.len(), "a port for each node");
        for (node, port) in self.nodes.iter().zip(ports) {
            node.cmd(&["CONFIG", "SET", "cluster-announce-port", &port.to_string()]);
        }
        let named: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}@")).collect();
        self.wait("every node named by its announced port", |n| {
            let nodes = n.cmd(&["CLUSTER", "NODES"]);
            named.iter().all(|name| nodes.contains(name.as_str()))
        });
    }

    /// Node `i` (the first `primaries` are the primaries at start).
    pub fn node(&self, i: usize) -> &ValkeyServer {
        &self.nodes[i]
    }

    /// Node `i`, to kill or restart.
    pub fn node_mut(&mut self, i: usize) -> &mut ValkeyServer {
        &mut self.nodes[i]
    }

    /// The primaries at start.
    pub fn primaries(&self) -> usize {
        self.primaries
    }

    /// `CLUSTER KEYSLOT key`, asked of a live node.
    pub fn keyslot(&self, key: &str) -> u16 {
        self.live()
            .cmd(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .expect("a slot number")
    }

    /// A running node to ask.
    pub fn live(&self) -> &ValkeyServer {
        self.nodes
            .iter()
            .find(|n| n.is_running())
            .expect("a running node")
    }

    /// Waits until every running node reports `cluster_state:ok` (after a
    /// failover, say).
    pub fn wait_ok(&self) {
        self.wait("cluster_state:ok", |n| {
            n.try_cmd(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains("cluster_state:ok"))
        });
    }

    /// Whether node `i` is a primary now (by its own `ROLE`).
    pub fn is_primary(&self, i: usize) -> bool {
        self.nodes[i]
            .try_cmd(&["ROLE"])
            .is_ok_and(|role| role.starts_with("master"))
    }
}

fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "the Valkey cluster did not reach {what} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
