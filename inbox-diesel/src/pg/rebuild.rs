//! The rebuild's PostgreSQL statements.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Text, Timestamptz};
use diesel::PgConnection;

use crate::rebuild::ops::{
    rebuild_dsl, release, take_over, CoverClaims, Covered, RebuildOps, RunLease,
};

rebuild_dsl!(PgConnection);

#[derive(QueryableByName)]
struct Got {
    #[diesel(sql_type = Bool)]
    got: bool,
}

impl RebuildOps for PgConnection {
    fn lock_exclusive(conn: &mut Self, key: i64, timeout: Duration) -> QueryResult<bool> {
        // Every lock wait of this transaction is bounded, the exclusive request first:
        // live batches that arrive while it waits queue behind it.
        conn.batch_execute(&format!(
            "SET LOCAL lock_timeout = {}",
            timeout.as_millis().max(1)
        ))?;
        let free = diesel::sql_query("SELECT pg_try_advisory_xact_lock($1) AS got")
            .bind::<BigInt, _>(key)
            .get_result::<Got>(conn)?
            .got;
        if free {
            return Ok(false);
        }
        diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
            .bind::<BigInt, _>(key)
            .execute(conn)?;
        Ok(true)
    }

    fn read_snapshot<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>,
    {
        conn.build_transaction()
            .read_only()
            .repeatable_read()
            .run(f)
    }

    fn cover(conn: &mut Self, c: &CoverClaims<'_>) -> QueryResult<Covered> {
        // The cover is one step over locked rows. Operator writes (replay, bulk
        // replay, redrive) take no projection lock (they cannot know its name), so
        // each statement below must see rows no replay can change until the commit:
        // first the letters the cover may resolve (by id), then the claims it covers
        // (by key), the order a replay takes them in (its letter, then its claim), so
        // the two never wait for each other in a circle. A replay that committed
        // before these locks is seen (its claim is `failed`: covered, its copy a
        // duplicate); one that comes after waits, then finds its letter resolved or
        // its claim's digest gone.
        diesel::sql_query(
            "SELECT id FROM inbox_dead_letters \
             WHERE consumer_group = $1 AND message_key = ANY($2::text[]) \
               AND resolved_at IS NULL \
             ORDER BY id FOR UPDATE",
        )
        .bind::<Text, _>(c.group)
        .bind::<Array<Text>, _>(c.keys)
        .execute(conn)?;
        diesel::sql_query(
            "SELECT message_key FROM inbox_claims \
             WHERE consumer_group = $1 AND message_key = ANY($2::text[]) \
             ORDER BY message_key FOR UPDATE",
        )
        .bind::<Text, _>(c.group)
        .bind::<Array<Text>, _>(c.keys)
        .execute(conn)?;
        // One statement over an array whatever the partition's size: a row per
        // covered event that has no claim yet, in key order.
        let recorded = diesel::sql_query(
            "INSERT INTO inbox_claims (consumer_group, message_key, message_type, \
                 payload_digest, status, attempts, starts, first_seen_at, updated_at, covered_at) \
             SELECT $1, k, $2, ''::bytea, 'done', 0, 0, $3, $3, $3 \
             FROM unnest($4::text[]) AS k ORDER BY k \
             ON CONFLICT (consumer_group, message_key) DO NOTHING",
        )
        .bind::<Text, _>(c.group)
        .bind::<Text, _>(c.message_type)
        .bind::<Timestamptz, _>(c.now)
        .bind::<Array<Text>, _>(c.keys)
        .execute(conn)?;
        let mut out = Covered {
            recorded: recorded as u64,
            ..Covered::default()
        };
        take_over(conn, c, c.keys, &mut out)?;
        Ok(out)
    }

    fn lease_run(conn: &mut Self, lease: &RunLease<'_>) -> QueryResult<String> {
        shared_lease(conn, lease)
    }

    fn release_run(conn: &mut Self, projection: &str, runner: &str) -> QueryResult<()> {
        release(conn, projection, runner)
    }
}
