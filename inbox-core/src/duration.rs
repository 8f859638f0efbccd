//! Durations as operators write them: `50ms`, `10s`, `5m`, `2h`, `7d`, and retry
//! ladders as lists of them (`50ms,200ms`).

use std::time::Duration;

use crate::{Error, RetryLadder};

/// The longest timeout PostgreSQL takes for `statement_timeout`, `lock_timeout` and
/// `idle_in_transaction_session_timeout`: 2^31 - 1 ms (about 24.8 days). The store
/// (inbox-diesel's `StoreBuilder`) refuses a longer `batch_deadline` or
/// `statement_timeout` when it is built; a rebuild's `lock_timeout` saturates to it.
pub const MAX_DATABASE_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// A timeout as PostgreSQL's settings take it: whole milliseconds, at least 1 (0 would
/// turn the timeout off) and at most [`MAX_DATABASE_TIMEOUT`].
///
/// ```
/// use std::time::Duration;
/// use inbox_core::database_timeout;
/// assert_eq!(database_timeout(Duration::ZERO), 1);
/// assert_eq!(database_timeout(Duration::from_millis(200)), 200);
/// assert_eq!(database_timeout(Duration::MAX), 2_147_483_647);
/// ```
pub fn database_timeout(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1)
}

/// Parses a whole number followed by a unit: `ms`, `s`, `m`, `h` or `d`.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::parse_duration;
/// assert_eq!(parse_duration("50ms").unwrap(), Duration::from_millis(50));
/// assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
/// assert!(matches!(
///     parse_duration("5"),
///     Err(inbox_core::Error::InvalidDuration { .. })
/// ));
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, Error> {
    let text = text.trim();
    let invalid = || Error::InvalidDuration {
        expected: "a whole number with a unit: 50ms, 10s, 5m, 2h or 7d",
        found: text.to_owned(),
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
        assert_eq!(
            parse_duration("18446744073709551615ms").unwrap(),
            Duration::from_millis(u64::MAX)
        );
        assert!(parse_duration("18446744073709551616ms").is_err());
        assert!(parse_ladder("50ms,,200ms").is_ok());
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn database_timeouts_are_whole_milliseconds_within_what_postgres_takes() {
        let ms = Duration::from_millis;
        assert_eq!(database_timeout(Duration::ZERO), 1);
        assert_eq!(database_timeout(Duration::from_micros(1)), 1);
        assert_eq!(database_timeout(ms(1)), 1);
        assert_eq!(database_timeout(MAX_DATABASE_TIMEOUT), i32::MAX);
        assert_eq!(database_timeout(ms(1 << 31)), i32::MAX);
        assert_eq!(database_timeout(Duration::MAX), i32::MAX);
    }
}
