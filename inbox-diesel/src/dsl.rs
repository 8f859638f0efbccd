//! The diesel DSL both backends share, on the one table set of `schema`: the claim
//! statements other than the claim itself, and the outbox statements other than
//! leasing and waking. A backend folder invokes these; what is its own SQL stays in
//! it. Neutral: nothing here names a backend.
//!
//! Two forms, by what diesel lets a generic function bound:
//!
//! - plain functions generic over the connection ([`SharedClaimOps`],
//!   [`SharedOutboxOps`]): one impl for every connection type, bounded per statement
//!   on `LoadQuery`/`ExecuteDsl` of the statement's `#[auto_type]` builder, as
//!   diesel's docs advise for generic code. A bound on the backend instead (`C:
//!   Connection<Backend = B>`) does not get far: diesel's `QueryFragment` impls
//!   require its private `DieselReserveSpecialization`, dispatch through
//!   `SqlDialect`, and a row's check is the private `CompatibleType`, so the bound
//!   would have to spell each statement's whole type;
//! - `claim_dsl!`, expanded in each backend's `impl ClaimOps`, for the rest: the
//!   upserts (`mark_start`, `mark_dead`: diesel names no type for `ON CONFLICT ...
//!   DO UPDATE`, so `#[auto_type]` cannot name them) and the statements that bind a
//!   batch's keys or a payload by reference (`lookup`, `record_failure`,
//!   `has_dead_letter`, `insert_dead_letter`): a borrowed statement needs a
//!   higher-ranked `for<'a>` bound, which rustc does not prove for the backends'
//!   connections (E0477), and an owned one would copy the payload on the consumer's
//!   path.

use chrono::{DateTime, Utc};
use diesel::connection::LoadConnection;
use diesel::dsl::{auto_type, insert_into, sql, update, AsExprOf};
use diesel::expression::{SqlLiteral, UncheckedBind};
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::LoadQuery;
use diesel::sql_types::Bool;
use inbox_core::{ClaimKey, ConsumerGroup, OutboxRow, UnreadableRow};

use crate::rows::{
    claim_record, dead_letter, dead_row, decode_into, ClaimRecord, DeadLetter, DeadOutboxRow,
    NewOutbox, StoredClaim, StoredDeadLetter, StoredDeadOutbox, StoredOutbox,
};
use crate::schema::inbox_claims as ic;
use crate::schema::inbox_dead_letters as dl;
use crate::schema::outbox_fates as of;
use crate::schema::outbox_messages as om;
use crate::schema::sql_types::{Stamp, StoreTime};
use crate::statements::{ClaimConflict, SharedClaimOps, SharedOutboxOps};

/// Ids per statement: SQLite binds every id of an `IN` list as its own parameter.
pub(crate) const ID_CHUNK: usize = 500;

/// The claim upserts' conflict target: the claim key's columns (`ClaimKey::COLUMNS`,
/// checked by a test).
pub(crate) fn claim_target() -> (ic::consumer_group, ic::message_key) {
    (ic::consumer_group, ic::message_key)
}

/// A claim upsert's conflict condition (see
/// [`claim_conflict`](crate::statements::claim_conflict)) as a filter, its due time
/// bound to `now`.
pub(crate) fn due_condition(conflict: &ClaimConflict, now: DateTime<Utc>) -> DueCondition {
    sql::<Bool>(&conflict.condition)
        .bind::<StoreTime, _>(Stamp(now))
        .sql(conflict.close)
}

/// The type of [`due_condition`].
pub(crate) type DueCondition =
    SqlLiteral<Bool, UncheckedBind<SqlLiteral<Bool>, AsExprOf<Stamp, StoreTime>>>;

/// The claim statements of [`ClaimOps`](crate::statements::ClaimOps) that are the
/// same diesel DSL on both backends.
macro_rules! claim_dsl {
    () => {
        fn lookup(
            conn: &mut Self,
            group: &inbox_core::ConsumerGroup,
            keys: &[&str],
        ) -> diesel::QueryResult<Vec<$crate::rows::Stored>> {
            use $crate::schema::inbox_claims::dsl::*;
            let rows: Vec<(
                String,
                String,
                Vec<u8>,
                Option<chrono::DateTime<chrono::Utc>>,
            )> = inbox_claims
                .filter(consumer_group.eq(group.as_str()))
                .filter(message_key.eq_any(keys))
                .select((message_key, status, payload_digest, next_attempt_at))
                .load(conn)?;
            Ok(rows
                .into_iter()
                .map(|(k, s, d, n)| $crate::rows::Stored {
                    key: k,
                    status: s,
                    digest: d,
                    next_attempt_at: n,
                })
                .collect())
        }

        fn mark_start(
            conn: &mut Self,
            group: &inbox_core::ConsumerGroup,
            row: &$crate::rows::ClaimRow<'_>,
            increment: i32,
            now: chrono::DateTime<chrono::Utc>,
        ) -> diesel::QueryResult<Option<i32>> {
            use diesel::query_dsl::methods::FilterDsl;
            use diesel::upsert::excluded;
            use $crate::schema::inbox_claims::dsl::*;
            let conflict = $crate::statements::claim_conflict(true);
            diesel::insert_into(inbox_claims)
                .values((
                    consumer_group.eq(group.as_str()),
                    message_key.eq(row.key),
                    message_type.eq(row.message_type),
                    tenant.eq(row.tenant),
                    payload_digest.eq(row.digest),
                    status.eq($crate::ClaimStatus::Started.as_str()),
                    attempts.eq(0),
                    starts.eq(1),
                    payload.eq(Some(row.payload)),
                    first_seen_at.eq($crate::schema::Stamp(now)),
                    updated_at.eq($crate::schema::Stamp(now)),
                ))
                .on_conflict($crate::dsl::claim_target())
                .do_update()
                .set((
                    status.eq($crate::ClaimStatus::Started.as_str()),
                    starts.eq(starts + increment),
                    payload.eq(excluded(payload)),
                    updated_at.eq($crate::schema::Stamp(now)),
                ))
                // The claim's own conflict condition: a done, dead, colliding or
                // not-yet-due row gets no mark and takes its ordinary decision.
                .filter($crate::dsl::due_condition(&conflict, now))
                .returning(starts)
                .get_result(conn)
                .optional()
        }

        fn record_failure(
            conn: &mut Self,
            key: &inbox_core::ClaimKey,
            update: &$crate::rows::FailureUpdate<'_>,
            count_attempt: bool,
        ) -> diesel::QueryResult<Vec<i32>> {
            use $crate::schema::inbox_claims::dsl::*;
            let increment = i32::from(count_attempt);
            diesel::update(inbox_claims.find((key.group.as_str(), key.key.as_str())))
                .set((
                    status.eq(update.status.as_str()),
                    attempts.eq(attempts + increment),
                    starts.eq(0),
                    next_attempt_at.eq(update.next_attempt_at.map($crate::schema::Stamp)),
                    last_error.eq(update.last_error),
                    payload.eq(update.payload),
                    updated_at.eq($crate::schema::Stamp(update.now)),
                ))
                .returning(attempts)
                .get_results(conn)
        }

        fn mark_dead(
            conn: &mut Self,
            group: &inbox_core::ConsumerGroup,
            row: &$crate::rows::ClaimRow<'_>,
            error: &str,
            now: chrono::DateTime<chrono::Utc>,
        ) -> diesel::QueryResult<Option<i32>> {
            use diesel::query_dsl::methods::FilterDsl;
            use $crate::schema::inbox_claims::dsl::*;
            let conflict = $crate::statements::claim_conflict(false);
            diesel::insert_into(inbox_claims)
                .values((
                    consumer_group.eq(group.as_str()),
                    message_key.eq(row.key),
                    message_type.eq(row.message_type),
                    tenant.eq(row.tenant),
                    payload_digest.eq(row.digest),
                    status.eq($crate::ClaimStatus::Dead.as_str()),
                    attempts.eq(0),
                    starts.eq(0),
                    last_error.eq(error),
                    first_seen_at.eq($crate::schema::Stamp(now)),
                    updated_at.eq($crate::schema::Stamp(now)),
                ))
                .on_conflict($crate::dsl::claim_target())
                .do_update()
                .set((
                    status.eq($crate::ClaimStatus::Dead.as_str()),
                    payload.eq(None::<Vec<u8>>),
                    last_error.eq(error),
                    updated_at.eq($crate::schema::Stamp(now)),
                ))
                // Not the due time: a broker that gave up does not wait for it.
                .filter(diesel::dsl::sql::<diesel::sql_types::Bool>(
                    &conflict.condition,
                ))
                .returning(attempts)
                .get_result::<i32>(conn)
                .optional()
        }

        fn has_dead_letter(
            conn: &mut Self,
            dl: &$crate::rows::NewDeadLetter<'_>,
        ) -> diesel::QueryResult<bool> {
            use $crate::schema::inbox_dead_letters::dsl::*;
            diesel::select(diesel::dsl::exists(
                inbox_dead_letters
                    .filter(consumer_group.eq(dl.group))
                    .filter(message_key.eq(dl.key))
                    .filter(reason.eq(dl.reason))
                    .filter(payload.eq(dl.payload)),
            ))
            .get_result(conn)
        }

        fn insert_dead_letter(
            conn: &mut Self,
            dl: &$crate::rows::NewDeadLetter<'_>,
        ) -> diesel::QueryResult<()> {
            use $crate::schema::inbox_dead_letters::dsl::*;
            // Every letter carries its failure group from the start: the operator's
            // filter and grouping read the column, never the masking.
            let fingerprint =
                $crate::fingerprint::signature(dl.reason, dl.message_type, dl.last_error)
                    .fingerprint;
            diesel::insert_into(inbox_dead_letters)
                .values((
                    consumer_group.eq(dl.group),
                    message_key.eq(dl.key),
                    message_type.eq(dl.message_type),
                    tenant.eq(dl.tenant),
                    payload.eq(dl.payload),
                    headers.eq(&dl.headers),
                    attempts.eq(dl.attempts),
                    reason.eq(dl.reason),
                    last_error.eq(dl.last_error),
                    dead_lettered_at.eq($crate::schema::Stamp(dl.now)),
                    payload_length.eq(dl.payload_length),
                    payload_sha256.eq(dl.payload_sha256),
                    failure_group.eq(Some(fingerprint)),
                ))
                .execute(conn)
                .map(|_| ())
        }
    };
}
pub(crate) use claim_dsl;

/// The claim reads of [`SharedClaimOps`], as the outbox statements below are
/// written.
impl<C> SharedClaimOps for C
where
    C: Connection + LoadConnection,
    claim_by_key: LoadQuery<'static, C, StoredClaim>,
    dead_letters_of: LoadQuery<'static, C, StoredDeadLetter>,
{
    fn read_claim(conn: &mut C, key: &ClaimKey) -> QueryResult<Option<ClaimRecord>> {
        claim_by_key(key.group.to_string(), key.key.to_string())
            .get_result(conn)
            .optional()?
            .map(claim_record)
            .transpose()
    }

    fn read_dead_letters(conn: &mut C, group: &ConsumerGroup) -> QueryResult<Vec<DeadLetter>> {
        dead_letters_of(group.to_string())
            .load(conn)?
            .into_iter()
            .map(dead_letter)
            .collect()
    }
}

/// The outbox statements of [`SharedOutboxOps`] as plain functions, for every
/// connection type that runs each statement, as diesel advises for generic code: a
/// where clause per statement on [`LoadQuery`] or [`ExecuteDsl`], the statement's
/// type named by `#[auto_type]` (the builders below). Both backends run all of them,
/// so both implement the trait through this one impl. The builders take owned
/// values (an id chunk, the relay's name): a statement type without a lifetime
/// keeps each bound a plain one (with a borrowed chunk, the bound would be a
/// higher-ranked `for<'a>` one, which rustc does not prove for the backends'
/// connections: E0477), for an allocation beside a round trip.
impl<C> SharedOutboxOps for C
where
    C: Connection + LoadConnection,
    outbox_rows: LoadQuery<'static, C, StoredOutbox>,
    outbox_row: LoadQuery<'static, C, StoredOutbox>,
    outbox_attempts: LoadQuery<'static, C, i32>,
    mark_published: ExecuteDsl<C>,
    record_failure: ExecuteDsl<C>,
    first_unpublished: LoadQuery<'static, C, DateTime<Utc>>,
    dead_rows: LoadQuery<'static, C, StoredDeadOutbox>,
    revive: ExecuteDsl<C>,
{
    fn load_outbox(conn: &mut C, ids: &[i64]) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)> {
        use diesel::result::Error::DeserializationError;
        let mut rows = Vec::with_capacity(ids.len());
        let mut unreadable = Vec::new();
        for chunk in ids.chunks(ID_CHUNK) {
            match outbox_rows(chunk.to_vec()).load(conn) {
                Ok(stored) => {
                    for t in stored {
                        decode_into(t, &mut rows, &mut unreadable);
                    }
                }
                // A value diesel cannot decode (a timestamp another producer wrote as
                // it liked): find it row by row. Decoding fails on the client, so the
                // transaction is still usable.
                Err(DeserializationError(_)) => {
                    for &one in chunk {
                        match outbox_row(one).get_result(conn).optional() {
                            Ok(Some(t)) => decode_into(t, &mut rows, &mut unreadable),
                            Ok(None) => {}
                            Err(DeserializationError(err)) => {
                                let tries = match outbox_attempts(one).get_result(conn) {
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
        conn: &mut C,
        relay: &str,
        ids: &[i64],
        now: DateTime<Utc>,
    ) -> QueryResult<usize> {
        let mut marked = 0;
        for chunk in ids.chunks(ID_CHUNK) {
            marked += mark_published(relay.to_owned(), chunk.to_vec(), Stamp(now)).execute(conn)?;
        }
        Ok(marked)
    }

    fn record_outbox_failure(
        conn: &mut C,
        relay: &str,
        row_id: i64,
        error: &str,
        due: DateTime<Utc>,
        dead: Option<DateTime<Utc>>,
    ) -> QueryResult<usize> {
        record_failure(
            relay.to_owned(),
            row_id,
            error.to_owned(),
            Stamp(due),
            dead.map(Stamp),
        )
        .execute(conn)
    }

    fn first_unpublished_at(conn: &mut C) -> QueryResult<Option<DateTime<Utc>>> {
        first_unpublished().get_result(conn).optional()
    }

    fn dead_outbox(conn: &mut C, limit: i64) -> QueryResult<Vec<DeadOutboxRow>> {
        Ok(dead_rows(limit)
            .load(conn)?
            .into_iter()
            .map(dead_row)
            .collect())
    }

    fn revive_outbox(conn: &mut C, ids: &[i64], now: DateTime<Utc>) -> QueryResult<usize> {
        let mut revived = 0;
        for chunk in ids.chunks(ID_CHUNK) {
            revived += revive(chunk.to_vec(), Stamp(now)).execute(conn)?;
        }
        Ok(revived)
    }
}

/// A producer's row, as an insert: each backend adds its own `ON CONFLICT DO
/// NOTHING` (diesel names no type for an upsert, so the statement cannot be bounded
/// as the others are). The only unique key besides the id is (message_key,
/// replay_seq), and a producer's row has replay_seq 0.
#[auto_type]
pub(crate) fn new_outbox_row<'a>(row: &'a NewOutbox<'a>) -> _ {
    let created: Stamp = Stamp(row.created_at);
    let available: Stamp = Stamp(row.available_at);
    let key: &'a str = row.key;
    let exchange: &'a str = row.exchange;
    let routing_key: &'a str = row.routing_key;
    let message_type: &'a str = row.message_type;
    let tenant: Option<&'a str> = row.tenant;
    let payload: &'a [u8] = row.payload;
    let headers: &'a String = &row.headers;
    let ordering_key: Option<&'a str> = row.ordering_key;
    let no_attempts: i32 = 0;
    insert_into(om::table).values((
        om::message_key.eq(key),
        om::exchange.eq(exchange),
        om::routing_key.eq(routing_key),
        om::message_type.eq(message_type),
        om::tenant.eq(tenant),
        om::payload.eq(payload),
        om::headers.eq(headers),
        om::ordering_key.eq(ordering_key),
        om::created_at.eq(created),
        om::available_at.eq(available),
        om::attempts.eq(no_attempts),
    ))
}

/// The columns of a [`StoredClaim`], in its fields' order (checked against its
/// `Selectable` by a test).
#[auto_type]
pub(crate) fn claim_columns() -> _ {
    (
        ic::consumer_group,
        ic::message_key,
        ic::message_type,
        ic::tenant,
        ic::status,
        ic::attempts,
        ic::starts,
        ic::next_attempt_at,
        ic::last_error,
        ic::payload.is_not_null(),
        ic::first_seen_at,
        ic::updated_at,
    )
}

/// The columns of a [`StoredDeadLetter`], in its fields' order.
#[auto_type]
fn dead_letter_columns() -> _ {
    (
        dl::id,
        dl::consumer_group,
        dl::message_key,
        dl::message_type,
        dl::tenant,
        dl::payload,
        dl::headers,
        dl::attempts,
        dl::reason,
        dl::last_error,
        dl::dead_lettered_at,
        dl::replayed_at,
        dl::payload_length,
        dl::payload_sha256,
    )
}

/// The columns of a [`StoredDeadOutbox`], in its fields' order.
#[auto_type]
fn dead_outbox_columns() -> _ {
    (
        of::id,
        of::message_key,
        of::exchange,
        of::routing_key,
        of::message_type,
        of::ordering_key,
        of::attempts,
        of::last_error,
        of::dead_at,
    )
}

#[auto_type]
fn claim_by_key(group: String, key: String) -> _ {
    let columns: claim_columns = claim_columns();
    ic::table.find((group, key)).select(columns).limit(1_i64)
}

#[auto_type]
fn dead_letters_of(group: String) -> _ {
    let columns: dead_letter_columns = dead_letter_columns();
    dl::table
        .filter(dl::consumer_group.eq(group))
        .order(dl::id)
        .select(columns)
}

/// The columns of a [`StoredOutbox`], in its fields' order.
#[auto_type]
fn outbox_columns() -> _ {
    (
        om::id,
        om::message_key,
        om::exchange,
        om::routing_key,
        om::message_type,
        om::tenant,
        om::payload,
        om::headers,
        om::ordering_key,
        om::created_at,
        om::attempts,
    )
}

#[auto_type]
fn outbox_rows(ids: Vec<i64>) -> _ {
    let columns: outbox_columns = outbox_columns();
    om::table.filter(om::id.eq_any(ids)).select(columns)
}

#[auto_type]
fn outbox_row(one: i64) -> _ {
    let columns: outbox_columns = outbox_columns();
    om::table
        .filter(om::id.eq(one))
        .select(columns)
        .limit(1_i64)
}

#[auto_type]
fn outbox_attempts(one: i64) -> _ {
    om::table
        .filter(om::id.eq(one))
        .select(om::attempts)
        .limit(1_i64)
}

/// Only rows this relay still leases: a relay whose lease expired and was taken over
/// marks nothing (the new holder publishes).
#[auto_type]
fn mark_published(relay: String, ids: Vec<i64>, now: Stamp) -> _ {
    let no_lease: Option<Stamp> = None;
    update(
        om::table
            .filter(om::id.eq_any(ids))
            .filter(om::leased_by.eq(relay))
            .filter(om::published_at.is_null()),
    )
    .set((om::published_at.eq(now), om::leased_until.eq(no_lease)))
}

#[auto_type]
fn record_failure(relay: String, row_id: i64, error: String, due: Stamp, dead: Option<Stamp>) -> _ {
    let no_lease: Option<Stamp> = None;
    let no_holder: Option<String> = None;
    let one: i32 = 1;
    update(
        of::table
            .filter(of::id.eq(row_id))
            .filter(of::leased_by.eq(relay))
            .filter(of::published_at.is_null()),
    )
    .set((
        of::attempts.eq(of::attempts + one),
        of::last_error.eq(error),
        of::available_at.eq(due),
        of::dead_at.eq(dead),
        of::leased_until.eq(no_lease),
        of::leased_by.eq(no_holder),
    ))
}

#[auto_type]
fn first_unpublished() -> _ {
    of::table
        .filter(of::published_at.is_null())
        .filter(of::dead_at.is_null())
        .order(of::id)
        .select(of::created_at)
        .limit(1_i64)
}

#[auto_type]
fn dead_rows(limit: i64) -> _ {
    let columns: dead_outbox_columns = dead_outbox_columns();
    of::table
        .filter(of::dead_at.is_not_null())
        .filter(of::published_at.is_null())
        .order((of::dead_at, of::id))
        .limit(limit)
        .select(columns)
}

#[auto_type]
fn revive(ids: Vec<i64>, now: Stamp) -> _ {
    let alive: Option<Stamp> = None;
    let no_attempts: i32 = 0;
    update(
        of::table
            .filter(of::id.eq_any(ids))
            .filter(of::dead_at.is_not_null())
            .filter(of::published_at.is_null()),
    )
    .set((
        of::dead_at.eq(alive),
        of::attempts.eq(no_attempts),
        of::available_at.eq(now),
    ))
}

#[cfg(test)]
mod tests {
    use diesel::Column;
    use inbox_core::ClaimKey;

    fn names<A: Column, B: Column>(_: (A, B)) -> [&'static str; 2] {
        [A::NAME, B::NAME]
    }

    #[test]
    fn the_conflict_target_is_the_claim_key() {
        assert_eq!(names(super::claim_target()), ClaimKey::COLUMNS);
    }

    /// The rows are `Queryable`, read by position: each statement's column list
    /// selects what the row's `Selectable` (its fields, by name) would, in order.
    #[cfg(feature = "sqlite")]
    #[test]
    fn the_column_lists_are_the_rows_fields_in_order() {
        use super::*;
        use diesel::debug_query;
        use diesel::sqlite::Sqlite;

        fn same<A, B>(by_fields: A, by_list: B)
        where
            A: diesel::query_builder::QueryFragment<Sqlite>,
            B: diesel::query_builder::QueryFragment<Sqlite>,
        {
            assert_eq!(
                debug_query::<Sqlite, _>(&by_fields).to_string(),
                debug_query::<Sqlite, _>(&by_list).to_string()
            );
        }
        same(
            ic::table.select(StoredClaim::as_select()),
            ic::table.select(claim_columns()),
        );
        same(
            dl::table.select(StoredDeadLetter::as_select()),
            dl::table.select(dead_letter_columns()),
        );
        same(
            om::table.select(StoredOutbox::as_select()),
            om::table.select(outbox_columns()),
        );
        same(
            of::table.select(StoredDeadOutbox::as_select()),
            of::table.select(dead_outbox_columns()),
        );
    }
}
