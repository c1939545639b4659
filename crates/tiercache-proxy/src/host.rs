//! The request's `Host`, checked before the cache or the upstream sees it.

use http::header::HOST;
use http::uri::Authority;
use http::{Request, Version};

/// Why a request's `Host` makes it one a server must refuse with a 400
/// (RFC 9112 §3.2), or `None`: an HTTP/1.1 request without one, any
/// request with more than one, or one whose value is not a host and an
/// optional port (`evil.example/x?`, `user@host`, `a b`, `a:notaport`),
/// or is empty: a target without an authority may have an empty `Host`,
/// but a reverse proxy's targets all have one, and keyed on the empty
/// value an HTTP/1.0 request without `Host` (sent to the upstream with
/// its own address) would share entries with it. A target's own
/// authority (HTTP/2's `:authority`, an absolute-form target) may carry
/// no userinfo either (RFC 9113 §8.3.1).
pub(crate) fn host_problem<B>(req: &Request<B>) -> Option<&'static str> {
    // Checked as `Host` is (`http`'s parser does not look at a port's
    // digits), userinfo refused.
    if req
        .uri()
        .authority()
        .is_some_and(|a| !is_host_and_port(a.as_str().as_bytes()))
    {
        return Some("the request's target is no host and port");
    }
    let mut hosts = req.headers().get_all(HOST).iter();
    let Some(host) = hosts.next() else {
        return (req.version() == Version::HTTP_11).then_some("an HTTP/1.1 request needs a Host");
    };
    if hosts.next().is_some() {
        return Some("a request may carry one Host field");
    }
    (!is_host_and_port(host.as_bytes())).then_some("the Host field is no host and port")
}

/// Whether `value` is `uri-host [ ":" port ]` (RFC 9110 §7.2) with a host.
pub(crate) fn is_host_and_port(value: &[u8]) -> bool {
    if value.is_empty() || value.contains(&b'@') {
        return false;
    }
    // The authority's syntax, then its port, which it does not check: none,
    // empty, or digits that fit (`+80` parses as a number, and is not one).
    Authority::try_from(value).is_ok_and(|a| {
        let port = &a.as_str()[a.host().len()..];
        port.strip_prefix(':').map_or(port.is_empty(), |digits| {
            digits.bytes().all(|b| b.is_ascii_digit())
                && (digits.is_empty() || digits.parse::<u16>().is_ok())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_host(version: Version, hosts: &[&str]) -> Option<&'static str> {
        let mut req = Request::get("/").version(version);
        for host in hosts {
            req = req.header(HOST, *host);
        }
        host_problem(&req.body(()).unwrap())
    }

    #[test]
    fn a_host_is_a_host_and_an_optional_port() {
        for good in [
            "a.example",
            "A.example:8080",
            "[::1]:80",
            "127.0.0.1",
            "a:",
            "a,b",
        ] {
            assert_eq!(with_host(Version::HTTP_11, &[good]), None, "{good:?}");
        }
        for bad in [
            "x/y", "x?", "user@x", "a b", "a:port", "a:99999", "[::1", "a:+80", "",
        ] {
            assert!(with_host(Version::HTTP_11, &[bad]).is_some(), "{bad:?}");
        }
        assert!(with_host(Version::HTTP_11, &[]).is_some());
        assert!(with_host(Version::HTTP_11, &["a", "b"]).is_some());
        assert!(with_host(Version::HTTP_2, &["a", "b"]).is_some());
        assert_eq!(with_host(Version::HTTP_10, &[]), None);
        assert_eq!(with_host(Version::HTTP_2, &[]), None);
        for target in [
            "http://user@a.example/",
            "http://a:+80/",
            "http://a:notaport/",
        ] {
            let req = Request::get(target).body(()).unwrap();
            assert!(host_problem(&req).is_some(), "{target}");
        }
        let h2 = |target: &str| {
            let req = Request::get(target).version(Version::HTTP_2);
            host_problem(&req.body(()).unwrap())
        };
        assert_eq!(h2("http://a.example:8080/"), None);
        assert!(h2("http://a.example:notaport/").is_some(), ":authority");
    }
}
