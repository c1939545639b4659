//! Prefix bans: a prefix invalidation recorded in Valkey, checked on L2
//! reads against an entry's `created_at`.

use std::time::Duration;

/// How long a prefix ban is kept: entries it covers that outlive it (ttl
/// plus stale windows longer than this) could be read from L2 again.
pub const BAN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The hash of recorded prefix bans: `PREFIX:bans`.
pub(crate) fn bans_key(prefix: &str) -> String {
    format!("{prefix}:bans")
}
