//! The outbox's table: [`enqueue`] writes a row inside the caller's transaction; the
//! [`OutboxStore`] a relay uses leases rows, marks them published or records failures,
//! each in a short transaction of its own.
//!
//! Neutral: the statements are each backend's (`pg/outbox.rs`, `sqlite/outbox.rs`,
//! the shared DSL in `dsl.rs`), and so is waking a relay (PostgreSQL NOTIFY/LISTEN in
//! `pg/listen.rs`; SQLite polls).
//!
//! # Ordering keys: the writers that race, and what happens
//!
//! Rows of one ordering key go out in commit order. Per key, id order is commit
//! order, and the lease takes a key's live row of lowest id only.
//!
//! - **Two producers enqueue one key** (PostgreSQL). Each takes the key's ordering
//!   lock ([`ORDERING_LOCK_CLASS`], striped by [`ordering_lock_stripe`]) before its
//!   INSERT draws an id, and holds it to commit: the second waits for the first's
//!   commit (or rollback), and its id comes after. Proved by
//!   `store_outbox::postgres_only::an_enqueue_of_a_key_waits_for_the_open_transaction_that_enqueued_it_first`
//!   (a row the first transaction enqueues while the second waits still goes out
//!   before the second's; it fails with the lock taken after the INSERT) and
//!   `a_transaction_that_wrote_first_but_enqueued_later_goes_out_later` (a
//!   transaction that wrote first and enqueued later goes out later; it fails with a
//!   lease in transaction-id order).
//! - **Two producers enqueue several keys in opposite orders**. One call takes its
//!   locks sorted by stripe, so two calls never deadlock
//!   (`opposite_key_orders_in_one_call_never_deadlock`, which sees 40P01 without the
//!   sort). Across calls, locks are taken in call order and two transactions can
//!   deadlock; PostgreSQL aborts one (40P01), a contention error.
//! - **Keys of one stripe** wait for each other at enqueue, never at the lease
//!   (`keys_that_share_a_stripe_wait_at_enqueue_but_go_out_apart`); a transaction
//!   holds at most [`ORDERING_LOCK_STRIPES`] ordering locks
//!   (`a_bulk_enqueue_of_many_keys_holds_a_bounded_number_of_locks`, 1,000 locks
//!   without the stripes).
//! - **A lease and an enqueue.** A lease never sees an uncommitted row. It needs no
//!   wait for older transactions: with the lock, a committed row of a key never has
//!   an uncommitted lower id of that key beside it, and a snapshot that sees a
//!   transaction's commit sees every commit before its lock was granted. Two relays
//!   leasing at once: `FOR UPDATE SKIP LOCKED`, and a row whose lower sibling is
//!   leased waits (`concurrent_relays_lease_disjoint_rows`,
//!   `ordering_key_waits_for_earlier_unpublished_rows`).
//! - **SQLite** has one writer: a transaction's first write takes the database's
//!   write lock until it commits, so no two producers race and no lock is taken
//!   (`store_outbox::sqlite_only::one_writer_so_an_enqueue_after_another_transactions_first_write_comes_later`).
//!
//! Rows written by other means than [`enqueue`] (a hand-written INSERT) take no lock
//! and are ordered by id only. The id sequence must hand out ids in time order
//! across sessions (`CACHE 1`, the `BIGSERIAL` default).

use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use inbox_core::{
    delta, EnqueueOutcome, Lease, OutboxFailure, OutboxFate, OutboxMessage, OutboxStore,
};

use crate::backend::StoreConnection;
use crate::pool::PooledStoreConnection;
use crate::rows::{DeadOutboxRow, NewOutbox};
use crate::{Error, Result, Store};

/// The PostgreSQL channel [`enqueue`] notifies and relays listen on.
///
/// The payload is the enqueuing connection's schema (`current_schema()`), and a
/// store only wakes for its own schema's notifications: stores in other schemas of
/// the same database share the channel without waking each other.
pub const OUTBOX_CHANNEL: &str = "inbox_outbox";

/// The longest `last_error` kept.
const MAX_ERROR_LEN: usize = 4000;

/// The largest body [`enqueue`] accepts unless told otherwise: 16 MiB, RabbitMQ's
/// default `max_message_size` since 4.0 (3.x allowed 128 MiB). A body the broker
/// refuses closes the relay's channel on every try; refusing it in the business
/// transaction tells the writer instead.
pub const DEFAULT_MAX_OUTBOX_PAYLOAD: usize = 16 * 1024 * 1024;

/// The longest exchange name, routing key, message type, ordering key and header
/// name [`enqueue`] accepts: AMQP carries the first four as short strings, and header
/// names too.
pub const MAX_OUTBOX_NAME_LEN: usize = 255;

/// What [`enqueue_with`] accepts beyond the message's own rules.
///
/// ```
/// use inbox_diesel::{EnqueueLimits, DEFAULT_MAX_OUTBOX_PAYLOAD};
/// assert_eq!(EnqueueLimits::default().max_payload, DEFAULT_MAX_OUTBOX_PAYLOAD);
/// let larger = EnqueueLimits::default().max_payload(64 * 1024 * 1024);
/// assert_eq!(larger.max_payload, 64 * 1024 * 1024);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnqueueLimits {
    /// The largest body, in bytes (default [`DEFAULT_MAX_OUTBOX_PAYLOAD`]). Keep it at
    /// or below the broker's `max_message_size`.
    pub max_payload: usize,
}

impl Default for EnqueueLimits {
    fn default() -> Self {
        Self {
            max_payload: DEFAULT_MAX_OUTBOX_PAYLOAD,
        }
    }
}

impl EnqueueLimits {
    /// Sets the largest body.
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }
}

/// Enqueues `message` on `conn`, inside the caller's transaction: the row becomes
/// visible to relays when that transaction commits, and never exists if it rolls
/// back. Enqueueing a message key that is already in the table writes nothing and
/// returns [`EnqueueOutcome::AlreadyEnqueued`].
///
/// The row is due at `message.not_before`, or at `now` (pass the store's clock,
/// [`Store::clock`]). On PostgreSQL it also notifies [`OUTBOX_CHANNEL`]; the
/// notification is delivered at commit, so a rolled-back enqueue wakes nobody.
///
/// A message with an ordering key reaches the broker in commit order among the
/// key's messages. On PostgreSQL the enqueue first takes the key's ordering lock (a
/// transaction-scoped advisory lock, [`ORDERING_LOCK_CLASS`], one of
/// [`ORDERING_LOCK_STRIPES`] per schema) and holds it until the business transaction
/// ends, so the key's rows draw their ids in commit order: an enqueue of a key waits
/// while another open transaction has enqueued the same key (or a key of the same
/// stripe). Enqueue ordered messages late in the transaction, since the lock is held
/// from the enqueue to the commit. Locks are taken in call order across calls: two
/// transactions that enqueue several ordering keys in separate calls can deadlock,
/// and PostgreSQL then aborts one of them (SQLSTATE 40P01, a contention error a
/// consumer's batch reruns); [`enqueue_all`] takes a call's locks in one sorted step.
/// The wait is bounded by the connection's `statement_timeout`. SQLite has one
/// writer: a transaction's first write holds the database until it commits, so ids
/// are commit order there and no lock is taken.
///
/// Refuses up front what the relay could never publish or the store never read
/// back: an empty routing key, message type or ordering key (use `None` for no
/// ordering; an empty exchange is the default exchange); an exchange, routing key,
/// message type, ordering key or header name over [`MAX_OUTBOX_NAME_LEN`] bytes (or
/// an empty header name); a NUL byte in any of them, in a header value or in the
/// tenant (PostgreSQL's text refuses it); a body over [`DEFAULT_MAX_OUTBOX_PAYLOAD`]
/// ([`enqueue_with`] sets another limit). The message key is checked by
/// [`MessageKey`](inbox_core::MessageKey) itself (1 to 255 bytes, no NUL).
///
/// ```
/// use diesel::{Connection, SqliteConnection};
/// use inbox_core::{EnqueueOutcome, MessageKey, OutboxMessage};
/// use inbox_diesel::{enqueue, Store};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = std::env::temp_dir().join(format!("inbox-enqueue-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("app.db");
/// let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", path.display())).build()?;
/// let mut conn = store.connection()?;
/// let key = MessageKey::derive("billing", "ledger-row-7", "usage.recorded");
/// let msg = OutboxMessage::new(key, "billing", "usage.recorded", b"{}".to_vec());
///
/// // A business transaction that rolls back takes its message with it.
/// let rolled_back = conn.transaction::<(), Box<dyn std::error::Error + Send + Sync>, _>(|conn| {
///     enqueue(conn, &msg, store.clock().now())?;
///     Err("the business write failed".into())
/// });
/// assert!(rolled_back.is_err());
///
/// let outcome = conn.transaction(|conn| {
///     // ... the business writes ...
///     enqueue(conn, &msg, store.clock().now())
/// })?;
/// assert!(matches!(outcome, EnqueueOutcome::Enqueued { .. }));
/// // The same key again is a no-op that says so.
/// assert_eq!(enqueue(&mut conn, &msg, store.clock().now())?, EnqueueOutcome::AlreadyEnqueued);
/// # drop(conn);
/// # drop(store);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(()) }
/// ```
///
/// On PostgreSQL the same code runs on a `Store<PgConnection>`; the relay
/// (`inbox_amqp::Relay`) publishes the committed rows.
pub fn enqueue<C: AsStoreConnection + ?Sized>(
    conn: &mut C,
    message: &OutboxMessage,
    now: DateTime<Utc>,
) -> Result<EnqueueOutcome> {
    enqueue_on(
        conn.as_store_connection(),
        message,
        now,
        &EnqueueLimits::default(),
    )
}

/// [`enqueue`] with other limits, such as a larger body for a broker configured
/// for one.
pub fn enqueue_with<C: AsStoreConnection + ?Sized>(
    conn: &mut C,
    message: &OutboxMessage,
    now: DateTime<Utc>,
    limits: &EnqueueLimits,
) -> Result<EnqueueOutcome> {
    enqueue_on(conn.as_store_connection(), message, now, limits)
}

/// Enqueues `messages` on `conn` in one call, inside the caller's transaction, in
/// the given order (their ids follow it); returns one outcome per message, in the
/// same order. Each message is checked as [`enqueue`] checks it, all of them before
/// anything is written.
///
/// The call's ordering locks (PostgreSQL; see [`enqueue`]) are taken together,
/// before the first row, in stripe order: two transactions enqueuing the same keys
/// in opposite orders in one call each never deadlock. Enqueue a transaction's
/// ordered messages in one call rather than several.
///
/// ```
/// use diesel::{Connection, SqliteConnection};
/// use inbox_core::{EnqueueOutcome, MessageKey, OutboxMessage};
/// use inbox_diesel::{enqueue_all, Store};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = std::env::temp_dir().join(format!("inbox-enqueue-all-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("app.db");
/// let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", path.display())).build()?;
/// let mut conn = store.connection()?;
/// let msg = |row: &str, user: &str| {
///     let key = MessageKey::derive("billing", row, "usage.recorded");
///     OutboxMessage::new(key, "billing", "usage.recorded", b"{}".to_vec())
///         .with_ordering_key(user)
/// };
/// let outcomes = conn.transaction(|conn| {
///     enqueue_all(conn, &[msg("row-1", "user-9"), msg("row-2", "user-3")], store.clock().now())
/// })?;
/// assert!(matches!(outcomes[..], [EnqueueOutcome::Enqueued { .. }, EnqueueOutcome::Enqueued { .. }]));
/// # drop(conn);
/// # drop(store);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(()) }
/// ```
pub fn enqueue_all<C: AsStoreConnection + ?Sized>(
    conn: &mut C,
    messages: &[OutboxMessage],
    now: DateTime<Utc>,
) -> Result<Vec<EnqueueOutcome>> {
    enqueue_all_on(
        conn.as_store_connection(),
        messages,
        now,
        &EnqueueLimits::default(),
    )
}

/// [`enqueue_all`] with other limits.
pub fn enqueue_all_with<C: AsStoreConnection + ?Sized>(
    conn: &mut C,
    messages: &[OutboxMessage],
    now: DateTime<Utc>,
    limits: &EnqueueLimits,
) -> Result<Vec<EnqueueOutcome>> {
    enqueue_all_on(conn.as_store_connection(), messages, now, limits)
}

/// A connection [`enqueue`] runs on: a store connection (`PgConnection`,
/// `SqliteConnection`) or a pooled one, such as the `&mut PooledConnection` a
/// transaction on [`Store::connection`]'s connection hands its closure.
pub trait AsStoreConnection {
    /// The store connection underneath.
    type Conn: StoreConnection;

    /// The store connection underneath.
    fn as_store_connection(&mut self) -> &mut Self::Conn;
}

impl<C: StoreConnection> AsStoreConnection for C {
    type Conn = C;

    fn as_store_connection(&mut self) -> &mut C {
        self
    }
}

impl<C: StoreConnection> AsStoreConnection for PooledStoreConnection<C> {
    type Conn = C;

    fn as_store_connection(&mut self) -> &mut C {
        self
    }
}

fn enqueue_on<C: StoreConnection>(
    conn: &mut C,
    message: &OutboxMessage,
    now: DateTime<Utc>,
    limits: &EnqueueLimits,
) -> Result<EnqueueOutcome> {
    let outcomes = enqueue_all_on(conn, std::slice::from_ref(message), now, limits)?;
    outcomes.into_iter().next().ok_or(Error::Internal(
        "an enqueue of one message returned no outcome",
    ))
}

fn enqueue_all_on<C: StoreConnection>(
    conn: &mut C,
    messages: &[OutboxMessage],
    now: DateTime<Utc>,
    limits: &EnqueueLimits,
) -> Result<Vec<EnqueueOutcome>> {
    let mut all_headers = Vec::with_capacity(messages.len());
    for message in messages {
        validate(message, limits)?;
        let headers = serde_json::to_string(&message.headers)
            .map_err(|err| invalid(message, format!("headers do not serialize as JSON: {err}")))?;
        all_headers.push(headers);
    }
    // The ordering locks come before the first INSERT: the id a row draws from the
    // sequence must be drawn while its key's lock is held, or id order is not commit
    // order. Sorted and distinct, so two calls never take two locks in opposite orders.
    let mut stripes: Vec<i32> = messages
        .iter()
        .filter_map(|m| m.ordering_key.as_deref())
        .map(ordering_lock_stripe)
        .collect();
    stripes.sort_unstable();
    stripes.dedup();
    C::lock_ordering(conn, &stripes)?;
    let now = micros(now);
    let mut outcomes = Vec::with_capacity(messages.len());
    for (message, headers) in messages.iter().zip(all_headers) {
        let row = NewOutbox {
            key: message.message_key.as_str(),
            exchange: &message.exchange,
            routing_key: &message.routing_key,
            message_type: &message.message_type,
            tenant: message.tenant.as_deref(),
            payload: &message.payload,
            headers,
            ordering_key: message.ordering_key.as_deref(),
            created_at: now,
            available_at: message.not_before.map_or(now, micros),
        };
        outcomes.push(match C::insert_outbox(conn, &row)? {
            Some(id) => EnqueueOutcome::Enqueued { id },
            None => EnqueueOutcome::AlreadyEnqueued,
        });
    }
    if outcomes
        .iter()
        .any(|o| matches!(o, EnqueueOutcome::Enqueued { .. }))
    {
        C::notify_enqueue(conn)?;
    }
    Ok(outcomes)
}

/// The first key of the ordering lock (PostgreSQL): a transaction-scoped advisory
/// lock `pg_advisory_xact_lock(ORDERING_LOCK_CLASS, hashtext(current_schema()) #
/// stripe)` that [`enqueue`] takes for a message's ordering key, before its row
/// draws an id, held until the business transaction ends. A class of its own, apart
/// from the projection locks (one-key advisory locks), the purge lock
/// ([`PURGE_LOCK_CLASS`](crate::PURGE_LOCK_CLASS)) and the migration lock. Visible
/// in `pg_locks` as `locktype = 'advisory'`, `classid = ORDERING_LOCK_CLASS`,
/// `objsubid = 2`.
pub const ORDERING_LOCK_CLASS: i32 = 0x6f72_6472;

/// How many ordering locks there are per schema: ordering keys are striped into this
/// many, so a transaction holds at most this many whatever number of keys it
/// enqueues (PostgreSQL's `max_locks_per_transaction` is 64 by default, and its lock
/// table is shared by the whole server). Two keys of one stripe serialize each
/// other's enqueues (a wait, never a wrong order): the price of the bound.
pub const ORDERING_LOCK_STRIPES: u32 = 64;

/// The stripe of [`ORDERING_LOCK_STRIPES`] whose lock serializes the enqueues of
/// `ordering_key`: FNV-1a of its bytes, modulo the stripes, the same in every
/// process and version (producers that disagreed would not serialize each other).
///
/// ```
/// use inbox_diesel::{ordering_lock_stripe, ORDERING_LOCK_STRIPES};
/// let stripe = ordering_lock_stripe("user-42");
/// assert!((0..ORDERING_LOCK_STRIPES as i32).contains(&stripe));
/// assert_eq!(stripe, ordering_lock_stripe("user-42"));
/// ```
pub fn ordering_lock_stripe(ordering_key: &str) -> i32 {
    let hash = ordering_key.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    // Below 64, so it fits.
    i32::try_from(hash % ORDERING_LOCK_STRIPES).unwrap_or(0)
}

fn validate(message: &OutboxMessage, limits: &EnqueueLimits) -> Result<()> {
    let refuse = |reason: String| Err(invalid(message, reason));
    if message.routing_key.is_empty() {
        return refuse("routing key must not be empty".to_owned());
    }
    if message.message_type.is_empty() {
        return refuse("message type must not be empty".to_owned());
    }
    if message.ordering_key.as_deref() == Some("") {
        return refuse("ordering key must not be empty (use None for no ordering)".to_owned());
    }
    let names = [
        ("exchange", Some(message.exchange.as_str())),
        ("routing key", Some(message.routing_key.as_str())),
        ("message type", Some(message.message_type.as_str())),
        ("ordering key", message.ordering_key.as_deref()),
    ];
    for (what, value) in names {
        let Some(value) = value else { continue };
        if value.len() > MAX_OUTBOX_NAME_LEN {
            return refuse(format!(
                "{what} must be at most {MAX_OUTBOX_NAME_LEN} bytes, found {} bytes",
                value.len()
            ));
        }
        if value.contains('\0') {
            return refuse(format!("{what} must not contain a NUL byte"));
        }
    }
    if message.tenant.as_deref().is_some_and(|t| t.contains('\0')) {
        return refuse("tenant must not contain a NUL byte".to_owned());
    }
    for (name, value) in &message.headers {
        if name.is_empty() || name.len() > MAX_OUTBOX_NAME_LEN {
            return refuse(format!(
                "header name must be 1 to {MAX_OUTBOX_NAME_LEN} bytes, found {} bytes",
                name.len()
            ));
        }
        if name.contains('\0') || value.contains('\0') {
            return refuse(format!("header {name:?} must not contain a NUL byte"));
        }
    }
    if message.payload.len() > limits.max_payload {
        return refuse(format!(
            "body must be at most {} bytes, found {} bytes",
            limits.max_payload,
            message.payload.len()
        ));
    }
    Ok(())
}

fn invalid(message: &OutboxMessage, reason: String) -> Error {
    Error::InvalidOutboxMessage {
        key: message.message_key.to_string(),
        reason,
    }
}

/// Truncates to whole microseconds, the databases' precision.
fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(TimeDelta::microseconds(1)).unwrap_or(t)
}

/// `now + d`, or an [`Error::InvalidSetting`] naming `setting` when it is out of
/// range.
fn later(now: DateTime<Utc>, d: Duration, setting: &'static str) -> Result<DateTime<Utc>> {
    now.checked_add_signed(delta(d)).ok_or_else(|| {
        Error::invalid(
            setting,
            "a duration that, added to now, stays within the calendar",
            format_args!("{d:?} after {now}"),
        )
    })
}

fn truncate(s: &str) -> &str {
    if s.len() <= MAX_ERROR_LEN {
        return s;
    }
    let mut end = MAX_ERROR_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl<C: StoreConnection> Store<C> {
    /// Up to `limit` dead outbox rows (their last attempt failed), oldest death
    /// first. A dead row is kept and never leased again until
    /// [`revive_outbox_rows`](Self::revive_outbox_rows) makes it live; it holds up no
    /// other row, of its ordering key or any other.
    pub fn dead_outbox_rows(&self, limit: usize) -> Result<Vec<DeadOutboxRow>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.connection()?;
        Ok(C::dead_outbox(&mut conn, limit)?)
    }

    /// Makes dead outbox rows live again (say, after declaring the exchange they
    /// were for): due now, attempts back to 0, the last error kept. Returns how
    /// many were dead; ids of rows that are not dead are ignored.
    pub fn revive_outbox_rows(&self, ids: &[i64]) -> Result<usize> {
        if ids.is_empty() {
            return Ok(0);
        }
        let now = self.clock().now();
        let mut conn = self.connection()?;
        Ok(C::write_transaction(&mut *conn, |conn| {
            C::revive_outbox(conn, ids, now)
        })?)
    }

    fn lease_rows(&self, relay: &str, limit: usize, lease_for: Duration) -> Result<Lease> {
        if relay.is_empty() {
            return Err(Error::invalid("relay", "a non-empty relay name", "\"\""));
        }
        if lease_for.is_zero() {
            return Err(Error::invalid("lease_for", "a duration above zero", "0s"));
        }
        let now = self.clock().now();
        let until = later(now, lease_for, "lease_for")?;
        let mut lease = Lease {
            relay: relay.to_owned(),
            until,
            rows: Vec::new(),
            unreadable: Vec::new(),
        };
        if limit == 0 {
            return Ok(lease);
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.connection()?;
        // The lease and the read of its rows go together (one statement on
        // PostgreSQL, one transaction on SQLite): a read that fails before the
        // commit (a timeout, the connection lost) takes the lease back with it, so
        // the rows are free at once rather than after `lease_for`, and no later row
        // of their ordering keys waits for them. A connection lost after the commit
        // leaves them leased until `lease_for` runs out: on PostgreSQL that is while
        // the rows are on their way back (the statement commits before the client
        // has them all); a transaction leaves the same window at its COMMIT only,
        // and cost four round trips and a read of every row by id (docs/outbox.md).
        (lease.rows, lease.unreadable) = C::lease_outbox(&mut conn, relay, limit, now, until)?;
        Ok(lease)
    }

    fn mark_rows_published(&self, relay: &str, ids: &[i64]) -> Result<usize> {
        if ids.is_empty() {
            return Ok(0);
        }
        let now = self.clock().now();
        let mut conn = self.connection()?;
        // Each row's mark stands alone (guarded by the lease it names): a round of
        // up to 500 rows is marked by one statement, committed by itself, without
        // the two round trips of a `BEGIN` and a `COMMIT`. A larger round's several
        // statements share a transaction, so that an error means none was marked.
        if ids.len() <= crate::dsl::ID_CHUNK {
            return Ok(C::mark_outbox_published(&mut conn, relay, ids, now)?);
        }
        Ok(C::write_transaction(&mut *conn, |conn| {
            C::mark_outbox_published(conn, relay, ids, now)
        })?)
    }

    fn record_row_failures(&self, relay: &str, failures: &[OutboxFailure]) -> Result<()> {
        if failures.is_empty() {
            return Ok(());
        }
        let now = self.clock().now();
        let fates = failures
            .iter()
            .map(|f| match f.fate {
                OutboxFate::RetryAfter(delay) => Ok((later(now, delay, "retry_after")?, None)),
                OutboxFate::Dead => Ok((now, Some(now))),
                _ => Err(Error::Internal("an outbox fate this store does not know")),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut conn = self.connection()?;
        C::write_transaction(&mut *conn, |conn| {
            for (f, (due, dead)) in failures.iter().zip(fates) {
                C::record_outbox_failure(conn, relay, f.id, truncate(&f.error), due, dead)?;
            }
            Ok::<_, diesel::result::Error>(())
        })?;
        Ok(())
    }

    fn oldest_age(&self) -> Result<Option<Duration>> {
        let mut conn = self.connection()?;
        let first = C::first_unpublished_at(&mut conn)?;
        let now = self.clock().now();
        Ok(first.map(|at| (now - at).to_std().unwrap_or(Duration::ZERO)))
    }

    fn wait(&self, timeout: Duration) -> Result<bool> {
        self.inner.wait_for_enqueue(timeout)
    }
}

/// Every call is a short transaction of its own on a pooled connection (the mark of up
/// to 500 rows, one statement, commits by itself without a `BEGIN`); every time
/// comes from the store's clock. `wait_for_enqueue` on PostgreSQL uses the store's
/// LISTEN connection (not a pooled one) and wall time; on SQLite it sleeps on the
/// store's clock and returns `false`.
impl<C: StoreConnection> OutboxStore for Store<C> {
    fn lease(&self, relay: &str, limit: usize, lease_for: Duration) -> inbox_core::Result<Lease> {
        Ok(self.lease_rows(relay, limit, lease_for)?)
    }

    fn mark_published(&self, relay: &str, ids: &[i64]) -> inbox_core::Result<usize> {
        Ok(self.mark_rows_published(relay, ids)?)
    }

    fn record_failures(&self, relay: &str, failures: &[OutboxFailure]) -> inbox_core::Result<()> {
        Ok(self.record_row_failures(relay, failures)?)
    }

    fn oldest_unpublished_age(&self) -> inbox_core::Result<Option<Duration>> {
        Ok(self.oldest_age()?)
    }

    fn now(&self) -> DateTime<Utc> {
        self.clock().now()
    }

    fn wait_for_enqueue(&self, timeout: Duration) -> inbox_core::Result<bool> {
        Ok(self.wait(timeout)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_on_a_char_boundary() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate(&long);
        assert!(cut.len() <= MAX_ERROR_LEN);
        assert!(cut.len() > MAX_ERROR_LEN - 2);
        assert_eq!(truncate("short"), "short");
    }
}
