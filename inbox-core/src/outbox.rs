//! The producer half: messages written in the business transaction, published later
//! by a relay that leases rows, publishes them with confirms and marks them.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{exponential_backoff, Envelope, MessageKey, Result};

/// A message to publish, enqueued inside the caller's own transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The message's identity; enqueueing the same key twice is a no-op.
    pub message_key: MessageKey,
    /// The exchange to publish to.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The message type (AMQP `type`).
    pub message_type: String,
    /// The body.
    pub payload: Vec<u8>,
    /// Headers to publish.
    pub headers: BTreeMap<String, String>,
    /// The tenant, published as the `tenant` header.
    pub tenant: Option<String>,
    /// Rows with the same ordering key reach the broker in the order their
    /// transactions committed (inbox-diesel on PostgreSQL: an enqueue holds the
    /// key's ordering lock from its INSERT to the commit, so id order is commit
    /// order; SQLite has one writer).
    pub ordering_key: Option<String>,
    /// Not published before this time.
    pub not_before: Option<DateTime<Utc>>,
}

impl OutboxMessage {
    /// A message to `exchange` with routing key and type `message_type`.
    ///
    /// ```
    /// use inbox_core::{MessageKey, OutboxMessage};
    /// let key = MessageKey::derive("billing", "ledger-row-7", "usage.recorded");
    /// let msg = OutboxMessage::new(key, "billing", "usage.recorded", b"{}".to_vec())
    ///     .with_ordering_key("user-42");
    /// assert_eq!(msg.routing_key, "usage.recorded");
    /// ```
    pub fn new(
        message_key: MessageKey,
        exchange: impl Into<String>,
        message_type: impl Into<String>,
        payload: Vec<u8>,
    ) -> Self {
        let message_type = message_type.into();
        Self {
            message_key,
            exchange: exchange.into(),
            routing_key: message_type.clone(),
            message_type,
            payload,
            headers: BTreeMap::new(),
            tenant: None,
            ordering_key: None,
            not_before: None,
        }
    }

    /// Sets a routing key other than the message type.
    pub fn with_routing_key(mut self, routing_key: impl Into<String>) -> Self {
        self.routing_key = routing_key.into();
        self
    }

    /// Sets the tenant.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Sets the ordering key.
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the earliest publication time.
    pub fn with_not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// The envelope a consumer receives for this message (first delivery).
    pub fn to_envelope(&self) -> Envelope {
        let mut envelope = Envelope::new(
            self.message_key.clone(),
            self.message_type.clone(),
            self.payload.clone(),
        );
        envelope.headers = self.headers.clone();
        envelope.tenant = self.tenant.clone();
        envelope
    }
}

/// What an enqueue did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnqueueOutcome {
    /// A row was written (published after the transaction commits).
    Enqueued {
        /// The row's id.
        id: i64,
    },
    /// A row with this message key exists already: nothing was written.
    AlreadyEnqueued,
}

/// An outbox row leased by a relay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    /// The row's id (publication order).
    pub id: i64,
    /// The message.
    pub message: OutboxMessage,
    /// Failed publications so far.
    pub attempts: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
}

/// Rows a relay may publish until `until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The relay holding the lease.
    pub relay: String,
    /// When the lease expires; the relay does not publish after that.
    pub until: DateTime<Utc>,
    /// The rows, in id order.
    pub rows: Vec<OutboxRow>,
    /// Leased rows the store could not read (headers that are not JSON, a key out of
    /// range, a value another producer wrote in a form the store does not know). They
    /// are leased like the others, so the relay records their failure by id: they
    /// never fail the lease, and they end dead like any row that keeps failing.
    pub unreadable: Vec<UnreadableRow>,
}

/// A leased row the store could not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadableRow {
    /// The row's id.
    pub id: i64,
    /// Failed publications so far.
    pub attempts: i32,
    /// Why it could not be read.
    pub error: String,
}

/// How many failed publications make an outbox row dead, unless a relay is told
/// otherwise.
pub const DEFAULT_OUTBOX_MAX_ATTEMPTS: u32 = 20;

/// The longest delay between two tries of a failed outbox row.
pub const MAX_OUTBOX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// What becomes of an outbox row whose publication failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutboxFate {
    /// It is due again after this delay.
    RetryAfter(Duration),
    /// It failed its last attempt: kept, never leased again, listed for operators.
    Dead,
}

impl OutboxFate {
    /// The fate of a row that has failed `attempts` times before this failure:
    /// dead when this failure is its `max_attempts`-th, else due again after
    /// `first * 2^attempts`, at most [`MAX_OUTBOX_RETRY_DELAY`] (and at least
    /// `first`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_core::OutboxFate;
    /// let s = Duration::from_secs(1);
    /// assert_eq!(OutboxFate::after(s, 0, 3), OutboxFate::RetryAfter(s));
    /// assert_eq!(OutboxFate::after(s, 1, 3), OutboxFate::RetryAfter(2 * s));
    /// assert_eq!(OutboxFate::after(s, 2, 3), OutboxFate::Dead);
    /// ```
    pub fn after(first: Duration, attempts: i32, max_attempts: u32) -> Self {
        let this_attempt = i64::from(attempts.max(0)) + 1;
        if this_attempt >= i64::from(max_attempts) {
            return Self::Dead;
        }
        let doublings = u32::try_from(attempts.max(0)).unwrap_or(0);
        Self::RetryAfter(exponential_backoff(
            first,
            doublings,
            MAX_OUTBOX_RETRY_DELAY.max(first),
        ))
    }
}

/// A failed publication to record against its row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxFailure {
    /// The row's id.
    pub id: i64,
    /// What went wrong (kept as the row's `last_error`).
    pub error: String,
    /// Whether it is tried again, and when.
    pub fate: OutboxFate,
}

/// The outbox table, as a relay uses it. Every call is a short transaction of its
/// own: no database transaction is ever held across broker I/O.
pub trait OutboxStore: Send + Sync + 'static {
    /// Leases up to `limit` unpublished, live (not dead), due rows whose lease is free
    /// or expired, in id order, skipping rows locked by another relay and rows with
    /// an earlier live row of the same ordering key. A row it cannot read is leased
    /// and returned in [`Lease::unreadable`]; it never fails the lease.
    fn lease(&self, relay: &str, limit: usize, lease_for: Duration) -> Result<Lease>;

    /// Marks rows published, only those still leased by `relay`; returns how many.
    fn mark_published(&self, relay: &str, ids: &[i64]) -> Result<usize>;

    /// Records failed publications of rows `relay` still leases (attempts + 1, last
    /// error) and releases their lease; each is due again after its delay, or dead.
    fn record_failures(&self, relay: &str, failures: &[OutboxFailure]) -> Result<()>;

    /// The age of the oldest unpublished row that is not dead, if any.
    fn oldest_unpublished_age(&self) -> Result<Option<Duration>>;

    /// The store clock's time.
    fn now(&self) -> DateTime<Utc>;

    /// Blocks until a message may have been enqueued (a notification) or `timeout`
    /// passes; returns whether it was woken. Without notifications, it sleeps.
    fn wait_for_enqueue(&self, timeout: Duration) -> Result<bool> {
        std::thread::sleep(timeout);
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_rows_back_off_cap_and_die_on_their_last_attempt() {
        let s = Duration::from_secs(1);
        let retry = |attempts| OutboxFate::after(s, attempts, 100);
        assert_eq!(retry(0), OutboxFate::RetryAfter(s));
        assert_eq!(retry(3), OutboxFate::RetryAfter(8 * s));
        assert_eq!(retry(40), OutboxFate::RetryAfter(MAX_OUTBOX_RETRY_DELAY));
        assert_eq!(retry(-1), OutboxFate::RetryAfter(s));
        assert_eq!(OutboxFate::after(s, 0, 1), OutboxFate::Dead);
        assert_eq!(OutboxFate::after(s, 0, 0), OutboxFate::Dead);
        assert_eq!(
            OutboxFate::after(s, 18, 20),
            OutboxFate::RetryAfter(MAX_OUTBOX_RETRY_DELAY)
        );
        assert_eq!(OutboxFate::after(s, 19, 20), OutboxFate::Dead);
        assert_eq!(
            OutboxFate::after(s, i32::MAX, u32::MAX),
            OutboxFate::RetryAfter(MAX_OUTBOX_RETRY_DELAY)
        );
        let long = Duration::from_secs(600);
        assert_eq!(OutboxFate::after(long, 0, 5), OutboxFate::RetryAfter(long));
    }
}
