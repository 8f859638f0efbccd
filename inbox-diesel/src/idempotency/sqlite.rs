//! SQLite's idempotency statements and catalog: the same statements, without row
//! locks (the immediate transaction is the only writer).

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::SqliteConnection;

use crate::sqlite::collation;
use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::Result;

mod sql {
    pub const BEGIN: &str = "\
        INSERT INTO idempotency_keys (caller, idempotency_key, fingerprint, status, \
            lease_token, lease_until, created_at, updated_at) \
        VALUES (?1, ?2, ?3, 'in_flight', 1, ?4, ?5, ?5) \
        ON CONFLICT (caller, idempotency_key) DO UPDATE \
            SET lease_token = idempotency_keys.lease_token + 1, \
                lease_until = excluded.lease_until, updated_at = excluded.updated_at \
            WHERE idempotency_keys.status = 'in_flight' \
              AND idempotency_keys.committed_at IS NULL \
              AND idempotency_keys.lease_until <= excluded.updated_at \
              AND idempotency_keys.fingerprint = excluded.fingerprint \
        RETURNING lease_token";

    pub const READ: &str = "\
        SELECT caller, idempotency_key, fingerprint, status, lease_token, lease_until, \
               committed_at, response, created_at, updated_at \
        FROM idempotency_keys WHERE caller = ?1 AND idempotency_key = ?2";

    pub const COMMIT: &str = "\
        UPDATE idempotency_keys SET committed_at = ?4, updated_at = ?4 \
        WHERE caller = ?1 AND idempotency_key = ?2 AND lease_token = ?3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    pub const SETTLE: &str = "\
        UPDATE idempotency_keys SET status = ?4, response = ?5, updated_at = ?6 \
        WHERE caller = ?1 AND idempotency_key = ?2 AND lease_token = ?3 \
          AND status = 'in_flight' AND committed_at IS NOT NULL";

    pub const REFUND_DELIVERED: &str = "\
        UPDATE idempotency_keys SET status = 'refunded', response = NULL, updated_at = ?4 \
        WHERE caller = ?1 AND idempotency_key = ?2 AND lease_token = ?3 \
          AND status = 'delivered'";

    pub const ABANDON: &str = "\
        DELETE FROM idempotency_keys \
        WHERE caller = ?1 AND idempotency_key = ?2 AND lease_token = ?3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    pub const PURGE: &str = "\
        DELETE FROM idempotency_keys WHERE (caller, idempotency_key) IN ( \
            SELECT caller, idempotency_key FROM idempotency_keys \
            WHERE created_at < ?1 \
              AND (status <> 'in_flight' OR (committed_at IS NULL AND lease_until < ?1)) \
            ORDER BY created_at LIMIT ?2)";
}

super::idempotency_ops!(SqliteConnection, diesel::sql_types::TimestamptzSqlite, sql);

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
}

/// The same reading of the pragmas as the claim table's (see `crate::sqlite`).
fn catalog(conn: &mut SqliteConnection) -> Result<Catalog> {
    let columns: Vec<ColumnRow> = diesel::sql_query(
        "SELECT name, \"notnull\" AS not_null FROM pragma_table_info('idempotency_keys')",
    )
    .load(conn)?;
    let table = "main.idempotency_keys".to_owned();
    if columns.is_empty() {
        return Ok(Catalog {
            table,
            exists: false,
            indexes: vec![],
            columns: vec![],
        });
    }
    let rows: Vec<IndexRow> = diesel::sql_query(
        "SELECT name, \"unique\" AS is_unique, partial AS is_partial \
         FROM pragma_index_list('idempotency_keys') ORDER BY name",
    )
    .load(conn)?;
    let mut indexes = Vec::with_capacity(rows.len());
    for row in rows {
        let cols: Vec<IndexColumnRow> = diesel::sql_query(
            "SELECT name, coll FROM pragma_index_xinfo(?) WHERE key = 1 ORDER BY seqno",
        )
        .bind::<Text, _>(&row.name)
        .load(conn)?;
        let loose_collations = cols
            .iter()
            .map(|c| (!c.coll.eq_ignore_ascii_case("BINARY")).then(|| c.coll.clone()))
            .collect();
        indexes.push(IndexInfo {
            name: row.name,
            unique: row.is_unique != 0,
            partial: row.is_partial != 0,
            deferrable: false,
            valid: true,
            columns: cols.into_iter().map(|c| c.name).collect(),
            loose_collations,
        });
    }
    let create: Option<TableSqlRow> = diesel::sql_query(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_keys' \
         COLLATE NOCASE",
    )
    .get_result(conn)
    .optional()?;
    let declared = collation::declared(
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
            })
            .collect(),
    })
}
