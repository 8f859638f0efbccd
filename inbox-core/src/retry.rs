use std::time::Duration;

use crate::Error;

/// How often a failing message is tried and how long to wait between tries.
///
/// Exponential backoff: the delay after the n-th failure is `initial * 2^(n-1)`,
/// capped at `max`. After `max_attempts` failures the message is dead-lettered.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::RetryPolicy;
/// let p = RetryPolicy::new(4, Duration::from_secs(1), Duration::from_secs(3))?;
/// assert_eq!(p.delay_after(1), Duration::from_secs(1));
/// assert_eq!(p.delay_after(2), Duration::from_secs(2));
/// assert_eq!(p.delay_after(3), Duration::from_secs(3));
/// assert!(p.is_exhausted(4));
/// # Ok::<(), inbox_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial: Duration,
    max: Duration,
}

/// The longest retry delay the framework waits (a year): a longer one would overflow
/// the clock arithmetic of a store or a transport. [`RetryPolicy::new`] and
/// [`RetryLadder::new`] refuse more; [`HandlerError::retry_after`](crate::HandlerError::retry_after)
/// saturates to it.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

impl RetryPolicy {
    /// A policy of at most `max_attempts` tries with backoff from `initial` to `max`.
    ///
    /// Rejects `max_attempts` of 0, a zero `initial` delay, `initial > max`, and a
    /// `max` above [`MAX_RETRY_DELAY`].
    pub fn new(max_attempts: u32, initial: Duration, max: Duration) -> Result<Self, Error> {
        if max_attempts == 0 {
            return Err(Error::InvalidRetryPolicy {
                setting: "max_attempts",
                expected: "at least 1",
                found: "0".to_owned(),
            });
        }
        if initial.is_zero() {
            return Err(Error::InvalidRetryPolicy {
                setting: "initial",
                expected: "greater than zero",
                found: format!("{initial:?}"),
            });
        }
        if initial > max {
            return Err(Error::InvalidRetryPolicy {
                setting: "initial",
                expected: "at most max",
                found: format!("{initial:?} with max {max:?}"),
            });
        }
        if max > MAX_RETRY_DELAY {
            return Err(Error::InvalidRetryPolicy {
                setting: "max",
                expected: "365 days or less",
                found: format!("{max:?}"),
            });
        }
        Ok(Self {
            max_attempts,
            initial,
            max,
        })
    }

    /// The most tries a message gets.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The first delay.
    pub fn initial(&self) -> Duration {
        self.initial
    }

    /// The longest delay.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The delay after the `attempts`-th failure (1-based).
    pub fn delay_after(&self, attempts: u32) -> Duration {
        exponential_backoff(self.initial, attempts.saturating_sub(1), self.max)
    }

    /// Whether `attempts` failures use up the policy.
    pub fn is_exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
    }
}

/// The framework's one backoff formula: `first * 2^doublings`, at most `cap` (no
/// overflow for any input). Retry policies, outbox rows and reconnects all wait by it.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::exponential_backoff;
/// let s = Duration::from_secs(1);
/// assert_eq!(exponential_backoff(s, 0, 60 * s), s);
/// assert_eq!(exponential_backoff(s, 3, 60 * s), 8 * s);
/// assert_eq!(exponential_backoff(s, 99, 60 * s), 60 * s);
/// ```
pub fn exponential_backoff(first: Duration, doublings: u32, cap: Duration) -> Duration {
    let factor = 1u128 << doublings.min(127);
    let nanos = first.as_nanos().saturating_mul(factor);
    if nanos >= cap.as_nanos() {
        cap
    } else {
        // nanos < cap, which fits in a Duration.
        Duration::new(
            u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX),
            u32::try_from(nanos % 1_000_000_000).unwrap_or(0),
        )
    }
}

impl Default for RetryPolicy {
    /// 8 attempts, 1 s to 5 min.
    fn default() -> Self {
        Self {
            max_attempts: 8,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_delays_past_the_cap() {
        let s = Duration::from_secs(1);
        assert!(RetryPolicy::new(3, s, MAX_RETRY_DELAY).is_ok());
        assert!(matches!(
            RetryPolicy::new(3, s, Duration::MAX),
            Err(Error::InvalidRetryPolicy { setting: "max", .. })
        ));
        assert!(matches!(
            RetryLadder::new([s, MAX_RETRY_DELAY + s]),
            Err(Error::InvalidRetryPolicy {
                setting: "tiers",
                ..
            })
        ));
        let policy = RetryPolicy::new(64, s, MAX_RETRY_DELAY).unwrap_or_default();
        assert_eq!(policy.delay_after(64), MAX_RETRY_DELAY);
    }

    #[test]
    fn rejects_invalid_settings() {
        let s = Duration::from_secs(1);
        assert!(RetryPolicy::new(0, s, s).is_err());
        assert!(RetryPolicy::new(1, Duration::ZERO, s).is_err());
        let err = RetryPolicy::new(3, 2 * s, s).unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid retry policy: initial must be at most max, found 2s with max 1s"
        );
    }

    #[test]
    fn the_backoff_formula_doubles_caps_and_never_overflows() {
        let s = Duration::from_secs(1);
        let delays: Vec<_> = (0..5).map(|n| exponential_backoff(s, n, 10 * s)).collect();
        assert_eq!(delays, [s, 2 * s, 4 * s, 8 * s, 10 * s]);
        assert_eq!(
            exponential_backoff(s, u32::MAX, Duration::MAX),
            Duration::MAX
        );
        assert_eq!(exponential_backoff(Duration::MAX, 1, s), s);
        let tiny = Duration::from_nanos(1);
        assert_eq!(
            exponential_backoff(tiny, 40, Duration::MAX),
            tiny * (1 << 20) * (1 << 20)
        );
        assert_eq!(exponential_backoff(Duration::ZERO, 5, s), Duration::ZERO);
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = RetryPolicy::new(10, Duration::from_millis(100), Duration::from_secs(1)).unwrap();
        let delays: Vec<_> = (1..=6).map(|n| p.delay_after(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.delay_after(u32::MAX), Duration::from_secs(1));
        assert!(!p.is_exhausted(9));
        assert!(p.is_exhausted(10));
    }
}

/// The fixed delays a transport can wait out (a broker's retry-tier queues).
///
/// A retry waits in the smallest tier not shorter than the delay it asks for; a
/// delay longer than every tier waits in the longest. A store given the ladder records
/// the delay actually used in `next_attempt_at`.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::RetryLadder;
/// let ladder = RetryLadder::new([Duration::from_secs(1), Duration::from_secs(30)])?;
/// assert_eq!(ladder.tier_for(Duration::from_millis(1500)), Duration::from_secs(30));
/// assert_eq!(ladder.tier_for(Duration::from_secs(600)), Duration::from_secs(30));
/// assert_eq!(RetryLadder::label(Duration::from_millis(50)), "50ms");
/// # Ok::<(), inbox_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryLadder(Vec<Duration>);

impl RetryLadder {
    /// A ladder of these delays (sorted, duplicates removed); at least one, none zero,
    /// each a whole number of milliseconds.
    pub fn new(tiers: impl IntoIterator<Item = Duration>) -> Result<Self, Error> {
        let mut tiers: Vec<Duration> = tiers.into_iter().collect();
        tiers.sort_unstable();
        tiers.dedup();
        if tiers.is_empty() {
            return Err(Error::InvalidRetryPolicy {
                setting: "tiers",
                expected: "one tier or more",
                found: "none".to_owned(),
            });
        }
        if let Some(bad) = tiers.iter().find(|d| **d > MAX_RETRY_DELAY) {
            return Err(Error::InvalidRetryPolicy {
                setting: "tiers",
                expected: "each 365 days or less",
                found: format!("{bad:?}"),
            });
        }
        if let Some(bad) = tiers
            .iter()
            .find(|d| d.is_zero() || d.subsec_nanos() % 1_000_000 != 0)
        {
            return Err(Error::InvalidRetryPolicy {
                setting: "tiers",
                expected: "each a whole, non-zero number of milliseconds",
                found: format!("{bad:?}"),
            });
        }
        Ok(Self(tiers))
    }

    /// The tiers, shortest first.
    pub fn tiers(&self) -> &[Duration] {
        &self.0
    }

    /// The tier a retry after `delay` waits in.
    pub fn tier_for(&self, delay: Duration) -> Duration {
        self.0
            .iter()
            .copied()
            .find(|tier| *tier >= delay)
            .or_else(|| self.0.last().copied())
            .unwrap_or(delay)
    }

    /// A short name for a tier: `50ms`, `1s`, `2m`, `1h`.
    pub fn label(tier: Duration) -> String {
        let ms = tier.as_millis();
        if ms.is_multiple_of(3_600_000) {
            format!("{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) {
            format!("{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            format!("{}s", ms / 1000)
        } else {
            format!("{ms}ms")
        }
    }
}

impl Default for RetryLadder {
    /// 1 s, 5 s, 30 s, 2 min, 10 min.
    fn default() -> Self {
        Self(
            [1, 5, 30, 120, 600]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
        )
    }
}

#[cfg(test)]
mod ladder_tests {
    use super::*;

    #[test]
    fn picks_the_smallest_tier_not_shorter() {
        let ms = Duration::from_millis;
        let ladder = RetryLadder::new([ms(200), ms(50), ms(100), ms(50)]).unwrap();
        assert_eq!(ladder.tiers(), [ms(50), ms(100), ms(200)]);
        assert_eq!(ladder.tier_for(ms(1)), ms(50));
        assert_eq!(ladder.tier_for(ms(50)), ms(50));
        assert_eq!(ladder.tier_for(ms(51)), ms(100));
        assert_eq!(ladder.tier_for(ms(5000)), ms(200));
        assert!(RetryLadder::new([]).is_err());
        assert!(RetryLadder::new([Duration::ZERO]).is_err());
        assert!(RetryLadder::new([Duration::from_micros(1500)]).is_err());
        assert_eq!(RetryLadder::label(Duration::from_secs(120)), "2m");
        assert_eq!(RetryLadder::label(Duration::from_millis(1500)), "1500ms");
    }
}
