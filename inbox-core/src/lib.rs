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
//! round ([`RelayRound`]) and the backoff ([`exponential_backoff`]). Every metric the
//! crates record through the `metrics` facade is named, typed and described once in
//! [`metrics`] ([`metrics::describe`] gives them their units and help).
//!
//! The crates share two conventions. Errors: each crate's `Error` is
//! `#[non_exhaustive]` and matched by variant (a rejected setting is
//! `InvalidSetting { setting, expected, found }`, a broken invariant its own variant);
//! a message says its own level only and keeps its cause as its `source`, which
//! [`ErrorChain`] prints. Builders: a setter on a builder or settings value takes
//! `self`, returns `Self` and is named after its setting (`pool_size`, `workers`), and
//! the checks run once, at `build()` or `checked()`; `with_*` sets or adds a part of
//! an already-constructed value that is not one of its settings
//! ([`Envelope::with_tenant`], [`InProcessTransport::with_clock`]); a getter is the
//! bare noun, and a read that could be taken for an action says what it reads.
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
#![cfg_attr(docsrs, feature(doc_cfg))]

mod clock;
mod decision;
pub mod display;
mod duration;
mod envelope;
mod error;
mod handler;
#[cfg(feature = "idempotency")]
#[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
pub mod idempotency;
mod key;
pub mod metrics;
mod outbox;
#[cfg(feature = "rebuild")]
#[cfg_attr(docsrs, doc(cfg(feature = "rebuild")))]
pub mod rebuild;
mod relay;
mod replay;
mod retry;
mod store;
pub mod trace;
mod transport;
mod url;

pub use clock::{
    delta, earlier_by, later_by, stored_time, Clock, ManualClock, SystemClock,
    EARLIEST_STORED_TIME, LATEST_STORED_TIME,
};
pub use decision::{check_decision_count, DeadLetterReason, Decision, Tally, TransportAction};
pub use duration::{database_timeout, parse_duration, parse_ladder, MAX_DATABASE_TIMEOUT};
pub use envelope::{payload_digest, Envelope, PayloadCut, CUT_PAYLOAD_PREFIX};
pub use error::{ClaimInvariantViolated, Error, ErrorChain, Result};
pub use handler::{
    DecodeError, DynHandler, Handler, HandlerError, HandlerErrorKind, HandlerFailure,
    MessageContext, ProjectionLock,
};
/// `#[derive(Handler)]`: implements the [`Handler`](trait@Handler) trait for a
/// handler struct from its `#[inbox(...)]` attribute.
#[cfg(feature = "derive")]
pub use inbox_macros::Handler;
/// The [`Handler`](trait@Handler) trait alone, without the derive: for the facade crate,
/// which re-exports its own derive under the same name.
#[doc(hidden)]
pub mod handler_trait {
    pub use crate::handler::Handler;
}
/// The name rules, shared with the derive (the `inbox-names` crate).
#[doc(hidden)]
pub use inbox_names as names;
pub use key::{ClaimKey, ConsumerGroup, InvalidName, MessageKey};
pub use outbox::{
    EnqueueOutcome, Lease, OutboxFailure, OutboxFate, OutboxMessage, OutboxRow, OutboxStore,
    UnreadableRow, DEFAULT_OUTBOX_MAX_ATTEMPTS, MAX_OUTBOX_RETRY_DELAY,
};
pub use relay::{relay_in_process, OutboxPublisher, Publication, RelayRound, RoundReport};
pub use replay::{replay_target, REPLAY_GROUP_HEADER, REPLAY_SEQUENCE_HEADER};
pub use retry::{exponential_backoff, RetryLadder, RetryPolicy, MAX_RETRY_DELAY};
pub use store::{DeadLetterOutcome, GroupHalts, InboxStore};
pub use trace::{adopt_trace_parent, Traceparent, TRACEPARENT_HEADER, TRACESTATE_HEADER};
pub use transport::{InProcessTransport, TransportStats};
pub use url::{redact_message, redact_url, RedactedError};
