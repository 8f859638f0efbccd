//! The operator's statements, written once as diesel DSL: most are plain functions
//! generic over the connection (`shared.rs`, [`SharedOperatorOps`]); the ones a
//! generic function cannot bound readably stay in `operator_ops!`, expanded by each
//! backend (`pg/operator.rs`, `sqlite/operator.rs`): the filters' boxed queries
//! (`op_entries`, `op_redrivable`) and the upserts (`op_next_sequence`,
//! `op_record_canary`); see `shared.rs` for why. The catalog reads of the schema
//! check are each backend's own.

use chrono::{DateTime, Utc};
use diesel::result::QueryResult;

use super::shared::SharedOperatorOps;
use super::DeadLetterFilter;
use crate::backend::StoreConnection;

pub(crate) use super::activity::{ScanRow, ScanWindow, Tally};
pub(crate) use super::records::{
    EntryRow, FailureCount, FailureSample, Letter, NewReplay, Redrivable,
};

/// The operator statements every backend runs, on its own connection type.
pub trait OperatorOps: StoreConnection + SharedOperatorOps + crate::reports::ReportOps {
    /// Dead letters matching `filter`, newest first.
    #[doc(hidden)]
    fn op_entries(
        conn: &mut Self,
        filter: &DeadLetterFilter,
        limit: Option<i64>,
        offset: i64,
    ) -> QueryResult<Vec<EntryRow>>;

    /// Failure groups of the letters matching `filter`, one row per stored
    /// fingerprint (`None`: letters the backfill has not reached), reason and
    /// consumer group (see [`FailureCount`]).
    #[doc(hidden)]
    fn op_failure_counts(
        conn: &mut Self,
        filter: &DeadLetterFilter,
    ) -> QueryResult<Vec<FailureCount>>;

    /// The newest letters matching `filter` of a failure group (`None`: the letters
    /// without a stored one), of one stored reason when given.
    #[doc(hidden)]
    fn op_failure_samples(
        conn: &mut Self,
        filter: &DeadLetterFilter,
        fingerprint: Option<&str>,
        reason: Option<&str>,
        limit: i64,
    ) -> QueryResult<Vec<FailureSample>>;

    /// The consumer groups with claims or dead letters, by name (a loose index scan
    /// of each table: one probe per group).
    #[doc(hidden)]
    fn op_groups_present(conn: &mut Self) -> QueryResult<Vec<String>>;

    /// One group's bounded read of one tally (see `operator::activity`).
    #[doc(hidden)]
    fn op_activity_scan(
        conn: &mut Self,
        tally: Tally,
        group: &str,
        window: &ScanWindow,
    ) -> QueryResult<Vec<ScanRow>>;

    /// The next replay sequence of a message key: its counter row's, raised by one
    /// (the row is never purged, so a sequence never repeats for a key).
    #[doc(hidden)]
    fn op_next_sequence(conn: &mut Self, key: &str) -> QueryResult<i32>;

    /// Failed claims with a payload, due and unchanged since `cutoff`.
    #[doc(hidden)]
    fn op_redrivable(
        conn: &mut Self,
        group: Option<&str>,
        key: Option<&str>,
        cutoff: DateTime<Utc>,
        limit: i64,
    ) -> QueryResult<Vec<Redrivable>>;

    /// Records an arrival of a canary message.
    #[doc(hidden)]
    fn op_record_canary(
        conn: &mut Self,
        run: &str,
        seq: i32,
        sent_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> QueryResult<()>;
}

/// Narrows a boxed query of the letters view `$q` by a [`DeadLetterFilter`]: the one
/// place its fields become SQL, for the list and the failure groups alike.
/// The loose index scans that find the consumer groups, one per table: each step
/// asks the index for the first group name after the last one found. The same SQL on
/// both backends (a recursive CTE of scalar subqueries); each runs on an index whose
/// first column is `consumer_group`: `inbox_claims_done_by_group` (partial, `WHERE
/// status = 'done'`, on PostgreSQL; on SQLite its second column is the status) and
/// `inbox_dead_letters_by_group`. The claims' primary key starts with the message
/// key, so the claims' scan asks for done claims: a group whose claims are all still
/// started, failed or dead, and that has no letter, has no activity to show (the
/// overview finds failing groups by the failed claims' index). Without the status
/// condition PostgreSQL read every claim at each step (seconds on 10 M claims:
/// `benches/bench_console.rs`).
pub(crate) const GROUPS_PRESENT: &[&str] = &[
    "WITH RECURSIVE g(name) AS ( \
       SELECT (SELECT consumer_group FROM inbox_claims WHERE status = 'done' \
               ORDER BY consumer_group LIMIT 1) \
       UNION ALL \
       SELECT (SELECT c.consumer_group FROM inbox_claims c WHERE c.status = 'done' \
               AND c.consumer_group > g.name ORDER BY c.consumer_group LIMIT 1) \
         FROM g WHERE g.name IS NOT NULL \
     ) SELECT name FROM g WHERE name IS NOT NULL",
    "WITH RECURSIVE g(name) AS ( \
       SELECT (SELECT consumer_group FROM inbox_dead_letters ORDER BY consumer_group LIMIT 1) \
       UNION ALL \
       SELECT (SELECT d.consumer_group FROM inbox_dead_letters d WHERE d.consumer_group > g.name \
               ORDER BY d.consumer_group LIMIT 1) FROM g WHERE g.name IS NOT NULL \
     ) SELECT name FROM g WHERE name IS NOT NULL",
];

macro_rules! letter_filter {
    ($q:ident, $filter:expr) => {{
        use crate::operator::tables::op_dead_letters as l;
        let filter: &DeadLetterFilter = $filter;
        if let Some(g) = &filter.consumer_group {
            $q = $q.filter(l::consumer_group.eq(g.clone()));
        }
        if let Some(r) = filter.reason {
            $q = $q.filter(l::reason.eq(r.as_str()));
        }
        if let Some(t) = &filter.message_type {
            $q = $q.filter(l::message_type.eq(t.clone()));
        }
        if let Some(k) = &filter.message_key {
            $q = $q.filter(l::message_key.eq(k.clone()));
        }
        if let Some(fp) = &filter.failure_group {
            $q = $q.filter(l::failure_group.eq(fp.clone()));
        }
        // Within the years the stores hold: "since 10,000 years ago" is all.
        if let Some(since) = filter.since {
            $q = $q.filter(
                l::dead_lettered_at.ge(crate::schema::Stamp(inbox_core::stored_time(since))),
            );
        }
        if let Some(until) = filter.until {
            $q = $q.filter(
                l::dead_lettered_at.lt(crate::schema::Stamp(inbox_core::stored_time(until))),
            );
        }
        $q = match filter.status {
            None => $q.filter(l::discarded_at.is_null()),
            Some(LetterStatus::Pending) => $q
                .filter(l::discarded_at.is_null())
                .filter(l::resolved_at.is_null())
                .filter(l::replayed_at.is_null()),
            Some(LetterStatus::Replayed) => $q
                .filter(l::discarded_at.is_null())
                .filter(l::resolved_at.is_null())
                .filter(l::replayed_at.is_not_null()),
            Some(LetterStatus::Resolved) => $q
                .filter(l::discarded_at.is_null())
                .filter(l::resolved_at.is_not_null()),
            Some(LetterStatus::Discarded) => $q.filter(l::discarded_at.is_not_null()),
        };
    }};
}

pub(crate) use letter_filter;

macro_rules! operator_ops {
    ($conn:ty) => {
        impl OperatorOps for $conn {
            fn op_entries(
                conn: &mut Self,
                filter: &DeadLetterFilter,
                limit: Option<i64>,
                offset: i64,
            ) -> QueryResult<Vec<EntryRow>> {
                use crate::operator::tables::op_dead_letters::dsl::*;
                let mut q = op_dead_letters.into_boxed();
                crate::operator::ops::letter_filter!(q, filter);
                let mut q = q
                    .order((dead_lettered_at.desc(), id.desc()))
                    .offset(offset)
                    .select((
                        id,
                        consumer_group,
                        message_key,
                        message_type,
                        tenant,
                        headers,
                        attempts,
                        reason,
                        last_error,
                        dead_lettered_at,
                        replayed_at,
                        replay_count,
                        discarded_at,
                        resolved_at,
                        failure_group,
                    ));
                if let Some(limit) = limit {
                    q = q.limit(limit);
                } else if offset > 0 {
                    // SQLite allows OFFSET only after a LIMIT.
                    q = q.limit(i64::MAX);
                }
                q.load(conn)
            }

            fn op_failure_counts(
                conn: &mut Self,
                filter: &DeadLetterFilter,
            ) -> QueryResult<Vec<FailureCount>> {
                use crate::operator::tables::op_dead_letters::dsl::*;
                let mut q = op_dead_letters
                    .group_by((failure_group, reason, consumer_group))
                    .select((
                        failure_group,
                        reason,
                        consumer_group,
                        diesel::dsl::count_star(),
                        diesel::dsl::min(dead_lettered_at),
                        diesel::dsl::max(dead_lettered_at),
                    ))
                    .into_boxed();
                crate::operator::ops::letter_filter!(q, filter);
                q.load(conn)
            }

            fn op_failure_samples(
                conn: &mut Self,
                filter: &DeadLetterFilter,
                fingerprint: Option<&str>,
                stored_reason: Option<&str>,
                limit: i64,
            ) -> QueryResult<Vec<FailureSample>> {
                use crate::operator::tables::op_dead_letters::dsl::*;
                let mut q = op_dead_letters
                    .select((
                        id,
                        reason,
                        message_type,
                        last_error,
                        dead_lettered_at,
                        consumer_group,
                    ))
                    .order((dead_lettered_at.desc(), id.desc()))
                    .limit(limit)
                    .into_boxed();
                crate::operator::ops::letter_filter!(q, filter);
                q = match fingerprint {
                    Some(fp) => q.filter(failure_group.eq(fp.to_owned())),
                    None => q.filter(failure_group.is_null()),
                };
                if let Some(r) = stored_reason {
                    q = q.filter(reason.eq(r.to_owned()));
                }
                q.load(conn)
            }

            fn op_groups_present(conn: &mut Self) -> QueryResult<Vec<String>> {
                #[derive(diesel::QueryableByName)]
                struct Name {
                    #[diesel(sql_type = diesel::sql_types::Text)]
                    name: String,
                }
                let mut names = std::collections::BTreeSet::new();
                for sql in crate::operator::ops::GROUPS_PRESENT {
                    let found: Vec<Name> = diesel::sql_query(*sql).load(conn)?;
                    names.extend(found.into_iter().map(|n| n.name));
                }
                Ok(names.into_iter().collect())
            }

            fn op_activity_scan(
                conn: &mut Self,
                tally: Tally,
                group: &str,
                window: &ScanWindow,
            ) -> QueryResult<Vec<ScanRow>> {
                // The backend's own statement (`pg/operator.rs`, `sqlite/operator.rs`).
                activity_scan(conn, tally, group, window)
            }

            fn op_next_sequence(conn: &mut Self, key: &str) -> QueryResult<i32> {
                use crate::operator::tables::inbox_replay_sequences::dsl::*;
                // One row per key, raised under its row lock: two replays of one key
                // (in two groups) take two numbers, and a purge of the outbox rows
                // that carried the earlier ones leaves the counter where it was.
                diesel::insert_into(inbox_replay_sequences)
                    .values((message_key.eq(key), last_seq.eq(1)))
                    .on_conflict(message_key)
                    .do_update()
                    .set(last_seq.eq(last_seq + 1))
                    .returning(last_seq)
                    .get_result(conn)
            }

            fn op_redrivable(
                conn: &mut Self,
                group: Option<&str>,
                key: Option<&str>,
                cutoff: DateTime<Utc>,
                limit: i64,
            ) -> QueryResult<Vec<Redrivable>> {
                use crate::schema::inbox_claims::dsl::*;
                let mut q = inbox_claims
                    .filter(status.eq(crate::ClaimStatus::Failed.as_str()))
                    .filter(payload.is_not_null())
                    .filter(next_attempt_at.le(crate::schema::Stamp(cutoff)))
                    .filter(updated_at.le(crate::schema::Stamp(cutoff)))
                    .into_boxed();
                if let Some(g) = group {
                    q = q.filter(consumer_group.eq(g.to_owned()));
                }
                if let Some(k) = key {
                    q = q.filter(message_key.eq(k.to_owned()));
                }
                let rows: Vec<(
                    String,
                    String,
                    String,
                    Option<String>,
                    Option<Vec<u8>>,
                    DateTime<Utc>,
                )> = q
                    .order((next_attempt_at, message_key))
                    .limit(limit)
                    .select((
                        consumer_group,
                        message_key,
                        message_type,
                        tenant,
                        payload,
                        updated_at,
                    ))
                    .load(conn)?;
                Ok(rows
                    .into_iter()
                    .filter_map(|r| {
                        Some(Redrivable {
                            group: r.0,
                            key: r.1,
                            message_type: r.2,
                            tenant: r.3,
                            payload: r.4?,
                            updated_at: r.5,
                        })
                    })
                    .collect())
            }

            fn op_record_canary(
                conn: &mut Self,
                run: &str,
                number: i32,
                sent: DateTime<Utc>,
                now: DateTime<Utc>,
            ) -> QueryResult<()> {
                use crate::operator::tables::inbox_canary::dsl::*;
                diesel::insert_into(inbox_canary)
                    .values((
                        run_id.eq(run),
                        seq.eq(number),
                        sent_at.eq(crate::schema::Stamp(sent)),
                        arrived_at.eq(crate::schema::Stamp(now)),
                        arrivals.eq(1),
                    ))
                    .on_conflict((run_id, seq))
                    .do_update()
                    .set(arrivals.eq(arrivals + 1))
                    .execute(conn)
                    .map(|_| ())
            }
        }
    };
}

pub(crate) use operator_ops;
