//! SQLite's claim statements: the claim once per row (diesel's SQLite backend has no
//! multi-row upsert), all of them the shared DSL.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::{QueryResult, SqliteConnection};
use inbox_core::ConsumerGroup;

use crate::knobs::Knobs;
use crate::rows::{ClaimRow, Claimed};
use crate::statements::ClaimOps;

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
            let claimed = crate::dsl::claim_dsl!(
                @claim_one sqlite,
                diesel::sql_types::TimestamptzSqlite,
                conn,
                group,
                r,
                now
            );
            owned.extend(claimed?);
        }
        // SQLite has no transaction token (see `transaction_token`).
        Ok(Claimed { owned, token: None })
    }

    crate::dsl::claim_dsl!(sqlite, diesel::sql_types::TimestamptzSqlite);
}
