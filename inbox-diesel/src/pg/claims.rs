//! PostgreSQL's claim statements: the claim itself (one cached statement over arrays)
//! and the shared DSL for the rest.

use chrono::{DateTime, Utc};
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, Binary, Integer, Nullable, Text, Timestamptz};
use diesel::{PgConnection, QueryResult};
use inbox_core::ConsumerGroup;

use super::TOKEN_SQL;
use crate::knobs::Knobs;
use crate::rows::{ClaimRow, Claimed};
use crate::statements::{claim_conflict, ClaimOps};

/// The claim statement on PostgreSQL: the whole batch in one statement, over arrays
/// (one text whatever the batch size), or over one VALUES row for a lone message
/// (cheaper for the server than unpacking arrays).
///
/// Written as a query fragment whose parameters diesel numbers itself, so that it is
/// safe to cache and every connection prepares each form once. Diesel never caches
/// `sql_query`, nor an upsert built with `do_update()`: the server would parse,
/// rewrite and plan the statement for every batch, which at one message per batch is
/// most of its work.
///
/// The conflict target and condition are the ones every claim upsert uses
/// ([`claim_conflict`]): a row is ours if it is new, or failed/started with the same
/// payload digest and due. Rows are inserted in the order given (sorted by key).
struct ClaimStatement<'a> {
    group: &'a str,
    rows: &'a [ClaimRow<'a>],
    columns: Option<ClaimColumns<'a>>,
    now: DateTime<Utc>,
    knobs: Knobs,
}

/// A batch as one array per column, for `unnest`.
struct ClaimColumns<'a> {
    keys: Vec<&'a str>,
    types: Vec<&'a str>,
    tenants: Vec<Option<&'a str>>,
    digests: Vec<&'a [u8]>,
}

impl QueryId for ClaimStatement<'_> {
    type QueryId = ();
    // Two texts: diesel's cache keys them by their SQL.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for ClaimStatement<'_> {
    type SqlType = (Text, Integer, Nullable<Text>);
}

impl RunQueryDsl<PgConnection> for ClaimStatement<'_> {}

impl QueryFragment<Pg> for ClaimStatement<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if self.knobs.narrow_claims() {
            return self.walk_narrow(out);
        }
        let conflict = claim_conflict(true);
        out.push_sql("INSERT INTO inbox_claims (");
        out.push_sql(&conflict.target);
        out.push_sql(
            ", message_type, tenant, payload_digest, status, attempts, starts, first_seen_at, \
             updated_at) ",
        );
        match (&self.columns, self.rows) {
            (Some(c), _) => {
                out.push_sql("SELECT ");
                out.push_bind_param::<Text, _>(&self.group)?;
                out.push_sql(
                    ", k.message_key, k.message_type, k.tenant, k.payload_digest, 'done', 0, 0, ",
                );
                out.push_bind_param::<Timestamptz, _>(&self.now)?;
                out.push_sql(", ");
                out.push_bind_param::<Timestamptz, _>(&self.now)?;
                out.push_sql(" FROM unnest(");
                out.push_bind_param::<Array<Text>, _>(&c.keys)?;
                out.push_sql("::text[], ");
                out.push_bind_param::<Array<Text>, _>(&c.types)?;
                out.push_sql("::text[], ");
                out.push_bind_param::<Array<Nullable<Text>>, _>(&c.tenants)?;
                out.push_sql("::text[], ");
                out.push_bind_param::<Array<Binary>, _>(&c.digests)?;
                out.push_sql("::bytea[]) AS k(message_key, message_type, tenant, payload_digest)");
            }
            (None, [row]) => {
                out.push_sql("VALUES (");
                out.push_bind_param::<Text, _>(&self.group)?;
                out.push_sql(", ");
                out.push_bind_param::<Text, _>(&row.key)?;
                out.push_sql(", ");
                out.push_bind_param::<Text, _>(&row.message_type)?;
                out.push_sql(", ");
                out.push_bind_param::<Nullable<Text>, _>(&row.tenant)?;
                out.push_sql(", ");
                out.push_bind_param::<Binary, _>(&row.digest)?;
                out.push_sql(", 'done', 0, 0, ");
                out.push_bind_param::<Timestamptz, _>(&self.now)?;
                out.push_sql(", ");
                out.push_bind_param::<Timestamptz, _>(&self.now)?;
                out.push_sql(")");
            }
            (None, rows) => {
                return Err(diesel::result::Error::QueryBuilderError(
                    format!("a claim of {} rows needs its columns", rows.len()).into(),
                ))
            }
        }
        out.push_sql(" ON CONFLICT (");
        out.push_sql(&conflict.target);
        if self.knobs.takeover() {
            out.push_sql(
                ") DO UPDATE SET status = 'done', payload = NULL, \
                 updated_at = EXCLUDED.updated_at WHERE ",
            );
            out.push_sql(&conflict.condition);
            out.push_bind_param::<Timestamptz, _>(&self.now)?;
            out.push_sql(conflict.close);
        } else {
            out.push_sql(") DO NOTHING");
        }
        out.push_sql(" RETURNING message_key, attempts, ");
        self.returning_token(&mut out);
        Ok(())
    }
}

impl ClaimStatement<'_> {
    /// The transaction's token with every row the claim returns: the handlers run only
    /// when it returned one, and their checks compare against it, so reading it here
    /// saves the round trip of a statement of its own.
    fn returning_token(&self, out: &mut AstPass<'_, '_, Pg>) {
        if self.knobs.commit_checks() {
            out.push_sql(TOKEN_SQL);
        } else {
            out.push_sql("NULL::text");
        }
    }

    /// A benchmark's claim into a two-column claim table: the key only, `DO NOTHING`.
    fn walk_narrow<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let conflict = claim_conflict(false);
        out.push_sql("INSERT INTO inbox_claims (");
        out.push_sql(&conflict.target);
        out.push_sql(") ");
        match (&self.columns, self.rows) {
            (Some(c), _) => {
                out.push_sql("SELECT ");
                out.push_bind_param::<Text, _>(&self.group)?;
                out.push_sql(", k FROM unnest(");
                out.push_bind_param::<Array<Text>, _>(&c.keys)?;
                out.push_sql("::text[]) AS k");
            }
            (None, [row]) => {
                out.push_sql("VALUES (");
                out.push_bind_param::<Text, _>(&self.group)?;
                out.push_sql(", ");
                out.push_bind_param::<Text, _>(&row.key)?;
                out.push_sql(")");
            }
            (None, rows) => {
                return Err(diesel::result::Error::QueryBuilderError(
                    format!("a claim of {} rows needs its columns", rows.len()).into(),
                ))
            }
        }
        out.push_sql(" ON CONFLICT (");
        out.push_sql(&conflict.target);
        out.push_sql(") DO NOTHING RETURNING message_key, 0, ");
        self.returning_token(&mut out);
        Ok(())
    }
}

/// Runs the claim statement; returns (key, attempts) of the rows now owned, and the
/// transaction's token.
fn claim(
    conn: &mut PgConnection,
    group: &ConsumerGroup,
    rows: &[ClaimRow<'_>],
    now: DateTime<Utc>,
    knobs: Knobs,
) -> QueryResult<Claimed> {
    let columns = (rows.len() != 1).then(|| ClaimColumns {
        keys: rows.iter().map(|r| r.key).collect(),
        types: rows.iter().map(|r| r.message_type).collect(),
        tenants: rows.iter().map(|r| r.tenant).collect(),
        digests: rows.iter().map(|r| r.digest).collect(),
    });
    let returned: Vec<(String, i32, Option<String>)> = ClaimStatement {
        group: group.as_str(),
        rows,
        columns,
        now,
        knobs,
    }
    .load(conn)?;
    let token = returned.first().and_then(|(_, _, t)| t.clone());
    Ok(Claimed {
        owned: returned.into_iter().map(|(k, a, _)| (k, a)).collect(),
        token,
    })
}

impl ClaimOps for PgConnection {
    fn claim(
        conn: &mut Self,
        group: &ConsumerGroup,
        rows: &[ClaimRow<'_>],
        now: DateTime<Utc>,
        knobs: Knobs,
    ) -> QueryResult<Claimed> {
        claim(conn, group, rows, now, knobs)
    }

    crate::dsl::claim_dsl!();
}
