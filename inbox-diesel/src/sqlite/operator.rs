//! SQLite's side of the operator tooling: its statements (the shared DSL of
//! `operator::ops`) and the catalog reads of the operator migration's check.

use diesel::prelude::*;
use diesel::result::QueryResult;
use diesel::sql_types::{BigInt, Nullable, Text};

use chrono::{DateTime, Utc};

use crate::operator::ops::{
    CanaryRow, ClaimTuple, EntryTuple, FailureSpan, Letter, NewReplay, OperatorOps, RawStats,
    Redrivable, StoredPayload,
};
use crate::operator::{CatalogOps, DeadLetterFilter, LetterStatus, OperatorCatalog, UniqueIndex};

crate::operator::operator_ops!(diesel::SqliteConnection, sqlite);

#[derive(QueryableByName)]
struct SqliteColumn {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    not_null: i64,
}

#[derive(QueryableByName)]
struct SqliteIndex {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    is_partial: i64,
}

#[derive(QueryableByName)]
struct SqliteIndexColumn {
    #[diesel(sql_type = Nullable<Text>)]
    name: Option<String>,
}

impl CatalogOps for diesel::SqliteConnection {
    fn op_catalog(conn: &mut Self) -> QueryResult<OperatorCatalog> {
        let columns = |conn: &mut Self, table: &str| -> QueryResult<Vec<SqliteColumn>> {
            diesel::sql_query("SELECT name, \"notnull\" AS not_null FROM pragma_table_info(?)")
                .bind::<Text, _>(table)
                .load(conn)
        };
        let outbox_columns = columns(conn, "outbox_messages")?;
        let dead_letter_columns = columns(conn, "inbox_dead_letters")?;
        let canary_columns = columns(conn, "inbox_canary")?;
        let halt_columns = columns(conn, "inbox_group_halts")?;
        let sequence_columns = columns(conn, "inbox_replay_sequences")?;
        let rows: Vec<SqliteIndex> = diesel::sql_query(
            "SELECT name, partial AS is_partial FROM pragma_index_list('outbox_messages') \
             WHERE \"unique\" = 1 ORDER BY name",
        )
        .load(conn)?;
        let mut outbox_unique = Vec::with_capacity(rows.len());
        for row in rows {
            let cols: Vec<SqliteIndexColumn> = diesel::sql_query(
                "SELECT name FROM pragma_index_xinfo(?) WHERE key = 1 ORDER BY seqno",
            )
            .bind::<Text, _>(&row.name)
            .load(conn)?;
            outbox_unique.push(UniqueIndex {
                name: row.name,
                partial: row.is_partial != 0,
                columns: cols.into_iter().map(|c| c.name).collect(),
            });
        }
        Ok(OperatorCatalog {
            outbox_table: "main.outbox_messages".to_owned(),
            outbox_columns: outbox_columns
                .into_iter()
                .map(|c| (c.name, c.not_null != 0))
                .collect(),
            outbox_unique,
            dead_letter_table: "main.inbox_dead_letters".to_owned(),
            dead_letter_columns: dead_letter_columns.into_iter().map(|c| c.name).collect(),
            canary_table: "main.inbox_canary".to_owned(),
            canary_columns: canary_columns.into_iter().map(|c| c.name).collect(),
            halt_table: "main.inbox_group_halts".to_owned(),
            halt_columns: halt_columns.into_iter().map(|c| c.name).collect(),
            sequence_table: "main.inbox_replay_sequences".to_owned(),
            sequence_columns: sequence_columns.into_iter().map(|c| c.name).collect(),
        })
    }
}
