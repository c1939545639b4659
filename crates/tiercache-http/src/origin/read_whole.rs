//! Reading an origin's body whole to store (or share) it, within
//! `max_body` and the engine's bound on bodies being read.

use std::collections::VecDeque;
use std::pin::Pin;

use bytes::Bytes;
use http::response;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tiercache_core::body::BodyBuilder;

use super::Load;
use super::tee::{Early, Tee};
use crate::body::{BoxError, CacheBody};
use crate::cacheable::{Reason, content_length};

impl Load<'_> {
    /// Reads the body within `max_body` into storage of its own (see
    /// [`tiercache_core::body`]): each frame is copied as it arrives, so the
    /// connection's read buffer is free again at once and nothing stored
    /// keeps it alive. What cannot be stored (too large, trailers, a read
    /// error) comes back as a body that replays what was read and streams
    /// the rest, the same bytes; so does one still coming at `within`
    /// (`NotFresh`: it would be stale once read). With `early`, a body
    /// still coming [`TEE_AFTER`](super::tee::TEE_AFTER) past its first
    /// bytes goes on to its client as it is read (see [`Tee`]); what is
    /// not stored then follows it there.
    pub(super) async fn read<ResB>(
        &self,
        parts: &response::Parts,
        body: ResB,
        within: Option<tokio::time::Instant>,
        early: Option<Early<ResB>>,
    ) -> Result<Bytes, (CacheBody<ResB>, Reason)>
    where
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        let max = self.route.config.max_body;
        let announced = content_length(&parts.headers);
        if announced.is_some_and(|len| len > max as u64) {
            return Err((CacheBody::stream(body), Reason::TooLarge));
        }
        // Held against the bound of what bodies being read hold at once
        // (see `Reading`): the announced length, allocated at once, or
        // what has come.
        let mut share = self.route.reading.share();
        if !share.grow_to(announced.unwrap_or(0) as usize) {
            return Err((CacheBody::stream(body), Reason::Busy));
        }
        let mut body = Box::pin(body);
        let mut read = BodyBuilder::with_capacity(announced.unwrap_or(0) as usize);
        let mut tee = Tee::new(early);
        loop {
            let stop = match (within, tee.due()) {
                (Some(at), Some(due)) => Some(at.min(due)),
                (at, due) => at.or(due),
            };
            let next = match stop {
                Some(at) => match tokio::time::timeout_at(at, body.frame()).await {
                    Ok(next) => next,
                    Err(_) if within.is_some_and(|w| w <= at) => {
                        return unstored(&mut tee, read, After::Rest(body), Reason::NotFresh);
                    }
                    Err(_) => {
                        tee.start(parts, read.as_slice());
                        continue;
                    }
                },
                None => body.frame().await,
            };
            let Some(frame) = next else { break };
            match frame {
                Ok(frame) => {
                    let Some(data) = frame.data_ref() else {
                        // Trailers cannot be stored: replay what was read, untouched.
                        return unstored(&mut tee, read, After::Frame(frame, body), Reason::Body);
                    };
                    if read.len() + data.len() > max {
                        return unstored(
                            &mut tee,
                            read,
                            After::Frame(frame, body),
                            Reason::TooLarge,
                        );
                    }
                    if !share.grow_to(read.len() + data.len()) {
                        return unstored(&mut tee, read, After::Frame(frame, body), Reason::Busy);
                    }
                    read.push(data);
                    tee.read(data);
                    // Bytes of a body whose read is bounded (`within`) keep
                    // the requests waiting on it (an error page read to be
                    // shared has no such bound).
                    if within.is_some() && !data.is_empty() {
                        self.progress.made();
                    }
                }
                Err(e) => {
                    return unstored(&mut tee, read, After::Error(e.into()), Reason::BodyFailed);
                }
            }
        }
        tee.end();
        Ok(read.finish())
    }
}

/// What follows what a read stored of a body it does not store.
enum After<B> {
    /// The rest of the body (at the not-fresh deadline).
    Rest(Pin<Box<B>>),
    /// The frame that stopped the read (too large, trailers, no room),
    /// then the rest.
    Frame(Frame<Bytes>, Pin<Box<B>>),
    /// The error that stopped it.
    Error(BoxError),
}

/// What a read does not store: what was read (unless it went on to the
/// client already), then what stopped the read and the rest of the body;
/// sent on after what was, if the read was sending.
fn unstored<B>(
    tee: &mut Tee<B>,
    read: BodyBuilder,
    after: After<B>,
    why: Reason,
) -> Result<Bytes, (CacheBody<B>, Reason)> {
    let mut frames = VecDeque::new();
    if !read.is_empty() && !tee.on() {
        frames.push_back(Frame::data(read.into_bytes()));
    }
    let body = match after {
        After::Rest(rest) => CacheBody::replay(frames, None, Some(rest)),
        After::Frame(last, rest) => {
            frames.push_back(last);
            CacheBody::replay(frames, None, Some(rest))
        }
        After::Error(error) => CacheBody::replay(frames, Some(error), None),
    };
    Err((tee.rest(body), why))
}
