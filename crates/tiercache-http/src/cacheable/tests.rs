//! What a request may use and what a response may be stored as.

use super::*;
use http::Response;

fn refused(
    build: impl FnOnce(http::response::Builder) -> http::response::Builder,
) -> Result<(), Reason> {
    let p = build(Response::builder()).body(()).unwrap().into_parts().0;
    response_storable(p.status, &p.headers, &p.headers, false)
}

#[test]
fn refuses_what_may_not_be_shared() {
    let cases = [
        (refused(|b| b.status(400)), Reason::Status),
        (refused(|b| b.status(431)), Reason::Status),
        (refused(|b| b.status(206)), Reason::Status),
        (
            refused(|b| b.header("set-cookie", "a=b")),
            Reason::SetCookie,
        ),
        (
            refused(|b| b.header("cache-control", "max-age=60, No-Store")),
            Reason::NoStore,
        ),
        (
            refused(|b| b.header("cache-control", "private=\"x\"")),
            Reason::Private,
        ),
        (refused(|b| b.header("vary", "accept, *")), Reason::VaryStar),
    ];
    for (got, reason) in cases {
        assert_eq!(got, Err(reason));
    }
    assert_eq!(refused(|b| b.status(404)), Ok(()));
    assert_eq!(
        refused(|b| b.header("cache-control", "public, max-age=5")),
        Ok(())
    );
}

#[test]
fn credentialed_responses_need_a_sharing_directive() {
    let p = Response::builder().body(()).unwrap().into_parts().0;
    assert_eq!(
        response_storable(p.status, &p.headers, &p.headers, true),
        Err(Reason::Authorization)
    );
    for cc in ["public", "s-maxage=5", "Must-Revalidate, max-age=5"] {
        let p = Response::builder()
            .header("cache-control", cc)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_eq!(
            response_storable(p.status, &p.headers, &p.headers, true),
            Ok(()),
            "{cc}"
        );
    }
}

#[test]
fn only_plain_gets_and_heads() {
    let req = |m: Method, h: &[(&str, &str)]| {
        let mut b = http::Request::builder().method(m).uri("/");
        for (n, v) in h {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    };
    assert_eq!(request_cacheable(&req(Method::GET, &[])), Ok(()));
    assert_eq!(
        request_cacheable(&req(Method::HEAD, &[("content-length", "0")])),
        Ok(())
    );
    assert_eq!(
        request_cacheable(&req(Method::POST, &[])),
        Err(Reason::Method)
    );
    let too_long = "h".repeat(MAX_HOST + 1);
    let refused = [
        (vec![("cache-control", "no-store")], Reason::RequestNoStore),
        (vec![("content-length", "3")], Reason::RequestBody),
        (vec![("transfer-encoding", "chunked")], Reason::RequestBody),
        (vec![("if-match", "\"a\"")], Reason::Precondition),
        (
            vec![("if-unmodified-since", "Sun, 06 Nov 1994 08:49:37 GMT")],
            Reason::Precondition,
        ),
        (vec![("host", "a"), ("host", "b")], Reason::Host),
        (vec![("upgrade", "websocket")], Reason::Upgrade),
        (vec![("upgrade", "h2c, WebSocket/13")], Reason::Upgrade),
        (
            vec![("upgrade", "h2c"), ("upgrade", "foo")],
            Reason::Upgrade,
        ),
        // Longer than any DNS name and port: the client's own size.
        (vec![("host", too_long.as_str())], Reason::Host),
    ];
    for only_h2c in ["h2c", "H2C , ", ""] {
        let upgrade = [("upgrade", only_h2c)];
        assert_eq!(request_cacheable(&req(Method::GET, &upgrade)), Ok(()));
    }
    let longest = format!("{}:65535", "h".repeat(253));
    assert_eq!(
        request_cacheable(&req(Method::GET, &[("host", &longest)])),
        Ok(())
    );
    for (headers, reason) in refused {
        assert_eq!(
            request_cacheable(&req(Method::GET, &headers)),
            Err(reason),
            "{headers:?}"
        );
    }
    let absolute = http::Request::get("http://victim.example/")
        .header("host", "evil.example")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    assert_eq!(request_cacheable(&absolute), Err(Reason::Host));
}
