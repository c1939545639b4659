//! Durations (`250ms`, `10s`, `5m`, `1h`) and sizes (`512`, `64KiB`, `8MiB`, `1GiB`) on the command line.

pub use tiercache_core::parse_duration;

/// Parses a byte count: a bare number, or with `KiB`, `MiB`, `GiB`.
///
/// ```
/// assert_eq!(tiercache_proxy::units::parse_size("8MiB"), Ok(8 * 1024 * 1024));
/// assert_eq!(tiercache_proxy::units::parse_size("1000"), Ok(1000));
/// assert!(tiercache_proxy::units::parse_size("8MB").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size: write it as 1000, 64KiB, 8MiB or 1GiB"))?;
    let scale: u64 = match unit {
        "" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("`{text}` has unit `{unit}`; use KiB, MiB or GiB")),
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}` is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert!(parse_duration("s").is_err());
        assert_eq!(parse_duration("3d"), Ok(Duration::from_secs(3 * 86_400)));
        assert!(
            parse_duration("3w")
                .unwrap_err()
                .contains("ms, s, m, h or d")
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
    }
}
