use crate::ClaimInvariantViolated;

/// Everything that can go wrong in `inbox-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A message key is empty or longer than 255 bytes.
    #[error("invalid message key: {0}")]
    InvalidMessageKey(String),
    /// A consumer group name breaks the name rules.
    #[error("invalid consumer group: {0}")]
    InvalidConsumerGroup(String),
    /// A retry policy's settings make no sense.
    #[error("invalid retry policy: {0}")]
    InvalidRetryPolicy(String),
    /// Two handlers were registered for the same group and message type.
    #[error("a handler for message type {message_type:?} in group {group} is already registered")]
    DuplicateHandler {
        /// The group.
        group: String,
        /// The message type.
        message_type: String,
    },
    /// A message was published that no registered handler takes.
    #[error("no consumer group takes message type {message_type:?}")]
    Unroutable {
        /// The message type.
        message_type: String,
    },
    /// A message was addressed to one consumer group (a replay) that this transport
    /// does not consume.
    #[error("no consumer group {group:?} here to deliver a replay to")]
    UnknownGroup {
        /// The consumer group.
        group: String,
    },
    /// The claim table broke its own invariant; the consumer group must stop.
    #[error(transparent)]
    ClaimInvariantViolated(#[from] ClaimInvariantViolated),
    /// The store failed; nothing of the batch was acknowledged.
    #[error("store error: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
