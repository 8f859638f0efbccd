//! The optimistic run: every owned message's handler at once, no savepoints; any
//! failure asks for the isolated run.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use inbox_core::{Decision, DynHandler, MessageContext};

use super::ownership::{check_transaction, ownership_after_failure, Ownership, TxCheck};
use super::run::{
    attempt_number, depth, failure_is_retryable, restore_depth, retryable_cause, HandlerRun, Run,
};
use super::tx::TxError;
use crate::backend::StoreConnection;
use crate::store::Inner;

impl<C: StoreConnection> Inner<C> {
    /// Every owned message at once, no savepoints; any failure asks for isolation.
    /// Returns the last handler when its call is still to be checked: the commit
    /// checks it in the same round trip.
    ///
    /// The handlers' savepoint was set when the transaction began (only the store's
    /// own transaction has it): after a failure that left the transaction aborted,
    /// rolling back to it tells a swallowed error (ours again, usable) from a handler
    /// that ended or restarted the transaction.
    pub(super) fn run_optimistic(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<Option<Arc<dyn DynHandler<C>>>, TxError> {
        let per_handler = self.per_handler(conn, run, decisions)?;
        let calls = per_handler.len();
        for (call, (handler, entries)) in per_handler.into_iter().enumerate() {
            let ctxs: Vec<MessageContext<'_>> = entries.iter().map(|(_, c)| *c).collect();
            let before = depth(conn)?;
            let called = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| handler.handle_all(conn, &ctxs)));
            self.note_if_hung(called);
            let (failure, at) = match outcome {
                // The last call's check is the commit's.
                Ok(Ok(())) if call + 1 == calls && run.token.is_some() => {
                    decisions.extend(entries.iter().map(|(idx, _)| (*idx, Decision::Processed)));
                    return Ok(Some(Arc::clone(handler)));
                }
                Ok(Ok(())) => match check_transaction(conn, run.token)? {
                    TxCheck::Ours => {
                        decisions
                            .extend(entries.iter().map(|(idx, _)| (*idx, Decision::Processed)));
                        continue;
                    }
                    TxCheck::Replaced => return Err(run.ended_by(&**handler)),
                    // A call swallowed an error; which one shows in isolation.
                    TxCheck::Aborted(_) => (None, None),
                },
                Ok(Err((at, failure))) => (Some(failure), at),
                Err(_) => (None, None),
            };
            if let Err(err) = restore_depth(conn, before) {
                return Err(match check_transaction(conn, run.token) {
                    Ok(TxCheck::Ours) => err,
                    Ok(_) => run.ended_by(&**handler),
                    // The connection itself is gone (the server ended a hung session).
                    Err(lost) => lost,
                });
            }
            // The failing call is to blame only if the transaction was still usable:
            // once an earlier call swallowed an error (PostgreSQL aborted the
            // transaction), the next call's first statement fails for it.
            let usable = match ownership_after_failure(conn, run.token)? {
                Ownership::Usable => true,
                Ownership::WasAborted => false,
                Ownership::Replaced => return Err(run.ended_by(&**handler)),
            };
            if let Some(failure) = failure {
                if failure_is_retryable(&failure) {
                    return Err(TxError::Retryable(retryable_cause(failure)));
                }
                let known = at
                    .filter(|_| usable)
                    .and_then(|i| entries.get(i))
                    .map(|(idx, _)| (*idx, failure));
                return Err(TxError::Isolate(known));
            }
            return Err(TxError::Isolate(None));
        }
        Ok(None)
    }

    /// The owned messages grouped by handler, each with its context; a message no
    /// handler takes fails at once.
    fn per_handler<'a>(
        &self,
        conn: &mut C,
        run: &Run<'a, '_, 'a, C>,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<Vec<HandlerRun<'a, 'a, C>>, TxError> {
        let (group, now) = (run.group, run.now);
        let mut per_handler: Vec<HandlerRun<'_, '_, C>> = Vec::new();
        for (d, attempts) in run.mine {
            let attempt = attempt_number(*attempts);
            d.span.record("attempt", attempt);
            let Some(handler) = d.handler else {
                decisions.push((d.idx, self.fail(conn, group, d, *attempts, None, now)?));
                continue;
            };
            let ctx = MessageContext::new(d.env, group, attempt, now).with_span(&d.span);
            match per_handler
                .iter_mut()
                .find(|(h, _)| Arc::ptr_eq(h, handler))
            {
                Some((_, ctxs)) => ctxs.push((d.idx, ctx)),
                None => per_handler.push((handler, vec![(d.idx, ctx)])),
            }
        }
        Ok(per_handler)
    }
}
