//! Crash loops: a redelivered message runs one at a time per group in this process,
//! after a committed start mark; too many unfinished starts dead-letter it as
//! `crash_loop` without running it.

use chrono::{DateTime, Utc};
use inbox_core::display::Escaped;
use inbox_core::{ClaimKey, ConsumerGroup, DeadLetterReason, Decision};

use super::claim::phantom;
use super::dead_letter::dead_letter_row;
use super::delivery::Delivery;
use super::metrics::record_metrics;
use super::retry::CONTENDED_RETRY;
use super::run::HUNG;
use super::tx::TxError;
use crate::backend::StoreConnection;
use crate::rows::FailureUpdate;
use crate::store::Inner;
use crate::{ClaimStatus, Error, Result};

impl<C: StoreConnection> Inner<C> {
    /// A redelivered message: one at a time per group in this process, first a
    /// committed start mark (under the claim's own conflict condition), then the
    /// normal path. Too many unfinished starts dead-letter it as a crash loop.
    pub(super) fn run_redelivered(
        &self,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
    ) -> Result<Decision> {
        let slot = self.slot(group);
        let _one_at_a_time = slot.acquire(self.settings().batch_deadline);
        let claim_key = ClaimKey::new(group.clone(), d.env.message_key.clone());
        // This process's last start of the message ended in a store error, not a
        // crash: its mark stays, and this start adds none (only a death counts).
        let errored = self.errored_starts().contains(&claim_key);
        let increment = if errored { 0 } else { 1 };
        let mut tries = 0;
        let crashed = loop {
            let now = self.now();
            let mut conn = self.connection()?;
            let marked = C::write_transaction(&mut conn, |conn| {
                self.mark_start(conn, group, d, increment, now)
            });
            match marked {
                Ok(decision) => break decision,
                Err(TxError::Retryable(err)) if tries < self.settings().transaction_retries => {
                    tries += 1;
                    tracing::warn!(group = %group, error = %err, "start mark conflicted");
                }
                Err(TxError::Retryable(_)) => {
                    let decision = Decision::RetryAfter(CONTENDED_RETRY);
                    record_metrics(group, [&decision]);
                    return Ok(decision);
                }
                Err(TxError::Fatal(err)) => return Err(err),
                Err(TxError::Data(err)) => {
                    let why = format!("the store could not write the delivery: {err}");
                    return self.dead_letter_malformed(group, d.env, &why);
                }
                Err(TxError::Isolate(_) | TxError::Ended(_)) => {
                    return Err(Error::Internal("a start mark ran no handler"))
                }
            }
        };
        let decision = match crashed {
            Some(decision) => {
                record_metrics(group, [&decision]);
                decision
            }
            None => self.run_started(group, d, &claim_key)?,
        };
        if errored {
            self.errored_starts().remove(&claim_key);
        }
        Ok(decision)
    }

    /// Commits-to-be the start mark; past the crash limit, marks the claim dead and
    /// writes its dead letter instead (the decision), in the same transaction.
    fn mark_start(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
        increment: i32,
        now: DateTime<Utc>,
    ) -> std::result::Result<Option<Decision>, TxError> {
        let Some(starts) = C::mark_start(conn, group, &d.row(), increment, now)? else {
            return Ok(None);
        };
        let limit = i32::try_from(self.settings().crash_limit).unwrap_or(i32::MAX);
        if starts <= limit {
            return Ok(None);
        }
        let unfinished = starts - 1;
        let last_error =
            format!("crash loop: {unfinished} starts without an outcome (limit {limit})");
        let update = FailureUpdate {
            status: ClaimStatus::Dead,
            next_attempt_at: None,
            last_error: &last_error,
            payload: None,
            now,
        };
        let key = ClaimKey::new(group.clone(), d.env.message_key.clone());
        let touched = C::record_failure(conn, &key, &update, false)?;
        let [attempts] = touched[..] else {
            return Ok(Some(phantom(
                group,
                &d.env.message_key,
                &format!(
                    "the crash-loop update by claim key touched {} rows",
                    touched.len()
                ),
            )));
        };
        C::insert_dead_letter(
            conn,
            &dead_letter_row(
                group,
                d.env,
                attempts,
                DeadLetterReason::CrashLoop,
                &last_error,
                now,
            ),
        )?;
        tracing::error!(group = %group, key = %Escaped(d.env.message_key.as_str()), unfinished, "crash loop: dead-lettered");
        Ok(Some(Decision::DeadLettered(DeadLetterReason::CrashLoop)))
    }

    /// The normal path of a marked redelivery; a store error that was not a hang
    /// leaves the mark counted once.
    fn run_started(
        &self,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
        claim_key: &ClaimKey,
    ) -> Result<Decision> {
        HUNG.with(|h| h.set(false));
        match self.run_with_retries(group, std::slice::from_ref(&d)) {
            Ok(mut decisions) => decisions
                .pop()
                .map(|(_, decision)| decision)
                .ok_or(Error::Internal("a delivery was left without a decision")),
            // A store error is not a crash, unless the handler's call
            // outlived the deadline: then it hung (the server ended the
            // session under it), and the start counts like a crash. A wait
            // for a lock (a rebuild's) is not the handler's.
            Err(err) => {
                if !HUNG.with(std::cell::Cell::take) {
                    self.errored_starts().insert(claim_key.clone());
                }
                Err(err)
            }
        }
    }
}
