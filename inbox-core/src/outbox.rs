//! The producer half: messages written in the business transaction, published later
//! by a relay that leases rows, publishes them with confirms and marks them.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{Envelope, InProcessTransport, InboxStore, MessageKey, Result};

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
    /// Rows with the same ordering key reach the broker in id order.
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
}

/// The outbox table, as a relay uses it. Every call is a short transaction of its
/// own: no database transaction is ever held across broker I/O.
pub trait OutboxStore: Send + Sync + 'static {
    /// Leases up to `limit` unpublished, due rows whose lease is free or expired, in
    /// id order, skipping rows locked by another relay and rows with an earlier
    /// unpublished row of the same ordering key.
    fn lease(&self, relay: &str, limit: usize, lease_for: Duration) -> Result<Lease>;

    /// Marks rows published, only those still leased by `relay`; returns how many.
    fn mark_published(&self, relay: &str, ids: &[i64]) -> Result<usize>;

    /// Records failed publications (attempts + 1, last error) and releases their
    /// lease; they are due again after `retry_after`.
    fn record_failures(
        &self,
        relay: &str,
        failures: &[(i64, String)],
        retry_after: Duration,
    ) -> Result<()>;

    /// The age of the oldest unpublished row, if any.
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

/// One relay round into the in-process transport: lease, publish, mark. Returns how
/// many rows were published. For embedded use (SQLite) and tests.
pub fn relay_in_process<O, S>(
    outbox: &O,
    transport: &mut InProcessTransport<S>,
    relay: &str,
    limit: usize,
) -> Result<usize>
where
    O: OutboxStore + ?Sized,
    S: InboxStore,
{
    let lease = outbox.lease(relay, limit, Duration::from_secs(30))?;
    let mut published = Vec::with_capacity(lease.rows.len());
    let mut failed = Vec::new();
    for row in &lease.rows {
        match transport.publish(row.message.to_envelope()) {
            Ok(_) => published.push(row.id),
            Err(err) => failed.push((row.id, err.to_string())),
        }
    }
    if !failed.is_empty() {
        outbox.record_failures(relay, &failed, Duration::from_secs(1))?;
    }
    outbox.mark_published(relay, &published)
}
