//! Cache keys: structured, length-prefixed parts, hashed for the tiers.
//!
//! Two different part lists never produce the same full key (each part is
//! prefixed with its length), and the full key travels inside the entry so a
//! read compares it: a hash collision is a miss, never another request's body.

use std::fmt;

use bytes::Bytes;

/// The fixed-length digest of a full key: what L1 and L2 are indexed by.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyHash([u8; 16]);

impl KeyHash {
    /// The raw digest bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The digest as 32 lower-case hex digits (safe in a Valkey key: no `{`).
    pub fn to_hex(&self) -> String {
        self.to_string()
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
        KeyBuilder {
            buf: Vec::with_capacity(128),
        }
    }

    /// A key of one part, for programmatic use of the engine.
    pub fn new(key: impl AsRef<[u8]>) -> Self {
        Self::builder().part(key.as_ref()).finish()
    }

    /// Rebuilds a key from the full bytes stored with an entry.
    pub fn from_full(full: Bytes) -> Self {
        let hash = digest(&full);
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

fn digest(bytes: &[u8]) -> KeyHash {
    let hash = blake3::hash(bytes);
    let mut out = [0u8; 16];
    out.copy_from_slice(&hash.as_bytes()[..16]);
    KeyHash(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_boundaries_matter() {
        let ab_c = CacheKey::builder().part(b"ab").part(b"c").finish();
        let a_bc = CacheKey::builder().part(b"a").part(b"bc").finish();
        let abc = CacheKey::builder().part(b"abc").finish();
        assert_ne!(ab_c, a_bc);
        assert_ne!(ab_c, abc);
        assert_ne!(ab_c.hash(), a_bc.hash());
    }

    #[test]
    fn hex_has_no_hash_tag_braces() {
        let k = CacheKey::new("/x{evil}");
        let hex = k.hash().to_hex();
        assert_eq!(hex.len(), 32);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn concat_equals_one_part() {
        let mut a = CacheKey::builder();
        a.push_concat(&[b"ab", b"cd"]);
        assert_eq!(a.finish(), CacheKey::new("abcd"));
    }
}
