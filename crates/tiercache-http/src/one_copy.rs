//! Many byte strings copied into one allocation of exactly their bytes,
//! each handed out as a `Bytes` of its own (slices sharing it): what is
//! kept for long (a stored head, a request head in flight, an entry's
//! tags) is one allocation, not one per string, each with a shared
//! handle made on its first clone.

use bytes::{Bytes, BytesMut};

/// Room for copies of `bytes` bytes in all; see the module's docs.
pub(crate) struct OneCopy(BytesMut);

impl OneCopy {
    /// Room for copies of `bytes` bytes in all (more would allocate again).
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        Self(BytesMut::with_capacity(bytes))
    }

    /// A copy of `bytes`, in the room.
    pub(crate) fn copy(&mut self, bytes: &[u8]) -> Bytes {
        self.0.extend_from_slice(bytes);
        self.0.split().freeze()
    }
}
