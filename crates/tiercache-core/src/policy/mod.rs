//! Per-route caching policy: ttl, jitter, lock timeout.
//!
//! A [`PolicyBuilder`] is a draft; [`PolicyBuilder::build`] checks it once and
//! the error names the field and the allowed range. A [`Policy`] exists only
//! validated, so nothing past `build` (the engine, the layer) can meet a
//! jitter of 1.5 or a window that overflows the clock.

use std::fmt;
use std::time::Duration;

use rand::Rng;

/// The longest ttl (and additive jitter) a policy accepts: one year.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// The largest symmetric jitter fraction.
pub const MAX_JITTER: f64 = 0.5;
/// The longest a follower may wait on another request's origin load.
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(600);

/// How each fill's fresh lifetime is spread around the route's ttl.
///
/// Drawn again at every fill so that a cohort of keys filled together never
/// expires together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Jitter {
    /// The symmetric band `ttl ± ttl·fraction`, `fraction` in `0.0..=0.5`.
    Symmetric(f64),
    /// The additive band `ttl + uniform(0, max)`, `max` in `0..=ttl`.
    Additive(Duration),
}

/// How a route's responses are cached: a validated policy, built with
/// [`Policy::ttl`] and [`PolicyBuilder::build`].
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::Policy;
///
/// let policy = Policy::ttl(Duration::from_secs(30)).jitter(0.1).build().unwrap();
/// assert_eq!(policy.fresh_ttl(), Duration::from_secs(30));
///
/// let err = Policy::ttl(Duration::from_secs(30)).jitter(0.7).build().unwrap_err();
/// assert!(err.to_string().contains("jitter"));
/// ```
///
/// A draft that skipped `build` is not a policy: nothing takes it in its
/// place, so an unchecked jitter of 1.5 never reaches the engine.
///
/// ```compile_fail
/// use std::time::Duration;
/// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
///
/// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
/// let draft = Policy::ttl(Duration::from_secs(30)).jitter(1.5);
/// cache.put(&CacheKey::new("k"), Value::from_body("v"), &draft); // expected `&Policy`
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    ttl: Duration,
    jitter: Jitter,
    lock_timeout: Duration,
    hit_for_miss_ttl: Duration,
    stale_while_revalidate: Duration,
    stale_if_error: Duration,
    negative_ttl: Duration,
    xfetch_beta: f64,
    origin_soft_timeout: Option<Duration>,
    override_origin: bool,
    tags: Vec<bytes::Bytes>,
    revalidation_window: Duration,
}

impl Policy {
    /// Default jitter fraction: `ttl ± 10 %`.
    pub const DEFAULT_JITTER: f64 = 0.1;
    /// Default wait of a follower on another request's origin load.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
    /// Default time a key whose response could not be shared stays uncacheable.
    pub const DEFAULT_HIT_FOR_MISS_TTL: Duration = Duration::from_secs(10);
    /// Default lifetime of a 404 or 410 (never longer than the ttl).
    pub const DEFAULT_NEGATIVE_TTL: Duration = Duration::from_secs(5);
    /// Default XFetch β.
    pub const DEFAULT_XFETCH_BETA: f64 = 1.0;
    /// The largest XFetch β.
    pub const MAX_XFETCH_BETA: f64 = 10.0;
    /// Default time an expired entry with a validator is kept for
    /// revalidation: one minute.
    pub const DEFAULT_REVALIDATION_WINDOW: Duration = Duration::from_secs(60);

    /// Starts a policy with fresh lifetime `ttl` (must be > 0) and the
    /// default jitter; finish it with [`PolicyBuilder::build`].
    pub fn ttl(ttl: Duration) -> PolicyBuilder {
        PolicyBuilder(Self {
            ttl,
            jitter: Jitter::Symmetric(Self::DEFAULT_JITTER),
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            hit_for_miss_ttl: Self::DEFAULT_HIT_FOR_MISS_TTL,
            stale_while_revalidate: Duration::ZERO,
            stale_if_error: Duration::ZERO,
            negative_ttl: Self::DEFAULT_NEGATIVE_TTL.min(ttl),
            xfetch_beta: Self::DEFAULT_XFETCH_BETA,
            origin_soft_timeout: None,
            override_origin: false,
            tags: Vec::new(),
            revalidation_window: Self::DEFAULT_REVALIDATION_WINDOW,
        })
    }

    /// A builder holding this policy, to derive another from it.
    pub fn to_builder(&self) -> PolicyBuilder {
        PolicyBuilder(self.clone())
    }

    /// The route's tags.
    pub fn tags(&self) -> &[bytes::Bytes] {
        &self.tags
    }

    /// The stale-while-revalidate window.
    pub fn swr_window(&self) -> Duration {
        self.stale_while_revalidate
    }

    /// The stale-if-error window.
    pub fn sie_window(&self) -> Duration {
        self.stale_if_error
    }

    /// The negative ttl.
    pub fn negative(&self) -> Duration {
        self.negative_ttl
    }

    /// XFetch β.
    pub fn beta(&self) -> f64 {
        self.xfetch_beta
    }

    /// The origin soft timeout, if any.
    pub fn soft_timeout(&self) -> Option<Duration> {
        self.origin_soft_timeout
    }

    /// How long an expired entry with a validator is kept for revalidation.
    pub fn revalidation_window(&self) -> Duration {
        self.revalidation_window
    }

    /// Whether the route's ttl overrides an origin-declared lifetime.
    pub fn overrides_origin(&self) -> bool {
        self.override_origin
    }

    /// The route's nominal fresh lifetime.
    pub fn fresh_ttl(&self) -> Duration {
        self.ttl
    }

    /// The jitter mode.
    pub fn jitter_mode(&self) -> Jitter {
        self.jitter
    }

    /// The follower wait bound.
    pub fn lock_wait(&self) -> Duration {
        self.lock_timeout
    }

    /// The hit-for-miss lifetime.
    pub fn hit_for_miss(&self) -> Duration {
        self.hit_for_miss_ttl
    }

    /// The smallest and largest fresh lifetime a fill may draw.
    pub fn band(&self) -> (Duration, Duration) {
        match self.jitter {
            Jitter::Symmetric(j) => (self.ttl.mul_f64(1.0 - j), self.ttl.mul_f64(1.0 + j)),
            Jitter::Additive(max) => (self.ttl, self.ttl + max),
        }
    }

    /// Draws one fresh lifetime from the band. Jitter 0 gives exactly `ttl`.
    pub fn draw_ttl<R: Rng + ?Sized>(&self, rng: &mut R) -> Duration {
        self.draw_around(self.ttl, rng)
    }

    /// Draws a negative (404/410) lifetime, jittered like the ttl.
    pub fn draw_negative_ttl<R: Rng + ?Sized>(&self, rng: &mut R) -> Duration {
        let scaled = match self.jitter {
            Jitter::Additive(max) => Jitter::Additive(
                max.mul_f64(self.negative_ttl.as_secs_f64() / self.ttl.as_secs_f64()),
            ),
            j => j,
        };
        Self {
            jitter: scaled,
            ..self.clone()
        }
        .draw_around(self.negative_ttl, rng)
    }

    /// Draws a lifetime for one the origin declared: jitter only shortens it,
    /// into `[declared·(1−jitter), declared]` (additive: by up to `J`, at most half).
    pub fn draw_origin_ttl<R: Rng + ?Sized>(&self, declared: Duration, rng: &mut R) -> Duration {
        match self.jitter {
            Jitter::Symmetric(j) if j > 0.0 => declared.mul_f64(1.0 - rng.random_range(0.0..=j)),
            Jitter::Additive(max) if !max.is_zero() && !declared.is_zero() => {
                let cap = max.min(declared / 2).as_nanos() as u64;
                declared - Duration::from_nanos(rng.random_range(0..=cap))
            }
            _ => declared,
        }
    }

    fn draw_around<R: Rng + ?Sized>(&self, ttl: Duration, rng: &mut R) -> Duration {
        match self.jitter {
            Jitter::Symmetric(j) if j > 0.0 => {
                let u: f64 = rng.random_range(-j..=j);
                ttl.mul_f64(1.0 + u)
            }
            Jitter::Additive(max) if !max.is_zero() => {
                let extra = rng.random_range(0..=max.as_nanos() as u64);
                ttl + Duration::from_nanos(extra)
            }
            _ => ttl,
        }
    }

    /// Checks every field; the error names the first bad one and its allowed range.
    fn check(&self) -> Result<(), PolicyError> {
        if self.ttl.is_zero() || self.ttl > MAX_TTL {
            return Err(PolicyError::new(
                "ttl",
                format!("{:?}", self.ttl),
                "greater than 0 and at most 365 days",
            ));
        }
        match self.jitter {
            Jitter::Symmetric(j) if !(0.0..=MAX_JITTER).contains(&j) => {
                return Err(PolicyError::new(
                    "jitter",
                    j.to_string(),
                    "0.0..=0.5 (the band ttl ± ttl·jitter)",
                ));
            }
            Jitter::Additive(max) if max > self.ttl => {
                return Err(PolicyError::new(
                    "jitter",
                    format!("additive {max:?}"),
                    "an additive jitter of 0..=ttl",
                ));
            }
            _ => {}
        }
        if self.lock_timeout.is_zero() || self.lock_timeout > MAX_LOCK_TIMEOUT {
            return Err(PolicyError::new(
                "lock_timeout",
                format!("{:?}", self.lock_timeout),
                "greater than 0 and at most 600 s",
            ));
        }
        for (field, window) in [
            ("stale_while_revalidate", self.stale_while_revalidate),
            ("stale_if_error", self.stale_if_error),
            ("keep_for_revalidation", self.revalidation_window),
        ] {
            if window > MAX_TTL {
                return Err(PolicyError::new(
                    field,
                    format!("{window:?}"),
                    "at most 365 days",
                ));
            }
        }
        if self.negative_ttl.is_zero() || self.negative_ttl > self.ttl {
            return Err(PolicyError::new(
                "negative_ttl",
                format!("{:?}", self.negative_ttl),
                "greater than 0 and at most the ttl",
            ));
        }
        if !(0.0..=Self::MAX_XFETCH_BETA).contains(&self.xfetch_beta) {
            return Err(PolicyError::new(
                "xfetch_beta",
                self.xfetch_beta.to_string(),
                "0.0..=10.0 (0 disables early refresh)",
            ));
        }
        if let Some(t) = self.origin_soft_timeout
            && (t.is_zero() || t > MAX_LOCK_TIMEOUT)
        {
            return Err(PolicyError::new(
                "origin_soft_timeout",
                format!("{t:?}"),
                "greater than 0 and at most 600 s",
            ));
        }
        if self.hit_for_miss_ttl > MAX_TTL {
            return Err(PolicyError::new(
                "hit_for_miss_ttl",
                format!("{:?}", self.hit_for_miss_ttl),
                "at most 365 days",
            ));
        }
        Ok(())
    }
}

/// A draft [`Policy`]: set its fields, then [`build`](Self::build) it, which
/// validates every field once.
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::Policy;
///
/// let policy = Policy::ttl(Duration::from_secs(60))
///     .jitter(0.1)
///     .stale_while_revalidate(Duration::from_secs(30))
///     .build()?;
/// # Ok::<(), tiercache_core::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[must_use = "a policy draft does nothing until it is built"]
pub struct PolicyBuilder(Policy);

impl PolicyBuilder {
    /// Soft/hard TTL: past its fresh time and inside this window an entry is
    /// answered at once (`STALE`) while one background refresh runs.
    pub fn stale_while_revalidate(mut self, window: Duration) -> Self {
        self.0.stale_while_revalidate = window;
        self
    }

    /// Past its fresh time and inside this window an entry answers when the
    /// origin fails (5xx, an error, a soft timeout), unless the origin said
    /// `must-revalidate`, `proxy-revalidate` or `no-cache`. For a second
    /// after such a failure it answers without asking the origin again.
    pub fn stale_if_error(mut self, window: Duration) -> Self {
        self.0.stale_if_error = window;
        self
    }

    /// Lifetime of 404 and 410 responses without explicit freshness (default
    /// 5 s, or the ttl if shorter).
    pub fn negative_ttl(mut self, ttl: Duration) -> Self {
        self.0.negative_ttl = ttl;
        self
    }

    /// XFetch β (default 1.0; 0 disables): a fresh hit refreshes early when
    /// `now − δ·β·ln(rand()) ≥ fresh_until`, δ being the last fill's origin time.
    pub fn xfetch_beta(mut self, beta: f64) -> Self {
        self.0.xfetch_beta = beta;
        self
    }

    /// With a stale entry at hand, answer it once the origin has taken this
    /// long, and let the fill finish in the background.
    pub fn origin_soft_timeout(mut self, timeout: Duration) -> Self {
        self.0.origin_soft_timeout = Some(timeout);
        self
    }

    /// Records every response of this route under `tag` (a surrogate key),
    /// besides any the response names in `Surrogate-Key`; see
    /// [`TieredCache::invalidate_tag`](crate::TieredCache::invalidate_tag).
    pub fn tag(mut self, tag: impl Into<bytes::Bytes>) -> Self {
        self.0.tags.push(tag.into());
        self
    }

    /// Use the route's ttl even when the origin declares a lifetime
    /// (`s-maxage`, `max-age`, `Expires`).
    pub fn override_origin(mut self, on: bool) -> Self {
        self.0.override_origin = on;
        self
    }

    /// Symmetric jitter: each fill lives `ttl ± ttl·fraction`, `fraction` in `0.0..=0.5`.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.0.jitter = Jitter::Symmetric(fraction);
        self
    }

    /// Additive jitter: each fill lives `ttl + uniform(0, max)`, `max` in `0..=ttl`.
    pub fn additive_jitter(mut self, max: Duration) -> Self {
        self.0.jitter = Jitter::Additive(max);
        self
    }

    /// How long a follower waits on the leader's origin load before going to
    /// the origin itself (counted as a lock timeout): from the load's start,
    /// or from its last [`Progress`](crate::Progress) (an HTTP origin's head,
    /// each frame of its body), up to four times this from the start, so a
    /// slow answer that keeps coming is waited for.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.0.lock_timeout = timeout;
        self
    }

    /// How long a key whose response may not be shared is remembered as
    /// uncacheable, so later requests go straight to the origin instead of
    /// queueing behind one another (Varnish's hit-for-miss).
    pub fn hit_for_miss_ttl(mut self, ttl: Duration) -> Self {
        self.0.hit_for_miss_ttl = ttl;
        self
    }

    /// How long an entry with a validator (`ETag`, `Last-Modified`) is kept
    /// once every window has passed (default 60 s; 0 drops it at once):
    /// never answered, but the next request asks the origin with its
    /// validators, and a 304 renews it without a body. It counts in L1's
    /// budget and in L2's `PX` like any entry.
    pub fn keep_for_revalidation(mut self, window: Duration) -> Self {
        self.0.revalidation_window = window;
        self
    }

    /// Checks every field without building; the error names the first bad
    /// one and its allowed range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.0.check()
    }

    /// Validates every field and returns the policy; the error names the
    /// first bad field and its allowed range.
    pub fn build(self) -> Result<Policy, PolicyError> {
        self.0.check()?;
        Ok(self.0)
    }
}

/// What the layer's `route` and the engine's builders accept as a policy:
/// a built [`Policy`], or a [`PolicyBuilder`] that is validated on the spot.
pub trait IntoPolicy {
    /// The validated policy, or why it is refused.
    fn into_policy(self) -> Result<Policy, PolicyError>;
}

impl IntoPolicy for Policy {
    fn into_policy(self) -> Result<Policy, PolicyError> {
        Ok(self)
    }
}

impl IntoPolicy for PolicyBuilder {
    fn into_policy(self) -> Result<Policy, PolicyError> {
        self.build()
    }
}

/// A policy field outside its allowed range.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PolicyError {
    /// The field's name, as its builder method is spelled.
    pub field: &'static str,
    /// The refused value, printed.
    pub value: String,
    /// What the field accepts.
    pub allowed: &'static str,
}

impl PolicyError {
    fn new(field: &'static str, value: String, allowed: &'static str) -> Self {
        Self {
            field,
            value,
            allowed,
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid cache policy: `{}` is {}, but must be {}",
            self.field, self.value, self.allowed
        )
    }
}

impl std::error::Error for PolicyError {}

mod serde;

pub use self::serde::{deserialize_duration, parse_duration};

#[cfg(test)]
mod tests;
