//! PostgreSQL's catalog, the one read every schema check works on: a store table's
//! columns, their collations and its indexes, as `verify` checks them.

use diesel::prelude::*;
use diesel::sql_types::{Array, Bool, Nullable, Text};
use diesel::PgConnection;

use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::Result;

#[derive(QueryableByName)]
struct IndexRow {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    is_unique: bool,
    #[diesel(sql_type = Bool)]
    is_partial: bool,
    #[diesel(sql_type = Bool)]
    is_deferrable: bool,
    #[diesel(sql_type = Bool)]
    is_valid: bool,
    #[diesel(sql_type = Array<Nullable<Text>>)]
    columns: Vec<Option<String>>,
    #[diesel(sql_type = Array<Nullable<Text>>)]
    loose_collations: Vec<Option<String>>,
}

#[derive(QueryableByName)]
struct ColumnRow {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    not_null: bool,
    #[diesel(sql_type = Nullable<Text>)]
    loose_collation: Option<String>,
    #[diesel(sql_type = Text)]
    type_name: String,
}

#[derive(QueryableByName)]
struct TableRow {
    #[diesel(sql_type = Nullable<Text>)]
    schema: Option<String>,
    #[diesel(sql_type = Bool)]
    exists: bool,
}

/// Reads one of the store's tables (a constant name) in the store's own schema, the
/// first of its search path, from the live catalog.
pub(crate) fn read_table(conn: &mut PgConnection, table_name: &'static str) -> Result<Catalog> {
    let regclass = format!("to_regclass(format('%I.%I', current_schema(), '{table_name}'))");
    let table: TableRow = diesel::sql_query(format!(
        "SELECT current_schema()::text AS schema, {regclass} IS NOT NULL AS exists"
    ))
    .get_result(conn)?;
    let name = format!(
        "{}.{table_name}",
        table.schema.as_deref().unwrap_or("<no schema>")
    );
    if !table.exists {
        return Ok(Catalog {
            table: name,
            exists: false,
            indexes: vec![],
            columns: vec![],
        });
    }
    // Key columns only (not INCLUDE columns), in index order; 0 is an expression.
    // A deferrable constraint's index checks at commit (NOT indimmediate, whether
    // initially deferred or not); an index that a failed CREATE INDEX CONCURRENTLY
    // or a concurrent drop left behind is not valid, ready or live.
    let indexes: Vec<IndexRow> = diesel::sql_query(format!(
        "SELECT ic.relname::text AS name, i.indisunique AS is_unique, \
                (i.indpred IS NOT NULL) AS is_partial, \
                (NOT i.indimmediate OR EXISTS (SELECT 1 FROM pg_constraint con \
                     WHERE con.conindid = i.indexrelid AND con.conrelid = i.indrelid \
                       AND con.condeferrable)) AS is_deferrable, \
                (i.indisvalid AND i.indisready AND i.indislive) AS is_valid, \
                ARRAY(SELECT a.attname::text \
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
                      LEFT JOIN pg_attribute a \
                        ON a.attrelid = i.indrelid AND a.attnum = k.attnum AND k.attnum > 0 \
                      WHERE k.ord <= i.indnkeyatts \
                      ORDER BY k.ord) AS columns, \
                ARRAY(SELECT CASE WHEN NOT c.collisdeterministic THEN c.collname::text END \
                      FROM unnest(i.indcollation::oid[]) WITH ORDINALITY AS k(coll, ord) \
                      LEFT JOIN pg_collation c ON c.oid = k.coll \
                      WHERE k.ord <= i.indnkeyatts \
                      ORDER BY k.ord) AS loose_collations \
         FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
         WHERE i.indrelid = {regclass} ORDER BY ic.relname"
    ))
    .load(conn)?;
    let columns: Vec<ColumnRow> = diesel::sql_query(format!(
        "SELECT a.attname::text AS name, a.attnotnull AS not_null, \
                CASE WHEN NOT c.collisdeterministic THEN c.collname::text END \
                    AS loose_collation, \
                format_type(a.atttypid, a.atttypmod) AS type_name \
         FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation \
         WHERE a.attrelid = {regclass} AND a.attnum > 0 AND NOT a.attisdropped"
    ))
    .load(conn)?;
    Ok(Catalog {
        table: name,
        exists: true,
        indexes: indexes
            .into_iter()
            .map(|i| IndexInfo {
                name: i.name,
                unique: i.is_unique,
                partial: i.is_partial,
                deferrable: i.is_deferrable,
                valid: i.is_valid,
                columns: i.columns,
                loose_collations: i.loose_collations,
            })
            .collect(),
        columns: columns
            .into_iter()
            .map(|c| ColumnInfo {
                name: c.name,
                not_null: c.not_null,
                loose_collation: c.loose_collation,
                type_name: c.type_name.to_lowercase(),
            })
            .collect(),
    })
}
