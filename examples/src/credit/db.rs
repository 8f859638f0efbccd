//! The ledger's tables and its guarded writes, on PostgreSQL and SQLite.
//!
//! Every transition is one conditional `UPDATE ... WHERE <state> RETURNING`: only the
//! writer whose update matched appends the ledger row, in the same transaction. Nothing
//! here reads a flag and then writes it.

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::{PgConnection, SqliteConnection};

/// A job's lifecycle state (`jobs.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum JobState {
    /// Attempt `attempts` is enqueued (`job.run`), not started.
    Queued,
    /// Attempt `attempts` runs.
    Running,
    /// The result exists: net `-cost`.
    Delivered,
    /// A permanent failure, never delivered: net `0`.
    Failed,
    /// Every attempt failed, never delivered: net `0`; `job.dead` was enqueued.
    Dead,
}

impl JobState {
    /// Every state, in display order.
    pub const ALL: [JobState; 5] = [
        JobState::Delivered,
        JobState::Failed,
        JobState::Dead,
        JobState::Queued,
        JobState::Running,
    ];

    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
            Self::Dead => "dead",
        }
    }

    /// Parses the column's value.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Whether no further run is planned (a late success still delivers a failed or
    /// dead job).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Delivered | Self::Failed | Self::Dead)
    }
}

/// A row of `jobs`.
#[derive(Clone, Debug, PartialEq, Eq, QueryableByName)]
pub struct JobRow {
    /// The job.
    #[diesel(sql_type = Text)]
    pub job_id: String,
    /// Its user.
    #[diesel(sql_type = Text)]
    pub user_id: String,
    /// The cost fixed at charge time.
    #[diesel(sql_type = BigInt)]
    pub cost: i64,
    /// `jobs.state`.
    #[diesel(sql_type = Text)]
    pub state: String,
    /// The current (or last) attempt, from 1.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The refund guard.
    #[diesel(sql_type = Bool)]
    pub refunded: bool,
    /// The reclaim guard.
    #[diesel(sql_type = Bool)]
    pub reclaimed: bool,
    /// The last failure's reason.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
}

/// A row of `credit_ledger`.
#[derive(Clone, Debug, PartialEq, Eq, QueryableByName)]
pub struct LedgerRow {
    /// Append order.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// The job.
    #[diesel(sql_type = Text)]
    pub job_id: String,
    /// `charge`, `refund` or `reclaim`.
    #[diesel(sql_type = Text)]
    pub entry_type: String,
    /// Signed: a charge and a reclaim are negative, a refund positive.
    #[diesel(sql_type = BigInt)]
    pub amount: i64,
}

/// What a failure signal decided for the job's current attempt.
#[derive(Clone, Debug, PartialEq, Eq, QueryableByName)]
pub struct Fate {
    /// The new state: `queued` (retry), `failed` or `dead`.
    #[diesel(sql_type = Text)]
    pub state: String,
    /// The attempt now current (the retry's number when queued).
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The job's user.
    #[diesel(sql_type = Text)]
    pub user_id: String,
    /// The job's cost.
    #[diesel(sql_type = BigInt)]
    pub cost: i64,
}

#[derive(QueryableByName)]
struct Cost {
    #[diesel(sql_type = BigInt)]
    cost: i64,
}

#[derive(QueryableByName)]
struct Started {
    #[diesel(sql_type = Text)]
    user_id: String,
    #[diesel(sql_type = BigInt)]
    cost: i64,
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The example's own migrations (not the framework's), applied in order and recorded
/// in `credit_migrations`.
const PG_MIGRATIONS: &[(&str, &str)] = &[(
    "0001_ledger",
    include_str!("migrations/postgres/0001_ledger.sql"),
)];
const SQLITE_MIGRATIONS: &[(&str, &str)] = &[(
    "0001_ledger",
    include_str!("migrations/sqlite/0001_ledger.sql"),
)];

/// The refund guard: only a job not yet refunded and not delivered (a late timeout
/// after the success refunds nothing).
const REFUND: &str = "UPDATE jobs SET refunded = TRUE, refunded_at = $2, updated_at = $2 \
     WHERE job_id = $1 AND NOT refunded AND state <> 'delivered' RETURNING cost";

/// The fate of the current attempt, decided once: only while an attempt is
/// outstanding (`queued` or `running`) and, when the signal names one, only for that
/// attempt. A transient failure with attempts left queues the next attempt.
const FAIL_ATTEMPT: &str = "UPDATE jobs SET \
     state = CASE WHEN $2 AND attempts < $3 THEN 'queued' WHEN $2 THEN 'dead' ELSE 'failed' END, \
     attempts = CASE WHEN $2 AND attempts < $3 THEN attempts + 1 ELSE attempts END, \
     last_error = $4, updated_at = $5 \
     WHERE job_id = $1 AND state IN ('queued', 'running') AND ($6 IS NULL OR attempts = $6) \
     RETURNING state, attempts, user_id, cost";

/// Delivery: once.
const DELIVER: &str = "UPDATE jobs SET state = 'delivered', delivered_at = $2, updated_at = $2 \
     WHERE job_id = $1 AND state <> 'delivered' RETURNING cost";

/// The reclaim guard: only a delivered job that was refunded and not yet reclaimed.
const RECLAIM: &str = "UPDATE jobs SET reclaimed = TRUE, reclaimed_at = $2, updated_at = $2 \
     WHERE job_id = $1 AND refunded AND NOT reclaimed AND state = 'delivered' RETURNING cost";

/// The runner's start: only the attempt the job waits for.
const START: &str = "UPDATE jobs SET state = 'running', updated_at = $3 \
     WHERE job_id = $1 AND state = 'queued' AND attempts = $2 RETURNING user_id, cost";

const APPEND: &str =
    "INSERT INTO credit_ledger (job_id, entry_type, amount, created_at) VALUES ($1, $2, $3, $4)";

/// The ledger's tables on a backend the example runs on.
pub trait CreditDb: Connection + Send + 'static {
    /// Applies the example's migrations that are missing (concurrent callers wait for
    /// each other).
    fn migrate_credit(&mut self) -> QueryResult<()>;

    /// Runs `f` in a write transaction (SQLite: `BEGIN IMMEDIATE`).
    fn write_transaction<T, E, F>(&mut self, f: F) -> Result<T, E>
    where
        F: FnOnce(&mut Self) -> Result<T, E>,
        E: From<diesel::result::Error>;

    /// Inserts the job (state `queued`, attempt 1) and appends its charge of `-cost`.
    /// Call it inside a transaction that also enqueues attempt 1.
    fn insert_job(
        &mut self,
        job_id: &str,
        user_id: &str,
        cost: i64,
        now: DateTime<Utc>,
    ) -> QueryResult<()>;

    /// The refund guard; appends `+cost` and returns it when this call won.
    fn refund(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<Option<i64>>;

    /// Decides the current attempt's fate once (see [`Fate`]); `None` when no attempt
    /// was outstanding (the job is delivered, failed, dead, or past `attempt`).
    fn fail_attempt(
        &mut self,
        job_id: &str,
        transient: bool,
        max_attempts: i32,
        reason: &str,
        attempt: Option<i32>,
        now: DateTime<Utc>,
    ) -> QueryResult<Option<Fate>>;

    /// Marks the job delivered; whether this call did.
    fn deliver(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<bool>;

    /// The reclaim guard; appends `-cost` (the cost recorded at charge time) and
    /// returns it when this call won.
    fn reclaim(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<Option<i64>>;

    /// Starts `attempt` if the job waits for it; its (user, cost) when it did.
    fn start(
        &mut self,
        job_id: &str,
        attempt: i32,
        now: DateTime<Utc>,
    ) -> QueryResult<Option<(String, i64)>>;

    /// Whether the job exists.
    fn job_exists(&mut self, job_id: &str) -> QueryResult<bool>;

    /// Every job, by id.
    fn jobs(&mut self) -> QueryResult<Vec<JobRow>>;

    /// Every ledger row, in append order.
    fn ledger(&mut self) -> QueryResult<Vec<LedgerRow>>;

    /// Jobs and ledger read in one snapshot (a check never sees half a transition).
    fn snapshot(&mut self) -> QueryResult<(Vec<JobRow>, Vec<LedgerRow>)>;
}

/// The same statements on both backends; the DDL, the time type and the write
/// transaction differ.
macro_rules! credit_db {
    ($conn:ty, $ts:ty, $migrations:expr, $lock:expr, $tx:ident, $q:path) => {
        impl CreditDb for $conn {
            fn migrate_credit(&mut self) -> QueryResult<()> {
                self.$tx(|conn| {
                    if let Some(lock) = $lock {
                        conn.batch_execute(lock)?;
                    }
                    conn.batch_execute(
                        "CREATE TABLE IF NOT EXISTS credit_migrations \
                         (version TEXT PRIMARY KEY NOT NULL, applied_at TEXT NOT NULL)",
                    )?;
                    let done: Vec<Version> =
                        diesel::sql_query("SELECT version FROM credit_migrations").load(conn)?;
                    for (version, sql) in $migrations {
                        if done.iter().any(|v| v.version == *version) {
                            continue;
                        }
                        conn.batch_execute(sql)?;
                        diesel::sql_query($q(
                            "INSERT INTO credit_migrations (version, applied_at) VALUES ($1, $2)",
                        ))
                        .bind::<Text, _>(*version)
                        .bind::<Text, _>(Utc::now().to_rfc3339())
                        .execute(conn)?;
                    }
                    Ok(())
                })
            }

            fn write_transaction<T, E, F>(&mut self, f: F) -> Result<T, E>
            where
                F: FnOnce(&mut Self) -> Result<T, E>,
                E: From<diesel::result::Error>,
            {
                self.$tx(f)
            }

            fn insert_job(
                &mut self,
                job_id: &str,
                user_id: &str,
                cost: i64,
                now: DateTime<Utc>,
            ) -> QueryResult<()> {
                diesel::sql_query($q(
                    "INSERT INTO jobs (job_id, user_id, cost, state, attempts, created_at, updated_at) \
                     VALUES ($1, $2, $3, 'queued', 1, $4, $4)",
                ))
                .bind::<Text, _>(job_id)
                .bind::<Text, _>(user_id)
                .bind::<BigInt, _>(cost)
                .bind::<$ts, _>(now)
                .execute(self)?;
                append(self, job_id, "charge", -cost, now)
            }

            fn refund(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<Option<i64>> {
                let won: Option<Cost> = diesel::sql_query($q(REFUND))
                    .bind::<Text, _>(job_id)
                    .bind::<$ts, _>(now)
                    .get_result(self)
                    .optional()?;
                match won {
                    Some(Cost { cost }) => {
                        append(self, job_id, "refund", cost, now)?;
                        Ok(Some(cost))
                    }
                    None => Ok(None),
                }
            }

            fn fail_attempt(
                &mut self,
                job_id: &str,
                transient: bool,
                max_attempts: i32,
                reason: &str,
                attempt: Option<i32>,
                now: DateTime<Utc>,
            ) -> QueryResult<Option<Fate>> {
                diesel::sql_query($q(FAIL_ATTEMPT))
                    .bind::<Text, _>(job_id)
                    .bind::<Bool, _>(transient)
                    .bind::<Integer, _>(max_attempts)
                    .bind::<Text, _>(reason)
                    .bind::<$ts, _>(now)
                    .bind::<Nullable<Integer>, _>(attempt)
                    .get_result(self)
                    .optional()
            }

            fn deliver(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<bool> {
                let done: Option<Cost> = diesel::sql_query($q(DELIVER))
                    .bind::<Text, _>(job_id)
                    .bind::<$ts, _>(now)
                    .get_result(self)
                    .optional()?;
                Ok(done.is_some())
            }

            fn reclaim(&mut self, job_id: &str, now: DateTime<Utc>) -> QueryResult<Option<i64>> {
                let won: Option<Cost> = diesel::sql_query($q(RECLAIM))
                    .bind::<Text, _>(job_id)
                    .bind::<$ts, _>(now)
                    .get_result(self)
                    .optional()?;
                match won {
                    Some(Cost { cost }) => {
                        append(self, job_id, "reclaim", -cost, now)?;
                        Ok(Some(cost))
                    }
                    None => Ok(None),
                }
            }

            fn start(
                &mut self,
                job_id: &str,
                attempt: i32,
                now: DateTime<Utc>,
            ) -> QueryResult<Option<(String, i64)>> {
                let started: Option<Started> = diesel::sql_query($q(START))
                    .bind::<Text, _>(job_id)
                    .bind::<Integer, _>(attempt)
                    .bind::<$ts, _>(now)
                    .get_result(self)
                    .optional()?;
                Ok(started.map(|s| (s.user_id, s.cost)))
            }

            fn job_exists(&mut self, job_id: &str) -> QueryResult<bool> {
                let found: Count =
                    diesel::sql_query($q("SELECT COUNT(*) AS n FROM jobs WHERE job_id = $1"))
                        .bind::<Text, _>(job_id)
                        .get_result(self)?;
                Ok(found.n > 0)
            }

            fn jobs(&mut self) -> QueryResult<Vec<JobRow>> {
                diesel::sql_query(
                    "SELECT job_id, user_id, cost, state, attempts, refunded, reclaimed, last_error \
                     FROM jobs ORDER BY job_id",
                )
                .load(self)
            }

            fn ledger(&mut self) -> QueryResult<Vec<LedgerRow>> {
                diesel::sql_query(
                    "SELECT id, job_id, entry_type, amount FROM credit_ledger ORDER BY id",
                )
                .load(self)
            }

            fn snapshot(&mut self) -> QueryResult<(Vec<JobRow>, Vec<LedgerRow>)> {
                self.snapshot_of()
            }
        }

        impl Appender for $conn {
            fn append_row(
                &mut self,
                job_id: &str,
                entry_type: &str,
                amount: i64,
                now: DateTime<Utc>,
            ) -> QueryResult<()> {
                diesel::sql_query($q(APPEND))
                    .bind::<Text, _>(job_id)
                    .bind::<Text, _>(entry_type)
                    .bind::<BigInt, _>(amount)
                    .bind::<$ts, _>(now)
                    .execute(self)
                    .map(|_| ())
            }
        }
    };
}

/// Appends a ledger row (the only insert into `credit_ledger`).
trait Appender {
    fn append_row(
        &mut self,
        job_id: &str,
        entry_type: &str,
        amount: i64,
        now: DateTime<Utc>,
    ) -> QueryResult<()>;
}

fn append<C: Appender>(
    conn: &mut C,
    job_id: &str,
    entry_type: &str,
    amount: i64,
    now: DateTime<Utc>,
) -> QueryResult<()> {
    conn.append_row(job_id, entry_type, amount, now)
}

/// Two processes starting at once: the second waits for the first's migrations.
const PG_MIGRATION_LOCK: Option<&str> =
    Some("SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.credit_migrations'))");

credit_db!(
    PgConnection,
    diesel::sql_types::Timestamptz,
    PG_MIGRATIONS,
    PG_MIGRATION_LOCK,
    transaction,
    std::convert::identity
);
credit_db!(
    SqliteConnection,
    diesel::sql_types::TimestamptzSqlite,
    SQLITE_MIGRATIONS,
    None::<&str>,
    immediate_transaction,
    sqlite_numbered
);

impl Snapshot for PgConnection {
    fn snapshot_of(&mut self) -> QueryResult<(Vec<JobRow>, Vec<LedgerRow>)> {
        self.build_transaction()
            .repeatable_read()
            .read_only()
            .run(|conn| Ok((conn.jobs()?, conn.ledger()?)))
    }
}

impl Snapshot for SqliteConnection {
    fn snapshot_of(&mut self) -> QueryResult<(Vec<JobRow>, Vec<LedgerRow>)> {
        self.transaction(|conn| Ok((conn.jobs()?, conn.ledger()?)))
    }
}

trait Snapshot {
    fn snapshot_of(&mut self) -> QueryResult<(Vec<JobRow>, Vec<LedgerRow>)>;
}

/// SQLite reads `$1` as a *named* parameter, numbered by first appearance; `?1` is
/// parameter 1 wherever it appears, as `$1` is on PostgreSQL.
fn sqlite_numbered(sql: &str) -> String {
    sql.replace('$', "?")
}
