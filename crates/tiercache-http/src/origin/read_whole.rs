//! Reading an origin's body whole to store (or share) it, within
//! `max_body` and the engine's bound on bodies being read.

use std::collections::VecDeque;

use bytes::Bytes;
use http::response;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tiercache_core::body::BodyBuilder;

use super::Load;
use crate::body::{BoxError, CacheBody};
use crate::cacheable::{Reason, content_length};

impl Load<'_> {
    /// Reads the body within `max_body` into storage of its own (see
    /// [`tiercache_core::body`]): each frame is copied as it arrives, so the
    /// connection's read buffer is free again at once and nothing stored
    /// keeps it alive. What cannot be stored (too large, trailers, a read
    /// error) comes back as a body that replays what was read and streams
    /// the rest, the same bytes; so does one still coming at `within`
    /// (`NotFresh`: it would be stale once read).
    pub(super) async fn read<ResB>(
        &self,
        parts: &response::Parts,
        body: ResB,
        within: Option<tokio::time::Instant>,
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
        // What was read and the frame that stopped the read, to replay.
        let replay = |read: BodyBuilder, last: Option<Frame<Bytes>>| {
            let mut frames = VecDeque::new();
            if !read.is_empty() {
                frames.push_back(Frame::data(read.into_bytes()));
            }
            frames.extend(last);
            frames
        };
        loop {
            let next = match within {
                Some(at) => match tokio::time::timeout_at(at, body.frame()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let frames = replay(read, None);
                        return Err((
                            CacheBody::replay(frames, None, Some(body)),
                            Reason::NotFresh,
                        ));
                    }
                },
                None => body.frame().await,
            };
            let Some(frame) = next else { break };
            match frame {
                Ok(frame) => {
                    let Some(data) = frame.data_ref() else {
                        // Trailers cannot be stored: replay what was read, untouched.
                        let frames = replay(read, Some(frame));
                        return Err((CacheBody::replay(frames, None, Some(body)), Reason::Body));
                    };
                    if read.len() + data.len() > max {
                        let frames = replay(read, Some(frame));
                        return Err((
                            CacheBody::replay(frames, None, Some(body)),
                            Reason::TooLarge,
                        ));
                    }
                    if !share.grow_to(read.len() + data.len()) {
                        let frames = replay(read, Some(frame));
                        return Err((CacheBody::replay(frames, None, Some(body)), Reason::Busy));
                    }
                    read.push(data);
                }
                Err(e) => {
                    return Err((
                        CacheBody::replay(replay(read, None), Some(e.into()), None),
                        Reason::BodyFailed,
                    ));
                }
            }
        }
        Ok(read.finish())
    }
}
