//! Durations as operators write them: `50ms`, `10s`, `5m`, `2h`, `7d`, and retry
//! ladders as lists of them (`50ms,200ms`).

use std::time::Duration;

use crate::{Error, RetryLadder};

/// Parses a whole number followed by a unit: `ms`, `s`, `m`, `h` or `d`.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::parse_duration;
/// assert_eq!(parse_duration("50ms").unwrap(), Duration::from_millis(50));
/// assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
/// assert!(parse_duration("5").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, Error> {
    let text = text.trim();
    let invalid = || {
        Error::InvalidRetryPolicy(format!(
            "expected a duration such as 50ms, 10s, 5m, 2h or 7d, found {text:?}"
        ))
    };
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(invalid)?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| invalid())?;
    let millis = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => None,
    }
    .ok_or_else(invalid)?;
    Ok(Duration::from_millis(millis))
}

/// Parses a retry ladder written as comma-separated durations (`50ms,200ms,1s`).
///
/// ```
/// use std::time::Duration;
/// use inbox_core::parse_ladder;
/// let ladder = parse_ladder("50ms,200ms").unwrap();
/// assert_eq!(ladder.tiers(), [Duration::from_millis(50), Duration::from_millis(200)]);
/// assert!(parse_ladder("").is_err());
/// ```
pub fn parse_ladder(text: &str) -> Result<RetryLadder, Error> {
    let tiers = text
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(parse_duration)
        .collect::<Result<Vec<_>, _>>()?;
    RetryLadder::new(tiers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_refusals() {
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        assert_eq!(
            parse_duration(" 7d ").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        for bad in [
            "",
            "ms",
            "5",
            "5 s",
            "-5s",
            "5.5s",
            "5w",
            "99999999999999999999d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert!(parse_ladder("50ms,0ms").is_err());
        assert!(parse_ladder("50ms,,200ms").is_ok());
    }
}
