//! Storage for the bodies L1 keeps: each body one owned allocation, never a
//! slice of what a connection read; below [`mapped_from`] bytes on the heap
//! at its exact size, from there up in a page mapping of its own, sized to
//! a class (see [`stored_size`]). The L2 tier writes its envelopes (an
//! entry's copy for Valkey, as large as its body) here too.
//!
//! Why mappings: an allocator keeps a page resident while any block on it
//! lives, and L1 drops bodies in an order unrelated to where they were
//! allocated. Flooded from a cold start, the proxy held 1.32–1.35× a 32 MiB
//! budget with 64 KiB bodies (mimalloc; glibc's arenas did worse) and
//! 1.23× a 64 MiB one; with each large body in a mapping of its own, whose
//! pages go back to the system when the body is dropped, 1.12× at 64 MiB
//! (at 32 MiB the connections' own buffers, ~8 MiB whatever the budget,
//! keep it at 1.2×). A few recently freed mappings (at most
//! [`SPARE_BYTES`]) wait for the next body of the same size, so a store
//! under churn does not pay for mapping, faulting and zeroing fresh pages
//! and for unmapping them each time (without them a flood of 64 KiB fills
//! made ~28 % fewer requests).
//!
//! ```
//! use tiercache_core::body::{BodyBuilder, mapped_from};
//!
//! // As a body arrives: announced length first, then its frames.
//! let mut body = BodyBuilder::with_capacity(3);
//! body.push(b"ab");
//! body.push(b"c");
//! assert_eq!(body.finish(), "abc");
//!
//! let large = tiercache_core::body::copy(&vec![7u8; mapped_from()]);
//! assert_eq!(large.len(), mapped_from());
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use memmap2::MmapMut;

/// Bodies of this many bytes and more are stored in page mappings of their
/// own, on 4 KiB pages (below it, the allocator's pages hold many bodies
/// each and churn evenly: 1 KiB and 4 KiB bodies stayed within 1.13× of
/// the budget); see [`mapped_from`].
pub const MAPPED_FROM: usize = 16 * 1024;

/// Where mapped storage starts on this machine: [`MAPPED_FROM`], or four
/// pages where pages are larger (64 KiB pages would otherwise round a
/// 16 KiB body up to four times its size).
pub fn mapped_from() -> usize {
    MAPPED_FROM.max(4 * page_size())
}

/// The most a body's first mapping reserves before its bytes arrive, so an
/// announced length (an origin's `Content-Length`) is not taken on trust;
/// a longer body moves to a mapping twice as large as it grows.
const FIRST_MAPPING: usize = 1 << 20;

/// Most mappings alive at once, spares included; past it large bodies go to
/// the heap. A quarter of Linux's default `vm.max_map_count` (65,530), so a
/// large L1 of large bodies never runs the process out of mappings.
pub const MAX_MAPPINGS: usize = 16 * 1024;

/// Most bytes of freed mappings kept for reuse (resident, counted in no
/// budget). The sweeper's tick releases them when none was reused since
/// the tick before.
pub const SPARE_BYTES: usize = 512 << 10;

/// A body being collected before it is stored.
///
/// Given the announced length (a `Content-Length`), a large body is copied
/// straight into its mapping as its frames arrive, so a connection's read
/// buffer is free for the next read at once; without one it grows on the
/// heap and [`finish`](Self::finish) copies it once into exact storage.
#[derive(Debug)]
pub struct BodyBuilder {
    buf: Buf,
    len: usize,
    /// The announced length (0 when unknown).
    expected: usize,
}

#[derive(Debug)]
enum Buf {
    Heap(Vec<u8>),
    Pages(Pages),
}

impl BodyBuilder {
    /// Room for `expected` bytes: the announced length, or 0 when unknown.
    /// More may be pushed, or fewer; at most 1 MiB is reserved up front.
    pub fn with_capacity(expected: usize) -> Self {
        Self::reserving(expected.min(FIRST_MAPPING), expected)
    }

    /// Room for exactly `len` bytes, reserved whole: for a length the
    /// caller worked out itself (an L2 envelope's), not one a peer
    /// announced.
    pub fn exact(len: usize) -> Self {
        Self::reserving(len, len)
    }

    /// `first` bytes reserved now (a mapping's faulted in at once), of
    /// `expected`.
    fn reserving(first: usize, expected: usize) -> Self {
        let buf = if expected >= mapped_from() {
            Pages::new(first, Faults::Now)
                .map_or_else(|| Buf::Heap(Vec::with_capacity(first)), Buf::Pages)
        } else {
            Buf::Heap(Vec::with_capacity(expected))
        };
        Self {
            buf,
            len: 0,
            expected,
        }
    }

    /// Appends the next frame's bytes.
    pub fn push(&mut self, data: &[u8]) {
        let end = self.len + data.len();
        if let Buf::Pages(pages) = &self.buf
            && end > pages.capacity()
        {
            // Past the mapping: one twice as large (up to the announced
            // length, when the body keeps to it), else the heap.
            let mut want = end.max(2 * pages.capacity());
            if end <= self.expected {
                want = want.min(self.expected);
            }
            let read = &pages.as_ref()[..self.len];
            self.buf = Pages::copied(read, want, Faults::AsWritten).map_or_else(
                || {
                    let mut heap = Vec::with_capacity(want);
                    heap.extend_from_slice(read);
                    Buf::Heap(heap)
                },
                Buf::Pages,
            );
        }
        match &mut self.buf {
            Buf::Pages(pages) => pages.as_mut_slice()[self.len..end].copy_from_slice(data),
            Buf::Heap(heap) => heap.extend_from_slice(data),
        }
        self.len = end;
    }

    /// Bytes pushed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// What was pushed so far.
    pub fn as_slice(&self) -> &[u8] {
        match &self.buf {
            Buf::Pages(pages) => &pages.as_ref()[..self.len],
            Buf::Heap(heap) => heap,
        }
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The body, stored: on the heap at its exact size, or from
    /// [`mapped_from`] up in a mapping of its size class (a body that came
    /// without an announced length, or far from it, is copied once more).
    pub fn finish(self) -> Bytes {
        let len = self.len;
        let expected = self.expected;
        match self.buf {
            Buf::Pages(pages) if len >= mapped_from() && pages.capacity() == class_size(len) => {
                pages.freeze(len)
            }
            Buf::Pages(pages) => copy(&pages.as_ref()[..len]),
            // Refused a mapping when reserved, and exactly as long as that:
            // kept where it lies, not copied to ask again.
            Buf::Heap(heap)
                if len >= mapped_from() && len == expected && heap.capacity() == len =>
            {
                HEAP_FALLBACKS.fetch_add(1, Relaxed);
                Bytes::from(heap.into_boxed_slice())
            }
            Buf::Heap(heap) if len >= mapped_from() => copy(&heap),
            // Shrinks to its length (no copy when it is already exact).
            Buf::Heap(heap) => Bytes::from(heap.into_boxed_slice()),
        }
    }

    /// What was pushed, as it lies (for a body that will not be stored,
    /// replayed to its one client).
    pub fn into_bytes(self) -> Bytes {
        match self.buf {
            Buf::Pages(pages) => pages.freeze(self.len),
            Buf::Heap(heap) => Bytes::from(heap),
        }
    }
}

/// A copy of `data` in storage of its exact size: the way to store bytes
/// that are a slice of something larger (a connection's read buffer, a
/// reply from the shared tier), which a stored slice would keep alive.
pub fn copy(data: &[u8]) -> Bytes {
    if data.len() < mapped_from() {
        return Bytes::copy_from_slice(data);
    }
    match Pages::copied(data, data.len(), Faults::Now) {
        Some(pages) => pages.freeze(data.len()),
        None => {
            HEAP_FALLBACKS.fetch_add(1, Relaxed);
            Bytes::copy_from_slice(data)
        }
    }
}

/// Bytes a stored body of `len` bytes takes, what the L1 weigher counts:
/// its length below [`mapped_from`]; from there up its mapping's size,
/// whole pages rounded up to a class, eight to a doubling as allocators
/// do (at most an eighth or one page more than the body), so a freed mapping fits the
/// next body of about the same size.
pub fn stored_size(len: usize) -> usize {
    if len >= mapped_from() {
        class_size(len)
    } else {
        len
    }
}

/// The size of a mapping for `len` bytes (see [`stored_size`]).
fn class_size(len: usize) -> usize {
    let page = page_size();
    let pages = len.div_ceil(page).max(1);
    let step = ((1usize << pages.ilog2()) / 8).max(1);
    pages.next_multiple_of(step) * page
}

/// Mappings alive now (bodies, L2 envelopes, spares).
pub fn mappings() -> usize {
    MAPPINGS.load(Relaxed)
}

/// Bodies (and L2 envelopes) of [`mapped_from`] bytes or more stored on
/// the heap since the process started (each counted once, when it is
/// stored): past [`MAX_MAPPINGS`], or refused a mapping by the system.
/// Such bodies pin the allocator's pages as smaller ones do.
pub fn heap_fallbacks() -> u64 {
    HEAP_FALLBACKS.load(Relaxed)
}

/// Releases the spare mappings unless one was reused since the last call.
/// Each engine's sweeper calls it on its tick (a process with several
/// engines trims more often), so an idle process keeps none; without a
/// sweeper they stay, [`SPARE_BYTES`] at most.
pub fn trim_spares() {
    let released = {
        let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
        if std::mem::take(&mut spares.reused) {
            return;
        }
        spares.bytes = 0;
        std::mem::take(&mut spares.maps)
    };
    MAPPINGS.fetch_sub(released.len(), Relaxed);
}

fn page_size() -> usize {
    page_size::get()
}

static MAPPINGS: AtomicUsize = AtomicUsize::new(0);
static HEAP_FALLBACKS: AtomicU64 = AtomicU64::new(0);
static SPARES: Mutex<Spares> = Mutex::new(Spares {
    maps: VecDeque::new(),
    bytes: 0,
    reused: false,
});

#[derive(Debug)]
struct Spares {
    /// Oldest first.
    maps: VecDeque<MmapMut>,
    bytes: usize,
    /// Whether one was taken since the last trim.
    reused: bool,
}

/// When a new mapping's pages are faulted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Faults {
    /// All at once (`MAP_POPULATE`): one call instead of a fault a page,
    /// for room the bytes fill straight away: a copy, an L2 envelope, a
    /// body's first reservation (its announced length up to 1 MiB, which
    /// the HTTP layer holds against its bound on bodies being read as
    /// allocated at once). Page by page, a flood of misses with Valkey on
    /// cost ~8 % more CPU, and 64 KiB bodies without it ~5 %.
    Now,
    /// Page by page as bytes arrive: a body's room grown past what has
    /// arrived.
    AsWritten,
}

/// One body's (or envelope's) page mapping; given back to the spares when
/// dropped.
#[derive(Debug)]
struct Pages(Option<MmapMut>);

impl Pages {
    /// A mapping for `len` bytes, of its size class: a spare of that size,
    /// else a new one; `None` past [`MAX_MAPPINGS`] or when the system
    /// refuses.
    fn new(len: usize, faults: Faults) -> Option<Self> {
        let size = class_size(len);
        {
            let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = spares.maps.iter().position(|m| m.len() == size) {
                let map = spares.maps.remove(at)?;
                spares.bytes -= size;
                spares.reused = true;
                return Some(Self(Some(map)));
            }
        }
        if MAPPINGS.fetch_add(1, Relaxed) >= MAX_MAPPINGS {
            MAPPINGS.fetch_sub(1, Relaxed);
            return None;
        }
        let mut options = memmap2::MmapOptions::new();
        if faults == Faults::Now {
            options.populate();
        }
        match options.len(size).map_anon() {
            Ok(map) => Some(Self(Some(map))),
            Err(_) => {
                MAPPINGS.fetch_sub(1, Relaxed);
                None
            }
        }
    }

    /// A mapping with room for `room` bytes, holding a copy of `data` first.
    fn copied(data: &[u8], room: usize, faults: Faults) -> Option<Self> {
        let mut pages = Self::new(room, faults)?;
        pages.as_mut_slice()[..data.len()].copy_from_slice(data);
        Some(pages)
    }

    fn capacity(&self) -> usize {
        self.as_ref().len()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_deref_mut().unwrap_or_default()
    }

    fn freeze(self, len: usize) -> Bytes {
        Bytes::from_owner(self).slice(..len)
    }
}

impl AsRef<[u8]> for Pages {
    fn as_ref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        let Some(map) = self.0.take() else { return };
        let released = {
            let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
            let mut released = Vec::new();
            if map.len() > SPARE_BYTES {
                released.push(map);
            } else {
                spares.bytes += map.len();
                spares.maps.push_back(map);
                while spares.bytes > SPARE_BYTES {
                    let Some(old) = spares.maps.pop_front() else {
                        break;
                    };
                    spares.bytes -= old.len();
                    released.push(old);
                }
            }
            released
        };
        // Unmapped outside the lock.
        MAPPINGS.fetch_sub(released.len(), Relaxed);
    }
}

#[cfg(test)]
mod tests;
