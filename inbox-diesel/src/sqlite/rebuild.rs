//! The rebuild's SQLite statements. SQLite has one writer: the rebuild's `BEGIN
//! IMMEDIATE` transaction is its exclusive lock, and a live batch's write transaction
//! waits for it (`busy_timeout`) before it claims. The same holds for operator writes
//! (a replay, a redrive): none can commit between the cover's statements, so the
//! cover needs no row locks here (PostgreSQL's takes them).

use std::time::Duration;

use diesel::prelude::*;
use diesel::SqliteConnection;

use crate::rebuild::ops::{
    rebuild_dsl, release, take_over, CoverClaims, Covered, RebuildOps, RunLease, NO_DIGEST,
};

rebuild_dsl!(SqliteConnection);

/// Keys per statement of the take-over (SQLite binds at most 32,766 parameters).
const CHUNK: usize = 500;

impl RebuildOps for SqliteConnection {
    fn lock_exclusive(_conn: &mut Self, _key: i64, _timeout: Duration) -> QueryResult<bool> {
        // The immediate write transaction already excludes every other writer.
        Ok(false)
    }

    fn read_snapshot<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>,
    {
        // A deferred transaction reads one snapshot from its first read to its end.
        conn.transaction(f)
    }

    fn cover(conn: &mut Self, c: &CoverClaims<'_>) -> QueryResult<Covered> {
        use crate::rebuild::ops::tables::covered_claims::dsl::*;
        use crate::ClaimStatus;
        let mut out = Covered::default();
        for chunk in c.keys.chunks(CHUNK) {
            // diesel's SQLite backend has no multi-row upsert: a statement per row,
            // in-process, costs no round trip.
            for k in chunk {
                out.recorded += diesel::insert_into(covered_claims)
                    .values((
                        consumer_group.eq(c.group),
                        message_key.eq(*k),
                        message_type.eq(c.message_type),
                        payload_digest.eq(NO_DIGEST),
                        status.eq(ClaimStatus::Done.as_str()),
                        attempts.eq(0),
                        starts.eq(0),
                        first_seen_at.eq(crate::schema::Stamp(c.now)),
                        updated_at.eq(crate::schema::Stamp(c.now)),
                        covered_at.eq(Some(crate::schema::Stamp(c.now))),
                    ))
                    .on_conflict((consumer_group, message_key))
                    .do_nothing()
                    .execute(conn)? as u64;
            }
            take_over(conn, c, chunk, &mut out)?;
        }
        Ok(out)
    }

    fn lease_run(conn: &mut Self, lease: &RunLease<'_>) -> QueryResult<String> {
        shared_lease(conn, lease)
    }

    fn release_run(conn: &mut Self, projection: &str, runner: &str) -> QueryResult<()> {
        release(conn, projection, runner)
    }
}
