//! What the tier's connections last failed with, for an operator: fred
//! tells a refused connection, a failed TLS handshake or authentication,
//! or a lost connection only on its error stream, which no request sees
//! (each request just goes on to the origin). Counted, and the last one
//! kept with when it came.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use fred::prelude::{EventInterface, Server};
use tiercache_core::TierFailure;
use tokio::sync::broadcast::error::RecvError;

/// The failures of every client the tier has had (its own, replaced ones,
/// the subscriber).
#[derive(Debug, Default)]
pub(crate) struct Failures {
    pub(crate) count: AtomicU64,
    last: Mutex<Option<(tokio::time::Instant, String)>>,
}

impl Failures {
    /// Notes one failure, of `server` when fred named it.
    fn note(&self, error: &fred::error::Error, server: Option<&Server>) {
        self.count.fetch_add(1, Relaxed);
        let message = match server {
            Some(server) => format!("{server}: {error}"),
            None => error.to_string(),
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((tokio::time::Instant::now(), message));
    }

    /// The last failure, if there was one.
    pub(crate) fn last(&self) -> Option<TierFailure> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let (at, message) = last.as_ref()?;
        Some(TierFailure::new(message.clone(), at.elapsed().as_secs()))
    }

    /// Notes the failures `client` reports from now on, until it is
    /// dropped. Called before the client connects, so that a first
    /// connection refused is noted too.
    pub(crate) fn watch(self: &std::sync::Arc<Self>, client: &impl EventInterface) {
        let mut errors = client.error_rx();
        let failures = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                match errors.recv().await {
                    Ok((error, server)) => match failures.upgrade() {
                        Some(failures) => failures.note(&error, server.as_ref()),
                        None => return,
                    },
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return,
                }
            }
        });
    }
}
