//! SQLite's retention statements: bounded deletes of published outbox rows and
//! `done` claims.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use diesel::{QueryResult, SqliteConnection};

use crate::statements::RetentionOps;

const PURGE_PUBLISHED: &str = "\
    DELETE FROM outbox_messages WHERE id IN ( \
        SELECT id FROM outbox_messages \
        WHERE published_at IS NOT NULL AND published_at < ?1 \
        ORDER BY published_at LIMIT ?2)";

const PURGE_DONE_CLAIMS: &str = "\
    DELETE FROM inbox_claims WHERE (message_key, consumer_group) IN ( \
        SELECT message_key, consumer_group FROM inbox_claims \
        WHERE status = 'done' AND updated_at < ?1 \
        ORDER BY updated_at LIMIT ?2)";

impl RetentionOps for SqliteConnection {
    fn purge_published(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize> {
        diesel::sql_query(PURGE_PUBLISHED)
            .bind::<diesel::sql_types::TimestamptzSqlite, _>(cutoff)
            .bind::<BigInt, _>(limit)
            .execute(conn)
    }

    fn purge_done_claims(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize> {
        diesel::sql_query(PURGE_DONE_CLAIMS)
            .bind::<diesel::sql_types::TimestamptzSqlite, _>(cutoff)
            .bind::<BigInt, _>(limit)
            .execute(conn)
    }
}
