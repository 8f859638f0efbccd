//! PostgreSQL's outbox statements: the ordering lock an enqueue takes, leasing (SKIP
//! LOCKED, in id order, which is commit order per ordering key) and the NOTIFY that
//! wakes relays, and the insert's `ON CONFLICT`; the rest is the shared DSL.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer, Text, Timestamptz};
use diesel::{PgConnection, QueryResult};
use inbox_core::{OutboxRow, UnreadableRow};

use crate::dsl::new_outbox_row;
use crate::rows::{decode_into, NewOutbox, StoredOutbox};
use crate::schema::outbox_messages;
use crate::statements::{OutboxOps, SharedOutboxOps};
use crate::{ORDERING_LOCK_CLASS, OUTBOX_CHANNEL};

/// Delivered at commit, with the enqueuing connection's schema as its payload.
const NOTIFY: &str = "SELECT pg_notify($1, coalesce(current_schema(), ''))";

/// The ordering locks of a call, one per stripe, taken in the order of the array
/// (the caller sorts it: two calls never take two stripes in opposite orders) and
/// held to the end of the transaction. The second key mixes the stripe into the
/// schema's hash (a bijection per schema), so stores in other schemas of the
/// database rarely share a lock; advisory locks are per database.
const LOCK_ORDERING: &str = "\
    SELECT pg_advisory_xact_lock($1, hashtext(coalesce(current_schema(), '')) # s) \
    FROM unnest($2::int4[]) AS s";

/// SKIP LOCKED: concurrent relays lease disjoint rows without waiting for each
/// other. Dead rows are never leased and hold nothing up.
///
/// Rows with an ordering key go out per key in id order, which is their commit
/// order: [`enqueue`](crate::enqueue) takes the key's ordering lock before the
/// INSERT draws the id and holds it to commit, so a row of the key with a higher
/// id was drawn after every lower id's transaction had ended, and a snapshot that
/// sees it sees them. A row is leased only while no live row of its key has a
/// lower id (leased, failed or not yet due). No wait for older transactions
/// (`xact_id` against the snapshot's xmin) is needed: a lower id of the key that is
/// still uncommitted cannot exist beside a committed higher one. Rows without an
/// ordering key are leased at once.
const LEASE: &str = "\
    UPDATE outbox_messages SET leased_until = $2, leased_by = $3 \
    WHERE id IN ( \
        SELECT o.id FROM outbox_messages o \
        WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at <= $1 \
          AND (o.leased_until IS NULL OR o.leased_until <= $1) \
          AND (o.ordering_key IS NULL OR NOT EXISTS ( \
              SELECT 1 FROM outbox_messages e \
              WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                AND e.published_at IS NULL AND e.dead_at IS NULL)) \
        ORDER BY o.id LIMIT $4 \
        FOR UPDATE SKIP LOCKED) \
    RETURNING id, message_key, exchange, routing_key, message_type, tenant, payload, \
        headers, ordering_key, created_at, attempts";

/// The ids a relay holds under one lease: read again when the lease's own read
/// back could not decode a row.
const LEASED_IDS: &str = "\
    SELECT id FROM outbox_messages \
    WHERE leased_by = $1 AND leased_until = $2 AND published_at IS NULL AND dead_at IS NULL \
    ORDER BY id";

#[derive(QueryableByName)]
struct LeasedId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

impl OutboxOps for PgConnection {
    fn lock_ordering(conn: &mut Self, stripes: &[i32]) -> QueryResult<()> {
        if stripes.is_empty() {
            return Ok(());
        }
        diesel::sql_query(LOCK_ORDERING)
            .bind::<Integer, _>(ORDERING_LOCK_CLASS)
            .bind::<Array<Integer>, _>(stripes)
            .execute(conn)
            .map(|_| ())
    }

    fn notify_enqueue(conn: &mut Self) -> QueryResult<()> {
        diesel::sql_query(NOTIFY)
            .bind::<Text, _>(OUTBOX_CHANNEL)
            .execute(conn)
            .map(|_| ())
    }

    fn lease_outbox(
        conn: &mut Self,
        relay: &str,
        limit: i64,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)> {
        let leased = diesel::sql_query(LEASE)
            .bind::<Timestamptz, _>(now)
            .bind::<Timestamptz, _>(until)
            .bind::<Text, _>(relay)
            .bind::<BigInt, _>(limit)
            .load::<StoredOutbox>(conn);
        match leased {
            Ok(stored) => {
                let mut rows = Vec::with_capacity(stored.len());
                let mut unreadable = Vec::new();
                for t in stored {
                    decode_into(t, &mut rows, &mut unreadable);
                }
                rows.sort_by_key(|r| r.id);
                unreadable.sort_by_key(|r| r.id);
                Ok((rows, unreadable))
            }
            // A value diesel cannot decode (a timestamp of `infinity` another
            // producer wrote): the lease stands (decoding fails on the client, after
            // the statement committed), and its rows are read again by id, the
            // undecodable ones apart. Should that read fail, they stay leased
            // until `until`.
            Err(diesel::result::Error::DeserializationError(_)) => {
                let ids: Vec<LeasedId> = diesel::sql_query(LEASED_IDS)
                    .bind::<Text, _>(relay)
                    .bind::<Timestamptz, _>(until)
                    .load(conn)?;
                let ids: Vec<i64> = ids.into_iter().map(|r| r.id).collect();
                Self::load_outbox(conn, &ids)
            }
            Err(other) => Err(other),
        }
    }

    fn insert_outbox(conn: &mut Self, row: &NewOutbox<'_>) -> QueryResult<Option<i64>> {
        new_outbox_row(row)
            .on_conflict_do_nothing()
            .returning(outbox_messages::id)
            .get_result(conn)
            .optional()
    }
}
