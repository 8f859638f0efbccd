//! Activity per consumer group: how many claims reached `done` and how many messages
//! were dead-lettered, per interval of a window ending at the store clock's now, and
//! in the last hour and day ([`Operator::activity`](super::Operator::activity)).
//!
//! # What is counted
//!
//! - **processed**: claims whose status is `done`, by `updated_at` (the time the
//!   claim became done, or was last touched while done: a rebuild's cover). The
//!   retention purge of done claims ([`Retention::done_claims`](crate::Retention))
//!   deletes what it counts: intervals older than the retention count only what is
//!   left, so keep the window inside it.
//! - **dead_lettered**: dead letters by `dead_lettered_at`, whatever happened to them
//!   since (replayed, resolved or discarded; a purge of discarded letters deletes
//!   them).
//!
//! Bucket `k` of `n` (oldest first in [`GroupActivity::buckets`]) is the interval
//! `[now - (n - k) * interval, now - (n - k - 1) * interval)`; the last hour is
//! `[now - 1 h, now)`, the last day `[now - 24 h, now)`. A claim or letter stamped at
//! `now` itself is not counted yet.
//!
//! # The bound
//!
//! The groups are found by a loose index scan ("skip scan": a recursive query that
//! asks the index for the next group name after the last one) over the claims and
//! the dead letters, one index probe per group, never a scan of the rows.
//!
//! Per group, each of the two counts is ONE statement that reads the group's entries
//! of its index (`inbox_claims_done_by_group`, `inbox_dead_letters_by_group`) newest
//! first, from now back to the older of the window's start and a day ago, and stops
//! after `cap` entries (`ORDER BY ... DESC LIMIT cap`); every bucket and the hour and
//! day counts are taken from that one read. So a call reads at most
//! `2 * groups * cap` index entries (plus one probe per group to find them), however
//! many rows the tables hold and however many buckets are asked for. When a read
//! stops at `cap`, the counts whose interval reaches back past the oldest entry it
//! read are lower bounds ([`Count::at_least`]): the true number is that or more
//! (an interval entirely before it says 0, at least).
//!
//! On PostgreSQL the statement buckets the timestamps itself and returns one row per
//! (bucket, in the last hour, in the last day); SQLite returns the timestamps (at
//! most `cap` of them, in process) and they are bucketed here, by the same rule.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;

use crate::{Error, Result};

/// What [`Operator::activity`](super::Operator::activity) counts, and how finely.
///
/// **processed** counts claims whose status is `done` by `updated_at` (the retention
/// purge of done claims deletes what it counts: keep the window inside
/// [`Retention::done_claims`](crate::Retention::done_claims)); **dead_lettered**
/// counts dead letters by `dead_lettered_at`, whatever happened to them since. The
/// window ends at the store clock's now; bucket `k` of `n` (oldest first) is
/// `[now - (n - k) * interval, now - (n - k - 1) * interval)`, the last hour
/// `[now - 1 h, now)`, the last day `[now - 24 h, now)`.
///
/// **The bound.** The groups are found by a loose index scan (one index probe per
/// group). Per group, each of the two counts is one statement reading the group's
/// index entries newest first, back to the older of the window's start and a day ago,
/// stopping after `cap` entries; every bucket and the hour and day counts come from
/// that read. A call reads at most `2 x groups x cap` index entries, however many
/// rows the tables hold and however many buckets are asked for; a count whose
/// interval reaches past the oldest entry a capped read saw is a lower bound
/// ([`Count::at_least`]). Measured on PostgreSQL here: a read that stops at 100,000
/// entries takes about 45 ms (an index-only scan and the bucketing), so a call with
/// the defaults on three busy groups about 140 ms; with more busy groups, lower the
/// cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ActivityQuery {
    /// The length of a bucket: 1 s or more. Default 1 h.
    pub interval: Duration,
    /// How many buckets, ending at now: 1 to [`MAX_ACTIVITY_BUCKETS`]. Default 24.
    pub buckets: u32,
    /// The most index entries one count reads (per group, for processed and for
    /// dead-lettered each): 1 or more. Default 100,000.
    pub cap: u64,
}

/// The most buckets an [`ActivityQuery`] may ask for.
pub const MAX_ACTIVITY_BUCKETS: u32 = 1000;

impl Default for ActivityQuery {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(3600),
            buckets: 24,
            cap: 100_000,
        }
    }
}

impl ActivityQuery {
    /// Buckets of this length.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// This many buckets.
    pub fn buckets(mut self, buckets: u32) -> Self {
        self.buckets = buckets;
        self
    }

    /// At most this many index entries per count.
    pub fn cap(mut self, cap: u64) -> Self {
        self.cap = cap;
        self
    }

    /// Refuses buckets outside 1..=[`MAX_ACTIVITY_BUCKETS`], an interval under 1 s,
    /// a cap of 0, and a window too long for the calendar.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_ACTIVITY_BUCKETS).contains(&self.buckets) {
            return Err(Error::invalid("buckets", "1 to 1000 buckets", self.buckets));
        }
        if self.interval < Duration::from_secs(1) {
            return Err(Error::invalid(
                "interval",
                "an interval of 1 s or more",
                format_args!("{:?}", self.interval),
            ));
        }
        if self.cap == 0 {
            return Err(Error::invalid("cap", "a cap of 1 or more", self.cap));
        }
        let window = self
            .interval
            .checked_mul(self.buckets)
            .and_then(|w| TimeDelta::from_std(w).ok());
        if window.is_none() || i64::try_from(self.interval.as_micros()).is_err() {
            return Err(Error::invalid(
                "interval",
                "an interval whose buckets fit the calendar",
                format_args!("{:?} x {}", self.interval, self.buckets),
            ));
        }
        Ok(())
    }
}

/// A count, and whether it is a lower bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Count {
    /// How many were counted.
    pub count: u64,
    /// The read stopped at the query's cap before reaching the start of this count's
    /// interval: the true number is `count` or more.
    pub at_least: bool,
}

impl Count {
    /// A count.
    pub fn new(count: u64, at_least: bool) -> Self {
        Self { count, at_least }
    }
}

/// One interval of a group's activity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ActivityBucket {
    /// Its start (inclusive); it ends an interval later (exclusive).
    pub start: DateTime<Utc>,
    /// Claims that reached `done` in it.
    pub processed: Count,
    /// Messages dead-lettered in it.
    pub dead_lettered: Count,
}

/// One consumer group's activity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GroupActivity {
    /// The consumer group.
    pub consumer_group: String,
    /// Its buckets, oldest first; the last one ends at [`Activity::at`].
    pub buckets: Vec<ActivityBucket>,
    /// Claims that reached `done` in the last hour.
    pub processed_last_hour: Count,
    /// Claims that reached `done` in the last 24 hours.
    pub processed_last_day: Count,
    /// Messages dead-lettered in the last hour.
    pub dead_lettered_last_hour: Count,
    /// Messages dead-lettered in the last 24 hours.
    pub dead_lettered_last_day: Count,
}

/// The activity of every consumer group with claims or dead letters, by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Activity {
    /// The end of the window: the store clock's now when the counts were read.
    pub at: DateTime<Utc>,
    /// The buckets' length, in seconds (whole seconds: a finer interval is cut).
    pub interval_secs: u64,
    /// Per consumer group, by name.
    pub groups: Vec<GroupActivity>,
}

/// Which of the two counts a read is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tally {
    /// Claims that reached `done`, by `updated_at`.
    Processed,
    /// Dead letters, by `dead_lettered_at`.
    DeadLettered,
}

/// The bounds of one read: entries in `[from, now)`, newest first, at most `cap`.
#[derive(Clone, Copy, Debug)]
pub struct ScanWindow {
    pub now: DateTime<Utc>,
    pub from: DateTime<Utc>,
    pub hour: DateTime<Utc>,
    pub day: DateTime<Utc>,
    pub interval_us: i64,
    pub cap: i64,
}

/// Entries of one read that fell in the same bucket, and in (or out of) the last
/// hour and day.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanRow {
    /// `floor((now - at - 1 µs) / interval)`: 0 is the newest bucket, whose
    /// interval `[now - interval, now)` holds `at`.
    pub bucket: i64,
    pub in_hour: bool,
    pub in_day: bool,
    pub count: i64,
    /// The oldest entry among them.
    pub oldest: DateTime<Utc>,
}

impl ScanWindow {
    pub(crate) fn new(now: DateTime<Utc>, query: &ActivityQuery) -> Self {
        let day = now - TimeDelta::hours(24);
        // validate() proved these fit.
        let interval = TimeDelta::from_std(query.interval).unwrap_or(TimeDelta::MAX);
        let window = interval
            .checked_mul(i32::try_from(query.buckets).unwrap_or(i32::MAX))
            .unwrap_or(TimeDelta::MAX);
        let start = inbox_core::earlier_by(now, window.to_std().unwrap_or(Duration::MAX));
        Self {
            now,
            from: start.min(day),
            hour: now - TimeDelta::hours(1),
            day,
            interval_us: i64::try_from(query.interval.as_micros()).unwrap_or(i64::MAX),
            cap: i64::try_from(query.cap).unwrap_or(i64::MAX),
        }
    }

    /// The rows of a read that returned the timestamps themselves (SQLite), by the
    /// rule PostgreSQL's statement applies.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn tally(&self, times: &[DateTime<Utc>]) -> Vec<ScanRow> {
        let mut rows: Vec<ScanRow> = Vec::new();
        for &at in times {
            let micros = (self.now - at).num_microseconds().unwrap_or(i64::MAX);
            // `at < now`, so `micros >= 1`: bucket k is `now - at` in
            // `(k * interval, (k + 1) * interval]`, `at` in `[start, end)`.
            let bucket = (micros - 1).div_euclid(self.interval_us);
            let (in_hour, in_day) = (at >= self.hour, at >= self.day);
            match rows
                .iter_mut()
                .find(|r| (r.bucket, r.in_hour, r.in_day) == (bucket, in_hour, in_day))
            {
                Some(r) => {
                    r.count += 1;
                    r.oldest = r.oldest.min(at);
                }
                None => rows.push(ScanRow {
                    bucket,
                    in_hour,
                    in_day,
                    count: 1,
                    oldest: at,
                }),
            }
        }
        rows
    }
}

/// One group's read of one tally, summed for any interval.
struct Read {
    rows: Vec<ScanRow>,
    /// The read stopped at the cap.
    capped: bool,
    oldest: Option<DateTime<Utc>>,
}

impl Read {
    fn new(rows: Vec<ScanRow>, cap: i64) -> Self {
        let scanned: i64 = rows.iter().map(|r| r.count).sum();
        Self {
            oldest: rows.iter().map(|r| r.oldest).min(),
            capped: scanned >= cap,
            rows,
        }
    }

    /// Whether every entry at or after `start` was read: the read did not stop at
    /// the cap, or it read an entry older than `start`.
    fn reached(&self, start: DateTime<Utc>) -> bool {
        !self.capped || self.oldest.is_some_and(|o| o < start)
    }

    fn count(&self, start: DateTime<Utc>, pick: impl Fn(&ScanRow) -> bool) -> Count {
        let n: i64 = self.rows.iter().filter(|r| pick(r)).map(|r| r.count).sum();
        Count::new(u64::try_from(n).unwrap_or(0), !self.reached(start))
    }
}

/// A group's activity from its two reads.
pub(crate) fn group_activity(
    consumer_group: String,
    query: &ActivityQuery,
    window: &ScanWindow,
    processed: Vec<ScanRow>,
    dead_lettered: Vec<ScanRow>,
) -> GroupActivity {
    let processed = Read::new(processed, window.cap);
    let dead = Read::new(dead_lettered, window.cap);
    let interval = TimeDelta::microseconds(window.interval_us);
    let buckets = (0..i64::from(query.buckets))
        .rev()
        .map(|k| {
            let start = window.now - interval * i32::try_from(k + 1).unwrap_or(i32::MAX);
            ActivityBucket {
                start,
                processed: processed.count(start, |r| r.bucket == k),
                dead_lettered: dead.count(start, |r| r.bucket == k),
            }
        })
        .collect();
    GroupActivity {
        consumer_group,
        buckets,
        processed_last_hour: processed.count(window.hour, |r| r.in_hour),
        processed_last_day: processed.count(window.day, |r| r.in_day),
        dead_lettered_last_hour: dead.count(window.hour, |r| r.in_hour),
        dead_lettered_last_day: dead.count(window.day, |r| r.in_day),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap()
    }

    #[test]
    fn settings_outside_their_range_are_refused_by_name() {
        let setting = |q: ActivityQuery| match q.validate() {
            Err(Error::InvalidSetting { setting, .. }) => Some(setting),
            _ => None,
        };
        let q = ActivityQuery::default();
        assert_eq!(setting(q), None);
        assert_eq!(setting(q.buckets(0)), Some("buckets"));
        assert_eq!(setting(q.buckets(1001)), Some("buckets"));
        assert_eq!(setting(q.buckets(1000)), None);
        assert_eq!(
            setting(q.interval(Duration::from_millis(999))),
            Some("interval")
        );
        assert_eq!(setting(q.interval(Duration::from_secs(1))), None);
        assert_eq!(setting(q.cap(0)), Some("cap"));
        assert_eq!(
            setting(q.interval(Duration::from_secs(u64::MAX / 2))),
            Some("interval")
        );
    }

    #[test]
    fn buckets_are_half_open_and_the_cap_makes_older_counts_lower_bounds() {
        let q = ActivityQuery::default()
            .interval(Duration::from_secs(60))
            .buckets(3)
            .cap(3);
        let w = ScanWindow::new(now(), &q);
        let at = |secs: i64| now() - TimeDelta::seconds(secs);
        // Newest first, as the read returns them: 1 s and 60 s ago (bucket 0,
        // [now-60, now)), 61 s (bucket 1), 120 s: the cap of 3 stops before it.
        let rows = w.tally(&[at(1), at(60), at(61)]);
        let g = group_activity("g".into(), &q, &w, rows, Vec::new());
        let counts: Vec<(u64, bool)> = g
            .buckets
            .iter()
            .map(|b| (b.processed.count, b.processed.at_least))
            .collect();
        // Oldest first: bucket 2 [now-180, now-120) is beyond the read, bucket 1
        // [now-120, now-60) holds the oldest read entry (61 s) so it may hold more.
        assert_eq!(counts, [(0, true), (1, true), (2, false)]);
        assert_eq!(g.buckets[2].start, at(60));
        assert_eq!(g.processed_last_hour, Count::new(3, true));
        assert_eq!(g.dead_lettered_last_day, Count::new(0, false));
    }
}
