//! Failures: what a handler's failure means under its retry policy, recorded by
//! the same claim key the claim used, with its retry or its dead letter.

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::display::Escaped;
use inbox_core::{
    later_by, ClaimKey, ConsumerGroup, DeadLetterReason, Decision, HandlerError, HandlerErrorKind,
    HandlerFailure, RetryPolicy, MAX_RETRY_DELAY,
};

use super::claim::phantom;
use super::dead_letter::{dead_letter_row, truncate};
use super::delivery::Delivery;
use super::tx::TxError;
use crate::backend::{classify, ErrorClass, StoreConnection};
use crate::rows::FailureUpdate;
use crate::store::Inner;
use crate::ClaimStatus;

/// Whether a handler's failure is a data error the database raised (SQLSTATE classes
/// 22 and 23): permanent.
fn failure_is_data_error(err: &HandlerError) -> bool {
    err.downcast_ref::<diesel::result::Error>()
        .is_some_and(|db| matches!(classify(db), ErrorClass::Data | ErrorClass::Integrity))
}

/// What a failure means (a retry after a delay, or a dead letter and why) and the
/// error to record; `None` means no handler takes the message type.
fn verdict<C>(
    group: &ConsumerGroup,
    d: &Delivery<'_, C>,
    policy: &RetryPolicy,
    attempts: i32,
    failure: Option<&HandlerFailure>,
) -> (std::result::Result<Duration, DeadLetterReason>, String) {
    let exhausted = policy.is_exhausted(u32::try_from(attempts).unwrap_or(u32::MAX));
    match failure {
        None => (
            Err(DeadLetterReason::NoHandler),
            format!(
                "no handler in group {group} takes message type {:?}",
                d.env.message_type
            ),
        ),
        Some(f @ HandlerFailure::Decode(_)) => (Err(DeadLetterReason::DecodeError), f.to_string()),
        Some(f @ HandlerFailure::Handler(e)) => {
            let outcome = match e.kind() {
                HandlerErrorKind::Permanent => Err(DeadLetterReason::Permanent),
                // A data error of the database (class 22 or 23) does not heal by
                // retrying: dead-letter at once instead of climbing the ladder.
                _ if failure_is_data_error(e) => Err(DeadLetterReason::Permanent),
                _ if exhausted => Err(DeadLetterReason::MaxAttempts),
                HandlerErrorKind::RetryAfter(delay) => Ok(delay),
                _ => Ok(policy.delay_after(attempts.unsigned_abs())),
            };
            (outcome, f.to_string())
        }
        Some(f) => (
            if exhausted {
                Err(DeadLetterReason::MaxAttempts)
            } else {
                Ok(policy.delay_after(attempts.unsigned_abs()))
            },
            f.to_string(),
        ),
    }
}

impl<C: StoreConnection> Inner<C> {
    /// Records a failure by the same claim key the claim used; `None` means no
    /// handler takes the message type.
    pub(super) fn fail(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
        attempts_before: i32,
        failure: Option<HandlerFailure>,
        now: DateTime<Utc>,
    ) -> std::result::Result<Decision, TxError> {
        let policy = d
            .handler
            .map_or_else(RetryPolicy::default, |h| h.retry_policy());
        let attempts = attempts_before.saturating_add(1);
        let (outcome, last_error) = verdict(group, d, &policy, attempts, failure.as_ref());
        let last_error = truncate(last_error);
        // Record the delay the transport will really wait: its tier, not the policy's.
        let outcome = outcome.map(|delay| match &self.settings().ladder {
            Some(ladder) => ladder.tier_for(delay),
            None => delay.min(MAX_RETRY_DELAY),
        });
        let update = FailureUpdate {
            status: if outcome.is_ok() {
                ClaimStatus::Failed
            } else {
                ClaimStatus::Dead
            },
            // Within the years the stores hold, whatever the clock says.
            next_attempt_at: outcome.as_ref().ok().map(|delay| later_by(now, *delay)),
            last_error: &last_error,
            // Kept only while a retry is pending, so the message can be redriven.
            payload: outcome.is_ok().then_some(d.env.payload.as_slice()),
            now,
        };
        let key = ClaimKey::new(group.clone(), d.env.message_key.clone());
        // By the same claim key the claim used: exactly one row, or the claim vanished.
        let touched = C::record_failure(conn, &key, &update, true)?;
        if touched != [attempts] {
            return Ok(phantom(
                group,
                &d.env.message_key,
                &format!(
                    "the failure update by claim key returned attempts {touched:?}, expected [{attempts}]"
                ),
            ));
        }
        tracing::warn!(group = %group, key = %Escaped(d.env.message_key.as_str()), attempts, error = %Escaped(&last_error), "handler failed");
        match outcome {
            Ok(delay) => Ok(Decision::RetryAfter(delay)),
            Err(reason) => {
                C::insert_dead_letter(
                    conn,
                    &dead_letter_row(group, d.env, attempts, reason, &last_error, now),
                )?;
                tracing::error!(group = %group, key = %Escaped(d.env.message_key.as_str()), %reason, "message dead-lettered");
                Ok(Decision::DeadLettered(reason))
            }
        }
    }
}
