//! SQLite's catalog, the one read every schema check works on: a store table's
//! columns, their collations and its indexes (from pragmas and the table's CREATE
//! statement), as `verify` checks them.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::SqliteConnection;

use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::Result;

#[derive(QueryableByName)]
struct IndexRow {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    is_unique: i64,
    #[diesel(sql_type = BigInt)]
    is_partial: i64,
}

#[derive(QueryableByName)]
struct IndexColumnRow {
    #[diesel(sql_type = Nullable<Text>)]
    name: Option<String>,
    #[diesel(sql_type = Text)]
    coll: String,
}

#[derive(QueryableByName)]
struct TableSqlRow {
    #[diesel(sql_type = Nullable<Text>)]
    sql: Option<String>,
}

#[derive(QueryableByName)]
struct ColumnRow {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    not_null: i64,
    #[diesel(sql_type = Text)]
    type_name: String,
}

/// Reads one of the store's tables (a constant name) from the live catalog.
pub(crate) fn read_table(conn: &mut SqliteConnection, table_name: &'static str) -> Result<Catalog> {
    let columns: Vec<ColumnRow> = diesel::sql_query(format!(
        "SELECT name, \"notnull\" AS not_null, type AS type_name \
         FROM pragma_table_info('{table_name}')"
    ))
    .load(conn)?;
    let table = format!("main.{table_name}");
    if columns.is_empty() {
        return Ok(Catalog {
            table,
            exists: false,
            indexes: vec![],
            columns: vec![],
        });
    }
    let rows: Vec<IndexRow> = diesel::sql_query(format!(
        "SELECT name, \"unique\" AS is_unique, partial AS is_partial \
         FROM pragma_index_list('{table_name}') ORDER BY name"
    ))
    .load(conn)?;
    let mut indexes = Vec::with_capacity(rows.len());
    for row in rows {
        // Key columns only (not the rowid or a WITHOUT ROWID table's appended
        // primary key columns); an expression has no name.
        let cols: Vec<IndexColumnRow> = diesel::sql_query(
            "SELECT name, coll FROM pragma_index_xinfo(?) WHERE key = 1 ORDER BY seqno",
        )
        .bind::<Text, _>(&row.name)
        .load(conn)?;
        // NOCASE, RTRIM or an application's collation: equal values that differ
        // in bytes.
        let loose_collations = cols
            .iter()
            .map(|c| (!c.coll.eq_ignore_ascii_case("BINARY")).then(|| c.coll.clone()))
            .collect();
        indexes.push(IndexInfo {
            name: row.name,
            unique: row.is_unique != 0,
            partial: row.is_partial != 0,
            // Only foreign keys can be deferred; indexes are always live.
            deferrable: false,
            valid: true,
            columns: cols.into_iter().map(|c| c.name).collect(),
            loose_collations,
        });
    }
    // The lookup by key compares under the column's own collation, which only
    // the table's CREATE statement records.
    let create: Option<TableSqlRow> = diesel::sql_query(format!(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{table_name}' \
         COLLATE NOCASE"
    ))
    .get_result(conn)
    .optional()?;
    let declared = super::collation::declared(
        create
            .as_ref()
            .and_then(|c| c.sql.as_deref())
            .unwrap_or_default(),
    );
    Ok(Catalog {
        table,
        exists: true,
        indexes,
        columns: columns
            .into_iter()
            .map(|c| ColumnInfo {
                loose_collation: declared
                    .iter()
                    .find(|(column, _)| column.eq_ignore_ascii_case(&c.name))
                    .map(|(_, collation)| collation)
                    .filter(|collation| !collation.eq_ignore_ascii_case("BINARY"))
                    .cloned(),
                name: c.name,
                not_null: c.not_null != 0,
                type_name: c.type_name.to_lowercase(),
            })
            .collect(),
    })
}
