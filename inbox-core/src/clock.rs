use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};

/// The source of every "now" the framework uses.
///
/// Stores bind the clock's time into SQL as a parameter (never `now()` in SQL), so a
/// test that drives a [`ManualClock`] controls retry times exactly.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time, truncated to microseconds (the database's precision).
    fn now(&self) -> DateTime<Utc>;

    /// Waits for `duration`. A manual clock advances itself instead.
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

/// Truncates to whole microseconds, so values read back from a database compare equal.
pub(crate) fn to_micros(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(TimeDelta::microseconds(1)).unwrap_or(t)
}

/// Converts a `std` duration to chrono's, saturating.
pub fn delta(d: Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}

/// The earliest time the stores write or compare: 0001-01-01T00:00:00Z. PostgreSQL's
/// `timestamptz` ends at 4713 BC, and SQLite compares times as text, which orders
/// four-digit years only.
pub const EARLIEST_STORED_TIME: DateTime<Utc> = match DateTime::from_timestamp(-62_135_596_800, 0) {
    Some(t) => t,
    None => DateTime::<Utc>::MIN_UTC,
};

/// The latest time the stores write or compare: 9999-12-31T23:59:59.999999Z (see
/// [`EARLIEST_STORED_TIME`]). A lease or a retry that would end later ends here: for
/// ever, as far as the stores can tell.
pub const LATEST_STORED_TIME: DateTime<Utc> =
    match DateTime::from_timestamp(253_402_300_799, 999_999_000) {
        Some(t) => t,
        None => DateTime::<Utc>::MAX_UTC,
    };

/// `now` minus `window`, saturating at [`EARLIEST_STORED_TIME`] (and at most
/// [`LATEST_STORED_TIME`]): the start of a window a user sets (a retention, "overdue
/// for", "since 2d ago"). A window reaching before year 1 starts at year 1, which no
/// stored row precedes: "keep for ever" is a window of 10,000 years, or
/// `Duration::MAX`.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::{earlier_by, EARLIEST_STORED_TIME};
/// let now = "2026-12-01T00:00:00Z".parse().unwrap();
/// let day = earlier_by(now, Duration::from_secs(86_400));
/// assert_eq!(day.to_rfc3339(), "2026-11-30T00:00:00+00:00");
/// let ten_thousand_years = Duration::from_secs(10_000 * 366 * 86_400);
/// assert_eq!(earlier_by(now, ten_thousand_years), EARLIEST_STORED_TIME);
/// assert_eq!(earlier_by(now, Duration::MAX), EARLIEST_STORED_TIME);
/// ```
pub fn earlier_by(now: DateTime<Utc>, window: Duration) -> DateTime<Utc> {
    now.checked_sub_signed(delta(window))
        .map_or(EARLIEST_STORED_TIME, stored_time)
}

/// `now` plus `delay`, saturating at [`LATEST_STORED_TIME`] (and at least
/// [`EARLIEST_STORED_TIME`]): the end of a lease or of a retry's wait.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::{later_by, LATEST_STORED_TIME};
/// let now = "2026-12-01T00:00:00Z".parse().unwrap();
/// assert_eq!(later_by(now, Duration::from_secs(60)).to_rfc3339(), "2026-12-01T00:01:00+00:00");
/// assert_eq!(later_by(now, Duration::MAX), LATEST_STORED_TIME);
/// ```
pub fn later_by(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    now.checked_add_signed(delta(delay))
        .map_or(LATEST_STORED_TIME, stored_time)
}

/// `t` within [`EARLIEST_STORED_TIME`]..=[`LATEST_STORED_TIME`].
pub fn stored_time(t: DateTime<Utc>) -> DateTime<Utc> {
    t.clamp(EARLIEST_STORED_TIME, LATEST_STORED_TIME)
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        to_micros(Utc::now())
    }
}

/// A clock that moves only when told to; cloning shares the time.
///
/// ```
/// use std::time::Duration;
/// use inbox_core::{Clock, ManualClock};
/// let clock = ManualClock::new("2026-01-01T00:00:00Z".parse().unwrap());
/// let before = clock.now();
/// clock.advance(Duration::from_secs(5));
/// assert_eq!((clock.now() - before).num_seconds(), 5);
/// ```
#[derive(Clone, Debug)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self(Arc::new(Mutex::new(to_micros(start))))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let mut now = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        *now = to_micros(*now + delta(by));
    }

    /// Sets the clock.
    pub fn set(&self, to: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = to_micros(to);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sleep(&self, duration: Duration) {
        self.advance(duration);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stored_range_is_year_1_to_9999() {
        assert_eq!(
            EARLIEST_STORED_TIME.to_rfc3339(),
            "0001-01-01T00:00:00+00:00"
        );
        assert_eq!(
            LATEST_STORED_TIME.to_rfc3339(),
            "9999-12-31T23:59:59.999999+00:00"
        );
    }

    #[test]
    fn windows_and_delays_saturate_at_the_stored_range() {
        let now: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().unwrap_or_default();
        let s = Duration::from_secs;
        assert_eq!(earlier_by(now, Duration::ZERO), now);
        assert_eq!(earlier_by(now, s(1)), now - TimeDelta::seconds(1));
        assert_eq!(later_by(now, Duration::ZERO), now);
        assert_eq!(later_by(now, s(1)), now + TimeDelta::seconds(1));
        let years = |n: u64| s(n * 366 * 86_400);
        for window in [years(2026), years(10_000), years(300_000), Duration::MAX] {
            assert_eq!(earlier_by(now, window), EARLIEST_STORED_TIME, "{window:?}");
        }
        for delay in [years(7_974), years(10_000), years(300_000), Duration::MAX] {
            assert_eq!(later_by(now, delay), LATEST_STORED_TIME, "{delay:?}");
        }
        // A clock beyond the range is brought back into it.
        assert_eq!(
            earlier_by(DateTime::<Utc>::MAX_UTC, s(1)),
            LATEST_STORED_TIME
        );
        assert_eq!(
            later_by(DateTime::<Utc>::MIN_UTC, s(1)),
            EARLIEST_STORED_TIME
        );
    }
}
