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
use inbox_core::{delta, EnqueueOutcome, Lease, MessageKey, OutboxMessage, OutboxRow, OutboxStore};

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

/// Enqueues `message` on `conn`, inside the caller's transaction: the row becomes
/// visible to relays when that transaction commits, and never exists if it rolls
/// back. Enqueueing a message key that is already in the table writes nothing and
/// returns [`EnqueueOutcome::AlreadyEnqueued`].
///
/// The row is due at `message.not_before`, or at `now` (pass the store's clock,
/// [`Store::clock`]). On PostgreSQL it also notifies [`OUTBOX_CHANNEL`]; the
/// notification is delivered at commit, so a rolled-back enqueue wakes nobody.
///
/// Refuses an empty routing key, an empty message type and an empty ordering key
/// (use `None` for no ordering); an empty exchange is the default exchange.
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
    enqueue_on(conn.as_store_connection(), message, now)
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
) -> Result<EnqueueOutcome> {
    validate(message)?;
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

fn validate(message: &OutboxMessage) -> Result<()> {
    if message.routing_key.is_empty() {
        return Err(invalid(message, "routing key must not be empty".to_owned()));
    }
    if message.message_type.is_empty() {
        return Err(invalid(
            message,
            "message type must not be empty".to_owned(),
        ));
    }
    if message.ordering_key.as_deref() == Some("") {
        return Err(invalid(
            message,
            "ordering key must not be empty (use None for no ordering)".to_owned(),
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

fn outbox_row(t: OutboxTuple) -> QueryResult<OutboxRow> {
    let corrupt = |what: String| {
        diesel::result::Error::DeserializationError(format!("outbox row {}: {what}", t.0).into())
    };
    let message_key = MessageKey::new(t.1.clone()).map_err(|err| corrupt(err.to_string()))?;
    let headers = serde_json::from_str(&t.7)
        .map_err(|err| corrupt(format!("headers are not a JSON object of strings: {err}")))?;
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

    /// Reads rows by id, in id order.
    fn load_outbox(conn: &mut Self, ids: &[i64]) -> QueryResult<Vec<OutboxRow>>;

    /// Marks rows published that `relay` still leases; returns how many.
    fn mark_outbox_published(
        conn: &mut Self,
        relay: &str,
        ids: &[i64],
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Records a failed publication of a row `relay` still leases and frees it.
    fn record_outbox_failure(
        conn: &mut Self,
        relay: &str,
        id: i64,
        error: &str,
        due: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// When the first unpublished row in id order was enqueued.
    fn first_unpublished_at(conn: &mut Self) -> QueryResult<Option<DateTime<Utc>>>;

    /// Deletes up to `limit` rows published before `cutoff`, oldest first.
    fn purge_published(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize>;

    /// Deletes up to `limit` done claims last updated before `cutoff`, oldest first.
    fn purge_done_claims(conn: &mut Self, cutoff: DateTime<Utc>, limit: i64) -> QueryResult<usize>;
}

/// PostgreSQL's statements.
mod pg_sql {
    pub const NOTIFY: Option<&str> = Some("SELECT pg_notify($1, coalesce(current_schema(), ''))");

    /// SKIP LOCKED: concurrent relays lease disjoint rows without waiting for each
    /// other. The NOT EXISTS keeps an ordering key's rows in id order: a row waits
    /// while an earlier row of its key is unpublished (leased, failed or not yet due).
    pub const LEASE: &str = "\
        UPDATE outbox_messages SET leased_until = $2, leased_by = $3 \
        WHERE id IN ( \
            SELECT o.id FROM outbox_messages o \
            WHERE o.published_at IS NULL AND o.available_at <= $1 \
              AND (o.leased_until IS NULL OR o.leased_until <= $1) \
              AND NOT EXISTS ( \
                  SELECT 1 FROM outbox_messages e \
                  WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                    AND e.published_at IS NULL) \
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

    pub const LEASE: &str = "\
        UPDATE outbox_messages SET leased_until = ?2, leased_by = ?3 \
        WHERE id IN ( \
            SELECT o.id FROM outbox_messages o \
            WHERE o.published_at IS NULL AND o.available_at <= ?1 \
              AND (o.leased_until IS NULL OR o.leased_until <= ?1) \
              AND NOT EXISTS ( \
                  SELECT 1 FROM outbox_messages e \
                  WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                    AND e.published_at IS NULL) \
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
                    .on_conflict(message_key)
                    .do_nothing()
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

            fn load_outbox(conn: &mut Self, ids: &[i64]) -> QueryResult<Vec<OutboxRow>> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                let mut rows = Vec::with_capacity(ids.len());
                for chunk in ids.chunks(ID_CHUNK) {
                    let tuples: Vec<OutboxTuple> = outbox_messages
                        .filter(id.eq_any(chunk))
                        .select((
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
                        ))
                        .load(conn)?;
                    for t in tuples {
                        rows.push(outbox_row(t)?);
                    }
                }
                rows.sort_by_key(|r| r.id);
                Ok(rows)
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
            ) -> QueryResult<usize> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                diesel::update(
                    outbox_messages
                        .filter(id.eq(row_id))
                        .filter(leased_by.eq(relay))
                        .filter(published_at.is_null()),
                )
                .set((
                    attempts.eq(attempts + 1),
                    last_error.eq(error),
                    available_at.eq(due),
                    leased_until.eq(None::<DateTime<Utc>>),
                    leased_by.eq(None::<&str>),
                ))
                .execute(conn)
            }

            fn first_unpublished_at(conn: &mut Self) -> QueryResult<Option<DateTime<Utc>>> {
                use crate::schema::$schema::outbox_messages::dsl::*;
                outbox_messages
                    .filter(published_at.is_null())
                    .order(id)
                    .select(created_at)
                    .first(conn)
                    .optional()
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
        };
        if limit == 0 {
            return Ok(lease);
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.connection()?;
        lease.rows = C::write_transaction(&mut *conn, |conn| {
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

    fn record_row_failures(
        &self,
        relay: &str,
        failures: &[(i64, String)],
        retry_after: Duration,
    ) -> Result<()> {
        if failures.is_empty() {
            return Ok(());
        }
        let due = later(self.inner.clock.now(), retry_after, "a retry")?;
        let mut conn = self.connection()?;
        C::write_transaction(&mut *conn, |conn| {
            for (id, error) in failures {
                C::record_outbox_failure(conn, relay, *id, truncate(error), due)?;
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

    fn record_failures(
        &self,
        relay: &str,
        failures: &[(i64, String)],
        retry_after: Duration,
    ) -> inbox_core::Result<()> {
        Ok(self.record_row_failures(relay, failures, retry_after)?)
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
