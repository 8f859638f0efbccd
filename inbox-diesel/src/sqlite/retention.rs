//! SQLite's retention statements: bounded deletes of published outbox rows, `done`
//! claims, discarded dead letters and expired idempotency records.
//!
//! The same rows as PostgreSQL's, oldest first from the timestamp's index,
//! each batch starting where the previous one stopped. SQLite has one writer: every
//! batch is an immediate transaction, so two purges (or a purge and a consumer) take
//! turns batch by batch, and a row deleted by one is not there for the other; there
//! are no row locks to skip and no dead rows left in the index.
//!
//! The statements' texts are built at compile time by `concat!`, which takes only
//! literals: `purge_sql!`/`count_sql!` and `for_target!` are the macros that do
//! it, so each target's table, timestamp and rows are written once.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, TimestamptzSqlite};
use diesel::{QueryResult, SqliteConnection};

use crate::rows::{PurgeBatch, PurgeTarget};
use crate::statements::RetentionOps;

/// One purge statement: `?1` the cutoff, `?2` the limit, `?3` where the previous
/// batch stopped (NULL for the first).
macro_rules! purge_sql {
    ($table:literal, $key:literal, $columns:literal, $at:literal, $keep:literal) => {
        concat!(
            "DELETE FROM ",
            $table,
            " WHERE ",
            $key,
            " IN (SELECT ",
            $columns,
            " FROM ",
            $table,
            " WHERE ",
            $keep,
            " AND ",
            $at,
            " < ?1 AND (?3 IS NULL OR ",
            $at,
            " >= ?3) ORDER BY ",
            $at,
            " LIMIT ?2) RETURNING ",
            $at,
            " AS at"
        )
    };
}

/// The dry-run count of what a purge of the same target and cutoff deletes: the
/// same table, timestamp and rows as [`purge_sql`], `?1` the cutoff.
macro_rules! count_sql {
    ($table:literal, $key:literal, $columns:literal, $at:literal, $keep:literal) => {
        concat!(
            "SELECT count(*) AS n FROM ",
            $table,
            " WHERE ",
            $keep,
            " AND ",
            $at,
            " < ?1"
        )
    };
}

/// Each target's table, key, timestamp and rows, written once: the purge and its
/// dry-run count are both built from them, so they cannot disagree.
macro_rules! for_target {
    ($target:expr, $sql:ident) => {
        match $target {
            PurgeTarget::PublishedOutboxRows => $sql!(
                "outbox_messages",
                "id",
                "id",
                "published_at",
                "published_at IS NOT NULL"
            ),
            PurgeTarget::DoneClaims => $sql!(
                "inbox_claims",
                "(message_key, consumer_group)",
                "message_key, consumer_group",
                "updated_at",
                "status = 'done'"
            ),
            PurgeTarget::DiscardedDeadLetters => $sql!(
                "inbox_dead_letters",
                "id",
                "id",
                "discarded_at",
                "discarded_at IS NOT NULL"
            ),
            PurgeTarget::ExpiredIdempotencyKeys => $sql!(
                "idempotency_keys",
                "(caller, idempotency_key)",
                "caller, idempotency_key",
                "created_at",
                "(status <> 'in_flight' OR (committed_at IS NULL AND lease_until < ?1))"
            ),
        }
    };
}

fn purge_statement(target: PurgeTarget) -> &'static str {
    for_target!(target, purge_sql)
}

fn count_statement(target: PurgeTarget) -> &'static str {
    for_target!(target, count_sql)
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct Deleted {
    #[diesel(sql_type = TimestamptzSqlite)]
    at: DateTime<Utc>,
}

impl RetentionOps for SqliteConnection {
    fn purge_batch(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
        limit: i64,
        from: Option<DateTime<Utc>>,
    ) -> QueryResult<PurgeBatch> {
        let gone: Vec<Deleted> = diesel::sql_query(purge_statement(target))
            .bind::<TimestamptzSqlite, _>(cutoff)
            .bind::<BigInt, _>(limit)
            .bind::<Nullable<TimestamptzSqlite>, _>(from)
            .load(conn)?;
        Ok(PurgeBatch {
            deleted: gone.len() as u64,
            resume_from: gone.iter().map(|d| d.at).max(),
            busy: false,
        })
    }

    fn count_purgeable(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
    ) -> QueryResult<i64> {
        let count: Count = diesel::sql_query(count_statement(target))
            .bind::<TimestamptzSqlite, _>(cutoff)
            .get_result(conn)?;
        Ok(count.n)
    }
}
