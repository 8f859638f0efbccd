//! What differs per backend beyond the claim statements: connecting, migrations,
//! the catalog, the write transaction and projection locks.

use diesel::connection::{AnsiTransactionManager, SimpleConnection};
use diesel::r2d2::R2D2Connection;
use diesel::{Connection, ConnectionResult, QueryResult};

use crate::verify::Catalog;
use crate::{Backend, Result};

pub(crate) mod private {
    use super::*;

    /// Backend operations; sealed, so only this crate's backends implement them.
    pub trait Sealed: crate::ops::ClaimOps + crate::outbox::OutboxOps + Sized {
        const BACKEND: Backend;

        /// Opens a connection from the store's URL.
        fn establish_url(url: &str) -> ConnectionResult<Self>;

        /// The URL the connection pool is given.
        fn pool_url(url: &str) -> String;

        /// Prepares a fresh pooled connection (search path, pragmas).
        fn on_acquire(conn: &mut Self, schema: Option<&str>) -> QueryResult<()>;

        /// Runs the embedded migrations (in `schema`, on PostgreSQL).
        fn migrate(conn: &mut Self, schema: Option<&str>) -> Result<()>;

        /// Reads the claim table's indexes and columns from the live catalog.
        fn catalog(conn: &mut Self) -> Result<Catalog>;

        /// Runs `f` in a write transaction (SQLite: `BEGIN IMMEDIATE`).
        fn write_transaction<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
        where
            F: FnOnce(&mut Self) -> std::result::Result<T, E>,
            E: From<diesel::result::Error>;

        /// Takes projection locks (id, exclusive), for the rest of the transaction.
        fn take_locks(conn: &mut Self, locks: &[(i64, bool)]) -> QueryResult<()>;

        /// The server's identity of the open transaction (PostgreSQL: its transaction
        /// id), or `None` where the backend cannot tell. Read again after a handler
        /// call, it fails if the handler left the transaction aborted, and differs if
        /// the handler ended or restarted it.
        fn transaction_token(conn: &mut Self) -> QueryResult<Option<String>>;
    }
}

/// A diesel connection type the store runs on: `PgConnection` or `SqliteConnection`.
///
/// Sealed: the store's SQL is written for these two backends.
pub trait StoreConnection:
    private::Sealed
    + Connection<TransactionManager = AnsiTransactionManager>
    + R2D2Connection
    + SimpleConnection
    + Send
    + 'static
{
}

impl StoreConnection for diesel::PgConnection {}
impl StoreConnection for diesel::SqliteConnection {}

/// Whose a database error is, which decides what the store does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// A deadlock (40P01), a serialization failure (40001), SQLite's busy/locked: run
    /// the transaction again.
    Contention,
    /// A data exception (SQLSTATE class 22: a NUL byte, a value out of range, a bad
    /// date; SQLite's too-big and mismatch codes): caused by the values written, it
    /// does not heal by retrying.
    Data,
    /// An integrity constraint refused the write (SQLSTATE class 23: unique, foreign
    /// key, not null, check, exclusion). From a handler, the message's data; from the
    /// store's own statements, a schema that does not match what the store verified.
    Integrity,
    /// The store itself is unreachable (a lost connection, a statement the server
    /// cancelled): nothing is about any delivery.
    Infrastructure,
    /// Anything else.
    Other,
}

/// Classifies a database error.
///
/// diesel maps 40001 and class 23 to kinds but not 40P01 or class 22, so those are
/// recognised by the server's message.
pub(crate) fn classify(err: &diesel::result::Error) -> ErrorClass {
    use diesel::result::{DatabaseErrorKind as K, Error};
    match err {
        Error::DatabaseError(K::SerializationFailure, _) => ErrorClass::Contention,
        Error::DatabaseError(
            K::UniqueViolation
            | K::ForeignKeyViolation
            | K::NotNullViolation
            | K::CheckViolation
            | K::RestrictViolation
            | K::ExclusionViolation,
            _,
        ) => ErrorClass::Integrity,
        Error::DatabaseError(K::ClosedConnection | K::UnableToSendCommand, _) => {
            ErrorClass::Infrastructure
        }
        Error::DatabaseError(_, info) => {
            let msg = info.message();
            if msg.contains("deadlock detected")
                || msg.contains("database is locked")
                || msg.contains("database table is locked")
            {
                ErrorClass::Contention
            } else if is_data_message(msg) {
                ErrorClass::Data
            } else {
                ErrorClass::Other
            }
        }
        Error::BrokenTransactionManager => ErrorClass::Infrastructure,
        _ => ErrorClass::Other,
    }
}

/// Messages of PostgreSQL's class 22 (data exception) under `lc_messages = 'C'`.
fn is_data_message(msg: &str) -> bool {
    const CLASS_22: &[&str] = &[
        "invalid byte sequence for encoding",
        "invalid input syntax",
        "out of range",
        "division by zero",
        "value too long for type",
        "numeric field overflow",
        "invalid input value for enum",
        "null character not permitted",
        "unsupported Unicode escape sequence",
    ];
    CLASS_22.iter().any(|m| msg.contains(m))
}

/// Whether a database error means "run the whole transaction again".
pub(crate) fn is_retryable(err: &diesel::result::Error) -> bool {
    classify(err) == ErrorClass::Contention
}

/// Quotes an identifier already checked to be `[a-z_][a-z0-9_]*`.
pub(crate) fn quoted(ident: &str) -> String {
    format!("\"{ident}\"")
}

/// Checks a schema name: a plain lower-case identifier.
pub(crate) fn valid_schema_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}
