//! Projection rebuild hooks: recompute a window of a projection from its source of
//! truth (the ledger) and replace it, or audit the drift without writing.
//!
//! A projection is a [`Handler`] whose writes are a read model. Implementing
//! [`Rebuild`] for it gives the store what it needs to rebuild a window of partitions
//! (days, say) while live consumers keep running:
//!
//! 1. [`Rebuild::read_source`] reads a partition's source rows in **one statement**,
//!    each with the message key of the event it produced;
//! 2. [`Rebuild::recompute`] folds that one result into the projection's rows (pure:
//!    no connection), and the store takes the covered events from the same result, so
//!    no row can be summed but not covered, or covered but not summed;
//! 3. [`Rebuild::read_projection`] reads what the projection holds now (for the drift);
//! 4. [`Rebuild::replace`] deletes the partition's rows and writes the recomputed ones.
//!
//! The store (`inbox-diesel`) runs these steps one partition per transaction, holding
//! the handler's [`ProjectionLock`] exclusively, and records a claim for every covered
//! event; its module docs argue why that never double counts nor loses an event.
//!
//! The keys [`Rebuild::read_source`] yields must be exactly the keys the producer
//! gives the events: derive both with one shared function.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;

use crate::{ConsumerGroup, Handler, MessageKey, ProjectionLock};

/// An error of a rebuild hook (usually the database's), kept boxed so the store can
/// recognise contention (a lock timeout, a deadlock) by downcasting it.
pub type HookError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A row of a projection, as a rebuild and an audit compare it.
pub trait ProjectionRow: Clone + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// The row's identity within its partition (e.g. the user id of a daily total).
    fn row_key(&self) -> String;

    /// The figure an audit compares, projected against recomputed (e.g. the total).
    fn measure(&self) -> f64;
}

/// A source row of a partition: the message key of the event it produced, and what
/// the projection needs of it.
pub type SourceEvent<S> = (MessageKey, S);

/// A projection's rebuild hooks, on a store connection `C`.
///
/// The handler must declare a [`ProjectionLock`] ([`Handler::lock`]): live batches take
/// it shared before they claim, a rebuild takes it exclusively. The store refuses to
/// build when a projection registered with a rebuild hook has none.
///
/// Correctness also needs each event to be published only after its source row
/// committed (the transactional outbox gives that: the ledger row and the outbox row
/// commit together): an event whose row a rebuild could not see yet is then applied by
/// the live consumer after the rebuild, never lost.
pub trait Rebuild<C>: Handler<C> {
    /// The projection's partition key (a day).
    type Partition: Clone + fmt::Display + Send + Sync + 'static;
    /// What the projection needs of one source row.
    type Source: Send + 'static;
    /// A projection row.
    type Row: ProjectionRow;

    /// The projection's name (`daily_usage`): what operators and reports call it.
    fn projection(&self) -> &str;

    /// The `size` partitions of the window that ends at `now`, e.g. today (UTC) and the
    /// `size - 1` days before it ([`days_ending`]).
    fn window(&self, now: DateTime<Utc>, size: u32) -> Vec<Self::Partition>;

    /// Reads every source row of a partition, in one statement, each with the message
    /// key the producer gave its event.
    fn read_source(
        &self,
        conn: &mut C,
        partition: &Self::Partition,
    ) -> Result<Vec<SourceEvent<Self::Source>>, HookError>;

    /// The partition's rows as the source says they should be (pure: from the one read).
    fn recompute(
        &self,
        partition: &Self::Partition,
        source: &[SourceEvent<Self::Source>],
    ) -> Vec<Self::Row>;

    /// The partition's rows as the projection holds them now.
    fn read_projection(
        &self,
        conn: &mut C,
        partition: &Self::Partition,
    ) -> Result<Vec<Self::Row>, HookError>;

    /// Deletes (or resets) the partition's rows and writes `rows` instead. Rows of
    /// other partitions must not be touched.
    fn replace(
        &self,
        conn: &mut C,
        partition: &Self::Partition,
        rows: &[Self::Row],
    ) -> Result<(), HookError>;
}

/// The days of a window of `size` days ending on `now`'s UTC day, oldest first: today
/// and the `size - 1` days before it.
///
/// ```
/// use chrono::{TimeZone, Utc};
/// let now = Utc.with_ymd_and_hms(2026, 12, 1, 0, 30, 0).unwrap();
/// let days: Vec<String> = inbox_core::rebuild::days_ending(now, 2).iter().map(|d| d.to_string()).collect();
/// assert_eq!(days, ["2026-11-30", "2026-12-01"]);
/// ```
pub fn days_ending(now: DateTime<Utc>, size: u32) -> Vec<NaiveDate> {
    let today = now.date_naive();
    (0..size)
        .rev()
        .filter_map(|back| today.checked_sub_days(chrono::Days::new(u64::from(back))))
        .collect()
}

/// A partition of a window, its type erased (the store holds hooks as
/// [`DynRebuild`]).
#[derive(Clone)]
pub struct WindowPartition {
    label: String,
    value: Arc<dyn Any + Send + Sync>,
}

impl WindowPartition {
    /// The partition as reports print it (`2026-12-01`).
    pub fn label(&self) -> &str {
        &self.label
    }
}

impl fmt::Debug for WindowPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

/// A differing row, as an audit samples it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DriftRow {
    /// The partition (`2026-12-01`).
    pub partition: String,
    /// The row's key within it ([`ProjectionRow::row_key`]).
    pub row: String,
    /// The projected figure, `None` when the projection has no such row.
    pub projected: Option<f64>,
    /// The recomputed figure, `None` when the source has no such row.
    pub recomputed: Option<f64>,
}

/// The drift of one partition: the projection against its recomputation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PartitionDrift {
    /// The partition.
    pub partition: String,
    /// Rows compared (present on either side).
    pub rows_checked: u64,
    /// Rows that differ, extra rows included.
    pub rows_differing: u64,
    /// Projected rows whose recomputed figure is zero or missing (no ratio exists).
    pub extra_rows: u64,
    /// The largest projected / recomputed ratio over rows present on both sides with a
    /// non-zero recomputed figure; `None` when there is no such row.
    pub largest_ratio: Option<f64>,
    /// The differing rows, in row key order.
    pub differing: Vec<DriftRow>,
}

impl PartitionDrift {
    /// Compares a partition's projected rows with its recomputed ones.
    ///
    /// ```
    /// # #[derive(Clone, Debug, PartialEq)] struct Total(&'static str, i64);
    /// # impl inbox_core::rebuild::ProjectionRow for Total {
    /// #     fn row_key(&self) -> String { self.0.to_owned() }
    /// #     fn measure(&self) -> f64 { self.1 as f64 }
    /// # }
    /// use inbox_core::rebuild::PartitionDrift;
    /// let projected = [Total("a", 24), Total("b", 5), Total("c", 3)];
    /// let recomputed = [Total("a", 10), Total("b", 5)];
    /// let drift = PartitionDrift::compare("2026-12-01", &projected, &recomputed);
    /// assert_eq!((drift.rows_checked, drift.rows_differing, drift.extra_rows), (3, 2, 1));
    /// assert_eq!(drift.largest_ratio, Some(2.4));
    /// ```
    pub fn compare<R: ProjectionRow>(partition: &str, projected: &[R], recomputed: &[R]) -> Self {
        let mut rows: BTreeMap<String, (Option<&R>, Option<&R>)> = BTreeMap::new();
        for r in projected {
            rows.entry(r.row_key()).or_default().0 = Some(r);
        }
        for r in recomputed {
            rows.entry(r.row_key()).or_default().1 = Some(r);
        }
        let mut drift = Self {
            partition: partition.to_owned(),
            ..Self::default()
        };
        for (key, (p, r)) in rows {
            drift.rows_checked += 1;
            let recomputed_figure = r.map(ProjectionRow::measure);
            let differs = p != r;
            if let Some(p) = p {
                match recomputed_figure {
                    Some(figure) if figure != 0.0 => {
                        let ratio = p.measure() / figure;
                        if drift.largest_ratio.is_none_or(|largest| ratio > largest) {
                            drift.largest_ratio = Some(ratio);
                        }
                    }
                    // A projected row over zero or nothing: no ratio exists.
                    _ if differs => drift.extra_rows += 1,
                    _ => {}
                }
            }
            if differs {
                drift.rows_differing += 1;
                drift.differing.push(DriftRow {
                    partition: partition.to_owned(),
                    row: key,
                    projected: p.map(ProjectionRow::measure),
                    recomputed: recomputed_figure,
                });
            }
        }
        drift
    }
}

/// How many differing rows a report keeps as its sample.
pub const DRIFT_SAMPLE: usize = 20;

/// An audit of a window: the projection against its recomputation, nothing written.
///
/// Its JSON form (`serde`) is a contract: the field names below are stable.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditReport {
    /// The projection.
    pub projection: String,
    /// Partitions audited.
    pub partitions: u64,
    /// Rows compared (present on either side).
    pub rows_checked: u64,
    /// Rows that differ, extra rows included.
    pub rows_differing: u64,
    /// Projected rows whose recomputed figure is zero or missing.
    pub extra_rows: u64,
    /// The largest projected / recomputed ratio (see [`PartitionDrift::largest_ratio`]).
    pub largest_ratio: Option<f64>,
    /// Up to [`DRIFT_SAMPLE`] differing rows, partition by partition.
    pub sample: Vec<DriftRow>,
    /// How long the audit took, in milliseconds.
    pub duration_ms: u64,
}

impl AuditReport {
    /// Adds a partition's drift.
    pub fn add(&mut self, drift: &PartitionDrift) {
        self.partitions += 1;
        self.rows_checked += drift.rows_checked;
        self.rows_differing += drift.rows_differing;
        self.extra_rows += drift.extra_rows;
        if let Some(ratio) = drift.largest_ratio {
            if self.largest_ratio.is_none_or(|largest| ratio > largest) {
                self.largest_ratio = Some(ratio);
            }
        }
        let room = DRIFT_SAMPLE.saturating_sub(self.sample.len());
        self.sample
            .extend(drift.differing.iter().take(room).cloned());
    }
}

/// A rebuild of a window: what it healed and which events it covered.
///
/// Its JSON form (`serde`) is a contract: the field names below are stable.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RebuildReport {
    /// The projection.
    pub projection: String,
    /// Partitions rebuilt (one transaction each).
    pub partitions: u64,
    /// Projection rows the rebuild changed (written, rewritten or deleted): the drift
    /// it found, row by row.
    pub rows_changed: u64,
    /// Source events the rebuilt rows count; each has a claim afterwards.
    pub events_covered: u64,
    /// Covered events that had no claim: a claim marked covered was recorded, so their
    /// delivery is a duplicate.
    pub claims_recorded: u64,
    /// Covered events whose claim was `failed` or `started`: now done and covered.
    pub claims_converted: u64,
    /// Covered events whose claim was `dead`: now covered, their dead letters resolved.
    pub dead_covered: u64,
    /// Dead letters marked resolved.
    pub dead_letters_resolved: u64,
    /// Rows compared before the rewrite.
    pub rows_checked: u64,
    /// Rows that differed before the rewrite (equals `rows_changed`).
    pub rows_differing: u64,
    /// Projected rows over a zero or missing recomputed figure, before the rewrite.
    pub extra_rows: u64,
    /// The largest projected / recomputed ratio found before the rewrite.
    pub largest_ratio: Option<f64>,
    /// Partitions whose lock was held by live batches when the rebuild asked for it
    /// (the rebuild overlapped them and waited for them to commit).
    pub lock_waits: u64,
    /// Tries whose lock wait ran out (`lock_timeout`) and were retried.
    pub lock_timeouts: u64,
    /// The longest wait for the projection lock, in milliseconds.
    pub longest_lock_wait_ms: u64,
    /// Up to [`DRIFT_SAMPLE`] rows the rebuild changed, as they were before.
    pub sample: Vec<DriftRow>,
    /// How long the rebuild took, in milliseconds.
    pub duration_ms: u64,
}

impl RebuildReport {
    /// Adds a partition's drift (before its rewrite).
    pub fn add_drift(&mut self, drift: &PartitionDrift) {
        let mut audit = AuditReport {
            largest_ratio: self.largest_ratio,
            sample: std::mem::take(&mut self.sample),
            ..AuditReport::default()
        };
        audit.add(drift);
        self.partitions += 1;
        self.rows_changed += drift.rows_differing;
        self.rows_checked += drift.rows_checked;
        self.rows_differing += drift.rows_differing;
        self.extra_rows += drift.extra_rows;
        self.largest_ratio = audit.largest_ratio;
        self.sample = audit.sample;
    }
}

/// What a rebuild of one partition computed, before the store records its claims.
#[derive(Clone, Debug)]
pub struct RebuiltPartition {
    /// The projection against the recomputation, before the rewrite (its differing
    /// rows are the rows the rewrite changed).
    pub drift: PartitionDrift,
    /// The message keys of every source event the new rows count.
    pub covered: Vec<MessageKey>,
}

/// A projection's rebuild hooks with their types erased: stores hold
/// `Arc<dyn DynRebuild<C>>`. Blanket-implemented for every [`Rebuild`].
pub trait DynRebuild<C>: Send + Sync + 'static {
    /// See [`Rebuild::projection`].
    fn projection(&self) -> &str;
    /// The handler's consumer group (its claims are the ones covered).
    fn group(&self) -> &ConsumerGroup;
    /// The handler's message type (recorded on covered claims).
    fn message_type(&self) -> &str;
    /// The handler's lock.
    fn lock(&self) -> Option<ProjectionLock>;
    /// See [`Rebuild::window`].
    fn window(&self, now: DateTime<Utc>, size: u32) -> Vec<WindowPartition>;
    /// Compares the partition's rows with their recomputation; writes nothing.
    fn audit_partition(
        &self,
        conn: &mut C,
        partition: &WindowPartition,
    ) -> Result<PartitionDrift, HookError>;
    /// Reads the partition's source once, rewrites its rows when they differ, and
    /// returns the drift it healed and the events the new rows count.
    fn rebuild_partition(
        &self,
        conn: &mut C,
        partition: &WindowPartition,
    ) -> Result<RebuiltPartition, HookError>;
}

/// A partition handed back to a hook of another type (a bug of the caller).
#[derive(Debug, thiserror::Error)]
#[error("partition {0} does not belong to this projection")]
pub struct ForeignPartition(String);

fn partition_of<P: 'static>(p: &WindowPartition) -> Result<&P, HookError> {
    p.value
        .downcast_ref::<P>()
        .ok_or_else(|| Box::new(ForeignPartition(p.label.clone())) as HookError)
}

impl<C, R> DynRebuild<C> for R
where
    R: Rebuild<C>,
{
    fn projection(&self) -> &str {
        Rebuild::projection(self)
    }

    fn group(&self) -> &ConsumerGroup {
        Handler::group(self)
    }

    fn message_type(&self) -> &str {
        Handler::message_type(self)
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Handler::lock(self)
    }

    fn window(&self, now: DateTime<Utc>, size: u32) -> Vec<WindowPartition> {
        Rebuild::window(self, now, size)
            .into_iter()
            .map(|p| WindowPartition {
                label: p.to_string(),
                value: Arc::new(p),
            })
            .collect()
    }

    fn audit_partition(
        &self,
        conn: &mut C,
        partition: &WindowPartition,
    ) -> Result<PartitionDrift, HookError> {
        let p = partition_of::<R::Partition>(partition)?;
        let source = self.read_source(conn, p)?;
        let recomputed = self.recompute(p, &source);
        let projected = self.read_projection(conn, p)?;
        Ok(PartitionDrift::compare(
            partition.label(),
            &projected,
            &recomputed,
        ))
    }

    fn rebuild_partition(
        &self,
        conn: &mut C,
        partition: &WindowPartition,
    ) -> Result<RebuiltPartition, HookError> {
        let p = partition_of::<R::Partition>(partition)?;
        // The one read: the new rows and the covered events both come from `source`.
        let source = self.read_source(conn, p)?;
        let recomputed = self.recompute(p, &source);
        let projected = self.read_projection(conn, p)?;
        let drift = PartitionDrift::compare(partition.label(), &projected, &recomputed);
        if drift.rows_differing > 0 {
            self.replace(conn, p, &recomputed)?;
        }
        Ok(RebuiltPartition {
            drift,
            covered: source.into_iter().map(|(key, _)| key).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct Total(&'static str, i64);

    impl ProjectionRow for Total {
        fn row_key(&self) -> String {
            self.0.to_owned()
        }
        fn measure(&self) -> f64 {
            self.1 as f64
        }
    }

    #[test]
    fn equal_partitions_have_no_drift_and_a_ratio_of_one() {
        let rows = [Total("a", 3), Total("b", 4)];
        let drift = PartitionDrift::compare("d", &rows, &rows);
        assert_eq!(drift.rows_checked, 2);
        assert_eq!(drift.rows_differing, 0);
        assert_eq!(drift.extra_rows, 0);
        assert_eq!(drift.largest_ratio, Some(1.0));
        assert!(drift.differing.is_empty());
    }

    #[test]
    fn a_projected_row_over_zero_or_nothing_is_extra_not_a_ratio() {
        let projected = [Total("a", 5), Total("b", 7), Total("c", 2)];
        let recomputed = [Total("a", 0), Total("c", 1)];
        let drift = PartitionDrift::compare("d", &projected, &recomputed);
        assert_eq!(drift.rows_checked, 3);
        assert_eq!(drift.rows_differing, 3);
        assert_eq!(drift.extra_rows, 2);
        assert_eq!(drift.largest_ratio, Some(2.0));
        assert_eq!(
            drift.differing[1],
            DriftRow {
                partition: "d".into(),
                row: "b".into(),
                projected: Some(7.0),
                recomputed: None
            }
        );
    }

    #[test]
    fn a_missing_projected_row_differs_without_a_ratio() {
        let drift = PartitionDrift::compare("d", &[], &[Total("a", 5)]);
        assert_eq!((drift.rows_checked, drift.rows_differing), (1, 1));
        assert_eq!(drift.extra_rows, 0);
        assert_eq!(drift.largest_ratio, None);
    }

    #[test]
    fn equal_rows_at_zero_are_not_extra() {
        let rows = [Total("a", 0)];
        let drift = PartitionDrift::compare("d", &rows, &rows);
        assert_eq!((drift.rows_differing, drift.extra_rows), (0, 0));
    }

    #[test]
    fn the_largest_ratio_is_the_largest() {
        let projected = [Total("a", 12), Total("b", 3)];
        let recomputed = [Total("a", 5), Total("b", 2)];
        let drift = PartitionDrift::compare("d", &projected, &recomputed);
        assert_eq!(drift.largest_ratio, Some(2.4));
    }

    #[test]
    fn windows_end_today_and_go_back() {
        use chrono::TimeZone;
        let now = Utc.with_ymd_and_hms(2026, 3, 1, 23, 59, 0).unwrap();
        let days: Vec<String> = days_ending(now, 3).iter().map(|d| d.to_string()).collect();
        assert_eq!(days, ["2026-02-27", "2026-02-28", "2026-03-01"]);
        assert!(days_ending(now, 0).is_empty());
    }

    #[test]
    fn lock_keys_are_scoped_by_schema_and_stable() {
        let a = ProjectionLock::named("daily_usage");
        assert_eq!(a.key_in("s1"), a.key_in("s1"));
        assert_ne!(a.key_in("s1"), a.key_in("s2"));
        assert_ne!(a.key_in("s1"), ProjectionLock::named("other").key_in("s1"));
        // Shared and serialized locks of one name are one lock.
        assert_eq!(
            ProjectionLock::serialized("daily_usage").key_in("s1"),
            a.key_in("s1")
        );
        // The schema's end is marked: ("ab", x) and ("a", "b"+x) cannot meet.
        assert_ne!(a.key_in("ab"), a.key_in("a"));
    }
}
