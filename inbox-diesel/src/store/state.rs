//! The state a store's batches share ([`Inner`]) and the settings they run under;
//! its fields are touched by the store's own modules only (the builder fills them),
//! every other module goes through its methods.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::r2d2::Pool;
use diesel::QueryResult;
use inbox_core::{ClaimKey, Clock, ConsumerGroup, DynHandler, RetryLadder};

use crate::backend::StoreConnection;
use crate::knobs::Knobs;
use crate::pool::{Closer, PooledStoreConnection, StoreManager};
use crate::slot::Slot;
use crate::Result;

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
    pub(super) pool: Pool<StoreManager<C>>,
    /// Waits for the pool's connecting threads when the store is dropped.
    pub(super) closer: Closer,
    pub(super) handlers: HashMap<(ConsumerGroup, String), Arc<dyn DynHandler<C>>>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) settings: Settings,
    /// One crash-detection slot per consumer group in this process.
    pub(super) slots: Mutex<HashMap<ConsumerGroup, Arc<Slot>>>,
    /// Redelivered messages whose start mark this process committed and whose
    /// processing then failed on a store error: their next start is not a crash.
    pub(super) errored_starts: Mutex<HashSet<ClaimKey>>,
    /// The URL and schema the store was built with (the outbox's LISTEN connection
    /// opens its own connection, outside the pool). The URL is never printed.
    pub(super) url: String,
    pub(super) schema: Option<String>,
    /// What a relay waits for enqueues on (PostgreSQL: the LISTEN connection,
    /// opened on the first wait).
    pub(super) listener: Mutex<C::Listener>,
    /// The projections with rebuild hooks, by name (the feature `rebuild`).
    #[cfg(feature = "rebuild")]
    pub(super) rebuilds: HashMap<String, Arc<dyn inbox_core::rebuild::DynRebuild<C>>>,
    /// The schema projection lock keys are scoped to (see `rebuild`).
    pub(super) lock_scope: String,
    /// The batch path's switches (all on unless a benchmark turned one off).
    pub(super) knobs: Knobs,
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
    #[cfg(feature = "rebuild")]
    pub(crate) fn rebuilds(&self) -> &HashMap<String, Arc<dyn inbox_core::rebuild::DynRebuild<C>>> {
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
