//! Durations like `"500ms"` and the rules of a retry policy, checked at compile time.
//!
//! The rules are those of `inbox_core::RetryPolicy::new` and the defaults those of
//! `RetryPolicy::default()`; this crate cannot call inbox-core (inbox-core depends on
//! it), so the tests below check that the two agree.

use std::fmt;
use std::time::Duration;

/// `RetryPolicy::default().max_attempts()`.
pub(crate) const DEFAULT_MAX_ATTEMPTS: u32 = 8;
/// `RetryPolicy::default().initial()`.
pub(crate) const DEFAULT_INITIAL: Duration = Duration::from_secs(1);
/// `RetryPolicy::default().max()`.
pub(crate) const DEFAULT_MAX: Duration = Duration::from_secs(300);

/// `inbox_core::MAX_RETRY_DELAY`: the longest delay a policy may have (a year).
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// What is wrong with a retry policy's settings.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PolicyProblem {
    /// `max_attempts` is 0.
    NoAttempts,
    /// The initial backoff is zero.
    ZeroInitial,
    /// The initial backoff is longer than the max.
    InitialAboveMax,
    /// The max backoff is longer than [`MAX_DELAY`].
    MaxAboveCap,
}

/// Every rule `RetryPolicy::new` would reject these settings by (all of them, so
/// the user sees every problem in one build).
pub(crate) fn policy_problems(
    max_attempts: u32,
    initial: Duration,
    max: Duration,
) -> Vec<PolicyProblem> {
    let mut problems = Vec::new();
    if max_attempts == 0 {
        problems.push(PolicyProblem::NoAttempts);
    }
    if initial.is_zero() {
        problems.push(PolicyProblem::ZeroInitial);
    }
    if initial > max {
        problems.push(PolicyProblem::InitialAboveMax);
    }
    if max > MAX_DELAY {
        problems.push(PolicyProblem::MaxAboveCap);
    }
    problems
}

/// Parses a whole number followed by a unit: `ms`, `s`, `m` or `h` (`"250ms"`,
/// `"1s"`, `"5m"`, `"1h"`).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let expected = || {
        format!(
            "cannot parse {text:?} as a duration: expected a whole number and a unit \
             (ms, s, m or h), like \"500ms\", \"1s\", \"5m\" or \"1h\""
        )
    };
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err(expected());
    }
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(expected()),
    };
    let too_long = || format!("duration {text:?} is too long");
    let count: u64 = digits.parse().map_err(|_| too_long())?;
    let millis = count.checked_mul(millis_per_unit).ok_or_else(too_long)?;
    Ok(Duration::from_millis(millis))
}

/// Shows a duration the way users write it (`1h`, `5m`, `1s`, `250ms`).
pub(crate) struct Shown(pub(crate) Duration);

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms == 0 {
            write!(f, "0ms")
        } else if ms.is_multiple_of(3_600_000) {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1_000) {
            write!(f, "{}s", ms / 1_000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_core::RetryPolicy;

    #[test]
    fn parses_the_four_units() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("2ms"), Duration::from_millis(2));
        assert_eq!(ok("1s"), Duration::from_secs(1));
        assert_eq!(ok("5m"), Duration::from_secs(300));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok("0010s"), Duration::from_secs(10));
    }

    #[test]
    fn rejects_anything_else() {
        for bad in [
            "", "s", "1", "1 s", " 1s", "1.5s", "-1s", "1d", "1sec", "1S", "1ms2", "1m30s",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.starts_with("cannot parse"), "{bad:?}: {err}");
        }
        let err = parse_duration("99999999999999999999h").unwrap_err();
        assert_eq!(err, "duration \"99999999999999999999h\" is too long");
        assert!(parse_duration("18446744073709551615h").is_err());
    }

    #[test]
    fn shows_durations_as_written() {
        let shown = |d| Shown(d).to_string();
        assert_eq!(shown(Duration::from_secs(7200)), "2h");
        assert_eq!(shown(Duration::from_secs(300)), "5m");
        assert_eq!(shown(Duration::from_secs(90)), "90s");
        assert_eq!(shown(Duration::from_millis(1500)), "1500ms");
        assert_eq!(shown(Duration::ZERO), "0ms");
    }

    #[test]
    fn defaults_are_retry_policy_defaults() {
        let default = RetryPolicy::default();
        assert_eq!(default.max_attempts(), DEFAULT_MAX_ATTEMPTS);
        assert_eq!(default.initial(), DEFAULT_INITIAL);
        assert_eq!(default.max(), DEFAULT_MAX);
    }

    /// The derive's generated code relies on this: whatever it accepts at compile
    /// time, `RetryPolicy::new` accepts at run time, and the other way round.
    #[test]
    fn rules_agree_with_retry_policy_new() {
        let durations = [0, 1, 2, 999, 1_000, 60_000, 300_000, 3_600_000]
            .map(Duration::from_millis)
            .into_iter()
            .chain([
                Duration::from_nanos(1),
                MAX_DELAY,
                MAX_DELAY + Duration::from_secs(1),
                Duration::MAX,
            ]);
        let durations: Vec<Duration> = durations.collect();
        for max_attempts in [0, 1, 2, 8, u32::MAX] {
            for &initial in &durations {
                for &max in &durations {
                    let derive_accepts = policy_problems(max_attempts, initial, max).is_empty();
                    let core_accepts = RetryPolicy::new(max_attempts, initial, max).is_ok();
                    assert_eq!(
                        derive_accepts, core_accepts,
                        "max_attempts {max_attempts}, initial {initial:?}, max {max:?}"
                    );
                }
            }
        }
    }
}
