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

/// A frame read ahead, and its share of the buffer's room.
type Ahead = (Result<Frame<Bytes>, BoxError>, Option<OwnedSemaphorePermit>);

/// The client's side of an answer read ahead (see the module's docs).
#[derive(Debug)]
pub struct ReadAhead {
    frames: mpsc::UnboundedReceiver<Ahead>,
    /// The upstream's hint, less what was passed on.
    hint: SizeHint,
    ended: bool,
}

impl ReadAhead {
    /// Bytes of one answer held ahead of its client at most (and one
    /// frame past them, the one waiting for room).
    pub const ROOM: usize = 256 * 1024;

    /// Starts reading `body` ahead, at most `room` bytes past what the
    /// client took; the upstream's body is dropped (its connection back in
    /// the pool) once read whole, or once the client has gone.
    pub fn start<B>(body: B, room: usize) -> Self
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        let hint = body.size_hint();
        let (sender, frames) = mpsc::unbounded_channel();
        tokio::spawn(pull(body, room, sender));
        Self {
            frames,
            hint,
            ended: false,
        }
    }
}

async fn pull<B>(mut body: B, room: usize, sender: mpsc::UnboundedSender<Ahead>)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
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
            return;
        };
        let frame: Result<Frame<Bytes>, BoxError> = frame.map_err(Into::into);
        let failed = frame.is_err();
        let bytes = match &frame {
            Ok(frame) => frame.data_ref().map_or(0, Bytes::len),
            Err(_) => 0,
        };
        let share = u32::try_from(bytes.min(room)).unwrap_or(u32::MAX);
        let permit = tokio::select! {
            permit = room_left.clone().acquire_many_owned(share) => permit.ok(),
            () = sender.closed() => return,
        };
        if sender.send((frame, permit)).is_err() || failed {
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
        match this.frames.poll_recv(cx) {
            Poll::Ready(Some((frame, _room))) => {
                if let Ok(data) = frame.as_ref().map(|f| f.data_ref()) {
                    let sent = data.map_or(0, |d| d.len() as u64);
                    let mut hint = SizeHint::new();
                    hint.set_lower(this.hint.lower().saturating_sub(sent));
                    if let Some(upper) = this.hint.upper() {
                        hint.set_upper(upper.saturating_sub(sent));
                    }
                    this.hint = hint;
                }
                Poll::Ready(Some(frame))
            }
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
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
        let mut ahead = ReadAhead::start(upstream, 4 * FRAME);
        let_it_run().await;
        // The room, and the frame waiting for room.
        assert_eq!(pulled.load(SeqCst), 5);
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
        let ahead = ReadAhead::start(upstream, 4 * FRAME);
        let_it_run().await;
        assert!(dropped.load(SeqCst), "read whole ahead of the client");
        let body = ahead.collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), 4 * FRAME);
    }

    #[tokio::test]
    async fn a_client_that_leaves_lets_a_silent_upstream_go_at_once() {
        let (upstream, _, dropped) = Upstream::new(None);
        let ahead = ReadAhead::start(upstream, 4 * FRAME);
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
