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

impl RetryPolicy {
    /// A policy of at most `max_attempts` tries with backoff from `initial` to `max`.
    ///
    /// Rejects `max_attempts` of 0, a zero `initial` delay, and `initial > max`.
    pub fn new(max_attempts: u32, initial: Duration, max: Duration) -> Result<Self, Error> {
        if max_attempts == 0 {
            return Err(Error::InvalidRetryPolicy(
                "max_attempts must be at least 1, found 0".to_owned(),
            ));
        }
        if initial.is_zero() {
            return Err(Error::InvalidRetryPolicy(
                "initial backoff must be greater than zero".to_owned(),
            ));
        }
        if initial > max {
            return Err(Error::InvalidRetryPolicy(format!(
                "initial backoff ({initial:?}) must not exceed max backoff ({max:?})"
            )));
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
        let shift = attempts.saturating_sub(1).min(63);
        let factor = 1u64 << shift;
        let nanos = self.initial.as_nanos().saturating_mul(u128::from(factor));
        if nanos >= self.max.as_nanos() {
            self.max
        } else {
            // nanos < max, which fits in a Duration.
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }
    }

    /// Whether `attempts` failures use up the policy.
    pub fn is_exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
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
    fn rejects_invalid_settings() {
        let s = Duration::from_secs(1);
        assert!(RetryPolicy::new(0, s, s).is_err());
        assert!(RetryPolicy::new(1, Duration::ZERO, s).is_err());
        let err = RetryPolicy::new(3, 2 * s, s).unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid retry policy: initial backoff (2s) must not exceed max backoff (1s)"
        );
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
