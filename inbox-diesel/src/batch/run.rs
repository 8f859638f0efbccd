//! What the optimistic and the isolated run of handlers share: the owned messages
//! they run, diesel's transaction depth repaired after a panic, panics and hangs
//! caught, and contention inside a handler told from its failure.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use inbox_core::{ConsumerGroup, DynHandler, HandlerFailure, MessageContext};

use super::delivery::Delivery;
use super::tx::TxError;
use crate::backend::{is_retryable, StoreConnection};
use crate::store::Inner;

/// One handler's share of an optimistic run: (delivery index, context) each.
pub(super) type HandlerRun<'h, 'e, C> =
    (&'h Arc<dyn DynHandler<C>>, Vec<(usize, MessageContext<'e>)>);

/// What a batch's handler run works on: the owned deliveries (with the attempts
/// before this one), the batch's `now`, and the transaction's token.
pub(super) struct Run<'r, 'd, 'e, C> {
    pub(super) group: &'r ConsumerGroup,
    pub(super) mine: &'r [(&'d Delivery<'e, C>, i32)],
    pub(super) now: DateTime<Utc>,
    pub(super) token: Option<&'r str>,
    /// Set when a handler ended the transaction: the rollbacks that follow can fail
    /// and replace the error, so the finding is kept here.
    pub(super) ended: &'r std::cell::Cell<Option<String>>,
}

impl<C: 'static> Run<'_, '_, '_, C> {
    pub(super) fn ended_by(&self, handler: &dyn DynHandler<C>) -> TxError {
        ended(self.ended, handler)
    }
}

/// A handler ended or restarted the store's transaction: the finding, kept in `cell`
/// (the rollbacks that follow can fail and replace the error).
pub(super) fn ended<C: 'static>(
    cell: &std::cell::Cell<Option<String>>,
    handler: &dyn DynHandler<C>,
) -> TxError {
    let name = handler_name(handler);
    cell.set(Some(name.clone()));
    TxError::Ended(name)
}

/// A handler's name for an error line: its group and message type.
pub(super) fn handler_name<C: 'static>(handler: &dyn DynHandler<C>) -> String {
    format!("{}/{}", handler.group(), handler.message_type())
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Optimistic,
    /// A savepoint per message; with `count_contention`, contention raised inside a
    /// handler is recorded as its failure instead of rerunning the batch.
    Isolated {
        count_contention: bool,
    },
}

thread_local! {
    /// Whether a handler call on this thread outlived the batch deadline since the
    /// flag was last taken (a hang, which the server ended: counted like a crash).
    pub(super) static HUNG: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(super) fn depth<C: StoreConnection>(conn: &mut C) -> std::result::Result<u32, TxError> {
    let status = AnsiTransactionManager::transaction_manager_status_mut(conn);
    Ok(status
        .transaction_depth()
        .map_err(TxError::from)?
        .map_or(0, NonZeroU32::get))
}

/// Puts the connection back at `target` depth: a handler that panicked inside its own
/// nested transaction leaves diesel's manager one level deeper, and diesel does not
/// unwind that for us.
pub(super) fn restore_depth<C: StoreConnection>(
    conn: &mut C,
    target: u32,
) -> std::result::Result<(), TxError> {
    loop {
        let found = depth(conn)?;
        if found <= target {
            return Ok(());
        }
        AnsiTransactionManager::rollback_transaction(conn)?;
    }
}

pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Whether a handler's failure is the database asking for the transaction again (a
/// deadlock inside the handler retries the batch; it is not the message's fault).
pub(super) fn failure_is_retryable(failure: &HandlerFailure) -> bool {
    match failure {
        HandlerFailure::Handler(err) => err
            .downcast_ref::<diesel::result::Error>()
            .is_some_and(is_retryable),
        _ => false,
    }
}

pub(super) fn attempt_number(attempts_before: i32) -> u32 {
    attempts_before.unsigned_abs().saturating_add(1)
}

pub(super) fn retryable_cause(failure: HandlerFailure) -> diesel::result::Error {
    match failure {
        HandlerFailure::Handler(err) => match err.downcast_ref::<diesel::result::Error>() {
            Some(diesel::result::Error::DatabaseError(kind, info)) => {
                diesel::result::Error::DatabaseError(*kind, Box::new(info.message().to_owned()))
            }
            _ => diesel::result::Error::RollbackTransaction,
        },
        _ => diesel::result::Error::RollbackTransaction,
    }
}

impl<C: StoreConnection> Inner<C> {
    /// Notes a handler call that outlived the batch deadline (see [`HUNG`]).
    pub(super) fn note_if_hung(&self, called: Instant) {
        if called.elapsed() >= self.settings().batch_deadline {
            HUNG.with(|h| h.set(true));
        }
    }
}
