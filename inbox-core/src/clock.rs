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
