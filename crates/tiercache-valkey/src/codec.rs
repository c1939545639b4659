//! The L2 envelope: how an entry is laid out in a Valkey value.
//!
//! ```text
//! "TCE" version:u8 payload_len:u32le payload checksum:u32le
//! payload = created_at_ms:u64 fresh_until_ms:u64 stale_until_ms:u64 error_until_ms:u64
//!           hard_until_ms:u64 origin_latency_us:u64
//!           status:u16 key:(u32 len, bytes) variant:(u32 len, bytes)
//!           header_count:u16 { name:(u16 len, bytes) value:(u32 len, bytes) }*
//!           body:(u32 len, bytes)
//!           tag_count:u16 { tag:(u32 len, bytes) }*          (version 3)
//! checksum = CRC-32 (IEEE) of payload
//! ```
//!
//! Version 3 added the tags an entry was stored under, so that an instance
//! that promotes a copy records it under them: its own tag invalidations
//! then reach the copy even when Valkey cannot (the tag's set is in
//! Valkey). A version 2 envelope (an instance of the build before) still
//! reads, with no tags.
//!
//! The checksum catches damage, not forgery: whoever can write to Valkey can
//! write a valid envelope whatever the checksum. CRC-32 (version 2) replaced
//! eight bytes of BLAKE3 (version 1), which cost ~1.7 µs per 2 KiB entry on
//! every L2 read and write; an envelope of version 1 now reads as a miss.
//!
//! All integers little-endian. Anything else (another magic, an unknown
//! version, a wrong length, a bad checksum, an invalid header field, trailing
//! bytes) is a [`DecodeError`]: the caller treats it as a miss.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tiercache_core::body::BodyBuilder;
use tiercache_core::{Entry, Times, Value};

/// The envelope's first bytes.
pub const MAGIC: &[u8; 3] = b"TCE";
/// The format version this build writes (it reads this and version 2).
pub const VERSION: u8 = 3;
/// The oldest format version this build reads.
const OLDEST_READ: u8 = 2;
const HEADER_LEN: usize = 3 + 1 + 4;
const CHECKSUM_LEN: usize = 4;

/// Encodes `entry` into an envelope: from
/// [`mapped_from`](tiercache_core::body::mapped_from) bytes up in a page
/// mapping of its own, as L1 stores a large body (see
/// [`tiercache_core::body`]).
///
/// ```
/// # use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// # use tiercache_core::{Entry, Times, Value};
/// use tiercache_valkey::codec::{decode, encode};
///
/// let t = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
/// let times = Times::fresh(t, t + Duration::from_secs(30));
/// let entry = Entry::new("key".into(), Default::default(), Value::from_body("hello"), times, Duration::from_millis(5));
/// let bytes = encode(&entry);
/// let back = decode(bytes).unwrap();
/// assert_eq!(back.value(), entry.value());
/// assert_eq!(back.times(), entry.times());
/// ```
pub fn encode(entry: &Entry) -> Bytes {
    Measured::of(entry).encode_after(&[])
}

/// How many bytes [`encode`] makes of `entry`, without making them.
pub fn encoded_len(entry: &Entry) -> usize {
    Measured::of(entry).len()
}

/// An entry measured for its envelope: the length known before the bytes
/// are made (the write queue asks for room first), and not worked out
/// again when they are.
pub(crate) struct Measured<'a> {
    entry: &'a Entry,
    payload_len: usize,
}

impl<'a> Measured<'a> {
    pub(crate) fn of(entry: &'a Entry) -> Self {
        Self {
            entry,
            payload_len: payload_len(entry),
        }
    }

    /// The envelope's length.
    pub(crate) fn len(&self) -> usize {
        HEADER_LEN + self.payload_len + CHECKSUM_LEN
    }

    /// The envelope ([`encode`]), after `prefix` in the same bytes (a lock
    /// release's message carries one after its tag).
    pub(crate) fn encode_after(&self, prefix: &[u8]) -> Bytes {
        let (entry, payload_len) = (self.entry, self.payload_len);
        let value = entry.value();
        // In body storage: a large envelope in a page mapping of its own, as
        // L1 keeps a large body. On the allocator's heap, a flood's envelopes
        // (as large as their bodies, freed once written) left pages of each
        // size class partly used: bodies of ten sizes from 16 to 88 KiB held
        // 1.14-1.22x a 32 MiB budget with Valkey on, 1.07-1.15x now (for
        // ~10 % more CPU in such a flood of misses: mapping, zeroing).
        let mut out = Out(BodyBuilder::exact(prefix.len() + self.len()));
        out.slice(prefix);
        out.slice(MAGIC);
        out.u8(VERSION);
        out.u32(payload_len as u32);
        let times = entry.times();
        out.u64(millis(times.created_at));
        out.u64(millis(times.fresh_until));
        out.u64(millis(times.stale_until));
        out.u64(millis(times.error_until));
        out.u64(millis(times.hard_until));
        out.u64(entry.origin_latency().as_micros().min(u64::MAX as u128) as u64);
        out.u16(value.status);
        out.long(entry.key());
        out.long(entry.variant());
        out.u16(value.headers.len().min(u16::MAX as usize) as u16);
        for (name, v) in value.headers.iter().take(u16::MAX as usize) {
            out.u16(name.len() as u16);
            out.slice(name);
            out.long(v);
        }
        out.long(&value.body);
        out.u16(tags(entry).count() as u16);
        for tag in tags(entry) {
            out.long(tag);
        }
        let checksum = crc32fast::hash(&out.0.as_slice()[prefix.len() + HEADER_LEN..]);
        out.u32(checksum);
        out.0.finish()
    }
}

fn payload_len(entry: &Entry) -> usize {
    let value = entry.value();
    let headers_len: usize = value
        .headers
        .iter()
        .take(u16::MAX as usize)
        .map(|(n, v)| 6 + n.len() + v.len())
        .sum();
    8 * 6
        + 2
        + 4
        + entry.key().len()
        + 4
        + entry.variant().len()
        + 2
        + headers_len
        + 4
        + value.body.len()
        + 2
        + tags(entry).map(|t| 4 + t.len()).sum::<usize>()
}

/// An envelope being written, little-endian.
struct Out(BodyBuilder);

impl Out {
    fn slice(&mut self, bytes: &[u8]) {
        self.0.push(bytes);
    }
    fn u8(&mut self, n: u8) {
        self.0.push(&[n]);
    }
    fn u16(&mut self, n: u16) {
        self.0.push(&n.to_le_bytes());
    }
    fn u32(&mut self, n: u32) {
        self.0.push(&n.to_le_bytes());
    }
    fn u64(&mut self, n: u64) {
        self.0.push(&n.to_le_bytes());
    }
    /// A part of any length: its length first.
    fn long(&mut self, part: &[u8]) {
        self.u32(part.len() as u32);
        self.0.push(part);
    }
}

/// Decodes an envelope into an entry that owns its bytes (none of it a
/// slice of `bytes`); the body in [`tiercache_core::body`] storage.
pub fn decode(bytes: Bytes) -> Result<Entry, DecodeError> {
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN || &bytes[..3] != MAGIC {
        return Err(DecodeError::Foreign);
    }
    let version = bytes[3];
    if !(OLDEST_READ..=VERSION).contains(&version) {
        return Err(DecodeError::Version(version));
    }
    let payload_len = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) as usize;
    if bytes.len() != HEADER_LEN + payload_len + CHECKSUM_LEN {
        return Err(DecodeError::Length);
    }
    let payload = bytes.slice(HEADER_LEN..HEADER_LEN + payload_len);
    let checksum = &bytes[HEADER_LEN + payload_len..];
    if crc32fast::hash(&payload).to_le_bytes() != checksum {
        return Err(DecodeError::Checksum);
    }
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let created_at = r.time()?;
    let fresh_until = r.time()?;
    let stale_until = r.time()?;
    let error_until = r.time()?;
    let hard_until = r.time()?;
    let origin_latency = Duration::from_micros(r.u64()?);
    let status = r.u16()?;
    if !(100..=999).contains(&status) {
        return Err(DecodeError::Field("status"));
    }
    let head_start = r.pos;
    let key = r.long()?;
    let variant = r.long()?;
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let len = r.u16()? as usize;
        let name = r.take(len)?;
        let value = r.long()?;
        if !valid_name(&name) {
            return Err(DecodeError::Field("header name"));
        }
        if !valid_value(&value) {
            return Err(DecodeError::Field("header value"));
        }
        headers.push((name, value));
    }
    let head_end = r.pos;
    let body = r.long()?;
    let mut tags: Vec<Bytes> = Vec::new();
    if version >= 3 {
        let count = r.u16()?;
        let start = r.pos;
        let mut spans = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = r.long()?.len();
            spans.push(r.pos - start - len..r.pos - start);
        }
        // One copy of the tags' bytes: the tag index keeps tags past the
        // entry, and a slice of the payload would keep all of it with them.
        let block = Bytes::copy_from_slice(&r.buf[start..r.pos]);
        tags = spans.into_iter().map(|span| block.slice(span)).collect();
    }
    if r.pos != r.buf.len() {
        return Err(DecodeError::Length);
    }
    let ordered = created_at <= fresh_until
        && fresh_until <= stale_until
        && fresh_until <= error_until
        && hard_until >= stale_until.max(error_until);
    if !ordered {
        return Err(DecodeError::Field("times"));
    }
    // Valid: the entry takes its own copies. Slices of the reply would keep
    // all of it alive as long as the entry, and fred decodes a reply in
    // place, as a slice of the connection's read buffer. The key, variant
    // and fields in one block; the body in storage of its own.
    let head = Bytes::copy_from_slice(&r.buf[head_start..head_end]);
    let own = |part: &Bytes| {
        if part.is_empty() {
            return Bytes::new();
        }
        let at = part.as_ptr() as usize - r.buf.as_ptr() as usize - head_start;
        head.slice(at..at + part.len())
    };
    let key = own(&key);
    let variant = own(&variant);
    let headers = headers.iter().map(|(n, v)| (own(n), own(v))).collect();
    let body = tiercache_core::body::copy(&body);
    Ok(Entry::new(
        key,
        variant,
        Value {
            status,
            headers,
            body,
        },
        Times {
            created_at,
            fresh_until,
            stale_until,
            error_until,
            hard_until,
        },
        origin_latency,
    )
    .with_tags(&tags))
}

/// The tags `entry` is encoded with (at most `u16::MAX`).
fn tags(entry: &Entry) -> impl Iterator<Item = &Bytes> {
    entry.tags().iter().take(u16::MAX as usize)
}

/// Why bytes read from L2 are not an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not an envelope (another application's value, or garbage).
    Foreign,
    /// An envelope of a format version this build does not read.
    Version(u8),
    /// Truncated, padded, or a length field that does not add up.
    Length,
    /// The payload does not match its checksum.
    Checksum,
    /// A field holds a value no encoder writes.
    Field(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Foreign => f.write_str("not a tiercache envelope"),
            DecodeError::Version(v) => write!(
                f,
                "envelope format version {v}, this build reads versions {OLDEST_READ} to {VERSION}"
            ),
            DecodeError::Length => f.write_str("envelope truncated or its lengths do not add up"),
            DecodeError::Checksum => f.write_str("envelope checksum mismatch"),
            DecodeError::Field(name) => write!(f, "envelope field `{name}` is invalid"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Where an envelope holds its fill's `created_at` (8 bytes, the payload's
/// first field): what tells two fills of a key apart.
pub(crate) const CREATED_AT: std::ops::Range<usize> = HEADER_LEN..HEADER_LEN + 8;

/// Where an envelope holds its fill's origin latency (8 bytes, the
/// microseconds its load took: the sixth field after [`CREATED_AT`]).
pub(crate) const ORIGIN_LATENCY: std::ops::Range<usize> = HEADER_LEN + 40..HEADER_LEN + 48;

/// `entry`'s `created_at` as its envelope holds it (see [`CREATED_AT`]).
pub(crate) fn created_at(entry: &Entry) -> [u8; 8] {
    millis(entry.times().created_at).to_le_bytes()
}

/// The creation an envelope holds (see [`CREATED_AT`]), if it is long
/// enough to hold one.
pub(crate) fn created_at_of(envelope: &[u8]) -> Option<SystemTime> {
    let bytes = <[u8; 8]>::try_from(envelope.get(CREATED_AT)?).ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(u64::from_le_bytes(bytes)))
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// RFC 9110 `token`.
fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// RFC 9110 `field-value`: visible ASCII, SP, HTAB, obs-text; no CR, LF, NUL.
fn valid_value(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b) || b >= 0x80)
}

struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Length)?;
        if end > self.buf.len() {
            return Err(DecodeError::Length);
        }
        let out = self.buf.slice(self.pos..end);
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N)?[..].try_into().expect("N bytes"))
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn time(&mut self) -> Result<SystemTime, DecodeError> {
        let ms = self.u64()?;
        UNIX_EPOCH
            .checked_add(Duration::from_millis(ms))
            .ok_or(DecodeError::Field("times"))
    }

    fn long(&mut self) -> Result<Bytes, DecodeError> {
        let len = u32::from_le_bytes(self.array()?) as usize;
        self.take(len)
    }
}

#[cfg(test)]
mod tests;
