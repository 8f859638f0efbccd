//! The schedule: rebuild a projection every interval over a moving window, one runner
//! at a time per projection across every process on the database.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::delta;
use inbox_core::rebuild::{RebuildReport, WindowPartition};

use super::RebuildConnection;
use super::Rebuilder;
use crate::rebuild::ops::RunLease;
use crate::{Error, Result};

/// The default [`RebuildRunner::every`]: hourly.
pub const DEFAULT_REBUILD_EVERY: Duration = Duration::from_secs(3_600);

/// The default [`RebuildRunner::window`]: two partitions (today and yesterday).
pub const DEFAULT_REBUILD_WINDOW: u32 = 2;

/// The longest [`RebuildRunner::every`] and [`RebuildRunner::lease`]: a year; longer
/// ones saturate to it.
pub const MAX_REBUILD_EVERY: Duration = Duration::from_secs(365 * 86_400);

/// The default [`RebuildRunner::lease`].
pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(600);

/// What one scheduled run did.
#[derive(Clone, Debug, PartialEq)]
pub enum RunOutcome {
    /// The window was rebuilt.
    Ran(RebuildReport),
    /// Another runner holds the projection's lease: this run did nothing.
    Skipped {
        /// The runner that holds it.
        holder: String,
    },
}

type Before = Arc<dyn Fn(&str, &[WindowPartition]) + Send + Sync>;
type After = Arc<dyn Fn(std::result::Result<&RunOutcome, &Error>) + Send + Sync>;

/// Runs a projection's rebuild every interval over a moving window (default hourly over
/// two days), in the consumer's process or on its own.
///
/// Two runners against one database never rebuild the same projection at once: a run
/// first takes the projection's lease (`inbox_rebuild_runs`), renews it before every
/// partition and gives it up at the end; a runner that finds it held skips the run and
/// says so ([`RunOutcome::Skipped`], an info log, `inbox_rebuild_runs_total{outcome =
/// "skipped"}`). A runner that dies leaves a lease that expires ([`RebuildRunner::lease`]).
///
/// ```no_run
/// # fn demo(store: inbox_diesel::Store<diesel::PgConnection>) -> inbox_diesel::Result<()> {
/// use std::sync::atomic::AtomicBool;
/// use std::time::Duration;
/// let runner = inbox_diesel::rebuild::RebuildRunner::new(inbox_diesel::rebuild::Rebuilder::new(&store, "daily_usage")?)
///     .every(Duration::from_secs(3600))
///     .window(2)
///     .after(|outcome| println!("rebuild: {outcome:?}"));
/// let stop = AtomicBool::new(false);
/// runner.run(&stop); // until `stop` is set
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RebuildRunner<C: RebuildConnection> {
    rebuilder: Rebuilder<C>,
    every: Duration,
    window: u32,
    lease: Duration,
    id: String,
    before: Vec<Before>,
    after: Vec<After>,
}

impl<C: RebuildConnection> RebuildRunner<C> {
    /// A runner of `rebuilder`'s projection, hourly over two partitions.
    pub fn new(rebuilder: Rebuilder<C>) -> Self {
        static RUNNERS: AtomicUsize = AtomicUsize::new(0);
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".to_owned());
        let id = format!(
            "{host}:{}:{}",
            std::process::id(),
            RUNNERS.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            rebuilder,
            every: DEFAULT_REBUILD_EVERY,
            window: DEFAULT_REBUILD_WINDOW,
            lease: DEFAULT_LEASE,
            id,
            before: Vec::new(),
            after: Vec::new(),
        }
    }

    /// The interval between two runs (default 1 h). Saturates to
    /// [`MAX_REBUILD_EVERY`] (a year); 0 runs back to back.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.min(MAX_REBUILD_EVERY);
        self
    }

    /// The window's size in partitions, ending now (default 2: today and yesterday).
    pub fn window(mut self, partitions: u32) -> Self {
        self.window = partitions;
        self
    }

    /// How long a lease lasts without renewal (default 10 min); renewed before every
    /// partition, so it must outlast one partition's rebuild. Saturates to
    /// [`MAX_REBUILD_EVERY`] (a year; a runner that dies holding it blocks the others
    /// that long); 0 ends the lease as it is taken, so another runner may take the
    /// projection between two partitions.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.min(MAX_REBUILD_EVERY);
        self
    }

    /// The runner's name in the lease (default `host:pid:n`).
    pub fn runner_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// The runner's name in the lease.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Called before each run with the projection and the window's partitions.
    pub fn before(mut self, f: impl Fn(&str, &[WindowPartition]) + Send + Sync + 'static) -> Self {
        self.before.push(Arc::new(f));
        self
    }

    /// Called after each run with its outcome or its error.
    pub fn after(
        mut self,
        f: impl Fn(std::result::Result<&RunOutcome, &Error>) + Send + Sync + 'static,
    ) -> Self {
        self.after.push(Arc::new(f));
        self
    }

    /// One run: take the lease (or skip), rebuild the window, give the lease up. The
    /// outcome is logged, counted through `metrics` and handed to the callbacks.
    pub fn run_once(&self) -> Result<RunOutcome> {
        let started = Instant::now();
        let result = self.run_inner();
        let projection = self.rebuilder.projection().to_owned();
        let outcome = match &result {
            Ok(RunOutcome::Ran(report)) => {
                metrics::gauge!(inbox_core::metrics::PROJECTION_DRIFT_ROWS, "projection" => projection.clone())
                    .set(report.rows_differing as f64);
                "ran"
            }
            Ok(RunOutcome::Skipped { holder }) => {
                tracing::info!(projection = %projection, runner = %self.id, holder = %holder, "rebuild skipped: another runner holds the projection");
                "skipped"
            }
            Err(err) => {
                tracing::error!(projection = %projection, runner = %self.id, error = %err, "scheduled rebuild failed");
                "failed"
            }
        };
        metrics::counter!(inbox_core::metrics::REBUILD_RUNS_TOTAL, "projection" => projection.clone(), "outcome" => outcome)
            .increment(1);
        metrics::histogram!(inbox_core::metrics::REBUILD_RUN_SECONDS, "projection" => projection)
            .record(started.elapsed().as_secs_f64());
        for f in &self.after {
            f(result.as_ref());
        }
        result
    }

    fn run_inner(&self) -> Result<RunOutcome> {
        let partitions = self.rebuilder.window(self.window)?;
        let projection = self.rebuilder.projection();
        for f in &self.before {
            f(projection, &partitions);
        }
        let holder = self.take_lease()?;
        if holder != self.id {
            return Ok(RunOutcome::Skipped { holder });
        }
        let rebuilt = self.rebuilder.rebuild_with(&partitions, &mut || {
            let holder = self.take_lease()?;
            if holder == self.id {
                Ok(())
            } else {
                Err(Error::RebuildLeaseLost {
                    projection: projection.to_owned(),
                    holder,
                })
            }
        });
        // Given up whatever happened; a lease left behind expires anyway.
        if let Err(err) = self.release_lease() {
            tracing::warn!(projection, error = %err, "could not give the rebuild lease up");
        }
        rebuilt.map(RunOutcome::Ran)
    }

    fn take_lease(&self) -> Result<String> {
        let store = self.rebuilder.store();
        let now = store.clock().now();
        let until = now
            .checked_add_signed(delta(self.lease))
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
        let mut conn = store.connection()?;
        let lease = RunLease {
            projection: self.rebuilder.projection(),
            runner: &self.id,
            now,
            until,
        };
        Ok(C::write_transaction(&mut *conn, |conn| {
            C::lease_run(conn, &lease)
        })?)
    }

    fn release_lease(&self) -> Result<()> {
        let mut conn = self.rebuilder.store().connection()?;
        Ok(C::release_run(
            &mut conn,
            self.rebuilder.projection(),
            &self.id,
        )?)
    }

    /// Runs at once, then every interval, until `stop` is set (checked every 100 ms).
    /// A failed run is logged and counted; the next one runs at its time.
    pub fn run(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let _ = self.run_once();
            let next = Instant::now() + self.every;
            while !stop.load(Ordering::Relaxed) && Instant::now() < next {
                std::thread::sleep(Duration::from_millis(100).min(self.every));
            }
        }
    }
}
