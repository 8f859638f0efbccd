//! The operator figures as `metrics` gauges, for a process to publish on a schedule.

use std::time::Duration;

use super::{DeadLetterFilter, LetterStatus, OperatorStats};
use crate::Result;

fn age(now: chrono::DateTime<chrono::Utc>, at: chrono::DateTime<chrono::Utc>) -> f64 {
    (now - at).to_std().unwrap_or(Duration::ZERO).as_secs_f64()
}

impl<C: super::OperatorConnection> super::Operator<C> {
    /// Reads [`operator_stats`](Self::operator_stats) and the pending failure groups and
    /// sets them as gauges; returns the stats.
    ///
    /// - `inbox_outbox_backlog`: live outbox rows not published yet;
    /// - `inbox_outbox_oldest_unpublished_seconds`: the oldest one's age (0 when none);
    /// - `inbox_outbox_dead_rows`: outbox rows whose last attempt failed;
    /// - `inbox_oldest_unprocessed_seconds{group}`: the age of the group's oldest message
    ///   not processed yet (a failed or started claim; 0 when none);
    /// - `inbox_retries_due{group}`: failed claims whose retry is due;
    /// - `inbox_dead_letters_pending{failure_group, reason}`: pending dead letters per
    ///   failure group.
    ///
    /// Replays and redrives are counted as they happen: the counter
    /// `inbox_replays_total{kind="replay"|"redrive"}`.
    pub fn publish_operator_gauges(&self) -> Result<OperatorStats> {
        let stats = self.operator_stats()?;
        let groups =
            self.failure_groups(&DeadLetterFilter::default().status(LetterStatus::Pending))?;
        let now = stats.at;
        metrics::gauge!("inbox_outbox_backlog").set(stats.outbox_backlog as f64);
        metrics::gauge!("inbox_outbox_oldest_unpublished_seconds").set(
            stats
                .oldest_unpublished_age
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        metrics::gauge!("inbox_outbox_dead_rows").set(stats.dead_outbox_rows as f64);
        for g in &stats.groups {
            let group = g.consumer_group.clone();
            metrics::gauge!("inbox_oldest_unprocessed_seconds", "group" => group.clone())
                .set(g.oldest_unprocessed_at.map_or(0.0, |at| age(now, at)));
            metrics::gauge!("inbox_retries_due", "group" => group).set(g.retries_due as f64);
        }
        for fg in &groups {
            metrics::gauge!(
                "inbox_dead_letters_pending",
                "failure_group" => fg.fingerprint.clone(),
                "reason" => fg.reason.as_str()
            )
            .set(fg.count as f64);
        }
        Ok(stats)
    }
}
