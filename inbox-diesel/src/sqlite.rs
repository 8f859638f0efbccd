//! SQLite specifics.

pub(crate) mod collation;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{ConnectionResult, QueryResult, SqliteConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use crate::backend::private::Sealed;
use crate::url::sqlite_path;
use crate::verify::{Catalog, ColumnInfo, IndexInfo};
use crate::{Backend, Error, Result};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

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

impl Sealed for SqliteConnection {
    const BACKEND: Backend = Backend::Sqlite;

    fn establish_url(url: &str) -> ConnectionResult<Self> {
        SqliteConnection::establish(sqlite_path(url))
    }

    fn pool_url(url: &str) -> String {
        sqlite_path(url).to_owned()
    }

    fn on_acquire(conn: &mut Self, _schema: Option<&str>) -> QueryResult<()> {
        // Several pooled connections share one file: wait for the writer instead of
        // failing at once, and let readers run beside it.
        conn.batch_execute(
            "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL; \
             PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;",
        )
    }

    fn reset_session(conn: &mut Self) -> QueryResult<()> {
        // A transaction a handler left open (an error: none is open is fine).
        let _ = conn.batch_execute("ROLLBACK");
        Ok(())
    }

    fn set_timeouts(
        _conn: &mut Self,
        _statement: std::time::Duration,
        _idle_in_transaction: std::time::Duration,
    ) -> QueryResult<()> {
        // No statement timeout in SQLite: a handler that hangs holds the writer lock
        // until it returns.
        Ok(())
    }

    fn recognises_server_errors(_conn: &mut Self) -> QueryResult<bool> {
        // SQLite's messages are never translated.
        Ok(true)
    }

    fn migrate(conn: &mut Self, _schema: Option<&str>) -> Result<()> {
        conn.run_pending_migrations(MIGRATIONS)
            .map(|_| ())
            .map_err(Error::Migration)
    }

    fn catalog(conn: &mut Self) -> Result<Catalog> {
        let columns: Vec<ColumnRow> = diesel::sql_query(
            "SELECT name, \"notnull\" AS not_null FROM pragma_table_info('inbox_claims')",
        )
        .load(conn)?;
        let table = "main.inbox_claims".to_owned();
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
             FROM pragma_index_list('inbox_claims') ORDER BY name",
        )
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
        let create: Option<TableSqlRow> = diesel::sql_query(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'inbox_claims' \
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

    fn write_transaction<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>,
    {
        // BEGIN IMMEDIATE: a deferred transaction that reads and then writes can fail
        // with SQLITE_BUSY, which busy_timeout does not retry.
        conn.immediate_transaction(f)
    }

    fn take_locks(_conn: &mut Self, _locks: &[(i64, bool)]) -> QueryResult<()> {
        // One writer at a time already: the immediate transaction is the lock.
        Ok(())
    }

    fn transaction_token(_conn: &mut Self) -> QueryResult<Option<String>> {
        // SQLite has no transaction id diesel can read, and an error a handler
        // swallowed does not abort an SQLite transaction.
        Ok(None)
    }
}
