//! PostgreSQL's idempotency statements and catalog.

use diesel::prelude::*;
use diesel::sql_types::{Array, Bool, Nullable, Text};
use diesel::PgConnection;

use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::Result;

mod sql {
    /// The insert takes a free key; the conflict branch takes over only an
    /// uncommitted, in-flight record whose lease has ended, with the same
    /// fingerprint, raising its fencing token. Concurrent requests with one key
    /// wait on the unique index for the first to commit, then find it taken.
    pub const BEGIN: &str = "\
        INSERT INTO idempotency_keys (caller, idempotency_key, fingerprint, status, \
            lease_token, lease_until, created_at, updated_at) \
        VALUES ($1, $2, $3, 'in_flight', 1, $4, $5, $5) \
        ON CONFLICT (caller, idempotency_key) DO UPDATE \
            SET lease_token = idempotency_keys.lease_token + 1, \
                lease_until = EXCLUDED.lease_until, updated_at = EXCLUDED.updated_at \
            WHERE idempotency_keys.status = 'in_flight' \
              AND idempotency_keys.committed_at IS NULL \
              AND idempotency_keys.lease_until <= EXCLUDED.updated_at \
              AND idempotency_keys.fingerprint = EXCLUDED.fingerprint \
        RETURNING lease_token";

    pub const READ: &str = "\
        SELECT caller, idempotency_key, fingerprint, status, lease_token, lease_until, \
               committed_at, response, created_at, updated_at \
        FROM idempotency_keys WHERE caller = $1 AND idempotency_key = $2";

    pub const COMMIT: &str = "\
        UPDATE idempotency_keys SET committed_at = $4, updated_at = $4 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    pub const SETTLE: &str = "\
        UPDATE idempotency_keys SET status = $4, response = $5, updated_at = $6 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NOT NULL";

    pub const REFUND_DELIVERED: &str = "\
        UPDATE idempotency_keys SET status = 'refunded', response = NULL, updated_at = $4 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'delivered'";

    pub const ABANDON: &str = "\
        DELETE FROM idempotency_keys \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    // SKIP LOCKED: a purge never waits for a running request.
    pub const PURGE: &str = "\
        DELETE FROM idempotency_keys WHERE (caller, idempotency_key) IN ( \
            SELECT caller, idempotency_key FROM idempotency_keys \
            WHERE created_at < $1 \
              AND (status <> 'in_flight' OR (committed_at IS NULL AND lease_until < $1)) \
            ORDER BY created_at LIMIT $2 \
            FOR UPDATE SKIP LOCKED)";
}

super::idempotency_ops!(PgConnection, diesel::sql_types::Timestamptz, sql);

/// The idempotency table of the store's own schema.
const TABLE: &str = "to_regclass(format('%I.%I', current_schema(), 'idempotency_keys'))";

#[derive(QueryableByName)]
struct TableRow {
    #[diesel(sql_type = Nullable<Text>)]
    schema: Option<String>,
    #[diesel(sql_type = Bool)]
    exists: bool,
}

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
}

/// The same reading of `pg_index` as the claim table's (see `crate::pg`).
fn catalog(conn: &mut PgConnection) -> Result<Catalog> {
    let table: TableRow = diesel::sql_query(format!(
        "SELECT current_schema()::text AS schema, {TABLE} IS NOT NULL AS exists"
    ))
    .get_result(conn)?;
    let name = format!(
        "{}.idempotency_keys",
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
         WHERE i.indrelid = {TABLE} ORDER BY ic.relname"
    ))
    .load(conn)?;
    let columns: Vec<ColumnRow> = diesel::sql_query(format!(
        "SELECT a.attname::text AS name, a.attnotnull AS not_null, \
                CASE WHEN NOT c.collisdeterministic THEN c.collname::text END \
                    AS loose_collation \
         FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation \
         WHERE a.attrelid = {TABLE} AND a.attnum > 0 AND NOT a.attisdropped"
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
            })
            .collect(),
    })
}
