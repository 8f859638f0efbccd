//! The backend contract: what the inbox path and the relay need of a backend beyond
//! the statements (connecting, migrations, the catalog, the write transaction,
//! projection locks, waiting for an enqueue), sealed, and [`StoreConnection`], with the
//! classification of database errors every backend shares. Implemented by `pg/` and
//! `sqlite/`; neutral itself (it names no backend).
//!
//! The optional capabilities are not part of it: each has its own sealed trait that
//! extends [`StoreConnection`] in its own module (`OperatorConnection`,
//! `RebuildConnection`, `IdempotencyConnection`), as diesel's `LoadConnection` extends
//! `Connection`, so this module imports none of them.

use std::sync::Mutex;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection};
use diesel::r2d2::R2D2Connection;
use diesel::{Connection, ConnectionResult, QueryResult};
use inbox_core::Clock;

use crate::statements::{
    ClaimOps, HaltOps, OutboxOps, RetentionOps, SharedClaimOps, SharedOutboxOps,
};
use crate::verify::Catalog;
use crate::{Backend, Result};

pub(crate) mod private {
    use super::*;

    /// Backend operations; sealed, so only this crate's backends implement them.
    pub trait Sealed:
        ClaimOps + SharedClaimOps + OutboxOps + SharedOutboxOps + RetentionOps + HaltOps + Sized
    {
        const BACKEND: Backend;

        /// What a relay waits for enqueues on (PostgreSQL: the store's LISTEN
        /// connection, opened on the first wait; SQLite: nothing).
        type Listener: Default + Send;

        /// Opens a connection from the store's URL.
        fn establish_url(url: &str) -> ConnectionResult<Self>;

        /// The URL the connection pool is given.
        fn pool_url(url: &str) -> String;

        /// Prepares a fresh pooled connection (search path, pragmas, the language of
        /// the server's messages).
        fn on_acquire(conn: &mut Self, schema: Option<&str>) -> QueryResult<()>;

        /// Whether the server's messages on this connection are the untranslated
        /// ones the store recognises deadlocks and data errors by.
        fn recognises_server_errors(conn: &mut Self) -> QueryResult<bool>;

        /// Undoes what a handler that ended the store's transaction may have left on
        /// the connection (an open transaction, session settings); the caller applies
        /// the store's settings again.
        fn reset_session(conn: &mut Self) -> QueryResult<()>;

        /// Bounds the connection's statements and how long a transaction may stay
        /// open without one running (a handler that hangs): PostgreSQL's
        /// `statement_timeout` and `idle_in_transaction_session_timeout`. SQLite has
        /// neither (its `busy_timeout` bounds only lock waits).
        fn set_timeouts(
            conn: &mut Self,
            statement: Duration,
            idle_in_transaction: Duration,
        ) -> QueryResult<()>;

        /// Runs the embedded migrations (in `schema`, on PostgreSQL) when `framework`,
        /// then the application's `setup` steps, all under the migration lock
        /// (PostgreSQL; SQLite's single writer serializes them).
        fn migrate(
            conn: &mut Self,
            schema: Option<&str>,
            framework: bool,
            setup: &[super::Setup<Self>],
        ) -> Result<()>;

        /// Checks the tables of the capabilities this backend has (idempotency keys,
        /// rebuilds, the operator's), after the claim table's check: the backend
        /// implements each capability, so it is the one that knows which to check.
        fn verify_capabilities(conn: &mut Self) -> Result<()>;

        /// The store's schema as projection lock keys name it (SQLite: `main`).
        fn lock_scope(conn: &mut Self) -> QueryResult<String>;

        /// Reads one of the store's tables (a constant name: its columns, their
        /// collations, its indexes) from the live catalog, in the store's schema. The
        /// one catalog read: every schema check (claims, idempotency keys, rebuild
        /// runs, the operator's tables) works on what it returns.
        fn catalog(conn: &mut Self, table: &'static str) -> Result<Catalog>;

        /// Runs `f` in a write transaction (SQLite: `BEGIN IMMEDIATE`).
        fn write_transaction<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
        where
            F: FnOnce(&mut Self) -> std::result::Result<T, E>,
            E: From<diesel::result::Error>;

        /// Begins a batch transaction (SQLite: `BEGIN IMMEDIATE`). With `savepoint`,
        /// PostgreSQL sets the handlers' savepoint (`inbox_handlers`) in the same round
        /// trip: it exists in the store's own transaction only, which is how a failed
        /// handler call is told from one that ended or restarted the transaction.
        fn begin_batch(conn: &mut Self, savepoint: bool) -> QueryResult<()>;

        /// Commits a batch transaction. With `token` (PostgreSQL), in the same round
        /// trip and before the `COMMIT`, checks that the transaction is still usable
        /// and still has that [`transaction_token`](Self::transaction_token): when the
        /// check fails, nothing is committed and the transaction is left open and
        /// aborted, for the caller to find out whose it is and roll it back.
        fn commit_batch(conn: &mut Self, token: Option<&str>) -> QueryResult<()>;

        /// Takes projection locks (id, exclusive), for the rest of the transaction.
        fn take_locks(conn: &mut Self, locks: &[(i64, bool)]) -> QueryResult<()>;

        /// Waits up to `timeout` for an enqueue in the store's schema; `false` when
        /// none came (PostgreSQL: on `listener`, in wall time; SQLite polls: sleeps on
        /// `clock` and returns `false`).
        fn wait_for_enqueue(
            listener: &Mutex<Self::Listener>,
            url: &str,
            schema: Option<&str>,
            clock: &dyn Clock,
            timeout: Duration,
        ) -> Result<bool>;

        /// The server's identity of the open transaction (PostgreSQL: its transaction
        /// id), or `None` where the backend cannot tell. Read again after a handler
        /// call, it fails if the handler left the transaction aborted, and differs if
        /// the handler ended or restarted it.
        fn transaction_token(conn: &mut Self) -> QueryResult<Option<String>>;
    }
}

/// An application's setup step (see [`StoreBuilder::setup`](crate::StoreBuilder::setup)).
pub(crate) type Setup<C> = Box<dyn Fn(&mut C) -> QueryResult<()> + Send + Sync>;

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

/// Whose a database error is, which decides what the store does with it.
///
/// Also for a handler that wants to tell its own data's fault (fail permanently) from
/// contention (return the error with `?`: the store runs the batch again).
///
/// PostgreSQL's deadlock (40P01) and data exceptions (class 22) reach diesel without
/// their SQLSTATE, so they are recognised by the server's message in English: the
/// store sets `lc_messages = 'C'` on its connections where the role may (see
/// [`Store::recognises_server_errors`](crate::Store::recognises_server_errors)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
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
    /// The store itself is unreachable or takes no writes (a lost connection, a
    /// statement the server cancelled, a read-only server or a standby, SQLSTATE
    /// 25006, as after a failover): nothing is about any delivery.
    Infrastructure,
    /// Anything else.
    Other,
}

impl ErrorClass {
    /// Classifies a database error.
    ///
    /// ```
    /// use diesel::result::{DatabaseErrorKind, Error};
    /// use inbox_diesel::ErrorClass;
    ///
    /// let err = Error::DatabaseError(
    ///     DatabaseErrorKind::Unknown,
    ///     Box::new("deadlock detected".to_owned()),
    /// );
    /// assert_eq!(ErrorClass::of(&err), ErrorClass::Contention);
    /// ```
    pub fn of(err: &diesel::result::Error) -> Self {
        classify(err)
    }
}

/// Classifies a database error.
///
/// diesel maps 40001 and class 23 to kinds but not 40P01 or class 22, so those are
/// recognised by the server's message (in the C locale the store's connections ask
/// for).
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
        // A server that takes no writes (25006, a standby, or a primary set read-only)
        // is the store's state, not any delivery's: after a failover the pool's next
        // connection finds the new primary (`target_session_attrs=read-write`).
        Error::DatabaseError(
            K::ClosedConnection | K::UnableToSendCommand | K::ReadOnlyTransaction,
            _,
        ) => ErrorClass::Infrastructure,
        Error::DatabaseError(_, info) => {
            let msg = info.message();
            if msg.contains("deadlock detected")
                || msg.contains("database is locked")
                || msg.contains("database table is locked")
            {
                ErrorClass::Contention
            } else if is_data_message(msg) {
                ErrorClass::Data
            } else if is_read_only_message(msg) {
                ErrorClass::Infrastructure
            } else {
                ErrorClass::Other
            }
        }
        Error::BrokenTransactionManager => ErrorClass::Infrastructure,
        _ => ErrorClass::Other,
    }
}

/// Messages of PostgreSQL's class 22 (data exception) under `lc_messages = 'C'`, by
/// SQLSTATE. Each phrase was checked against every message of the server's catalog
/// that contains it: none of those is outside class 22 (a bare "out of range" would
/// also match configuration errors, F0000).
const CLASS_22: &[&str] = &[
    // 22001 string_data_right_truncation
    "value too long for type",
    "bit string too long for type",
    // 22003 numeric_value_out_of_range
    "numeric field overflow",
    "integer out of range",
    "smallint out of range",
    "bigint out of range",
    "\"char\" out of range",
    "OID out of range",
    "money out of range",
    "is out of range for type",
    "value out of range: ",
    // 22004 null_value_not_allowed
    "null value not allowed for object key",
    "cannot be null",
    // 22007 invalid_datetime_format (to_date, to_timestamp)
    "invalid value \"",
    // 22008 datetime_field_overflow
    "field value out of range",
    "timestamp out of range",
    "date out of range",
    "interval out of range",
    // 22009 invalid_time_zone_displacement_value
    "time zone displacement out of range",
    // 22011 substring_error
    "negative substring length not allowed",
    // 22012 division_by_zero
    "division by zero",
    // 22021 character_not_in_repertoire (a NUL byte in text, bad UTF-8)
    "invalid byte sequence for encoding",
    // 22023 invalid_parameter_value, of bytea's input and decode()
    "invalid hexadecimal digit",
    "invalid hexadecimal data",
    "while decoding base64 sequence",
    "invalid base64 end sequence",
    // 22026 string_data_length_mismatch
    "does not match type bit",
    // 2202E array_subscript_error
    "array subscript out of range",
    // 22P02 invalid_text_representation
    "invalid input syntax for type",
    "invalid input value for enum",
    "malformed array literal",
    "malformed range literal",
    "malformed multirange literal",
    "malformed record literal",
    // 22P05 untranslatable_character (also jsonb's \u0000)
    "has no equivalent in encoding",
    "unsupported Unicode escape sequence",
];

/// Whether a PostgreSQL message says the server takes no writes (under `lc_messages
/// = 'C'`): 25006 where diesel did not map it, and a standby's "recovery is in
/// progress" (55000, e.g. from `nextval` or an advisory function on a hot standby).
fn is_read_only_message(msg: &str) -> bool {
    msg.contains("in a read-only transaction")
        || msg.contains("recovery is in progress")
        || msg.contains("during recovery")
}

/// Whether a PostgreSQL message is one of class 22's.
fn is_data_message(msg: &str) -> bool {
    CLASS_22.iter().any(|m| msg.contains(m))
}

/// Whether an `lc_messages` value gives the server's messages untranslated: C, POSIX,
/// or an English locale (PostgreSQL ships no English translation). An empty value
/// takes the server's environment, which the session cannot see.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL's only
pub(crate) fn is_untranslated(lc_messages: &str) -> bool {
    let lower = lc_messages.to_ascii_lowercase();
    let language = lower.split(['.', '@']).next().unwrap_or_default();
    matches!(language, "c" | "posix" | "en" | "english")
        || language.starts_with("en_")
        || language.starts_with("english_")
}

/// Whether a database error means "run the whole transaction again".
pub(crate) fn is_retryable(err: &diesel::result::Error) -> bool {
    classify(err) == ErrorClass::Contention
}

/// Quotes an identifier already checked to be `[a-z_][a-z0-9_]*`.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL's only
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

#[cfg(test)]
mod tests {
    use diesel::result::{DatabaseErrorKind, Error};

    use super::*;

    fn unknown(msg: &str) -> ErrorClass {
        classify(&Error::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(msg.to_owned()),
        ))
    }

    /// Real messages of PostgreSQL 15 under `lc_messages = 'C'`, each with its SQLSTATE
    /// and what raised it: at least one per phrase of [`CLASS_22`].
    #[rustfmt::skip]
    const SERVER_CLASS_22: &[(&str, &str, &str)] = &[
        ("22001", r"B'1111' into varbit(2)", r#"bit string too long for type bit varying(2)"#),
        ("22001", r"'abcdef' into varchar(3)", r#"value too long for type character varying(3)"#),
        ("22003", r"1234 into numeric(3,1)", r#"numeric field overflow"#),
        ("22003", r"2147483647::int + 1", r#"integer out of range"#),
        ("22003", r"99999::smallint", r#"smallint out of range"#),
        ("22003", r"9223372036854775807::bigint + 1", r#"bigint out of range"#),
        ("22003", r#"300::"char""#, r#""char" out of range"#),
        ("22003", r"4294967296::bigint::oid", r#"OID out of range"#),
        ("22003", r"92233720368547758::money * 2", r#"money out of range"#),
        ("22003", r"'99999999999'::int", r#"value "99999999999" is out of range for type integer"#),
        ("22003", r"1e308::float8 * 10", r#"value out of range: overflow"#),
        ("22003", r"1e-308::float8 * 1e-308", r#"value out of range: underflow"#),
        ("22004", r"jsonb_object(array[null, 'a'])", r#"null value not allowed for object key"#),
        ("22004", r"array_fill(1, null)", r#"dimension array or low bound array cannot be null"#),
        ("22023", r"json_build_object(null, 1)", r#"argument 1 cannot be null"#),
        ("22007", r"to_date('2024-xx-01', 'YYYY-MM-DD')", r#"invalid value "xx" for "MM""#),
        ("22007", r"'garbage'::timestamptz", r#"invalid input syntax for type timestamp with time zone: "garbage""#),
        ("22008", r"'2024-13-45'::date", r#"date/time field value out of range: "2024-13-45""#),
        ("22008", r"make_date(2024, 13, 1)", r#"date field value out of range: 2024-13-01"#),
        ("22008", r"'294277-01-01'::timestamp", r#"timestamp out of range: "294277-01-01""#),
        ("22008", r"'5874898-01-01'::date", r#"date out of range: "5874898-01-01""#),
        ("22008", r"'1 year'::interval * 1e300", r#"interval out of range"#),
        ("22009", r"'12:00+20'::timetz", r#"time zone displacement out of range: "12:00+20""#),
        ("22011", r"substring('abc', 1, -1)", r#"negative substring length not allowed"#),
        ("22012", r"1/0", r#"division by zero"#),
        ("22021", r"convert_from('\xff', 'UTF8')", r#"invalid byte sequence for encoding "UTF8": 0xff"#),
        ("22021", r"a NUL byte bound as text", r#"invalid byte sequence for encoding "UTF8": 0x00"#),
        ("22023", r"'\xzz'::bytea", r#"invalid hexadecimal digit: "z""#),
        ("22023", r"'\x123'::bytea", r#"invalid hexadecimal data: odd number of digits"#),
        ("22023", r"decode('a=b', 'base64')", r#"unexpected "=" while decoding base64 sequence"#),
        ("22023", r"decode('a', 'base64')", r#"invalid base64 end sequence"#),
        ("22026", r"B'111' into bit(2)", r#"bit string length 3 does not match type bit(2)"#),
        ("2202E", r"a[5][1] := 1 on a 2x2 int[]", r#"array subscript out of range"#),
        ("22P02", r"'abc'::int", r#"invalid input syntax for type integer: "abc""#),
        ("22P02", r#"'{"a":'::jsonb"#, r#"invalid input syntax for type json"#),
        ("22P02", r"'sad'::mood", r#"invalid input value for enum mood: "sad""#),
        ("22P02", r"'{1,2'::int[]", r#"malformed array literal: "{1,2""#),
        ("22P02", r"'[1,2'::int4range", r#"malformed range literal: "[1,2""#),
        ("22P02", r"'{[1,2'::int4multirange", r#"malformed multirange literal: "{[1,2""#),
        ("22P02", r"'(1'::pair", r#"malformed record literal: "(1""#),
        ("22P05", r"convert_to('€', 'LATIN1')", r#"character with byte sequence 0xe2 0x82 0xac in encoding "UTF8" has no equivalent in encoding "LATIN1""#),
        ("22P05", r#"'"\u0000"'::jsonb"#, r#"unsupported Unicode escape sequence"#),
    ];

    #[test]
    fn every_class_22_phrase_is_recognised_in_a_real_message() {
        for (state, raised_by, msg) in SERVER_CLASS_22 {
            assert_eq!(
                unknown(msg),
                ErrorClass::Data,
                "{state} from {raised_by}: {msg}"
            );
        }
        for phrase in CLASS_22 {
            assert!(
                SERVER_CLASS_22
                    .iter()
                    .any(|(_, _, msg)| msg.contains(phrase)),
                "no server message holds {phrase:?}"
            );
        }
    }

    /// Real messages of other classes that share words with class 22's.
    #[test]
    fn neighbouring_messages_of_other_classes_are_not_data() {
        for msg in [
            // F0000: configuration files.
            r#"affix flag "x" is out of range"#,
            r#"time zone offset 99999 is out of range in time zone file "Default", line 3"#,
            // 54000: chr(0), a limit of the text type.
            "null character not permitted",
            // 42601: the statement's own syntax.
            r#"syntax error at or near "[""#,
            r#"invalid Unicode escape value at or near "\u0000""#,
            // 42501, 42883, 0A000.
            r#"permission denied to set parameter "lc_messages""#,
            "function row_to_json(integer) does not exist",
            "cannot convert NaN to integer",
            // 22023 of a setting: a broken configuration is no delivery's fault.
            r#"invalid value for parameter "lc_messages": "de_DE.UTF-8""#,
        ] {
            assert_ne!(unknown(msg), ErrorClass::Data, "{msg}");
        }
    }

    #[test]
    fn deadlocks_and_data_errors_are_recognised_in_english_only() {
        assert_eq!(unknown("deadlock detected"), ErrorClass::Contention);
        // The same errors from a server whose lc_messages is German: why the store
        // asks for the C locale.
        assert_eq!(
            unknown("Verklemmung (Deadlock) entdeckt"),
            ErrorClass::Other
        );
        assert_eq!(unknown("Division durch Null"), ErrorClass::Other);
    }

    #[test]
    fn locales_whose_messages_are_untranslated() {
        for setting in [
            "C",
            "POSIX",
            "C.UTF-8",
            "C.utf8",
            "en_US.UTF-8",
            "en_GB",
            "en",
            "English_United States.1252",
        ] {
            assert!(is_untranslated(setting), "{setting}");
        }
        for setting in [
            "",
            "de_DE.UTF-8",
            "fr_FR",
            "eng",
            "ca_ES",
            "German_Germany.1252",
        ] {
            assert!(!is_untranslated(setting), "{setting}");
        }
    }
}
