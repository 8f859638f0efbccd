//! Types, traits and rules of a transactional inbox: process each broker message's
//! effect exactly once per consumer group, although delivery is at-least-once.
//!
//! This crate has no database and no network code. It defines the vocabulary
//! ([`Envelope`], [`MessageKey`], [`ConsumerGroup`], [`ClaimKey`]), the [`Handler`]
//! trait users implement, the [`RetryPolicy`], the per-delivery [`Decision`] a store
//! returns, the injectable [`Clock`], the [`InboxStore`] trait transports are generic
//! over, and an [`InProcessTransport`]. `inbox-diesel` provides the store. The rules
//! every transport follows live here once: what a decision means for an ack
//! ([`Decision::action`]), the decision count ([`check_decision_count`]), the relay
//! round ([`RelayRound`]) and the backoff ([`exponential_backoff`]).
//!
//! With the `derive` feature, `#[derive(Handler)]` (from `inbox-macros`) writes the
//! `Handler` impl of a handler struct from an `#[inbox(...)]` attribute, checked at
//! compile time; `use inbox_core::Handler;` brings the trait and the derive.
//!
//! ```
//! use inbox_core::{ConsumerGroup, MessageKey, RetryPolicy};
//! use std::time::Duration;
//!
//! let group = ConsumerGroup::new("billing.daily-usage")?;
//! let key = MessageKey::derive("billing", "usage-event-17", "usage.recorded");
//! let policy = RetryPolicy::new(4, Duration::from_secs(1), Duration::from_secs(60))?;
//! # let _ = (group, key, policy);
//! # Ok::<(), inbox_core::Error>(())
//! ```
#![forbid(unsafe_code)]

mod clock;
mod decision;
mod duration;
mod envelope;
mod error;
mod handler;
mod key;
#[doc(hidden)]
pub mod names;
mod outbox;
mod relay;
mod replay;
mod retry;
mod store;
mod trace;
mod transport;
mod url;

pub use clock::{delta, Clock, ManualClock, SystemClock};
pub use decision::{
    check_decision_count, ClaimInvariantViolated, DeadLetterReason, Decision, Tally,
    TransportAction,
};
pub use duration::{parse_duration, parse_ladder};
pub use envelope::{payload_digest, Envelope};
pub use error::{Error, Result};
pub use handler::{
    DecodeError, DynHandler, Handler, HandlerError, HandlerErrorKind, HandlerFailure,
    MessageContext, ProjectionLock,
};
/// `#[derive(Handler)]`: implements the [`Handler`](trait@Handler) trait for a
/// handler struct from its `#[inbox(...)]` attribute.
#[cfg(feature = "derive")]
pub use inbox_macros::Handler;
pub use key::{ClaimKey, ConsumerGroup, MessageKey};
pub use outbox::{
    EnqueueOutcome, Lease, OutboxFailure, OutboxFate, OutboxMessage, OutboxRow, OutboxStore,
    UnreadableRow, DEFAULT_OUTBOX_MAX_ATTEMPTS, MAX_OUTBOX_RETRY_DELAY,
};
pub use relay::{relay_in_process, OutboxPublisher, Publication, RelayRound, RoundReport};
pub use replay::{replay_target, REPLAY_GROUP_HEADER, REPLAY_SEQUENCE_HEADER};
pub use retry::{exponential_backoff, RetryLadder, RetryPolicy, MAX_RETRY_DELAY};
pub use store::{DeadLetterOutcome, InboxStore};
pub use trace::{adopt_trace_parent, Traceparent, TRACEPARENT_HEADER};
pub use transport::{InProcessTransport, TransportStats};
pub use url::{redact_message, redact_url, RedactedError};
