//! What `verify_schema` checks of the operator migration's objects: outbox rows unique
//! by (message_key, replay_seq), and nothing unique on the key alone (a replay keeps
//! the original key, and would be refused); the dead-letter columns replays and
//! discards write.

use diesel::prelude::*;
use diesel::result::QueryResult;
use diesel::sql_types::{Array, BigInt, Bool, Nullable, Text};

use crate::{Error, Result};

/// One unique index of `outbox_messages`.
#[derive(Debug)]
pub struct UniqueIndex {
    pub name: String,
    pub partial: bool,
    pub columns: Vec<Option<String>>,
}

/// The live catalog, as the check needs it.
#[derive(Debug, Default)]
pub struct OperatorCatalog {
    /// The outbox table's name as the store sees it.
    pub outbox_table: String,
    /// (column, not null) of `outbox_messages`.
    pub outbox_columns: Vec<(String, bool)>,
    pub outbox_unique: Vec<UniqueIndex>,
    pub dead_letter_table: String,
    /// Columns of `inbox_dead_letters`.
    pub dead_letter_columns: Vec<String>,
    pub canary_table: String,
    /// Columns of `inbox_canary`.
    pub canary_columns: Vec<String>,
}

/// Reads the catalog; per backend.
pub trait CatalogOps: Sized {
    /// Reads what [`check`] needs.
    #[doc(hidden)]
    fn op_catalog(conn: &mut Self) -> QueryResult<OperatorCatalog>;
}

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
        })
    }
}

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
        })
    }
}

fn describe(index: &UniqueIndex) -> String {
    let cols: Vec<&str> = index
        .columns
        .iter()
        .map(|c| c.as_deref().unwrap_or("<expression>"))
        .collect();
    format!(
        "{}unique ({}) [{}]",
        if index.partial { "partial " } else { "" },
        cols.join(", "),
        index.name
    )
}

fn has_columns(index: &UniqueIndex, wanted: &[&str]) -> bool {
    index.columns.len() == wanted.len()
        && wanted
            .iter()
            .all(|w| index.columns.iter().any(|c| c.as_deref() == Some(*w)))
}

/// Refuses a schema whose outbox cannot hold replays exactly once, or whose dead
/// letters lack the replay and discard columns.
pub(crate) fn check(catalog: &OperatorCatalog) -> Result<()> {
    let mismatch = |table: &str, expected: &str, found: String| Error::OperatorSchema {
        expected: expected.to_owned(),
        found,
        table: table.to_owned(),
    };
    let outbox = &catalog.outbox_table;
    if catalog.outbox_columns.is_empty() {
        return Err(mismatch(
            outbox,
            "table outbox_messages",
            "no such table (were the migrations run?)".to_owned(),
        ));
    }
    match catalog
        .outbox_columns
        .iter()
        .find(|(n, _)| n == "replay_seq")
    {
        None => {
            return Err(mismatch(
                outbox,
                "NOT NULL column replay_seq",
                "no such column (were the migrations run?)".to_owned(),
            ))
        }
        Some((_, false)) => {
            return Err(mismatch(
                outbox,
                "NOT NULL column replay_seq",
                "nullable column replay_seq".to_owned(),
            ))
        }
        Some(_) => {}
    }
    if let Some(alone) = catalog
        .outbox_unique
        .iter()
        .find(|i| has_columns(i, &["message_key"]))
    {
        return Err(mismatch(
            outbox,
            "no unique index on message_key alone (a replay keeps the message key)",
            describe(alone),
        ));
    }
    let key_replay = ["message_key", "replay_seq"];
    if !catalog
        .outbox_unique
        .iter()
        .any(|i| !i.partial && has_columns(i, &key_replay))
    {
        let found: Vec<String> = catalog.outbox_unique.iter().map(describe).collect();
        return Err(mismatch(
            outbox,
            "unique (message_key, replay_seq)",
            if found.is_empty() {
                "no unique index".to_owned()
            } else {
                found.join(", ")
            },
        ));
    }
    for column in ["run_id", "seq", "sent_at", "arrived_at", "arrivals"] {
        if !catalog.canary_columns.iter().any(|c| c == column) {
            return Err(mismatch(
                &catalog.canary_table,
                &format!("table inbox_canary with column {column}"),
                if catalog.canary_columns.is_empty() {
                    "no such table (were the migrations run?)".to_owned()
                } else {
                    "no such column (were the migrations run?)".to_owned()
                },
            ));
        }
    }
    for column in ["replay_count", "discarded_at"] {
        if !catalog.dead_letter_columns.iter().any(|c| c == column) {
            return Err(mismatch(
                &catalog.dead_letter_table,
                &format!("column {column}"),
                if catalog.dead_letter_columns.is_empty() {
                    "no such table (were the migrations run?)".to_owned()
                } else {
                    "no such column (were the migrations run?)".to_owned()
                },
            ));
        }
    }
    Ok(())
}
