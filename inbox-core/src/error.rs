use crate::{ConsumerGroup, InvalidName, MessageKey};

/// Everything that can go wrong in `inbox-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A message key or a consumer group name breaks its rules.
    #[error(transparent)]
    InvalidName(#[from] InvalidName),
    /// An idempotency key is empty, longer than 255 bytes or not printable ASCII.
    #[error("invalid idempotency key: expected {expected}, found {found}")]
    InvalidIdempotencyKey {
        /// What a key must be.
        expected: &'static str,
        /// What was given (its length, or its first byte outside the range).
        found: String,
    },
    /// A lease token was not 32 hex digits.
    #[error("invalid lease token: expected {expected}, found {found}")]
    InvalidLeaseToken {
        /// What a token looks like.
        expected: &'static str,
        /// What was given.
        found: String,
    },
    /// A request's fingerprint fields were given wrongly (a name twice).
    #[error("invalid request fields: expected {expected}, found {found}")]
    InvalidRequestFields {
        /// What the fields must be.
        expected: &'static str,
        /// What was given.
        found: String,
    },
    /// A duration given as text (a setting, a command's argument) does not parse.
    #[error("invalid duration: expected {expected}, found {found:?}")]
    InvalidDuration {
        /// What a duration looks like.
        expected: &'static str,
        /// What was given.
        found: String,
    },
    /// A retry policy's or retry ladder's settings make no sense.
    #[error("invalid retry policy: {setting} must be {expected}, found {found}")]
    InvalidRetryPolicy {
        /// The setting: `max_attempts`, `initial`, `max` (a policy's), `tiers` (a
        /// ladder's).
        setting: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What was given.
        found: String,
    },
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
    /// The store returned another number of decisions than deliveries it was given:
    /// it broke its contract, and nothing of the batch was acknowledged.
    #[error("the store returned {found} decisions for {expected} deliveries")]
    DecisionCount {
        /// The deliveries handed to the store.
        expected: usize,
        /// The decisions it returned.
        found: usize,
    },
    /// The store failed; nothing of the batch was acknowledged.
    #[error("store error")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// An error and every cause below it on one line, outermost first, joined by `": "`.
///
/// The errors of these crates print their own message only and keep the cause as
/// their [`source`](std::error::Error::source), so a log line or a stored failure
/// text that should say why prints the whole chain through this:
///
/// ```
/// use inbox_core::{Error, ErrorChain};
///
/// let cause = std::io::Error::other("connection reset");
/// let err = Error::Store(Box::new(cause));
/// assert_eq!(err.to_string(), "store error");
/// assert_eq!(ErrorChain(&err).to_string(), "store error: connection reset");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'a));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut level = self.0.source();
        while let Some(cause) = level {
            write!(f, ": {cause}")?;
            level = cause.source();
        }
        Ok(())
    }
}

impl std::fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
