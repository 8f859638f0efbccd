//! Projection rebuilds: recompute a window of a projection from its source of truth
//! while live consumers run, never double counting and never losing an event; audit
//! the drift without writing.
//!
//! A projection registered with [`StoreBuilder::projection`](crate::StoreBuilder::projection)
//! (a handler that implements [`inbox_core::rebuild::Rebuild`]) is rebuilt by a [`Rebuilder`],
//! one partition per transaction:
//!
//! 1. take the handler's [`ProjectionLock`](inbox_core::ProjectionLock) exclusively
//!    (PostgreSQL: `pg_advisory_xact_lock` on the lock's key in the store's schema,
//!    after `SET LOCAL lock_timeout`; SQLite: the `BEGIN IMMEDIATE` write transaction,
//!    SQLite's single writer, is the lock);
//! 2. read the partition's source rows **once** ([`Rebuild::read_source`](inbox_core::rebuild::Rebuild::read_source), one
//!    statement, after the lock is held) and derive from that one result both the new
//!    rows and the covered events;
//! 3. rewrite the partition's rows when they differ;
//! 4. cover the events, as one step over locked rows: lock the unresolved dead letters
//!    of the covered keys (by id), then their existing claims (by key), then record a
//!    claim for every covered event, marked covered (`covered_at`, an empty payload
//!    digest): a new claim is `done`; an existing `done` claim stays as it is; a
//!    `failed` or `started` one becomes `done` and covered (its payload dropped, so its
//!    retry is a duplicate); a `dead` one becomes covered and its dead letters are
//!    marked resolved (`resolved_at`: listed `resolved`, refused by replay and bulk
//!    replay);
//! 5. commit.
//!
//! Operator writes take no projection lock: the standalone CLI never knows the lock's
//! name (it lives in the user's handler). They are guarded by the rows the cover
//! locks instead. A replay marks its letter, then takes its claim (`dead` with its
//! digest), in one transaction; the cover locks the letters, then the claims, so each
//! statement of the cover sees rows no replay can change before the commit. Whichever
//! takes the letter first goes first (each is a test in `tests/tests/projection_rebuild.rs`,
//! `operator_writes`, forced with a third connection's row lock on PostgreSQL):
//!
//! - **A replay committed before the cover's locks**: its claim is `failed` with the
//!   replay's copy queued; the cover converts it to done and covered; the copy is a
//!   duplicate (`a_replay_committed_before_the_cover_locks_its_rows_is_seen_by_it`).
//! - **A replay arriving while the cover holds (or waits for) its rows**: it waits
//!   for the letter, then finds it resolved: refused, nothing enqueued
//!   (`a_replay_landing_inside_the_cover_counts_its_event_once`, its bulk twin,
//!   `a_replay_of_a_key_the_cover_holds_waits_and_is_refused`). Before the cover was
//!   one locked step, a replay committing `dead -> failed` between its statements
//!   left the event summed *and* its copy queued on a claim the cover had passed: the
//!   copy was applied on top (counted twice).
//! - **A redrive**: it changes a `failed` claim only; before the cover it is
//!   converted with it, after it finds the claim done and skips it
//!   (`a_redrive_racing_the_cover_counts_its_event_once`).
//!
//! On SQLite the rebuild's `BEGIN IMMEDIATE` transaction excludes every other writer,
//! a replay's included: the two never interleave, and the two orders are the only
//! cases (`a_replay_before_or_after_a_rebuild_counts_its_event_once`, both backends).
//!
//! Live batches take the same lock shared before they claim (the batch path does it
//! for every handler with a lock), so a live batch and a rebuild of one projection
//! never overlap. The interleavings, one live batch carrying event E whose source row
//! is S (each is a test in the workspace's `tests/tests/projection_rebuild.rs`):
//!
//! - **Live claim committed before the rebuild**: E's effect and its `done` claim are
//!   committed when the rebuild takes the lock; S was committed before E was published
//!   (the outbox publishes only committed rows), so the rebuild's read sees S, its new
//!   rows count E once (the live effect is replaced, not added to), and the `done`
//!   claim stays. A redelivery of E is a duplicate.
//! - **Live batch blocked during the rebuild**: the rebuild holds the lock exclusively;
//!   the live batch waits for it *before* it claims. If S was in the rebuild's read, E
//!   is covered: when the live batch claims after the commit, it finds the covered
//!   claim and decides duplicate (no second count, no collision: a covered claim has no
//!   digest to differ). If S was not in the read, E is not covered and the live batch
//!   applies it on top of the rebuilt rows: counted once.
//! - **Live batch in flight when the rebuild asks**: the batch holds the lock shared,
//!   so the rebuild waits (at most `lock_timeout`, then retries) until the batch
//!   committed: this is the first case.
//! - **Live claim after the rebuild**: as the blocked case, without the wait.
//! - **S committed before the lock**: in the read; counted and covered; E's delivery is
//!   a duplicate.
//! - **S committed between the lock and the read**: the read runs after the lock is
//!   held and sees every row committed before it (READ COMMITTED takes the statement's
//!   snapshot): counted and covered, as above.
//! - **S committed after the read**: neither counted nor covered; the live batch of E
//!   waits for the lock and then applies E on top of the rebuilt rows.
//!
//! What each guard prevents: without the shared/exclusive lock, a live batch applying
//! an event whose row the read missed commits before the rewrite, which then replaces
//! its effect: the event is lost (its claim says done). With two reads (one for the
//! rows, one for the keys), a row committed between them is covered but not summed
//! (lost) or summed but not covered (counted twice). Without the covered claims, the
//! delivery of an event the rebuild counted applies it a second time.
//!
//! Preconditions: the keys the hook yields are the producer's (one shared function
//! derives both), and every event is published only after its source row committed.
//!
//! Bounded lock time: each partition is its own transaction; the exclusive request
//! waits at most `lock_timeout` (live batches that arrive meanwhile queue behind it,
//! so this bounds their wait too) and is retried after a pause, a bounded number of
//! times.

pub(crate) mod ops;
mod runner;

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::rebuild::{AuditReport, DynRebuild, HookError, RebuildReport, WindowPartition};

pub use runner::{
    RebuildRunner, RunOutcome, DEFAULT_REBUILD_EVERY, DEFAULT_REBUILD_WINDOW, MAX_REBUILD_EVERY,
};

use crate::backend::{classify, ErrorClass, StoreConnection};
use crate::rebuild::ops::{CoverClaims, RebuildOps};
use crate::reports::{
    NewRebuildReport, RebuildOutcome, RebuildReportKind, KEPT_REBUILD_REPORTS,
    MAX_REPORT_ERROR_CHARS,
};
use crate::verify::{check_key, require_columns, Key};
use crate::{Error, Result, SchemaPart, Store, StoreBuilder};
use chrono::{DateTime, Utc};

/// A connection type projection rebuilds run on: `PgConnection` or
/// `SqliteConnection`. Sealed, as [`StoreConnection`] is; code generic over the
/// backend that rebuilds or audits a projection bounds its connection type by it.
pub trait RebuildConnection: StoreConnection + RebuildOps {}

impl<C: StoreConnection + RebuildOps> RebuildConnection for C {}

/// The default [`Rebuilder::lock_timeout`].
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// The largest window a rebuild or an audit takes: 36,525 partitions (a century of
/// days); [`Rebuilder::window`] refuses more.
pub const MAX_REBUILD_WINDOW: u32 = 36_525;

/// The default [`Rebuilder::lock_tries`].
pub const DEFAULT_LOCK_TRIES: u32 = 50;

/// The default [`Rebuilder::retry_pause`].
pub const DEFAULT_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Checks the rebuild's schema objects (part of `verify_schema`): the columns the
/// cover and the resolution write, and the run table's lease, unique by exactly the
/// projection (one runner per projection), by the rules of `verify` every table
/// shares, on the backend's one catalog read.
pub(crate) fn verify<C: RebuildConnection>(conn: &mut C) -> Result<()> {
    for (table, columns) in REQUIRED {
        require_columns(&C::catalog(conn, table)?, SchemaPart::Rebuild, columns)?;
    }
    check_key(&C::catalog(conn, "inbox_rebuild_runs")?, RUNS)
}

/// The tables a rebuild writes and the columns it needs.
const REQUIRED: &[(&str, &[&str])] = &[
    ("inbox_claims", &["covered_at"]),
    ("inbox_dead_letters", &["resolved_at"]),
    (
        "inbox_rebuild_runs",
        &["projection", "runner", "leased_until"],
    ),
    (
        "inbox_rebuild_reports",
        &["projection", "kind", "outcome", "error", "drift_sample"],
    ),
];

/// The run table's key: one lease per projection.
const RUNS: Key = Key {
    part: SchemaPart::Rebuild,
    columns: &["projection"],
    generated: &[],
};

impl<C: StoreConnection> StoreBuilder<C> {
    /// Registers a projection: its handler (as [`StoreBuilder::handler`] does) and its
    /// rebuild hooks ([`inbox_core::rebuild::Rebuild`]), for [`Rebuilder::new`].
    ///
    /// `build` fails with [`Error::ProjectionWithoutLock`] when the handler declares no
    /// projection lock, and with [`Error::DuplicateProjection`] when two projections
    /// share a name.
    pub fn projection<H: inbox_core::rebuild::Rebuild<C>>(mut self, handler: H) -> Self {
        let handler = Arc::new(handler);
        self.handlers.push(handler.clone());
        self.rebuilds.push(handler);
        self
    }
}

/// Rebuilds and audits one projection of a store, a partition per transaction.
///
/// ```no_run
/// # fn demo(store: inbox_diesel::Store<diesel::PgConnection>) -> inbox_diesel::Result<()> {
/// let rebuilder = inbox_diesel::rebuild::Rebuilder::new(&store, "daily_usage")?;
/// let drift = rebuilder.audit(2)?; // today and yesterday, nothing written
/// if drift.rows_differing > 0 {
///     let healed = rebuilder.rebuild(2)?;
///     println!("{} rows changed, {} events covered", healed.rows_changed, healed.events_covered);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Rebuilder<C: RebuildConnection> {
    store: Store<C>,
    hook: Arc<dyn DynRebuild<C>>,
    key: i64,
    lock_timeout: Duration,
    lock_tries: u32,
    retry_pause: Duration,
}

/// Why one try of a partition's transaction failed.
enum TryError {
    Db(diesel::result::Error),
    Hook(HookError),
}

impl From<diesel::result::Error> for TryError {
    fn from(err: diesel::result::Error) -> Self {
        Self::Db(err)
    }
}

/// PostgreSQL's 55P03 under `lc_messages = 'C'` (diesel does not carry the SQLSTATE).
fn is_lock_timeout(err: &diesel::result::Error) -> bool {
    matches!(err, diesel::result::Error::DatabaseError(_, info)
        if info.message().contains("canceling statement due to lock timeout"))
}

impl TryError {
    /// A lock wait that ran out, a deadlock, a serialization failure, SQLite's busy:
    /// the try is rolled back and run again.
    fn is_contention(&self) -> bool {
        let db = match self {
            Self::Db(err) => Some(err),
            Self::Hook(err) => err.downcast_ref::<diesel::result::Error>(),
        };
        db.is_some_and(|e| is_lock_timeout(e) || classify(e) == ErrorClass::Contention)
    }

    fn into_error(self, projection: &str, partition: &str) -> Error {
        match self {
            Self::Db(err) => Error::Database(err),
            Self::Hook(source) => Error::RebuildHook {
                projection: projection.to_owned(),
                partition: partition.to_owned(),
                source,
            },
        }
    }
}

impl<C: RebuildConnection> Rebuilder<C> {
    /// A rebuilder of `projection`, registered on `store` with
    /// [`StoreBuilder::projection`](crate::StoreBuilder::projection).
    pub fn new(store: &Store<C>, projection: &str) -> Result<Self> {
        let hook = store
            .inner
            .rebuilds()
            .get(projection)
            .cloned()
            .ok_or_else(|| Error::UnknownProjection {
                found: projection.to_owned(),
                expected: Self::projections(store).join(", "),
            })?;
        let lock = hook.lock().ok_or_else(|| Error::ProjectionWithoutLock {
            projection: projection.to_owned(),
            group: hook.group().to_string(),
            message_type: hook.message_type().to_owned(),
        })?;
        Ok(Self {
            key: store.inner.lock_key(&lock),
            store: store.clone(),
            hook,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            lock_tries: DEFAULT_LOCK_TRIES,
            retry_pause: DEFAULT_RETRY_PAUSE,
        })
    }

    /// The names of the projections registered on `store` with rebuild hooks, sorted.
    pub fn projections(store: &Store<C>) -> Vec<String> {
        let mut names: Vec<String> = store.inner.rebuilds().keys().cloned().collect();
        names.sort();
        names
    }

    /// How long one try waits for the exclusive lock (default 200 ms). Live batches
    /// that arrive while the rebuild waits queue behind it, so this bounds their extra
    /// wait too. PostgreSQL only: on SQLite the store's `busy_timeout` bounds it.
    ///
    /// Saturates to what PostgreSQL's `lock_timeout` takes: at least 1 ms, at most
    /// [`MAX_DATABASE_TIMEOUT`](inbox_core::MAX_DATABASE_TIMEOUT) (2^31 - 1 ms, about
    /// 24.8 days), the longest wait there is ("for ever" waits that long).
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout =
            timeout.clamp(Duration::from_millis(1), inbox_core::MAX_DATABASE_TIMEOUT);
        self
    }

    /// How many tries of a partition may time out or meet contention before the
    /// rebuild gives up with [`Error::LockTimeout`] (default 50).
    pub fn lock_tries(mut self, tries: u32) -> Self {
        self.lock_tries = tries.max(1);
        self
    }

    /// The pause between two tries of a partition (default 100 ms): live batches that
    /// queued behind a timed-out try run in it.
    pub fn retry_pause(mut self, pause: Duration) -> Self {
        self.retry_pause = pause;
        self
    }

    /// The projection.
    pub fn projection(&self) -> &str {
        self.hook.projection()
    }

    /// The `size` partitions of the window ending now (the store's clock): for a daily
    /// projection, today (UTC) and the `size - 1` days before it. Refuses 0 and more
    /// than [`MAX_REBUILD_WINDOW`] partitions.
    pub fn window(&self, size: u32) -> Result<Vec<WindowPartition>> {
        if size == 0 || size > MAX_REBUILD_WINDOW {
            return Err(Error::InvalidSetting {
                setting: "days",
                expected: "at least 1 and at most 36525 partitions (MAX_REBUILD_WINDOW)",
                found: size.to_string(),
            });
        }
        Ok(self.hook.window(self.store.clock().now(), size))
    }

    /// Audits the window of `size` partitions ending now: nothing is written.
    pub fn audit(&self, size: u32) -> Result<AuditReport> {
        self.audit_partitions(&self.window(size)?)
    }

    /// Audits the given partitions, each in a read-only transaction with one snapshot.
    ///
    /// When it finishes, ok or failed, it records a report (see
    /// [`Operator::rebuild_reports`](crate::operator::Operator::rebuild_reports)) in a
    /// short transaction of its own; a failure to record is logged at warn and
    /// changes nothing of what this returns.
    pub fn audit_partitions(&self, partitions: &[WindowPartition]) -> Result<AuditReport> {
        let started = Instant::now();
        let started_at = self.store.clock().now();
        let mut report = AuditReport {
            projection: self.projection().to_owned(),
            ..AuditReport::default()
        };
        let ran = self.audit_into(partitions, &mut report);
        report.duration_ms = millis(started.elapsed());
        self.record(audit_record(&report, started_at, ran.as_ref().err()));
        ran?;
        let projection = self.projection().to_owned();
        metrics::counter!(inbox_core::metrics::AUDIT_RUNS_TOTAL, "projection" => projection.clone())
            .increment(1);
        metrics::counter!(inbox_core::metrics::AUDIT_ROWS_DIFFERING_TOTAL, "projection" => projection.clone())
            .increment(report.rows_differing);
        metrics::gauge!(inbox_core::metrics::PROJECTION_DRIFT_ROWS, "projection" => projection)
            .set(report.rows_differing as f64);
        tracing::info!(
            projection = self.projection(),
            partitions = report.partitions,
            rows_checked = report.rows_checked,
            rows_differing = report.rows_differing,
            extra_rows = report.extra_rows,
            largest_ratio = report.largest_ratio,
            "projection audited"
        );
        Ok(report)
    }

    fn audit_into(&self, partitions: &[WindowPartition], report: &mut AuditReport) -> Result<()> {
        let mut conn = self.store.connection()?;
        for partition in partitions {
            let drift = C::read_snapshot(&mut *conn, |conn| {
                self.hook
                    .audit_partition(conn, partition)
                    .map_err(TryError::Hook)
            })
            .map_err(|e| e.into_error(self.projection(), partition.label()))?;
            report.add(&drift);
        }
        Ok(())
    }

    /// Records a finished run's report after the work, in a transaction of its own,
    /// trimming the projection's reports to the newest [`KEPT_REBUILD_REPORTS`]. A
    /// failure is logged at warn, never returned: the run is done either way.
    fn record(&self, mut report: NewRebuildReport) {
        report.finished_at = self.store.clock().now();
        let keep = i64::try_from(KEPT_REBUILD_REPORTS).unwrap_or(i64::MAX);
        let recorded = self.store.connection().and_then(|mut conn| {
            C::write_transaction(&mut *conn, |conn| C::record_report(conn, &report, keep))
                .map_err(Error::from)
        });
        if let Err(err) = recorded {
            tracing::warn!(
                projection = self.projection(),
                kind = report.kind.as_str(),
                error = %inbox_core::display::Escaped(&err.to_string()),
                "the run's report was not recorded"
            );
        }
    }

    /// Rebuilds the window of `size` partitions ending now, a partition per transaction.
    pub fn rebuild(&self, size: u32) -> Result<RebuildReport> {
        self.rebuild_partitions(&self.window(size)?)
    }

    /// Rebuilds the given partitions, one transaction each.
    pub fn rebuild_partitions(&self, partitions: &[WindowPartition]) -> Result<RebuildReport> {
        self.rebuild_with(partitions, &mut || Ok(()))
    }

    /// Rebuilds, calling `between` before each partition (a runner renews its lease).
    /// Records its report when it finishes, ok or failed, as
    /// [`audit_partitions`](Self::audit_partitions) does.
    pub(crate) fn rebuild_with(
        &self,
        partitions: &[WindowPartition],
        between: &mut dyn FnMut() -> Result<()>,
    ) -> Result<RebuildReport> {
        let started = Instant::now();
        let started_at = self.store.clock().now();
        let mut report = RebuildReport {
            projection: self.projection().to_owned(),
            ..RebuildReport::default()
        };
        let ran = (|| {
            for partition in partitions {
                between()?;
                self.rebuild_one(partition, &mut report)?;
            }
            Ok::<_, Error>(())
        })();
        report.duration_ms = millis(started.elapsed());
        self.record(rebuild_record(&report, started_at, ran.as_ref().err()));
        ran?;
        tracing::info!(
            projection = self.projection(),
            partitions = report.partitions,
            rows_changed = report.rows_changed,
            events_covered = report.events_covered,
            claims_recorded = report.claims_recorded,
            lock_waits = report.lock_waits,
            lock_timeouts = report.lock_timeouts,
            duration_ms = report.duration_ms,
            "projection rebuilt"
        );
        Ok(report)
    }

    fn rebuild_one(&self, partition: &WindowPartition, report: &mut RebuildReport) -> Result<()> {
        let projection = self.projection().to_owned();
        let mut timeouts = 0;
        loop {
            let started = Instant::now();
            let mut conn = self.store.connection()?;
            let now = self.store.clock().now();
            let mut lock_wait = None;
            let outcome = C::write_transaction(&mut *conn, |conn| {
                let asked = Instant::now();
                let waited = C::lock_exclusive(conn, self.key, self.lock_timeout)?;
                lock_wait = Some((waited, asked.elapsed()));
                // Held exclusively from here to the commit: the one read of the source,
                // then the rewrite and the claims it implies.
                let rebuilt = self
                    .hook
                    .rebuild_partition(conn, partition)
                    .map_err(TryError::Hook)?;
                let mut keys: Vec<&str> = rebuilt.covered.iter().map(|k| k.as_str()).collect();
                keys.sort_unstable();
                keys.dedup();
                let covered = C::cover(
                    conn,
                    &CoverClaims {
                        group: self.hook.group().as_str(),
                        message_type: self.hook.message_type(),
                        keys: &keys,
                        now,
                    },
                )?;
                let events = keys.len() as u64;
                drop(keys);
                Ok::<_, TryError>((rebuilt.drift, events, covered))
            });
            if let Some((waited, wait)) = lock_wait {
                metrics::histogram!(inbox_core::metrics::REBUILD_LOCK_WAIT_SECONDS, "projection" => projection.clone())
                    .record(wait.as_secs_f64());
                report.longest_lock_wait_ms = report.longest_lock_wait_ms.max(millis(wait));
                if waited {
                    report.lock_waits += 1;
                }
            }
            match outcome {
                Ok((drift, events, covered)) => {
                    report.add_drift(&drift);
                    report.events_covered += events;
                    report.claims_recorded += covered.recorded;
                    report.claims_converted += covered.converted;
                    report.dead_covered += covered.dead;
                    report.dead_letters_resolved += covered.letters_resolved;
                    let labels = [("projection", projection.clone())];
                    metrics::counter!(inbox_core::metrics::REBUILD_PARTITIONS_TOTAL, &labels)
                        .increment(1);
                    metrics::counter!(inbox_core::metrics::REBUILD_ROWS_CHANGED_TOTAL, &labels)
                        .increment(drift.rows_differing);
                    metrics::counter!(inbox_core::metrics::REBUILD_EVENTS_COVERED_TOTAL, &labels)
                        .increment(events);
                    metrics::histogram!(inbox_core::metrics::REBUILD_PARTITION_SECONDS, &labels)
                        .record(started.elapsed().as_secs_f64());
                    tracing::debug!(
                        projection = %projection,
                        partition = partition.label(),
                        rows_changed = drift.rows_differing,
                        events_covered = events,
                        "partition rebuilt"
                    );
                    return Ok(());
                }
                Err(err) if err.is_contention() => {
                    timeouts += 1;
                    report.lock_timeouts += 1;
                    metrics::counter!(inbox_core::metrics::REBUILD_LOCK_TIMEOUTS_TOTAL, "projection" => projection.clone())
                        .increment(1);
                    if timeouts >= self.lock_tries {
                        return Err(Error::LockTimeout {
                            projection,
                            partition: partition.label().to_owned(),
                            timeout: self.lock_timeout,
                            tries: timeouts,
                        });
                    }
                    tracing::debug!(projection = %projection, partition = partition.label(), tries = timeouts, "projection lock not granted in time: retrying");
                    drop(conn);
                    std::thread::sleep(self.retry_pause);
                }
                Err(err) => return Err(err.into_error(&projection, partition.label())),
            }
        }
    }

    pub(crate) fn store(&self) -> &Store<C> {
        &self.store
    }
}

/// A failed run's error and its causes, cut at [`MAX_REPORT_ERROR_CHARS`].
fn error_text(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text.chars().take(MAX_REPORT_ERROR_CHARS).collect()
}

fn outcome(err: Option<&Error>) -> (RebuildOutcome, Option<String>) {
    match err {
        None => (RebuildOutcome::Ok, None),
        Some(err) => (RebuildOutcome::Failed, Some(error_text(err))),
    }
}

fn sample_json<T: serde::Serialize>(sample: &T) -> String {
    serde_json::to_string(sample).unwrap_or_else(|_| "[]".to_owned())
}

fn audit_record(
    r: &AuditReport,
    started_at: DateTime<Utc>,
    err: Option<&Error>,
) -> NewRebuildReport {
    let (outcome, error) = outcome(err);
    NewRebuildReport {
        projection: r.projection.clone(),
        kind: RebuildReportKind::Audit,
        started_at,
        finished_at: started_at,
        outcome,
        error,
        counts: [
            r.partitions,
            r.rows_checked,
            r.rows_differing,
            0,
            r.extra_rows,
            0,
            0,
            0,
            0,
        ],
        largest_ratio: r.largest_ratio,
        lock_waits: 0,
        lock_timeouts: 0,
        duration_ms: r.duration_ms,
        drift_sample: sample_json(&r.sample),
    }
}

fn rebuild_record(
    r: &RebuildReport,
    started_at: DateTime<Utc>,
    err: Option<&Error>,
) -> NewRebuildReport {
    let (outcome, error) = outcome(err);
    NewRebuildReport {
        projection: r.projection.clone(),
        kind: RebuildReportKind::Rebuild,
        started_at,
        finished_at: started_at,
        outcome,
        error,
        counts: [
            r.partitions,
            r.rows_checked,
            r.rows_differing,
            r.rows_changed,
            r.extra_rows,
            r.events_covered,
            r.claims_recorded,
            r.claims_converted,
            r.dead_letters_resolved,
        ],
        largest_ratio: r.largest_ratio,
        lock_waits: r.lock_waits,
        lock_timeouts: r.lock_timeouts,
        duration_ms: r.duration_ms,
        drift_sample: sample_json(&r.sample),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
