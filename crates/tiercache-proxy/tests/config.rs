//! `tiercache-proxy --config tiercache.toml` (issue 18): per-path routes,
//! refusals that name the file, line and field, `--check-config`, and
//! `SIGHUP` reloads that keep L1.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tiercache_proxy::{Proxy, ProxyConfig, config_file};
use tiercache_testkit::http::{TwoChunks, h2c};
use tiercache_testkit::valkey::free_port;
use tiercache_testkit::{Counter, Server, bounded, eventually};

async fn upstream() -> (Server, Counter) {
    let calls = Counter::new();
    let app = Router::new()
        .route(
            "/{*path}",
            get(|State(c): State<Counter>| async move { format!("call {}", c.bump()) }),
        )
        .with_state(calls.clone());
    (Server::start(app).await, calls)
}

async fn fetch(addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let req = Request::get(format!("http://{addr}{path}"))
        .body(Body::empty())
        .unwrap();
    let res = client.request(req).await.expect("the proxy answers");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

fn file(upstream: &Server, listen: SocketAddr, routes: &str) -> String {
    format!(
        "upstream = \"{}\"\nlisten = \"{listen}\"\n\n[defaults]\nttl = \"10s\"\njitter = 0.0\n\n{routes}",
        upstream.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_decide_per_path_first_match_wins() {
    let (server, calls) = upstream().await;
    let listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let text = file(
        &server,
        listen,
        "[[route]]\npath = \"/static/*\"\nttl = \"1h\"\n\n[[route]]\npath = \"/api/cart/*\"\ncache = false\n\n[[route]]\npath = \"/api/*\"\nttl = \"2m\"\n",
    );
    let config = config_file::parse(&text, "tiercache.toml").unwrap().config;
    let proxy = Proxy::start(config).await.unwrap();
    let addr = proxy.addr();
    // A cached route with its own ttl.
    fetch(addr, "/static/site.css").await;
    let (_, headers, _) = fetch(addr, "/static/site.css").await;
    assert!(
        h(&headers, "cache-status").contains("ttl=3599")
            || h(&headers, "cache-status").contains("ttl=3600"),
        "{headers:?}"
    );
    // Passed through untouched: no cache, no cache fields; and it wins over
    // the broader route after it.
    for _ in 0..2 {
        let (_, headers, _) = fetch(addr, "/api/cart/items").await;
        assert_eq!(h(&headers, "x-cache"), "");
        assert_eq!(h(&headers, "cache-status"), "");
    }
    let before = calls.get();
    fetch(addr, "/api/cart/items").await;
    assert_eq!(
        calls.get(),
        before + 1,
        "a pass-through route is never cached"
    );
    fetch(addr, "/api/users").await;
    let (_, headers, _) = fetch(addr, "/api/users").await;
    let ttl: u64 = h(&headers, "cache-status")
        .split("ttl=")
        .nth(1)
        .and_then(|t| t.split(';').next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    assert!((115..=120).contains(&ttl), "{headers:?}");
    // No route: the defaults.
    fetch(addr, "/page").await;
    let (_, headers, _) = fetch(addr, "/page").await;
    assert_eq!(h(&headers, "x-cache"), "HIT");
    assert!(
        h(&headers, "cache-status").contains("ttl=9")
            || h(&headers, "cache-status").contains("ttl=10")
    );
}

#[test]
fn a_bad_file_is_refused_naming_the_file_the_line_and_the_field() {
    let cases = [
        (
            "[defaults]\nttl = \"10s\"\n\n[[route]]\npath = \"/a/*\"\njitter = 0.7\n",
            &[
                "tiercache.toml, line 6",
                "path = \"/a/*\"",
                "`jitter` is 0.7, but must be 0.0..=0.5",
            ][..],
        ),
        (
            "[defaults]\nttl = \"10s\"\njiter = 0.1\n",
            &["tiercache.toml", "line 3", "unknown field `jiter`"][..],
        ),
        (
            "[defaults]\nttl = \"10x\"\n",
            &["tiercache.toml", "line 2", "unit `x`"][..],
        ),
        (
            "[[route]]\nttl = \"1h\"\n",
            &["tiercache.toml, line 1", "needs `path`"][..],
        ),
        // A wrong type was told "data did not match any variant of
        // untagged enum Human".
        (
            "[defaults]\nttl = true\n",
            &["line 2", "expected a duration", "\"30s\""][..],
        ),
        (
            "[defaults]\nmax_body = -1\n",
            &["line 2", "-1 is not a size"][..],
        ),
        (
            "[defaults]\nmax_body = true\n",
            &["line 2", "expected a size", "\"8MiB\""][..],
        ),
    ];
    for (text, expected) in cases {
        let err = config_file::parse(text, "tiercache.toml")
            .unwrap_err()
            .to_string();
        for part in expected {
            assert!(err.contains(part), "{part:?} not in: {err}");
        }
    }
}

/// What the start refused, `--check-config` said valid (a black-box
/// audit): settings of the cache layer in a file, the defaults' or a
/// route's, are refused by both, naming the setting and the route.
/// Flags replace the file's cookie mode rather than clash with it, and a
/// route's cookie mode replaces the one it inherits.
#[test]
fn check_config_refuses_what_the_start_refuses() {
    let dir = tiercache_testkit::valkey::target_dir().join("config-test");
    std::fs::create_dir_all(&dir).unwrap();
    let check = |name: &str, text: &str, flags: &[&str]| {
        let path = dir.join(format!("{name}-{}.toml", std::process::id()));
        std::fs::write(&path, format!("upstream = \"http://127.0.0.1:9\"\n{text}")).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
            .arg("--config")
            .arg(&path)
            .args(flags)
            .arg("--check-config")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (name, text, names) in [
        (
            "route-key-header",
            "[[route]]\npath = \"/a/*\"\nkey_headers = [\"bad header\"]\n",
            &["`key_headers`", "`bad header`", "route `/a/*`"][..],
        ),
        (
            "targeted",
            "[defaults]\ntargeted_fields = [\"bad field\"]\n",
            &["`targeted_fields`", "`bad field`"][..],
        ),
        (
            "cookies",
            "[defaults]\nignore_cookies = true\nkey_cookies = [\"lang\"]\n",
            &["exclude each other"][..],
        ),
        (
            "authority",
            "[defaults]\ncanonical_authority = \"\"\n",
            &["`canonical_authority`"][..],
        ),
        (
            "variants",
            "[defaults]\nmax_variants = 0\n",
            &["`max_variants`", "at least 1"][..],
        ),
    ] {
        let (code, text) = check(name, text, &[]);
        assert_eq!(code, Some(2), "{name}: {text}");
        for part in names {
            assert!(text.contains(part), "{name}: {part:?} not in {text}");
        }
    }
    // The route policies again with the flags laid over the file.
    let (code, text) = check(
        "route-policy",
        "[[route]]\npath = \"/a/*\"\nttl = \"30s\"\n",
        &["--negative-ttl", "1m"],
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("negative_ttl") && text.contains("route `/a/*`"),
        "{text}"
    );
    for (name, text, flags) in [
        (
            "flag-ignores",
            "[defaults]\nkey_cookies = [\"lang\"]\n",
            &["--ignore-cookies"][..],
        ),
        (
            "flag-keys",
            "[defaults]\nignore_cookies = true\n",
            &["--key-cookie", "lang"][..],
        ),
        (
            "route-keys",
            "[defaults]\nignore_cookies = true\n[[route]]\npath = \"/a/*\"\nkey_cookies = [\"lang\"]\n",
            &[][..],
        ),
    ] {
        let (code, text) = check(name, text, flags);
        assert_eq!(code, Some(0), "{name}: {text}");
    }
}

/// A route's cookie setting replaces what it inherits only where it says
/// so: `ignore_cookies = false` alone keeps the inherited keys (it dropped
/// them, and the route bypassed every request with a cookie); keys turn
/// ignoring off; ignoring drops the keys.
#[test]
fn a_routes_cookie_setting_replaces_only_what_it_names() {
    let file = |defaults: &str, route: &str| {
        let text = format!(
            "upstream = \"http://127.0.0.1:9\"\n[defaults]\n{defaults}\n[[route]]\npath = \"/a/*\"\n{route}\n"
        );
        let config = config_file::parse(&text, "t.toml").unwrap().config;
        let route = config.with(&config.routes[0].settings);
        (route.ignore_cookies, route.key_cookies)
    };
    let lang = vec!["lang".to_owned()];
    assert_eq!(
        file("key_cookies = [\"lang\"]", "ignore_cookies = false"),
        (false, lang.clone())
    );
    assert_eq!(
        file("ignore_cookies = true", "key_cookies = [\"lang\"]"),
        (false, lang)
    );
    assert_eq!(
        file("key_cookies = [\"lang\"]", "ignore_cookies = true"),
        (true, vec![])
    );
    assert_eq!(
        file("ignore_cookies = true", "key_cookies = []"),
        (true, vec![])
    );
}

#[tokio::test]
async fn check_config_validates_and_exits() {
    let dir = tiercache_testkit::valkey::target_dir().join("config-test");
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join(format!("good-{}.toml", std::process::id()));
    let bad = dir.join(format!("bad-{}.toml", std::process::id()));
    std::fs::write(
        &good,
        "upstream = \"http://127.0.0.1:9\"\n[defaults]\nttl = \"10s\"\n",
    )
    .unwrap();
    std::fs::write(
        &bad,
        "upstream = \"http://127.0.0.1:9\"\n[defaults]\nttl = \"10s\"\njitter = 0.7\n",
    )
    .unwrap();
    let run = |path: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
            .arg("--config")
            .arg(path)
            .arg("--check-config")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let ok = run(&good);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = run(&bad);
    assert_eq!(refused.status.code(), Some(2));
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        text.contains("line 4") && text.contains("`jitter` is 0.7"),
        "{text}"
    );
    // The Valkey settings are checked too, without connecting.
    let refused = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
        .args(["--upstream", "http://127.0.0.1:9", "--check-config"])
        .args(["--valkey", "redis://127.0.0.1:9", "--valkey-timeout", "0ms"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("`--valkey-timeout`"), "{text}");
    // The admin token, from the environment: one that could be guessed is
    // refused, naming where it came from.
    let refused = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
        .args(["--upstream", "http://127.0.0.1:9", "--check-config"])
        .env("TIERCACHE_ADMIN_TOKEN", "short")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("TIERCACHE_ADMIN_TOKEN"), "{text}");
    // Settings that were taken silently before (a black-box audit): each is
    // refused naming what is wrong.
    for (args, names) in [
        (&["--upstream", "http://127.0.0.1:9/base"][..], "a path"),
        (
            &["--upstream", "http://127.0.0.1:9/?x=1"][..],
            "a path or query",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--valkey",
                "http://127.0.0.1:9",
            ][..],
            "the scheme must be redis://",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--valkey",
                "rediss://127.0.0.1:9?tls_cert=/etc/client.pem",
            ][..],
            "unknown parameter `tls_cert`",
        ),
        (
            &["--upstream", "http://127.0.0.1:9", "--max-body", "0"][..],
            "`--max-body`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--valkey-timeout",
                "0ms",
            ][..],
            "`--valkey-timeout`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-max-connections",
                "0",
            ][..],
            "`--upstream-max-connections`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-idle-timeout",
                "400d",
            ][..],
            "`--upstream-idle-timeout`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--max-requests-in-flight",
                "0",
            ][..],
            "`--max-requests-in-flight`",
        ),
        // Past a day the proxy panicked on the first body frame.
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--origin-timeout",
                "10000000000000000000s",
            ][..],
            "`--origin-timeout`",
        ),
        // Keyed, the client's value would pass as sent: its own address.
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--key-header",
                "X-Forwarded-For",
            ][..],
            "`--key-header`",
        ),
        // `--check-config` said valid, the start refused.
        (
            &["--upstream", "http://127.0.0.1:9", "--l1-capacity", "0"][..],
            "`--l1-capacity`",
        ),
        (
            &["--upstream", "http://127.0.0.1:9", "--max-refreshes", "0"][..],
            "`--max-refreshes`",
        ),
        // The start panicked past tokio's semaphore limit (a black-box
        // audit); `--check-config` said valid.
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--max-refreshes",
                "2305843009213693952",
            ][..],
            "`--max-refreshes`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-max-connections",
                "2305843009213693952",
            ][..],
            "`--upstream-max-connections`",
        ),
        // `--check-config` said valid, the start refused (the same audit).
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--key-header",
                "bad header",
            ][..],
            "`--key-header` `bad header`",
        ),
        (
            &["--upstream", "http://127.0.0.1:9", "--target", "bad field"][..],
            "`--target` `bad field`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--ignore-cookies",
                "--key-cookie",
                "lang",
            ][..],
            "exclude each other",
        ),
        // Taken, and sent upstream as `Host` (a client's was refused).
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--canonical-authority",
                "user@shop.example",
            ][..],
            "`--canonical-authority`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--canonical-authority",
                "shop.example:99999",
            ][..],
            "`--canonical-authority`",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:9",
                "--canonical-authority",
                "shop.example:notaport",
            ][..],
            "`--canonical-authority`",
        ),
    ] {
        let refused = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
            .args(args)
            .arg("--check-config")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(names), "{args:?}: {text}");
    }
}

/// A reload replaced the routes and said nothing of the settings it left
/// as they were (the budget, the upstream pool; the admin token too, then:
/// an operator who changed it and reloaded believed the old one revoked,
/// and a reload now applies it). It names each setting changed and left
/// until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_names_the_changed_settings_it_leaves_until_a_restart() {
    let (server, _calls) = upstream().await;
    let listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let parse = |extra: &str| {
        config_file::parse(&format!("{extra}{}", file(&server, listen, "")), "t.toml")
            .unwrap()
            .config
    };
    let proxy = Proxy::start(parse("admin_token = \"an-old-token-of-16+\"\n"))
        .await
        .unwrap();
    let same = parse("admin_token = \"an-old-token-of-16+\"\n");
    assert_eq!(proxy.reload(&same).unwrap(), Vec::<&str>::new());
    let mut changed = parse(
        "admin_token = \"a-new-token-of-16+\"\nl1_capacity = \"8MiB\"\nupstream_max_connections = 4\nmax_requests_in_flight = 64\n",
    );
    changed.jitter = 0.1;
    assert_eq!(
        proxy.reload(&changed).unwrap(),
        [
            "l1_capacity",
            "upstream_max_connections",
            "max_requests_in_flight"
        ],
        "the routes' own settings (jitter) and the admin token are applied, not named"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_routes_and_keeps_l1() {
    let (server, _calls) = upstream().await;
    let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let dir = tiercache_testkit::valkey::target_dir().join("config-test");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("reload-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        file(&server, listen, "[[route]]\npath = \"/x\"\ncache = false\n"),
    )
    .unwrap();
    let mut child = spawn_proxy(&["--config".as_ref(), path.as_os_str()], listen).await;
    fetch(listen, "/y").await;
    assert_eq!(h(&fetch(listen, "/y").await.1, "x-cache"), "HIT");
    assert_eq!(h(&fetch(listen, "/x").await.1, "x-cache"), "");

    // /x becomes cached; a bad file first is refused and changes nothing.
    std::fs::write(&path, "[defaults]\njitter = 0.9\n").unwrap();
    let hup = |pid: u32| {
        assert!(
            Command::new("kill")
                .args(["-HUP", &pid.to_string()])
                .status()
                .unwrap()
                .success()
        );
    };
    hup(child.id());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        h(&fetch(listen, "/x").await.1, "x-cache"),
        "",
        "a bad reload changed the routes"
    );
    std::fs::write(&path, file(&server, listen, "")).unwrap();
    hup(child.id());
    bounded("the reload takes", async {
        while h(&fetch(listen, "/x").await.1, "x-cache").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        h(&fetch(listen, "/y").await.1, "x-cache"),
        "HIT",
        "L1 survived the reload"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// The example file in the repository is valid.
#[test]
fn the_example_file_is_valid() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tiercache.example.toml");
    let file = config_file::load(&path).unwrap();
    assert_eq!(file.config.routes.len(), 3);
    assert!(file.has_upstream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canonical_authority_keys_every_host_alike() {
    let (server, calls) = upstream().await;
    let listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let text = format!(
        "{}canonical_authority = \"shop.example\"\n",
        file(&server, listen, "")
    );
    // In [defaults]: the file's routes (none here) inherit it.
    let config = config_file::parse(&text, "tiercache.toml").unwrap().config;
    let proxy = Proxy::start(config).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let mut seen = Vec::new();
    for host in ["shop.test:8080", "10.0.0.7:8081", "shop.example"] {
        let req = Request::get(format!("http://{}/p", proxy.addr()))
            .header("host", host)
            .body(Body::empty())
            .unwrap();
        let res = client.request(req).await.unwrap();
        seen.push(h(res.headers(), "x-cache").to_owned());
    }
    assert_eq!(seen, ["MISS", "HIT", "HIT"]);
    assert_eq!(calls.get(), 1);

    let bad = format!(
        "{}canonical_authority = \"not a host/\"\n",
        file(&server, listen, "")
    );
    let config = config_file::parse(&bad, "tiercache.toml").unwrap().config;
    let err = Proxy::start(config).await.unwrap_err().to_string();
    assert!(
        err.contains("`canonical_authority`") && err.contains("`not a host/`"),
        "{err}"
    );
}

#[tokio::test]
async fn a_zero_budget_with_valkey_is_refused_by_name() {
    // A sixteenth of the budget goes to the L2 write queue: a budget of 0
    // must not wrap around to an unbounded L1.
    let valkey = tiercache_testkit::ValkeyServer::start();
    let mut config = ProxyConfig::new("http://127.0.0.1:9".parse().unwrap());
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.valkey = Some(valkey.url());
    config.l1_capacity = 0;
    let err = Proxy::start(config).await.unwrap_err().to_string();
    assert!(err.contains("l1_capacity"), "{err}");
}

#[tokio::test]
async fn the_valkey_timeout_comes_from_the_file_and_a_bad_one_is_refused_by_name() {
    let text = "upstream = \"http://127.0.0.1:9\"\nvalkey_timeout = \"2s\"\n";
    let config = config_file::parse(text, "tiercache.toml").unwrap().config;
    assert_eq!(config.valkey_timeout, std::time::Duration::from_secs(2));
    let default = ProxyConfig::new("http://127.0.0.1:9".parse().unwrap());
    assert_eq!(
        default.valkey_timeout,
        tiercache_valkey::ValkeyConfig::DEFAULT_COMMAND_TIMEOUT
    );

    // Refused before any connection is tried, named as the user wrote it.
    let mut config = default.valkey_timeout(std::time::Duration::ZERO);
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.valkey = Some("redis://127.0.0.1:9".into());
    let err = Proxy::start(config).await.unwrap_err().to_string();
    assert!(err.contains("--valkey-timeout"), "{err}");
    assert!(err.contains("at most 60 s"), "{err}");
}

/// A request body that arrives chunk by chunk from the channel.
struct Upload(tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl hyper::body::Body for Upload {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(hyper::body::Frame::data(c))))
    }
}

/// `--origin-timeout` bounds the upstream's answer, not the client's
/// upload: a slow but steady upload longer than it (here 600 ms against
/// 300 ms) used to be a 504 ("no answer") though the upstream never had
/// the whole body; the timer now starts once it has. A silence within the
/// upload longer than the timeout still ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_counted_in_the_origin_timeout() {
    let app = Router::new().route(
        "/upload",
        axum::routing::post(|body: axum::body::Bytes| async move { format!("got {}", body.len()) }),
    );
    let server = Server::start(app).await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .origin_timeout(Duration::from_millis(300));
    let proxy = Proxy::start(config).await.unwrap();
    let client = Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let upload = |gaps: Vec<u64>| {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            for gap in gaps {
                tokio::time::sleep(Duration::from_millis(gap)).await;
                if tx
                    .send(bytes::Bytes::from_static(b"0123456789"))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Request::post(format!("http://{}/upload", proxy.addr()))
            .body(Body::new(Upload(rx)))
            .unwrap()
    };
    let res = bounded(
        "the upload",
        client.request(upload(vec![0, 150, 150, 150, 150])),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "got 50");
    // A silence of 800 ms within the upload: cut, not waited on for ever.
    let res = bounded(
        "the stalled upload",
        client.request(upload(vec![0, 800, 0])),
    )
    .await
    .unwrap();
    assert_ne!(res.status(), StatusCode::OK);
}

/// An upstream that never answers: past `--origin-timeout` the proxy
/// answers 504 itself, and with stale-if-error the stale copy answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_is_a_504_after_the_origin_timeout() {
    let calls = Counter::new();
    let app = Router::new()
        .route(
            "/{*path}",
            get(|State(c): State<Counter>| async move {
                if c.bump() > 1 {
                    std::future::pending::<()>().await;
                }
                ([("cache-control", "max-age=1")], "first")
            }),
        )
        .with_state(calls.clone());
    let server = Server::start(app).await;
    let mut config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .origin_timeout(Duration::from_millis(300));
    config.stale_if_error = Duration::from_secs(60);
    let proxy = Proxy::start(config).await.unwrap();
    assert_eq!(fetch(proxy.addr(), "/a").await.2, "first");
    // Stale after its second; the upstream now hangs: the stale copy answers.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = std::time::Instant::now();
    let (status, headers, body) = bounded("a stale answer", fetch(proxy.addr(), "/a")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "first"));
    assert_eq!(h(&headers, "x-cache"), "STALE");
    // A key with nothing stale: the proxy's own 504.
    let (status, _, body) = bounded("a 504", fetch(proxy.addr(), "/b")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A route's own `max_body = 0` is refused too, naming the route.
#[test]
fn a_route_storing_no_body_is_refused_by_name() {
    let text = "upstream = \"http://127.0.0.1:9\"\n\n[[route]]\npath = \"/a/*\"\nmax_body = 0\n";
    let config = config_file::parse(text, "tiercache.toml").unwrap().config;
    let err = config.check().unwrap_err().to_string();
    assert!(
        err.contains("`--max-body`") && err.contains("route `/a/*`"),
        "{err}"
    );
}

/// An upstream that sends its head and part of its body, then stalls: past
/// `--origin-timeout` with nothing read the proxy cuts the body (nginx's
/// `proxy_read_timeout` between two reads) and the client's answer with it
/// (its head and first bytes went on while the body was read to be
/// stored), stores nothing, and the next request loads and stores the
/// whole answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_is_cut_after_the_origin_timeout() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let connections = Counter::new();
    let served = connections.clone();
    let accept = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let n = served.bump();
            let _ = read_head(&mut socket).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-length: 10\r\ncache-control: max-age=60\r\n\r\n";
            // The first answer stops after three bytes and keeps its socket
            // open; the others are whole.
            let body = if n == 1 { "abc" } else { "0123456789" };
            let _ = socket.write_all(format!("{head}{body}").as_bytes()).await;
            held.push(socket);
        }
    });
    let config = ProxyConfig::new(format!("http://{upstream}").parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .origin_timeout(Duration::from_millis(300));
    let proxy = Proxy::start(config).await.unwrap();

    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let req = Request::get(format!("http://{}/s", proxy.addr()))
        .body(Body::empty())
        .unwrap();
    let started = std::time::Instant::now();
    let stalled = tokio::time::timeout(Duration::from_secs(10), async {
        let res = client.request(req).await.map_err(|e| e.to_string())?;
        let status = res.status();
        let body = res.into_body().collect().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((status, body.to_bytes()))
    })
    .await
    .expect("the stalled body was not cut within 10 s");
    assert!(
        stalled.as_ref().is_err_and(|e| e.contains("body")),
        "a cut body is not a whole one: {stalled:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let (status, headers, body) = bounded("the next request", fetch(proxy.addr(), "/s")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "0123456789"));
    assert_eq!(
        h(&headers, "x-cache"),
        "MISS",
        "the cut body was not stored"
    );
    let (_, headers, body) = bounded("a hit", fetch(proxy.addr(), "/s")).await;
    assert_eq!(
        (h(&headers, "x-cache"), body.as_str()),
        ("HIT", "0123456789")
    );
    assert_eq!(connections.get(), 2);
    accept.abort();
}

/// A chunked upstream body still coming after its first chunk (a slow
/// generator) reaches the client as it comes while the proxy reads it to
/// store it: the client has the head and the first chunk while the
/// upstream still holds the rest (before, nothing until the whole body).
/// Once whole it is stored, and the next request is a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_body_reaches_the_client_as_it_comes_and_is_stored() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let connections = Counter::new();
    let served = connections.clone();
    let accept = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        served.bump();
        let _ = read_head(&mut socket).await;
        let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\
                    cache-control: max-age=60\r\n\r\n6\r\nfirst \r\n";
        socket.write_all(head.as_bytes()).await.unwrap();
        let _ = released.await;
        socket.write_all(b"4\r\nlast\r\n0\r\n\r\n").await.unwrap();
        // Held open: a second request on a new connection would hang.
        std::future::pending::<()>().await;
    });
    let config = ProxyConfig::new(format!("http://{upstream}").parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    let proxy = Proxy::start(config).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let req = Request::get(format!("http://{}/slow", proxy.addr()))
        .body(Body::empty())
        .unwrap();
    let res = bounded("the head", client.request(req)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(h(res.headers(), "x-cache"), "MISS");
    let mut body = res.into_body();
    let first = bounded("the first chunk", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "first ");
    release.send(()).unwrap();
    let rest = bounded("the rest", body.collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(rest, "last");
    let (status, headers, text) = bounded("a hit", fetch(proxy.addr(), "/slow")).await;
    assert_eq!(
        (status, h(&headers, "x-cache"), text.as_str()),
        (StatusCode::OK, "HIT", "first last")
    );
    assert_eq!(connections.get(), 1);
    accept.abort();
}

/// A URL marked uncacheable (its first answer was `private`) whose next
/// answer may be stored, with a `Content-Length`, slow: it reaches its
/// client as it comes (a bypass), and is stored even though HTTP/1 stops
/// reading the response at its length (the store ran in the response's
/// body, never polled to its end, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_answer_to_a_marked_url_goes_on_as_it_comes_and_is_stored() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let connections = Counter::new();
    let served = connections.clone();
    let accept = tokio::spawn(async move {
        let mut released = Some(released);
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let n = served.bump();
            let _ = read_head(&mut socket).await;
            if n == 1 {
                let head = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\
                            cache-control: private\r\nconnection: close\r\n\r\nhello";
                let _ = socket.write_all(head.as_bytes()).await;
                continue;
            }
            let head = "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\
                        cache-control: max-age=60\r\n\r\nfirst";
            socket.write_all(head.as_bytes()).await.unwrap();
            let _ = released.take().unwrap().await;
            socket.write_all(b"12345").await.unwrap();
            std::future::pending::<()>().await;
        }
    });
    let config = ProxyConfig::new(format!("http://{upstream}").parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    let proxy = Proxy::start(config).await.unwrap();
    let (_, headers, text) = bounded("the private answer", fetch(proxy.addr(), "/m")).await;
    assert_eq!((h(&headers, "x-cache"), text.as_str()), ("MISS", "hello"));
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let req = Request::get(format!("http://{}/m", proxy.addr()))
        .body(Body::empty())
        .unwrap();
    let res = bounded("the head", client.request(req)).await.unwrap();
    assert_eq!(h(res.headers(), "x-cache"), "BYPASS");
    let mut body = res.into_body();
    let first = bounded("the first bytes", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "first");
    release.send(()).unwrap();
    let rest = bounded("the rest", body.collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(rest, "12345");
    let engine = proxy.engine().clone();
    eventually("stored", || engine.l1_entry_count() == 1).await;
    let (_, headers, text) = bounded("a hit", fetch(proxy.addr(), "/m")).await;
    assert_eq!(
        (h(&headers, "x-cache"), text.as_str()),
        ("HIT", "first12345")
    );
    assert_eq!(connections.get(), 2);
    accept.abort();
}

/// An upstream body that ends before it is whole (a chunked body closed
/// without its last chunk; a `Content-Length` longer than what is sent)
/// never reaches the client as a complete response, and never holds a
/// keep-alive client (a black-box audit saw `content-length: 3000` and a
/// clean end for the first, a connection left open for the second). Read
/// whole to be stored, none of it sent yet, it is answered 502 (it was the
/// origin's head with a body that broke, which hyper sent as nothing at
/// all: an empty reply); one streaming through reaches the client cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_body_that_breaks_off_never_reaches_the_client_whole() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let Some(head) = read_head(&mut socket).await else {
                    return;
                };
                let private = head.windows(8).any(|w| w == b"-private");
                let cache_control: &[u8] = if private { b"private" } else { b"max-age=60" };
                let framing: &[u8] = if head.starts_with(b"GET /chunked") {
                    b"transfer-encoding: chunked\r\ncache-control: "
                } else {
                    b"content-length: 100\r\ncache-control: "
                };
                let rest: &[u8] = if head.starts_with(b"GET /chunked") {
                    b"\r\n\r\n5\r\nhello\r\n"
                } else {
                    b"\r\n\r\nfifty"
                };
                let answer = [&b"HTTP/1.1 200 OK\r\n"[..], framing, cache_control, rest].concat();
                let _ = socket.write_all(&answer).await;
                // Closed here: the body ends before it is whole.
            });
        }
    });
    let config = ProxyConfig::new(format!("http://{upstream}").parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    let proxy = Proxy::start(config).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    for (path, stored) in [
        ("/chunked", true),
        ("/short", true),
        ("/chunked-private", false),
        ("/short-private", false),
    ] {
        let req = Request::get(format!("http://{}{path}", proxy.addr()))
            .body(Body::empty())
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), async {
            let res = client.request(req).await.map_err(|e| e.to_string())?;
            let status = res.status();
            let body = res.into_body().collect().await.map_err(|e| e.to_string())?;
            Ok::<_, String>((status, body.to_bytes()))
        })
        .await
        .unwrap_or_else(|_| panic!("{path}: the client was held past 10 s"));
        if stored {
            assert_eq!(
                answer.as_ref().map(|(status, _)| *status),
                Ok(StatusCode::BAD_GATEWAY),
                "{path}: {answer:?}"
            );
        } else {
            assert!(
                answer.is_err(),
                "{path}: a cut body reached the client as whole: {answer:?}"
            );
        }
    }
    accept.abort();
}

/// A client that asks and then reads nothing held its connection, and the
/// body it pins, for ever: hyper has no write timer. A write left pending
/// for `--client-timeout` (here 1 s) now ends the connection, as nginx's
/// `send_timeout` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BODY: usize = 32 * 1024 * 1024;
    let big = Router::new().route("/big", get(|| async { vec![b'x'; BODY] }));
    let server = Server::start(big).await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .client_timeout(Duration::from_secs(1));
    let proxy = Proxy::start(config).await.unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut client = socket.connect(proxy.addr()).await.unwrap();
    client
        .write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    // Reads nothing while the proxy's writes fill the socket's buffers,
    // and for the timeout past that.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    let drained = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
        }
    })
    .await;
    assert!(
        drained.is_ok(),
        "the connection was still open 35 s after a client stopped reading ({got} bytes read)"
    );
    assert!(
        got < BODY,
        "the whole body arrived: the client was never cut off"
    );
}

/// A client that sends nothing, or only part of a request's head, is cut
/// off after `--client-timeout` (here 10 s; 75 s by default) instead of holding its
/// connection for ever (a black-box audit: slowloris clients still open
/// after 150 s, 20,000 idle connections starving the proxy and its admin
/// port). The clock is paused: tokio moves it on while everything waits.
#[tokio::test(start_paused = true)]
async fn a_client_that_sends_no_head_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, _) = upstream().await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .admin(SocketAddr::from(([127, 0, 0, 1], 0)))
        .client_timeout(Duration::from_secs(10));
    let proxy = Proxy::start(config).await.unwrap();
    let admin = proxy.admin_addr().expect("an admin port");
    let whole = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n";
    for (addr, sent) in [
        (proxy.addr(), &b""[..]),
        (proxy.addr(), &b"GET /a HTTP/1.1\r\nHo"[..]),
        // What could be the start of HTTP/2's preface.
        (proxy.addr(), &b"PRI * HT"[..]),
        (admin, &b""[..]),
        // A keep-alive connection idle after its first request.
        (proxy.addr(), &whole[..]),
    ] {
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client.write_all(sent).await.unwrap();
        if sent == whole {
            let mut head = [0u8; 1024];
            let n = client.read(&mut head).await.unwrap();
            assert!(head[..n].starts_with(b"HTTP/1.1 200"));
        }
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(300), client.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("{addr} {sent:?}: still open after 300 s"));
        // Closed (or a 408 then closed): either way the connection ends.
        if let Ok(n) = read
            && n > 0
        {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(11),
            "{addr} {sent:?}: cut off after {took:?}"
        );
    }
    // An HTTP/2 client that sends its preface and settings, then nothing:
    // hyper has no idle timeout for HTTP/2; the proxy's watchdog shuts the
    // connection down (a GOAWAY, then the close).
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let settings = [0u8, 0, 0, 4, 0, 0, 0, 0, 0];
    client
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    client.write_all(&settings).await.unwrap();
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(300), async {
        let mut buf = [0u8; 256];
        while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await
    .expect("an idle HTTP/2 connection still open after 300 s");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(10) && took <= Duration::from_secs(41),
        "HTTP/2 idle: cut off after {took:?}"
    );
}

/// An HTTP/2 client that asks and then takes no data (its stream's window
/// left shut, at 0 or at 1 byte) leaves nothing pending on the socket for
/// the send timer to see, and h2 keeps what hyper handed it; the idle
/// watchdog's graceful shutdown waits for the stream, so the connection,
/// and the body it pins, were held for as long as the client answered
/// pings. A closing connection that writes next to nothing for
/// `--client-timeout` while waiting on nothing but its client is now
/// closed. The clock is paused: tokio moves it on while everything waits.
#[tokio::test(start_paused = true)]
async fn an_http2_client_that_takes_no_data_is_cut_off() {
    let (server, _) = upstream().await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .client_timeout(Duration::from_secs(10));
    let proxy = Proxy::start(config).await.unwrap();
    for window in [0, 1] {
        let (mut sender, conn) = h2c(proxy.addr(), Some(window)).await;
        let req = Request::get(format!("http://{}/a", proxy.addr()))
            .version(axum::http::Version::HTTP_2)
            .body(Body::empty())
            .unwrap();
        let res = sender.send_request(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        // Its body is held unread: the window stays shut.
        let started = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(300), conn)
            .await
            .unwrap_or_else(|_| panic!("window {window}: still open after 300 s"))
            .unwrap()
            .ok();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(31),
            "window {window}: cut off after {took:?}"
        );
        drop(res);
    }
}

/// The other side of the watchdog above: a connection waiting on a slow
/// upstream (35 s for a response's head, or between two chunks of its
/// body: past two `--client-timeout`s, within `--origin-timeout`) waits on
/// its source, not on the client: the answers arrive whole over HTTP/2.
#[tokio::test(start_paused = true)]
async fn an_http2_response_waiting_on_a_slow_upstream_is_not_cut_off() {
    let slow = Router::new()
        .route(
            "/slow-body",
            get(|| async {
                // 35 s apart (a slow upstream), from now.
                let gap = tokio::time::sleep(Duration::from_secs(35));
                let chunks = TwoChunks::new("first ", async move {
                    gap.await;
                    "second"
                });
                ([("cache-control", "no-store")], Body::new(chunks))
            }),
        )
        .route(
            "/slow-head",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(35)).await;
                "first second"
            }),
        );
    let server = Server::start(slow).await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .client_timeout(Duration::from_secs(10));
    let proxy = Proxy::start(config).await.unwrap();
    for path in ["/slow-body", "/slow-head"] {
        let (mut sender, _conn) = h2c(proxy.addr(), None).await;
        let req = Request::get(format!("http://{}{path}", proxy.addr()))
            .version(axum::http::Version::HTTP_2)
            .body(Body::empty())
            .unwrap();
        let res = sender.send_request(req).await.expect(path);
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        let body = res.into_body().collect().await.expect(path);
        assert_eq!(body.to_bytes(), "first second", "{path}");
    }
}

/// A request with two `Host` fields is refused with a 400 (RFC 9112 §3.2),
/// not forwarded with both (which one the upstream reads is its business;
/// a black-box audit saw both sent on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_two_hosts_is_a_400() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, calls) = upstream().await;
    let config = ProxyConfig::new(server.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    let proxy = Proxy::start(config).await.unwrap();
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    client
        .write_all(
            b"GET /a HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\nconnection: close\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    bounded("the answer", client.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(calls.get(), 0, "nothing reached the upstream");
}

/// `client_timeout` comes from the file (75 s by default), and 0 is
/// refused by name.
#[test]
fn the_client_timeout_comes_from_the_file_and_zero_is_refused() {
    let default = ProxyConfig::new("http://127.0.0.1:9".parse().unwrap());
    assert_eq!(default.client_timeout, Duration::from_secs(75));
    let text = "upstream = \"http://127.0.0.1:9\"\nclient_timeout = \"2m\"\n";
    let config = config_file::parse(text, "tiercache.toml").unwrap().config;
    assert_eq!(config.client_timeout, Duration::from_secs(120));
    let err = config
        .client_timeout(Duration::ZERO)
        .check()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--client-timeout"), "{err}");
}

/// Reads a request's head off a raw upstream socket (`None` if the client
/// goes away first).
async fn read_head(socket: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(read) => head.extend_from_slice(&buf[..read]),
        }
    }
    Some(head)
}

/// `SIGTERM` (a rolling update, `systemctl stop`) and `SIGINT` stop the
/// proxy gracefully: it exits 0 rather than dying of the signal; `SIGHUP`
/// without a config file is no death either (nothing to reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_sigint_stop_the_proxy_gracefully() {
    let upstream = tiercache_testkit::Server::start(axum::Router::new()).await;
    for signal in ["-TERM", "-INT"] {
        let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let (url, at) = (upstream.url(), listen.to_string());
        let args = ["--upstream", &url, "--listen", &at].map(std::ffi::OsStr::new);
        let mut child = spawn_proxy(&args, listen).await;
        let kill = |signal: &str| {
            Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .unwrap()
        };
        if signal == "-TERM" {
            assert!(kill("-HUP").success());
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(
                std::net::TcpStream::connect(listen).is_ok(),
                "SIGHUP without a config file ended the proxy"
            );
        }
        assert!(kill(signal).success());
        let status = bounded("the proxy exits", async {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(status.success(), "{signal}: {status:?}");
    }
}

/// The proxy binary started with `args`, once it listens on `listen`.
async fn spawn_proxy(args: &[&std::ffi::OsStr], listen: SocketAddr) -> std::process::Child {
    let child = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    bounded("the proxy listens", async {
        while std::net::TcpStream::connect(listen).is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    child
}

/// Client connections are capped (`--max-connections`, as nginx's
/// `worker_connections`): past the cap a new connection waits in the
/// kernel's backlog, unserved, until one closes. Before, every connection
/// was served, each with its buffers, as many as file descriptors allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_until_one_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = Server::start(Router::new().route("/p", get(|| async { "page" }))).await;
    let config = ProxyConfig::new(upstream.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .max_connections(2);
    let proxy = Proxy::start(config).await.unwrap();
    let connect = || tokio::net::TcpStream::connect(proxy.addr());
    // Two connections that asked something hold the two places.
    let mut held = Vec::new();
    for _ in 0..2 {
        let status = bounded("a held connection", async {
            let mut stream = connect().await.unwrap();
            let answer = get_on(&mut stream).await;
            held.push(stream);
            answer
        })
        .await;
        assert_eq!(status, 200);
    }
    let mut third = connect().await.unwrap();
    third
        .write_all(b"GET /p HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 12];
    let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut first)).await;
    assert!(
        early.is_err(),
        "a third connection was served past a cap of 2"
    );
    drop(held.pop());
    bounded(
        "the third once a place is free",
        third.read_exact(&mut first),
    )
    .await
    .unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
}

/// Sends `GET /p` on `stream` and reads the answer's status (its body is
/// short and read with it).
async fn get_on(stream: &mut tokio::net::TcpStream) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(b"GET /p HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.unwrap();
    std::str::from_utf8(&head[9..12]).unwrap().parse().unwrap()
}

/// An HTTP/2 connection carries at most 128 requests at once (nginx's
/// `http2_max_concurrent_streams`); more wait on the client's side. It
/// was hyper's 200, each stream with a send buffer of up to 400 KiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_carries_at_most_128_requests_at_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tiercache_testkit::Gate;

    #[derive(Clone, Default)]
    struct Held {
        now: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        gate: Gate,
    }
    let held = Held::default();
    let upstream = Server::start(
        Router::new()
            .route(
                "/h/{i}",
                get(|State(h): State<Held>| async move {
                    let now = h.now.fetch_add(1, SeqCst) + 1;
                    h.most.fetch_max(now, SeqCst);
                    h.gate.passed().await;
                    h.now.fetch_sub(1, SeqCst);
                    "held"
                }),
            )
            .with_state(held.clone()),
    )
    .await;
    let config = ProxyConfig::new(upstream.url().parse().unwrap())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)));
    let proxy = Proxy::start(config).await.unwrap();
    let (sender, _conn) = h2c(proxy.addr(), None).await;
    let requests: Vec<_> = (0..200)
        .map(|i| {
            let mut sender = sender.clone();
            let req = Request::get(format!("http://{}/h/{i}", proxy.addr()))
                .version(axum::http::Version::HTTP_2)
                .body(Body::empty())
                .unwrap();
            tokio::spawn(async move {
                sender.ready().await.unwrap();
                sender.send_request(req).await.map(|res| res.status())
            })
        })
        .collect();
    bounded("128 requests at the upstream", async {
        while held.now.load(SeqCst) < 128 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // Time for more to arrive, were they let through.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(held.most.load(SeqCst), 128);
    held.gate.open();
    for request in requests {
        let status = bounded("a request", request).await.unwrap();
        assert_eq!(status.unwrap(), StatusCode::OK);
    }
}

/// Why L2 is off reaches the operator on stderr: the connection failure as
/// it happens, then `connected again` once Valkey is back, and no stream
/// of lines in between (one a minute while a failure repeats, none more
/// often than every 10 s). Before, the proxy said nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_l2_is_off_is_told_on_stderr() {
    use std::io::BufRead;
    let mut valkey = tiercache_testkit::ValkeyServer::start();
    valkey.kill();
    let listen = SocketAddr::from(([127, 0, 0, 1], tiercache_testkit::valkey::free_port()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tiercache-proxy"))
        .args([
            "--upstream",
            "http://127.0.0.1:9",
            "--valkey",
            &valkey.url(),
        ])
        .args(["--listen", &listen.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut told = Vec::new();
    let mut until = async |what: &str, found: &dyn Fn(&str) -> bool| {
        bounded(what, async {
            loop {
                let line = lines.recv().await.expect("the proxy's stderr ended");
                let hit = found(&line);
                told.push(line);
                if hit {
                    return;
                }
            }
        })
        .await;
    };
    until("the failure told", &|line| {
        line.starts_with("tiercache-proxy: Valkey:")
            && line.to_ascii_lowercase().contains("refused")
    })
    .await;
    valkey.restart();
    until("its end told", &|line| {
        line == "tiercache-proxy: Valkey: connected again"
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let about_valkey = told.iter().filter(|l| l.contains("Valkey:")).count();
    assert_eq!(about_valkey, 2, "{told:#?}");
}
