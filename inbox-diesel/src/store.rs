//! The store: [`Store`], its builder and the state its batches share ([`Inner`],
//! whose fields only this module touches; the other modules go through its methods).
//!
//! Two builds of one schema at once (two processes starting on a fresh database) write
//! the same catalog rows: the framework's migrations and the application's
//! [`StoreBuilder::setup`] run under one lock ([`MIGRATION_LOCK_CLASS`] on PostgreSQL,
//! held across both; SQLite's migrations in one write transaction), so the second
//! waits and then finds everything created (`store_settings::
//! two_setups_started_at_once_on_a_fresh_schema_both_start`, the race forced by a
//! third connection holding the lock until both wait; `store_settings::
//! two_sqlite_setups_started_at_once_both_start`, at a barrier).
//!
//! Every setting is checked by `build` before it connects, or saturates to a bound
//! its setter documents; none reaches the database out of range
//! (`inbox-diesel/tests/store_settings.rs`).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::r2d2::{CustomizeConnection, Pool};
use diesel::QueryResult;
use inbox_core::{
    ClaimKey, Clock, ConsumerGroup, DeadLetterOutcome, DeadLetterReason, Decision, DynHandler,
    Envelope, Handler, InboxStore, RetryLadder, SystemClock, MAX_DATABASE_TIMEOUT,
};

use crate::backend::{valid_schema_name, Setup, StoreConnection};
use crate::knobs::Knobs;
use crate::pool::{Closer, PooledStoreConnection, StoreManager};
use crate::rows::{ClaimRecord, DeadLetter};
use crate::slot::Slot;
use crate::{verify, Backend, Error, Result};
use inbox_core::DynRebuild;

/// The settings a batch runs under.
pub(crate) struct Settings {
    pub crash_limit: u32,
    /// How long a batch may hold its transaction (and the crash slot).
    pub batch_deadline: Duration,
    /// PostgreSQL's `statement_timeout` on the store's connections.
    pub statement_timeout: Duration,
    pub transaction_retries: u32,
    pub ladder: Option<RetryLadder>,
}

pub(crate) struct Inner<C: StoreConnection> {
    pool: Pool<StoreManager<C>>,
    /// Waits for the pool's connecting threads when the store is dropped.
    closer: Closer,
    handlers: HashMap<(ConsumerGroup, String), Arc<dyn DynHandler<C>>>,
    clock: Arc<dyn Clock>,
    settings: Settings,
    /// One crash-detection slot per consumer group in this process.
    slots: Mutex<HashMap<ConsumerGroup, Arc<Slot>>>,
    /// Redelivered messages whose start mark this process committed and whose
    /// processing then failed on a store error: their next start is not a crash.
    errored_starts: Mutex<HashSet<ClaimKey>>,
    /// The URL and schema the store was built with (the outbox's LISTEN connection
    /// opens its own connection, outside the pool). The URL is never printed.
    url: String,
    schema: Option<String>,
    /// What a relay waits for enqueues on (PostgreSQL: the LISTEN connection,
    /// opened on the first wait).
    listener: Mutex<C::Listener>,
    /// The projections with rebuild hooks, by name (registered only with the
    /// feature `rebuild`).
    #[cfg_attr(not(feature = "rebuild"), allow(dead_code))]
    rebuilds: HashMap<String, Arc<dyn inbox_core::DynRebuild<C>>>,
    /// The schema projection lock keys are scoped to (see `rebuild`).
    lock_scope: String,
    /// The batch path's switches (all on unless a benchmark turned one off).
    knobs: Knobs,
}

impl<C: StoreConnection> Drop for Inner<C> {
    fn drop(&mut self) {
        // The pool's threads outlive it; none may still be connecting when the
        // process exits (see the `pool` module).
        self.closer.close();
    }
}

impl<C: StoreConnection> Inner<C> {
    /// A pooled connection.
    pub(crate) fn connection(&self) -> Result<PooledStoreConnection<C>> {
        Ok(self.pool.get()?)
    }

    /// The store's clock's now.
    pub(crate) fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// The settings batches run under.
    /// The advisory key of a projection lock in this store's schema (live batches and
    /// rebuilds of the store compute the same one; see `rebuild`).
    pub(crate) fn lock_key(&self, lock: &inbox_core::ProjectionLock) -> i64 {
        lock.key_in(&self.lock_scope)
    }

    /// The projections with rebuild hooks, by name.
    #[cfg_attr(not(feature = "rebuild"), allow(dead_code))]
    pub(crate) fn rebuilds(&self) -> &HashMap<String, Arc<dyn inbox_core::DynRebuild<C>>> {
        &self.rebuilds
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The batch path's switches.
    pub(crate) fn knobs(&self) -> Knobs {
        self.knobs
    }

    /// The handler registered for a group and message type.
    pub(crate) fn handler(
        &self,
        group: &ConsumerGroup,
        message_type: &str,
    ) -> Option<&Arc<dyn DynHandler<C>>> {
        self.handlers.get(&(group.clone(), message_type.to_owned()))
    }

    /// The group's crash-detection slot in this process.
    pub(crate) fn slot(&self, group: &ConsumerGroup) -> Arc<Slot> {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(group.clone())
            .or_default()
            .clone()
    }

    /// Redelivered messages whose last start here ended in a store error.
    pub(crate) fn errored_starts(&self) -> MutexGuard<'_, HashSet<ClaimKey>> {
        self.errored_starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets a connection up as the store's own again (after a handler ended the
    /// transaction or changed the session).
    pub(crate) fn restore_session(&self, conn: &mut C) -> QueryResult<()> {
        C::reset_session(conn)
            .and_then(|()| C::on_acquire(conn, self.schema.as_deref()))
            .and_then(|()| {
                C::set_timeouts(
                    conn,
                    self.settings.statement_timeout,
                    self.settings.batch_deadline,
                )
            })
    }

    /// Waits for an enqueue in the store's schema (see
    /// [`OutboxStore::wait_for_enqueue`](inbox_core::OutboxStore::wait_for_enqueue)).
    pub(crate) fn wait_for_enqueue(&self, timeout: Duration) -> Result<bool> {
        C::wait_for_enqueue(
            &self.listener,
            &self.url,
            self.schema.as_deref(),
            &*self.clock,
            timeout,
        )
    }
}

/// The claim store: processes batches of deliveries exactly once per consumer group
/// on PostgreSQL or SQLite, with retries, dead letters and crash-loop detection.
///
/// Cloning is cheap and shares the pool. Build it with [`Store::builder`].
///
/// On SQLite the store keeps its tables in the database file, next to the
/// application's:
///
/// ```
/// use diesel::SqliteConnection;
/// use inbox_core::ConsumerGroup;
/// use inbox_diesel::{Backend, Store};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = std::env::temp_dir().join(format!("inbox-store-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("app.db");
/// let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", path.display()))
///     .build()?; // runs migrations, then verifies the claim index
/// assert_eq!(store.backend(), Backend::Sqlite);
/// store.verify_schema()?;
/// let group = ConsumerGroup::new("billing.daily-usage")?;
/// assert!(store.dead_letters(&group)?.is_empty());
/// # drop(store);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(()) }
/// ```
///
/// On PostgreSQL, in a schema of its own:
///
/// ```no_run
/// use diesel::PgConnection;
/// use inbox_diesel::Store;
/// # fn main() -> inbox_diesel::Result<()> {
/// let store = Store::<PgConnection>::builder("postgres://postgres@127.0.0.1/test")
///     .schema("billing")
///     .build()?; // runs migrations, then verifies the claim index
/// # let _ = store; Ok(()) }
/// ```
pub struct Store<C: StoreConnection> {
    pub(crate) inner: Arc<Inner<C>>,
}

impl<C: StoreConnection> Clone for Store<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C: StoreConnection> fmt::Debug for Store<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("backend", &C::BACKEND)
            .field("handlers", &self.inner.handlers.len())
            .finish_non_exhaustive()
    }
}

impl<C: StoreConnection> Store<C> {
    /// Starts building a store for `url`.
    pub fn builder(url: impl Into<String>) -> StoreBuilder<C> {
        StoreBuilder {
            url: url.into(),
            schema: None,
            pool_size: 4,
            clock: Arc::new(SystemClock),
            handlers: Vec::new(),
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

    /// The backend the store runs on.
    pub fn backend(&self) -> Backend {
        C::BACKEND
    }

    /// The connection pool (for the application's own queries and tests).
    pub fn pool(&self) -> &Pool<StoreManager<C>> {
        &self.inner.pool
    }

    /// A pooled connection, set up like the store's own (search path, pragmas).
    pub fn connection(&self) -> Result<PooledStoreConnection<C>> {
        Ok(self.inner.pool.get()?)
    }

    /// The advisory lock key a projection lock has in this store (the lock's id mixed
    /// with the store's schema; see [`inbox_core::ProjectionLock::key_in`]).
    pub fn projection_lock_key(&self, lock: &inbox_core::ProjectionLock) -> i64 {
        self.inner.lock_key(lock)
    }

    /// The store's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// Checks the live schema: a unique index (or primary key) must cover exactly the
    /// claim key columns, with no predicate and no expression, on NOT NULL columns,
    /// and no other unique index may constrain a part of them. Then the tables of the
    /// capabilities this build has: with `idempotency`, the same rule for the
    /// idempotency table and its key (caller, idempotency_key); with `rebuild`,
    /// `inbox_claims.covered_at`, `inbox_dead_letters.resolved_at`, and
    /// `inbox_rebuild_runs` with a unique index on exactly `projection`; with
    /// `operator`, the operator migration's columns and tables.
    pub fn verify_schema(&self) -> Result<()> {
        let mut conn = self.connection()?;
        verify::check(&C::catalog(&mut conn)?)?;
        C::verify_capabilities(&mut conn)
    }

    /// Processes one consumer group's batch; see [`InboxStore::process_batch`].
    ///
    /// One decision per delivery, in order. The handler's write commits with the
    /// claim, so a copy of the same message (in the batch or delivered again later)
    /// is a duplicate and the handler does not run for it:
    ///
    /// ```
    /// use diesel::connection::SimpleConnection;
    /// use diesel::sql_types::BigInt;
    /// use diesel::{RunQueryDsl, SqliteConnection};
    /// use inbox_core::{
    ///     ConsumerGroup, Decision, Envelope, Handler, HandlerError, MessageContext, MessageKey,
    /// };
    /// use inbox_diesel::Store;
    ///
    /// struct UsageTotal {
    ///     group: ConsumerGroup,
    /// }
    ///
    /// impl Handler<SqliteConnection> for UsageTotal {
    ///     type Message = serde_json::Value;
    ///     fn group(&self) -> &ConsumerGroup { &self.group }
    ///     fn message_type(&self) -> &str { "usage.recorded" }
    ///     fn handle(&self, conn: &mut SqliteConnection, msg: serde_json::Value, _: &MessageContext<'_>)
    ///         -> Result<(), HandlerError>
    ///     {
    ///         let amount = msg["amount"].as_i64().ok_or(HandlerError::permanent("no amount"))?;
    ///         diesel::sql_query("UPDATE usage_total SET total = total + ?")
    ///             .bind::<BigInt, _>(amount)
    ///             .execute(conn)?; // in the store's transaction: commits with the claim
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dir = std::env::temp_dir().join(format!("inbox-batch-{}", std::process::id()));
    /// std::fs::create_dir_all(&dir)?;
    /// let path = dir.join("app.db");
    /// let group = ConsumerGroup::new("billing.usage-total")?;
    /// let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", path.display()))
    ///     .handler(UsageTotal { group: group.clone() })
    ///     .build()?;
    /// store.connection()?.batch_execute(
    ///     "CREATE TABLE usage_total (total BIGINT NOT NULL); INSERT INTO usage_total VALUES (0);",
    /// )?;
    ///
    /// let key = MessageKey::derive("billing", "event-1", "usage.recorded");
    /// let delivery = Envelope::new(key, "usage.recorded", br#"{"amount": 40}"#.to_vec());
    /// let decisions = store.process_batch(&group, &[delivery.clone(), delivery.clone()])?;
    /// assert_eq!(decisions, [Decision::Processed, Decision::Duplicate]);
    /// let again = store.process_batch(&group, &[delivery.redelivered()])?;
    /// assert_eq!(again, [Decision::Duplicate]);
    ///
    /// let total: i64 = diesel::select(diesel::dsl::sql::<BigInt>("(SELECT total FROM usage_total)"))
    ///     .get_result(&mut *store.connection()?)?;
    /// assert_eq!(total, 40);
    /// # drop(store);
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub fn process_batch(
        &self,
        group: &ConsumerGroup,
        batch: &[Envelope],
    ) -> Result<Vec<Decision>> {
        self.inner.process(group, batch)
    }

    /// Reads the stored claim of `key`, if there is one; it claims nothing (the
    /// claim itself is made by [`process_batch`](Self::process_batch)).
    pub fn claim_record(&self, key: &ClaimKey) -> Result<Option<ClaimRecord>> {
        let mut conn = self.connection()?;
        Ok(C::read_claim(&mut conn, key)?)
    }

    /// Reads a group's dead letters, oldest first.
    pub fn dead_letters(&self, group: &ConsumerGroup) -> Result<Vec<DeadLetter>> {
        let mut conn = self.connection()?;
        Ok(C::read_dead_letters(&mut conn, group)?)
    }

    /// Whether the store's connections get the server's messages untranslated, which
    /// it recognises PostgreSQL's deadlocks and data errors by (see [`ErrorClass`]).
    /// The store sets `lc_messages = 'C'` where the role may; false means a translated
    /// server and a role that may not (a warning said so at start-up). Always true on
    /// SQLite.
    ///
    /// [`ErrorClass`]: crate::ErrorClass
    pub fn recognises_server_errors(&self) -> Result<bool> {
        let mut conn = self.connection()?;
        Ok(C::recognises_server_errors(&mut conn)?)
    }
}

impl<C: StoreConnection> InboxStore for Store<C> {
    fn process_batch(
        &self,
        group: &ConsumerGroup,
        batch: &[Envelope],
    ) -> inbox_core::Result<Vec<Decision>> {
        Ok(self.inner.process(group, batch)?)
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        let mut routes: Vec<_> = self.inner.handlers.keys().cloned().collect();
        routes.sort();
        routes
    }

    fn dead_letter(
        &self,
        group: &ConsumerGroup,
        envelope: &Envelope,
        reason: DeadLetterReason,
        detail: &str,
    ) -> inbox_core::Result<DeadLetterOutcome> {
        Ok(self.inner.dead_letter(group, envelope, reason, detail)?)
    }

    fn batch_deadline(&self) -> Option<Duration> {
        Some(self.inner.settings.batch_deadline)
    }
}

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
    pub(crate) rebuilds: Vec<Arc<dyn inbox_core::DynRebuild<C>>>,
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
    /// [`InboxStore::batch_deadline`] to a batch before they abandon it.
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
                rebuilds,
                lock_scope,
                knobs: self.knobs,
            }),
        })
    }

    /// Refuses settings the store cannot run with, before connecting.
    fn check_settings(&self) -> Result<()> {
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
        verify::check(&C::catalog(&mut first)?)?;
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
