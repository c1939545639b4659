//! Fills stored only under a condition, which a script checks on the
//! server: a renewal only over the fill it renews ([`SET_OVER`]), and a
//! late fill (the answer of a load that outlived its fleet lock, or whose
//! lock Valkey lost) only over nothing newer, and while no other instance
//! holds the key's lock ([`SET_UNLESS_NEWER`]).

use bytes::Bytes;
use fred::clients::{Client, Pipeline};
use fred::prelude::{ClientLike, Value};
use tiercache_core::{KeyHash, LateFill};

use crate::keys::slot_key;
use crate::tier::Inner;
use crate::writer::eval_on;

/// What a guarded fill's script checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Guard {
    /// A renewal: stored only while the key holds the fill created at
    /// these envelope bytes (see [`SET_OVER`]).
    Over([u8; 8]),
    /// A late fill (see [`LateFill`]): stored unless the key holds the
    /// fill of a load that began after `since` (milliseconds since the
    /// epoch), or its lock holds another token than `holder`'s (see
    /// [`SET_UNLESS_NEWER`]).
    UnlessNewer {
        /// When the load began.
        since: u64,
        /// The token of the lock the load held on the key.
        holder: Option<Bytes>,
    },
}

impl Guard {
    /// [`Guard::UnlessNewer`] for `late`.
    pub(crate) fn unless_newer_than(late: &LateFill) -> Self {
        let ms = late
            .since
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        Self::UnlessNewer {
            since: u64::try_from(ms).unwrap_or(u64::MAX),
            holder: late.holder.as_ref().map(|token| token.0.clone()),
        }
    }
}

/// Sets `KEYS[1]` to `ARGV[4]` with `PX ARGV[5]` only while it holds an
/// envelope whose bytes `ARGV[1]..=ARGV[2]` (its fill's creation) are
/// `ARGV[3]`: a renewal never replaces a newer fill, nor brings back one
/// taken out (expired, invalidated, deleted again). Refused, it publishes
/// `ARGV[7]` on `ARGV[6]` (an `R` message): every instance holding the old
/// fill drops its L1 copies of it, which L2 no longer backs (copies of a
/// newer fill stay); the renewer drops its renewal's copy on the reply.
const SET_OVER: &str = "local held = redis.call('GETRANGE', KEYS[1], ARGV[1], ARGV[2]) \
     if held == ARGV[3] then \
     redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5]) return 1 end \
     redis.call('PUBLISH', ARGV[6], ARGV[7]) return 0";

/// Sets `KEYS[1]` to `ARGV[4]` with `PX ARGV[5]` unless `KEYS[2]` (when
/// given: the key's fleet lock) holds another token than `ARGV[8]` (the
/// loader's: another instance took the lock after this load's ended, so
/// its load began after this one's and its answer is on its way), or it
/// holds an envelope whose load began after `ARGV[3]` (milliseconds): its creation
/// less its origin latency, read from bytes `ARGV[1]..=ARGV[2]` (the
/// creation's 8 bytes, little-endian milliseconds, through the latency's,
/// microseconds). A slow load's answer never replaces the one of a later
/// load (another instance's, which took the lock this one outlived)
/// stored meanwhile; it replaces one of an earlier load, stored first
/// because it ended first, and then publishes `ARGV[7]` followed by the
/// replaced fill's creation on `ARGV[6]` (an `R` message): every instance
/// drops its L1 copies of that fill (the earlier loader's own, and those
/// read from L2 meanwhile), as a renewal's refusal has them do. Refused,
/// the loader drops its own copy on the reply; the other instances'
/// copies are the newer fill's. A key of another type is replaced, as a
/// `SET` replaces it.
const SET_UNLESS_NEWER: &str = "if KEYS[2] then local owner = redis.call('GET', KEYS[2]) \
     if owner and owner ~= ARGV[8] then return 0 end end \
     local read, held = pcall(redis.call, 'GETRANGE', KEYS[1], ARGV[1], ARGV[2]) \
     local replaced = read and #held == 48 \
     local function le(at) local n = 0 for i = at + 7, at, -1 do n = n * 256 + string.byte(held, i) end return n end \
     if replaced and le(1) - le(41) / 1000 > tonumber(ARGV[3]) then return 0 end \
     redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5]) \
     if replaced then redis.call('PUBLISH', ARGV[6], ARGV[7] .. ' ' .. string.format('%.0f', le(1))) end \
     return 1";

/// Queues a guarded fill's script (its tags wait for its answer: see
/// `apply_batch`). Answers 1 when stored, 0 when refused.
pub(crate) async fn pipe_guarded(
    inner: &Inner,
    pipe: &Pipeline<Client>,
    key: &str,
    (value, px, hash): (&Bytes, i64, KeyHash),
    guard: Guard,
) -> Result<(), fred::error::Error> {
    let eval = eval_on(key);
    let at = &crate::codec::CREATED_AT;
    // A renewal reads the creation; a late fill reads on to the latency.
    let end = match guard {
        Guard::Over(_) => at.end,
        Guard::UnlessNewer { .. } => crate::codec::ORIGIN_LATENCY.end,
    };
    let mut args = vec![
        Value::from(""),
        Value::from(1),
        Value::from(key),
        Value::from(at.start as i64),
        Value::from((end - 1) as i64),
    ];
    match guard {
        Guard::Over(created) => {
            // The fill read (the renewer drops its renewal's copy itself: no
            // other instance has it, and its time may be a newer fill's).
            let created_ms = [u64::from_le_bytes(created)];
            let message = crate::bus::encode_stale_fill(&inner.bus.instance, hash, &created_ms);
            args[0] = Value::from(SET_OVER);
            args.extend([
                Value::from(Bytes::copy_from_slice(&created)),
                Value::from(value.clone()),
                Value::from(px),
                Value::from(inner.bus.channel.as_str()),
                Value::from(message),
            ]);
        }
        Guard::UnlessNewer { since, holder } => {
            // The message names the fill replaced, whose creation the
            // script adds.
            let message = crate::bus::encode_stale_fill(&inner.bus.instance, hash, &[]);
            args[0] = Value::from(SET_UNLESS_NEWER);
            args.extend([
                Value::from(i64::try_from(since).unwrap_or(i64::MAX)),
                Value::from(value.clone()),
                Value::from(px),
                Value::from(inner.bus.channel.as_str()),
                Value::from(message),
            ]);
            // The lock, in the entry's slot, read with the entry.
            if let Some(token) = holder {
                args[1] = Value::from(2);
                args.insert(3, Value::from(slot_key(&inner.prefix, &hash, "lock")));
                args.push(Value::from(token));
            }
        }
    }
    let _: () = pipe.custom(eval, args).await?;
    Ok(())
}
