//! PostgreSQL's outbox statements: leasing (SKIP LOCKED, in commit order per
//! ordering key) and the NOTIFY that wakes relays; the rest is the shared DSL.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{PgConnection, QueryResult};

use crate::statements::OutboxOps;
use crate::OUTBOX_CHANNEL;

/// Delivered at commit, with the enqueuing connection's schema as its payload.
const NOTIFY: &str = "SELECT pg_notify($1, coalesce(current_schema(), ''))";

/// SKIP LOCKED: concurrent relays lease disjoint rows without waiting for each
/// other. Dead rows are never leased and hold nothing up.
///
/// Rows with an ordering key go out per key in (writing transaction, id) order,
/// which is commit order: ids are not (a row with a lower id can commit later,
/// and until then the NOT EXISTS cannot see it). So an ordered row is leased only
/// once its transaction is older than every transaction still running
/// (`pg_snapshot_xmin`): every row that precedes it has then committed (or rolled
/// back) and is visible; and only while no live row precedes it (leased, failed
/// or not yet due). A NULL `xact_id` (a row from before the column) counts as
/// long committed. Rows without an ordering key are leased at once.
const LEASE: &str = "\
    UPDATE outbox_messages SET leased_until = $2, leased_by = $3 \
    WHERE id IN ( \
        SELECT o.id FROM outbox_messages o \
        WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at <= $1 \
          AND (o.leased_until IS NULL OR o.leased_until <= $1) \
          AND (o.ordering_key IS NULL OR ( \
              coalesce(o.xact_id, '0'::xid8) < pg_snapshot_xmin(pg_current_snapshot()) \
              AND NOT EXISTS ( \
                  SELECT 1 FROM outbox_messages e \
                  WHERE e.ordering_key = o.ordering_key \
                    AND e.published_at IS NULL AND e.dead_at IS NULL \
                    AND (coalesce(e.xact_id, '0'::xid8), e.id) \
                      < (coalesce(o.xact_id, '0'::xid8), o.id)))) \
        ORDER BY o.id LIMIT $4 \
        FOR UPDATE SKIP LOCKED) \
    RETURNING id";

#[derive(QueryableByName)]
struct LeasedId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

impl OutboxOps for PgConnection {
    fn notify_enqueue(conn: &mut Self) -> QueryResult<()> {
        diesel::sql_query(NOTIFY)
            .bind::<Text, _>(OUTBOX_CHANNEL)
            .execute(conn)
            .map(|_| ())
    }

    fn lease_ids(
        conn: &mut Self,
        relay: &str,
        limit: i64,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> QueryResult<Vec<i64>> {
        let ids: Vec<LeasedId> = diesel::sql_query(LEASE)
            .bind::<diesel::sql_types::Timestamptz, _>(now)
            .bind::<diesel::sql_types::Timestamptz, _>(until)
            .bind::<Text, _>(relay)
            .bind::<BigInt, _>(limit)
            .load(conn)?;
        Ok(ids.into_iter().map(|r| r.id).collect())
    }

    crate::dsl::outbox_dsl!(pg);
}
