//! Idempotency keys of requests on the store: begin, commit, settle, abandon, read
//! and purge the records of `idempotency_keys`, and verify its unique index.
//!
//! The rules (see [`inbox_core::idempotency::judge`]): a key whose effect committed is never
//! executed again; until the request is settled (delivered or refunded) replays are
//! in flight, whatever the lease says. The lease (to the request's deadline) only
//! frees a key whose request died *before* its effect committed, and every later
//! write of the first request is fenced by its lease token.
//!
//! A lease token ([`LeaseToken`]) is 16 random bytes drawn at every begin and every
//! take-over: it never repeats for a key, across abandons, purges and a failover that
//! rolls rows back with any sequence, so a guarded write matching (caller, key,
//! token) reaches the one record and lease it was handed for, or nothing.
//!
//! Lock order: the caller's own rows first (a balance, a key), then the record. The
//! functions that take a connection run inside the caller's transaction, so the
//! commit mark and the effect commit together.
//!
//! # Two writers of one record
//!
//! The writers are begin (insert), take-over (begin's conflict branch), commit,
//! settle, refund, abandon and purge. Each decides by one guarded statement and is
//! judged by the rows it touched, never by a read before it (begin reads the record
//! only to answer a request that did not get the key). On PostgreSQL the second of
//! two writers waits on the first's row lock (or, for an insert, on the unique
//! index) and then evaluates its guard on the row as committed; the tests force each
//! order with two connections, the second blocked until the first commits. SQLite
//! has one writer (every write is an immediate transaction), so two writers never
//! overlap: the race is one of the two orders, and the same tests run both there.
//!
//! | writers | what happens | test (`tests/store_idempotency.rs`) |
//! |---|---|---|
//! | begin, begin (one key) | the second waits on the unique index, then finds the key taken: in flight (mismatch for other content) | `two_begins_of_one_key_execute_one`, `concurrent_requests_with_one_key_execute_once` |
//! | take-over, take-over | the second re-checks `lease_until <= now` on the new lease: in flight | `two_begins_of_one_key_execute_one` |
//! | commit, then take-over | the take-over re-checks `committed_at IS NULL`: in flight, never run twice | `a_commit_ahead_of_a_takeover_keeps_the_key` |
//! | take-over, then commit | the commit matches the old token: fenced, roll back | `a_takeover_ahead_of_a_late_commit_fences_it` |
//! | take-over, then abandon | the abandon matches the old token: deletes nothing | `an_abandon_racing_a_takeover_never_deletes_the_new_lease` |
//! | abandon, then begin | the insert waits for the delete, then begins a record with a new token; the old token is fenced | `an_abandon_racing_a_takeover_never_deletes_the_new_lease`, `a_late_commit_never_lands_on_a_record_begun_after_an_abandon` |
//! | purge, purge (two instances) | the retention purge's lock on PostgreSQL: the second finds it held and returns at once, deleting nothing | `postgres_an_idempotency_purge_that_finds_another_running_leaves_the_records_to_it` |
//! | commit, then purge | the purge skips the locked row (PostgreSQL) and never takes a committed, unsettled record | `a_purge_racing_a_late_commit_never_loses_a_committed_request` |
//! | purge, then commit | the commit finds no record: fenced; a record begun later has another token | `a_purge_racing_a_late_commit_never_loses_a_committed_request`, `a_late_commit_never_lands_on_a_record_begun_after_a_purge` |
//! | settle, settle (delivered against refunded) | guarded from in flight: the first wins, the second touches nothing | `a_committed_request_is_in_flight_until_settled_whatever_its_lease` |
//! | settle, take-over or abandon | cannot meet: settle needs a committed record, take-over and abandon an uncommitted one | `an_expired_lease_frees_only_an_uncommitted_key_and_fences_the_first` |
//! | refund (delivered to refunded), purge | one row, two guarded writes: the second finds it refunded or gone and touches nothing (refund answers `false`); not forced by a test of its own | `a_delivered_request_refunded_later_answers_refunded` (the guard alone) |
//! | commit, abandon (one request) | both guarded by `committed_at IS NULL`: one wins | `a_request_refused_before_its_commit_gives_its_key_back` |

mod verify;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::result::QueryResult;
use inbox_core::idempotency::{
    judge, Fingerprint, IdempotencyAnswer, IdempotencyKey, IdempotencyRecord, IdempotencyStatus,
    Judgement, LeaseToken, Settlement,
};

use crate::backend::StoreConnection;
use crate::{AsStoreConnection, Error, PurgeTarget, Result, Store};

pub(crate) use verify::check;

/// The idempotency table's key columns, in the order of its primary key.
pub const IDEMPOTENCY_KEY_COLUMNS: [&str; 2] = ["caller", "idempotency_key"];

/// A record as a backend reads it, before its values are checked.
#[doc(hidden)]
pub struct RawRecord {
    pub caller: String,
    pub key: String,
    pub fingerprint: Vec<u8>,
    pub status: String,
    pub lease_token: Vec<u8>,
    pub lease_until: DateTime<Utc>,
    pub committed_at: Option<DateTime<Utc>>,
    pub response: Option<Vec<u8>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl RawRecord {
    fn check(self) -> Result<IdempotencyRecord> {
        let corrupt = |reason: String| Error::CorruptIdempotencyRecord {
            caller: self.caller.clone(),
            key: self.key.clone(),
            reason,
        };
        let fingerprint = Fingerprint::from_slice(&self.fingerprint).ok_or_else(|| {
            corrupt(format!(
                "fingerprint of {} bytes, expected {}",
                self.fingerprint.len(),
                Fingerprint::LEN
            ))
        })?;
        let status = IdempotencyStatus::parse(&self.status)
            .ok_or_else(|| corrupt(format!("unknown status {:?}", self.status)))?;
        let lease_token = LeaseToken::from_slice(&self.lease_token).ok_or_else(|| {
            corrupt(format!(
                "lease token of {} bytes, expected {}",
                self.lease_token.len(),
                LeaseToken::LEN
            ))
        })?;
        let mut record =
            IdempotencyRecord::from_parts(&self.caller, &self.key, fingerprint, status);
        record.lease_token = lease_token;
        record.lease_until = self.lease_until;
        record.committed_at = self.committed_at;
        record.response = self.response;
        record.created_at = self.created_at;
        record.updated_at = self.updated_at;
        Ok(record)
    }
}

/// A connection type idempotency keys are kept on: `PgConnection` or
/// `SqliteConnection`. Sealed, as [`StoreConnection`] is; code generic over the
/// backend that begins, commits or purges requests bounds its connection type by it.
pub trait IdempotencyConnection: StoreConnection + IdempotencyOps {}

impl<C: StoreConnection + IdempotencyOps> IdempotencyConnection for C {}

/// Deletes idempotency records created longer ago than `retention` (24 h is
/// [`inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION`]), at most `batch` per
/// transaction, until a batch deletes fewer; returns how many. Settled records
/// go, and uncommitted ones whose lease ended before the cutoff; a committed
/// request that is not settled yet is kept until it is. A replay after its
/// record is gone executes as a new request.
///
/// The purge is the retention purge's, with [`PurgeTarget::ExpiredIdempotencyKeys`]
/// (see [`purge_batch`](crate::purge_batch)): one cutoff, the rows oldest first from
/// the `created_at` index, each batch starting where the previous one stopped. On
/// PostgreSQL rows locked by a running request are skipped (the next purge takes
/// them), and one purge of the table runs at a time: a purge that finds another
/// running (its purge lock held) returns at once with what it deleted so far.
pub fn purge_expired_requests<C: IdempotencyConnection>(
    store: &Store<C>,
    retention: Duration,
    batch: usize,
) -> Result<u64> {
    store.purge(PurgeTarget::ExpiredIdempotencyKeys, retention, batch)
}

/// How many records [`purge_expired_requests`] with `retention` would delete now:
/// the retention purge's dry-run count ([`count_purgeable`](crate::count_purgeable)),
/// the same rows by the same rules.
pub fn count_expired_requests<C: IdempotencyConnection>(
    store: &Store<C>,
    retention: Duration,
) -> Result<u64> {
    let cutoff = inbox_core::earlier_by(store.clock().now(), retention);
    let mut conn = store.connection()?;
    crate::count_purgeable(&mut *conn, PurgeTarget::ExpiredIdempotencyKeys, cutoff)
}

/// Reads the idempotency record of (caller, key) on a connection of `store`'s pool.
pub fn request_record<C: IdempotencyConnection>(
    store: &Store<C>,
    caller: &str,
    key: &IdempotencyKey,
) -> Result<Option<IdempotencyRecord>> {
    let mut conn = store.connection()?;
    read_request(&mut *conn, caller, key)
}

/// The statements of one backend.
#[doc(hidden)]
pub trait IdempotencyOps: StoreConnection {
    /// Inserts the record with `token`, or takes over an expired, uncommitted one
    /// with the same fingerprint (giving it `token`); returns whether it did (`false`:
    /// the key is not free).
    fn begin(
        conn: &mut Self,
        caller: &str,
        key: &str,
        fingerprint: &[u8],
        token: &[u8],
        lease_until: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> QueryResult<bool>;

    /// Reads one record.
    fn read(conn: &mut Self, caller: &str, key: &str) -> QueryResult<Option<RawRecord>>;

    /// Marks the effect committed, fenced by the token; returns the rows touched.
    fn commit(
        conn: &mut Self,
        caller: &str,
        key: &str,
        token: &[u8],
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Settles a committed, in-flight record, fenced by the token.
    fn settle(
        conn: &mut Self,
        caller: &str,
        key: &str,
        token: &[u8],
        status: &str,
        response: Option<&[u8]>,
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Moves a delivered record to refunded, fenced by the token.
    fn refund_delivered(
        conn: &mut Self,
        caller: &str,
        key: &str,
        token: &[u8],
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Deletes an uncommitted, in-flight record, fenced by the token.
    fn abandon(conn: &mut Self, caller: &str, key: &str, token: &[u8]) -> QueryResult<usize>;

    /// The type `lease_token` must have (16 random bytes).
    const LEASE_TOKEN_TYPE: &'static str;
}

/// A request to begin under an idempotency key.
#[derive(Clone, Copy, Debug)]
pub struct NewRequest<'a> {
    /// Whose key it is (an account): one key means one request across all of the
    /// caller's credentials.
    pub caller: &'a str,
    /// The client's key.
    pub key: &'a IdempotencyKey,
    /// The request's fingerprint (see [`inbox_core::idempotency::RequestFields`]).
    pub fingerprint: &'a Fingerprint,
    /// The end of the lease: the request's deadline (stored within years 1 to 9999:
    /// a later one ends on 9999-12-31, for ever).
    pub lease_until: DateTime<Utc>,
}

/// How often `begin_request` tries again when the record it conflicted with is gone
/// (abandoned or purged meanwhile) or its lease ran out meanwhile.
const BEGIN_ROUNDS: usize = 3;

/// Begins a request under its idempotency key, in its own short transaction (a
/// savepoint inside the caller's): the key is this request's
/// ([`IdempotencyAnswer::Execute`] with the lease's fencing token) or the stored
/// record answers it (in flight, mismatch, replay, refunded). The database decides,
/// not a cache: of concurrent requests with one key exactly one executes.
pub fn begin_request<C>(
    conn: &mut C,
    request: &NewRequest<'_>,
    now: DateTime<Utc>,
) -> Result<IdempotencyAnswer>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    begin_on(conn, request, now)
}

fn begin_on<C: IdempotencyConnection>(
    conn: &mut C,
    request: &NewRequest<'_>,
    now: DateTime<Utc>,
) -> Result<IdempotencyAnswer> {
    let caller = request.caller;
    let key = request.key.as_str();
    check_caller(caller)?;
    for _ in 0..BEGIN_ROUNDS {
        // A new token per attempt: never one a deleted record of this key had.
        let token = LeaseToken::random();
        let taken = C::write_transaction(conn, |conn| {
            C::begin(
                conn,
                caller,
                key,
                request.fingerprint.as_bytes(),
                token.as_bytes(),
                // Within the years the stores hold (SQLite orders four-digit years only).
                inbox_core::stored_time(request.lease_until),
                now,
            )
        })?;
        if taken {
            return Ok(IdempotencyAnswer::Execute { token });
        }
        let Some(raw) = C::read(conn, caller, key)? else {
            continue; // abandoned or purged since the conflict: try again
        };
        match judge(&raw.check()?, request.fingerprint, now) {
            Judgement::Answer(answer) => return Ok(answer),
            Judgement::TakeOver { .. } => continue,
            Judgement::Corrupt(reason) => {
                return Err(Error::CorruptIdempotencyRecord {
                    caller: caller.to_owned(),
                    key: key.to_owned(),
                    reason: reason.to_owned(),
                })
            }
            _ => return Ok(IdempotencyAnswer::InFlight),
        }
    }
    // Still contended after every round: another request holds the key.
    Ok(IdempotencyAnswer::InFlight)
}

fn check_caller(caller: &str) -> Result<()> {
    if caller.is_empty() || caller.len() > 255 || caller.contains('\0') {
        return Err(Error::InvalidSetting {
            setting: "caller",
            expected: "1 to 255 bytes without NUL",
            found: format!("{} bytes", caller.len()),
        });
    }
    Ok(())
}

/// Marks the request's effect committed, inside the transaction of the effect (the
/// debit): from its commit on, the key is never executed again. Fenced: if the
/// request's lease was taken over, this fails with [`Error::Fenced`] and the caller
/// must roll its transaction back.
pub fn commit_request<C>(
    conn: &mut C,
    caller: &str,
    key: &IdempotencyKey,
    token: LeaseToken,
    now: DateTime<Utc>,
) -> Result<()>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    match <C::Conn as IdempotencyOps>::commit(conn, caller, key.as_str(), token.as_bytes(), now)? {
        1 => Ok(()),
        _ => Err(Error::Fenced {
            caller: caller.to_owned(),
            key: key.as_str().to_owned(),
            token,
        }),
    }
}

/// Settles a committed request by a guarded write from in flight: delivered with
/// its saved response, or refunded. Returns whether this write settled it (`false`:
/// settled already, by this or another process, or fenced). Run it in the same
/// transaction as the caller's own settlement (the usage row's), after its writes.
pub fn settle_request<C>(
    conn: &mut C,
    caller: &str,
    key: &IdempotencyKey,
    token: LeaseToken,
    settlement: &Settlement,
    now: DateTime<Utc>,
) -> Result<bool>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    let response = match settlement {
        Settlement::Delivered { response } => Some(response.as_slice()),
        _ => None,
    };
    let status = settlement.status().as_str();
    let touched = <C::Conn as IdempotencyOps>::settle(
        conn,
        caller,
        key.as_str(),
        token.as_bytes(),
        status,
        response,
        now,
    )?;
    Ok(touched == 1)
}

/// Refunds a request that was delivered (an operator's refund, say): a guarded write
/// from delivered to refunded that drops the saved response. Returns whether this
/// write did it. A replay being served meanwhile sees it when it checks the record
/// again after serving, and ends with an error instead of the saved last line.
pub fn refund_delivered_request<C>(
    conn: &mut C,
    caller: &str,
    key: &IdempotencyKey,
    token: LeaseToken,
    now: DateTime<Utc>,
) -> Result<bool>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    Ok(<C::Conn as IdempotencyOps>::refund_delivered(
        conn,
        caller,
        key.as_str(),
        token.as_bytes(),
        now,
    )? == 1)
}

/// Gives the key back when the request ended before its effect committed (it was
/// refused: no credit, a bad request): a retry with the key executes. Fenced by the
/// token; returns whether the record was deleted. A committed record is kept.
pub fn abandon_request<C>(
    conn: &mut C,
    caller: &str,
    key: &IdempotencyKey,
    token: LeaseToken,
) -> Result<bool>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    Ok(<C::Conn as IdempotencyOps>::abandon(conn, caller, key.as_str(), token.as_bytes())? == 1)
}

/// Reads the record of (caller, key).
pub fn read_request<C>(
    conn: &mut C,
    caller: &str,
    key: &IdempotencyKey,
) -> Result<Option<IdempotencyRecord>>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    let conn = conn.as_store_connection();
    <C::Conn as IdempotencyOps>::read(conn, caller, key.as_str())?
        .map(RawRecord::check)
        .transpose()
}

/// Deletes up to `batch` idempotency records that expired `retention` before `now`
/// (the rules of [`purge_expired_requests`]), oldest first, on the caller's
/// connection in a write transaction of its own; returns how many. It is one
/// [`purge_batch`](crate::purge_batch) of [`PurgeTarget::ExpiredIdempotencyKeys`]
/// from the oldest row: on PostgreSQL it deletes nothing (and answers 0) while
/// another purge of the table holds the purge lock.
///
/// Inside a transaction the caller opened: on PostgreSQL it runs as a savepoint and
/// the purge lock is held until the caller's transaction ends (every other purge of
/// the table answers 0 until then); SQLite refuses to nest it (a database error):
/// call [`purge_batch`](crate::purge_batch) there instead. A maintenance job that purges in its own
/// transactions, or a test that holds a purge open, calls this (or `purge_batch`,
/// to resume where a batch stopped); most programs call [`purge_expired_requests`].
pub fn purge_requests<C>(
    conn: &mut C,
    retention: Duration,
    batch: usize,
    now: DateTime<Utc>,
) -> Result<usize>
where
    C: AsStoreConnection + ?Sized,
    C::Conn: IdempotencyConnection,
{
    check_batch(batch)?;
    purge_on(conn.as_store_connection(), retention, batch, now)
}

fn check_batch(batch: usize) -> Result<()> {
    if batch == 0 {
        return Err(Error::InvalidSetting {
            setting: "batch",
            expected: "at least 1 row",
            found: "0".to_owned(),
        });
    }
    Ok(())
}

fn purge_on<C: IdempotencyConnection>(
    conn: &mut C,
    retention: Duration,
    batch: usize,
    now: DateTime<Utc>,
) -> Result<usize> {
    // A retention reaching before year 1 keeps every record.
    let cutoff = inbox_core::earlier_by(now, retention);
    let done = C::write_transaction(conn, |conn| {
        crate::purge_batch(
            conn,
            PurgeTarget::ExpiredIdempotencyKeys,
            cutoff,
            batch,
            None,
        )
    })?;
    Ok(usize::try_from(done.deleted).unwrap_or(usize::MAX))
}

/// Refuses an idempotency table whose unique indexes do not enforce exactly
/// (caller, idempotency_key), or whose lease tokens are not 16 bytes (a table the
/// migration `random_lease_tokens` has not reached).
pub(crate) fn verify_on<C: IdempotencyConnection>(conn: &mut C) -> Result<()> {
    let catalog = C::catalog(conn, "idempotency_keys")?;
    check(&catalog)?;
    let token_type = catalog
        .columns
        .iter()
        .find(|c| c.name == "lease_token")
        .map(|c| c.type_name.clone());
    verify::check_token_type(&catalog.table, token_type, C::LEASE_TOKEN_TYPE)
}

/// The statements of [`IdempotencyOps`], written once and expanded per backend with
/// its SQL (placeholders differ). A macro still: the statements are `sql_query`s with
/// borrowed binds, whose `QueryFragment` impls require diesel's private
/// `DieselReserveSpecialization` of the backend, so a generic function could bound
/// them only by each statement's full type (see `dsl.rs`).
macro_rules! idempotency_ops {
    ($conn:ty, $sql:ident) => {
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Text)]
            caller: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            idempotency_key: String,
            #[diesel(sql_type = diesel::sql_types::Binary)]
            fingerprint: Vec<u8>,
            #[diesel(sql_type = diesel::sql_types::Text)]
            status: String,
            #[diesel(sql_type = diesel::sql_types::Binary)]
            lease_token: Vec<u8>,
            #[diesel(sql_type = crate::schema::sql_types::StoreTime)]
            lease_until: chrono::DateTime<chrono::Utc>,
            #[diesel(sql_type = diesel::sql_types::Nullable<crate::schema::sql_types::StoreTime>)]
            committed_at: Option<chrono::DateTime<chrono::Utc>>,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Binary>)]
            response: Option<Vec<u8>>,
            #[diesel(sql_type = crate::schema::sql_types::StoreTime)]
            created_at: chrono::DateTime<chrono::Utc>,
            #[diesel(sql_type = crate::schema::sql_types::StoreTime)]
            updated_at: chrono::DateTime<chrono::Utc>,
        }

        #[derive(diesel::QueryableByName)]
        struct Token {
            #[diesel(sql_type = diesel::sql_types::Binary)]
            #[allow(dead_code)] // the row's presence is the answer
            lease_token: Vec<u8>,
        }

        impl crate::idempotency::IdempotencyOps for $conn {
            fn begin(
                conn: &mut Self,
                caller: &str,
                key: &str,
                fingerprint: &[u8],
                token: &[u8],
                lease_until: chrono::DateTime<chrono::Utc>,
                now: chrono::DateTime<chrono::Utc>,
            ) -> diesel::QueryResult<bool> {
                use diesel::prelude::*;
                use diesel::sql_types::{Binary, Text};
                let row: Option<Token> = diesel::sql_query($sql::BEGIN)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .bind::<Binary, _>(fingerprint)
                    .bind::<crate::schema::sql_types::StoreTime, _>(crate::schema::Stamp(
                        lease_until,
                    ))
                    .bind::<crate::schema::sql_types::StoreTime, _>(crate::schema::Stamp(now))
                    .bind::<Binary, _>(token)
                    .get_result(conn)
                    .optional()?;
                Ok(row.is_some())
            }

            fn read(
                conn: &mut Self,
                caller: &str,
                key: &str,
            ) -> diesel::QueryResult<Option<crate::idempotency::RawRecord>> {
                use diesel::prelude::*;
                use diesel::sql_types::Text;
                let row: Option<Row> = diesel::sql_query($sql::READ)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .get_result(conn)
                    .optional()?;
                Ok(row.map(|r| crate::idempotency::RawRecord {
                    caller: r.caller,
                    key: r.idempotency_key,
                    fingerprint: r.fingerprint,
                    status: r.status,
                    lease_token: r.lease_token,
                    lease_until: r.lease_until,
                    committed_at: r.committed_at,
                    response: r.response,
                    created_at: r.created_at,
                    updated_at: r.updated_at,
                }))
            }

            fn commit(
                conn: &mut Self,
                caller: &str,
                key: &str,
                token: &[u8],
                now: chrono::DateTime<chrono::Utc>,
            ) -> diesel::QueryResult<usize> {
                use diesel::prelude::*;
                use diesel::sql_types::{Binary, Text};
                diesel::sql_query($sql::COMMIT)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .bind::<Binary, _>(token)
                    .bind::<crate::schema::sql_types::StoreTime, _>(crate::schema::Stamp(now))
                    .execute(conn)
            }

            fn settle(
                conn: &mut Self,
                caller: &str,
                key: &str,
                token: &[u8],
                status: &str,
                response: Option<&[u8]>,
                now: chrono::DateTime<chrono::Utc>,
            ) -> diesel::QueryResult<usize> {
                use diesel::prelude::*;
                use diesel::sql_types::{Binary, Nullable, Text};
                diesel::sql_query($sql::SETTLE)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .bind::<Binary, _>(token)
                    .bind::<Text, _>(status)
                    .bind::<Nullable<Binary>, _>(response)
                    .bind::<crate::schema::sql_types::StoreTime, _>(crate::schema::Stamp(now))
                    .execute(conn)
            }

            fn refund_delivered(
                conn: &mut Self,
                caller: &str,
                key: &str,
                token: &[u8],
                now: chrono::DateTime<chrono::Utc>,
            ) -> diesel::QueryResult<usize> {
                use diesel::prelude::*;
                use diesel::sql_types::{Binary, Text};
                diesel::sql_query($sql::REFUND_DELIVERED)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .bind::<Binary, _>(token)
                    .bind::<crate::schema::sql_types::StoreTime, _>(crate::schema::Stamp(now))
                    .execute(conn)
            }

            fn abandon(
                conn: &mut Self,
                caller: &str,
                key: &str,
                token: &[u8],
            ) -> diesel::QueryResult<usize> {
                use diesel::prelude::*;
                use diesel::sql_types::{Binary, Text};
                diesel::sql_query($sql::ABANDON)
                    .bind::<Text, _>(caller)
                    .bind::<Text, _>(key)
                    .bind::<Binary, _>(token)
                    .execute(conn)
            }

            const LEASE_TOKEN_TYPE: &'static str = $sql::TOKEN_TYPE;
        }
    };
}
pub(crate) use idempotency_ops;
