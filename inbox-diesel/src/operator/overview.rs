//! The overview: what an on-call engineer looks at first, per consumer group and for
//! the outbox, read without scanning every claim.
//!
//! [`Operator::operator_stats`] counts every claim by status (a scan of the whole
//! table: seconds on ten million claims); the overview reads only what indexes give
//! cheaply: the [activity](Operator::activity) (bounded range reads of the done claims
//! and the letters), the failed claims per group and the due ones (the failed claims'
//! partial index: as many entries as claims wait for a retry), the halted groups, and
//! the outbox's backlog, oldest unpublished row and dead rows (its partial indexes).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{Activity, ActivityQuery, Count, HaltedGroup, Operator, OperatorConnection};
use crate::Result;

/// One consumer group at a glance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GroupOverview {
    /// The consumer group.
    pub consumer_group: String,
    /// Whether it is halted (see [`Overview::halted`] for the cause).
    pub halted: bool,
    /// Messages that reached `done` in the last hour and day (bounded counts).
    pub processed_last_hour: Count,
    /// See `processed_last_hour`.
    pub processed_last_day: Count,
    /// Messages dead-lettered in the last hour and day (bounded counts).
    pub dead_lettered_last_hour: Count,
    /// See `dead_lettered_last_hour`.
    pub dead_lettered_last_day: Count,
    /// Failed claims waiting for their retry's time.
    pub retries_waiting: u64,
    /// Failed claims whose retry is due.
    pub retries_due: u64,
}

/// The overview of a store (its JSON: [`json::overview`](super::json::overview)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Overview {
    /// When it was read (the store's clock).
    pub at: DateTime<Utc>,
    /// Every group with claims, letters, retries or a halt, by name.
    pub groups: Vec<GroupOverview>,
    /// The halted groups with their cause.
    pub halted: Vec<HaltedGroup>,
    /// Unpublished outbox rows (not dead).
    pub outbox_backlog: u64,
    /// The age of the oldest unpublished row, in seconds.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Dead outbox rows.
    pub dead_outbox_rows: u64,
    /// The activity per interval the groups' figures come from (the chart's bars).
    pub activity: Activity,
}

/// The outbox at a glance, read by its partial indexes.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct OutboxSummary {
    /// Unpublished outbox rows (not dead).
    pub backlog: u64,
    /// The age of the oldest unpublished row, in seconds.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Dead outbox rows.
    pub dead: u64,
}

impl<C: OperatorConnection> Operator<C> {
    /// The outbox's backlog, its oldest unpublished row's age and its dead rows,
    /// each read by an index.
    pub fn outbox_summary(&self) -> Result<OutboxSummary> {
        let now = self.clock().now();
        let mut conn = self.connection()?;
        let raw = C::op_overview(&mut conn, now)?;
        Ok(OutboxSummary {
            backlog: u64::try_from(raw.backlog).unwrap_or(0),
            oldest_unpublished_age_seconds: raw
                .oldest_unpublished
                .map(|at| (now - at).to_std().unwrap_or(Duration::ZERO).as_secs_f64()),
            dead: u64::try_from(raw.dead_outbox).unwrap_or(0),
        })
    }

    /// The overview: per group its bounded activity counts, its retries and whether
    /// it is halted; the outbox's backlog, oldest row and dead rows. Every figure is
    /// read by an index; `query` is the activity's window (see
    /// [`activity`](Self::activity), whose errors it returns).
    pub fn overview(&self, query: &ActivityQuery) -> Result<Overview> {
        let activity = self.activity(query)?;
        let halted = self.list_halted_groups()?;
        let now = activity.at;
        let raw = {
            let mut conn = self.connection()?;
            C::op_overview(&mut conn, now)?
        };
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        let zero = Count::new(0, false);
        let mut groups: BTreeMap<String, GroupOverview> = BTreeMap::new();
        let mut entry = |name: &str| {
            groups
                .entry(name.to_owned())
                .or_insert_with(|| GroupOverview {
                    consumer_group: name.to_owned(),
                    halted: false,
                    processed_last_hour: zero,
                    processed_last_day: zero,
                    dead_lettered_last_hour: zero,
                    dead_lettered_last_day: zero,
                    retries_waiting: 0,
                    retries_due: 0,
                })
                .consumer_group
                .clone()
        };
        for g in &activity.groups {
            entry(&g.consumer_group);
        }
        for (g, _) in &raw.failed {
            entry(g);
        }
        for h in &halted {
            entry(&h.consumer_group);
        }
        for g in &activity.groups {
            if let Some(o) = groups.get_mut(&g.consumer_group) {
                o.processed_last_hour = g.processed_last_hour;
                o.processed_last_day = g.processed_last_day;
                o.dead_lettered_last_hour = g.dead_lettered_last_hour;
                o.dead_lettered_last_day = g.dead_lettered_last_day;
            }
        }
        for (g, n) in &raw.due {
            if let Some(o) = groups.get_mut(g) {
                o.retries_due = count(*n);
            }
        }
        for (g, n) in &raw.failed {
            if let Some(o) = groups.get_mut(g) {
                o.retries_waiting = count(*n).saturating_sub(o.retries_due);
            }
        }
        for h in &halted {
            if let Some(o) = groups.get_mut(&h.consumer_group) {
                o.halted = true;
            }
        }
        Ok(Overview {
            at: now,
            groups: groups.into_values().collect(),
            halted,
            outbox_backlog: count(raw.backlog),
            oldest_unpublished_age_seconds: raw
                .oldest_unpublished
                .map(|at| (now - at).to_std().unwrap_or(Duration::ZERO).as_secs_f64()),
            dead_outbox_rows: count(raw.dead_outbox),
            activity,
        })
    }
}
