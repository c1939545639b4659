//! Cache keys: structured, length-prefixed parts, hashed for the tiers.
//!
//! Two different part lists never produce the same full key (each part is
//! prefixed with its length), and the full key travels inside the entry so a
//! read compares it: a hash collision is a miss, never another request's body.

use std::cell::RefCell;
use std::fmt;
use std::hash::BuildHasher;

use bytes::Bytes;

/// The fixed-length digest of a full key: what L1 and L2 are indexed by.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyHash([u8; 16]);

impl KeyHash {
    /// The least digest, a bound for ranges ordered by digest.
    pub(crate) const MIN: KeyHash = KeyHash([0; 16]);
}

impl std::hash::Hash for KeyHash {
    // One word instead of a length prefix and a byte slice: equal digests
    // still hash equal, and a map's hasher mixes a single write.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u128(u128::from_le_bytes(self.0));
    }
}

impl KeyHash {
    /// The raw digest bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The digest as 32 lower-case hex digits (safe in a Valkey key: no `{`).
    pub fn to_hex(&self) -> String {
        self.to_string()
    }

    /// Reads [`to_hex`](Self::to_hex)'s output; `None` for anything else.
    pub fn from_hex(hex: &str) -> Option<Self> {
        if hex.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(out))
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({self})")
    }
}

/// A full cache key and its hash.
///
/// ```
/// use tiercache_core::CacheKey;
///
/// let a = CacheKey::builder().part(b"GET").part(b"example.com").part(b"/a").finish();
/// let b = CacheKey::builder().part(b"GET").part(b"example.com/").part(b"a").finish();
/// assert_ne!(a, b);
/// assert_ne!(a.hash(), b.hash());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct CacheKey {
    full: Bytes,
    hash: KeyHash,
}

impl CacheKey {
    /// Starts a key from parts.
    pub fn builder() -> KeyBuilder {
        Self::builder_with_capacity(128)
    }

    /// Starts a key from parts, with room for `bytes` of them (each part
    /// takes 4 bytes more than its length). A builder filled exactly to its
    /// capacity finishes without another allocation, and its key is freed
    /// in one: the hit path builds and drops a key per request.
    ///
    /// ```
    /// use tiercache_core::CacheKey;
    ///
    /// let key = CacheKey::builder_with_capacity(4 + 2).part(b"/a").finish();
    /// assert_eq!(key, CacheKey::new("/a"));
    /// ```
    pub fn builder_with_capacity(bytes: usize) -> KeyBuilder {
        KeyBuilder {
            buf: Vec::with_capacity(bytes),
        }
    }

    /// A key of one part, for programmatic use of the engine.
    pub fn new(key: impl AsRef<[u8]>) -> Self {
        Self::builder().part(key.as_ref()).finish()
    }

    /// Rebuilds a key from the full bytes stored with an entry.
    pub fn from_full(full: Bytes) -> Self {
        let hash = recent_digest(&full);
        Self { full, hash }
    }

    /// This key with one more part: a key of its own, never equal to this one
    /// or to any other key's extension by a different part.
    ///
    /// ```
    /// use tiercache_core::CacheKey;
    ///
    /// let page = CacheKey::new("/page");
    /// assert_ne!(page.with_part(b"en"), page.with_part(b"fr"));
    /// assert_eq!(page.with_part(b"en"), CacheKey::builder().part(b"/page").part(b"en").finish());
    /// ```
    pub fn with_part(&self, part: &[u8]) -> CacheKey {
        let mut buf = Vec::with_capacity(self.full.len() + 4 + part.len());
        buf.extend_from_slice(&self.full);
        let mut builder = KeyBuilder { buf };
        builder.push(part);
        builder.finish()
    }

    /// The key made of this key's first `n` parts (this key itself when it
    /// has no more), or `None` when it has fewer.
    ///
    /// ```
    /// use tiercache_core::CacheKey;
    ///
    /// let url = CacheKey::builder().part(b"GET").part(b"/a").finish();
    /// let alices = url.with_part(b"alice");
    /// assert_eq!(alices.first_parts(2), Some(url.clone()));
    /// assert_eq!(url.first_parts(2), Some(url.clone()));
    /// assert_eq!(url.first_parts(3), None);
    /// ```
    pub fn first_parts(&self, n: usize) -> Option<CacheKey> {
        let mut parts = Parts { rest: &self.full };
        for _ in 0..n {
            parts.next()?;
        }
        let end = self.full.len() - parts.rest.len();
        Some(if end == self.full.len() {
            self.clone()
        } else {
            CacheKey::from_full(self.full.slice(..end))
        })
    }

    /// The full, length-prefixed key.
    pub fn full(&self) -> &Bytes {
        &self.full
    }

    /// The key's digest.
    pub fn hash(&self) -> KeyHash {
        self.hash
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The full key may hold user data (paths, query): keep it out of logs.
        f.debug_struct("CacheKey")
            .field("hash", &self.hash)
            .finish()
    }
}

/// Accumulates length-prefixed key parts; see [`CacheKey::builder`].
#[derive(Debug)]
pub struct KeyBuilder {
    buf: Vec<u8>,
}

impl KeyBuilder {
    /// Appends one part.
    pub fn part(mut self, part: &[u8]) -> Self {
        self.push(part);
        self
    }

    /// Appends one part in place.
    pub fn push(&mut self, part: &[u8]) {
        self.buf
            .extend_from_slice(&(part.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(part);
    }

    /// Appends a part built from several slices, as if concatenated.
    pub fn push_concat(&mut self, pieces: &[&[u8]]) {
        let len: usize = pieces.iter().map(|p| p.len()).sum();
        self.buf.extend_from_slice(&(len as u32).to_le_bytes());
        for p in pieces {
            self.buf.extend_from_slice(p);
        }
    }

    /// Appends the [`fingerprint`] of a part that must not be kept in the
    /// clear (a credential, a session cookie): the key, stored with the entry
    /// in L1 and L2, then holds only its digest.
    pub fn push_secret(&mut self, part: &[u8]) {
        self.push(&fingerprint(part));
    }

    /// Hashes the parts into a key.
    pub fn finish(self) -> CacheKey {
        CacheKey::from_full(Bytes::from(self.buf))
    }
}

/// Which keys an invalidation by prefix reaches: a key matches when its
/// first parts match the pattern's, part by part (more parts may follow, so
/// a URL's `Vary` variants and credential-keyed copies match with it).
///
/// ```
/// use tiercache_core::{CacheKey, KeyPattern};
///
/// let products = KeyPattern::new().part(b"shop").prefix(b"/products/");
/// assert!(products.matches(&CacheKey::builder().part(b"shop").part(b"/products/7").finish()));
/// assert!(!products.matches(&CacheKey::builder().part(b"shop").part(b"/users/7").finish()));
/// assert!(!products.matches(&CacheKey::new("shop/products/7")));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct KeyPattern {
    parts: Vec<PartMatch>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum PartMatch {
    Exact(Bytes),
    Prefix(Bytes),
    Any,
}

impl KeyPattern {
    /// A pattern that matches every key.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next part must equal `part`.
    pub fn part(mut self, part: &[u8]) -> Self {
        self.parts
            .push(PartMatch::Exact(Bytes::copy_from_slice(part)));
        self
    }

    /// The next part may be anything.
    pub fn any(mut self) -> Self {
        self.parts.push(PartMatch::Any);
        self
    }

    /// The next part must start with `prefix`.
    pub fn prefix(mut self, prefix: &[u8]) -> Self {
        self.parts
            .push(PartMatch::Prefix(Bytes::copy_from_slice(prefix)));
        self
    }

    /// Whether `key` matches.
    pub fn matches(&self, key: &CacheKey) -> bool {
        self.matches_full(key.full())
    }

    /// Whether the full key bytes `full` (see [`CacheKey::full`]) match.
    pub fn matches_full(&self, full: &[u8]) -> bool {
        let mut parts = Parts { rest: full };
        self.parts.iter().all(|want| match (parts.next(), want) {
            (None, _) => false,
            (Some(_), PartMatch::Any) => true,
            (Some(got), PartMatch::Exact(p)) => got == &p[..],
            (Some(got), PartMatch::Prefix(p)) => got.starts_with(p),
        })
    }

    /// What it weighs where invalidations are kept, in key hashes: its
    /// parts' bytes over a hash's 16.
    pub(crate) fn in_hashes(&self) -> usize {
        in_hashes(self.byte_len())
    }

    /// The bytes its parts hold.
    pub(crate) fn byte_len(&self) -> usize {
        self.parts
            .iter()
            .map(|part| match part {
                PartMatch::Exact(b) | PartMatch::Prefix(b) => b.len(),
                PartMatch::Any => 0,
            })
            .sum()
    }

    /// The pattern as bytes (for sending it to other instances).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for part in &self.parts {
            let (tag, bytes): (u8, &[u8]) = match part {
                PartMatch::Exact(b) => (b'=', b),
                PartMatch::Prefix(b) => (b'^', b),
                PartMatch::Any => (b'*', b""),
            };
            out.push(tag);
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Reads [`to_bytes`](Self::to_bytes)'s output; `None` for anything else.
    pub fn from_bytes(mut bytes: &[u8]) -> Option<Self> {
        let mut pattern = Self::new();
        while let Some((&tag, rest)) = bytes.split_first() {
            let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            let part = rest.get(4..4 + len)?;
            pattern = match tag {
                b'=' => pattern.part(part),
                b'^' => pattern.prefix(part),
                b'*' if len == 0 => pattern.any(),
                _ => return None,
            };
            bytes = &rest[4 + len..];
        }
        Some(pattern)
    }
}

/// The parts of a full key, in order.
struct Parts<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Parts<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let len = u32::from_le_bytes(self.rest.get(..4)?.try_into().ok()?) as usize;
        let part = self.rest.get(4..4 + len)?;
        self.rest = &self.rest[4 + len..];
        Some(part)
    }
}

/// A 128-bit digest of `bytes` for telling values apart without keeping
/// them: BLAKE3 in derive-key mode, so it never equals a key hash.
///
/// ```
/// use tiercache_core::key::fingerprint;
///
/// assert_ne!(fingerprint(b"Bearer alice"), fingerprint(b"Bearer bob"));
/// ```
pub fn fingerprint(bytes: &[u8]) -> [u8; 16] {
    let mut hasher = blake3::Hasher::new_derive_key("tiercache 2026-12 request value fingerprint");
    hasher.update(bytes);
    let mut out = [0u8; 16];
    out.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
    out
}

/// Keys at most this long are remembered by [`recent_digest`] (longer ones
/// are rare, and would let a few slots hold a lot of memory).
const RECENT_MAX_KEY: usize = 256;
/// Slots in each thread's table of recent digests (a power of two).
const RECENT_SLOTS: usize = 64;

thread_local! {
    /// The digests this thread computed last, direct-mapped by a fast hash
    /// of the full key: at most 64 keys of 256 bytes a thread.
    static RECENT: RefCell<Vec<Option<(Bytes, KeyHash)>>> =
        RefCell::new(vec![None; RECENT_SLOTS]);
}

/// [`digest`] of `full`, taken from this thread's recent digests when the
/// same key was hashed here lately: a hot key's hits then cost a fast
/// hash and a compare instead of BLAKE3 (~100 instructions against ~600).
/// The digest is a pure function of the bytes, so a remembered one is never
/// stale; a slot only ever answers for bytes equal to its own.
fn recent_digest(full: &Bytes) -> KeyHash {
    if full.len() > RECENT_MAX_KEY {
        return digest(full);
    }
    let slot = foldhash::fast::FixedState::default().hash_one(&full[..]) as usize % RECENT_SLOTS;
    RECENT
        .try_with(|recent| {
            let mut recent = recent.borrow_mut();
            match &recent[slot] {
                Some((bytes, hash)) if bytes == full => *hash,
                _ => {
                    let hash = digest(full);
                    // A copy: `full` may be a slice of a larger buffer (an
                    // L2 read's, body included) that the slot would pin.
                    recent[slot] = Some((Bytes::copy_from_slice(full), hash));
                    hash
                }
            }
        })
        // A thread being torn down has no table any more.
        .unwrap_or_else(|_| digest(full))
}

fn digest(bytes: &[u8]) -> KeyHash {
    let hash = blake3::hash(bytes);
    let mut out = [0u8; 16];
    out.copy_from_slice(&hash.as_bytes()[..16]);
    KeyHash(out)
}

/// `bytes` (a tag's, a pattern's) in key hashes of 16 bytes, the unit the
/// journal and the outbox bound what they hold by.
pub(crate) fn in_hashes(bytes: usize) -> usize {
    bytes.div_ceil(std::mem::size_of::<KeyHash>())
}

#[cfg(test)]
mod tests;
