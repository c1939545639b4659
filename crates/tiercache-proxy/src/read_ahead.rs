//! An answer read ahead of its client: the upstream's body pulled into a
//! bounded buffer as fast as the upstream sends it, so an answer that fits
//! gives its upstream connection (and its slot, see
//! [`Forward::max_connections`](crate::forward::Forward::max_connections))
//! back when the upstream is done, not when a slow client has read it all
//! (as nginx's `proxy_buffering`, in memory only: a larger answer streams,
//! holding its slot, as with nginx's `proxy_max_temp_file_size 0`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the reading task passes on.
enum Pulled {
    /// A frame (or the upstream's error), holding its share of the room.
    Frame(Result<Frame<Bytes>, BoxError>, Option<OwnedSemaphorePermit>),
    /// The upstream's body ended: without it, the task's end is a cut.
    End,
}

/// A frame's cost beyond its bytes (the channel's slot, the frame): a
/// body of one-byte chunks is bounded too.
const FRAME_COST: usize = 128;

/// The client's side of an answer read ahead (see the module's docs).
pub struct ReadAhead {
    frames: mpsc::UnboundedReceiver<Pulled>,
    /// The upstream's hint, less what was passed on.
    hint: SizeHint,
    ended: bool,
    /// This answer's share of every answer's room, until it is read.
    _reserved: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl ReadAhead {
    /// Bytes of one answer held ahead of its client at most (and one
    /// frame past them, the one waiting for room).
    pub const ROOM: usize = 256 * 1024;

    /// Starts reading `body` ahead, at most `room` bytes (at least one)
    /// past what the client took, holding `reserved` (its share of a
    /// bound over all answers) until the client has it all or has gone;
    /// the upstream's body is dropped (its connection back in the pool)
    /// once read whole, or once the client has gone.
    fn start<B>(body: B, room: usize, reserved: Option<OwnedSemaphorePermit>) -> Self
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        let hint = body.size_hint();
        let (sender, frames) = mpsc::unbounded_channel();
        tokio::spawn(pull(body, room.max(1), sender));
        Self {
            frames,
            hint,
            ended: false,
            _reserved: reserved,
        }
    }
}

/// The room all answers read ahead share: [`ReadAhead::ROOM`] for each of
/// a number of answers.
#[derive(Debug, Clone)]
pub struct Rooms(Arc<Semaphore>);

impl Rooms {
    /// Room for `answers` answers read ahead at once.
    pub fn new(answers: usize) -> Self {
        let bytes = answers
            .saturating_mul(ReadAhead::ROOM)
            .min(Semaphore::MAX_PERMITS);
        Self(Arc::new(Semaphore::new(bytes)))
    }

    /// `body` read ahead of its client, or `body` as it was: an empty one
    /// (hyper sends no body for what ends at once, and over HTTP/2 gives
    /// an answer that does not a length) or one past the room left.
    pub fn read_ahead<B>(&self, body: B) -> Result<ReadAhead, B>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        if body.is_end_stream() {
            return Err(body);
        }
        let share = u32::try_from(ReadAhead::ROOM).unwrap_or(u32::MAX);
        match self.0.clone().try_acquire_many_owned(share) {
            Ok(reserved) => Ok(ReadAhead::start(body, ReadAhead::ROOM, Some(reserved))),
            Err(_) => Err(body),
        }
    }
}

async fn pull<B>(mut body: B, room: usize, sender: mpsc::UnboundedSender<Pulled>)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + Send,
{
    let room_left = Arc::new(Semaphore::new(room));
    loop {
        let frame = tokio::select! {
            frame = body.frame() => frame,
            // The client left: the upstream's body goes now, not at its
            // next frame.
            () = sender.closed() => return,
        };
        let Some(frame) = frame else {
            let _ = sender.send(Pulled::End);
            return;
        };
        let frame: Result<Frame<Bytes>, BoxError> = frame.map_err(Into::into);
        let failed = frame.is_err();
        let bytes = match &frame {
            Ok(frame) => frame.data_ref().map_or(0, Bytes::len),
            Err(_) => 0,
        };
        let share = u32::try_from((bytes + FRAME_COST).min(room)).unwrap_or(u32::MAX);
        let permit = tokio::select! {
            permit = room_left.clone().acquire_many_owned(share) => permit.ok(),
            () = sender.closed() => return,
        };
        if sender.send(Pulled::Frame(frame, permit)).is_err() || failed {
            return;
        }
    }
}

impl Body for ReadAhead {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        match this.frames.poll_recv(cx) {
            Poll::Ready(Some(Pulled::Frame(frame, _room))) => {
                match &frame {
                    Ok(frame) => {
                        let sent = frame.data_ref().map_or(0, |d| d.len() as u64);
                        let mut hint = SizeHint::new();
                        hint.set_lower(this.hint.lower().saturating_sub(sent));
                        if let Some(upper) = this.hint.upper() {
                            hint.set_upper(upper.saturating_sub(sent));
                        }
                        this.hint = hint;
                    }
                    Err(_) => this.ended = true,
                }
                Poll::Ready(Some(frame))
            }
            Poll::Ready(Some(Pulled::End)) => {
                this.ended = true;
                Poll::Ready(None)
            }
            // The task ended before the body did (it panicked, or its
            // runtime went): a cut, never a clean end the cache would store.
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(Some(Err("the upstream's answer stopped being read".into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.hint.exact() == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    use super::*;

    const FRAME: usize = 16 * 1024;

    /// An upstream's body: `frames` frames of `FRAME` bytes, then its end
    /// (or nothing ever, with none), counting what was pulled and telling
    /// its drop (its connection's release).
    struct Upstream {
        frames: Option<usize>,
        pulled: Arc<AtomicUsize>,
        dropped: Arc<AtomicBool>,
    }

    impl Upstream {
        fn new(frames: Option<usize>) -> (Self, Arc<AtomicUsize>, Arc<AtomicBool>) {
            let (pulled, dropped) = (Arc::default(), Arc::<AtomicBool>::default());
            let body = Self {
                frames,
                pulled: Arc::clone(&pulled),
                dropped: Arc::clone(&dropped),
            };
            (body, pulled, dropped)
        }
    }

    impl Body for Upstream {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            match self.frames {
                None => Poll::Pending,
                Some(0) => Poll::Ready(None),
                Some(left) => {
                    self.frames = Some(left - 1);
                    self.pulled.fetch_add(1, SeqCst);
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; FRAME])))))
                }
            }
        }
    }

    impl Drop for Upstream {
        fn drop(&mut self) {
            self.dropped.store(true, SeqCst);
        }
    }

    /// Lets the reading task run until it waits (one thread: it runs only
    /// when this one yields).
    async fn let_it_run() {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn an_answer_past_the_room_arrives_whole_never_more_than_the_room_ahead() {
        let (upstream, pulled, dropped) = Upstream::new(Some(64));
        let mut ahead = ReadAhead::start(upstream, 4 * FRAME, None);
        let_it_run().await;
        // What the room holds (three frames and their cost), and the
        // frame waiting for room.
        assert_eq!(pulled.load(SeqCst), 4);
        let mut got = 0;
        while let Some(frame) = ahead.frame().await {
            got += frame.unwrap().into_data().unwrap().len();
            assert!(pulled.load(SeqCst) * FRAME <= got + 5 * FRAME);
        }
        assert_eq!(got, 64 * FRAME);
        assert!(dropped.load(SeqCst), "the upstream's body was let go");
    }

    #[tokio::test]
    async fn an_answer_that_fits_lets_the_upstream_go_before_the_client_reads() {
        let (upstream, _, dropped) = Upstream::new(Some(4));
        let ahead = ReadAhead::start(upstream, 5 * FRAME, None);
        let_it_run().await;
        assert!(dropped.load(SeqCst), "read whole ahead of the client");
        let body = ahead.collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), 4 * FRAME);
    }

    /// An upstream's body whose reading panics.
    struct Panics;

    impl Body for Panics {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            panic!("the reading task fails");
        }
    }

    #[tokio::test]
    async fn a_reading_that_stops_short_is_a_cut_not_an_end() {
        // A clean end here, the cache would store what came before it.
        let ahead = ReadAhead::start(Panics, FRAME, None);
        assert!(ahead.collect().await.is_err());
    }

    #[tokio::test]
    async fn a_client_that_leaves_lets_a_silent_upstream_go_at_once() {
        let (upstream, _, dropped) = Upstream::new(None);
        let ahead = ReadAhead::start(upstream, 4 * FRAME, None);
        let_it_run().await;
        assert!(!dropped.load(SeqCst));
        drop(ahead);
        let_it_run().await;
        assert!(
            dropped.load(SeqCst),
            "the upstream's body outlived its client"
        );
    }
}
