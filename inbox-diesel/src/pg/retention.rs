//! PostgreSQL's retention statements: bounded deletes of published outbox rows,
//! `done` claims, discarded dead letters and expired idempotency records.
//!
//! Three rules keep a purge cheap and safe on a table of tens of millions of rows
//! while consumers write to it and other instances purge too:
//!
//! - the rows come from the index of their timestamp (partial where the table keeps
//!   other rows for good; `idempotency_keys (created_at)` is plain), oldest first,
//!   `LIMIT` rows per batch (never a scan of the table);
//! - each batch starts at the newest timestamp the previous batch deleted: until
//!   vacuum runs, deleted rows stay in the index, and a batch that started from the
//!   oldest row again would walk over every row the purge has deleted so far;
//! - `FOR UPDATE SKIP LOCKED`: a row a running batch or relay holds is left for the
//!   next purge, so a purge never waits for (or deadlocks with) a consumer; and a
//!   transaction-level advisory lock per table lets one purge of a kind run at a
//!   time: a second one (another instance) finds it held and stops at once instead
//!   of scanning behind the first.
//!
//! The statements' texts are built at compile time by `concat!`, which takes only
//! literals: `purge_sql!`/`count_sql!` and `for_target!` are the macros that do
//! it, so each target's table, timestamp and rows are written once.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Nullable, Timestamptz};
use diesel::{PgConnection, QueryResult};

use crate::rows::{PurgeBatch, PurgeTarget};
use crate::statements::RetentionOps;
use crate::PURGE_LOCK_CLASS;

/// One purge statement: `$1` the cutoff, `$2` the limit, `$3` where the previous
/// batch stopped (NULL for the first). Rows are deleted by the `ctid`s the locking
/// read returned: they are locked, so they cannot have moved.
macro_rules! purge_sql {
    ($table:literal, $at:literal, $keep:literal) => {
        concat!(
            "WITH gone AS (DELETE FROM ",
            $table,
            " WHERE ctid = ANY(ARRAY(SELECT ctid FROM ",
            $table,
            " WHERE ",
            $keep,
            " AND ",
            $at,
            " < $1 AND ",
            $at,
            " >= COALESCE($3, '-infinity'::timestamptz) ORDER BY ",
            $at,
            " LIMIT $2 FOR UPDATE SKIP LOCKED)) RETURNING ",
            $at,
            " AS at) SELECT count(*) AS deleted, max(at) AS last FROM gone"
        )
    };
}

/// The dry-run count of what a purge of the same target and cutoff deletes: the
/// same table, timestamp and rows as [`purge_sql`], `$1` the cutoff.
macro_rules! count_sql {
    ($table:literal, $at:literal, $keep:literal) => {
        concat!(
            "SELECT count(*) AS n FROM ",
            $table,
            " WHERE ",
            $keep,
            " AND ",
            $at,
            " < $1"
        )
    };
}

/// Each target's table, timestamp and rows, written once: the purge and its dry-run
/// count are both built from them, so they cannot disagree.
macro_rules! for_target {
    ($target:expr, $sql:ident) => {
        match $target {
            PurgeTarget::PublishedOutboxRows => {
                $sql!(
                    "outbox_messages",
                    "published_at",
                    "published_at IS NOT NULL"
                )
            }
            PurgeTarget::DoneClaims => $sql!("inbox_claims", "updated_at", "status = 'done'"),
            PurgeTarget::DiscardedDeadLetters => $sql!(
                "inbox_dead_letters",
                "discarded_at",
                "discarded_at IS NOT NULL"
            ),
            PurgeTarget::ExpiredIdempotencyKeys => $sql!(
                "idempotency_keys",
                "created_at",
                "(status <> 'in_flight' OR (committed_at IS NULL AND lease_until < $1))"
            ),
        }
    };
}

/// The statement that deletes one batch of `target` (see [`purge_sql`]); public,
/// hidden, for the tests that read its plan.
#[doc(hidden)]
pub fn purge_statement(target: PurgeTarget) -> &'static str {
    for_target!(target, purge_sql)
}

/// The statement that counts what a purge of `target` deletes (see [`count_sql`]).
fn count_statement(target: PurgeTarget) -> &'static str {
    for_target!(target, count_sql)
}

/// The purge lock of `target`'s table, tried, never waited for.
fn lock_statement(target: PurgeTarget) -> &'static str {
    match target {
        PurgeTarget::PublishedOutboxRows => {
            "SELECT pg_try_advisory_xact_lock($1, 'outbox_messages'::regclass::oid::int4) AS held"
        }
        PurgeTarget::DoneClaims => {
            "SELECT pg_try_advisory_xact_lock($1, 'inbox_claims'::regclass::oid::int4) AS held"
        }
        PurgeTarget::DiscardedDeadLetters => {
            "SELECT pg_try_advisory_xact_lock($1, 'inbox_dead_letters'::regclass::oid::int4) AS held"
        }
        PurgeTarget::ExpiredIdempotencyKeys => {
            "SELECT pg_try_advisory_xact_lock($1, 'idempotency_keys'::regclass::oid::int4) AS held"
        }
    }
}

#[derive(QueryableByName)]
struct Held {
    #[diesel(sql_type = Bool)]
    held: bool,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct Deleted {
    #[diesel(sql_type = BigInt)]
    deleted: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    last: Option<DateTime<Utc>>,
}

impl RetentionOps for PgConnection {
    fn purge_batch(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
        limit: i64,
        from: Option<DateTime<Utc>>,
    ) -> QueryResult<PurgeBatch> {
        let lock: Held = diesel::sql_query(lock_statement(target))
            .bind::<diesel::sql_types::Integer, _>(PURGE_LOCK_CLASS)
            .get_result(conn)?;
        if !lock.held {
            return Ok(PurgeBatch {
                busy: true,
                ..PurgeBatch::default()
            });
        }
        let done: Deleted = diesel::sql_query(purge_statement(target))
            .bind::<Timestamptz, _>(cutoff)
            .bind::<BigInt, _>(limit)
            .bind::<Nullable<Timestamptz>, _>(from)
            .get_result(conn)?;
        Ok(PurgeBatch {
            deleted: u64::try_from(done.deleted).unwrap_or(0),
            resume_from: done.last,
            busy: false,
        })
    }

    fn count_purgeable(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
    ) -> QueryResult<i64> {
        let count: Count = diesel::sql_query(count_statement(target))
            .bind::<Timestamptz, _>(cutoff)
            .get_result(conn)?;
        Ok(count.n)
    }
}
