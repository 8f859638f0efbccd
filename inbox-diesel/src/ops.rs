//! The claim store's statements. Each body is written once and expanded for
//! `PgConnection` and `SqliteConnection` (diesel's `ON CONFLICT` does not go through
//! `MultiConnection`); what truly differs per backend lives in `pg.rs` and `sqlite.rs`.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::result::QueryResult;
use inbox_core::{ClaimKey, ConsumerGroup};

use crate::{ClaimRecord, ClaimStatus, DeadLetter};

/// A claim to insert.
pub struct ClaimRow<'a> {
    pub key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub digest: &'a [u8],
    pub payload: &'a [u8],
}

/// What the claim table holds for a key the claim statement did not return.
pub struct Stored {
    pub key: String,
    pub status: String,
    pub digest: Vec<u8>,
    pub next_attempt_at: Option<DateTime<Utc>>,
}

impl Stored {
    /// Whether a delivery with `digest` collides with this claim: another payload
    /// under its key. A claim a rebuild covered has no digest (it counted the event
    /// from the ledger): every delivery of its key is that event.
    pub fn collides(&self, digest: &[u8]) -> bool {
        !self.digest.is_empty() && self.digest != digest
    }
}

/// A failure to record against a claim the batch owns.
pub struct FailureUpdate<'a> {
    pub status: ClaimStatus,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: &'a str,
    pub payload: Option<&'a [u8]>,
    pub now: DateTime<Utc>,
}

/// A dead letter to insert.
pub struct NewDeadLetter<'a> {
    pub group: &'a str,
    pub key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub payload: &'a [u8],
    pub headers: String,
    pub attempts: i32,
    pub reason: &'a str,
    pub last_error: Option<&'a str>,
    pub now: DateTime<Utc>,
}

type ClaimTuple = (
    String,
    String,
    String,
    Option<String>,
    String,
    i32,
    i32,
    Option<DateTime<Utc>>,
    Option<String>,
    bool,
    DateTime<Utc>,
    DateTime<Utc>,
);

type DeadLetterTuple = (
    i64,
    String,
    String,
    String,
    Option<String>,
    Vec<u8>,
    String,
    i32,
    String,
    Option<String>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
);

fn claim_record(t: ClaimTuple) -> QueryResult<ClaimRecord> {
    let status = ClaimStatus::parse(&t.4).ok_or_else(|| {
        diesel::result::Error::DeserializationError(
            format!("unknown claim status {:?}", t.4).into(),
        )
    })?;
    Ok(ClaimRecord {
        group: t.0,
        key: t.1,
        message_type: t.2,
        tenant: t.3,
        status,
        attempts: t.5,
        starts: t.6,
        next_attempt_at: t.7,
        last_error: t.8,
        has_payload: t.9,
        first_seen_at: t.10,
        updated_at: t.11,
    })
}

fn dead_letter(t: DeadLetterTuple) -> DeadLetter {
    DeadLetter {
        id: t.0,
        group: t.1,
        key: t.2,
        message_type: t.3,
        tenant: t.4,
        payload: t.5,
        headers: serde_json::from_str(&t.6).unwrap_or_default(),
        attempts: t.7,
        reason: t.8,
        last_error: t.9,
        dead_lettered_at: t.10,
        replayed_at: t.11,
    }
}

/// The statements every backend runs, on its own connection type.
pub trait ClaimOps: Sized {
    /// Claims rows (sorted by key) in one statement; returns (key, attempts) of the
    /// rows this transaction now owns.
    fn claim(
        conn: &mut Self,
        group: &ConsumerGroup,
        rows: &[ClaimRow<'_>],
        now: DateTime<Utc>,
    ) -> QueryResult<Vec<(String, i32)>>;

    /// Looks up claims by the same claim key the claim statement used.
    fn lookup(conn: &mut Self, group: &ConsumerGroup, keys: &[&str]) -> QueryResult<Vec<Stored>>;

    /// Commits-to-be a `started` mark under the claim's own conflict condition,
    /// adding `increment` (0 or 1) to an existing row's starts; returns the unfinished
    /// starts, or `None` when the row takes no mark.
    fn mark_start(
        conn: &mut Self,
        group: &ConsumerGroup,
        row: &ClaimRow<'_>,
        increment: i32,
        now: DateTime<Utc>,
    ) -> QueryResult<Option<i32>>;

    /// Records a failure (or a terminal state) by the claim key; returns the
    /// `attempts` of every row it touched (exactly one, or the invariant is broken).
    fn record_failure(
        conn: &mut Self,
        key: &ClaimKey,
        update: &FailureUpdate<'_>,
        count_attempt: bool,
    ) -> QueryResult<Vec<i32>>;

    /// Inserts a dead letter.
    fn insert_dead_letter(conn: &mut Self, dl: &NewDeadLetter<'_>) -> QueryResult<()>;

    /// Whether a dead letter with the same group, key, reason and payload exists (a
    /// delivery dead-lettered without a claim, come back again).
    fn has_dead_letter(conn: &mut Self, dl: &NewDeadLetter<'_>) -> QueryResult<bool>;

    /// Marks a claim dead, inserting it if missing, under the claim's own conflict
    /// condition (a done, dead or colliding row is left alone); returns the attempts of
    /// the row it marked, or `None` when it left the row alone.
    fn mark_dead(
        conn: &mut Self,
        group: &ConsumerGroup,
        row: &ClaimRow<'_>,
        last_error: &str,
        now: DateTime<Utc>,
    ) -> QueryResult<Option<i32>>;

    /// Reads one claim.
    fn read_claim(conn: &mut Self, key: &ClaimKey) -> QueryResult<Option<ClaimRecord>>;

    /// Reads a group's dead letters in id order.
    fn read_dead_letters(conn: &mut Self, group: &ConsumerGroup) -> QueryResult<Vec<DeadLetter>>;
}

macro_rules! claim_ops {
    // The claim statement. A row is ours if it is new, or failed/started with the
    // same payload digest and due: digest and due time are part of the conflict
    // condition, so a colliding or not-yet-due row is never taken over.
    (@statement $schema:ident, $values:expr, $now:expr) => {{
        use diesel::query_dsl::methods::FilterDsl;
        use diesel::upsert::excluded;
        use crate::schema::$schema::inbox_claims::dsl::*;
        diesel::insert_into(inbox_claims)
            .values($values)
            .on_conflict((consumer_group, message_key))
            .do_update()
            .set((
                status.eq(ClaimStatus::Done.as_str()),
                payload.eq(None::<Vec<u8>>),
                updated_at.eq($now),
            ))
            .filter(
                status
                    .eq_any([ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()])
                    .and(payload_digest.eq(excluded(payload_digest)))
                    .and(next_attempt_at.is_null().or(next_attempt_at.le($now))),
            )
            .returning((message_key, attempts))
    }};
    (@values $schema:ident, $group:expr, $row:expr, $now:expr) => {{
        use crate::schema::$schema::inbox_claims::dsl::*;
        (
            consumer_group.eq($group.as_str()),
            message_key.eq($row.key),
            message_type.eq($row.message_type),
            tenant.eq($row.tenant),
            payload_digest.eq($row.digest),
            status.eq(ClaimStatus::Done.as_str()),
            attempts.eq(0),
            starts.eq(0),
            first_seen_at.eq($now),
            updated_at.eq($now),
        )
    }};
    // PostgreSQL: one prepared statement over arrays, whatever the batch size (see
    // `pg::claim`).
    (@claim unnest, $schema:ident, $conn:ident, $group:ident, $rows:ident, $now:ident) => {{
        crate::pg::claim($conn, $group, $rows, $now)
    }};
    // The same statement once per row (diesel's SQLite backend has no multi-row upsert).
    (@claim row_by_row, $schema:ident, $conn:ident, $group:ident, $rows:ident, $now:ident) => {{
        let mut owned = Vec::new();
        for r in $rows {
            let values = claim_ops!(@values $schema, $group, r, $now);
            if let Some(row) = claim_ops!(@statement $schema, values, $now)
                .get_result($conn)
                .optional()?
            {
                owned.push(row);
            }
        }
        Ok(owned)
    }};
    ($conn:ty, $schema:ident, $multi:ident) => {
        impl ClaimOps for $conn {
            fn claim(
                conn: &mut Self,
                group: &ConsumerGroup,
                rows: &[ClaimRow<'_>],
                now: DateTime<Utc>,
            ) -> QueryResult<Vec<(String, i32)>> {
                claim_ops!(@claim $multi, $schema, conn, group, rows, now)
            }

            fn lookup(
                conn: &mut Self,
                group: &ConsumerGroup,
                keys: &[&str],
            ) -> QueryResult<Vec<Stored>> {
                use crate::schema::$schema::inbox_claims::dsl::*;
                let rows: Vec<(String, String, Vec<u8>, Option<DateTime<Utc>>)> = inbox_claims
                    .filter(consumer_group.eq(group.as_str()))
                    .filter(message_key.eq_any(keys))
                    .select((message_key, status, payload_digest, next_attempt_at))
                    .load(conn)?;
                Ok(rows
                    .into_iter()
                    .map(|(k, s, d, n)| Stored {
                        key: k,
                        status: s,
                        digest: d,
                        next_attempt_at: n,
                    })
                    .collect())
            }

            fn mark_start(
                conn: &mut Self,
                group: &ConsumerGroup,
                row: &ClaimRow<'_>,
                increment: i32,
                now: DateTime<Utc>,
            ) -> QueryResult<Option<i32>> {
                use diesel::query_dsl::methods::FilterDsl;
                use diesel::upsert::excluded;
                use crate::schema::$schema::inbox_claims::dsl::*;
                diesel::insert_into(inbox_claims)
                    .values((
                        consumer_group.eq(group.as_str()),
                        message_key.eq(row.key),
                        message_type.eq(row.message_type),
                        tenant.eq(row.tenant),
                        payload_digest.eq(row.digest),
                        status.eq(ClaimStatus::Started.as_str()),
                        attempts.eq(0),
                        starts.eq(1),
                        payload.eq(Some(row.payload)),
                        first_seen_at.eq(now),
                        updated_at.eq(now),
                    ))
                    .on_conflict((consumer_group, message_key))
                    .do_update()
                    .set((
                        status.eq(ClaimStatus::Started.as_str()),
                        starts.eq(starts + increment),
                        payload.eq(excluded(payload)),
                        updated_at.eq(now),
                    ))
                    // The claim's own conflict condition: a done, dead, colliding or
                    // not-yet-due row gets no mark and takes its ordinary decision.
                    .filter(
                        status
                            .eq_any([ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()])
                            .and(payload_digest.eq(excluded(payload_digest)))
                            .and(next_attempt_at.is_null().or(next_attempt_at.le(now))),
                    )
                    .returning(starts)
                    .get_result(conn)
                    .optional()
            }

            fn record_failure(
                conn: &mut Self,
                key: &ClaimKey,
                update: &FailureUpdate<'_>,
                count_attempt: bool,
            ) -> QueryResult<Vec<i32>> {
                use crate::schema::$schema::inbox_claims::dsl::*;
                let increment = i32::from(count_attempt);
                diesel::update(inbox_claims.find((key.group.as_str(), key.key.as_str())))
                    .set((
                        status.eq(update.status.as_str()),
                        attempts.eq(attempts + increment),
                        starts.eq(0),
                        next_attempt_at.eq(update.next_attempt_at),
                        last_error.eq(update.last_error),
                        payload.eq(update.payload),
                        updated_at.eq(update.now),
                    ))
                    .returning(attempts)
                    .get_results(conn)
            }

            fn mark_dead(
                conn: &mut Self,
                group: &ConsumerGroup,
                row: &ClaimRow<'_>,
                error: &str,
                now: DateTime<Utc>,
            ) -> QueryResult<Option<i32>> {
                use diesel::query_dsl::methods::FilterDsl;
                use diesel::upsert::excluded;
                use crate::schema::$schema::inbox_claims::dsl::*;
                diesel::insert_into(inbox_claims)
                    .values((
                        consumer_group.eq(group.as_str()),
                        message_key.eq(row.key),
                        message_type.eq(row.message_type),
                        tenant.eq(row.tenant),
                        payload_digest.eq(row.digest),
                        status.eq(ClaimStatus::Dead.as_str()),
                        attempts.eq(0),
                        starts.eq(0),
                        last_error.eq(error),
                        first_seen_at.eq(now),
                        updated_at.eq(now),
                    ))
                    .on_conflict((consumer_group, message_key))
                    .do_update()
                    .set((
                        status.eq(ClaimStatus::Dead.as_str()),
                        payload.eq(None::<Vec<u8>>),
                        last_error.eq(error),
                        updated_at.eq(now),
                    ))
                    .filter(
                        status
                            .eq_any([ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()])
                            .and(payload_digest.eq(excluded(payload_digest))),
                    )
                    .returning(attempts)
                    .get_result::<i32>(conn)
                    .optional()
            }

            fn has_dead_letter(conn: &mut Self, dl: &NewDeadLetter<'_>) -> QueryResult<bool> {
                use crate::schema::$schema::inbox_dead_letters::dsl::*;
                diesel::select(diesel::dsl::exists(
                    inbox_dead_letters
                        .filter(consumer_group.eq(dl.group))
                        .filter(message_key.eq(dl.key))
                        .filter(reason.eq(dl.reason))
                        .filter(payload.eq(dl.payload)),
                ))
                .get_result(conn)
            }

            fn insert_dead_letter(conn: &mut Self, dl: &NewDeadLetter<'_>) -> QueryResult<()> {
                use crate::schema::$schema::inbox_dead_letters::dsl::*;
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
                        dead_lettered_at.eq(dl.now),
                    ))
                    .execute(conn)
                    .map(|_| ())
            }

            fn read_claim(conn: &mut Self, key: &ClaimKey) -> QueryResult<Option<ClaimRecord>> {
                use crate::schema::$schema::inbox_claims::dsl::*;
                inbox_claims
                    .find((key.group.as_str(), key.key.as_str()))
                    .select((
                        consumer_group,
                        message_key,
                        message_type,
                        tenant,
                        status,
                        attempts,
                        starts,
                        next_attempt_at,
                        last_error,
                        payload.is_not_null(),
                        first_seen_at,
                        updated_at,
                    ))
                    .first::<ClaimTuple>(conn)
                    .optional()?
                    .map(claim_record)
                    .transpose()
            }

            fn read_dead_letters(
                conn: &mut Self,
                group: &ConsumerGroup,
            ) -> QueryResult<Vec<DeadLetter>> {
                use crate::schema::$schema::inbox_dead_letters::dsl::*;
                let rows: Vec<DeadLetterTuple> = inbox_dead_letters
                    .filter(consumer_group.eq(group.as_str()))
                    .order(id)
                    .select((
                        id,
                        consumer_group,
                        message_key,
                        message_type,
                        tenant,
                        payload,
                        headers,
                        attempts,
                        reason,
                        last_error,
                        dead_lettered_at,
                        replayed_at,
                    ))
                    .load(conn)?;
                Ok(rows.into_iter().map(dead_letter).collect())
            }
        }
    };
}

claim_ops!(diesel::PgConnection, pg, unnest);
claim_ops!(diesel::SqliteConnection, sqlite, row_by_row);
