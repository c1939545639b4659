//! Prefix bans: a prefix invalidation recorded in Valkey, checked on L2
//! reads against an entry's `created_at`.
//!
//! Bans are bounded: past the most a tier keeps, the oldest half fold into
//! one ban of every key at the latest of their times. Folding only widens
//! what is refused (copies older than that time, of any key, are misses),
//! so no banned copy is ever read again, and both the held list each L2
//! read scans and the hash in Valkey stay within the bound whatever the
//! rate of prefix invalidations.

use std::time::{Duration, SystemTime};

use tiercache_core::KeyPattern;

/// How long a prefix ban is kept: entries it covers that outlive it (ttl
/// plus stale windows longer than this) could be read from L2 again.
pub const BAN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// A prefix ban: entries matching `pattern` created at or before `at` are
/// gone, wherever they are read from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ban {
    pub(crate) pattern: KeyPattern,
    pub(crate) at: SystemTime,
}

/// The hash of recorded prefix bans: `PREFIX:bans`.
pub(crate) fn bans_key(prefix: &str) -> String {
    format!("{prefix}:bans")
}

/// When `bans` holds more than `max`, takes out the oldest by `at` (all but
/// `max / 2`) and returns them with the latest of their times: a ban of
/// every key at that time covers each of them. `None` within the bound.
pub(crate) fn take_oldest<T, K: Ord>(
    bans: &mut Vec<T>,
    max: usize,
    at: impl Fn(&T) -> K,
) -> Option<(K, Vec<T>)> {
    if bans.len() <= max {
        return None;
    }
    bans.sort_unstable_by_key(&at);
    let oldest: Vec<T> = bans.drain(..bans.len() - max / 2).collect();
    let latest = oldest.iter().map(&at).max()?;
    Some((latest, oldest))
}

/// Keeps `bans` within `max`: the oldest fold into one ban of every key
/// (see [`take_oldest`]), merged with such a ban already held.
pub(crate) fn fold(bans: &mut Vec<Ban>, max: usize) {
    let Some((at, _)) = take_oldest(bans, max, |b| b.at) else {
        return;
    };
    let everything = KeyPattern::new();
    match bans.iter_mut().find(|b| b.pattern == everything) {
        Some(held) => held.at = held.at.max(at),
        None => bans.push(Ban {
            pattern: everything,
            at,
        }),
    }
}

/// Every change to the bans hash (`KEYS[1]`), atomically, so no instance
/// undoes another's: when `ARGV[1]` is "1", field `ARGV[2]` is set to time
/// `ARGV[3]` (milliseconds) unless it holds a later one (a ban only moves
/// later); then each field of `ARGV[5..]` goes if it holds a time at or
/// before `ARGV[4]` (a lapsed or folded ban recorded again later stays).
pub(crate) const BANS_SCRIPT: &str = r#"
if ARGV[1] == '1' then
  local held = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '0') or 0
  if tonumber(ARGV[3]) > held then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
end
local upto = tonumber(ARGV[4])
for i = 5, #ARGV do
  local was = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') or 0
  if was <= upto then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 1
"#;

/// [`BANS_SCRIPT`]'s arguments: `raise` sets a field to a time unless it
/// holds a later one, then `drop` goes where it holds `upto` or earlier.
pub(crate) fn bans_script_args(
    raise: Option<(String, u64)>,
    upto: u64,
    drop: Vec<String>,
) -> Vec<String> {
    let mut args = match raise {
        Some((field, at)) => vec!["1".to_owned(), field, at.to_string()],
        None => vec!["0".to_owned(), String::new(), "0".to_owned()],
    };
    args.push(upto.to_string());
    args.extend(drop);
    args
}

/// Reads the recorded prefix bans (on every reconnect).
pub(crate) async fn load_bans(tier: std::sync::Weak<crate::tier::Inner>) -> Option<Vec<Ban>> {
    let inner = tier.upgrade()?;
    let key = bans_key(&inner.prefix);
    let client = inner.client();
    let read = fred::prelude::HashesInterface::hgetall::<
        std::collections::HashMap<String, String>,
        _,
    >(&client, key);
    let fields = tokio::time::timeout(inner.command_timeout * 4, read)
        .await
        .ok()?
        .ok()?;
    let now = SystemTime::now();
    Some(
        fields
            .into_iter()
            .filter_map(|(pattern, at)| {
                let pattern =
                    tiercache_core::KeyPattern::from_bytes(&crate::bus::unhex(&pattern)?)?;
                let at = std::time::UNIX_EPOCH + Duration::from_millis(at.parse().ok()?);
                (at + BAN_RETENTION > now).then_some(Ban { pattern, at })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ban(path: &str, secs: u64) -> Ban {
        Ban {
            pattern: KeyPattern::new().prefix(path.as_bytes()),
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
        }
    }

    #[test]
    fn bans_past_the_bound_fold_into_one_ban_of_every_key_that_covers_them() {
        let mut bans: Vec<Ban> = (0..9).map(|i| ban(&format!("/p{i}"), 100 - i)).collect();
        let before = bans.clone();
        fold(&mut bans, 8);
        assert_eq!(bans.len(), 5, "4 kept and the folded one: {bans:?}");
        let everything = bans
            .iter()
            .find(|b| b.pattern == KeyPattern::new())
            .unwrap();
        for old in &before {
            // Every ban is still covered, by itself or by the folded one.
            assert!(
                bans.iter()
                    .any(|b| b.at >= old.at && (b.pattern == old.pattern || b == everything)),
                "{old:?} is no longer covered"
            );
        }
        // The newest four are kept as they were; the folded one is at the
        // latest of the rest (92..=96 → 96), no later.
        assert_eq!(
            everything.at,
            SystemTime::UNIX_EPOCH + Duration::from_secs(96)
        );
        for kept in [97, 98, 99, 100] {
            assert!(
                bans.iter()
                    .any(|b| b.at == SystemTime::UNIX_EPOCH + Duration::from_secs(kept))
            );
        }
    }

    #[test]
    fn a_second_fold_merges_with_the_ban_of_every_key_already_held() {
        let mut bans = Vec::new();
        for i in 0..40 {
            bans.push(ban(&format!("/p{i}"), i));
            fold(&mut bans, 8);
            assert!(bans.len() <= 8, "{} bans held", bans.len());
        }
        let everything: Vec<_> = bans
            .iter()
            .filter(|b| b.pattern == KeyPattern::new())
            .collect();
        assert_eq!(everything.len(), 1, "{bans:?}");
        // Everything up to the oldest kept prefix ban is covered.
        let oldest_kept = bans
            .iter()
            .filter(|b| b.pattern != KeyPattern::new())
            .map(|b| b.at)
            .min()
            .unwrap();
        assert!(everything[0].at + Duration::from_secs(1) >= oldest_kept);
    }

    #[test]
    fn within_the_bound_nothing_folds() {
        let mut bans: Vec<Ban> = (0..8).map(|i| ban(&format!("/p{i}"), i)).collect();
        let before = bans.clone();
        fold(&mut bans, 8);
        assert_eq!(bans, before);
    }
}
