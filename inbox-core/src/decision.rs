use std::fmt;
use std::time::Duration;

use crate::{ClaimInvariantViolated, Error, Result};

/// What a transport must do with one delivery, as decided by the store.
///
/// The store decides inside its transaction; the transport only carries the decision
/// out after the commit.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// The handler ran and its effect committed with the claim: ack.
    Processed,
    /// The message's effect already happened (or a copy in the same batch was
    /// processed): ack without running the handler.
    Duplicate,
    /// The message was dead-lettered earlier: ack without running the handler.
    AlreadyDeadLettered,
    /// Try again after the delay; ack once the retry copy is safely scheduled.
    RetryAfter(Duration),
    /// The message was dead-lettered in this transaction: ack.
    DeadLettered(DeadLetterReason),
    /// The claim table broke an invariant: do not ack, halt the consumer group.
    Stop(ClaimInvariantViolated),
}

impl Decision {
    /// What a transport does with the delivery once the store's transaction
    /// committed. The one exhaustive match over `Decision`: transports in other
    /// crates call this instead of matching the `#[non_exhaustive]` enum themselves.
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_core::{Decision, Tally, TransportAction};
    /// assert_eq!(Decision::Processed.action(), TransportAction::Ack(Tally::Processed));
    /// let retry = Decision::RetryAfter(Duration::from_secs(5)).action();
    /// assert_eq!(retry, TransportAction::RetryThenAck(Duration::from_secs(5)));
    /// ```
    pub fn action(self) -> TransportAction {
        match self {
            Self::Processed => TransportAction::Ack(Tally::Processed),
            Self::Duplicate | Self::AlreadyDeadLettered => TransportAction::Ack(Tally::Duplicate),
            Self::DeadLettered(_) => TransportAction::Ack(Tally::DeadLettered),
            Self::RetryAfter(delay) => TransportAction::RetryThenAck(delay),
            Self::Stop(violation) => TransportAction::HoldAndStop(violation),
        }
    }

    /// Whether the delivery is acknowledged right after the commit (the
    /// [`action`](Self::action) is an [`Ack`](TransportAction::Ack)).
    ///
    /// A retry is acknowledged only after its copy is scheduled, and a stop never.
    pub fn acks_after_commit(&self) -> bool {
        matches!(self.clone().action(), TransportAction::Ack(_))
    }
}

/// What a transport does with one delivery after the store's commit, as
/// [`Decision::action`] says.
///
/// Deliberately not `#[non_exhaustive]`: a transport matches it without a wildcard
/// arm, so a new kind of action is a compile error in every transport rather than a
/// guess at run time. New decisions map onto these actions in [`Decision::action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportAction {
    /// Acknowledge now, counted under this tally.
    Ack(Tally),
    /// Schedule a retry copy after this delay; acknowledge the original only once
    /// the copy is safely scheduled (counted as [`Tally::Retried`] then).
    RetryThenAck(Duration),
    /// Leave the delivery unacknowledged and halt its consumer group.
    HoldAndStop(ClaimInvariantViolated),
}

/// Under which counter a transport counts a delivery it settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tally {
    /// The handler ran and committed.
    Processed,
    /// Acked without running the handler (a duplicate, or dead-lettered before).
    Duplicate,
    /// Dead-lettered in this transaction.
    DeadLettered,
    /// A retry copy was scheduled.
    Retried,
}

/// Checks that the store returned one decision per delivery handed to it; a store
/// that did not broke its contract, and the transport treats the batch as failed
/// (nothing acked, everything comes back).
///
/// ```
/// use inbox_core::{check_decision_count, Decision};
/// assert!(check_decision_count(vec![Decision::Processed], 1).is_ok());
/// assert!(check_decision_count(vec![Decision::Processed], 2).is_err());
/// ```
pub fn check_decision_count(decisions: Vec<Decision>, deliveries: usize) -> Result<Vec<Decision>> {
    if decisions.len() == deliveries {
        Ok(decisions)
    } else {
        Err(Error::DecisionCount {
            expected: deliveries,
            found: decisions.len(),
        })
    }
}

/// Why a message was dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The handler failed `max_attempts` times.
    MaxAttempts,
    /// The handler returned a permanent error.
    Permanent,
    /// The payload did not decode into the handler's message type.
    DecodeError,
    /// The same key arrived with another payload than the claimed one.
    KeyCollision,
    /// The message's processing started too often without an outcome.
    CrashLoop,
    /// The broker's delivery limit was reached.
    DeliveryLimit,
    /// No handler of the group takes the message type.
    NoHandler,
    /// The delivery could not be read as an envelope (no key, too large, ...).
    Malformed,
}

impl DeadLetterReason {
    /// Every reason.
    pub const ALL: [Self; 8] = [
        Self::MaxAttempts,
        Self::Permanent,
        Self::DecodeError,
        Self::KeyCollision,
        Self::CrashLoop,
        Self::DeliveryLimit,
        Self::NoHandler,
        Self::Malformed,
    ];

    /// The reason stored as `s` ([`as_str`](Self::as_str) read back), or `None` for
    /// a text no reason is stored as.
    ///
    /// ```
    /// use inbox_core::DeadLetterReason;
    /// assert_eq!(DeadLetterReason::parse("crash_loop"), Some(DeadLetterReason::CrashLoop));
    /// assert_eq!(DeadLetterReason::parse("Crash_Loop"), None);
    /// ```
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|reason| reason.as_str() == s)
    }

    /// Why a letter of this reason is never replayed as it is, and what an operator
    /// does instead; `None` when it may be. One exhaustive match: a new reason does
    /// not compile until it is decided here.
    ///
    /// Replayable (the claim is reset and the same message goes to its group again,
    /// once the cause is fixed): `max_attempts`, `permanent`, `crash_loop`,
    /// `delivery_limit`, and `no_handler` (once a handler of the group takes the type;
    /// replayed before that, it is dead-lettered again as `no_handler`). Never:
    /// `key_collision` (the letter's payload is another message than its key's claim;
    /// sent again it could only collide again, or take a claim that is not its own),
    /// `malformed` (no envelope, so no claim to reset), `decode_error` (the same bytes
    /// would fail the same way).
    ///
    /// ```
    /// use inbox_core::DeadLetterReason;
    /// assert_eq!(DeadLetterReason::NoHandler.replay_refusal(), None);
    /// assert!(DeadLetterReason::KeyCollision.replay_refusal().is_some());
    /// ```
    pub fn replay_refusal(self) -> Option<&'static str> {
        match self {
            Self::MaxAttempts
            | Self::Permanent
            | Self::CrashLoop
            | Self::DeliveryLimit
            | Self::NoHandler => None,
            Self::KeyCollision => Some(
                "a key_collision letter belongs to another payload than its key's claim: \
                 publish it under its own key, then discard the letter",
            ),
            Self::Malformed => Some(
                "a malformed delivery has no claim to reset: publish a corrected message, \
                 then discard the letter",
            ),
            Self::DecodeError => Some(
                "the payload does not decode and would fail the same way: publish a \
                 corrected message under a new key, then discard the letter",
            ),
        }
    }

    /// The reason as stored in the dead-letter table.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::MaxAttempts => "max_attempts",
            Self::Permanent => "permanent",
            Self::DecodeError => "decode_error",
            Self::KeyCollision => "key_collision",
            Self::CrashLoop => "crash_loop",
            Self::DeliveryLimit => "delivery_limit",
            Self::NoHandler => "no_handler",
            Self::Malformed => "malformed",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_classified_for_replay() {
        use DeadLetterReason as R;
        for (reason, replayable) in [
            (R::MaxAttempts, true),
            (R::Permanent, true),
            (R::CrashLoop, true),
            (R::DeliveryLimit, true),
            (R::NoHandler, true),
            (R::KeyCollision, false),
            (R::Malformed, false),
            (R::DecodeError, false),
        ] {
            assert_eq!(reason.replay_refusal().is_none(), replayable, "{reason}");
            assert_eq!(DeadLetterReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(DeadLetterReason::parse("something_new"), None);
    }
    use crate::{ConsumerGroup, MessageKey};

    fn violation() -> ClaimInvariantViolated {
        ClaimInvariantViolated {
            group: ConsumerGroup::new("a.b").unwrap(),
            key: MessageKey::new("k").unwrap(),
            detail: "phantom".to_owned(),
        }
    }

    #[test]
    fn every_decision_has_an_action_and_none_is_a_requeue() {
        let ms = Duration::from_millis;
        let cases = [
            (Decision::Processed, TransportAction::Ack(Tally::Processed)),
            (Decision::Duplicate, TransportAction::Ack(Tally::Duplicate)),
            (
                Decision::AlreadyDeadLettered,
                TransportAction::Ack(Tally::Duplicate),
            ),
            (
                Decision::DeadLettered(DeadLetterReason::Permanent),
                TransportAction::Ack(Tally::DeadLettered),
            ),
            (
                Decision::RetryAfter(ms(5)),
                TransportAction::RetryThenAck(ms(5)),
            ),
            (
                Decision::Stop(violation()),
                TransportAction::HoldAndStop(violation()),
            ),
        ];
        for (decision, action) in cases {
            let acks = matches!(action, TransportAction::Ack(_));
            assert_eq!(decision.acks_after_commit(), acks, "{decision:?}");
            assert_eq!(decision.action(), action);
        }
    }

    #[test]
    fn every_reason_reads_back_as_itself() {
        for reason in DeadLetterReason::ALL {
            assert_eq!(DeadLetterReason::parse(reason.as_str()), Some(reason));
            assert_eq!(reason.to_string(), reason.as_str());
        }
        assert_eq!(DeadLetterReason::parse(""), None);
        assert_eq!(DeadLetterReason::parse("max-attempts"), None);
    }

    #[test]
    fn a_store_must_return_one_decision_per_delivery() {
        let two = vec![Decision::Processed, Decision::Duplicate];
        assert_eq!(check_decision_count(two.clone(), 2).unwrap(), two);
        for deliveries in [0, 1, 3] {
            let err = check_decision_count(two.clone(), deliveries).unwrap_err();
            assert!(
                matches!(err, Error::DecisionCount { expected, found: 2 } if expected == deliveries),
                "{err:?}"
            );
            assert_eq!(
                err.to_string(),
                format!("the store returned 2 decisions for {deliveries} deliveries")
            );
        }
    }
}
