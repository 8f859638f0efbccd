//! [`StoreBuilder`]: the settings, their checks, and what `build` does (connect,
//! migrate under the migration lock, verify, register the handlers and projections).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::r2d2::{CustomizeConnection, Pool};
use diesel::QueryResult;
#[cfg(feature = "rebuild")]
use inbox_core::rebuild::DynRebuild;
use inbox_core::{
    Clock, ConsumerGroup, DynHandler, Handler, RetryLadder, SystemClock, MAX_DATABASE_TIMEOUT,
};

use super::{Inner, Settings, Store};
use crate::backend::{valid_schema_name, Setup, StoreConnection};
use crate::knobs::Knobs;
use crate::pool::StoreManager;
use crate::{verify, Backend, Error, Result};

/// Builds a [`Store`].
///
/// Every setting has a default; [`build`](Self::build) checks them, connects,
/// migrates and verifies the schema.
///
/// ```
/// use std::time::Duration;
/// use diesel::SqliteConnection;
/// use inbox_core::RetryLadder;
/// use inbox_diesel::Store;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = std::env::temp_dir().join(format!("inbox-builder-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("app.db");
/// let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", path.display()))
///     .pool_size(2)
///     .crash_limit(5)
///     .batch_deadline(Duration::from_secs(30))
///     .transaction_retries(5)
///     .retry_ladder(RetryLadder::default())
///     .build()?;
/// # drop(store);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(()) }
/// ```
#[must_use]
pub struct StoreBuilder<C: StoreConnection> {
    url: String,
    schema: Option<String>,
    pool_size: u32,
    clock: Arc<dyn Clock>,
    pub(crate) handlers: Vec<Arc<dyn DynHandler<C>>>,
    #[cfg(feature = "rebuild")]
    pub(crate) rebuilds: Vec<Arc<dyn DynRebuild<C>>>,
    crash_limit: u32,
    batch_deadline: Duration,
    statement_timeout: Duration,
    transaction_retries: u32,
    ladder: Option<RetryLadder>,
    migrate: bool,
    setup: Vec<Setup<C>>,
    knobs: Knobs,
}

/// PostgreSQL: the first key of the migration lock, `pg_advisory_lock(
/// MIGRATION_LOCK_CLASS, hashtext('<schema>'))`, whose second key is the hash of the
/// store's schema (its `current_schema()` without [`StoreBuilder::schema`]). A store
/// holds it while it migrates and runs the application's [`StoreBuilder::setup`], so
/// that processes starting at once on one schema take turns; an application that
/// changes its own tables outside a store's build can take it the same way.
pub const MIGRATION_LOCK_CLASS: i32 = 0x1b0c_5a11;

/// The default [`StoreBuilder::batch_deadline`].
pub const DEFAULT_BATCH_DEADLINE: Duration = Duration::from_secs(60);

/// The default [`StoreBuilder::statement_timeout`].
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

impl<C: StoreConnection> StoreBuilder<C> {
    /// The defaults, for `url` ([`Store::builder`]).
    pub(super) fn new(url: String) -> Self {
        StoreBuilder {
            url,
            schema: None,
            pool_size: 4,
            clock: Arc::new(SystemClock),
            handlers: Vec::new(),
            #[cfg(feature = "rebuild")]
            rebuilds: Vec::new(),
            crash_limit: 3,
            batch_deadline: DEFAULT_BATCH_DEADLINE,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            transaction_retries: 3,
            ladder: None,
            migrate: true,
            setup: Vec::new(),
            knobs: Knobs::default(),
        }
    }

    /// PostgreSQL only: keep the store's tables in this schema (created if missing)
    /// and verify that schema's claim table. Defaults to the connection's search path.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// **Benchmarks only** (feature `bench-knobs`, never for production): turns
    /// single guarantees of the batch path off, to measure what each one costs; see
    /// [`BenchKnobs`](crate::BenchKnobs). Read once, here.
    #[cfg(feature = "bench-knobs")]
    pub fn bench_knobs(mut self, knobs: crate::BenchKnobs) -> Self {
        self.knobs = Knobs { set: Some(knobs) };
        self
    }

    /// The most connections the pool opens (default 4, at least 1, else `build`
    /// refuses it).
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// The clock every "now" comes from (default: the system clock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Registers a handler.
    pub fn handler<H: Handler<C>>(mut self, handler: H) -> Self {
        self.handlers.push(Arc::new(handler));
        self
    }

    /// Registers a shared, type-erased handler.
    pub fn dyn_handler(mut self, handler: Arc<dyn DynHandler<C>>) -> Self {
        self.handlers.push(handler);
        self
    }

    /// Unfinished starts of a redelivered message after which it is dead-lettered as
    /// `crash_loop` without running (default 3, at least 1).
    pub fn crash_limit(mut self, limit: u32) -> Self {
        self.crash_limit = limit;
        self
    }

    /// How long a batch may hold its transaction (default 60 s; at least 1 ms, at most
    /// [`MAX_DATABASE_TIMEOUT`], about 24.8 days, else `build` refuses it). On PostgreSQL a
    /// transaction left idle this long (a handler that hangs between statements) is
    /// ended by the server (`idle_in_transaction_session_timeout`), which releases its
    /// row and projection locks: nothing of the batch commits, nothing is acked, and a
    /// redelivered message that hung has its start counted like a crash. A process's
    /// crash-detection slot held longer than this is taken over. Transports give
    /// [`InboxStore::batch_deadline`](inbox_core::InboxStore::batch_deadline) to a
    /// batch before they abandon it.
    pub fn batch_deadline(mut self, deadline: Duration) -> Self {
        self.batch_deadline = deadline;
        self
    }

    /// PostgreSQL's `statement_timeout` on the store's connections (default 30 s, at
    /// least 1 ms and at most the batch deadline, else `build` refuses it): a statement running longer is cancelled, a failure of
    /// the message whose handler ran it. It applies to every pooled connection,
    /// including those the application takes with [`Store::connection`].
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// How often a batch is run again after a deadlock, serialization failure or
    /// SQLITE_BUSY before it is split (default 3; 0 splits at once; any count up to
    /// `u32::MAX` is taken, each rerun waiting 5 ms longer than the one before).
    pub fn transaction_retries(mut self, retries: u32) -> Self {
        self.transaction_retries = retries;
        self
    }

    /// The delays the transport can wait out (its retry tiers): a retry's delay is
    /// rounded up to a tier, and `next_attempt_at` records the delay actually used.
    /// Without a ladder (the in-process transport) the policy's delay is used as is.
    pub fn retry_ladder(mut self, ladder: RetryLadder) -> Self {
        self.ladder = Some(ladder);
        self
    }

    /// Whether `build` runs the embedded migrations first (default true).
    pub fn run_migrations(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// The application's own setup (`CREATE TABLE IF NOT EXISTS ...` of its
    /// projections and ledgers): `build` runs it on its first connection right after
    /// the framework's migrations, under the same lock ([`MIGRATION_LOCK_CLASS`] on
    /// PostgreSQL), so a process that starts while another runs its setup waits and
    /// then sees the other's tables committed. Two processes that start at once on a
    /// fresh database then both start: PostgreSQL does not make concurrent
    /// `CREATE TABLE IF NOT EXISTS` of one table safe (the second fails on
    /// `pg_type_typname_nsp_index`). On SQLite (one writer) each DDL statement takes
    /// the write lock and is checked again under it, so the race cannot occur there.
    /// Steps run in the order given, outside a transaction (a step opens its own
    /// where it needs one), also when [`run_migrations`](Self::run_migrations) is off.
    ///
    /// ```
    /// use diesel::connection::SimpleConnection;
    /// use diesel::SqliteConnection;
    /// use inbox_diesel::Store;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = std::env::temp_dir().join(format!("inbox-setup-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir)?;
    /// # let url = format!("sqlite://{}", dir.join("app.db").display());
    /// let store = Store::<SqliteConnection>::builder(url)
    ///     .setup(|conn: &mut SqliteConnection| {
    ///         conn.batch_execute("CREATE TABLE IF NOT EXISTS usage_total (total BIGINT NOT NULL)")
    ///     })
    ///     .build()?;
    /// # drop(store);
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub fn setup(
        mut self,
        step: impl Fn(&mut C) -> QueryResult<()> + Send + Sync + 'static,
    ) -> Self {
        self.setup.push(Box::new(step));
        self
    }

    /// Connects, runs the migrations (unless turned off), and refuses to start unless
    /// [`Store::verify_schema`] accepts the live schema.
    pub fn build(self) -> Result<Store<C>> {
        self.assemble(true)
    }

    /// Like [`StoreBuilder::build`] but without verifying the schema. For tests that
    /// sabotage the schema on purpose, so hidden from the documentation; a store
    /// uses `build`.
    #[doc(hidden)]
    pub fn build_unchecked(self) -> Result<Store<C>> {
        self.assemble(false)
    }

    fn assemble(self, check_schema: bool) -> Result<Store<C>> {
        self.check_settings()?;
        let handlers = routes(self.handlers)?;
        #[cfg(feature = "rebuild")]
        let rebuilds = register(self.rebuilds)?;
        let mut first = first_connection::<C>(
            &self.url,
            self.schema.as_deref(),
            (self.migrate, &self.setup),
            check_schema,
        )?;
        let lock_scope = C::lock_scope(&mut first)?;
        C::set_timeouts(&mut first, self.statement_timeout, self.batch_deadline)?;
        drop(first);

        let (manager, closer) = StoreManager::<C>::new(C::pool_url(&self.url));
        let pool = Pool::builder()
            .max_size(self.pool_size)
            .min_idle(Some(1))
            // No `SELECT 1` per check-out (a round trip per batch): a connection that
            // broke is found by its failing statement and discarded (`has_broken`).
            .test_on_check_out(false)
            .connection_customizer(Box::new(Customizer {
                schema: self.schema.clone(),
                statement_timeout: self.statement_timeout,
                batch_deadline: self.batch_deadline,
            }))
            .build(manager)?;
        Ok(Store {
            inner: Arc::new(Inner {
                pool,
                closer,
                handlers,
                clock: self.clock,
                settings: Settings {
                    crash_limit: self.crash_limit,
                    batch_deadline: self.batch_deadline,
                    statement_timeout: self.statement_timeout,
                    transaction_retries: self.transaction_retries,
                    ladder: self.ladder,
                },
                slots: Mutex::new(HashMap::new()),
                errored_starts: Mutex::default(),
                url: self.url,
                schema: self.schema,
                listener: Mutex::default(),
                #[cfg(feature = "rebuild")]
                rebuilds,
                lock_scope,
                knobs: self.knobs,
            }),
        })
    }

    /// Refuses settings the store cannot run with, before connecting.
    fn check_settings(&self) -> Result<()> {
        // A store of one backend never opens a URL of the other's scheme (SQLite would
        // take `postgres://...` as a file name). A PostgreSQL store still takes libpq's
        // `key=value` strings, which name no scheme; a SQLite store refuses them (it
        // would create a file named `host=...`).
        let lower = self.url.to_ascii_lowercase();
        let other = match C::BACKEND {
            Backend::Postgres => lower.starts_with("sqlite:") || lower.starts_with("file:"),
            Backend::Sqlite => {
                lower.starts_with("postgres://")
                    || lower.starts_with("postgresql://")
                    || crate::url::is_conninfo(&self.url)
            }
        };
        if other {
            return Err(Error::invalid(
                "url",
                match C::BACKEND {
                    Backend::Postgres => "a postgres:// or postgresql:// URL, or a libpq key=value string (a PostgreSQL store)",
                    Backend::Sqlite => "a sqlite:// URL or a file path (a SQLite store), not a postgres:// URL or a libpq key=value string",
                },
                format_args!("a URL of the other backend: {}", crate::redact(&self.url)),
            ));
        }
        if let Some(schema) = &self.schema {
            if C::BACKEND != Backend::Postgres {
                return Err(Error::invalid(
                    "schema",
                    "no schema on SQLite (schemas are PostgreSQL's)",
                    format_args!("{schema:?}"),
                ));
            }
            if !valid_schema_name(schema) {
                return Err(Error::InvalidSchemaName(schema.clone()));
            }
        }
        if self.crash_limit == 0 {
            return Err(Error::invalid("crash_limit", "at least 1", 0));
        }
        // PostgreSQL takes timeouts up to 2^31 - 1 ms; refused here rather than by the
        // server's `SET` on every connection. Refused on SQLite too: the deadline is
        // also the transports' and the crash slot's.
        if self.batch_deadline < Duration::from_millis(1)
            || self.batch_deadline > MAX_DATABASE_TIMEOUT
        {
            return Err(Error::invalid(
                "batch_deadline",
                "at least 1 ms and at most 2147483647 ms (MAX_DATABASE_TIMEOUT)",
                format_args!("{:?}", self.batch_deadline),
            ));
        }
        if self.statement_timeout < Duration::from_millis(1)
            || self.statement_timeout > self.batch_deadline
        {
            return Err(Error::invalid(
                "statement_timeout",
                "at least 1 ms and at most batch_deadline",
                format_args!(
                    "{:?} with batch_deadline {:?}",
                    self.statement_timeout, self.batch_deadline
                ),
            ));
        }
        if self.pool_size == 0 {
            return Err(Error::invalid("pool_size", "at least 1", 0));
        }
        Ok(())
    }
}

/// The handlers by route; two for one route are refused.
#[allow(clippy::type_complexity)]
fn routes<C: StoreConnection>(
    list: Vec<Arc<dyn DynHandler<C>>>,
) -> Result<HashMap<(ConsumerGroup, String), Arc<dyn DynHandler<C>>>> {
    let mut handlers = HashMap::new();
    for handler in list {
        let route = (handler.group().clone(), handler.message_type().to_owned());
        if handlers.contains_key(&route) {
            return Err(Error::Core(inbox_core::Error::DuplicateHandler {
                group: route.0.to_string(),
                message_type: route.1,
            }));
        }
        handlers.insert(route, handler);
    }
    Ok(handlers)
}

/// The store's first connection, opened by hand: the driver's own error says why
/// ("connection refused"), which a pool's time-out would not. Migrates and verifies
/// on it, before any pool exists: a refused schema leaves no pool thread behind still
/// connecting (a process that exits on the error would tear the TLS library down
/// under it).
fn first_connection<C: StoreConnection>(
    url: &str,
    schema: Option<&str>,
    (migrate, setup): (bool, &[Setup<C>]),
    check_schema: bool,
) -> Result<C> {
    let mut first = C::establish_url(url).map_err(|source| Error::connect(url, &source))?;
    C::on_acquire(&mut first, schema)?;
    if migrate || !setup.is_empty() {
        C::migrate(&mut first, schema, migrate, setup)?;
    }
    if check_schema {
        verify::check(&C::catalog(&mut first, "inbox_claims")?)?;
        C::verify_capabilities(&mut first)?;
    }
    Ok(first)
}

#[derive(Debug)]
struct Customizer {
    schema: Option<String>,
    statement_timeout: Duration,
    batch_deadline: Duration,
}

impl<C: StoreConnection> CustomizeConnection<C, diesel::r2d2::Error> for Customizer {
    fn on_acquire(&self, conn: &mut C) -> std::result::Result<(), diesel::r2d2::Error> {
        C::on_acquire(conn, self.schema.as_deref())
            .and_then(|()| C::set_timeouts(conn, self.statement_timeout, self.batch_deadline))
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// Checks the projections registered on a builder: each has a lock and a name of its
/// own.
#[cfg(feature = "rebuild")]
fn register<C: StoreConnection>(
    rebuilds: Vec<Arc<dyn DynRebuild<C>>>,
) -> Result<HashMap<String, Arc<dyn DynRebuild<C>>>> {
    let mut registered = HashMap::new();
    for hook in rebuilds {
        if hook.lock().is_none() {
            return Err(Error::ProjectionWithoutLock {
                projection: hook.projection().to_owned(),
                group: hook.group().to_string(),
                message_type: hook.message_type().to_owned(),
            });
        }
        let name = hook.projection().to_owned();
        if registered.insert(name.clone(), hook).is_some() {
            return Err(Error::DuplicateProjection(name));
        }
    }
    Ok(registered)
}
