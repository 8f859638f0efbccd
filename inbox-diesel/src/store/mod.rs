//! The store: [`Store`], its builder and the state its batches share ([`Inner`],
//! whose fields only the store's own modules touch; the others go through its methods).
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
//!
//! Three files: this one the type and its inbox path, `builder.rs` the builder and
//! what `build` does, `state.rs` the shared state ([`Inner`]) and its settings.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use diesel::r2d2::Pool;
use inbox_core::{
    ClaimKey, Clock, ConsumerGroup, DeadLetterOutcome, DeadLetterReason, Decision, Envelope,
    InboxStore,
};

use crate::backend::StoreConnection;
use crate::pool::{PooledStoreConnection, StoreManager};
use crate::rows::{ClaimRecord, DeadLetter};
use crate::{verify, Backend, Result};

mod builder;
mod state;

pub use builder::{
    StoreBuilder, DEFAULT_BATCH_DEADLINE, DEFAULT_STATEMENT_TIMEOUT, MIGRATION_LOCK_CLASS,
};
pub(crate) use state::{Inner, Settings};

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
        StoreBuilder::new(url.into())
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
        verify::check(&C::catalog(&mut conn, "inbox_claims")?)?;
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
