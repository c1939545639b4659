//! Framing: what the engine answered, as the response the client gets, with
//! the cache's own fields and the route's metrics.

use bytes::Bytes;
use http::{Response, StatusCode};
use tiercache_core::{Answer, FetchError, Fetched, Served, Source};

use crate::body::CacheBody;
use crate::cacheable::{Reason, status_never_stored};
use crate::headers::{self, Outcome};
use crate::origin::Passed;
use crate::route::{Ask, Route};

impl Route {
    /// The response for what a fetch after an L1 miss answered.
    pub(crate) fn respond<B, E>(
        &self,
        fetched: Result<Fetched<Passed<B>>, FetchError<E>>,
        ask: &Ask,
    ) -> Result<Response<CacheBody<B>>, E> {
        match fetched {
            Ok(Fetched::Entry(answer)) => Ok(self.answer(&answer, ask)),
            // Its own load, even after a wait on another's (whose answer
            // could not be shared): RFC 9211's `collapsed` is for an
            // answer reused from another request's, so it is not said.
            Ok(Fetched::Passed {
                output: (mut res, reason),
                collapsed: _,
                hit_for_miss,
            }) => {
                // The client's validators were kept from the origin (so it
                // answers in full, for the cache); they are answered here,
                // against what was passed, as against a stored entry.
                if res.status() == StatusCode::OK && !ask.conditional.is_empty() {
                    let etag = res.headers().get(http::header::ETAG).map(|v| v.as_bytes());
                    let modified = res
                        .headers()
                        .get(http::header::LAST_MODIFIED)
                        .and_then(|v| v.to_str().ok())
                        .and_then(crate::freshness::parse_http_date);
                    if ask.conditional.not_modified(etag, modified) {
                        let mut head = headers::not_modified_fields(res.headers());
                        // A cookie is this client's own (often why the
                        // response was passed): its 304 keeps it.
                        for cookie in res.headers().get_all(http::header::SET_COOKIE) {
                            head.append(http::header::SET_COOKIE, cookie.clone());
                        }
                        res = Response::new(CacheBody::empty());
                        *res.status_mut() = StatusCode::NOT_MODIFIED;
                        *res.headers_mut() = head;
                    }
                }
                if ask.head {
                    *res.body_mut() = CacheBody::empty();
                }
                self.label_own_load(&mut res, hit_for_miss, Some(reason));
                Ok(res)
            }
            Err(FetchError::Origin(e)) => Err(e),
            Err(FetchError::Panicked(panic)) if panic.is_own() => panic.resume(),
            Err(FetchError::Panicked(_)) => {
                self.metrics.served(Source::Origin);
                Ok(self.error_response(StatusCode::INTERNAL_SERVER_ERROR, ask.head))
            }
            Err(_) => {
                self.metrics.served(Source::Origin);
                Ok(self.error_response(StatusCode::BAD_GATEWAY, ask.head))
            }
        }
    }

    /// A response sent on while its body is read to be stored (see
    /// `origin::tee`): a miss, stored only once read whole, so not said to
    /// be stored; or, for a key marked uncacheable, the bypass it is
    /// counted as already.
    pub(crate) fn answered_early<B>(&self, res: &mut Response<CacheBody<B>>, hit_for_miss: bool) {
        self.label_own_load(res, hit_for_miss, None);
    }

    /// Labels (and counts) what the origin answered this request: a
    /// bypass for a key marked uncacheable (counted as one already), else
    /// a miss not stored, for `reason` (or none said yet: then whether L2
    /// was down).
    fn label_own_load<B>(
        &self,
        res: &mut Response<CacheBody<B>>,
        hit_for_miss: bool,
        reason: Option<Reason>,
    ) {
        let outcome = if hit_for_miss {
            Outcome::Bypass(Reason::HitForMiss)
        } else {
            self.metrics.served(Source::Origin);
            Outcome::Miss {
                stored: false,
                reason,
                collapsed: false,
                l2_down: reason.is_none() && !self.engine.l2_available(),
            }
        };
        self.label(res.headers_mut(), &outcome);
    }

    /// The response for an entry the engine answered with.
    pub(crate) fn answer<B>(&self, answer: &Answer, ask: &Ask) -> Response<CacheBody<B>> {
        let now = self.engine.now();
        let entry = &answer.entry;
        let outcome = match answer.served {
            Served::Stale(why) => {
                self.metrics.stale();
                Outcome::Stale {
                    tier: answer.source,
                    ttl: crate::headers::stale_ttl(entry.times().fresh_until, now),
                    collapsed: answer.collapsed,
                    detail: why.as_str(),
                }
            }
            Served::Miss { stored } => {
                self.metrics.served(answer.source);
                Outcome::Miss {
                    stored: stored && !answer.collapsed,
                    reason: None,
                    collapsed: answer.collapsed,
                    l2_down: !self.engine.l2_available(),
                }
            }
            // Only origin errors are shared unstored (see `HttpOrigin`).
            Served::Shared => {
                self.metrics.served(answer.source);
                let status = http::StatusCode::from_u16(entry.value().status)
                    .unwrap_or(StatusCode::BAD_GATEWAY);
                let reason = if status_never_stored(status) {
                    Reason::Status
                } else {
                    Reason::NoFreshness
                };
                Outcome::Miss {
                    stored: false,
                    reason: (!answer.collapsed).then_some(reason),
                    collapsed: answer.collapsed,
                    l2_down: !self.engine.l2_available(),
                }
            }
            _ => {
                self.metrics.served(answer.source);
                Outcome::Hit {
                    tier: answer.source,
                    ttl: headers::ttl_left(entry, now),
                    collapsed: answer.collapsed,
                }
            }
        };
        self.entry_response(entry, now, ask, &outcome)
    }

    /// The answer to an `only-if-cached` request that nothing stored
    /// answers: 504, the origin never asked (RFC 9111 §5.2.1.7).
    pub(crate) fn not_cached<B>(&self, head: bool) -> Response<CacheBody<B>> {
        let mut res = Response::new(if head {
            CacheBody::empty()
        } else {
            CacheBody::full(Bytes::from_static(
                b"nothing stored answers this request, and it asked for a stored response only\n",
            ))
        });
        *res.status_mut() = StatusCode::GATEWAY_TIMEOUT;
        res.extensions_mut().insert(crate::NothingStored);
        self.metrics.not_cached();
        self.label(res.headers_mut(), &Outcome::NotCached);
        res
    }

    /// The cache's own answer to a load that failed; no body for a HEAD
    /// (RFC 9110 §9.3.2; over HTTP/2 nobody else takes it off).
    fn error_response<B>(&self, status: StatusCode, head: bool) -> Response<CacheBody<B>> {
        let mut res = Response::new(if head {
            CacheBody::empty()
        } else {
            CacheBody::full(Bytes::from_static(
                b"the origin failed while loading this resource\n",
            ))
        });
        *res.status_mut() = status;
        let outcome = Outcome::Miss {
            stored: false,
            reason: None,
            collapsed: true,
            l2_down: !self.engine.l2_available(),
        };
        self.label(res.headers_mut(), &outcome);
        res
    }
}
