//! The outbox's table: [`enqueue`] writes a row inside the caller's transaction; the
//! [`OutboxStore`] a relay uses leases rows, marks them published or records failures,
//! each in a short transaction of its own.
//!
//! Leasing differs per backend (PostgreSQL skips rows another relay has locked;
//! SQLite has one writer at a time), and so does waking a relay (PostgreSQL
//! NOTIFY/LISTEN; SQLite polls). The other statements are written once.

use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::pool::PooledStoreConnection;
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::QueryResult;
use diesel::sql_types::{BigInt, Text};
use diesel::PgConnection;
use inbox_core::{
    delta, EnqueueOutcome, Lease, MessageKey, OutboxFailure, OutboxFate, OutboxMessage, OutboxRow,
    OutboxStore, UnreadableRow,
};

use crate::backend::{private::Sealed, StoreConnection};
use crate::{Backend, Error, Result, Store};

/// The PostgreSQL channel [`enqueue`] notifies and relays listen on.
///
/// The payload is the enqueuing connection's schema (`current_schema()`), and a
/// store only wakes for its own schema's notifications: stores in other schemas of
/// the same database share the channel without waking each other.
pub const OUTBOX_CHANNEL: &str = "inbox_outbox";

/// How often a waiting relay checks its LISTEN connection for notifications.
const LISTEN_POLL: Duration = Duration::from_millis(5);

/// Ids per statement: SQLite binds every id of an `IN` list as its own parameter.
const ID_CHUNK: usize = 500;

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
/// let larger = EnqueueLimits::default().with_max_payload(64 * 1024 * 1024);
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
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
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
/// Refuses up front what the relay could never publish or the store never read
/// back: an empty routing key, message type or ordering key (use `None` for no
/// ordering; an empty exchange is the default exchange); an exchange, routing key,
/// message type, ordering key or header name over [`MAX_OUTBOX_NAME_LEN`] bytes (or
/// an empty header name); a NUL byte in any of them, in a header value or in the
/// tenant (PostgreSQL's text refuses it); a body over [`DEFAULT_MAX_OUTBOX_PAYLOAD`]
/// ([`enqueue_with`] sets another limit). The message key is checked by
/// [`MessageKey`] itself (1 to 255 bytes, no NUL).
///
/// ```no_run
/// use diesel::{Connection, PgConnection};
/// use inbox_core::{EnqueueOutcome, MessageKey, OutboxMessage};
/// use inbox_diesel::{enqueue, Store};
/// # fn main() -> inbox_diesel::Result<()> {
/// let store = Store::<PgConnection>::builder("postgres://postgres@127.0.0.1/test").build()?;
/// let mut conn = store.connection()?;
/// let key = MessageKey::derive("billing", "ledger-row-7", "usage.recorded");
/// let msg = OutboxMessage::new(key, "billing", "usage.recorded", b"{}".to_vec());
/// let outcome = conn.transaction(|conn| {
///     // ... the business writes ...
///     enqueue(conn, &msg, store.clock().now())
/// })?;
/// assert!(matches!(outcome, EnqueueOutcome::Enqueued { .. }));
/// # Ok(()) }
/// ```
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
    validate(message, limits)?;
    let headers = serde_json::to_string(&message.headers)
        .map_err(|err| invalid(message, format!("headers do not serialize as JSON: {err}")))?;
    let now = micros(now);
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
    match C::insert_outbox(conn, &row)? {
        Some(id) => {
            C::notify_enqueue(conn)?;
            Ok(EnqueueOutcome::Enqueued { id })
        }
        None => Ok(EnqueueOutcome::AlreadyEnqueued),
    }
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

/// `now + d`, or an error naming both when it is out of range.
fn later(now: DateTime<Utc>, d: Duration, what: &str) -> Result<DateTime<Utc>> {
    now.checked_add_signed(delta(d))
        .ok_or_else(|| Error::Config(format!("{what} of {d:?} after {now} is out of range")))
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

/// A row to insert.
pub struct NewOutbox<'a> {
    pub key: &'a str,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub payload: &'a [u8],
    pub headers: String,
    pub ordering_key: Option<&'a str>,
    pub created_at: DateTime<Utc>,
    pub available_at: DateTime<Utc>,
}

type OutboxTuple = (
    i64,
    String,
    String,
    String,
    String,
    Option<String>,
    Vec<u8>,
    String,
    Option<String>,
    DateTime<Utc>,
    i32,
);

/// A stored row as a message, or why it cannot be one (it is recorded against the
/// row, never failing the lease).
fn outbox_row(t: OutboxTuple) -> std::result::Result<OutboxRow, UnreadableRow> {
    let unreadable = |error: String| UnreadableRow {
        id: t.0,
        attempts: t.10,
        error: format!("unreadable row: {error}"),
    };
    let message_key = MessageKey::new(t.1.clone()).map_err(|err| unreadable(err.to_string()))?;
    let headers = serde_json::from_str(&t.7)
        .map_err(|err| unreadable(format!("headers are not a JSON object of strings: {err}")))?;
    Ok(OutboxRow {
        id: t.0,
        message: OutboxMessage {
            message_key,
            exchange: t.2,
            routing_key: t.3,
            message_type: t.4,
            payload: t.6,
            headers,
            tenant: t.5,
            ordering_key: t.8,
            // Consumed by leasing: a leased row is due, whenever it was first due.
            not_before: None,
        },
        attempts: t.10,
        created_at: t.9,
    })
}

/// Sorts decoded tuples into readable rows and unreadable ones.
fn decode_into(t: OutboxTuple, rows: &mut Vec<OutboxRow>, unreadable: &mut Vec<UnreadableRow>) {
    match outbox_row(t) {
        Ok(row) => rows.push(row),
        Err(bad) => unreadable.push(bad),
    }
}

/// A dead outbox row, as an operator sees it: what was stored, read as text where
/// it can be (a row may be dead because it could not be read).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadOutboxRow {
    /// The row's id.
    pub id: i64,
    /// The message key, as stored.
    pub message_key: String,
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The message type.
    pub message_type: String,
    /// The ordering key.
    pub ordering_key: Option<String>,
    /// Failed publications.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When its last attempt failed. (Its `created_at` is not read: a row may be
    /// dead because another producer wrote a timestamp the store cannot decode.)
    pub dead_at: DateTime<Utc>,
}

type DeadTuple = (
    i64,
    String,
    String,
    String,
    String,
    Option<String>,
    i32,
    Option<String>,
    Option<DateTime<Utc>>,
);

fn dead_row(t: DeadTuple) -> DeadOutboxRow {
    DeadOutboxRow {
        id: t.0,
        message_key: t.1,
        exchange: t.2,
        routing_key: t.3,
        message_type: t.4,
        ordering_key: t.5,
        attempts: t.6,
        last_error: t.7,
        // Selected with dead_at IS NOT NULL.
        dead_at: t.8.unwrap_or(DateTime::<Utc>::MIN_UTC),
    }
}

#[derive(QueryableByName)]
struct LeasedId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct SchemaName {
    #[diesel(sql_type = Text)]
    name: String,
}

/// The outbox statements every backend runs, on its own connection type.
pub trait OutboxOps: Sized {
    /// Inserts a row unless its message key exists; returns its id if it did.
    fn insert_outbox(conn: &mut Self, row: &NewOutbox<'_>) -> QueryResult<Option<i64>>;

    /// Wakes relays at commit (PostgreSQL); nothing on SQLite.
    fn notify_enqueue(conn: &mut Self) -> QueryResult<()>;

    /// Leases up to `limit` due rows (see [`OutboxStore::lease`]); returns their ids.
    fn lease_ids(
        conn: &mut Self,
        relay: &str,
        limit: i64,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> QueryResult<Vec<i64>>;

    /// Reads rows by id, in id order; rows that cannot be read are returned apart.
    fn load_outbox(
        conn: &mut Self,
        ids: &[i64],
    ) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)>;

    /// Marks rows published that `relay` still leases; returns how many.
    fn mark_outbox_published(
        conn: &mut Self,
        relay: &str,
        ids: &[i64],
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Records a failed publication of a row `relay` still leases and frees it: due
    /// again at `due`, or dead since `dead_at`.
    fn record_outbox_failure(
        conn: &mut Self,
        relay: &str,
        id: i64,
        error: &str,
        due: DateTime<Utc>,
        dead_at: Option<DateTime<Utc>>,
    ) -> QueryResult<usize>;

    /// When the first live unpublished row in id order was enqueued.
    fn first_unpublished_at(conn: &mut Self) -> QueryResult<Option<DateTime<Utc>>>;

    /// Up to `limit` dead rows, oldest death first.
    fn dead_outbox(conn: &mut Self, limit: i64) -> QueryResult<Vec<DeadOutboxRow>>;

    /// Makes dead rows live again, due at `now` with no attempts; returns how many.
    fn revive_outbox(conn: &mut Self, ids: &[i64], now: DateTime<Utc>) -> QueryResult<usize>;

    /// Deletes up to `limit` rows published before `cutoff`, oldest first.
    fn purge_published(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize>;

    /// Deletes up to `limit` done claims last updated before `cutoff`, oldest first.
    fn purge_done_claims(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize>;
}

/// PostgreSQL's statements.
mod pg_sql {
    pub const NOTIFY: Option<&str> = Some("SELECT pg_notify($1, coalesce(current_schema(), ''))");

    /// SKIP LOCKED: concurrent relays lease disjoint rows without waiting for each
    /// other. Dead rows are never leased and hold nothing up.
    ///
    /// Rows with an ordering key go out per key in (writing transaction, id) order,
    /// which is commit order: ids are not (a row with a lower id can commit later,
    /// and until then the NOT EXISTS cannot see it). So an ordered row is leased only
    /// once its transaction is older than every transaction still running
    /// (`pg_snapshot_xmin`): every row that precedes it has then committed (or rolled
    /// back) and is visible; and only while no live row precedes it (leased, failed
    /// or not yet due). A NULL `xact_id` (a row from before the column) counts as
    /// long committed. Rows without an ordering key are leased at once.
    pub const LEASE: &str = "\
        UPDATE outbox_messages SET leased_until = $2, leased_by = $3 \
        WHERE id IN ( \
            SELECT o.id FROM outbox_messages o \
            WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at <= $1 \
              AND (o.leased_until IS NULL OR o.leased_until <= $1) \
              AND (o.ordering_key IS NULL OR ( \
                  coalesce(o.xact_id, '0'::xid8) < pg_snapshot_xmin(pg_current_snapshot()) \
                  AND NOT EXISTS ( \
                      SELECT 1 FROM outbox_messages e \
                      WHERE e.ordering_key = o.ordering_key \
                        AND e.published_at IS NULL AND e.dead_at IS NULL \
                        AND (coalesce(e.xact_id, '0'::xid8), e.id) \
                          < (coalesce(o.xact_id, '0'::xid8), o.id)))) \
            ORDER BY o.id LIMIT $4 \
            FOR UPDATE SKIP LOCKED) \
        RETURNING id";

    // SKIP LOCKED: a purge never waits for (or deadlocks with) a relay or a batch.
    pub const PURGE_PUBLISHED: &str = "\
        DELETE FROM outbox_messages WHERE id IN ( \
            SELECT id FROM outbox_messages \
            WHERE published_at IS NOT NULL AND published_at < $1 \
            ORDER BY published_at LIMIT $2 \
            FOR UPDATE SKIP LOCKED)";

    pub const PURGE_DONE_CLAIMS: &str = "\
        DELETE FROM inbox_claims WHERE (message_key, consumer_group) IN ( \
            SELECT message_key, consumer_group FROM inbox_claims \
            WHERE status = 'done' AND updated_at < $1 \
            ORDER BY updated_at LIMIT $2 \
            FOR UPDATE SKIP LOCKED)";
}

/// SQLite's statements: the same, without row locks (the immediate transaction is
/// the only writer).
mod sqlite_sql {
    pub const NOTIFY: Option<&str> = None;

    /// One writer at a time, so ids are handed out in commit order: id order is
    /// an ordering key's order, and no transaction id is needed.
    pub const LEASE: &str = "\
        UPDATE outbox_messages SET leased_until = ?2, leased_by = ?3 \
        WHERE id IN ( \
            SELECT o.id FROM outbox_messages o \
            WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at <= ?1 \
              AND (o.leased_until IS NULL OR o.leased_until <= ?1) \
              AND NOT EXISTS ( \
                  SELECT 1 FROM outbox_messages e \
                  WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                    AND e.published_at IS NULL AND e.dead_at IS NULL) \
            ORDER BY o.id LIMIT ?4) \
        RETURNING id";

    pub const PURGE_PUBLISHED: &str = "\
        DELETE FROM outbox_messages WHERE id IN ( \
            SELECT id FROM outbox_messages \
            WHERE published_at IS NOT NULL AND published_at < ?1 \
            ORDER BY published_at LIMIT ?2)";

    pub const PURGE_DONE_CLAIMS: &str = "\
        DELETE FROM inbox_claims WHERE (message_key, consumer_group) IN ( \
            SELECT message_key, consumer_group FROM inbox_claims \
            WHERE status = 'done' AND updated_at < ?1 \
            ORDER BY updated_at LIMIT ?2)";
}

macro_rules! outbox_ops {
    ($conn:ty, $schema:ident, $ts:ty, $sql:ident) => {
        impl OutboxOps for $conn {
            fn insert_outbox(conn: &mut Self, row: &NewOutbox<'_>) -> QueryResult<Option<i64>> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                diesel::insert_into(outbox_messages)
                    .values((
                        message_key.eq(row.key),
                        exchange.eq(row.exchange),
                        routing_key.eq(row.routing_key),
                        message_type.eq(row.message_type),
                        tenant.eq(row.tenant),
                        payload.eq(row.payload),
                        headers.eq(&row.headers),
                        ordering_key.eq(row.ordering_key),
                        created_at.eq(row.created_at),
                        available_at.eq(row.available_at),
                        attempts.eq(0),
                    ))
                    // The only unique key besides the id is (message_key, replay_seq),
                    // and a producer's row has replay_seq 0.
                    .on_conflict_do_nothing()
                    .returning(id)
                    .get_result(conn)
                    .optional()
            }

            fn notify_enqueue(conn: &mut Self) -> QueryResult<()> {
                match $sql::NOTIFY {
                    Some(sql) => diesel::sql_query(sql)
                        .bind::<Text, _>(OUTBOX_CHANNEL)
                        .execute(conn)
                        .map(|_| ()),
                    None => Ok(()),
                }
            }

            fn lease_ids(
                conn: &mut Self,
                relay: &str,
                limit: i64,
                now: DateTime<Utc>,
                until: DateTime<Utc>,
            ) -> QueryResult<Vec<i64>> {
                let ids: Vec<LeasedId> = diesel::sql_query($sql::LEASE)
                    .bind::<$ts, _>(now)
                    .bind::<$ts, _>(until)
                    .bind::<Text, _>(relay)
                    .bind::<BigInt, _>(limit)
                    .load(conn)?;
                Ok(ids.into_iter().map(|r| r.id).collect())
            }

            fn load_outbox(
                conn: &mut Self,
                ids: &[i64],
            ) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                use diesel::result::Error::DeserializationError;
                let columns = (
                    id,
                    message_key,
                    exchange,
                    routing_key,
                    message_type,
                    tenant,
                    payload,
                    headers,
                    ordering_key,
                    created_at,
                    attempts,
                );
                let mut rows = Vec::with_capacity(ids.len());
                let mut unreadable = Vec::new();
                for chunk in ids.chunks(ID_CHUNK) {
                    let loaded: QueryResult<Vec<OutboxTuple>> = outbox_messages
                        .filter(id.eq_any(chunk))
                        .select(columns)
                        .load(conn);
                    match loaded {
                        Ok(tuples) => {
                            for t in tuples {
                                decode_into(t, &mut rows, &mut unreadable);
                            }
                        }
                        // A value diesel cannot decode (a timestamp another producer
                        // wrote as it liked): find it row by row. Decoding fails on
                        // the client, so the transaction is still usable.
                        Err(DeserializationError(_)) => {
                            for &one in chunk {
                                let single: QueryResult<Option<OutboxTuple>> = outbox_messages
                                    .filter(id.eq(one))
                                    .select(columns)
                                    .first(conn)
                                    .optional();
                                match single {
                                    Ok(Some(t)) => decode_into(t, &mut rows, &mut unreadable),
                                    Ok(None) => {}
                                    Err(DeserializationError(err)) => {
                                        let tries: QueryResult<i32> = outbox_messages
                                            .filter(id.eq(one))
                                            .select(attempts)
                                            .first(conn);
                                        let tries = match tries {
                                            Ok(n) => n,
                                            Err(DeserializationError(_)) => 0,
                                            Err(other) => return Err(other),
                                        };
                                        unreadable.push(UnreadableRow {
                                            id: one,
                                            attempts: tries,
                                            error: format!("unreadable row: {err}"),
                                        });
                                    }
                                    Err(other) => return Err(other),
                                }
                            }
                        }
                        Err(other) => return Err(other),
                    }
                }
                rows.sort_by_key(|r| r.id);
                unreadable.sort_by_key(|r| r.id);
                Ok((rows, unreadable))
            }

            fn mark_outbox_published(
                conn: &mut Self,
                relay: &str,
                ids: &[i64],
                now: DateTime<Utc>,
            ) -> QueryResult<usize> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                let mut marked = 0;
                for chunk in ids.chunks(ID_CHUNK) {
                    // Only rows this relay still leases: a relay whose lease expired
                    // and was taken over marks nothing (the new holder publishes).
                    marked += diesel::update(
                        outbox_messages
                            .filter(id.eq_any(chunk))
                            .filter(leased_by.eq(relay))
                            .filter(published_at.is_null()),
                    )
                    .set((published_at.eq(now), leased_until.eq(None::<DateTime<Utc>>)))
                    .execute(conn)?;
                }
                Ok(marked)
            }

            fn record_outbox_failure(
                conn: &mut Self,
                relay: &str,
                row_id: i64,
                error: &str,
                due: DateTime<Utc>,
                dead: Option<DateTime<Utc>>,
            ) -> QueryResult<usize> {
                use crate::schema::$schema::outbox_fates::dsl::*;
                diesel::update(
                    outbox_fates
                        .filter(id.eq(row_id))
                        .filter(leased_by.eq(relay))
                        .filter(published_at.is_null()),
                )
                .set((
                    attempts.eq(attempts + 1),
                    last_error.eq(error),
                    available_at.eq(due),
                    dead_at.eq(dead),
                    leased_until.eq(None::<DateTime<Utc>>),
                    leased_by.eq(None::<&str>),
                ))
                .execute(conn)
            }

            fn first_unpublished_at(conn: &mut Self) -> QueryResult<Option<DateTime<Utc>>> {
                use crate::schema::$schema::outbox_fates::dsl::*;
                outbox_fates
                    .filter(published_at.is_null())
                    .filter(dead_at.is_null())
                    .order(id)
                    .select(created_at)
                    .first(conn)
                    .optional()
            }

            fn dead_outbox(conn: &mut Self, limit: i64) -> QueryResult<Vec<DeadOutboxRow>> {
                use crate::schema::$schema::outbox_fates::dsl::*;
                let tuples: Vec<DeadTuple> = outbox_fates
                    .filter(dead_at.is_not_null())
                    .filter(published_at.is_null())
                    .order((dead_at, id))
                    .limit(limit)
                    .select((
                        id,
                        message_key,
                        exchange,
                        routing_key,
                        message_type,
                        ordering_key,
                        attempts,
                        last_error,
                        dead_at,
                    ))
                    .load(conn)?;
                Ok(tuples.into_iter().map(dead_row).collect())
            }

            fn revive_outbox(
                conn: &mut Self,
                ids: &[i64],
                now: DateTime<Utc>,
            ) -> QueryResult<usize> {
                use crate::schema::$schema::outbox_fates::dsl::*;
                let mut revived = 0;
                for chunk in ids.chunks(ID_CHUNK) {
                    revived += diesel::update(
                        outbox_fates
                            .filter(id.eq_any(chunk))
                            .filter(dead_at.is_not_null())
                            .filter(published_at.is_null()),
                    )
                    .set((
                        dead_at.eq(None::<DateTime<Utc>>),
                        attempts.eq(0),
                        available_at.eq(now),
                    ))
                    .execute(conn)?;
                }
                Ok(revived)
            }

            fn purge_published(
                conn: &mut Self,
                cutoff: DateTime<Utc>,
                limit: i64,
            ) -> QueryResult<usize> {
                diesel::sql_query($sql::PURGE_PUBLISHED)
                    .bind::<$ts, _>(cutoff)
                    .bind::<BigInt, _>(limit)
                    .execute(conn)
            }

            fn purge_done_claims(
                conn: &mut Self,
                cutoff: DateTime<Utc>,
                limit: i64,
            ) -> QueryResult<usize> {
                diesel::sql_query($sql::PURGE_DONE_CLAIMS)
                    .bind::<$ts, _>(cutoff)
                    .bind::<BigInt, _>(limit)
                    .execute(conn)
            }
        }
    };
}

outbox_ops!(
    diesel::PgConnection,
    pg,
    diesel::sql_types::Timestamptz,
    pg_sql
);
outbox_ops!(
    diesel::SqliteConnection,
    sqlite,
    diesel::sql_types::TimestamptzSqlite,
    sqlite_sql
);

/// PostgreSQL: the store's dedicated LISTEN connection, outside the pool, opened on
/// the first wait and again after it breaks.
#[derive(Default)]
pub struct Listener {
    conn: Option<PgConnection>,
    /// The listening connection's schema: only its notifications wake this store.
    schema: String,
    /// Wake-ups seen so far; a waiter is woken when the count moves past its start.
    wakeups: u64,
}

impl Listener {
    /// Opens the connection if needed, then counts this schema's notifications;
    /// returns the count before and after.
    fn poll(&mut self, url: &str, schema: Option<&str>) -> Result<(u64, u64)> {
        let before = self.wakeups;
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let mut conn = <PgConnection as Sealed>::establish_url(url)
                    .map_err(|source| Error::connect(url, &source))?;
                <PgConnection as Sealed>::on_acquire(&mut conn, schema)?;
                let current: SchemaName =
                    diesel::sql_query("SELECT coalesce(current_schema(), '') AS name")
                        .get_result(&mut conn)?;
                conn.batch_execute(&format!("LISTEN {OUTBOX_CHANNEL}"))?;
                self.schema = current.name;
                // A message enqueued before LISTEN sent no notification we can see:
                // a fresh connection counts as a wake-up, so the relay leases again.
                self.wakeups += 1;
                self.conn.insert(conn)
            }
        };
        let received: Vec<_> = conn.notifications_iter().collect();
        for notification in received {
            match notification {
                Ok(n) if n.channel == OUTBOX_CHANNEL && n.payload == self.schema => {
                    self.wakeups += 1;
                }
                Ok(_) => {}
                Err(err) => {
                    // Broken: the next wait opens a new connection.
                    self.conn = None;
                    return Err(err.into());
                }
            }
        }
        Ok((before, self.wakeups))
    }
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
        let now = self.inner.clock.now();
        let mut conn = self.connection()?;
        Ok(C::write_transaction(&mut *conn, |conn| {
            C::revive_outbox(conn, ids, now)
        })?)
    }

    fn lease_rows(&self, relay: &str, limit: usize, lease_for: Duration) -> Result<Lease> {
        if relay.is_empty() {
            return Err(Error::Config("a relay name must not be empty".to_owned()));
        }
        if lease_for.is_zero() {
            return Err(Error::Config(
                "a lease must last longer than zero, found 0s".to_owned(),
            ));
        }
        let now = self.inner.clock.now();
        let until = later(now, lease_for, "a lease")?;
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
        (lease.rows, lease.unreadable) = C::write_transaction(&mut *conn, |conn| {
            let ids = C::lease_ids(conn, relay, limit, now, until)?;
            C::load_outbox(conn, &ids)
        })?;
        Ok(lease)
    }

    fn mark_rows_published(&self, relay: &str, ids: &[i64]) -> Result<usize> {
        if ids.is_empty() {
            return Ok(0);
        }
        let now = self.inner.clock.now();
        let mut conn = self.connection()?;
        Ok(C::write_transaction(&mut *conn, |conn| {
            C::mark_outbox_published(conn, relay, ids, now)
        })?)
    }

    fn record_row_failures(&self, relay: &str, failures: &[OutboxFailure]) -> Result<()> {
        if failures.is_empty() {
            return Ok(());
        }
        let now = self.inner.clock.now();
        let fates = failures
            .iter()
            .map(|f| match f.fate {
                OutboxFate::RetryAfter(delay) => Ok((later(now, delay, "a retry")?, None)),
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
        let now = self.inner.clock.now();
        Ok(first.map(|at| (now - at).to_std().unwrap_or(Duration::ZERO)))
    }

    fn wait(&self, timeout: Duration) -> Result<bool> {
        if C::BACKEND != Backend::Postgres {
            // Polling is SQLite's only mode; a manual clock advances instead.
            self.inner.clock.sleep(timeout);
            return Ok(false);
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut start = None;
        loop {
            // The lock is held only while checking, never while sleeping.
            let (before, after) = self
                .inner
                .listener
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .poll(&self.inner.url, self.inner.schema.as_deref())?;
            let start = *start.get_or_insert(before);
            if after > start {
                return Ok(true);
            }
            let now = Instant::now();
            let step = match deadline {
                Some(deadline) if now >= deadline => return Ok(false),
                Some(deadline) => LISTEN_POLL.min(deadline - now),
                None => LISTEN_POLL,
            };
            std::thread::sleep(step);
        }
    }
}

/// Every call is a short transaction of its own on a pooled connection; every time
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
        self.inner.clock.now()
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
