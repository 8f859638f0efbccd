//! SQLite's outbox statements: no ordering lock and no wake-up (one writer at a
//! time, so id order is commit order; relays poll), and leasing; the rest is the
//! shared DSL.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryResult, SqliteConnection};
use inbox_core::{OutboxRow, UnreadableRow};

use crate::dsl::new_outbox_row;
use crate::rows::NewOutbox;
use crate::schema::outbox_messages;
use crate::statements::{OutboxOps, SharedOutboxOps};

/// One writer at a time, so ids are handed out in commit order: id order is
/// an ordering key's order, with no lock and no transaction id. A transaction's
/// first write takes the database's write lock and holds it to commit, so no other
/// transaction draws an id between a transaction's first write and its commit.
const LEASE: &str = "\
    UPDATE outbox_messages SET leased_until = ?2, leased_by = ?3 \
    WHERE id IN ( \
        SELECT o.id FROM outbox_messages o \
        WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at <= ?1 \
          AND (o.leased_until IS NULL OR o.leased_until <= ?1) \
          AND NOT EXISTS ( \
              SELECT 1 FROM outbox_messages e \
              WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                AND e.published_at IS NULL AND e.dead_at IS NULL) \
        ORDER BY o.id LIMIT ?4) \
    RETURNING id";

#[derive(QueryableByName)]
struct LeasedId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

impl OutboxOps for SqliteConnection {
    fn lock_ordering(conn: &mut Self, stripes: &[i32]) -> QueryResult<()> {
        // The database's write lock, taken by the INSERT, serializes every writer.
        let _ = (conn, stripes);
        Ok(())
    }

    fn notify_enqueue(conn: &mut Self) -> QueryResult<()> {
        // Relays poll: nothing to wake.
        let _ = conn;
        Ok(())
    }

    fn lease_outbox(
        conn: &mut Self,
        relay: &str,
        limit: i64,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)> {
        // The lease and the read of its rows in one transaction (IMMEDIATE, as every
        // write of the store's): a read that fails takes the lease back with it.
        conn.immediate_transaction(|conn| {
            let ids: Vec<LeasedId> = diesel::sql_query(LEASE)
                .bind::<diesel::sql_types::TimestamptzSqlite, _>(now)
                .bind::<diesel::sql_types::TimestamptzSqlite, _>(until)
                .bind::<Text, _>(relay)
                .bind::<BigInt, _>(limit)
                .load(conn)?;
            let ids: Vec<i64> = ids.into_iter().map(|r| r.id).collect();
            Self::load_outbox(conn, &ids)
        })
    }

    fn insert_outbox(conn: &mut Self, row: &NewOutbox<'_>) -> QueryResult<Option<i64>> {
        new_outbox_row(row)
            .on_conflict_do_nothing()
            .returning(outbox_messages::id)
            .get_result(conn)
            .optional()
    }
}
