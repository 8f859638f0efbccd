//! The operator figures as `metrics` gauges, for a process to publish on a schedule.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use inbox_core::metrics::{
    DEAD_LETTERS_PENDING, MAX_FAILURE_GROUP_SERIES, OLDEST_UNPROCESSED_SECONDS, OUTBOX_BACKLOG,
    OUTBOX_DEAD_ROWS, OUTBOX_OLDEST_UNPUBLISHED_SECONDS, RETRIES_DUE,
};

use super::{DeadLetterFilter, FailureGroup, LetterStatus, OperatorStats};
use crate::Result;

/// The label value of the failure groups past the [`MAX_FAILURE_GROUP_SERIES`] largest.
const OTHER_FAILURE_GROUPS: &str = "other";

fn age(now: chrono::DateTime<chrono::Utc>, at: chrono::DateTime<chrono::Utc>) -> f64 {
    (now - at).to_std().unwrap_or(Duration::ZERO).as_secs_f64()
}

/// The labelled series an operator handle set last time, so that a consumer group or a
/// failure group that has vanished since is set back to zero rather than left at its
/// last value.
#[derive(Debug, Default)]
pub(super) struct PublishedSeries {
    groups: BTreeSet<String>,
    /// `(failure_group, reason)`.
    failure_groups: BTreeSet<(String, String)>,
}

/// The pending failure groups as `(failure_group, reason, count)` series: the `max`
/// largest one by one, the others summed per reason under `failure_group="other"`.
fn failure_group_series(groups: &[FailureGroup], max: usize) -> Vec<(String, String, u64)> {
    let mut largest: Vec<&FailureGroup> = groups.iter().collect();
    // Largest first; ties by fingerprint, so the cut is the same on every scrape.
    largest.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then(a.fingerprint.cmp(&b.fingerprint))
    });
    let mut series: Vec<(String, String, u64)> = Vec::new();
    for (i, g) in largest.into_iter().enumerate() {
        if i < max {
            series.push((g.fingerprint.clone(), g.reason.as_str().to_owned(), g.count));
            continue;
        }
        match series
            .iter_mut()
            .find(|(fg, reason, _)| fg == OTHER_FAILURE_GROUPS && reason == g.reason.as_str())
        {
            Some((_, _, n)) => *n += g.count,
            None => series.push((
                OTHER_FAILURE_GROUPS.to_owned(),
                g.reason.as_str().to_owned(),
                g.count,
            )),
        }
    }
    series
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
    ///   failure group, for the [`MAX_FAILURE_GROUP_SERIES`] largest groups; the others
    ///   are summed per reason under `failure_group="other"`.
    ///
    /// A series this handle (or a clone of it) set before whose subject has vanished
    /// since (a consumer group no longer in the stats, a failure group with no pending
    /// letter left) is set to 0: keep one handle to publish with.
    ///
    /// Replays and redrives are counted as they happen: the counter
    /// `inbox_replays_total{kind="replay"|"redrive"}`.
    pub fn publish_operator_gauges(&self) -> Result<OperatorStats> {
        let stats = self.operator_stats()?;
        let groups =
            self.failure_groups(&DeadLetterFilter::default().status(LetterStatus::Pending))?;
        let now = stats.at;
        metrics::gauge!(OUTBOX_BACKLOG).set(stats.outbox_backlog as f64);
        metrics::gauge!(OUTBOX_OLDEST_UNPUBLISHED_SECONDS).set(
            stats
                .oldest_unpublished_age
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        metrics::gauge!(OUTBOX_DEAD_ROWS).set(stats.dead_outbox_rows as f64);
        let mut published = PublishedSeries::default();
        for g in &stats.groups {
            let group = g.consumer_group.clone();
            metrics::gauge!(OLDEST_UNPROCESSED_SECONDS, "group" => group.clone())
                .set(g.oldest_unprocessed_at.map_or(0.0, |at| age(now, at)));
            metrics::gauge!(RETRIES_DUE, "group" => group.clone()).set(g.retries_due as f64);
            published.groups.insert(group);
        }
        for (failure_group, reason, count) in
            failure_group_series(&groups, MAX_FAILURE_GROUP_SERIES)
        {
            metrics::gauge!(
                DEAD_LETTERS_PENDING,
                "failure_group" => failure_group.clone(),
                "reason" => reason.clone()
            )
            .set(count as f64);
            published.failure_groups.insert((failure_group, reason));
        }
        let mut last = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for group in last.groups.difference(&published.groups) {
            metrics::gauge!(OLDEST_UNPROCESSED_SECONDS, "group" => group.clone()).set(0.0);
            metrics::gauge!(RETRIES_DUE, "group" => group.clone()).set(0.0);
        }
        for (failure_group, reason) in last.failure_groups.difference(&published.failure_groups) {
            metrics::gauge!(
                DEAD_LETTERS_PENDING,
                "failure_group" => failure_group.clone(),
                "reason" => reason.clone()
            )
            .set(0.0);
        }
        *last = published;
        Ok(stats)
    }
}

/// The memory of the series set, shared by an operator handle's clones.
pub(super) type Published = std::sync::Arc<Mutex<PublishedSeries>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn group(fingerprint: &str, reason: &str, count: u64) -> FailureGroup {
        FailureGroup {
            fingerprint: fingerprint.to_owned(),
            replayable: true,
            reason: inbox_core::DeadLetterReason::parse(reason).expect("a reason"),
            message_type: "usage.recorded".to_owned(),
            kind: "permanent".to_owned(),
            signature: String::new(),
            count,
            consumer_groups: Vec::new(),
            first_seen: chrono::DateTime::UNIX_EPOCH,
            last_seen: chrono::DateTime::UNIX_EPOCH,
            sample_error: None,
        }
    }

    #[test]
    fn failure_groups_past_the_bound_are_summed_per_reason_as_other() {
        let groups = [
            group("aa", "permanent", 1),
            group("bb", "permanent", 5),
            group("cc", "max_attempts", 3),
            group("dd", "permanent", 2),
            group("ee", "max_attempts", 1),
        ];
        let series = failure_group_series(&groups, 2);
        let s = |fg: &str, r: &str, n: u64| (fg.to_owned(), r.to_owned(), n);
        assert_eq!(
            series,
            [
                s("bb", "permanent", 5),
                s("cc", "max_attempts", 3),
                s("other", "permanent", 3),
                s("other", "max_attempts", 1),
            ]
        );
        assert_eq!(failure_group_series(&groups, 10).len(), 5);
    }
}
