//! Sending a body on to its client while it is read to be stored: a body
//! still coming [`TEE_AFTER`] past its first bytes (a slow origin, a large
//! body, one without a length) reaches the client as it comes, where it
//! reached it whole once stored, possibly seconds later.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, response};
use http_body::Frame;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::body::{CacheBody, Teed};
use crate::cacheable::content_length;

/// How long a body is read whole before what has come is sent on: most
/// bodies are whole by then (and go out framed from the stored entry, a
/// clean 502 if they break off); a slower one streams.
pub(crate) const TEE_AFTER: Duration = Duration::from_millis(100);

/// Where the request that leads a load takes its response early: the
/// origin's head (its own fields the layer's to add) and a body of
/// [`CacheBody::tee`]'s frames, and what says when its client has the
/// whole body.
pub(crate) type Early<B> = oneshot::Sender<(Response<CacheBody<B>>, oneshot::Receiver<()>)>;

/// One read's sending on, from waiting to send to sending.
pub(super) enum Tee<B> {
    /// Nothing to send to (a background refresh, a request that wants the
    /// stored entry: a `HEAD`, a range, a conditional; a load with a stale
    /// entry at hand), or no one took the response.
    Off,
    /// Reading whole until `due` (set by the first bytes).
    Waiting {
        early: Early<B>,
        due: Option<Instant>,
    },
    /// Sending each frame as it is read.
    On(mpsc::UnboundedSender<Teed<B>>),
}

impl<B> Tee<B> {
    pub(super) fn new(early: Option<Early<B>>) -> Self {
        match early {
            Some(early) => Self::Waiting { early, due: None },
            None => Self::Off,
        }
    }

    /// When what has come is sent on if the body is still coming.
    pub(super) fn due(&self) -> Option<Instant> {
        match self {
            Self::Waiting { due, .. } => *due,
            _ => None,
        }
    }

    /// Whether what is read now goes on as it is read.
    pub(super) fn on(&self) -> bool {
        matches!(self, Self::On(_))
    }

    /// A frame of data read (and kept to be stored).
    pub(super) fn read(&mut self, data: &Bytes) {
        match self {
            Self::Off => {}
            Self::Waiting { due, .. } => {
                due.get_or_insert_with(|| Instant::now() + TEE_AFTER);
            }
            Self::On(frames) => {
                // A copy: the origin's frame may be a slice of its
                // connection's read buffer, which a slow client would keep.
                let copy = Bytes::copy_from_slice(data);
                // A client gone: the read goes on to store the body.
                if frames.send(Teed::Frame(Frame::data(copy))).is_err() {
                    *self = Self::Off;
                }
            }
        }
    }

    /// The body is still coming at `due`: the response goes to the client
    /// with what came, `read` (a copy: the frames read were let go), and
    /// the rest as it comes.
    pub(super) fn start(&mut self, parts: &response::Parts, read: &[u8]) {
        let Self::Waiting { early, .. } = std::mem::replace(self, Self::Off) else {
            unreachable!("started only while waiting (`due`)");
        };
        let (frames, receiver) = mpsc::unbounded_channel();
        let _ = frames.send(Teed::Frame(Frame::data(Bytes::copy_from_slice(read))));
        let (body, whole) = CacheBody::tee(receiver, content_length(&parts.headers));
        let mut res = Response::new(body);
        *res.status_mut() = parts.status;
        *res.version_mut() = parts.version;
        let mut headers = parts.headers.clone();
        crate::headers::strip_hop_by_hop_but_trailer(&mut headers);
        *res.headers_mut() = headers;
        // Taken, unless the request is gone (its client left): the read
        // then goes on as before.
        if early.send((res, whole)).is_ok() {
            *self = Self::On(frames);
        }
    }

    /// The body was read whole: its client's ends too.
    pub(super) fn end(&mut self) {
        if let Self::On(frames) = std::mem::replace(self, Self::Off) {
            let _ = frames.send(Teed::End);
        }
    }

    /// What the read does not store goes on with `rest`: sent on to the
    /// client once sending (the caller's own answer is then empty), else
    /// the caller's to answer with.
    pub(super) fn rest(&mut self, rest: CacheBody<B>) -> CacheBody<B> {
        match std::mem::replace(self, Self::Off) {
            Self::On(frames) => {
                let _ = frames.send(Teed::Rest(rest));
                CacheBody::empty()
            }
            _ => rest,
        }
    }
}
