//! Policies from configuration: [`Policy`] implements serde's
//! `Deserialize`, with human durations (`"30s"`, `"5m"`, `"250ms"`, `"1h"`)
//! and the same validation as [`PolicyBuilder::build`]: a bad value is
//! refused with the same words, and unknown fields are errors.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::{Policy, PolicyBuilder};

/// Parses `<number><unit>` with unit `ms`, `s`, `m`, `h` or `d` (a fraction is allowed: `1.5s`).
///
/// ```
/// use std::time::Duration;
/// assert_eq!(tiercache_core::parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(tiercache_core::parse_duration("5m"), Ok(Duration::from_secs(300)));
/// assert!(tiercache_core::parse_duration("10").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("`{text}` has no unit: write it as 250ms, 10s, 5m, 1h or 1d"))?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write it as 250ms, 10s, 5m, 1h or 1d"))?;
    let seconds = match unit {
        "ms" => number / 1000.0,
        "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        "d" => number * 86_400.0,
        _ => return Err(format!("`{text}` has unit `{unit}`; use ms, s, m, h or d")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("`{text}` is out of range"))
}

/// A duration in configuration: `"30s"` (see [`parse_duration`]) or a
/// number of seconds.
enum Human {
    Text(String),
    Seconds(f64),
}

/// Read by hand: derived (`untagged`), a wrong type was told only "data did
/// not match any variant of untagged enum Human".
impl<'de> Deserialize<'de> for Human {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Human;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a duration: text such as \"30s\", \"250ms\" or \"1h\", or a number of seconds",
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Human, E> {
                Ok(Human::Text(v.to_owned()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Human, E> {
                Ok(Human::Seconds(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Human, E> {
                Ok(Human::Seconds(v as f64))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Human, E> {
                Ok(Human::Seconds(v as f64))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Deserializes an optional duration written as `"30s"` (see
/// [`parse_duration`]) or a number of seconds: for
/// `#[serde(default, deserialize_with = "…")]` on fields of configuration
/// structs of your own, as [`Policy`]'s own fields use it.
pub fn deserialize_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let Some(human) = Option::<Human>::deserialize(d)? else {
        return Ok(None);
    };
    match human {
        Human::Text(text) => parse_duration(&text)
            .map(Some)
            .map_err(serde::de::Error::custom),
        Human::Seconds(secs) => Duration::try_from_secs_f64(secs)
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{secs} is not a duration in seconds"))),
    }
}

/// The fields of a policy as configuration spells them (the builder
/// methods' names).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    #[serde(deserialize_with = "deserialize_duration")]
    ttl: Option<Duration>,
    jitter: Option<f64>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    additive_jitter: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    lock_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    hit_for_miss_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    stale_while_revalidate: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    stale_if_error: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    negative_ttl: Option<Duration>,
    xfetch_beta: Option<f64>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    origin_soft_timeout: Option<Duration>,
    override_origin: Option<bool>,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default, deserialize_with = "deserialize_duration")]
    keep_for_revalidation: Option<Duration>,
}

impl Spec {
    fn builder(self) -> Result<PolicyBuilder, String> {
        let ttl = self.ttl.ok_or("missing field `ttl`")?;
        let mut b = Policy::ttl(ttl);
        if let Some(j) = self.jitter {
            b = b.jitter(j);
        }
        if let Some(j) = self.additive_jitter {
            b = b.additive_jitter(j);
        }
        if let Some(t) = self.lock_timeout {
            b = b.lock_timeout(t);
        }
        if let Some(t) = self.hit_for_miss_ttl {
            b = b.hit_for_miss_ttl(t);
        }
        if let Some(w) = self.stale_while_revalidate {
            b = b.stale_while_revalidate(w);
        }
        if let Some(w) = self.stale_if_error {
            b = b.stale_if_error(w);
        }
        if let Some(t) = self.negative_ttl {
            b = b.negative_ttl(t);
        }
        if let Some(beta) = self.xfetch_beta {
            b = b.xfetch_beta(beta);
        }
        if let Some(t) = self.origin_soft_timeout {
            b = b.origin_soft_timeout(t);
        }
        if let Some(on) = self.override_origin {
            b = b.override_origin(on);
        }
        for tag in self.tags {
            b = b.tag(tag);
        }
        if let Some(w) = self.keep_for_revalidation {
            b = b.keep_for_revalidation(w);
        }
        Ok(b)
    }
}

/// A policy from configuration, validated as [`PolicyBuilder::build`] does.
///
/// ```
/// use std::time::Duration;
/// use tiercache_core::Policy;
///
/// let policy: Policy = serde_json::from_str(r#"{ "ttl": "30s", "jitter": 0.1, "stale_if_error": "5m" }"#)?;
/// assert_eq!(policy.fresh_ttl(), Duration::from_secs(30));
/// assert_eq!(policy.sie_window(), Duration::from_secs(300));
///
/// // The same refusal, in the same words, as the builder's.
/// let err = serde_json::from_str::<Policy>(r#"{ "ttl": "30s", "jitter": 0.7 }"#).unwrap_err();
/// assert!(err.to_string().contains("`jitter` is 0.7, but must be 0.0..=0.5"), "{err}");
/// // Unknown fields are errors, not ignored.
/// assert!(serde_json::from_str::<Policy>(r#"{ "ttl": "30s", "jiter": 0.1 }"#).is_err());
/// # Ok::<(), serde_json::Error>(())
/// ```
impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        PolicyBuilder::deserialize(d)?
            .build()
            .map_err(serde::de::Error::custom)
    }
}

/// A policy draft from configuration (not yet validated: a file's
/// `[defaults]` can be one, completed by a route's fields).
impl<'de> Deserialize<'de> for PolicyBuilder {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Spec::deserialize(d)?
            .builder()
            .map_err(serde::de::Error::custom)
    }
}
