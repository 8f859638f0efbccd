//! SQLite: everything the store runs there. `claims` (the claim, row by row),
//! `outbox` (leasing in id order), `retention` (purges), `catalog` and `collation`
//! (the claim table's indexes and declared collations); this module connects,
//! migrates, sets the pragmas and holds the immediate write transaction.

mod catalog;
mod claims;
mod collation;
#[cfg(feature = "idempotency")]
mod idempotency;
#[cfg(feature = "operator")]
mod operator;
mod outbox;
#[cfg(feature = "rebuild")]
mod rebuild;
mod retention;

use std::sync::Mutex;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::prelude::*;
use diesel::{ConnectionResult, QueryResult, SqliteConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use inbox_core::Clock;

use crate::backend::{private::Sealed, StoreConnection};
use crate::url::sqlite_path;
use crate::verify::Catalog;
use crate::{Backend, Error, Result};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

impl StoreConnection for SqliteConnection {}

crate::halts::halt_ops!(SqliteConnection);
crate::reports::report_ops!(SqliteConnection);

impl Sealed for SqliteConnection {
    const BACKEND: Backend = Backend::Sqlite;

    /// Relays poll: nothing listens.
    type Listener = ();

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

    fn migrate(
        conn: &mut Self,
        _schema: Option<&str>,
        framework: bool,
        setup: &[crate::backend::Setup<Self>],
    ) -> Result<()> {
        if framework {
            // One write transaction for the lot (each migration a savepoint in it): two
            // processes starting at once on a fresh file would otherwise both read "none
            // applied" and the second fail on the first's tables.
            conn.immediate_transaction(|conn| {
                conn.run_pending_migrations(MIGRATIONS)
                    .map(|_| ())
                    .map_err(Error::Migration)
            })?;
            // The stored failure groups need Rust's masking: filled here, not in SQL.
            crate::fingerprint::backfill(conn)?;
        }
        // One writer: each DDL statement takes the write lock and SQLite checks the
        // schema again under it, so two processes' `CREATE TABLE IF NOT EXISTS` never
        // both create; a step that needs more opens its own `BEGIN IMMEDIATE`.
        for step in setup {
            step(conn)?;
        }
        Ok(())
    }

    fn catalog(conn: &mut Self, table: &'static str) -> Result<Catalog> {
        catalog::read_table(conn, table)
    }

    fn wait_for_enqueue(
        _listener: &Mutex<()>,
        _url: &str,
        _schema: Option<&str>,
        clock: &dyn Clock,
        timeout: Duration,
    ) -> Result<bool> {
        // Polling is SQLite's only mode; a manual clock advances instead.
        clock.sleep(timeout);
        Ok(false)
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

    fn begin_batch(conn: &mut Self, _savepoint: bool) -> QueryResult<()> {
        // No transaction token to tell a handler's transaction from the store's, so
        // no savepoint either; IMMEDIATE as in `write_transaction`.
        AnsiTransactionManager::begin_transaction_sql(conn, "BEGIN IMMEDIATE")
    }

    fn commit_batch(conn: &mut Self, _token: Option<&str>) -> QueryResult<()> {
        AnsiTransactionManager::commit_transaction(conn)
    }

    fn take_locks(_conn: &mut Self, _locks: &[(i64, bool)]) -> QueryResult<()> {
        // One writer at a time already: the immediate transaction is the lock.
        Ok(())
    }

    fn verify_capabilities(conn: &mut Self) -> Result<()> {
        #[cfg(feature = "idempotency")]
        crate::idempotency::verify_on(conn)?;
        #[cfg(feature = "rebuild")]
        crate::rebuild::verify(conn)?;
        #[cfg(feature = "operator")]
        crate::operator::verify(conn)?;
        let _ = conn;
        Ok(())
    }

    fn lock_scope(conn: &mut Self) -> QueryResult<String> {
        lock_scope(conn)
    }

    fn transaction_token(_conn: &mut Self) -> QueryResult<Option<String>> {
        // SQLite has no transaction id diesel can read, and an error a handler
        // swallowed does not abort an SQLite transaction.
        Ok(None)
    }
}

/// The store's schema as projection lock keys name it.
fn lock_scope(_conn: &mut SqliteConnection) -> QueryResult<String> {
    // One database per file: no schema to tell stores apart (and no advisory locks).
    Ok("main".to_owned())
}
