//! The isolated run: one savepoint per owned message; a failure rolls back to it and
//! is recorded by the same claim key.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use inbox_core::{Decision, DynHandler, HandlerError, HandlerFailure, MessageContext};

use super::delivery::Delivery;
use super::ownership::{check_transaction, SwallowedDatabaseError, TxCheck};
use super::run::{
    attempt_number, depth, failure_is_retryable, panic_message, restore_depth, retryable_cause, Run,
};
use super::tx::TxError;
use crate::backend::{classify, ErrorClass, StoreConnection};
use crate::store::Inner;

/// The outcome of one handler call inside its savepoint.
enum SavepointError {
    Failed(HandlerFailure),
    Db(diesel::result::Error),
}

impl From<diesel::result::Error> for SavepointError {
    fn from(err: diesel::result::Error) -> Self {
        Self::Db(err)
    }
}

/// One handler call in its savepoint, and what the store saw of it.
struct Called {
    outcome: std::result::Result<(), SavepointError>,
    /// The handler ended or restarted the transaction.
    replaced: bool,
    /// The handler itself failed (not the savepoint around it).
    failed_in_handler: bool,
}

impl<C: StoreConnection> Inner<C> {
    /// One savepoint per owned message; a failure rolls back to it and is recorded.
    pub(super) fn run_isolated(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        mut known: Option<(usize, HandlerFailure)>,
        count_contention: bool,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<(), TxError> {
        let (group, now) = (run.group, run.now);
        for (d, attempts) in run.mine {
            let Some(handler) = d.handler else {
                decisions.push((d.idx, self.fail(conn, group, d, *attempts, None, now)?));
                continue;
            };
            // The optimistic run already saw this message fail: one attempt, one call.
            if known.as_ref().is_some_and(|(idx, _)| *idx == d.idx) {
                if let Some((_, failure)) = known.take() {
                    let decision = self.fail(conn, group, d, *attempts, Some(failure), now)?;
                    decisions.push((d.idx, decision));
                    continue;
                }
            }
            let attempt = attempt_number(*attempts);
            d.span.record("attempt", attempt);
            let ctx = MessageContext::new(d.env, group, attempt, now).with_span(&d.span);
            let _entered = d.span.enter();
            let called = self.call_in_savepoint(conn, run, &**handler, &ctx);
            let decision = self.isolated_decision(
                conn,
                run,
                (d, *attempts),
                &**handler,
                called,
                count_contention,
            )?;
            decisions.push((d.idx, decision));
        }
        Ok(())
    }

    /// Calls the handler inside a savepoint of its own.
    fn call_in_savepoint(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        handler: &dyn DynHandler<C>,
        ctx: &MessageContext<'_>,
    ) -> Called {
        let mut replaced = false;
        let mut failed_in_handler = false;
        let outcome = conn.transaction::<_, SavepointError, _>(|conn| {
            let before = depth(conn).map_err(|e| match e {
                TxError::Retryable(db) => SavepointError::Db(db),
                _ => {
                    SavepointError::Failed(HandlerFailure::Panic("broken transaction state".into()))
                }
            })?;
            let called = Instant::now();
            let result = catch_unwind(AssertUnwindSafe(|| handler.handle_payload(conn, ctx)));
            self.note_if_hung(called);
            let failure = match result {
                Ok(Ok(())) => match check_transaction(conn, run.token) {
                    Ok(TxCheck::Ours) => return Ok(()),
                    // Rolling back to the savepoint makes the transaction usable.
                    Ok(TxCheck::Aborted(err)) => HandlerFailure::Handler(HandlerError::transient(
                        SwallowedDatabaseError(err),
                    )),
                    Ok(TxCheck::Replaced) => {
                        replaced = true;
                        return Err(SavepointError::Db(
                            diesel::result::Error::RollbackTransaction,
                        ));
                    }
                    Err(_) => {
                        return Err(SavepointError::Db(
                            diesel::result::Error::BrokenTransactionManager,
                        ))
                    }
                },
                Ok(Err(failure)) => failure,
                Err(payload) => HandlerFailure::Panic(panic_message(&*payload)),
            };
            if restore_depth(conn, before).is_err() {
                return Err(SavepointError::Db(
                    diesel::result::Error::BrokenTransactionManager,
                ));
            }
            failed_in_handler = true;
            Err(SavepointError::Failed(failure))
        });
        Called {
            outcome,
            replaced,
            failed_in_handler,
        }
    }

    /// What one isolated call decides for its delivery (with its attempts before).
    fn isolated_decision(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        (d, attempts): (&Delivery<'_, C>, i32),
        handler: &dyn DynHandler<C>,
        called: Called,
        count_contention: bool,
    ) -> std::result::Result<Decision, TxError> {
        // Before anything else: the savepoint's own rollback may have failed too,
        // once the handler ended the transaction it lived in.
        if called.replaced {
            return Err(run.ended_by(handler));
        }
        match called.outcome {
            Ok(()) => Ok(Decision::Processed),
            // The savepoint exists in the store's own transaction only: its
            // rollback failing after a handler's failure means the handler ended
            // or restarted the transaction.
            Err(SavepointError::Db(err))
                if called.failed_in_handler && classify(&err) != ErrorClass::Infrastructure =>
            {
                Err(run.ended_by(handler))
            }
            Err(SavepointError::Db(err)) => Err(err.into()),
            Err(SavepointError::Failed(failure)) => {
                // Rolled back to the message's savepoint, the store's own
                // transaction is usable again. diesel does not report a savepoint
                // rollback that failed on an aborted transaction, so look: still
                // aborted, or another id, means the savepoint was not the store's.
                if !matches!(check_transaction(conn, run.token)?, TxCheck::Ours) {
                    return Err(run.ended_by(handler));
                }
                if failure_is_retryable(&failure) && !count_contention {
                    return Err(TxError::Retryable(retryable_cause(failure)));
                }
                // The savepoint is rolled back; the claim row is still ours.
                self.fail(conn, run.group, d, attempts, Some(failure), run.now)
            }
        }
    }
}
