use std::fmt;
use std::time::Duration;

use crate::{ConsumerGroup, MessageKey};

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
    /// Whether the delivery is acknowledged right after the commit.
    ///
    /// A retry is acknowledged only after its copy is scheduled, and a stop never.
    pub fn acks_after_commit(&self) -> bool {
        matches!(
            self,
            Self::Processed | Self::Duplicate | Self::AlreadyDeadLettered | Self::DeadLettered(_)
        )
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

/// The claim table rejected or lost a claim that its own lookup cannot explain.
///
/// Raised when an insert conflicted but no row exists under the same claim key, or a
/// failure update by the claim key touched no row. Acking such a delivery as a
/// duplicate would silently drop its effect, so the consumer group stops instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("claim invariant violated for ({group}, {key}): {detail}")]
pub struct ClaimInvariantViolated {
    /// The consumer group.
    pub group: ConsumerGroup,
    /// The message key.
    pub key: MessageKey,
    /// What was expected and what was found.
    pub detail: String,
}
