//! The diesel DSL both backends share, written once and expanded inside each
//! backend's own `impl` (diesel's `ON CONFLICT` does not go through
//! `MultiConnection`, and the two backends' tables are distinct types): the claim
//! statements other than the claim itself, and the outbox statements other than
//! leasing and waking. A backend folder invokes these; what is its own SQL stays in
//! it. Neutral: nothing here names a backend.

/// Ids per statement: SQLite binds every id of an `IN` list as its own parameter.
pub(crate) const ID_CHUNK: usize = 500;

use chrono::{DateTime, Utc};
use diesel::dsl::{sql, AsExprOf};
use diesel::expression::{SqlLiteral, UncheckedBind};
use diesel::sql_types::Bool;

use crate::schema::sql_types::{Stamp, StoreTime};
use crate::statements::ClaimConflict;

/// The claim upserts' conflict target: the claim key's columns (`ClaimKey::COLUMNS`,
/// checked by a test).
pub(crate) fn claim_target() -> (
    crate::schema::inbox_claims::consumer_group,
    crate::schema::inbox_claims::message_key,
) {
    (
        crate::schema::inbox_claims::consumer_group,
        crate::schema::inbox_claims::message_key,
    )
}

/// A claim upsert's conflict condition (see [`claim_conflict`]) as a filter, its due
/// time bound to `now`.
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
                ))
                .execute(conn)
                .map(|_| ())
        }

        fn read_claim(
            conn: &mut Self,
            key: &inbox_core::ClaimKey,
        ) -> diesel::QueryResult<Option<$crate::ClaimRecord>> {
            use $crate::rows::StoredClaim;
            use $crate::schema::inbox_claims::dsl::*;
            inbox_claims
                .find((key.group.as_str(), key.key.as_str()))
                .select(StoredClaim::as_select())
                .first(conn)
                .optional()?
                .map($crate::rows::claim_record)
                .transpose()
        }

        fn read_dead_letters(
            conn: &mut Self,
            group: &inbox_core::ConsumerGroup,
        ) -> diesel::QueryResult<Vec<$crate::DeadLetter>> {
            use $crate::schema::inbox_dead_letters::dsl::*;
            let rows: Vec<$crate::rows::StoredDeadLetter> = inbox_dead_letters
                .filter(consumer_group.eq(group.as_str()))
                .order(id)
                .select($crate::rows::StoredDeadLetter::as_select())
                .load(conn)?;
            rows.into_iter().map($crate::rows::dead_letter).collect()
        }
    };
}
pub(crate) use claim_dsl;

/// The outbox statements of [`OutboxOps`](crate::statements::OutboxOps) that are the
/// same diesel DSL on both backends.
macro_rules! outbox_dsl {
    () => {
        fn insert_outbox(
            conn: &mut Self,
            row: &$crate::rows::NewOutbox<'_>,
        ) -> diesel::QueryResult<Option<i64>> {
            use $crate::schema::outbox_messages::dsl::*;
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
                    created_at.eq($crate::schema::Stamp(row.created_at)),
                    available_at.eq($crate::schema::Stamp(row.available_at)),
                    attempts.eq(0),
                ))
                // The only unique key besides the id is (message_key, replay_seq),
                // and a producer's row has replay_seq 0.
                .on_conflict_do_nothing()
                .returning(id)
                .get_result(conn)
                .optional()
        }

        fn load_outbox(
            conn: &mut Self,
            ids: &[i64],
        ) -> diesel::QueryResult<(Vec<inbox_core::OutboxRow>, Vec<inbox_core::UnreadableRow>)> {
            use diesel::result::Error::DeserializationError;
            use $crate::schema::outbox_messages::dsl::*;
            let mut rows = Vec::with_capacity(ids.len());
            let mut unreadable = Vec::new();
            for chunk in ids.chunks($crate::dsl::ID_CHUNK) {
                let loaded: diesel::QueryResult<Vec<$crate::rows::StoredOutbox>> = outbox_messages
                    .filter(id.eq_any(chunk))
                    .select($crate::rows::StoredOutbox::as_select())
                    .load(conn);
                match loaded {
                    Ok(stored) => {
                        for t in stored {
                            $crate::rows::decode_into(t, &mut rows, &mut unreadable);
                        }
                    }
                    // A value diesel cannot decode (a timestamp another producer
                    // wrote as it liked): find it row by row. Decoding fails on
                    // the client, so the transaction is still usable.
                    Err(DeserializationError(_)) => {
                        for &one in chunk {
                            let single: diesel::QueryResult<Option<$crate::rows::StoredOutbox>> =
                                outbox_messages
                                    .filter(id.eq(one))
                                    .select($crate::rows::StoredOutbox::as_select())
                                    .first(conn)
                                    .optional();
                            match single {
                                Ok(Some(t)) => {
                                    $crate::rows::decode_into(t, &mut rows, &mut unreadable)
                                }
                                Ok(None) => {}
                                Err(DeserializationError(err)) => {
                                    let tries: diesel::QueryResult<i32> = outbox_messages
                                        .filter(id.eq(one))
                                        .select(attempts)
                                        .first(conn);
                                    let tries = match tries {
                                        Ok(n) => n,
                                        Err(DeserializationError(_)) => 0,
                                        Err(other) => return Err(other),
                                    };
                                    unreadable.push(inbox_core::UnreadableRow {
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
            now: chrono::DateTime<chrono::Utc>,
        ) -> diesel::QueryResult<usize> {
            use $crate::schema::outbox_messages::dsl::*;
            let mut marked = 0;
            for chunk in ids.chunks($crate::dsl::ID_CHUNK) {
                // Only rows this relay still leases: a relay whose lease expired
                // and was taken over marks nothing (the new holder publishes).
                marked += diesel::update(
                    outbox_messages
                        .filter(id.eq_any(chunk))
                        .filter(leased_by.eq(relay))
                        .filter(published_at.is_null()),
                )
                .set((
                    published_at.eq($crate::schema::Stamp(now)),
                    leased_until.eq(None::<$crate::schema::Stamp>),
                ))
                .execute(conn)?;
            }
            Ok(marked)
        }

        fn record_outbox_failure(
            conn: &mut Self,
            relay: &str,
            row_id: i64,
            error: &str,
            due: chrono::DateTime<chrono::Utc>,
            dead: Option<chrono::DateTime<chrono::Utc>>,
        ) -> diesel::QueryResult<usize> {
            use $crate::schema::outbox_fates::dsl::*;
            diesel::update(
                outbox_fates
                    .filter(id.eq(row_id))
                    .filter(leased_by.eq(relay))
                    .filter(published_at.is_null()),
            )
            .set((
                attempts.eq(attempts + 1),
                last_error.eq(error),
                available_at.eq($crate::schema::Stamp(due)),
                dead_at.eq(dead.map($crate::schema::Stamp)),
                leased_until.eq(None::<$crate::schema::Stamp>),
                leased_by.eq(None::<&str>),
            ))
            .execute(conn)
        }

        fn first_unpublished_at(
            conn: &mut Self,
        ) -> diesel::QueryResult<Option<chrono::DateTime<chrono::Utc>>> {
            use $crate::schema::outbox_fates::dsl::*;
            outbox_fates
                .filter(published_at.is_null())
                .filter(dead_at.is_null())
                .order(id)
                .select(created_at)
                .first(conn)
                .optional()
        }

        fn dead_outbox(
            conn: &mut Self,
            limit: i64,
        ) -> diesel::QueryResult<Vec<$crate::DeadOutboxRow>> {
            use $crate::schema::outbox_fates::dsl::*;
            let rows: Vec<$crate::rows::StoredDeadOutbox> = outbox_fates
                .filter(dead_at.is_not_null())
                .filter(published_at.is_null())
                .order((dead_at, id))
                .limit(limit)
                .select($crate::rows::StoredDeadOutbox::as_select())
                .load(conn)?;
            Ok(rows.into_iter().map($crate::rows::dead_row).collect())
        }

        fn revive_outbox(
            conn: &mut Self,
            ids: &[i64],
            now: chrono::DateTime<chrono::Utc>,
        ) -> diesel::QueryResult<usize> {
            use $crate::schema::outbox_fates::dsl::*;
            let mut revived = 0;
            for chunk in ids.chunks($crate::dsl::ID_CHUNK) {
                revived += diesel::update(
                    outbox_fates
                        .filter(id.eq_any(chunk))
                        .filter(dead_at.is_not_null())
                        .filter(published_at.is_null()),
                )
                .set((
                    dead_at.eq(None::<$crate::schema::Stamp>),
                    attempts.eq(0),
                    available_at.eq($crate::schema::Stamp(now)),
                ))
                .execute(conn)?;
            }
            Ok(revived)
        }
    };
}
pub(crate) use outbox_dsl;

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
}
