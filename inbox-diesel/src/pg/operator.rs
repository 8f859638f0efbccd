//! PostgreSQL's side of the operator tooling: its statements (the shared DSL of
//! `operator::ops`) and the catalog reads of the operator migration's check.

use diesel::prelude::*;
use diesel::result::QueryResult;
use diesel::sql_types::{Array, Bool, Nullable, Text};

use chrono::{DateTime, Utc};

use crate::operator::ops::{
    CanaryRow, ClaimTuple, EntryTuple, FailureSpan, Letter, NewReplay, OperatorOps, RawStats,
    Redrivable, StoredPayload,
};
use crate::operator::{CatalogOps, DeadLetterFilter, LetterStatus, OperatorCatalog, UniqueIndex};

crate::operator::operator_ops!(diesel::PgConnection, pg);

#[derive(QueryableByName)]
struct Column {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    not_null: bool,
}

#[derive(QueryableByName)]
struct PgIndex {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    is_partial: bool,
    #[diesel(sql_type = Array<Nullable<Text>>)]
    columns: Vec<Option<String>>,
}

#[derive(QueryableByName)]
struct SchemaRow {
    #[diesel(sql_type = Nullable<Text>)]
    schema: Option<String>,
}

fn pg_table(name: &str) -> String {
    format!("to_regclass(format('%I.%I', current_schema(), '{name}'))")
}

impl CatalogOps for diesel::PgConnection {
    fn op_catalog(conn: &mut Self) -> QueryResult<OperatorCatalog> {
        let schema: SchemaRow =
            diesel::sql_query("SELECT current_schema()::text AS schema").get_result(conn)?;
        let schema = schema.schema.unwrap_or_else(|| "<no schema>".to_owned());
        let columns = |conn: &mut Self, table: &str| -> QueryResult<Vec<Column>> {
            diesel::sql_query(format!(
                "SELECT a.attname::text AS name, a.attnotnull AS not_null FROM pg_attribute a \
                 WHERE a.attrelid = {} AND a.attnum > 0 AND NOT a.attisdropped",
                pg_table(table)
            ))
            .load(conn)
        };
        let outbox_columns = columns(conn, "outbox_messages")?;
        let dead_letter_columns = columns(conn, "inbox_dead_letters")?;
        let canary_columns = columns(conn, "inbox_canary")?;
        let halt_columns = columns(conn, "inbox_group_halts")?;
        let sequence_columns = columns(conn, "inbox_replay_sequences")?;
        let indexes: Vec<PgIndex> = diesel::sql_query(format!(
            "SELECT ic.relname::text AS name, (i.indpred IS NOT NULL) AS is_partial, \
                    ARRAY(SELECT a.attname::text \
                          FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
                          LEFT JOIN pg_attribute a \
                            ON a.attrelid = i.indrelid AND a.attnum = k.attnum AND k.attnum > 0 \
                          WHERE k.ord <= i.indnkeyatts ORDER BY k.ord) AS columns \
             FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
             WHERE i.indrelid = {} AND i.indisunique AND i.indisvalid ORDER BY ic.relname",
            pg_table("outbox_messages")
        ))
        .load(conn)?;
        Ok(OperatorCatalog {
            outbox_table: format!("{schema}.outbox_messages"),
            outbox_columns: outbox_columns
                .into_iter()
                .map(|c| (c.name, c.not_null))
                .collect(),
            outbox_unique: indexes
                .into_iter()
                .map(|i| UniqueIndex {
                    name: i.name,
                    partial: i.is_partial,
                    columns: i.columns,
                })
                .collect(),
            dead_letter_table: format!("{schema}.inbox_dead_letters"),
            dead_letter_columns: dead_letter_columns.into_iter().map(|c| c.name).collect(),
            canary_table: format!("{schema}.inbox_canary"),
            canary_columns: canary_columns.into_iter().map(|c| c.name).collect(),
            halt_table: format!("{schema}.inbox_group_halts"),
            halt_columns: halt_columns.into_iter().map(|c| c.name).collect(),
            sequence_table: format!("{schema}.inbox_replay_sequences"),
            sequence_columns: sequence_columns.into_iter().map(|c| c.name).collect(),
        })
    }
}
