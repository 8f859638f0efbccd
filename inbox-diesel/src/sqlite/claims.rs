//! SQLite's claim statements: the claim once per row (diesel's SQLite backend has no
//! multi-row upsert), the rest the shared DSL.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::{QueryResult, SqliteConnection};
use inbox_core::ConsumerGroup;

use crate::dsl::{claim_target, due_condition};
use crate::knobs::Knobs;
use crate::rows::{ClaimRow, Claimed};
use crate::schema::Stamp;
use crate::statements::{claim_conflict, ClaimOps};
use crate::ClaimStatus;

/// One row's claim: the upsert PostgreSQL's claim statement runs over the whole
/// batch, under the same conflict target and condition.
fn claim_one(
    conn: &mut SqliteConnection,
    group: &ConsumerGroup,
    row: &ClaimRow<'_>,
    now: DateTime<Utc>,
) -> QueryResult<Option<(String, i32)>> {
    use crate::schema::inbox_claims::dsl::*;
    use diesel::query_dsl::methods::FilterDsl;
    let conflict = claim_conflict(true);
    diesel::insert_into(inbox_claims)
        .values((
            consumer_group.eq(group.as_str()),
            message_key.eq(row.key),
            message_type.eq(row.message_type),
            tenant.eq(row.tenant),
            payload_digest.eq(row.digest),
            status.eq(ClaimStatus::Done.as_str()),
            attempts.eq(0),
            starts.eq(0),
            first_seen_at.eq(Stamp(now)),
            updated_at.eq(Stamp(now)),
        ))
        .on_conflict(claim_target())
        .do_update()
        .set((
            status.eq(ClaimStatus::Done.as_str()),
            payload.eq(None::<Vec<u8>>),
            updated_at.eq(Stamp(now)),
        ))
        .filter(due_condition(&conflict, now))
        .returning((message_key, attempts))
        .get_result(conn)
        .optional()
}

impl ClaimOps for SqliteConnection {
    fn claim(
        conn: &mut Self,
        group: &ConsumerGroup,
        rows: &[ClaimRow<'_>],
        now: DateTime<Utc>,
        _knobs: Knobs,
    ) -> QueryResult<Claimed> {
        let mut owned = Vec::new();
        for r in rows {
            owned.extend(claim_one(conn, group, r, now)?);
        }
        // SQLite has no transaction token (see `transaction_token`).
        Ok(Claimed { owned, token: None })
    }

    crate::dsl::claim_dsl!();
}
