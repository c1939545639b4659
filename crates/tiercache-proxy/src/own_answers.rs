//! The answers the proxy gives itself, and the upstream failures among
//! them counted apart: through the cache they are origin answers like any
//! other 5xx (an origin load, `not_stored{reason="no-freshness"}`), so a
//! refused or hung upstream could not be told from an upstream answering
//! 502 itself.

use axum::body::Body;
use http::{Response, StatusCode};
use metrics::{Counter, Key, KeyName, Label, Level, Metadata, Recorder, SharedString};

use crate::forward::UpstreamBody;

/// `tiercache_upstream_failures_total`, by `kind`.
const NAME: &str = "tiercache_upstream_failures_total";

/// Handles of one proxy's upstream failure counters (no-ops until
/// [`registered`](Self::registered)).
#[derive(Debug, Clone)]
pub(crate) struct Failures {
    /// No connection, or it failed before an answer, or its answer could
    /// not be read (a 502).
    pub(crate) unreachable: Counter,
    /// No answer within `--origin-timeout` (a 504).
    pub(crate) timeout: Counter,
    /// Every connection to the upstream stayed in use (`--upstream-max-connections`, a 503).
    pub(crate) busy: Counter,
}

impl Default for Failures {
    fn default() -> Self {
        Self {
            unreachable: Counter::noop(),
            timeout: Counter::noop(),
            busy: Counter::noop(),
        }
    }
}

impl Failures {
    /// The counters in `recorder`, described.
    pub(crate) fn registered(recorder: &dyn Recorder) -> Self {
        static METADATA: Metadata<'static> =
            Metadata::new(module_path!(), Level::INFO, Some(module_path!()));
        recorder.describe_counter(
            KeyName::from_const_str(NAME),
            None,
            SharedString::const_str(
                "Requests the proxy answered itself for its upstream, by kind: unreachable (502), \
                 timeout (504, --origin-timeout), busy (503, every connection in use).",
            ),
        );
        let counter = |kind: &'static str| {
            let key = Key::from_parts(NAME, vec![Label::new("kind", kind)]);
            recorder.register_counter(&key, &METADATA)
        };
        Self {
            unreachable: counter("unreachable"),
            timeout: counter("timeout"),
            busy: counter("busy"),
        }
    }
}

/// The proxy's own answer, with `text` as its body (none for a HEAD: RFC
/// 9110 §9.3.2; over HTTP/2, hyper sends whatever body a HEAD's answer has).
pub(crate) fn own_answer(status: StatusCode, text: String, head: bool) -> Response<UpstreamBody> {
    let body = if head {
        Body::empty()
    } else {
        Body::from(text)
    };
    let mut res = Response::new(http_body_util::Either::Right(body));
    *res.status_mut() = status;
    res
}

/// What the 502 for a failed exchange says: an answer whose head was too
/// large to read (past [`MAX_UPSTREAM_HEAD`](crate::forward::MAX_UPSTREAM_HEAD), or of more than 100 fields:
/// hyper says the same of both), one not read as HTTP/1.1, or none.
pub(crate) fn failure_text(e: &hyper_util::client::legacy::Error) -> String {
    match crate::connector::hyper_cause(e) {
        Some(h) if h.is_parse_too_large() => format!(
            "tiercache-proxy: upstream sent an answer head too large to read \
             (past {} KiB, or of more than 100 fields)\n",
            crate::forward::MAX_UPSTREAM_HEAD / 1024
        ),
        Some(h) if h.is_parse() => {
            format!("tiercache-proxy: upstream sent an answer that could not be read: {h}\n")
        }
        _ => format!("tiercache-proxy: upstream unreachable: {e}\n"),
    }
}
