//! The operator statements both backends run as the same diesel DSL, as plain
//! functions generic over the connection: one impl for every connection type that
//! runs each statement, bounded per statement on [`LoadQuery`] or [`ExecuteDsl`] of
//! its `#[auto_type]` builder, as diesel advises for generic code. The builders take
//! owned values (a group's name, a key, a replayed payload): a statement type
//! without a lifetime keeps each bound a plain one (a borrowed one needs a
//! higher-ranked `for<'a>` bound, which rustc does not prove for the backends'
//! connections: E0477); the operator's statements are not on the consumer's path,
//! so the copies cost nothing that matters.
//!
//! The rest of the operator's statements stay in `ops.rs`'s macro, expanded by each
//! backend: the filters' boxed queries (`op_entries`, `op_redrivable`: each filter
//! is added or not at run time, and a boxed query's filters would each need a
//! `BoxableExpression` bound on the backend) and the upserts (`op_next_sequence`,
//! `op_record_canary`: diesel names no type for an `ON CONFLICT`, so
//! `#[auto_type]` cannot name them and nothing can bound them).

use chrono::{DateTime, Utc};
use diesel::connection::LoadConnection;
use diesel::dsl::{auto_type, count_star, exists, insert_into, select, update};
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::LoadQuery;

use super::records::{
    CanaryRow, EntryRow, FailureSpan, Letter, NewReplay, RawOverview, RawStats, StoredPayload,
};
use crate::dsl::claim_columns;
use crate::operator::tables::{
    inbox_canary as cn, op_dead_letters as dl, op_letter_payloads as lp, op_outbox as ob,
};
use crate::rows::{claim_record, StoredClaim};
use crate::schema::inbox_claims as ic;
use crate::schema::Stamp;
use crate::{ClaimRecord, ClaimStatus};

/// A letter as [`Letter`] is built from.
type LetterRow = (
    i64,
    String,
    String,
    String,
    Option<String>,
    Vec<u8>,
    String,
    String,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

/// The operator statements that are the same diesel DSL on both backends.
pub trait SharedOperatorOps: Sized {
    /// One dead letter with its payload.
    #[doc(hidden)]
    fn op_letter(conn: &mut Self, id: i64) -> QueryResult<Option<Letter>>;

    /// One dead letter, and its payload (with a cut payload's length and SHA-256).
    #[doc(hidden)]
    fn op_entry(conn: &mut Self, id: i64) -> QueryResult<Option<(EntryRow, StoredPayload)>>;

    /// Whether a letter of (group, key) older than `before` (by id) was replayed.
    #[doc(hidden)]
    fn op_replayed_before(
        conn: &mut Self,
        group: &str,
        key: &str,
        before: i64,
    ) -> QueryResult<bool>;

    /// The first and last time a (group, key) was dead-lettered.
    #[doc(hidden)]
    fn op_failure_span(conn: &mut Self, group: &str, key: &str) -> QueryResult<FailureSpan>;

    /// A claim's status and digest.
    #[doc(hidden)]
    fn op_claim_state(
        conn: &mut Self,
        group: &str,
        key: &str,
    ) -> QueryResult<Option<(String, Vec<u8>)>>;

    /// Counts a replay against a dead letter, only if it is neither discarded, nor
    /// replayed, nor resolved by a rebuild; returns rows touched (the guard).
    #[doc(hidden)]
    fn op_mark_replayed(conn: &mut Self, id: i64, now: DateTime<Utc>) -> QueryResult<usize>;

    /// Discards a dead letter not discarded yet; returns rows touched.
    #[doc(hidden)]
    fn op_discard(conn: &mut Self, id: i64, now: DateTime<Utc>) -> QueryResult<usize>;

    /// Every claim of a message key, by group.
    #[doc(hidden)]
    fn op_claims_by_key(conn: &mut Self, key: &str) -> QueryResult<Vec<ClaimRecord>>;

    /// Marks a redriven claim (guarded by its `updated_at` as read): rows touched.
    #[doc(hidden)]
    fn op_touch_redriven(
        conn: &mut Self,
        group: &str,
        key: &str,
        read_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// A run's arrivals: (seq, sent_at, arrived_at, arrivals).
    #[doc(hidden)]
    fn op_canary_arrivals(conn: &mut Self, run: &str) -> QueryResult<Vec<CanaryRow>>;

    /// The guarded reset of a dead claim: only a `dead` claim of this payload digest
    /// becomes a due `failed` one with no attempts or starts; returns rows touched.
    #[doc(hidden)]
    fn op_reset_dead_claim(
        conn: &mut Self,
        group: &str,
        key: &str,
        digest: &[u8],
        payload: &[u8],
        now: DateTime<Utc>,
    ) -> QueryResult<usize>;

    /// Inserts a replay row; returns its id.
    #[doc(hidden)]
    fn op_insert_replay(conn: &mut Self, row: &NewReplay<'_>) -> QueryResult<i64>;

    /// The figures of `stats`.
    #[doc(hidden)]
    fn op_stats(conn: &mut Self, now: DateTime<Utc>) -> QueryResult<RawStats>;

    /// The overview's figures: each read by an index (no scan of every claim).
    #[doc(hidden)]
    fn op_overview(conn: &mut Self, now: DateTime<Utc>) -> QueryResult<RawOverview>;
}

impl<C> SharedOperatorOps for C
where
    C: Connection + LoadConnection,
    letter: LoadQuery<'static, C, LetterRow>,
    entry: LoadQuery<'static, C, EntryRow>,
    payload_of: LoadQuery<'static, C, StoredPayload>,
    replayed_before: LoadQuery<'static, C, bool>,
    first_failure: LoadQuery<'static, C, DateTime<Utc>>,
    last_failure: LoadQuery<'static, C, DateTime<Utc>>,
    claim_state: LoadQuery<'static, C, (String, Vec<u8>)>,
    mark_replayed: ExecuteDsl<C>,
    discard: ExecuteDsl<C>,
    claims_by_key: LoadQuery<'static, C, StoredClaim>,
    touch_redriven: ExecuteDsl<C>,
    canary_arrivals: LoadQuery<'static, C, CanaryRow>,
    reset_dead_claim: ExecuteDsl<C>,
    replay_row: LoadQuery<'static, C, i64>,
    claim_counts: LoadQuery<'static, C, (String, String, i64)>,
    failed_counts: LoadQuery<'static, C, (String, i64)>,
    due_counts: LoadQuery<'static, C, (String, i64)>,
    oldest_retry: LoadQuery<'static, C, Option<DateTime<Utc>>>,
    oldest_unfinished: LoadQuery<'static, C, DateTime<Utc>>,
    letter_counts: LoadQuery<'static, C, (String, String, i64)>,
    outbox_backlog: LoadQuery<'static, C, i64>,
    oldest_unpublished: LoadQuery<'static, C, DateTime<Utc>>,
    dead_outbox_rows: LoadQuery<'static, C, i64>,
{
    fn op_letter(conn: &mut C, id: i64) -> QueryResult<Option<Letter>> {
        let row = letter(id).get_result(conn).optional()?;
        row.map(|r| {
            Ok(Letter {
                reason: crate::rows::stored_reason(format_args!("dead letter {}", r.0), &r.7)?,
                id: r.0,
                group: r.1,
                key: r.2,
                message_type: r.3,
                tenant: r.4,
                payload: r.5,
                headers: r.6,
                discarded: r.8.is_some(),
                resolved: r.9.is_some(),
            })
        })
        .transpose()
    }

    fn op_entry(conn: &mut C, id: i64) -> QueryResult<Option<(EntryRow, StoredPayload)>> {
        let Some(found) = entry(id).get_result(conn).optional()? else {
            return Ok(None);
        };
        Ok(Some((found, payload_of(id).get_result(conn)?)))
    }

    fn op_replayed_before(conn: &mut C, group: &str, key: &str, before: i64) -> QueryResult<bool> {
        replayed_before(group.to_owned(), key.to_owned(), before).get_result(conn)
    }

    fn op_failure_span(conn: &mut C, group: &str, key: &str) -> QueryResult<FailureSpan> {
        // No MIN/MAX: diesel has no ordering aggregates for SQLite's timestamps.
        let first = first_failure(group.to_owned(), key.to_owned())
            .get_result(conn)
            .optional()?;
        let last = last_failure(group.to_owned(), key.to_owned())
            .get_result(conn)
            .optional()?;
        Ok((first, last))
    }

    fn op_claim_state(
        conn: &mut C,
        group: &str,
        key: &str,
    ) -> QueryResult<Option<(String, Vec<u8>)>> {
        claim_state(group.to_owned(), key.to_owned())
            .get_result(conn)
            .optional()
    }

    fn op_mark_replayed(conn: &mut C, id: i64, now: DateTime<Utc>) -> QueryResult<usize> {
        mark_replayed(id, Stamp(now)).execute(conn)
    }

    fn op_discard(conn: &mut C, id: i64, now: DateTime<Utc>) -> QueryResult<usize> {
        discard(id, Stamp(now)).execute(conn)
    }

    fn op_claims_by_key(conn: &mut C, key: &str) -> QueryResult<Vec<ClaimRecord>> {
        claims_by_key(key.to_owned())
            .load(conn)?
            .into_iter()
            .map(claim_record)
            .collect()
    }

    fn op_touch_redriven(
        conn: &mut C,
        group: &str,
        key: &str,
        read_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> QueryResult<usize> {
        touch_redriven(group.to_owned(), key.to_owned(), Stamp(read_at), Stamp(now)).execute(conn)
    }

    fn op_canary_arrivals(conn: &mut C, run: &str) -> QueryResult<Vec<CanaryRow>> {
        canary_arrivals(run.to_owned()).load(conn)
    }

    fn op_reset_dead_claim(
        conn: &mut C,
        group: &str,
        key: &str,
        digest: &[u8],
        payload: &[u8],
        now: DateTime<Utc>,
    ) -> QueryResult<usize> {
        reset_dead_claim(
            (group.to_owned(), key.to_owned()),
            digest.to_vec(),
            payload.to_vec(),
            Stamp(now),
        )
        .execute(conn)
    }

    fn op_insert_replay(conn: &mut C, row: &NewReplay<'_>) -> QueryResult<i64> {
        replay_row(ReplayValues {
            key: row.key.to_owned(),
            routing_key: row.routing_key.to_owned(),
            message_type: row.message_type.to_owned(),
            tenant: row.tenant.map(str::to_owned),
            payload: row.payload.to_vec(),
            headers: row.headers.to_owned(),
            sequence: row.sequence,
            now: Stamp(row.now),
        })
        .get_result(conn)
    }

    fn op_stats(conn: &mut C, now: DateTime<Utc>) -> QueryResult<RawStats> {
        let mut stats = RawStats {
            claims: claim_counts().load(conn)?,
            due: due_counts(Stamp(now)).load(conn)?,
            ..RawStats::default()
        };
        let failing: Vec<String> = stats
            .claims
            .iter()
            .filter(|(_, s, _)| s == ClaimStatus::Failed.as_str())
            .map(|(g, _, _)| g.clone())
            .collect();
        for group in failing {
            // Per group, by the failed-claims index (no MIN on SQLite's timestamps
            // in diesel).
            let oldest: Option<Option<DateTime<Utc>>> =
                oldest_retry(group.clone()).get_result(conn).optional()?;
            stats.oldest_retry.push((group, oldest.flatten()));
        }
        let unfinished: Vec<String> = stats
            .claims
            .iter()
            .filter(|(_, s, _)| {
                s == ClaimStatus::Failed.as_str() || s == ClaimStatus::Started.as_str()
            })
            .map(|(g, _, _)| g.clone())
            .collect();
        for group in unfinished {
            let oldest = oldest_unfinished(group.clone())
                .get_result(conn)
                .optional()?;
            if !stats.oldest_unprocessed.iter().any(|(g, _)| *g == group) {
                stats.oldest_unprocessed.push((group, oldest));
            }
        }
        stats.letters = letter_counts().load(conn)?;
        stats.backlog = outbox_backlog().get_result(conn)?;
        stats.oldest_unpublished = oldest_unpublished().get_result(conn).optional()?;
        stats.dead_outbox = dead_outbox_rows().get_result(conn)?;
        Ok(stats)
    }

    fn op_overview(conn: &mut C, now: DateTime<Utc>) -> QueryResult<RawOverview> {
        Ok(RawOverview {
            failed: failed_counts().load(conn)?,
            due: due_counts(Stamp(now)).load(conn)?,
            backlog: outbox_backlog().get_result(conn)?,
            oldest_unpublished: oldest_unpublished().get_result(conn).optional()?,
            dead_outbox: dead_outbox_rows().get_result(conn)?,
        })
    }
}

#[auto_type]
fn letter(id: i64) -> _ {
    dl::table
        .find(id)
        .select((
            dl::id,
            dl::consumer_group,
            dl::message_key,
            dl::message_type,
            dl::tenant,
            dl::payload,
            dl::headers,
            dl::reason,
            dl::discarded_at,
            dl::resolved_at,
        ))
        .limit(1_i64)
}

#[auto_type]
fn entry(id: i64) -> _ {
    dl::table
        .find(id)
        .select((
            dl::id,
            dl::consumer_group,
            dl::message_key,
            dl::message_type,
            dl::tenant,
            dl::headers,
            dl::attempts,
            dl::reason,
            dl::last_error,
            dl::dead_lettered_at,
            dl::replayed_at,
            dl::replay_count,
            dl::discarded_at,
            dl::resolved_at,
            dl::failure_group,
        ))
        .limit(1_i64)
}

#[auto_type]
fn payload_of(id: i64) -> _ {
    lp::table
        .find(id)
        .select((lp::payload, lp::payload_length, lp::payload_sha256))
        .limit(1_i64)
}

#[auto_type]
fn replayed_before(group: String, key: String, before: i64) -> _ {
    select(exists(
        dl::table
            .filter(dl::consumer_group.eq(group))
            .filter(dl::message_key.eq(key))
            .filter(dl::id.lt(before))
            .filter(dl::replayed_at.is_not_null()),
    ))
}

#[auto_type]
fn first_failure(group: String, key: String) -> _ {
    dl::table
        .filter(dl::consumer_group.eq(group))
        .filter(dl::message_key.eq(key))
        .order(dl::dead_lettered_at)
        .select(dl::dead_lettered_at)
        .limit(1_i64)
}

#[auto_type]
fn last_failure(group: String, key: String) -> _ {
    dl::table
        .filter(dl::consumer_group.eq(group))
        .filter(dl::message_key.eq(key))
        .order(dl::dead_lettered_at.desc())
        .select(dl::dead_lettered_at)
        .limit(1_i64)
}

#[auto_type]
fn claim_state(group: String, key: String) -> _ {
    ic::table
        .find((group, key))
        .select((ic::status, ic::payload_digest))
        .limit(1_i64)
}

#[auto_type]
fn mark_replayed(id: i64, now: Stamp) -> _ {
    let replayed: Option<Stamp> = Some(now);
    let one: i32 = 1;
    update(
        dl::table
            .find(id)
            .filter(dl::discarded_at.is_null())
            .filter(dl::replayed_at.is_null())
            .filter(dl::resolved_at.is_null()),
    )
    .set((
        dl::replay_count.eq(dl::replay_count + one),
        dl::replayed_at.eq(replayed),
    ))
}

#[auto_type]
fn discard(id: i64, now: Stamp) -> _ {
    let discarded: Option<Stamp> = Some(now);
    update(dl::table.find(id).filter(dl::discarded_at.is_null()))
        .set(dl::discarded_at.eq(discarded))
}

#[auto_type]
fn claims_by_key(key: String) -> _ {
    let columns: claim_columns = claim_columns();
    ic::table
        .filter(ic::message_key.eq(key))
        .order(ic::consumer_group)
        .select(columns)
}

#[auto_type]
fn touch_redriven(group: String, key: String, read_at: Stamp, now: Stamp) -> _ {
    let failed: &'static str = ClaimStatus::Failed.as_str();
    let due: Option<Stamp> = Some(now);
    update(
        ic::table
            .find((group, key))
            .filter(ic::status.eq(failed))
            .filter(ic::updated_at.eq(read_at))
            .filter(ic::payload.is_not_null()),
    )
    .set((ic::next_attempt_at.eq(due), ic::updated_at.eq(now)))
}

#[auto_type]
fn canary_arrivals(run: String) -> _ {
    cn::table.filter(cn::run_id.eq(run)).order(cn::seq).select((
        cn::seq,
        cn::sent_at,
        cn::arrived_at,
        cn::arrivals,
    ))
}

#[auto_type]
fn reset_dead_claim(claim: (String, String), digest: Vec<u8>, body: Vec<u8>, now: Stamp) -> _ {
    let dead: &'static str = ClaimStatus::Dead.as_str();
    let failed: &'static str = ClaimStatus::Failed.as_str();
    let none: i32 = 0;
    let due: Option<Stamp> = Some(now);
    let kept: Option<Vec<u8>> = Some(body);
    update(
        ic::table
            .find(claim)
            .filter(ic::status.eq(dead))
            .filter(ic::payload_digest.eq(digest)),
    )
    .set((
        ic::status.eq(failed),
        ic::attempts.eq(none),
        ic::starts.eq(none),
        ic::next_attempt_at.eq(due),
        ic::payload.eq(kept),
        ic::updated_at.eq(now),
    ))
}

/// A replay's outbox row, owned (see the module docs).
struct ReplayValues {
    key: String,
    routing_key: String,
    message_type: String,
    tenant: Option<String>,
    payload: Vec<u8>,
    headers: String,
    sequence: i32,
    now: Stamp,
}

#[auto_type]
fn replay_row(row: ReplayValues) -> _ {
    let key: String = row.key;
    let exchange: &'static str = "";
    let routing_key: String = row.routing_key;
    let message_type: String = row.message_type;
    let tenant: Option<String> = row.tenant;
    let payload: Vec<u8> = row.payload;
    let headers: String = row.headers;
    let now: Stamp = row.now;
    let no_attempts: i32 = 0;
    let sequence: i32 = row.sequence;
    insert_into(ob::table)
        .values((
            ob::message_key.eq(key),
            ob::exchange.eq(exchange),
            ob::routing_key.eq(routing_key),
            ob::message_type.eq(message_type),
            ob::tenant.eq(tenant),
            ob::payload.eq(payload),
            ob::headers.eq(headers),
            ob::created_at.eq(now),
            ob::available_at.eq(now),
            ob::attempts.eq(no_attempts),
            ob::replay_seq.eq(sequence),
        ))
        .returning(ob::id)
}

#[auto_type]
fn claim_counts() -> _ {
    ic::table
        .group_by((ic::consumer_group, ic::status))
        .select((ic::consumer_group, ic::status, count_star()))
        .order((ic::consumer_group, ic::status))
}

/// Failed claims per group, by the failed claims' partial index.
#[auto_type]
fn failed_counts() -> _ {
    let failed: &'static str = ClaimStatus::Failed.as_str();
    ic::table
        .filter(ic::status.eq(failed))
        .group_by(ic::consumer_group)
        .select((ic::consumer_group, count_star()))
}

#[auto_type]
fn due_counts(now: Stamp) -> _ {
    let failed: &'static str = ClaimStatus::Failed.as_str();
    ic::table
        .filter(ic::status.eq(failed))
        .filter(ic::next_attempt_at.le(now))
        .group_by(ic::consumer_group)
        .select((ic::consumer_group, count_star()))
}

#[auto_type]
fn oldest_retry(group: String) -> _ {
    let failed: &'static str = ClaimStatus::Failed.as_str();
    ic::table
        .filter(ic::status.eq(failed))
        .filter(ic::consumer_group.eq(group))
        .filter(ic::next_attempt_at.is_not_null())
        .order(ic::next_attempt_at)
        .select(ic::next_attempt_at)
        .limit(1_i64)
}

#[auto_type]
fn oldest_unfinished(group: String) -> _ {
    let unfinished: [&'static str; 2] =
        [ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()];
    ic::table
        .filter(ic::status.eq_any(unfinished))
        .filter(ic::consumer_group.eq(group))
        .order(ic::first_seen_at)
        .select(ic::first_seen_at)
        .limit(1_i64)
}

#[auto_type]
fn letter_counts() -> _ {
    dl::table
        .filter(dl::discarded_at.is_null())
        .filter(dl::replayed_at.is_null())
        .filter(dl::resolved_at.is_null())
        .group_by((dl::consumer_group, dl::reason))
        .select((dl::consumer_group, dl::reason, count_star()))
        .order((dl::consumer_group, dl::reason))
}

#[auto_type]
fn outbox_backlog() -> _ {
    ob::table
        .filter(ob::published_at.is_null())
        .filter(ob::dead_at.is_null())
        .select(count_star())
}

#[auto_type]
fn oldest_unpublished() -> _ {
    ob::table
        .filter(ob::published_at.is_null())
        .filter(ob::dead_at.is_null())
        .order(ob::created_at)
        .select(ob::created_at)
        .limit(1_i64)
}

#[auto_type]
fn dead_outbox_rows() -> _ {
    ob::table
        .filter(ob::published_at.is_null())
        .filter(ob::dead_at.is_not_null())
        .select(count_star())
}
