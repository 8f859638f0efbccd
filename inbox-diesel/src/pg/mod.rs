//! PostgreSQL: everything the store runs there. `claims` (the claim statement over
//! arrays), `outbox` (leasing with SKIP LOCKED, NOTIFY), `retention` (purges that
//! skip locked rows), `catalog` (the claim table's indexes), `listen` (the relay's
//! LISTEN connection); this module connects, migrates, sets the session up and holds
//! the write transaction, projection locks and transaction token.

mod catalog;
mod claims;
#[cfg(feature = "idempotency")]
mod idempotency;
mod listen;
#[cfg(feature = "operator")]
mod operator;
mod outbox;
#[cfg(feature = "rebuild")]
mod rebuild;
pub(crate) mod retention;

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::{ConnectionResult, PgConnection, QueryResult};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use inbox_core::Clock;

use crate::backend::{is_untranslated, private::Sealed, quoted, StoreConnection};
use crate::verify::Catalog;
use crate::{Backend, Error, Result};
use listen::Listener;

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Serialises concurrent migration runs of several processes on one schema: the first
/// key of a two-key advisory lock whose second key is the hash of the schema's name, so
/// stores in different schemas of one database never wait for each other's migrations
/// (advisory locks are per database).
const MIGRATION_LOCK: i32 = crate::MIGRATION_LOCK_CLASS;

impl StoreConnection for PgConnection {}

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

crate::halts::halt_ops!(PgConnection);
crate::reports::report_ops!(PgConnection);

impl Sealed for PgConnection {
    const BACKEND: Backend = Backend::Postgres;

    type Listener = Listener;

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

    fn migrate(
        conn: &mut Self,
        schema: Option<&str>,
        framework: bool,
        setup: &[crate::backend::Setup<Self>],
    ) -> Result<()> {
        // The lock comes first: two stores creating one schema at once would otherwise
        // race in `CREATE SCHEMA IF NOT EXISTS` (a unique violation in pg_namespace).
        let lock = |conn: &mut Self, verb: &str| {
            diesel::sql_query(format!(
                "SELECT pg_advisory_{verb}($1, hashtext(coalesce($2, current_schema())))"
            ))
            .bind::<Integer, _>(MIGRATION_LOCK)
            .bind::<Nullable<Text>, _>(schema)
            .execute(conn)
        };
        lock(conn, "lock")?;
        let ran = (|| {
            if framework {
                if let Some(schema) = schema {
                    let q = quoted(schema);
                    conn.batch_execute(&format!(
                        "CREATE SCHEMA IF NOT EXISTS {q}; SET search_path TO {q}"
                    ))?;
                }
                conn.run_pending_migrations(MIGRATIONS)
                    .map_err(Error::Migration)?;
                // The stored failure groups need Rust's masking: filled here, not in SQL.
                crate::fingerprint::backfill(conn)?;
            }
            // The application's own tables, under the same lock: two processes'
            // `CREATE TABLE IF NOT EXISTS` at once would meet in the catalog.
            for step in setup {
                step(conn)?;
            }
            Ok(())
        })();
        lock(conn, "unlock")?;
        ran
    }

    fn catalog(conn: &mut Self, table: &'static str) -> Result<Catalog> {
        catalog::read_table(conn, table)
    }

    fn write_transaction<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>,
    {
        conn.transaction(f)
    }

    fn begin_batch(conn: &mut Self, savepoint: bool) -> QueryResult<()> {
        let sql = if savepoint {
            "BEGIN; SAVEPOINT inbox_handlers"
        } else {
            "BEGIN"
        };
        AnsiTransactionManager::begin_transaction_sql(conn, sql)
    }

    fn commit_batch(conn: &mut Self, token: Option<&str>) -> QueryResult<()> {
        let Some(token) = token else {
            return AnsiTransactionManager::commit_transaction(conn);
        };
        // One round trip: a statement that fails unless the transaction is usable (an
        // aborted one refuses every statement) and still has the token (a division by
        // zero otherwise), then the COMMIT, which a failed statement before it skips.
        // libpq reports the transaction's state after it, which diesel's transaction
        // manager follows: none after the COMMIT, an aborted one after a failed check.
        conn.batch_execute(&format!(
            "SELECT 1 / ({TOKEN_SQL} = {})::int; COMMIT",
            escaped_literal(token)
        ))
    }

    fn take_locks(conn: &mut Self, locks: &[(i64, bool)]) -> QueryResult<()> {
        for &(id, exclusive) in locks {
            LockStatement { id, exclusive }.execute(conn)?;
        }
        Ok(())
    }

    fn wait_for_enqueue(
        listener: &Mutex<Listener>,
        url: &str,
        schema: Option<&str>,
        _clock: &dyn Clock,
        timeout: Duration,
    ) -> Result<bool> {
        listen::wait(listener, url, schema, timeout)
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

    fn transaction_token(conn: &mut Self) -> QueryResult<Option<String>> {
        // The schema too: a handler that moved the session's search_path would send
        // the next batch's claims into another store's tables.
        let row: Token = diesel::sql_query(TOKEN_QUERY).get_result(conn)?;
        Ok(Some(row.token))
    }
}

/// The transaction's token as SQL: its id, and the schema the store's statements
/// resolve to (a handler that moved the session's search_path would send the next
/// batch's claims into another store's tables). Read with the claim, read again after
/// a handler call, and checked before the commit.
macro_rules! token_sql {
    () => {
        "pg_current_xact_id()::text || ' ' || coalesce(current_schema(), '')"
    };
}

pub(crate) const TOKEN_SQL: &str = token_sql!();

const TOKEN_QUERY: &str = concat!("SELECT ", token_sql!(), " AS token");

/// `value` as an escape string literal, whatever `standard_conforming_strings` says.
fn escaped_literal(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 3);
    out.push_str("E'");
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

#[derive(QueryableByName)]
struct Token {
    #[diesel(sql_type = diesel::sql_types::Text)]
    token: String,
}

/// The store's schema as projection lock keys name it.
fn lock_scope(conn: &mut PgConnection) -> QueryResult<String> {
    diesel::sql_query("SELECT coalesce(current_schema()::text, '') AS scope")
        .get_result::<Scope>(conn)
        .map(|s| s.scope)
}

#[derive(QueryableByName)]
struct Scope {
    #[diesel(sql_type = Text)]
    scope: String,
}

#[cfg(test)]
mod tests {
    use super::escaped_literal;

    #[test]
    fn a_token_is_inlined_as_an_escape_string() {
        assert_eq!(escaped_literal("742 billing"), "E'742 billing'");
        assert_eq!(escaped_literal(r"1 a'b\c"), r"E'1 a''b\\c'");
    }
}
