/// Everything that can go wrong in `inbox-diesel`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL's scheme names no supported backend.
    #[error("unsupported database url {url}: expected postgres://, postgresql://, sqlite:// or a file path")]
    UnsupportedUrl {
        /// The URL, password redacted.
        url: String,
    },
    /// The database could not be reached; the driver's own error is kept, as text
    /// with every password of the URL taken out (libpq quotes parts of the URL back,
    /// a bad percent escape of the password among them).
    #[error("could not connect to {url}")]
    Connect {
        /// The URL, password redacted.
        url: String,
        /// The driver's error and its causes, passwords redacted.
        #[source]
        source: inbox_core::RedactedError,
    },
    /// The connection pool failed.
    #[error("connection pool error")]
    Pool(#[from] diesel::r2d2::PoolError),
    /// A schema name is not a plain identifier.
    #[error("invalid schema name {0:?}: expected [a-z_][a-z0-9_]*, at most 63 bytes")]
    InvalidSchemaName(String),
    /// Running the embedded migrations failed.
    #[error("migration failed")]
    Migration(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The live schema does not hold what the store needs: the claim table's key,
    /// the idempotency table's key, the operator's or a rebuild's objects. One
    /// variant whatever the table, so a caller (the CLI's exit code 3, say) maps
    /// every schema mismatch alike; `part` says whose objects, `problem` which rule.
    #[error("{} mismatch: expected {expected}, found {found} on {table}", part.label())]
    SchemaMismatch {
        /// Whose objects: the claim table, the idempotency table, the operator's,
        /// a rebuild's.
        part: SchemaPart,
        /// Which requirement the schema breaks.
        problem: SchemaProblem,
        /// What the store needs.
        expected: String,
        /// What the catalog says.
        found: String,
        /// The table, schema-qualified where the backend has schemas.
        table: String,
    },
    /// A setting was rejected before anything ran: which one, what it must be and
    /// what it was.
    #[error("invalid {setting}: expected {expected}, found {found}")]
    InvalidSetting {
        /// The setting, as its builder method or argument is named (`pool_size`,
        /// `crash_limit`, `lease_for`, ...).
        setting: &'static str,
        /// What the setting must be.
        expected: &'static str,
        /// The value given.
        found: String,
    },
    /// A request's write was refused: its lease was taken over (another request
    /// holds another fencing token), its record was deleted (and perhaps begun again
    /// by another request), or the record is no longer in flight. Roll the
    /// transaction back.
    #[cfg(feature = "idempotency")]
    #[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
    #[error("idempotency key {key:?} of caller {caller:?}: lease token {token} was fenced off")]
    Fenced {
        /// The caller.
        caller: String,
        /// The idempotency key.
        key: String,
        /// The token the write carried.
        token: inbox_core::idempotency::LeaseToken,
    },
    /// A stored idempotency record breaks the table's rules.
    #[error("corrupt idempotency record {key:?} of caller {caller:?}: {reason}")]
    CorruptIdempotencyRecord {
        /// The caller.
        caller: String,
        /// The idempotency key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// An outbox message was refused before it was written.
    #[error("invalid outbox message {key}: {reason}")]
    InvalidOutboxMessage {
        /// The message key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A database statement failed.
    #[error("database error")]
    Database(#[source] diesel::result::Error),
    /// The connection was left inside a transaction it could not unwind.
    #[error("connection left at transaction depth {found}, expected {expected}")]
    TransactionDepth {
        /// The depth the store expected.
        expected: u32,
        /// The depth found.
        found: u32,
    },
    /// An invariant of the store's own code was broken (a bug in this crate); the
    /// text says which.
    #[error("internal error: {0}")]
    Internal(&'static str),
    /// A projection was registered with rebuild hooks, but its handler declares no
    /// projection lock (a rebuild could not exclude live batches).
    #[error("projection {projection} has rebuild hooks but its handler (group {group}, message type {message_type}) declares no projection lock")]
    ProjectionWithoutLock {
        /// The projection.
        projection: String,
        /// The handler's group.
        group: String,
        /// The handler's message type.
        message_type: String,
    },
    /// Two projections of one store have the same name.
    #[error("projection {0} is registered twice")]
    DuplicateProjection(String),
    /// No projection of that name is registered.
    #[error("unknown projection {found}: expected one of [{expected}]")]
    UnknownProjection {
        /// The name asked for.
        found: String,
        /// The projections registered, comma-separated.
        expected: String,
    },
    /// A rebuild hook failed.
    #[error("projection {projection}, partition {partition}: the rebuild hook failed")]
    RebuildHook {
        /// The projection.
        projection: String,
        /// The partition.
        partition: String,
        /// The hook's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The projection lock was not granted within the lock timeout in any try.
    #[error("projection {projection}, partition {partition}: the projection lock was not granted within {timeout:?} in {tries} tries")]
    LockTimeout {
        /// The projection.
        projection: String,
        /// The partition.
        partition: String,
        /// The lock timeout of each try.
        timeout: std::time::Duration,
        /// How many tries timed out.
        tries: u32,
    },
    /// Another runner holds (or took over) the projection's rebuild lease.
    #[error("projection {projection}: the rebuild lease passed to runner {holder} during the run")]
    RebuildLeaseLost {
        /// The projection.
        projection: String,
        /// Who holds it now.
        holder: String,
    },
    /// An `inbox-core` error (invalid key, invariant violation, ...).
    #[error(transparent)]
    Core(#[from] inbox_core::Error),
}

/// Whose schema objects an [`Error::SchemaMismatch`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaPart {
    /// The claim table `inbox_claims` (the inbox path).
    Claims,
    /// The table `idempotency_keys` (the feature `idempotency`).
    Idempotency,
    /// The operator's columns and tables (the feature `operator`).
    Operator,
    /// The rebuild tables (the feature `rebuild`).
    Rebuild,
}

impl SchemaPart {
    /// The start of the error's message: `claim index`, `idempotency index`,
    /// `operator schema`, `rebuild schema`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Claims => "claim index",
            Self::Idempotency => "idempotency index",
            Self::Operator => "operator schema",
            Self::Rebuild => "rebuild schema",
        }
    }
}

/// Which requirement of a table an [`Error::SchemaMismatch`] found broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaProblem {
    /// A table is missing (the migrations did not run).
    MissingTable,
    /// A column is missing (a claim-key column, or one a capability writes).
    MissingColumn,
    /// A claim-key column is nullable.
    NullableColumn,
    /// A claim-key column's own collation lets values that differ in bytes compare
    /// equal, so the lookup by key would find a row the insert did not conflict with.
    ColumnCollation,
    /// No unique index covers exactly the key (the claim key, the idempotency key, a
    /// rebuild's projection, the outbox's key and replay sequence): a subset, a
    /// superset, a predicate, an expression or a case-folding collation, or no unique
    /// index.
    NoClaimIndex,
    /// A unique index on exactly the claim-key columns is deferrable (initially
    /// deferred or immediate): `ON CONFLICT` refuses it as an arbiter, so every
    /// claim would fail.
    DeferrableIndex,
    /// The only index on exactly the claim key is invalid or not ready (a failed
    /// `CREATE INDEX CONCURRENTLY`, a concurrent drop): `ON CONFLICT` cannot use it.
    InvalidIndex,
    /// Another unique index can reject a row the key allows (a claim; an outbox
    /// replay, which keeps its message key).
    ExtraUniqueIndex,
    /// An index an operator read needs is missing or invalid (the failure groups',
    /// the activity counts'): the read would scan the table instead of a bounded
    /// index range.
    MissingIndex,
    /// A column has another type than the store writes (an idempotency table whose
    /// lease tokens are still integers: a migration has not run).
    ColumnType,
}

impl From<inbox_core::InvalidName> for Error {
    fn from(err: inbox_core::InvalidName) -> Self {
        Self::Core(err.into())
    }
}

impl Error {
    /// A rejected setting.
    pub(crate) fn invalid(
        setting: &'static str,
        expected: &'static str,
        found: impl std::fmt::Display,
    ) -> Self {
        Self::InvalidSetting {
            setting,
            expected,
            found: found.to_string(),
        }
    }

    /// The error of a failed connection to `url`: neither the URL nor the driver's
    /// error (nor any cause below it) keeps a password of `url`.
    pub(crate) fn connect(url: &str, source: &diesel::ConnectionError) -> Self {
        Self::Connect {
            url: inbox_core::redact_url(url),
            source: inbox_core::RedactedError::new(source, url),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for inbox_core::Error {
    fn from(err: Error) -> Self {
        match err {
            Error::Core(core) => core,
            other => inbox_core::Error::Store(Box::new(other)),
        }
    }
}

impl From<diesel::result::Error> for Error {
    fn from(err: diesel::result::Error) -> Self {
        // The connection that raised it may be gone (a server restarted, a failover):
        // the pool looks before it takes the connection back.
        crate::suspect::mark();
        Self::Database(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn connect_errors_hold_no_password_at_any_level() {
        let cases = [
            (
                "postgres://app:pa%zzss@db/x",
                diesel::ConnectionError::BadConnection(
                    "invalid percent-encoded token: \"pa%zzss\"".to_owned(),
                ),
                "pa%zzss",
            ),
            (
                "postgres://app:s3cret@[::1/x",
                diesel::ConnectionError::BadConnection(
                    "end of string reached when looking for matching \"]\" in IPv6 host address in URI: \"postgres://app:s3cret@[::1/x\"".to_owned(),
                ),
                "s3cret",
            ),
            (
                "postgres://app@db/x?password=s3cret",
                diesel::ConnectionError::InvalidConnectionUrl(
                    "postgres://app@db/x?password=s3cret".to_owned(),
                ),
                "s3cret",
            ),
            (
                // The NulError keeps the URL's bytes, and Debug prints them.
                "postgres://app:s3cret@db/x\0",
                diesel::ConnectionError::InvalidCString(
                    std::ffi::CString::new("postgres://app:s3cret@db/x\0").unwrap_err(),
                ),
                "s3cret",
            ),
            (
                "postgres://app:s3cret@db/x",
                diesel::ConnectionError::CouldntSetupConfiguration(
                    diesel::result::Error::QueryBuilderError(
                        "postgres://app:s3cret@db/x".into(),
                    ),
                ),
                "s3cret",
            ),
        ];
        for (url, driver, password) in cases {
            let err = Error::connect(url, &driver);
            assert!(matches!(err, Error::Connect { .. }), "{err:?}");
            for text in inbox_test_support::everything_printed(&err) {
                assert!(!text.contains(password), "{url}: {text}");
            }
            assert!(err.source().is_some(), "the driver's error is kept");
        }
    }

    #[test]
    fn the_driver_message_is_kept() {
        let err = Error::connect(
            "postgres://app:s3cret@db/x",
            &diesel::ConnectionError::BadConnection("connection refused".to_owned()),
        );
        assert_eq!(
            err.to_string(),
            "could not connect to postgres://app:***@db/x"
        );
        assert_eq!(
            inbox_core::ErrorChain(&err).to_string(),
            "could not connect to postgres://app:***@db/x: connection refused"
        );
    }
}
