//! The catalog of every metric the inbox crates record through the [`metrics`] facade:
//! one name per quantity, all under `inbox_`, each described once.
//!
//! The crates record; the process chooses the recorder (an exporter such as
//! `metrics-exporter-prometheus`, installed first thing in `main`). Call [`describe`]
//! once after installing it, and every metric gets its unit and one line of help,
//! before it is first recorded:
//!
//! ```
//! // let handle = PrometheusBuilder::new().install_recorder()?;
//! inbox_core::metrics::describe();
//! ```
//!
//! Names follow Prometheus' conventions: counters end in `_total`, durations are
//! `_seconds`, sizes `_bytes`. Every label's values are bounded (see [`Label`]):
//! no message key, tenant or error text is ever a label. The recording crates name the
//! metrics by the constants here, and [`CATALOG`] lists each with its type, unit and
//! labels (the workspace's `docs/metrics.md` is checked against it).

use ::metrics::Unit;

/// What a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// Only goes up (until the process restarts).
    Counter,
    /// A value that is set, up or down.
    Gauge,
    /// Observations (a duration), exported as a histogram or a summary.
    Histogram,
}

impl Kind {
    /// `counter`, `gauge` or `histogram`, as Prometheus names the type.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// A label the inbox metrics carry, and the bound on its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Label {
    /// `group`: a consumer group of the process's handlers (`[a-z0-9._-]`, at most 100
    /// bytes): as many values as the deployment has groups.
    Group,
    /// `reason`: a dead-letter reason, one of [`DeadLetterReason`]'s eight
    /// (`max_attempts`, `permanent`, `decode_error`, `key_collision`, `crash_loop`,
    /// `delivery_limit`, `no_handler`, `malformed`).
    ///
    /// [`DeadLetterReason`]: crate::DeadLetterReason
    Reason,
    /// `kind`: `replay` or `redrive`.
    Kind,
    /// `projection`: a projection name of the process's rebuild hooks.
    Projection,
    /// `outcome`: `ran`, `skipped` or `failed`.
    Outcome,
    /// `failure_group`: the 16-hex-digit fingerprint of a failure group, for the
    /// [`MAX_FAILURE_GROUP_SERIES`] largest pending groups; the rest are summed per
    /// reason under the value `other`.
    FailureGroup,
}

impl Label {
    /// The label's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Group => "group",
            Self::Reason => "reason",
            Self::Kind => "kind",
            Self::Projection => "projection",
            Self::Outcome => "outcome",
            Self::FailureGroup => "failure_group",
        }
    }
}

/// The most failure groups published one by one as `inbox_dead_letters_pending`
/// series; the smaller ones are summed per reason as `failure_group="other"`.
pub const MAX_FAILURE_GROUP_SERIES: usize = 50;

/// One metric of the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metric {
    /// Its name, as exported.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its unit.
    pub unit: Unit,
    /// The labels it carries, every series all of them.
    pub labels: &'static [Label],
    /// One line of help.
    pub help: &'static str,
}

// --- inbox-diesel: the batch (recorded once its transaction committed) ---
/// Deliveries whose handler ran and committed.
pub const PROCESSED_TOTAL: &str = "inbox_processed_total";
/// Deliveries acked without running their handler: done or dead-lettered before.
pub const DUPLICATES_TOTAL: &str = "inbox_duplicates_total";
/// Deliveries whose failure was recorded and that wait for a retry.
pub const RETRIED_TOTAL: &str = "inbox_retried_total";
/// Deliveries whose key was claimed before with another payload.
pub const KEY_COLLISIONS_TOTAL: &str = "inbox_key_collisions_total";
/// Claims the unique index rejected but the lookup could not find.
pub const PHANTOM_CONFLICTS_TOTAL: &str = "inbox_phantom_conflicts_total";
/// Deliveries dead-lettered, by reason.
pub const DEAD_LETTERED_TOTAL: &str = "inbox_dead_lettered_total";
/// Batches rerun after a deadlock or a serialization failure.
pub const BATCH_CONFLICTS_TOTAL: &str = "inbox_batch_conflicts_total";
/// The time a batch's commit took.
pub const BATCH_COMMIT_SECONDS: &str = "inbox_batch_commit_seconds";
// --- inbox-amqp: the consumer ---
/// Consumer connections re-established after a loss.
pub const AMQP_RECONNECTS_TOTAL: &str = "inbox_amqp_reconnects_total";
/// 1 while a consumer group is halted, else 0.
pub const GROUP_HALTED: &str = "inbox_group_halted";
// --- inbox-amqp: the relay ---
/// Relay connections re-established after a loss.
pub const OUTBOX_RELAY_RECONNECTS_TOTAL: &str = "inbox_outbox_relay_reconnects_total";
/// Outbox rows published and confirmed.
pub const OUTBOX_PUBLISHED_TOTAL: &str = "inbox_outbox_published_total";
/// Outbox rows the broker returned as unroutable.
pub const OUTBOX_RETURNED_TOTAL: &str = "inbox_outbox_returned_total";
/// Outbox rows the broker nacked.
pub const OUTBOX_NACKED_TOTAL: &str = "inbox_outbox_nacked_total";
/// Outbox rows the broker refused otherwise (the channel closed over them).
pub const OUTBOX_REJECTED_TOTAL: &str = "inbox_outbox_rejected_total";
/// Outbox rows whose failed publication is retried later.
pub const OUTBOX_RETRIED_TOTAL: &str = "inbox_outbox_retried_total";
/// Outbox rows whose publication failed for the last time.
pub const OUTBOX_DEAD_TOTAL: &str = "inbox_outbox_dead_total";
/// The age of the oldest outbox row not published yet (relay and operator gauges).
pub const OUTBOX_OLDEST_UNPUBLISHED_SECONDS: &str = "inbox_outbox_oldest_unpublished_seconds";
// --- inbox-diesel: the operator's gauges ---
/// Replays and redrives of dead letters.
pub const REPLAYS_TOTAL: &str = "inbox_replays_total";
/// Outbox rows not published yet.
pub const OUTBOX_BACKLOG: &str = "inbox_outbox_backlog";
/// Outbox rows whose last publication failed for good.
pub const OUTBOX_DEAD_ROWS: &str = "inbox_outbox_dead_rows";
/// The age of a group's oldest message not processed yet.
pub const OLDEST_UNPROCESSED_SECONDS: &str = "inbox_oldest_unprocessed_seconds";
/// A group's failed claims whose retry is due.
pub const RETRIES_DUE: &str = "inbox_retries_due";
/// Pending dead letters per failure group.
pub const DEAD_LETTERS_PENDING: &str = "inbox_dead_letters_pending";
// --- inbox-diesel: audits and rebuilds ---
/// Audits run.
pub const AUDIT_RUNS_TOTAL: &str = "inbox_audit_runs_total";
/// Projection rows an audit found differing.
pub const AUDIT_ROWS_DIFFERING_TOTAL: &str = "inbox_audit_rows_differing_total";
/// Rows the last audit or rebuild found differing.
pub const PROJECTION_DRIFT_ROWS: &str = "inbox_projection_drift_rows";
/// The wait for a partition's rebuild lock.
pub const REBUILD_LOCK_WAIT_SECONDS: &str = "inbox_rebuild_lock_wait_seconds";
/// Partitions rebuilt.
pub const REBUILD_PARTITIONS_TOTAL: &str = "inbox_rebuild_partitions_total";
/// Projection rows a rebuild changed.
pub const REBUILD_ROWS_CHANGED_TOTAL: &str = "inbox_rebuild_rows_changed_total";
/// Events a rebuild covered.
pub const REBUILD_EVENTS_COVERED_TOTAL: &str = "inbox_rebuild_events_covered_total";
/// The time a partition's rebuild took.
pub const REBUILD_PARTITION_SECONDS: &str = "inbox_rebuild_partition_seconds";
/// Partitions whose rebuild lock timed out.
pub const REBUILD_LOCK_TIMEOUTS_TOTAL: &str = "inbox_rebuild_lock_timeouts_total";
/// Scheduled rebuild runs, by outcome.
pub const REBUILD_RUNS_TOTAL: &str = "inbox_rebuild_runs_total";
/// The time a scheduled rebuild run took.
pub const REBUILD_RUN_SECONDS: &str = "inbox_rebuild_run_seconds";

const fn metric(
    name: &'static str,
    kind: Kind,
    unit: Unit,
    labels: &'static [Label],
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        unit,
        labels,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram};
use Label::{FailureGroup, Group, Projection, Reason};
use Unit::{Count, Seconds};

/// Every metric the inbox crates record, in the order of `docs/metrics.md`.
pub const CATALOG: &[Metric] = &[
    metric(PROCESSED_TOTAL, Counter, Count, &[Group], "Deliveries whose handler ran and committed."),
    metric(DUPLICATES_TOTAL, Counter, Count, &[Group], "Deliveries acked without running their handler: already done or already dead-lettered."),
    metric(RETRIED_TOTAL, Counter, Count, &[Group], "Deliveries whose failure was recorded and that wait for a retry."),
    metric(DEAD_LETTERED_TOTAL, Counter, Count, &[Group, Reason], "Deliveries dead-lettered, by reason."),
    metric(KEY_COLLISIONS_TOTAL, Counter, Count, &[Group], "Deliveries whose message key was claimed before with another payload (also dead-lettered as key_collision)."),
    metric(PHANTOM_CONFLICTS_TOTAL, Counter, Count, &[Group], "Claims the unique index rejected but the lookup could not find: the group halts."),
    metric(BATCH_CONFLICTS_TOTAL, Counter, Count, &[Group], "Batches rerun after a deadlock or a serialization failure."),
    metric(BATCH_COMMIT_SECONDS, Histogram, Seconds, &[Group], "The time a batch's commit took."),
    metric(AMQP_RECONNECTS_TOTAL, Counter, Count, &[], "Consumer connections to the broker re-established after a loss."),
    metric(GROUP_HALTED, Gauge, Count, &[Group], "1 while the consumer group is halted (an invariant broke), 0 once it runs."),
    metric(OUTBOX_RELAY_RECONNECTS_TOTAL, Counter, Count, &[], "Relay connections to the broker re-established after a loss."),
    metric(OUTBOX_PUBLISHED_TOTAL, Counter, Count, &[], "Outbox rows published, confirmed and marked published."),
    metric(OUTBOX_RETURNED_TOTAL, Counter, Count, &[], "Outbox rows the broker returned as unroutable."),
    metric(OUTBOX_NACKED_TOTAL, Counter, Count, &[], "Outbox rows the broker nacked."),
    metric(OUTBOX_REJECTED_TOTAL, Counter, Count, &[], "Outbox rows that failed otherwise (the channel closed over them, or unreadable)."),
    metric(OUTBOX_RETRIED_TOTAL, Counter, Count, &[], "Outbox rows whose failed publication is retried later."),
    metric(OUTBOX_DEAD_TOTAL, Counter, Count, &[], "Outbox rows whose publication failed for the last time."),
    metric(OUTBOX_OLDEST_UNPUBLISHED_SECONDS, Gauge, Seconds, &[], "The age of the oldest outbox row not published yet (0 when none)."),
    metric(OUTBOX_BACKLOG, Gauge, Count, &[], "Outbox rows not published yet."),
    metric(OUTBOX_DEAD_ROWS, Gauge, Count, &[], "Outbox rows whose last publication failed for good."),
    metric(OLDEST_UNPROCESSED_SECONDS, Gauge, Seconds, &[Group], "The age of the group's oldest message not processed yet (a failed or started claim; 0 when none)."),
    metric(RETRIES_DUE, Gauge, Count, &[Group], "The group's failed claims whose retry is due."),
    metric(DEAD_LETTERS_PENDING, Gauge, Count, &[FailureGroup, Reason], "Pending dead letters of a failure group (0 once none is pending)."),
    metric(REPLAYS_TOTAL, Counter, Count, &[Label::Kind], "Dead letters replayed or claims redriven by an operator."),
    metric(AUDIT_RUNS_TOTAL, Counter, Count, &[Projection], "Projection audits run."),
    metric(AUDIT_ROWS_DIFFERING_TOTAL, Counter, Count, &[Projection], "Projection rows an audit found differing from a rebuild."),
    metric(PROJECTION_DRIFT_ROWS, Gauge, Count, &[Projection], "Rows the last audit or scheduled rebuild found differing."),
    metric(REBUILD_PARTITIONS_TOTAL, Counter, Count, &[Projection], "Projection partitions rebuilt."),
    metric(REBUILD_ROWS_CHANGED_TOTAL, Counter, Count, &[Projection], "Projection rows a rebuild changed."),
    metric(REBUILD_EVENTS_COVERED_TOTAL, Counter, Count, &[Projection], "Events a rebuild covered (their claims recorded as done)."),
    metric(REBUILD_PARTITION_SECONDS, Histogram, Seconds, &[Projection], "The time a partition's rebuild took."),
    metric(REBUILD_LOCK_WAIT_SECONDS, Histogram, Seconds, &[Projection], "The wait for a partition's rebuild lock."),
    metric(REBUILD_LOCK_TIMEOUTS_TOTAL, Counter, Count, &[Projection], "Partition rebuilds whose lock wait timed out."),
    metric(REBUILD_RUNS_TOTAL, Counter, Count, &[Projection, Label::Outcome], "Scheduled rebuild runs, by outcome."),
    metric(REBUILD_RUN_SECONDS, Histogram, Seconds, &[Projection], "The time a scheduled rebuild run took."),
];

/// Describes every metric of [`CATALOG`] to the installed recorder: its unit and its
/// help. Call it once, after installing the recorder (before it, there is nothing to
/// describe to); calling it again does no harm.
pub fn describe() {
    for m in CATALOG {
        match m.kind {
            Kind::Counter => ::metrics::describe_counter!(m.name, m.unit, m.help),
            Kind::Gauge => ::metrics::describe_gauge!(m.name, m.unit, m.help),
            Kind::Histogram => ::metrics::describe_histogram!(m.name, m.unit, m.help),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_namespace_one_name_per_quantity_and_the_conventions() {
        let mut names: Vec<&str> = CATALOG.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CATALOG.len(), "a name described twice");
        for m in CATALOG {
            assert!(m.name.starts_with("inbox_"), "{}", m.name);
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}",
                m.name
            );
            if m.kind == Kind::Histogram || m.unit == Unit::Seconds {
                assert!(m.name.ends_with("_seconds"), "{}", m.name);
                assert_eq!(m.unit, Unit::Seconds, "{}", m.name);
            }
            assert!(!m.help.is_empty() && !m.help.contains('\n'), "{}", m.name);
        }
    }
}
