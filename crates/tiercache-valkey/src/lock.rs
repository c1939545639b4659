//! Fleet-wide fill locks: the scripts that take and release them, and the
//! message a release sends to the instances waiting on it.

use std::time::Duration;

use bytes::Bytes;
use tiercache_core::Unlocked;

use crate::codec;

/// Takes the lock (`SET NX PX`) or tells how long it is still held.
/// Replies `{-10, ''}` when taken, else `{PTTL, holder's token}`.
pub(crate) const LOCK_SCRIPT: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return {-10, ''} end \
     return {redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1]) or ''}";

/// Deletes the lock only if it still holds this owner's token.
pub(crate) const UNLOCK_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('DEL', KEYS[1]) else return 0 end";

/// How long a shared answer stays readable for late waiters.
pub(crate) const SHARED_ANSWER_TTL: Duration = Duration::from_secs(1);

/// Largest shared answer carried in an unlock message; a larger one is
/// announced as passed (the waiting instances load it themselves).
const MAX_SHARED_MESSAGE: usize = 256 * 1024;

/// The message a lock's release sends on the key's done channel: `1`
/// filled (read L2), `0` passed (load), or `2`/`3` followed by the shared
/// answer's envelope (`2`: an origin failure), which waiting instances
/// answer with instead of calling the origin again.
pub(crate) fn unlock_message(how: &Unlocked) -> Bytes {
    match how {
        Unlocked::Filled => Bytes::from_static(b"1"),
        Unlocked::Shared(entry, failed) if entry.value().body.len() <= MAX_SHARED_MESSAGE => {
            let envelope = codec::encode(entry);
            let mut message = Vec::with_capacity(1 + envelope.len());
            message.push(if *failed { b'2' } else { b'3' });
            message.extend_from_slice(&envelope);
            Bytes::from(message)
        }
        _ => Bytes::from_static(b"0"),
    }
}

/// Reads [`unlock_message`]'s output; anything else is "passed".
pub(crate) fn read_unlock_message(message: &[u8]) -> Unlocked {
    match message.split_first() {
        Some((b'1', [])) => Unlocked::Filled,
        Some((tag @ (b'2' | b'3'), envelope)) => {
            match codec::decode(Bytes::copy_from_slice(envelope)) {
                Ok(entry) => Unlocked::Shared(entry, *tag == b'2'),
                Err(_) => Unlocked::Passed,
            }
        }
        _ => Unlocked::Passed,
    }
}
