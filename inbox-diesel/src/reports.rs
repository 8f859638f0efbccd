//! Stored rebuild and audit reports (`inbox_rebuild_reports`): what a
//! [`Rebuilder`](crate::rebuild::Rebuilder) records when a rebuild or an audit
//! finishes, and what the operator reads back
//! ([`Operator::rebuild_reports`](crate::operator::Operator::rebuild_reports)).
//! Neutral, and in every build: the migration exists whatever the features, the
//! writer is the `rebuild` capability, the reader the `operator` one (the standalone
//! CLI reads reports without any rebuild hook).
//!
//! # Bounded, and two writers at once
//!
//! Recording is one short transaction after the work: insert the report, then delete
//! the projection's reports beyond the newest [`KEPT_REBUILD_REPORTS`] (by id). Two
//! runs of one projection that record at once each insert their row and trim; the
//! trims may pick the same old rows, and a row one of them deleted is simply not
//! deleted again (PostgreSQL's second `DELETE` waits for the first's row lock and
//! then finds the row gone; SQLite's writers take turns). Between the two commits
//! the table may hold one report more than the bound for a moment; the next record
//! trims it. A failure to record is logged at warn and changes nothing of the run's
//! own result.

#![cfg_attr(not(any(feature = "operator", feature = "rebuild")), allow(dead_code))]
// Public through `operator` alone (the reader); a build without it keeps them inside.
#![cfg_attr(not(feature = "operator"), allow(unreachable_pub))]

use chrono::{DateTime, Utc};
use diesel::QueryResult;
use serde::Serialize;

/// How many reports of a projection the table keeps: recording one deletes the
/// projection's reports beyond its newest 100.
pub const KEPT_REBUILD_REPORTS: usize = 100;

/// The longest error text a failed report keeps, in characters.
pub const MAX_REPORT_ERROR_CHARS: usize = 2000;

/// Whether a report is a rebuild's or an audit's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RebuildReportKind {
    /// A rebuild (rows rewritten, events covered).
    Rebuild,
    /// An audit (nothing written).
    Audit,
}

impl RebuildReportKind {
    /// `rebuild` or `audit`, as stored and printed.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Rebuild => "rebuild",
            Self::Audit => "audit",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s names.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "rebuild" => Some(Self::Rebuild),
            "audit" => Some(Self::Audit),
            _ => None,
        }
    }
}

/// How a recorded run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RebuildOutcome {
    /// Every partition was done.
    Ok,
    /// It stopped with an error ([`StoredRebuildReport::error`]); the figures are
    /// those of the partitions done before it.
    Failed,
}

impl RebuildOutcome {
    /// `ok` or `failed`, as stored and printed.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Failed => "failed",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s names.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ok" => Some(Self::Ok),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

/// A rebuild's or an audit's report as stored. Its JSON form (`serde`) is the one
/// `inbox rebuild-reports --json` prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct StoredRebuildReport {
    /// The report's id (newer reports have larger ids).
    pub id: i64,
    /// The projection.
    pub projection: String,
    /// A rebuild's or an audit's.
    pub kind: RebuildReportKind,
    /// When the run started (the store's clock).
    pub started_at: DateTime<Utc>,
    /// When it finished.
    pub finished_at: DateTime<Utc>,
    /// How it ended.
    pub outcome: RebuildOutcome,
    /// A failed run's error with its causes, at most [`MAX_REPORT_ERROR_CHARS`].
    pub error: Option<String>,
    /// Partitions done.
    pub partitions: u64,
    /// Rows compared.
    pub rows_checked: u64,
    /// Rows that differed from their recomputation.
    pub rows_differing: u64,
    /// Rows a rebuild rewrote (0 for an audit).
    pub rows_changed: u64,
    /// Projected rows with nothing (or zero) recomputed.
    pub extra_rows: u64,
    /// Events a rebuild covered.
    pub events_covered: u64,
    /// Claims a rebuild recorded for covered events.
    pub claims_recorded: u64,
    /// Failed or started claims a rebuild converted to done.
    pub claims_converted: u64,
    /// Dead letters a rebuild resolved.
    pub dead_letters_resolved: u64,
    /// The largest ratio of a projected figure to its recomputation.
    pub largest_ratio: Option<f64>,
    /// Partitions whose lock was held by live batches when asked.
    pub lock_waits: u64,
    /// Lock requests that timed out and were tried again.
    pub lock_timeouts: u64,
    /// How long the run took, in milliseconds.
    pub duration_ms: u64,
    /// The report's sample of differing rows, as the report serialized it (an array
    /// of `{partition, row, projected, recomputed}`).
    pub drift_sample: serde_json::Value,
}

/// A report to record: everything but the id.
#[derive(Clone, Debug)]
pub struct NewRebuildReport {
    pub projection: String,
    pub kind: RebuildReportKind,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub outcome: RebuildOutcome,
    pub error: Option<String>,
    /// partitions, rows_checked, rows_differing, rows_changed, extra_rows,
    /// events_covered, claims_recorded, claims_converted, dead_letters_resolved.
    pub counts: [u64; 9],
    pub largest_ratio: Option<f64>,
    pub lock_waits: u64,
    pub lock_timeouts: u64,
    pub duration_ms: u64,
    pub drift_sample: String,
}

/// A stored report as read, before its names and sample are checked.
#[derive(diesel::QueryableByName)]
pub struct ReportRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub projection: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub kind: String,
    #[diesel(sql_type = crate::schema::sql_types::StoreTime)]
    pub started_at: DateTime<Utc>,
    #[diesel(sql_type = crate::schema::sql_types::StoreTime)]
    pub finished_at: DateTime<Utc>,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub outcome: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    pub error: Option<String>,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub partitions: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub rows_checked: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub rows_differing: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub rows_changed: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub extra_rows: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub events_covered: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub claims_recorded: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub claims_converted: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub dead_letters_resolved: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Double>)]
    pub largest_ratio: Option<f64>,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub lock_waits: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub lock_timeouts: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub duration_ms: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub drift_sample: String,
}

impl ReportRow {
    /// The report, or a deserialization error naming what this version cannot read.
    #[cfg_attr(not(feature = "operator"), allow(dead_code))]
    pub(crate) fn into_report(self) -> QueryResult<StoredRebuildReport> {
        let bad = |what: String| {
            diesel::result::Error::DeserializationError(
                format!("rebuild report {}: {what}", self.id).into(),
            )
        };
        let kind = RebuildReportKind::parse(&self.kind)
            .ok_or_else(|| bad(format!("unknown kind {:?}", self.kind)))?;
        let outcome = RebuildOutcome::parse(&self.outcome)
            .ok_or_else(|| bad(format!("unknown outcome {:?}", self.outcome)))?;
        let drift_sample = serde_json::from_str(&self.drift_sample)
            .map_err(|e| bad(format!("drift sample is not JSON: {e}")))?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(StoredRebuildReport {
            id: self.id,
            projection: self.projection,
            kind,
            started_at: self.started_at,
            finished_at: self.finished_at,
            outcome,
            error: self.error,
            partitions: n(self.partitions),
            rows_checked: n(self.rows_checked),
            rows_differing: n(self.rows_differing),
            rows_changed: n(self.rows_changed),
            extra_rows: n(self.extra_rows),
            events_covered: n(self.events_covered),
            claims_recorded: n(self.claims_recorded),
            claims_converted: n(self.claims_converted),
            dead_letters_resolved: n(self.dead_letters_resolved),
            largest_ratio: self.largest_ratio,
            lock_waits: n(self.lock_waits),
            lock_timeouts: n(self.lock_timeouts),
            duration_ms: n(self.duration_ms),
            drift_sample,
        })
    }
}

/// The report statements, per backend (expanded by `report_ops!` in `pg/` and
/// `sqlite/`: plain SQL, the table has more columns than a diesel `table!` takes).
pub trait ReportOps: Sized {
    /// Inserts a report, then deletes its projection's reports beyond the newest
    /// `keep`; the caller runs both in one transaction.
    #[doc(hidden)]
    fn record_report(conn: &mut Self, report: &NewRebuildReport, keep: i64) -> QueryResult<()>;

    /// Reports, newest first: of one projection, or of all.
    #[doc(hidden)]
    fn read_reports(
        conn: &mut Self,
        projection: Option<&str>,
        limit: i64,
    ) -> QueryResult<Vec<ReportRow>>;
}

/// The columns of a report, in the order the statements name them.
pub(crate) const REPORT_COLUMNS: &str = "projection, kind, started_at, finished_at, outcome, \
     error, partitions, rows_checked, rows_differing, rows_changed, extra_rows, \
     events_covered, claims_recorded, claims_converted, dead_letters_resolved, \
     largest_ratio, lock_waits, lock_timeouts, duration_ms, drift_sample";

/// Implements [`ReportOps`] for a backend's connection: one SQL text for both (`$n`
/// parameters, which SQLite takes as named ones).
macro_rules! report_ops {
    ($conn:ty) => {
        impl $crate::reports::ReportOps for $conn {
            fn record_report(
                conn: &mut Self,
                r: &$crate::reports::NewRebuildReport,
                keep: i64,
            ) -> diesel::QueryResult<()> {
                use diesel::sql_types::{BigInt, Double, Nullable, Text};
                use diesel::RunQueryDsl;
                use $crate::schema::sql_types::StoreTime;
                use $crate::schema::Stamp;
                let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                let c = r.counts;
                diesel::sql_query(format!(
                    "INSERT INTO inbox_rebuild_reports ({}) VALUES ($1, $2, $3, $4, $5, $6, \
                     $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)",
                    $crate::reports::REPORT_COLUMNS
                ))
                .bind::<Text, _>(&r.projection)
                .bind::<Text, _>(r.kind.as_str())
                .bind::<StoreTime, _>(Stamp(r.started_at))
                .bind::<StoreTime, _>(Stamp(r.finished_at))
                .bind::<Text, _>(r.outcome.as_str())
                .bind::<Nullable<Text>, _>(r.error.as_deref())
                .bind::<BigInt, _>(n(c[0]))
                .bind::<BigInt, _>(n(c[1]))
                .bind::<BigInt, _>(n(c[2]))
                .bind::<BigInt, _>(n(c[3]))
                .bind::<BigInt, _>(n(c[4]))
                .bind::<BigInt, _>(n(c[5]))
                .bind::<BigInt, _>(n(c[6]))
                .bind::<BigInt, _>(n(c[7]))
                .bind::<BigInt, _>(n(c[8]))
                .bind::<Nullable<Double>, _>(r.largest_ratio)
                .bind::<BigInt, _>(n(r.lock_waits))
                .bind::<BigInt, _>(n(r.lock_timeouts))
                .bind::<BigInt, _>(n(r.duration_ms))
                .bind::<Text, _>(&r.drift_sample)
                .execute(conn)?;
                // The bound: this projection's newest `keep` stay.
                diesel::sql_query(
                    "DELETE FROM inbox_rebuild_reports WHERE projection = $1 AND id < \
                     (SELECT MIN(id) FROM (SELECT id FROM inbox_rebuild_reports \
                      WHERE projection = $1 ORDER BY id DESC LIMIT $2) AS newest)",
                )
                .bind::<Text, _>(&r.projection)
                .bind::<BigInt, _>(keep)
                .execute(conn)
                .map(|_| ())
            }

            fn read_reports(
                conn: &mut Self,
                projection: Option<&str>,
                limit: i64,
            ) -> diesel::QueryResult<Vec<$crate::reports::ReportRow>> {
                use diesel::sql_types::{BigInt, Text};
                use diesel::RunQueryDsl;
                let columns = $crate::reports::REPORT_COLUMNS;
                match projection {
                    Some(p) => diesel::sql_query(format!(
                        "SELECT id, {columns} FROM inbox_rebuild_reports \
                         WHERE projection = $1 ORDER BY id DESC LIMIT $2"
                    ))
                    .bind::<Text, _>(p)
                    .bind::<BigInt, _>(limit)
                    .load(conn),
                    None => diesel::sql_query(format!(
                        "SELECT id, {columns} FROM inbox_rebuild_reports \
                         ORDER BY id DESC LIMIT $1"
                    ))
                    .bind::<BigInt, _>(limit)
                    .load(conn),
                }
            }
        }
    };
}

pub(crate) use report_ops;
