//! PostgreSQL specifics.

use std::sync::{Mutex, PoisonError};

use diesel::connection::SimpleConnection;
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Binary, Bool, Integer, Nullable, Text, Timestamptz};
use diesel::{ConnectionResult, PgConnection, QueryResult};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use chrono::{DateTime, Utc};
use inbox_core::ConsumerGroup;

use crate::backend::{is_untranslated, private::Sealed, quoted};
use crate::ops::ClaimRow;
use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::{Backend, Error, Result};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Serialises concurrent migration runs of several processes (an advisory lock key).
const MIGRATION_LOCK: i64 = 0x1b0c_5a11_0000_0001;

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

#[derive(QueryableByName)]
struct TableRow {
    #[diesel(sql_type = Nullable<Text>)]
    schema: Option<String>,
    #[diesel(sql_type = Bool)]
    exists: bool,
}

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
/// The conflict condition is the one every backend uses (see `ops.rs`): a row is
/// ours if it is new, or failed/started with the same payload digest and due. Rows
/// are inserted in the order given (sorted by key).
struct ClaimStatement<'a> {
    group: &'a str,
    rows: &'a [ClaimRow<'a>],
    columns: Option<ClaimColumns<'a>>,
    now: DateTime<Utc>,
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
    type SqlType = (Text, Integer);
}

impl RunQueryDsl<PgConnection> for ClaimStatement<'_> {}

impl QueryFragment<Pg> for ClaimStatement<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "INSERT INTO inbox_claims (consumer_group, message_key, message_type, tenant, \
                 payload_digest, status, attempts, starts, first_seen_at, updated_at) ",
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
        out.push_sql(
            " ON CONFLICT (consumer_group, message_key) DO UPDATE \
                 SET status = 'done', payload = NULL, updated_at = EXCLUDED.updated_at \
                 WHERE inbox_claims.status IN ('failed', 'started') \
                   AND inbox_claims.payload_digest = EXCLUDED.payload_digest \
                   AND (inbox_claims.next_attempt_at IS NULL OR inbox_claims.next_attempt_at <= ",
        );
        out.push_bind_param::<Timestamptz, _>(&self.now)?;
        out.push_sql(") RETURNING message_key, attempts");
        Ok(())
    }
}

/// A projection's transaction-scoped advisory lock, shared or exclusive: prepared
/// once per connection like the claim, since a folding batch takes it every time.
struct LockStatement {
    id: i64,
    exclusive: bool,
}

impl QueryId for LockStatement {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl RunQueryDsl<PgConnection> for LockStatement {}

impl QueryFragment<Pg> for LockStatement {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(if self.exclusive {
            "SELECT pg_advisory_xact_lock("
        } else {
            "SELECT pg_advisory_xact_lock_shared("
        });
        out.push_bind_param::<BigInt, _>(&self.id)?;
        out.push_sql(")");
        Ok(())
    }
}

/// Runs the claim statement; returns (key, attempts) of the rows now owned.
pub(crate) fn claim(
    conn: &mut PgConnection,
    group: &ConsumerGroup,
    rows: &[ClaimRow<'_>],
    now: DateTime<Utc>,
) -> QueryResult<Vec<(String, i32)>> {
    let columns = (rows.len() != 1).then(|| ClaimColumns {
        keys: rows.iter().map(|r| r.key).collect(),
        types: rows.iter().map(|r| r.message_type).collect(),
        tenants: rows.iter().map(|r| r.tenant).collect(),
        digests: rows.iter().map(|r| r.digest).collect(),
    });
    ClaimStatement {
        group: group.as_str(),
        rows,
        columns,
        now,
    }
    .load(conn)
}

/// The session's `lc_messages`, and whose session it is.
#[derive(QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
    #[diesel(sql_type = Text)]
    role: String,
    #[diesel(sql_type = Text)]
    database: String,
}

impl Setting {
    fn read(conn: &mut PgConnection) -> QueryResult<Self> {
        diesel::sql_query(
            "SELECT current_setting('lc_messages') AS value, \
                    current_user::text AS role, current_database()::text AS database",
        )
        .get_result(conn)
    }
}

/// The roles (on their database) already warned about in this process.
static WARNED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Asks for the server's messages untranslated, which the store recognises deadlocks
/// (40P01) and data errors (class 22) by: diesel hands those over without their
/// SQLSTATE. `lc_messages` is a superuser setting: a role that may not set it (and
/// whose own setting is translated) keeps the server's language, with one warning
/// per role and database in the process.
fn untranslated_messages(conn: &mut PgConnection) -> QueryResult<()> {
    let found = Setting::read(conn)?;
    if is_untranslated(&found.value) {
        return Ok(());
    }
    // Whatever the error (42501 for a role without the privilege, in the server's
    // language), the session's setting is as found; a broken connection fails the
    // next statement.
    if conn.batch_execute("SET lc_messages = 'C'").is_ok() {
        return Ok(());
    }
    let mut warned = WARNED.lock().unwrap_or_else(PoisonError::into_inner);
    let key = (found.role, found.database);
    if !warned.contains(&key) {
        tracing::warn!(
            role = %key.0,
            database = %key.1,
            lc_messages = %found.value,
            "the server's messages are translated and this role may not set lc_messages: \
             recognising deadlocks and data errors relies on the server's own language, so \
             a deadlock in a handler counts as a failed attempt and one in a claim fails \
             the batch; give the role lc_messages = 'C' (ALTER ROLE ... SET lc_messages = \
             'C', or GRANT SET ON PARAMETER lc_messages)"
        );
        warned.push(key);
    }
    Ok(())
}

/// The claim table of the store's own schema: the first schema of its search path.
const CLAIMS: &str = "to_regclass(format('%I.%I', current_schema(), 'inbox_claims'))";

impl Sealed for PgConnection {
    const BACKEND: Backend = Backend::Postgres;

    fn establish_url(url: &str) -> ConnectionResult<Self> {
        // Before libpq's first connection initialises OpenSSL with an exit cleanup.
        crate::init_tls();
        PgConnection::establish(url)
    }

    fn pool_url(url: &str) -> String {
        url.to_owned()
    }

    fn on_acquire(conn: &mut Self, schema: Option<&str>) -> QueryResult<()> {
        untranslated_messages(conn)?;
        match schema {
            Some(schema) => conn.batch_execute(&format!("SET search_path TO {}", quoted(schema))),
            None => Ok(()),
        }
    }

    fn recognises_server_errors(conn: &mut Self) -> QueryResult<bool> {
        Ok(is_untranslated(&Setting::read(conn)?.value))
    }

    fn reset_session(conn: &mut Self) -> QueryResult<()> {
        // Whatever a handler left: no transaction, the server's defaults; the caller
        // then applies the store's own settings again.
        let _ = conn.batch_execute("ROLLBACK");
        conn.batch_execute("RESET ALL")
    }

    fn set_timeouts(
        conn: &mut Self,
        statement: std::time::Duration,
        idle_in_transaction: std::time::Duration,
    ) -> QueryResult<()> {
        conn.batch_execute(&format!(
            "SET statement_timeout = {}; SET idle_in_transaction_session_timeout = {}",
            statement.as_millis(),
            idle_in_transaction.as_millis()
        ))
    }

    fn migrate(conn: &mut Self, schema: Option<&str>) -> Result<()> {
        if let Some(schema) = schema {
            let q = quoted(schema);
            conn.batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {q}; SET search_path TO {q}"
            ))?;
        }
        diesel::sql_query("SELECT pg_advisory_lock($1)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(conn)?;
        let ran = conn
            .run_pending_migrations(MIGRATIONS)
            .map(|_| ())
            .map_err(Error::Migration);
        diesel::sql_query("SELECT pg_advisory_unlock($1)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(conn)?;
        ran
    }

    fn catalog(conn: &mut Self) -> Result<Catalog> {
        let table: TableRow = diesel::sql_query(format!(
            "SELECT current_schema()::text AS schema, {CLAIMS} IS NOT NULL AS exists"
        ))
        .get_result(conn)?;
        let name = format!(
            "{}.inbox_claims",
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
             WHERE i.indrelid = {CLAIMS} ORDER BY ic.relname"
        ))
        .load(conn)?;
        let columns: Vec<ColumnRow> = diesel::sql_query(format!(
            "SELECT a.attname::text AS name, a.attnotnull AS not_null, \
                    CASE WHEN NOT c.collisdeterministic THEN c.collname::text END \
                        AS loose_collation \
             FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation \
             WHERE a.attrelid = {CLAIMS} AND a.attnum > 0 AND NOT a.attisdropped"
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

    fn write_transaction<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>,
    {
        conn.transaction(f)
    }

    fn take_locks(conn: &mut Self, locks: &[(i64, bool)]) -> QueryResult<()> {
        for &(id, exclusive) in locks {
            LockStatement { id, exclusive }.execute(conn)?;
        }
        Ok(())
    }

    fn transaction_token(conn: &mut Self) -> QueryResult<Option<String>> {
        // The schema too: a handler that moved the session's search_path would send
        // the next batch's claims into another store's tables.
        let row: Token = diesel::sql_query(
            "SELECT pg_current_xact_id()::text || ' ' || coalesce(current_schema(), '') AS token",
        )
        .get_result(conn)?;
        Ok(Some(row.token))
    }
}

#[derive(QueryableByName)]
struct Token {
    #[diesel(sql_type = diesel::sql_types::Text)]
    token: String,
}
